"""The C++ batch manager: requests, KV cache accounting, sequence slots and the two schedulers.

Names and semantics follow TensorRT-LLM's batch manager (snake_case); the specification, with the
places where we differ, is ``docs/batch-manager.md``. Pure-Python twins with the same interface and
decisions live in :mod:`inflight.batch_manager.reference`.
"""

from __future__ import annotations

from inflight._C import (
    DEFAULT_RETENTION_PRIORITY,
    DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY,
    PRIMARY_LEVEL,
    SECONDARY_LEVEL,
    CapacityScheduler,
    CapacitySchedulerPolicy,
    ContextChunkingConfig,
    ContextChunkingPolicy,
    FinishReason,
    KVCacheManager,
    KvCacheStats,
    KvTransferKind,
    LlmRequest,
    LlmRequestState,
    MicroBatchScheduler,
    RequestList,
    SequenceSlotManager,
)

__all__ = [
    "DEFAULT_RETENTION_PRIORITY",
    "DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY",
    "PRIMARY_LEVEL",
    "SECONDARY_LEVEL",
    "CapacityScheduler",
    "CapacitySchedulerPolicy",
    "ContextChunkingConfig",
    "ContextChunkingPolicy",
    "FinishReason",
    "KVCacheManager",
    "KvCacheStats",
    "KvTransferKind",
    "LlmRequest",
    "LlmRequestState",
    "MicroBatchScheduler",
    "RequestList",
    "SequenceSlotManager",
]
