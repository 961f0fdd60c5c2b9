"""Pure-Python twins of the C++ batch-manager components: the executable specification.

Each class here has the interface of its C++ counterpart in ``inflight._C`` (same constructor
arguments, method and property names, return shapes and exception types) and takes the same bound
``LlmRequest`` objects, so it can stand in for the C++ class anywhere. ``tests/python/test_twins.py``
drives the C++ classes and these twins with the same random traces and asserts identical decisions
step by step. Semantics: ``docs/batch-manager.md`` (TensorRT-LLM's, with the differences listed
there).

One module per C++ source file in ``csrc/batch_manager/``:

* :mod:`~inflight.batch_manager.reference.common`: state-window helpers (``common.cpp``)
* :mod:`~inflight.batch_manager.reference.kv_cache_manager`: ``KVCacheManager``
* :mod:`~inflight.batch_manager.reference.sequence_slot_manager`: ``SequenceSlotManager``
* :mod:`~inflight.batch_manager.reference.capacity_scheduler`: ``CapacityScheduler``
* :mod:`~inflight.batch_manager.reference.micro_batch_scheduler`: ``MicroBatchScheduler``

``LlmRequest`` (``llm_request.cpp``) has no twin: both sides use the bound class. The twins import
only the bound enums and constants of :mod:`inflight.batch_manager`, the standard library and numpy.

Exceptions: ``ValueError`` for bad arguments and unknown request ids (C++ ``std::invalid_argument``),
``RuntimeError`` for running out of KV blocks and for failed integrity checks.

Written for clarity, not speed: the twins favour the obvious data structure over the fast one.
"""

from __future__ import annotations

from inflight.batch_manager import DEFAULT_RETENTION_PRIORITY
from inflight.batch_manager.reference.capacity_scheduler import CapacityScheduler
from inflight.batch_manager.reference.kv_cache_manager import KVCacheManager
from inflight.batch_manager.reference.micro_batch_scheduler import MicroBatchScheduler
from inflight.batch_manager.reference.sequence_slot_manager import SequenceSlotManager

__all__ = [
    "DEFAULT_RETENTION_PRIORITY",
    "CapacityScheduler",
    "KVCacheManager",
    "MicroBatchScheduler",
    "SequenceSlotManager",
]
