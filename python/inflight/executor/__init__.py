"""The Python executor: the step loop (:class:`PyExecutor`), its components (scheduler, resource
managers, model engine, sampler), the factory that assembles them from :class:`~inflight.llm_args.LlmArgs`,
and the scheduling simulator. This package re-exports the scheduling interfaces users implement."""

from __future__ import annotations

from inflight.executor.scheduler import (
    BindCapacityScheduler,
    BindMicroBatchScheduler,
    CapacityScheduler,
    MicroBatchScheduler,
    RequestScheduler,
    ScheduledRequests,
    SimpleScheduler,
)

__all__ = [
    "BindCapacityScheduler",
    "BindMicroBatchScheduler",
    "CapacityScheduler",
    "MicroBatchScheduler",
    "RequestScheduler",
    "ScheduledRequests",
    "SimpleScheduler",
]
