"""Preemption: what a request paused by the capacity scheduler does with its KV cache, and when a
swapped-out one comes back (``SchedulerConfig.preemption_mode``; docs/batch-manager.md §3.9, §5.4).

- ``"recompute"`` (the default, TensorRT-LLM's too): the executor frees the request's blocks and
  turns it into a fresh prefill of its prompt and output so far (``LlmRequest.pause``).
- ``"swap"``: the request's private blocks move to the KV manager's secondary level
  (``suspend_sequence``); it keeps its state, tokens, position and sequence slot, and stays in the
  active list at its place. Before each schedule, :meth:`Preemption.schedulable` resumes it
  (``resume_sequence``, the onboard transfers run in the next ``prepare_resources``) once the free
  primary blocks cover its blocks and next step plus the next step of every request ahead of it; it
  then decodes on from where it stopped, with no second prefill. A request the secondary level has no
  room for is recomputed instead (logged once).

Invariants (checked by the executor tests): a request is swapped out exactly when its KV sequence is
suspended (the KV manager is the only record: ``is_suspended``). The schedulers never see a
swapped-out request, nor any request behind it in the active list: MAX_UTILIZATION lets no request
overtake a paused one (§5.4), and a victim is the started request nearest the end, so everything
behind a swapped-out request is swapped out too or has not started.
"""

from __future__ import annotations

import logging
from typing import Any

from inflight.batch_manager import RequestList
from inflight.llm_args import PREEMPTION_MODES

logger = logging.getLogger("inflight")


class Preemption:
    """``mode`` (:data:`PREEMPTION_MODES`) over the KV resource manager ``kv`` (may be None: then every
    pause recomputes). ``two_steps_lookahead``: plan two tokens per request when resuming, as the
    capacity scheduler of an overlap executor does (else a resumed request may be paused again at once)."""

    def __init__(self, mode: str = "recompute", kv: Any = None, two_steps_lookahead: bool = False) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {list(PREEMPTION_MODES)}, got {mode!r}")
        if mode == "swap" and (kv is None or getattr(kv, "secondary", None) is None):
            raise ValueError(
                "preemption_mode='swap' needs a KV cache with a secondary tier (KvCacheConfig.host_cache_size)"
            )
        self.mode = mode
        self.kv = kv
        self.two_steps_lookahead = two_steps_lookahead
        self.num_swapped_out = 0
        self.num_swapped_in = 0
        self.num_recomputed = 0  # pauses that recomputed (with swap: the tier had no room)
        self._warned = False

    def swap_out(self, request) -> bool:
        """With swap, suspends the paused ``request``'s KV; False: recompute it (the caller frees it)."""
        if self.mode == "swap":
            if self.kv.suspend(request):
                self.num_swapped_out += 1
                return True
            if not self._warned:
                impl = self.kv.impl
                logger.warning(
                    "request %d: the secondary KV tier has no room to swap it out (needs %d blocks, %d free "
                    "of %d); it will be recomputed (logged once: later fallbacks only count in the stats)",
                    request.request_id,
                    impl.get_needed_secondary_blocks_to_suspend(request.request_id),
                    impl.num_free_secondary_blocks,
                    impl.num_secondary_blocks,
                )
                self._warned = True
        self.num_recomputed += 1
        return False

    def schedulable(self, active):
        """``active`` for the schedulers: swapped-out requests resumed in list order while they fit
        (see the module doc), the list cut before the first that stays out; ``active`` itself when none
        is swapped out."""
        kv = self.kv
        if kv is None or kv.impl.num_suspended_sequences == 0:
            return active
        impl = kv.impl
        shown, planned = [], 0  # planned: next-step blocks of the requests ahead
        for req in active:
            rid = req.request_id
            step = impl.get_needed_blocks_one_step(req, self.two_steps_lookahead)
            if impl.is_suspended(rid):
                # num_free_blocks already went down by what the requests resumed before took.
                if planned + step + impl.get_needed_blocks_to_resume(rid) > impl.num_free_blocks:
                    return RequestList(shown)
                kv.resume(req)
                self.num_swapped_in += 1
            planned += step
            shown.append(req)
        return active

    def stats(self) -> dict[str, int]:
        """Counts since start, for the iteration stats."""
        return {
            "num_swapped_out": self.num_swapped_out,
            "num_swapped_in": self.num_swapped_in,
            "num_recomputed": self.num_recomputed,
            "num_swapped_requests": self.kv.impl.num_suspended_sequences if self.kv is not None else 0,
        }
