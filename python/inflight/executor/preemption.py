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

Beam requests (``ExecutorRequest.py_beam``) are never recomputed (folding K beams into one prompt
would change the search). With swap, all K beam sequences are suspended together and resumed together
(the beam state lives on the request: positions, scores and hypotheses are untouched). The blocks the
beams share stay in the primary pool while it is out (the KV manager moves private blocks only), so a
beam request is swapped out only when that leaves every request able to finish
(:meth:`beam_swap_is_safe`). When the tier has no room for all of them, or the swap is not safe, the
request is not paused at all: :meth:`unswappable` names it, and the
executor schedules again with it at the front of the list, so that other requests make room for it
(py_executor.py, ``_schedule_batch``). Without swap the LLM refuses beam requests under MAX_UTILIZATION.

Invariants (checked by the executor tests): a request is swapped out exactly when its KV sequence is
suspended (the KV manager is the only record: ``is_suspended``). The schedulers never see a
swapped-out request, nor any request behind it in the active list that holds no KV: MAX_UTILIZATION
lets no request overtake a paused one (§5.4), and a victim is the started request nearest the end, so
everything behind a swapped-out request is swapped out too or has not started, except a beam request
the tier had no room for (rescheduled at the front, see above): a request that holds primary KV is
never hidden, since its blocks could be what the swapped-out one waits for.
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
        self.num_beams_kept = 0  # pauses of beam requests the tier had no room for: kept instead
        self.num_beams_restarted = 0  # kept beam requests restarted from their prompt (last resort)
        self.active = ()  # the executor's active requests (it sets its list here): beam_swap_is_safe
        self._warned = False

    def swap_out(self, request) -> bool:
        """With swap, suspends the paused ``request``'s KV (every beam of a beam request, when
        :meth:`beam_swap_is_safe` over the executor's ``active`` list); False: recompute it (the caller
        frees it), or, for a beam request, keep it running (never recomputed)."""
        beam = getattr(request, "py_beam", None) is not None
        if self.mode == "swap":
            if (not beam or self.beam_swap_is_safe(request, self.active)) and self.kv.suspend(request):
                self.num_swapped_out += 1
                return True
            if beam:
                self.num_beams_kept += 1
                return False
            if not self._warned:
                impl = self.kv.impl
                logger.warning(
                    "request %d: the secondary KV tier has no room to swap it out (needs %d blocks, %d free "
                    "of %d); it will be recomputed (logged once: later fallbacks only count in the stats)",
                    request.request_id,
                    self.kv.blocks_to_suspend(request),
                    impl.num_free_secondary_blocks,
                    impl.num_secondary_blocks,
                )
                self._warned = True
        if not beam:
            self.num_recomputed += 1
        return False

    def unswappable(self, paused, active) -> set[int]:
        """The ids of the beam requests among ``paused`` (in the order the executor pauses them) that
        cannot be swapped out: the secondary tier would have no room for them once the requests before
        them are swapped out, or their swap is not safe (:meth:`beam_swap_is_safe`)."""
        if self.mode != "swap" or not any(getattr(r, "py_beam", None) is not None for r in paused):
            return set()
        kv = self.kv
        impl = kv.impl
        free, stuck, extra = impl.num_free_secondary_blocks, set(), set()
        for req in paused:
            rid = req.request_id
            if not impl.has_sequence(rid) or impl.is_suspended(rid):
                continue
            need = kv.blocks_to_suspend(req)
            beam = getattr(req, "py_beam", None) is not None
            if need <= free and (not beam or self.beam_swap_is_safe(req, active, extra)):
                free -= need
                if beam:
                    extra |= self._staying_blocks(req)
            elif beam:
                stuck.add(rid)
        return stuck

    def _staying_blocks(self, request) -> set[int]:
        """The primary blocks a suspended beam request keeps in the primary pool: those its beams share
        (the KV manager moves only a sequence's private blocks)."""
        impl, first = self.kv.impl, self.kv.num_blocks
        seen: dict[int, int] = {}
        for sid in self.kv.sequences(request):
            if impl.has_sequence(sid):
                for b in impl.get_block_ids(sid):
                    if b < first:
                        seen[b] = seen.get(b, 0) + 1
        return {b for b, m in seen.items() if m > 1}

    def _total_blocks(self, request) -> int:
        """The blocks ``request`` holds at its end (its prompt's full blocks shared by its beams)."""
        tpb = self.kv.tokens_per_block
        total = min(-(-(request.prompt_len + request.max_new_tokens) // tpb), -(-self.kv.max_seq_len // tpb))
        k = request.beam_width
        shared = min(request.prompt_len // tpb, total)
        return shared + (total - shared) * k if k > 1 else total

    def beam_swap_is_safe(self, request, active, also=frozenset()) -> bool:
        """Whether swapping out beam request ``request`` leaves every request able to finish. The blocks
        its beams share stay in the primary pool while it is out, as do those of the beam requests
        already out (and ``also``: of those about to go), so swapping is safe only while every active
        request's blocks at its end, plus all those staying blocks but its own, fit the pool. Otherwise
        two swapped-out beam requests could hold the pool between them and neither come back."""
        impl = self.kv.impl
        staying = set(also) | self._staying_blocks(request)
        own: dict[int, set[int]] = {request.request_id: self._staying_blocks(request)}
        for req in active:
            if req.request_id != request.request_id and impl.is_suspended(req.request_id):
                mine = self._staying_blocks(req)
                own[req.request_id] = mine
                staying |= mine
        for req in active:
            if getattr(req, "py_done", False):
                continue
            if self._total_blocks(req) + len(staying - own.get(req.request_id, set())) > self.kv.num_blocks:
                return False
        return True

    def step_blocks(self, request) -> int:
        """The primary blocks ``request``'s next step takes: the planner's count, plus a beam request's
        copy-on-write blocks (``KVCacheResourceManager.beam_copy_blocks``)."""
        n = self.kv.impl.get_needed_blocks_one_step(request, self.two_steps_lookahead)
        if getattr(request, "py_beam", None) is not None:
            n += self.kv.beam_copy_blocks(request)
        return n

    def schedulable(self, active):
        """``active`` for the schedulers: swapped-out requests resumed in list order while they fit
        (see the module doc), the list cut before the first that stays out (requests behind the cut that
        hold primary KV stay); ``active`` itself when none is swapped out."""
        kv = self.kv
        if kv is None or kv.impl.num_suspended_sequences == 0:
            return active
        impl = kv.impl
        shown, planned, cut = [], 0, False  # planned: next-step blocks of the requests ahead
        for req in active:
            rid = req.request_id
            if cut:
                if impl.has_sequence(rid) and not impl.is_suspended(rid):
                    shown.append(req)
                continue
            step = self.step_blocks(req)
            if impl.is_suspended(rid):
                # num_free_blocks already went down by what the requests resumed before took.
                if planned + step + kv.blocks_to_resume(req) > impl.num_free_blocks:
                    cut = True
                    continue
                kv.resume(req)
                self.num_swapped_in += 1
            planned += step
            shown.append(req)
        return RequestList(shown) if cut else active

    def stats(self) -> dict[str, int]:
        """Counts since start, for the iteration stats."""
        return {
            "num_swapped_out": self.num_swapped_out,
            "num_swapped_in": self.num_swapped_in,
            "num_recomputed": self.num_recomputed,
            "num_beams_kept": self.num_beams_kept,
            "num_beams_restarted": self.num_beams_restarted,
            "num_swapped_requests": self.kv.impl.num_suspended_sequences if self.kv is not None else 0,
        }
