"""Pure-Python twin of ``CapacityScheduler``: ``csrc/batch_manager/capacity_scheduler.cpp`` and
``csrc/include/inflight/batch_manager/capacity_scheduler.h``.

One class behind which sit TensorRT-LLM's capacity schedulers: MaxRequests (no KV cache manager
given), GuaranteedNoEvict, StaticBatch and MaxUtilization. It decides which active requests may
hold KV memory this step and, under MAX_UTILIZATION, which started requests are paused to make
room.

Data and its invariants:

* The scheduler owns only its configuration, validated in ``__init__`` and read-only afterwards;
  ``schedule`` keeps nothing between calls.
* ``schedule`` borrows the requests and the KV cache manager (C++ or twin). It changes no request;
  the only KV state it touches is the planning count (``start_scheduling`` and
  ``scheduling_remove_sequence``, MAX_UTILIZATION only).
* ``fitting`` holds at most ``max_num_requests`` requests of ``active_requests``, all within the
  state window, each once. Without a KV cache manager and under MAX_UTILIZATION it keeps their
  order; under GUARANTEED_NO_EVICT and STATIC_BATCH the generating requests come first, then the
  others admitted, each group in list order. ``paused`` is non-empty only under MAX_UTILIZATION,
  disjoint from ``fitting``, and holds started requests in the order they were chosen as victims
  (from the back of the list towards the front).
* The duplicate-prefill marks of one call are a set of block keys; each request adds at most one.

Semantics: ``docs/batch-manager.md``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Any

from inflight.batch_manager import CapacitySchedulerPolicy, LlmRequestState
from inflight.batch_manager.reference.common import check_window, in_window

if TYPE_CHECKING:
    from inflight.batch_manager import LlmRequest

__all__ = ["CapacityScheduler"]

_CAPACITY_POLICIES = (
    CapacitySchedulerPolicy.MAX_UTILIZATION,
    CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
    CapacitySchedulerPolicy.STATIC_BATCH,
)


class CapacityScheduler:
    """Which active requests may hold KV memory this step, and which are paused."""

    def __init__(
        self,
        max_num_requests: int,
        policy: Any = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
        no_schedule_until_state: Any = LlmRequestState.CONTEXT_INIT,
        no_schedule_after_state: Any = LlmRequestState.GENERATION_COMPLETE,
        two_steps_lookahead: bool = False,
    ) -> None:
        if max_num_requests < 1:
            raise ValueError(f"max_num_requests must be >= 1, got {max_num_requests}")
        check_window(no_schedule_until_state, no_schedule_after_state)
        if policy not in _CAPACITY_POLICIES:
            raise ValueError(
                f"policy must be MAX_UTILIZATION, GUARANTEED_NO_EVICT or STATIC_BATCH, got {policy}"
            )
        self._max_num_requests = max_num_requests
        self._policy = policy
        self._no_schedule_until_state = no_schedule_until_state
        self._no_schedule_after_state = no_schedule_after_state
        self._two_steps_lookahead = bool(two_steps_lookahead)

    @property
    def max_num_requests(self) -> int:
        return self._max_num_requests

    @property
    def policy(self) -> CapacitySchedulerPolicy:
        return self._policy

    @property
    def no_schedule_until_state(self) -> LlmRequestState:
        return self._no_schedule_until_state

    @property
    def no_schedule_after_state(self) -> LlmRequestState:
        return self._no_schedule_after_state

    @property
    def two_steps_lookahead(self) -> bool:
        return self._two_steps_lookahead

    def schedule(
        self,
        active_requests: Iterable[LlmRequest],
        kv_cache_manager: Any,
        window_managers: Iterable[Any] = (),
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        """(fitting, paused), ordered as the module docstring says: ``fitting`` in list order
        (generating requests first under the no-evict policies), ``paused`` in victim order.
        ``window_managers``: the KV managers of the sliding-window layers (VSWA), each with its own
        pool; a request fits only where it fits in every pool (the duplicate-prefill marks and the
        reuse checks are ``kv_cache_manager``'s)."""
        active = list(active_requests)
        if kv_cache_manager is None:
            return self._schedule_max_requests(active), []
        managers = [kv_cache_manager, *window_managers]
        if self.policy == CapacitySchedulerPolicy.MAX_UTILIZATION:
            return self._schedule_max_utilization(active, managers)
        static_batch = self.policy == CapacitySchedulerPolicy.STATIC_BATCH
        return self._schedule_no_evict(active, managers, static_batch), []

    def _in_window(self, request: LlmRequest) -> bool:
        return in_window(request, self.no_schedule_until_state, self.no_schedule_after_state)

    def _schedule_max_requests(self, active: list[LlmRequest]) -> list[LlmRequest]:
        return [r for r in active if self._in_window(r)][: self.max_num_requests]

    def _delays_duplicate_prefills(self, kv: Any) -> bool:
        return kv.enable_block_reuse and self.policy != CapacitySchedulerPolicy.STATIC_BATCH

    def _blocks_in_production(self, active: list[LlmRequest], kv: Any) -> set[Hashable]:
        """First new blocks of the contexts already past their first chunk (being produced)."""
        marked = set()
        for r in active:
            if self._in_window(r) and r.is_context_init_state and not r.is_first_context_chunk:
                key = kv.find_new_context_block(r)
                if key is not None:
                    marked.add(key)
        return marked

    @staticmethod
    def _is_duplicate_prefill(r: LlmRequest, kv: Any, marked: set[Hashable]) -> bool:
        """For a context on its first chunk: its first new block is being produced by another
        request (skip it this step); else marks that block as produced by this one."""
        if not (r.is_context_init_state and r.is_first_context_chunk):
            return False
        key = kv.find_new_context_block(r)
        if key in marked:
            return True
        if key is not None:
            marked.add(key)
        return False

    def _schedule_no_evict(
        self, active: list[LlmRequest], managers: list[Any], static_batch: bool
    ) -> list[LlmRequest]:
        kv = managers[0]
        marked = self._blocks_in_production(active, kv) if self._delays_duplicate_prefills(kv) else None
        scheduled: list[LlmRequest] = []
        pending: list[LlmRequest] = []
        reserved_blocks = [0] * len(managers)
        # Generating requests are always kept and reserve what they need to finish.
        for r in active:
            if not self._in_window(r):
                continue
            if len(scheduled) >= self.max_num_requests:
                break
            if r.is_generation_in_progress_state:
                scheduled.append(r)
                for j, m in enumerate(managers):
                    reserved_blocks[j] += m.get_remaining_blocks_to_completion(r)
            else:
                pending.append(r)
        any_generating = bool(scheduled)

        available_blocks = [m.num_free_blocks - reserved for m, reserved in zip(managers, reserved_blocks)]
        # The others in order, while they fit; the first that does not stops admission.
        for r in pending:
            if len(scheduled) >= self.max_num_requests:
                break
            if marked is not None and self._is_duplicate_prefill(r, kv, marked):
                continue
            if static_batch and any_generating and r.is_context_init_state and r.is_first_context_chunk:
                break
            needed_blocks = [m.get_remaining_blocks_to_completion(r) for m in managers]
            if any(n > a for n, a in zip(needed_blocks, available_blocks)):
                break
            scheduled.append(r)
            available_blocks = [a - n for a, n in zip(available_blocks, needed_blocks)]
        return scheduled

    def _is_started(self, r: LlmRequest) -> bool:
        return self._in_window(r) and (
            (r.is_context_init_state and not r.is_first_context_chunk) or r.is_generation_in_progress_state
        )

    def _schedule_max_utilization(
        self, active: list[LlmRequest], managers: list[Any]
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        kv = managers[0]
        for m in managers:
            m.start_scheduling()
        marked = self._blocks_in_production(active, kv) if self._delays_duplicate_prefills(kv) else None
        scheduled: list[LlmRequest] = []
        paused: list[LlmRequest] = []
        scheduled_blocks = [0] * len(managers)
        end = len(active)  # requests from `end` on were paused (the victim and all behind it)
        i = 0
        while i < end:
            r = active[i]
            if not self._in_window(r) or (marked is not None and self._is_duplicate_prefill(r, kv, marked)):
                i += 1
                continue
            needed_blocks = [m.get_needed_blocks_one_step(r, self.two_steps_lookahead) for m in managers]
            while not (
                len(scheduled) < self.max_num_requests
                and all(
                    s + n <= m.scheduling_num_free_blocks
                    for s, n, m in zip(scheduled_blocks, needed_blocks, managers)
                )
            ):
                # Pause the last started request among r and those behind it, then try r again.
                victim = next((j for j in range(end - 1, i - 1, -1) if self._is_started(active[j])), None)
                if victim is None:
                    return scheduled, paused
                for m in managers:
                    m.scheduling_remove_sequence(active[victim].request_id)
                paused.append(active[victim])
                end = victim
                if victim == i:
                    return scheduled, paused
            scheduled.append(r)
            scheduled_blocks = [s + n for s, n in zip(scheduled_blocks, needed_blocks)]
            i += 1
        return scheduled, paused
