"""The scheduling simulator: the real :class:`~inflight.executor.py_executor.PyExecutor`, step by step,
over a scripted model engine instead of a model.

Scheduling, KV accounting, preemption, chunked prefill, stop conditions and freeing are the
executor's own code, run on the caller's thread (no worker); only the forward is scripted: every row
whose logits are sampled gets a one-hot row at ``token_fn(request_id, position)`` (``position``: the
index the new token takes in the request's tokens), which the greedy sampler turns into that token.
Because a token depends only on its position, a paused and recomputed request ends with exactly the
tokens it would have had unpaused.

Used by ``examples/``, the tests of user-written schedulers, and anyone who wants to see what a
scheduler decides without a model::

    kv = KVCacheManager(num_blocks=40, tokens_per_block=16, max_seq_len=1024)
    sim = SchedulingSimulator(SimpleScheduler(BindCapacityScheduler(4, kv), BindMicroBatchScheduler(4, 512)), kv)
    sim.add_request(LlmRequest(0, 8, prompt_ids))
    records = sim.run()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from inflight.batch_manager import LlmRequest, RequestList
from inflight.executor.llm_request import ExecutorRequest, Response
from inflight.executor.model_engine import ModelInputs
from inflight.executor.py_executor import PyExecutor
from inflight.executor.resource_manager import KVCacheResourceManager, ResourceManager, SeqSlotManager
from inflight.executor.sampler import Sampler, SamplingState
from inflight.executor.scheduler import RequestScheduler, ScheduledRequests
from inflight.layers.attention import AttentionMetadata
from inflight.sampling_params import SamplingParams

__all__ = ["SchedulingSimulator", "StepRecord", "default_token_fn"]

# The scripted vocabulary: token_fn's values must be below it.
VOCAB_SIZE = 32000


def default_token_fn(request_id: int, position: int) -> int:
    return (request_id * 7919 + position * 104729) % VOCAB_SIZE


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


class _ScriptedModelEngine:
    """The model engine's interface (prepare / forward / store_new_tokens / shutdown) without a model."""

    def __init__(self, kv: KVCacheResourceManager, token_fn: Callable[[int, int], int]):
        self.kv = kv
        self.token_fn = token_fn
        self.last_block_tables = np.zeros((0, kv.impl.max_blocks_per_seq), dtype=np.int32)

    def prepare(self, batch: ScheduledRequests, pending_ids: Any = frozenset()) -> ModelInputs:
        requests = batch.all_requests
        tables = np.zeros((max(len(requests), 1), self.kv.impl.max_blocks_per_seq), dtype=np.int32)
        self.kv.copy_block_tables(RequestList(requests), tables)
        self.last_block_tables = tables[: len(requests)]
        sampled, positions, seq_lens = [], [], []
        for req in batch.context_requests:
            seq_lens.append(req.context_chunk_size)
            if req.is_last_context_chunk:
                sampled.append(req)
                positions.append(req.prompt_len)
        for req in batch.generation_requests:
            seq_lens.append(1)
            sampled.append(req)
            positions.append(req.num_tokens)
        n = len(seq_lens)
        zeros = torch.zeros(n, dtype=torch.int32)
        meta = AttentionMetadata(
            num_contexts=len(batch.context_requests),
            num_tokens=sum(seq_lens),
            tokens_per_block=self.kv.tokens_per_block,
            seq_lens=zeros,
            cu_seqlens=torch.zeros(n + 1, dtype=torch.int32),
            kv_lens=zeros,
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.zeros(0, dtype=torch.int64),
            block_tables=torch.from_numpy(self.last_block_tables),
            logits_indices=torch.zeros(0, dtype=torch.int64),
            seq_lens_host=tuple(seq_lens),
            kv_lens_host=tuple(seq_lens),
        )
        slots = torch.tensor([r.seq_slot for r in sampled], dtype=torch.int64)
        return ModelInputs(torch.zeros(meta.num_tokens, dtype=torch.int64), meta, sampled, slots)

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        logits = torch.zeros(len(inputs.sampled_requests), VOCAB_SIZE)
        for row, (req, pos) in enumerate(zip(inputs.sampled_requests, inputs.metadata.positions.tolist())):
            logits[row, self.token_fn(req.request_id, pos)] = 1.0
        return logits

    def store_new_tokens(self, inputs: ModelInputs, token_ids: torch.Tensor) -> None:
        """Nothing to keep: the simulator runs without overlap."""

    def shutdown(self) -> None:
        pass


class _RecordingScheduler(RequestScheduler):
    """The user's scheduler, with each step's decision kept for the step record (chunk sizes are
    read here: the step moves every context to its next chunk)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.last: ScheduledRequests | None = None
        self.last_chunk_sizes: list[int] = []
        self.last_num_tokens = 0

    def schedule_request(self, active_requests, inflight_request_ids) -> ScheduledRequests:
        self.last = self.inner.schedule_request(active_requests, inflight_request_ids)
        self.last_chunk_sizes = [r.context_chunk_size for r in self.last.context_requests]
        self.last_num_tokens = self.last.num_tokens
        return self.last


class SchedulingSimulator:
    """Drives a :class:`~inflight.executor.scheduler.RequestScheduler` and a KV cache manager (the C++
    one or its twin; the one the scheduler was built with) through the real executor loop.

    ``max_input_len``: the length a paused request's prompt is capped at (default the KV manager's
    ``max_seq_len``, which also ends a request as "length"). Every request is greedy and stops after
    its ``max_new_tokens`` (no EOS in the scripted vocabulary).
    """

    def __init__(
        self,
        scheduler: Any,
        kv_cache_manager: Any,
        max_input_len: int | None = None,
        token_fn: Callable[[int, int], int] = default_token_fn,
        check_integrity: bool = True,
        max_num_active_requests: int = 1 << 20,
    ):
        self.kv = kv_cache_manager
        self.check_integrity = check_integrity
        self._kv_resource = KVCacheResourceManager(kv_cache_manager)
        self._engine = _ScriptedModelEngine(self._kv_resource, token_fn)
        self._scheduler = _RecordingScheduler(scheduler)
        self._responses: list[Response] = []
        resources = ResourceManager(
            {
                "seq_slot_manager": SeqSlotManager(max_num_active_requests),
                "kv_cache_manager": self._kv_resource,
            }
        )
        self.executor = PyExecutor(
            self._engine,
            resources,
            self._scheduler,
            Sampler(VOCAB_SIZE),
            max_seq_len=max_input_len if max_input_len is not None else kv_cache_manager.max_seq_len,
            max_num_active_requests=max_num_active_requests,
            disable_overlap_scheduler=True,
            response_callback=self._responses.extend,
            start_worker=False,
        )
        self._params = SamplingParams(temperature=0.0)
        self._requests: dict[int, ExecutorRequest] = {}
        self.finished: list[ExecutorRequest] = []
        self.num_steps = 0

    def add_request(self, request: LlmRequest) -> ExecutorRequest:
        """Queues a request like ``request`` (id, prompt, max_new_tokens, priority); returns the executor
        request that runs (and ends up in :attr:`finished`)."""
        ids = request.get_tokens()
        state = SamplingState.create(self._params, VOCAB_SIZE, ids)
        req = ExecutorRequest(
            request.request_id, ids, request.max_new_tokens, state, priority=request.priority
        )
        self._requests[req.request_id] = req
        self.executor.enqueue_request(req)
        return req

    @property
    def idle(self) -> bool:
        return self.executor.is_idle

    def step(self) -> StepRecord:
        self._scheduler.last = None
        self._engine.last_block_tables = self._engine.last_block_tables[:0]
        self.executor.step()
        done = [r for r in self._responses if r.finished]
        self._responses.clear()
        for resp in done:
            if resp.error is not None:
                raise RuntimeError(f"request {resp.request_id} failed in the simulated step: {resp.error}")
            self.finished.append(self._requests.pop(resp.request_id))
        if self.check_integrity:
            self.kv.check_integrity()
        scheduled = self._scheduler.last
        out = scheduled if scheduled is not None else ScheduledRequests()
        self.num_steps += 1
        return StepRecord(
            step=self.num_steps - 1,
            context_ids=[r.request_id for r in out.context_requests],
            context_chunk_sizes=list(self._scheduler.last_chunk_sizes) if scheduled is not None else [],
            generation_ids=[r.request_id for r in out.generation_requests],
            paused_ids=[r.request_id for r in out.paused_requests],
            finished_ids=[r.request_id for r in done],
            num_tokens=self._scheduler.last_num_tokens if scheduled is not None else 0,
            num_free_blocks=self.kv.num_free_blocks,
            block_tables=self._engine.last_block_tables[: len(out)],
        )

    def run(self, max_steps: int = 100_000) -> list[StepRecord]:
        """Steps until every request finished; raises if the schedule stalls for max_steps."""
        records = []
        while not self.idle:
            if len(records) >= max_steps:
                raise RuntimeError(f"simulation did not finish within max_steps={max_steps}")
            records.append(self.step())
        return records
