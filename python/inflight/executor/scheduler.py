"""Scheduler interfaces that users can implement in Python, and wrappers of the C++ schedulers.

The executor asks one :class:`RequestScheduler` per step for its :class:`ScheduledRequests`: the step
object that every later stage (resource managers, model engine, stats) reads. The usual
one is :class:`SimpleScheduler`, which chains a :class:`CapacityScheduler` (who may hold KV memory;
who is paused) and a :class:`MicroBatchScheduler` (who runs in this forward pass, with which context
chunk). Either half can be the C++ implementation (``BindCapacityScheduler``,
``BindMicroBatchScheduler``), its pure-Python twin (``reference=True``) or a class of your own::

    class ShortestPromptFirst(CapacityScheduler):
        def schedule_request(self, active_requests):
            ...
            return fitting, paused

    scheduler = SimpleScheduler(ShortestPromptFirst(...), BindMicroBatchScheduler(max_batch_size=8))

Requests are :class:`inflight.batch_manager.LlmRequest` objects (or Python subclasses); every
scheduler returns the same objects it was given.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inflight import batch_manager as bm
from inflight.batch_manager import (
    CapacitySchedulerPolicy,
    ContextChunkingConfig,
    LlmRequest,
    LlmRequestState,
)
from inflight.batch_manager import reference as reference_impl
from inflight.llm_args import EnumRule

RequestSeq = Sequence[LlmRequest]


@dataclass
class ScheduledRequests:
    """One step: the context chunks and decode steps that run in this forward (contexts first, in
    scheduling order), the requests paused to make room, and how many the capacity scheduler let hold
    KV memory. Built by the scheduler, read by every later stage of the step."""

    context_requests: RequestSeq = field(default_factory=list)
    generation_requests: RequestSeq = field(default_factory=list)
    paused_requests: RequestSeq = field(default_factory=list)
    num_fitting_requests: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)

    def __len__(self) -> int:
        return self.batch_size

    @property
    def all_requests(self) -> list[LlmRequest]:
        """The requests of the forward: contexts, then generations."""
        return [*self.context_requests, *self.generation_requests]

    @property
    def num_tokens(self) -> int:
        """Tokens this step's forward processes (context chunks + one per decode + drafts)."""
        n = sum(r.context_chunk_size for r in self.context_requests)
        n += sum(r.num_draft_tokens for r in self.context_requests if r.is_last_context_chunk)
        n += sum(r.beam_width + r.num_draft_tokens for r in self.generation_requests)
        return n


class CapacityScheduler(abc.ABC):
    """Decides which active requests may hold KV memory this step and which are paused."""

    @abc.abstractmethod
    def schedule_request(self, active_requests: RequestSeq) -> tuple[RequestSeq, RequestSeq]:
        """Returns ``(fitting_requests, paused_requests)``, both made of the given objects.

        ``active_requests`` is in priority order (descending, FIFO within equal priority). A paused
        request has its KV blocks freed by the executor and is recomputed later.
        """


class MicroBatchScheduler(abc.ABC):
    """Decides which fitting requests run in this forward pass (and sets their context chunk sizes)."""

    @abc.abstractmethod
    def schedule(
        self, active_requests: RequestSeq, inflight_request_ids: set[int]
    ) -> tuple[RequestSeq, RequestSeq]:
        """Returns ``(context_requests, generation_requests)``; skips ``inflight_request_ids``."""


class RequestScheduler(abc.ABC):
    """The executor's single scheduling entry point."""

    @abc.abstractmethod
    def schedule_request(
        self, active_requests: RequestSeq, inflight_request_ids: set[int]
    ) -> ScheduledRequests:
        """Returns this step's :class:`ScheduledRequests`."""


class SimpleScheduler(RequestScheduler):
    """Capacity scheduling, then micro-batch scheduling over the fitting requests."""

    def __init__(self, capacity_scheduler: CapacityScheduler, micro_batch_scheduler: MicroBatchScheduler):
        if not isinstance(capacity_scheduler, CapacityScheduler):
            raise TypeError(
                f"capacity_scheduler must be a CapacityScheduler, got {type(capacity_scheduler).__name__}"
            )
        if not isinstance(micro_batch_scheduler, MicroBatchScheduler):
            raise TypeError(
                f"micro_batch_scheduler must be a MicroBatchScheduler, got {type(micro_batch_scheduler).__name__}"
            )
        self.capacity_scheduler = capacity_scheduler
        self.micro_batch_scheduler = micro_batch_scheduler

    def schedule_request(
        self, active_requests: RequestSeq, inflight_request_ids: set[int]
    ) -> ScheduledRequests:
        fitting, paused = self.capacity_scheduler.schedule_request(active_requests)
        context, generation = self.micro_batch_scheduler.schedule(fitting, inflight_request_ids)
        return ScheduledRequests(context, generation, paused, len(fitting))


class BindCapacityScheduler(CapacityScheduler):
    """The C++ :class:`inflight.batch_manager.CapacityScheduler` (or its twin with ``reference=True``).

    ``kv_cache_manager`` is the accounting :class:`inflight.batch_manager.KVCacheManager` (or None:
    then only ``max_num_requests`` limits). ``window_managers``: the KV managers of the sliding-window
    layers, each with its own pool (C++ managers for the C++ scheduler, twins for the twin); a request
    fits only where it fits in every pool (docs/batch-manager.md §5.6).
    """

    def __init__(
        self,
        max_num_requests: int,
        kv_cache_manager: Any,
        policy: CapacitySchedulerPolicy | str = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
        two_steps_lookahead: bool = False,
        no_schedule_until_state: LlmRequestState = LlmRequestState.CONTEXT_INIT,
        no_schedule_after_state: LlmRequestState = LlmRequestState.GENERATION_COMPLETE,
        reference: bool = False,
        window_managers: Sequence[Any] = (),
    ):
        cls = reference_impl.CapacityScheduler if reference else bm.CapacityScheduler
        self.impl = cls(
            max_num_requests,
            EnumRule(CapacitySchedulerPolicy).check("capacity_scheduler_policy", policy),
            no_schedule_until_state,
            no_schedule_after_state,
            two_steps_lookahead,
        )
        self.kv_cache_manager = kv_cache_manager
        # VSWA: the sliding-window layers' managers; a request fits where it fits in every pool.
        self.window_managers = list(window_managers)

    def schedule_request(self, active_requests: RequestSeq) -> tuple[RequestSeq, RequestSeq]:
        return self.impl.schedule(active_requests, self.kv_cache_manager, self.window_managers)


class BindMicroBatchScheduler(MicroBatchScheduler):
    """The C++ :class:`inflight.batch_manager.MicroBatchScheduler` with the step's limits bound in.

    ``max_num_tokens=None`` means no token budget; ``ctx_chunk_config=None`` means no chunking.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_num_tokens: int | None = None,
        ctx_chunk_config: ContextChunkingConfig | None = None,
        max_context_length: int | None = None,
        no_schedule_until_state: LlmRequestState = LlmRequestState.CONTEXT_INIT,
        no_schedule_after_state: LlmRequestState = LlmRequestState.GENERATION_TO_COMPLETE,
        reference: bool = False,
    ):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if max_num_tokens is not None and (not isinstance(max_num_tokens, int) or max_num_tokens < 1):
            raise ValueError(f"max_num_tokens must be None or an integer >= 1, got {max_num_tokens!r}")
        cls = reference_impl.MicroBatchScheduler if reference else bm.MicroBatchScheduler
        self.impl = cls(
            ctx_chunk_config, max_context_length, no_schedule_until_state, no_schedule_after_state
        )
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens

    def schedule(
        self, active_requests: RequestSeq, inflight_request_ids: Iterable[int]
    ) -> tuple[RequestSeq, RequestSeq]:
        ids = inflight_request_ids if isinstance(inflight_request_ids, set) else set(inflight_request_ids)
        return self.impl.schedule(active_requests, ids, self.max_batch_size, self.max_num_tokens)
