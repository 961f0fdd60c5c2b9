"""Pure-Python twin of ``MicroBatchScheduler``: ``csrc/batch_manager/micro_batch_scheduler.cpp``
and ``csrc/include/inflight/batch_manager/micro_batch_scheduler.h``.

Picks, among the requests the capacity scheduler let hold KV memory, those that run in this
forward pass: a batch-size limit, a token budget, context chunking (FIRST_COME_FIRST_SERVED or
EQUAL_PROGRESS) and the fitting of draft tokens into the last chunk. ``ContextChunkingConfig`` is
the bound class; the twin has none of its own.

Data and its invariants:

* The scheduler owns only its configuration (the chunking config, ``max_context_length`` and the
  state window), validated in ``__init__``; ``schedule`` keeps nothing between calls.
* ``schedule`` borrows the requests and writes to them: ``context_chunk_size`` of every context it
  takes (with chunking, also of contexts whose chunk ends at 0) and, through ``fit_draft_tokens``,
  the tail of their draft tokens. It changes nothing else.
* Both returned lists are subsequences of the input in its order. With a token budget, the
  returned chunks, their draft tokens and the generation costs add up to at most
  ``max_num_tokens``; with chunking, no returned context has a chunk of 0.

Semantics: ``docs/batch-manager.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from inflight.batch_manager import ContextChunkingPolicy, LlmRequestState
from inflight.batch_manager.reference.common import check_window, in_window

if TYPE_CHECKING:
    from inflight.batch_manager import ContextChunkingConfig, LlmRequest

__all__ = ["MicroBatchScheduler"]


class MicroBatchScheduler:
    """Which fitting requests run in this forward pass, with their context chunk sizes."""

    def __init__(
        self,
        ctx_chunk_config: ContextChunkingConfig | None = None,
        max_context_length: int | None = None,
        no_schedule_until_state: Any = LlmRequestState.CONTEXT_INIT,
        no_schedule_after_state: Any = LlmRequestState.GENERATION_TO_COMPLETE,
    ) -> None:
        if max_context_length is not None and max_context_length < 1:
            raise ValueError(f"max_context_length must be >= 1, got {max_context_length}")
        check_window(no_schedule_until_state, no_schedule_after_state)
        self._ctx_chunk_config = ctx_chunk_config
        self._max_context_length = max_context_length
        self._no_schedule_until_state = no_schedule_until_state
        self._no_schedule_after_state = no_schedule_after_state

    @property
    def ctx_chunk_config(self) -> ContextChunkingConfig | None:
        return self._ctx_chunk_config

    @property
    def max_context_length(self) -> int | None:
        return self._max_context_length

    def schedule(
        self,
        active_requests: Iterable[LlmRequest],
        inflight_request_ids: Iterable[int],
        max_batch_size: int,
        max_num_tokens: int | None,
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        """(context_requests, generation_requests); sets chunk sizes and may shorten draft tokens."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_num_tokens is not None and max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        inflight = set(inflight_request_ids)
        chunking = self.ctx_chunk_config
        max_ctx = self.max_context_length

        context: list[LlmRequest] = []
        generation: list[LlmRequest] = []
        to_chunk: list[LlmRequest] = []  # contexts collected for chunking, in order
        batch_num_tokens = 0  # generation requests and unchunked contexts
        chunked_num_tokens = 0  # collected contexts: whole remaining prompt (+ drafts on a last chunk)
        all_context_fits = True
        num_scheduled = 0
        for r in active_requests:
            if r.request_id in inflight or not in_window(
                r, self._no_schedule_until_state, self._no_schedule_after_state
            ):
                continue
            if r.is_context_init_state:
                if chunking is None:
                    num_tokens = r.context_remaining_length + r.num_draft_tokens
                    if max_ctx is not None and num_tokens > max_ctx:
                        raise ValueError(
                            f"context of request {r.request_id} has {num_tokens} tokens, more than "
                            f"max_context_length {max_ctx} (enable context chunking)"
                        )
                    if max_num_tokens is not None and batch_num_tokens + num_tokens > max_num_tokens:
                        break
                    batch_num_tokens += num_tokens
                    r.set_context_chunk_size(r.context_remaining_length)
                    context.append(r)
                else:
                    r.set_context_chunk_size(r.context_remaining_length)
                    num_draft = r.num_draft_tokens if r.is_last_context_chunk and r.has_draft_tokens else 0
                    num_tokens = r.context_chunk_size + num_draft
                    if max_ctx is not None and num_tokens > max_ctx:
                        all_context_fits = False
                    to_chunk.append(r)
                    chunked_num_tokens += num_tokens
            else:
                num_tokens = r.beam_width + r.num_draft_tokens
                if max_num_tokens is not None and batch_num_tokens + num_tokens > max_num_tokens:
                    break
                batch_num_tokens += num_tokens
                generation.append(r)
            num_scheduled += 1
            if num_scheduled >= max_batch_size:
                break

        if chunking is not None and to_chunk:
            if max_num_tokens is not None and chunked_num_tokens > max_num_tokens - batch_num_tokens:
                all_context_fits = False
            capacity = max_num_tokens - batch_num_tokens if max_num_tokens is not None else None
            if not all_context_fits:
                self.set_ctx_requests_chunk_size(
                    to_chunk, chunking.chunking_policy, capacity, chunking.chunk_unit_size, max_ctx
                )
            self.fit_draft_tokens(to_chunk, capacity, chunking.chunk_unit_size, max_ctx)
            context = [r for r in to_chunk if r.context_chunk_size > 0]
        return context, generation

    @staticmethod
    def set_ctx_requests_chunk_size(
        contexts_to_be_chunked: Sequence[LlmRequest],
        policy: Any,
        ctx_tokens_capacity: int | None,
        chunk_unit_size: int,
        max_context_length: int | None,
    ) -> None:
        """Chunk sizes by policy for contexts that do not all fit whole (all reset to 0 first)."""
        if chunk_unit_size < 1:
            raise ValueError(f"chunk_unit_size must be >= 1, got {chunk_unit_size}")
        for r in contexts_to_be_chunked:
            r.set_context_chunk_size(0)
        capacity = ctx_tokens_capacity
        max_ctx = max_context_length
        if policy == ContextChunkingPolicy.EQUAL_PROGRESS:
            num_ctx_tokens = 0
            num_tokens_grown = 1
            while (capacity is None or num_ctx_tokens < capacity) and num_tokens_grown > 0:
                num_tokens_grown = 0
                for r in contexts_to_be_chunked:
                    past_chunk = r.context_chunk_size
                    r.set_context_chunk_size(past_chunk + chunk_unit_size)  # clamps to what remains
                    increment = r.context_chunk_size - past_chunk
                    if (capacity is not None and num_ctx_tokens + increment > capacity) or (
                        max_ctx is not None and r.context_chunk_size > max_ctx
                    ):
                        r.set_context_chunk_size(past_chunk)
                        continue
                    num_ctx_tokens += increment
                    num_tokens_grown += increment
        elif policy == ContextChunkingPolicy.FIRST_COME_FIRST_SERVED:
            for r in contexts_to_be_chunked:
                remaining = r.context_remaining_length
                chunk = remaining
                if capacity is not None:
                    chunk = min(capacity, chunk)
                if max_ctx is not None:
                    chunk = min(max_ctx, chunk)
                if chunk != remaining:
                    chunk = chunk // chunk_unit_size * chunk_unit_size
                r.set_context_chunk_size(chunk)
                if capacity is not None:
                    capacity -= r.context_chunk_size
        else:
            raise ValueError(f"policy must be FIRST_COME_FIRST_SERVED or EQUAL_PROGRESS, got {policy}")

    @staticmethod
    def fit_draft_tokens(
        contexts_to_be_chunked: Sequence[LlmRequest],
        ctx_tokens_capacity: int | None,
        chunk_unit_size: int,
        max_context_length: int | None,
    ) -> None:
        """Drops the draft tokens of last chunks that would cost an extra unit or pass a limit."""
        num_used = sum(r.context_chunk_size for r in contexts_to_be_chunked)
        for r in contexts_to_be_chunked:
            if not (r.is_last_context_chunk and r.has_draft_tokens):
                continue
            chunk = r.context_chunk_size
            # Room left in the last unit: drafts never start a new unit (so never a new KV block).
            room = (chunk_unit_size - chunk % chunk_unit_size) % chunk_unit_size
            if max_context_length is not None:
                room = min(room, max_context_length - chunk)
            if ctx_tokens_capacity is not None:
                room = min(room, ctx_tokens_capacity - num_used)
            room = max(room, 0)
            num_draft = r.num_draft_tokens
            num_used += min(room, num_draft)
            if room < num_draft:
                r.truncate_draft_tokens(room)
