"""A model-free executor loop for the batch manager: scheduling, KV accounting and preemption.

Each step runs the executor's order (schedule -> free and pause the paused -> prepare resources
(``add_sequence`` / ``add_token``) -> block tables -> "forward" -> update states -> free finished)
with a fake model: a context chunk just advances, and every request that produces a token gets
``token_fn(request_id, position)``. Because that token depends only on the position, a paused and
recomputed request ends with exactly the tokens it would have had unpaused.

Used by the demo, the examples and the tests of user schedulers; the real executor follows the same
order with a model in place of ``token_fn``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inflight.batch_manager import LlmRequest, LlmRequestState, RequestList


def default_token_fn(request_id: int, position: int) -> int:
    return (request_id * 7919 + position * 104729) % 32000


@dataclass
class StepRecord:
    """What one step decided: ids in scheduling order, chunk sizes, and the KV state after it."""

    step: int
    context_ids: list[int]
    context_chunk_sizes: list[int]
    generation_ids: list[int]
    paused_ids: list[int]
    finished_ids: list[int]
    num_tokens: int
    num_free_blocks: int
    block_tables: np.ndarray = field(repr=False)


class SchedulingSimulator:
    """Drives a :class:`~inflight.executor.scheduler.RequestScheduler` and a KV cache manager."""

    def __init__(
        self,
        scheduler: Any,
        kv_cache_manager: Any,
        max_input_len: int | None = None,
        token_fn: Callable[[int, int], int] = default_token_fn,
        check_integrity: bool = True,
    ):
        self.scheduler = scheduler
        self.kv = kv_cache_manager
        self.max_input_len = max_input_len if max_input_len is not None else kv_cache_manager.max_seq_len
        self.token_fn = token_fn
        self.check_integrity = check_integrity
        self.active = RequestList()
        self.finished: list[LlmRequest] = []
        self.num_steps = 0

    def add_request(self, request: LlmRequest) -> None:
        self.active.insert_by_priority(request)

    @property
    def idle(self) -> bool:
        return len(self.active) == 0

    def step(self) -> StepRecord:
        out = self.scheduler.schedule_request(self.active, set())
        for req in out.paused_requests:
            self.kv.remove_sequence(req.request_id, req)
            req.pause(self.max_input_len)
        for req in out.context_requests:
            if req.is_first_context_chunk and not self.kv.has_sequence(req.request_id):
                self.kv.add_sequence(req.request_id, req.prompt_len, 1, req)
        for req in out.generation_requests:
            self.kv.add_token(req.request_id)
        batch = list(out.context_requests) + list(out.generation_requests)
        tables = np.zeros((max(len(batch), 1), self.kv.max_blocks_per_seq), dtype=np.int32)
        self.kv.copy_block_tables([r.request_id for r in batch], tables)
        chunk_sizes = [r.context_chunk_size for r in out.context_requests]
        num_tokens = out.num_tokens

        done: list[LlmRequest] = []
        for req in out.context_requests:
            last = req.is_last_context_chunk
            req.move_to_next_context_chunk()
            if last:
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                self.kv.store_context_blocks(req)
                self._emit(req, done)
        for req in out.generation_requests:
            self._emit(req, done)
        for req in done:
            req.state = LlmRequestState.GENERATION_COMPLETE
            self.kv.remove_sequence(req.request_id, req)
        if done:
            self.active.remove_ids({r.request_id for r in done})
            self.finished.extend(done)
        if self.check_integrity:
            self.kv.check_integrity()
        self.num_steps += 1
        return StepRecord(
            step=self.num_steps - 1,
            context_ids=[r.request_id for r in out.context_requests],
            context_chunk_sizes=chunk_sizes,
            generation_ids=[r.request_id for r in out.generation_requests],
            paused_ids=[r.request_id for r in out.paused_requests],
            finished_ids=[r.request_id for r in done],
            num_tokens=num_tokens,
            num_free_blocks=self.kv.num_free_blocks,
            block_tables=tables[: len(batch)],
        )

    def run(self, max_steps: int = 100_000) -> list[StepRecord]:
        """Steps until every request finished; raises if the schedule stalls for max_steps."""
        records = []
        while not self.idle:
            if len(records) >= max_steps:
                raise RuntimeError(f"simulation did not finish within max_steps={max_steps}")
            records.append(self.step())
        return records

    def _emit(self, req: LlmRequest, done: list[LlmRequest]) -> None:
        req.add_new_token(self.token_fn(req.request_id, req.num_tokens))
        # pause() folds generated tokens into the prompt and shrinks max_new_tokens by as much, so
        # this is also "generated since arrival >= the original max_new_tokens".
        if req.num_generated_tokens >= req.max_new_tokens:
            done.append(req)
