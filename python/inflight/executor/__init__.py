"""The Python executor: scheduling interfaces (and, as they land, the step loop and its components)."""

from __future__ import annotations

from inflight.executor.scheduler import (
    BindCapacityScheduler,
    BindMicroBatchScheduler,
    CapacityScheduler,
    MicroBatchScheduler,
    RequestScheduler,
    SchedulerOutput,
    SimpleScheduler,
)

__all__ = [
    "BindCapacityScheduler",
    "BindMicroBatchScheduler",
    "CapacityScheduler",
    "MicroBatchScheduler",
    "RequestScheduler",
    "SchedulerOutput",
    "SimpleScheduler",
]
