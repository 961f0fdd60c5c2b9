"""PyExecutor: the step loop on a worker thread.

One iteration, in order: fetch new requests (queue -> waiting -> active; cancels) -> schedule
(capacity, then micro-batch; swapped-out requests come back first, preemption.py) -> free (or swap
out) and pause what was paused -> prepare resources -> forward -> sample -> update request states
(advance chunks, context -> generation) -> append tokens and check stop conditions -> responses ->
free finished requests -> update resources (store context blocks for reuse) -> iteration stats.

Overlap mode (``disable_overlap_scheduler=False``): step N's forward is launched (on a second
thread) before the host work of step N-1, which then runs while N computes. N's decode inputs come
from the device buffer of newest tokens that N-1's sampling wrote, by sequence slot (no host round
trip); a request that met a stop condition at N-1 but was already scheduled into N has its step-N
token discarded, and is freed only once N is done.

Speculative decoding (:mod:`inflight.executor.speculative`, with a :class:`Speculator`): placeholder
drafts before scheduling, real drafts after it, verification after sampling, the KV cache rewound
by the drafts that were not kept. Overlap mode is off while speculating.

The loop runs on a worker thread (:meth:`start_worker`, by default at construction). Without one,
:meth:`step` runs one iteration on the caller's thread: the scheduling simulator drives the executor
that way, step by step.

Failure handling: an exception in forward or sampling fails the requests of that batch
(``finish_reason="error"``), frees them, and the loop goes on, unless the error is marked ``fatal``
(a rank of a parallel engine died): then, as when the loop itself dies, every waiter gets an error
and later calls raise at once. :meth:`PyExecutor.fail` does the same from another thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from inflight.batch_manager import FinishReason, LlmRequestState, RequestList
from inflight.executor.guided_decoder import GuidedDecoder, apply_masks
from inflight.executor.llm_request import ExecutorRequest, Response, format_iteration_stats, request_metrics
from inflight.executor.model_engine import ModelEngine, ModelInputs
from inflight.executor.preemption import Preemption
from inflight.executor.resource_manager import KVCacheResourceManager, ResourceManager
from inflight.executor.sampler import LogprobRows, Sampler, SamplerOutput, prompt_logprob_entries
from inflight.executor.scheduler import RequestScheduler, ScheduledRequests
from inflight.executor.speculative import Speculator
from inflight.executor.timeline import Timelines

logger = logging.getLogger("inflight")


@dataclass(frozen=True)
class _Cancel:
    """Queue item: cancel these requests (wherever they are), in one pass however many."""

    request_ids: frozenset[int]


class _Fatal:
    """Queued by :meth:`PyExecutor.fail`: the loop raises ``error`` (and so dies)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Shutdown:
    """Queue item: finish everything queued before this, then stop."""


class _Wake:
    """Queue item: something finished off the loop (a grammar compiled): look again."""


@dataclass(frozen=True)
class _Arrivals:
    """Queue item: requests submitted together (:meth:`PyExecutor.arrivals`), taken in one pass."""

    requests: tuple[ExecutorRequest, ...]


@dataclass
class _InFlight:
    """A launched step whose host work (tokens, stop checks, responses) is not done yet."""

    batch: ScheduledRequests
    inputs: ModelInputs
    future: Any = None  # overlap: the forward's Future; pipeline: the launched micro-batch's handle
    output: SamplerOutput | None = None
    processed: set[int] = field(default_factory=set)  # request ids whose token was taken
    prompts_taken: set[int] = field(default_factory=set)  # ... whose prompt logprobs were taken
    finished_contexts: list = field(default_factory=list)  # pipeline: contexts whose last chunk ran

    def pending_ids(self) -> set[int]:
        """Requests whose token of this step is sampled but not appended on the host yet."""
        return {r.request_id for r in self.inputs.sampled_requests} - self.processed


class PyExecutor:
    def __init__(
        self,
        model_engine: ModelEngine,
        resource_manager: ResourceManager,
        scheduler: RequestScheduler,
        sampler: Sampler,
        *,
        max_seq_len: int,
        max_num_active_requests: int,
        disable_overlap_scheduler: bool = True,
        response_callback: Callable[[list[Response]], None] | None = None,
        stats_window: int = 1024,
        log_stats_every: int = 0,
        start_worker: bool = True,
        stats_extra: dict | None = None,
        pipeline_depth: int = 1,
        speculator: Speculator | None = None,
        guided_decoder: GuidedDecoder | None = None,
        preemption: Preemption | None = None,
    ):
        self.model_engine = model_engine
        # What a paused request does with its KV (recompute / swap), and when a swapped one returns.
        self.preemption = preemption if preemption is not None else Preemption()
        self.resource_manager = resource_manager
        self.scheduler = scheduler
        self.sampler = sampler
        self.max_seq_len = max_seq_len
        self.max_num_active_requests = max_num_active_requests
        if speculator is not None and speculator.drafter is not None and not disable_overlap_scheduler:
            logger.info("overlap scheduler off: speculative decoding verifies each step before the next")
            disable_overlap_scheduler = True
        self.overlap = not disable_overlap_scheduler
        # In overlap mode the next step is planned before this one's tokens are known: no drafting
        # there (a request's prediction is then ignored).
        self.speculator = speculator if not self.overlap else None
        # Structured output: grammars compile off the loop; their requests wait here until then.
        self.guided = guided_decoder
        self._compiling: list[tuple[ExecutorRequest, concurrent.futures.Future]] = []
        self.log_stats_every = log_stats_every
        self._stats_extra = dict(stats_extra or {})  # constant keys of every stats entry
        self.timelines = Timelines()  # the recent requests' timelines (the engine dashboard)
        self._responses: queue.Queue[Response] = queue.Queue()
        # Called once per iteration with that iteration's responses, in order.
        self._callback = response_callback or self._put_responses
        self._queue: queue.Queue = queue.Queue()
        self._arriving = threading.local()  # per thread: the requests an open arrivals() holds back
        self._waiting: collections.deque[ExecutorRequest] = collections.deque()
        self.active = RequestList()
        self.preemption.active = self.active  # the list it checks a beam request's swap against
        self._deferred_free: list[ExecutorRequest] = []
        self._prev: _InFlight | None = None
        # Pipeline parallelism: up to pipeline_depth micro-batches launched and not yet collected, oldest
        # first (a request is in at most one of them).
        self.pipeline_depth = max(1, int(pipeline_depth))
        if self.pipeline_depth > 1:
            disable_overlap_scheduler = True
        self._pipeline: collections.deque[_InFlight] = collections.deque()
        # This step's scheduled list (in the order the scheduler saw it) and the beam requests chosen as
        # victims that could not be swapped out (kept): read by _fit_beams.
        self._order = None
        self._kept: list[ExecutorRequest] = []
        self._stats: collections.deque[dict] = collections.deque(maxlen=stats_window)
        self._iter = 0
        # The last time an iteration finished or the loop found nothing to do (stall_seconds).
        self._last_progress = time.monotonic()
        # The stats already show the engine as it went idle (it starts idle: nothing to record).
        self._idle_recorded = True
        self._step_num_tokens = 0
        self._micro_batches = 0  # pipeline: micro-batches in flight after this iteration's launch
        self._outbox: list[Response] = []
        self._error: BaseException | None = None
        self._closing = False  # no new requests accepted
        self._draining = False  # the loop saw the shutdown marker: stop once idle
        self._lock = threading.Lock()
        self._forward_pool = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="inflight-forward")
            if self.overlap
            else None
        )
        self._thread: threading.Thread | None = None
        if start_worker:
            self.start_worker()

    def start_worker(self) -> None:
        """Runs the loop on a worker thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="inflight-executor", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ public API (any thread)
    def enqueue_request(self, request: ExecutorRequest) -> int:
        with self._lock:
            self._check_alive()
            held = getattr(self._arriving, "requests", None)
            if held is not None:
                held.append(request)
            else:
                self._queue.put(request)
        return request.request_id

    @contextlib.contextmanager
    def arrivals(self):
        """Requests this thread enqueues inside the block reach the loop together when it ends, so the
        first step that sees one sees all of them: an offline batch (``LLM.generate``) or the ``n``
        sequences of one request get the same schedule however fast the caller submits them (the loop
        would otherwise start on the first while the rest are still being prepared). Nested blocks
        join the outermost one. Cancels this thread sends inside the block follow the requests. If the
        engine died or shut down meanwhile, the held requests end with that error (their waiters get
        it) and the block raises it."""
        outer = getattr(self._arriving, "requests", None) is None
        if outer:
            self._arriving.requests, self._arriving.cancels = [], []
        try:
            yield
        finally:
            if outer:
                held, cancels = self._arriving.requests, self._arriving.cancels
                self._arriving.requests = self._arriving.cancels = None
                self._release_arrivals(held, cancels)

    def _release_arrivals(self, held: list[ExecutorRequest], cancels: list[_Cancel]) -> None:
        dead = None
        with self._lock:
            try:
                self._check_alive()
            except RuntimeError as exc:
                dead = exc
            else:
                if held:
                    self._queue.put(_Arrivals(tuple(held)))
                for c in cancels:
                    self._queue.put(c)
        if dead is not None and held:
            # Never queued: the loop will not answer them, so answer here (the loop's lists untouched).
            error = str(dead)
            self._callback(
                [
                    Response(r.request_id, [], 0, finished=True, finish_reason="error", error=error)
                    for r in held
                ]
            )
            raise dead

    def cancel_request(self, request_id: int) -> None:
        self.cancel_requests((request_id,))

    def cancel_requests(self, request_ids) -> None:
        """Cancels requests wherever they are (queued, waiting, running); unknown ids are ignored."""
        with self._lock:
            if self._error is None and not self._closing:
                held = getattr(self._arriving, "requests", None)
                if held is not None:  # after the requests this thread holds back (they may be among them)
                    self._arriving.cancels.append(_Cancel(frozenset(request_ids)))
                else:
                    self._queue.put(_Cancel(frozenset(request_ids)))

    def fail(self, error: BaseException) -> None:
        """Kills the engine from any thread (e.g. a parallel rank died while idle): the loop raises
        ``error``, every queued and running request ends with it, later calls raise."""
        self._queue.put(_Fatal(error))

    def _put_responses(self, responses: list[Response]) -> None:
        for resp in responses:
            self._responses.put(resp)

    def await_responses(self, timeout: float | None = None) -> list[Response]:
        """Responses gathered so far (at least one, unless ``timeout`` passes); only when the
        executor was built without a response callback."""
        out = []
        try:
            out.append(self._responses.get(timeout=timeout))
            while True:
                out.append(self._responses.get_nowait())
        except queue.Empty:
            pass
        return out

    def get_stats(self) -> list[dict]:
        return list(self._stats)

    @property
    def kv_cache_manager(self) -> KVCacheResourceManager | None:
        return self.resource_manager.get("kv_cache_manager")

    @property
    def is_alive(self) -> bool:
        return self._error is None and (self._thread is None or self._thread.is_alive())

    @property
    def stall_seconds(self) -> float:
        """Seconds since the loop last finished an iteration while work is pending; 0 when idle. A
        liveness signal: a step that never returns, or a loop that stopped stepping, makes it grow."""
        if self.is_idle:
            return 0.0
        return max(time.monotonic() - self._last_progress, 0.0)

    @property
    def is_idle(self) -> bool:
        """No request queued, waiting, running or in flight."""
        return (
            len(self.active) == 0 and not self._waiting and self._nothing_in_flight() and self._queue.empty()
        )

    def _nothing_in_flight(self) -> bool:
        return self._prev is None and not self._pipeline

    def shutdown(self, timeout: float | None = None) -> None:
        """Finishes every queued and running request, then stops the loop and frees memory."""
        with self._lock:
            if not self._closing:
                self._closing = True
                self._queue.put(_Shutdown())
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            while self.step():
                pass
        if self._forward_pool is not None:
            self._forward_pool.shutdown(wait=True)
        if self.speculator is not None:
            self.speculator.shutdown()
        if self.guided is not None:
            self.guided.shutdown()
        self.resource_manager.shutdown()
        self.model_engine.shutdown()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the executor loop died: {self._error!r}") from self._error
        if self._closing:
            raise RuntimeError("the executor is shut down")

    # ------------------------------------------------------------------ the loop
    def step(self, block: bool = False) -> bool:
        """One iteration of the loop; False once a shutdown has drained everything. ``block``: wait
        for a request while idle (the worker thread does)."""
        if not self._fetch_new_requests(block):
            return False
        if self.pipeline_depth > 1:
            self._step_pipeline()
        elif self.overlap:
            self._step_overlap()
        else:
            self._step()
        self._flush_responses()
        return True

    def _loop(self) -> None:
        try:
            while self.step(block=True):
                pass
        except BaseException as exc:  # noqa: BLE001  (the loop must report any death)
            logger.error("executor loop died:\n%s", traceback.format_exc())
            with self._lock:
                self._error = exc
            self._fail_everything(exc)

    def _step(self) -> None:
        if len(self.active) == 0:
            return
        t0 = time.perf_counter()
        self._step_num_tokens = 0
        batch = self._schedule()
        self._pause(batch.paused_requests)
        batch = self._fit_beams(batch)
        if len(batch):
            try:
                inputs = self._prepare(batch)
                sampler_output = self._forward_and_sample(inputs)
            except Exception as exc:  # noqa: BLE001
                self._fail_batch(batch, exc)
            else:
                finished_contexts = self._update_request_states(batch)
                self._process_output(_InFlight(batch, inputs, output=sampler_output))
                self._free_finished()
                self.resource_manager.update_resources(batch, finished_contexts)
        self._record_stats(batch, t0)

    def _step_overlap(self) -> None:
        prev = self._prev
        if len(self.active) == 0 and prev is None:
            return
        t0 = time.perf_counter()
        self._step_num_tokens = 0
        # A beam request's next rows depend on the beams its step in flight keeps: it sits this one out.
        # Its beams advance now (that step is done), so that its KV is current when the schedulers and
        # the preemption look at it.
        waiting_beams = {r.request_id for r in prev.inputs.beam_requests or ()} if prev else set()
        for rid in waiting_beams:
            self._process_output(prev, only=rid)
        batch = self._schedule_batch(self.preemption.schedulable(self.active), waiting_beams)
        self._pause(batch.paused_requests, prev)
        batch = self._fit_beams(batch, prev)
        launched = None
        if len(batch):
            try:
                inputs = self._prepare(batch, prev.pending_ids() if prev else frozenset())
                launched = _InFlight(batch, inputs)
                # A grammar's mask needs the previous step's token: sample after its host work.
                guided = any(r.py_guided is not None for r in inputs.sampled_requests)
                work = self.model_engine.forward if guided else self._forward_and_sample
                launched.future = self._forward_pool.submit(work, inputs)
            except Exception as exc:  # noqa: BLE001
                self._fail_batch(batch, exc)
                launched = None
        finished_contexts = self._update_request_states(launched.batch) if launched else []
        if prev is not None:  # N-1's host work, while N computes
            self._process_output(prev)
        self._prev = None
        if launched is not None:
            try:
                result = launched.future.result()
                if not isinstance(result, SamplerOutput):  # logits of a guided batch
                    result = self._sample(result, launched.inputs)
                launched.output = result
                self._prev = launched
            except Exception as exc:  # noqa: BLE001
                self._fail_batch(launched.batch, exc)
        self._free_finished()
        if launched is not None:
            self.resource_manager.update_resources(launched.batch, finished_contexts)
        self._record_stats(batch, t0)

    def _step_pipeline(self) -> None:
        """Pipeline parallelism: launch a micro-batch of requests not already in flight while fewer than
        ``pipeline_depth`` are; collect the oldest when the pipe is full (or nothing new could go), then
        sample it and append its tokens. The stages work on different micro-batches meanwhile."""
        flight = self._pipeline
        if len(self.active) == 0 and not flight:
            return
        t0 = time.perf_counter()
        self._step_num_tokens = 0
        batch = ScheduledRequests()
        if len(flight) < self.pipeline_depth:
            in_flight = {r.request_id for step in flight for r in step.batch.all_requests}
            # Fill the pipe: a micro-batch takes its share of the active requests (at most
            # ceil(active / depth) of them); the rest are held back for the next micro-batch.
            free = [r.request_id for r in self.active if r.request_id not in in_flight]
            held = set(free[-(-len(self.active) // self.pipeline_depth) :])
            batch = self._schedule(in_flight, held)
            if any(r.request_id in in_flight for r in batch.paused_requests):
                # Room needs a request that is still in the pipe: let it land first.
                batch = ScheduledRequests()
            self._pause(batch.paused_requests)
            batch = self._fit_beams(batch)
            if len(batch):
                try:
                    inputs = self._prepare(batch)
                    launched = _InFlight(batch, inputs)
                    launched.future = self.model_engine.launch(inputs)
                    launched.finished_contexts = self._update_request_states(batch)
                    flight.append(launched)
                except Exception as exc:  # noqa: BLE001
                    self._fail_batch(batch, exc)
        self._micro_batches = len(flight)
        if flight and (len(flight) >= self.pipeline_depth or not len(batch)):
            step = flight.popleft()
            try:
                logits = self.model_engine.collect(step.future)
                step.output = self._sample(logits, step.inputs)
            except Exception as exc:  # noqa: BLE001
                self._fail_batch(step.batch, exc)
            else:
                self._process_output(step)
                self._free_finished()
                self.resource_manager.update_resources(step.batch, step.finished_contexts)
        self._record_stats(batch, t0)

    # ------------------------------------------------------------------ components of a step
    def _schedule(self, in_flight=frozenset(), held=frozenset()) -> ScheduledRequests:
        """The scheduler's batch; with speculation, drafts planned before it and filled after it.
        ``in_flight``: requests of launched micro-batches (untouched); ``held``: kept for a later one."""
        spec = self.speculator
        active = self.preemption.schedulable(self.active)  # swapped-out requests sit out
        if spec is not None:
            spec.plan(active, self.max_seq_len, in_flight)
        batch = self._schedule_batch(active, set(in_flight) | set(held))
        if spec is not None:
            spec.fill(batch.generation_requests)
        return batch

    def _schedule_batch(self, active, skip: set[int]) -> ScheduledRequests:
        """The scheduler's batch over ``active``. A beam request is never recomputed: if the scheduler
        paused one that the secondary tier cannot take (:meth:`Preemption.unswappable`), it schedules
        again with those requests at the front of the list (until no other one is paused), so that the
        requests behind them are the victims (they hold KV: the others must make room for them, or
        nothing could ever run). The list the batch was made from is kept for :meth:`_fit_beams`."""
        batch = self.scheduler.schedule_request(active, skip)
        self._order = active
        front: set[int] = set()
        while True:  # each pass moves at least one more beam request to the front: it ends
            stuck = self.preemption.unswappable(batch.paused_requests, self.active) - front
            if not stuck:
                return batch
            front |= stuck
            order = RequestList(
                [r for r in active if r.request_id in front]
                + [r for r in active if r.request_id not in front]
            )
            batch = self.scheduler.schedule_request(order, skip)
            self._order = order

    def _fit_beams(self, batch: ScheduledRequests, prev: _InFlight | None = None) -> ScheduledRequests:
        """Makes the batch fit the free KV blocks once its beam requests are counted right: the C++
        planner does not see the copy-on-write blocks of a beam decode (``beam_copy_blocks``), and a
        beam request kept (not swapped out, :meth:`_pause`) still holds the blocks the scheduler
        counted as freed. While the batch's blocks exceed the free ones, the request nearest the end of
        the scheduled list leaves it: one that holds KV is paused (swapped out or recomputed; a beam
        request that cannot be swapped out sits this step out), a new context just waits; a kept beam
        request reached this way, or kept when nothing at all would run (beam requests the pool cannot
        hold together, the tier full), is restarted (:meth:`_restart_beams`). Without beam requests the
        batch is returned as it is."""
        kept, self._kept = self._kept, []
        order, self._order = self._order, None
        kv = self.kv_cache_manager
        if kv is None or (not kept and not any(r.py_beam is not None for r in batch.generation_requests)):
            return batch
        impl = kv.impl
        if not kept and not any(kv.beam_copy_blocks(r) for r in batch.generation_requests if r.py_beam):
            return batch
        need = {r.request_id: self._step_blocks(r) for r in batch.all_requests}
        demand = sum(need.values())
        kept_ids = {r.request_id for r in kept if not r.py_done}
        walk = list(order if order is not None else batch.all_requests)
        dropped, paused = set(), []
        for req in reversed(walk):
            if demand <= impl.num_free_blocks:
                break
            rid = req.request_id
            if rid in kept_ids:
                self._restart_beams(req)
                kept_ids.discard(rid)
            elif rid in need and rid not in dropped:
                demand -= need[rid]
                dropped.add(rid)
                if impl.has_sequence(rid) and not impl.is_suspended(rid):
                    self._pause([req], prev)
                    paused.append(req)
        # A beam request that could not be swapped out here just sits this step out (it is kept too).
        kept = [r for r in [*kept, *self._kept] if r.request_id in kept_ids or r in self._kept]
        kept_ids = {r.request_id for r in kept if not r.py_done}
        self._kept = []
        if len(batch) == len(dropped) and kept_ids and prev is None:
            # Nothing would run and kept beam requests hold the pool: none of them could ever go on.
            last = next((r for r in reversed(walk) if r.request_id in kept_ids), None)
            self._restart_beams(
                last if last is not None else next(r for r in kept if r.request_id in kept_ids)
            )
        if not dropped:
            return batch
        return ScheduledRequests(
            [r for r in batch.context_requests if r.request_id not in dropped],
            [r for r in batch.generation_requests if r.request_id not in dropped],
            [*batch.paused_requests, *paused],
            batch.num_fitting_requests - len(dropped),
        )

    def _restart_beams(self, req: ExecutorRequest) -> None:
        """The last resort for a beam request that can neither run nor be swapped out while nothing
        else can run (beam requests holding the pool between them, the tier full): its KV is freed and
        its search starts again from its prompt — its generated tokens are dropped, never folded into
        the prompt, so its beams are those of an uninterrupted run; only the work is lost. The latest
        such request in the list is the one restarted, so the ones ahead of it finish."""
        logger.warning(
            "request %d (beam search): the KV cache is held by beam requests that cannot be swapped out "
            "(raise KvCacheConfig.host_cache_size); its search restarts from its prompt",
            req.request_id,
        )
        self.resource_manager.free_resources(req, store_for_reuse=False)
        req.pause(req.prompt_len)  # back to the prompt: the generated tokens are dropped
        req.py_beam = req.py_beam.restarted()
        if req.py_prompt_logprobs is not None:
            req.py_prompt_logprobs = [None]  # scored again with the prompt
        req.py_num_preemptions += 1
        self.preemption.num_beams_restarted += 1
        self.timelines.preempted(req.request_id)

    def _step_blocks(self, req: ExecutorRequest) -> int:
        """The free blocks ``prepare_resources`` takes for ``req`` this step, from its KV sequences as
        they are (exact also in overlap mode, where the request's last token is not appended yet): a
        context's first chunk its prompt's blocks (prefix hits not subtracted), a decode the blocks its
        new token (and drafts) start, a beam decode that for each beam plus its copy-on-write blocks."""
        kv = self.kv_cache_manager
        impl, tpb = kv.impl, kv.tokens_per_block
        if req.is_context_init_state:
            return impl.get_needed_blocks_one_step(req, False)
        beam = req.py_beam
        if beam is not None:
            return sum(impl.get_num_tokens(s) % tpb == 0 for s in beam.seq_ids) + kv.beam_copy_blocks(req)
        n = impl.get_num_tokens(req.request_id) if impl.has_sequence(req.request_id) else 0
        return -(-(n + 1 + req.num_draft_tokens) // tpb) - (-(-n // tpb))

    def _fetch_new_requests(self, block: bool) -> bool:
        """Moves queued requests into the waiting queue and (up to the limit) into the active list.
        With ``block``, waits while there is nothing to do. Returns False when the loop should stop."""
        self._take_compiled()
        idle = (
            len(self.active) == 0 and not self._waiting and not self._compiling and self._nothing_in_flight()
        )
        # Block only while nothing is running and no shutdown is pending: once the marker has been
        # taken (while requests were still running), nothing else may ever arrive.
        block = block and idle and not self._draining
        if block and not self._idle_recorded:
            # What the engine looks like now that it waits (metrics read the last entry): requests
            # cancelled or finished since the last iteration no longer show as running.
            self._step_num_tokens = self._micro_batches = 0
            self._record_stats(ScheduledRequests(), time.perf_counter())
            self._idle_recorded = True
        if block:
            self._last_progress = time.monotonic()
        stop = False
        while True:
            try:
                item = self._queue.get() if block else self._queue.get_nowait()
            except queue.Empty:
                break
            block = False
            self._idle_recorded = False
            if isinstance(item, _Fatal):
                raise item.error
            if isinstance(item, _Shutdown):
                stop = True  # drain: keep stepping until everything queued before it is done
            elif isinstance(item, _Cancel):
                self._cancel(item.request_ids)
            elif isinstance(item, _Wake):
                self._take_compiled()
            else:
                for req in item.requests if isinstance(item, _Arrivals) else (item,):
                    self._waiting.append(req)
                    self.timelines.queued(req.request_id, req.prompt_len, req.py_arrival_time)
        while self._waiting and len(self.active) < self.max_num_active_requests:
            req = self._waiting.popleft()
            if req.py_sampling_state.params.guided_decoding is not None and req.py_guided is None:
                self._compile(req)
            else:
                self._admit(req)
        if stop:
            self._draining = True
        idle = (
            len(self.active) == 0 and not self._waiting and not self._compiling and self._nothing_in_flight()
        )
        return not (self._draining and idle and self._queue.empty())

    def _compile(self, req: ExecutorRequest) -> None:
        """Starts compiling the request's grammar; it joins the active list once compiled."""
        if self.guided is None:
            self._finish(
                req, FinishReason.NOT_FINISHED, "guided_decoding: this engine has no grammar backend"
            )
            return
        future = self.guided.start(req.py_sampling_state.params.guided_decoding)
        self._compiling.append((req, future))
        future.add_done_callback(lambda _f: self._queue.put(_Wake()))

    def _take_compiled(self) -> None:
        """Admits the requests whose grammar compiled; fails those whose grammar did not."""
        if not self._compiling:
            return
        pending = []
        for req, future in self._compiling:
            if not future.done():
                pending.append((req, future))
            elif req.py_done:
                pass  # cancelled while compiling
            elif future.exception() is not None:
                self._finish(req, FinishReason.NOT_FINISHED, f"guided_decoding: {future.exception()}")
            else:
                req.py_guided = future.result()
                self._admit(req)
        self._compiling = pending

    def _admit(self, req: ExecutorRequest) -> None:
        """Inserts into the active list: descending priority, FIFO within equal priority, but never
        ahead of a request that has started (holds KV). Otherwise a high-priority request that cannot
        fit would stop GUARANTEED_NO_EVICT admission in front of a half-prefilled context whose
        blocks it is waiting for, and neither would ever run."""
        active = self.active
        pos = len(active)
        while pos > 0:
            other = active[pos - 1]
            started = other.state != LlmRequestState.CONTEXT_INIT or not other.is_first_context_chunk
            if started or other.priority >= req.priority:
                break
            pos -= 1
        active.insert(pos, req)

    def _cancel(self, request_ids: frozenset[int]) -> None:
        for req, _ in self._compiling:
            if req.request_id in request_ids and not req.py_done:
                self._finish(req, FinishReason.CANCELLED)
        if any(req.request_id in request_ids for req in self._waiting):
            kept = collections.deque()
            for req in self._waiting:
                if req.request_id in request_ids:
                    self._finish(req, FinishReason.CANCELLED)
                else:
                    kept.append(req)
            self._waiting = kept
        for req in self.active:
            if req.request_id in request_ids and not req.py_done:
                self._finish(req, FinishReason.CANCELLED)
                # In overlap mode the running step may still use its KV: free after it.
                self._deferred_free.append(req)
        if self._deferred_free and self._prev is None:
            self._free_finished()

    def _pause(self, paused, prev: _InFlight | None = None) -> None:
        for req in paused:
            if prev is not None and prev.output is not None:
                # Its last sampled token is not appended yet: take it before folding the prompt.
                self._process_output(prev, only=req.request_id)
                if req.py_done and req in self._deferred_free:
                    # It ended on that token: free it now, as the scheduler counted its blocks as freed
                    # for this step (the step it was in is done: nothing reads its KV any more).
                    self.resource_manager.free_resources(req, store_for_reuse=req.py_finish_reason != "error")
                    self._deferred_free.remove(req)
                    self.active.remove_ids({req.request_id})
            if req.py_done:
                continue
            if req.py_beam is not None and self.preemption.mode != "swap":
                # Folding K beams into one prompt would change the result (the LLM refuses this setup).
                self._finish(
                    req,
                    FinishReason.NOT_FINISHED,
                    "beam search: the scheduler paused this request (KV cache full) and beam requests "
                    "cannot be recomputed; use capacity_scheduler_policy GUARANTEED_NO_EVICT, or "
                    "preemption_mode='swap' with KvCacheConfig.host_cache_size",
                )
                self._deferred_free.append(req)
                continue
            swapped = self.preemption.swap_out(req)  # else recomputed: its KV is freed
            if not swapped and req.py_beam is not None:
                # Never recomputed: it keeps its KV (and does not run this step); _fit_beams makes room.
                logger.info(
                    "request %d (beam search): no room in the secondary KV tier for its beams; kept",
                    req.request_id,
                )
                self._kept.append(req)
                continue
            if swapped:
                logger.info("request %d preempted (KV cache full); swapped out", req.request_id)
            else:
                logger.warning("request %d preempted (KV cache full); it will be recomputed", req.request_id)
                self.resource_manager.free_resources(req)
            if self.speculator is not None:
                self.speculator.free(req)
            if req.has_draft_tokens:
                req.draft_tokens = []
            if not swapped:
                req.pause(self.max_seq_len)
            req.py_num_preemptions += 1
            self.timelines.preempted(req.request_id)

    def _prepare(self, batch: ScheduledRequests, pending_ids=frozenset()) -> ModelInputs:
        """The batch's KV (blocks for its new tokens) and its model inputs."""
        self.resource_manager.prepare_resources(batch)
        inputs = self.model_engine.prepare(batch, pending_ids)
        self._step_num_tokens = inputs.metadata.num_tokens
        return inputs

    def _forward_and_sample(self, inputs: ModelInputs) -> SamplerOutput:
        """A failure of the forward fails the step; one of sampling is narrowed down to its rows."""
        return self._sample(self.model_engine.forward(inputs), inputs)

    def _sample(self, logits, inputs: ModelInputs) -> SamplerOutput:
        prompt_logprobs = None
        if inputs.prompt_rows:
            prompt_logprobs = self._score_prompts(logits[inputs.num_sampled_rows :], inputs.prompt_rows)
            logits = logits[: inputs.num_sampled_rows]
        beam_logits = None
        if inputs.beam_requests:
            num_regular = inputs.num_sampled_rows - inputs.num_beam_rows
            beam_logits = logits[num_regular:]
            logits = logits[:num_regular]
        if self.guided is not None:
            logits = self._mask_grammars(logits, inputs)
        if inputs.num_rows is not None:  # drafting rows: one state per position
            states = Speculator.row_states(inputs)
        else:
            states = [r.py_sampling_state for r in inputs.sampled_requests]
        try:
            if states:
                output = self.sampler.sample(logits, states)
            else:  # only beam requests
                output = SamplerOutput(torch.zeros(0, dtype=torch.int64, device=logits.device))
        except Exception as exc:  # noqa: BLE001
            output = self.sampler.sample_each(logits, states)
            logger.warning(
                "sampling failed for the batch (%r); rows %s fail alone", exc, sorted(output.errors)
            )
        if inputs.num_rows is not None:
            self.speculator.verify(logits, inputs, output, self.sampler, states)
        if self.overlap:  # the next step's decode inputs, by slot, before the host sees them
            self.model_engine.store_new_tokens(inputs, output.token_ids)
        output.prompt_logprobs = prompt_logprobs
        if beam_logits is not None:
            output.beam_errors = self._step_beams(beam_logits, inputs)
        return output

    @staticmethod
    def _step_beams(logits, inputs: ModelInputs) -> dict[int, str]:
        """Beam search: each beam request's step over its rows; a failure fails that request only."""
        errors, row = {}, 0
        for req, n in zip(inputs.beam_requests, inputs.beam_num_rows):
            part = logits[row : row + n]
            row += n
            try:
                req.py_beam.step(part)
            except Exception as exc:  # noqa: BLE001
                errors[req.request_id] = f"{type(exc).__name__}: {exc}"
        return errors

    @staticmethod
    def _mask_grammars(logits, inputs: ModelInputs):
        """Structured output: the rows of grammar-guided requests masked to what their grammar
        allows next; a drafting request's row after each of its draft prefixes."""
        rows, row = [], 0
        for i, req in enumerate(inputs.sampled_requests):
            n = inputs.num_rows[i] if inputs.num_rows is not None else 1
            if req.py_guided is not None:
                rows.append((row, req.py_guided, list(req.draft_tokens) if n > 1 else []))
            row += n
        return apply_masks(logits, rows) if rows else logits

    @staticmethod
    def _score_prompts(logits, prompt_rows) -> list[tuple]:
        """SamplingParams.prompt_logprobs: each request's entries for its scored prompt positions; a
        failure fails that request only."""
        scored, row = [], 0
        for req, _, targets in prompt_rows:
            part = logits[row : row + len(targets)]
            row += len(targets)
            try:
                num_top = req.py_sampling_state.params.prompt_logprobs or 0
                scored.append((req, prompt_logprob_entries(part, targets, num_top)))
            except Exception as exc:  # noqa: BLE001
                scored.append((req, exc))
        return scored

    def _update_request_states(self, batch: ScheduledRequests) -> list:
        finished_contexts = []
        now = time.monotonic()
        for req in batch.context_requests:
            if req.py_first_scheduled_time is None:
                req.py_first_scheduled_time = now
            last = req.is_last_context_chunk
            self.timelines.chunk(req.request_id, req.context_chunk_size)
            req.move_to_next_context_chunk()
            if last:
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                finished_contexts.append(req)
        return finished_contexts

    def _process_output(self, step: _InFlight, only: int | None = None) -> None:
        """Appends a step's sampled tokens, checks stop conditions, sends responses. A request with
        drafts appends its kept tokens one by one (the first that stops it ends it; the rest is
        dropped), then its KV cache is rewound by the drafts it did not keep."""
        output = step.output
        tokens = output.token_ids.tolist()
        logprobs = LogprobRows(output) if output.logprobs is not None else None
        num_rows = step.inputs.num_rows
        num_kept = output.num_kept
        now = time.monotonic()
        for req, entries in output.prompt_logprobs or ():
            if (only is not None and req.request_id != only) or req.py_done:
                continue
            if req.request_id in step.prompts_taken:
                continue
            step.prompts_taken.add(req.request_id)
            if isinstance(entries, BaseException):
                self._finish(req, FinishReason.NOT_FINISHED, f"prompt_logprobs failed: {entries}")
                self._deferred_free.append(req)
            else:
                req.py_prompt_logprobs.extend(entries)
        row = 0
        for i, req in enumerate(step.inputs.sampled_requests):
            first = row
            n = num_rows[i] if num_rows is not None else 1
            row += n
            if only is not None and req.request_id != only:
                continue
            if req.py_done or req.request_id in step.processed:
                continue  # finished before this step's token (overlap), or already taken
            step.processed.add(req.request_id)
            failed = next((r for r in range(first, first + n) if r in output.errors), None)
            if failed is not None:
                self._finish(req, FinishReason.NOT_FINISHED, f"sampling failed: {output.errors[failed]}")
                self._deferred_free.append(req)
                continue
            kept = num_kept[i] if num_kept is not None else 1
            state = req.py_sampling_state
            reason = FinishReason.NOT_FINISHED
            appended = 0
            for r in range(first, first + kept):
                tok = tokens[r]
                req.add_new_token(tok)
                appended += 1
                self.timelines.token(req.request_id)
                state.append(tok)
                if logprobs is not None and state.params.logprobs is not None:
                    entry = logprobs.entry(r, tok, state.params.logprobs)
                    req.py_logprobs.append(entry)
                    req.py_cumulative_logprob += entry[tok]
                reason, stop_reason = self._stop_condition(req, tok)
                if req.py_guided is not None and not req.py_guided.accept(tok):
                    reason = None  # an error: the grammar refused a token its mask allowed
                if reason != FinishReason.NOT_FINISHED:
                    break
            if n > 1:  # drafted n - 1 tokens; appended - 1 of them are now in the sequence
                self.kv_cache_manager.rewind(req, n - appended)
                self.speculator.after_verify(req, n - 1, kept - 1)
            if req.py_first_token_time is None:
                req.py_first_token_time = now
            if reason is None:
                self._finish(req, FinishReason.NOT_FINISHED, f"guided_decoding: {req.py_guided.error()}")
                self._deferred_free.append(req)
            elif reason != FinishReason.NOT_FINISHED:
                req.py_stop_reason = stop_reason
                self._finish(req, reason)
                self._deferred_free.append(req)
            elif req.py_streaming:
                self._respond(req)
        for req in step.inputs.beam_requests or ():
            if only is not None and req.request_id != only:
                continue
            if req.py_done or req.request_id in step.processed:
                continue
            step.processed.add(req.request_id)
            self._advance_beams(req, output.beam_errors.get(req.request_id), now)

    def _advance_beams(self, req: ExecutorRequest, error: str | None, now: float) -> None:
        """After a beam step: the KV sequences follow the kept beams, the request counts one more
        token (the C++ planner sees its length), and a finished search ends the request."""
        beam = req.py_beam
        if error is not None:
            self._finish(req, FinishReason.NOT_FINISHED, f"beam search failed: {error}")
            self._deferred_free.append(req)
            return
        if req.py_first_token_time is None:
            req.py_first_token_time = now
        self.timelines.token(req.request_id)
        if beam.done:
            best = beam.results()[0]
            reason = FinishReason.END_ID if best.finish_reason == "stop" else FinishReason.LENGTH
            self._finish(req, reason)
            self._deferred_free.append(req)
            return
        try:
            self.kv_cache_manager.reorder_beams(req, beam.parents)
        except Exception as exc:  # noqa: BLE001
            self._finish(req, FinishReason.NOT_FINISHED, f"beam search failed: {exc}")
            self._deferred_free.append(req)
            return
        req.add_new_token(beam.best_token)

    def _stop_condition(self, req: ExecutorRequest, tok: int) -> tuple[FinishReason, int | None]:
        """Why the request stops after ``tok`` (NOT_FINISHED: it goes on), and the stop token."""
        state = req.py_sampling_state
        params = state.params
        if tok in state.eos_token_ids and not params.ignore_eos:
            return FinishReason.END_ID, None
        if params.stop_token_ids and tok in params.stop_token_ids:
            return FinishReason.STOP_WORDS, tok
        if req.py_num_output_tokens >= req.py_max_new_tokens or req.num_tokens >= self.max_seq_len:
            return FinishReason.LENGTH, None
        return FinishReason.NOT_FINISHED, None

    def _respond(self, req: ExecutorRequest) -> None:
        n = req.py_num_output_tokens
        start = req.py_num_returned
        if not req.py_streaming and not req.py_done:
            return
        if req.py_streaming and n == start and not req.py_done:
            return
        new_ids = req.get_tokens(req.orig_prompt_len + start) if n > start else []
        req.py_num_returned = n
        resp = Response(
            request_id=req.request_id,
            new_token_ids=new_ids,
            num_output_tokens=n,
            finished=req.py_done,
            finish_reason=req.py_finish_reason,
            stop_reason=req.py_stop_reason,
            new_logprobs=req.py_logprobs[start:n]
            if req.py_sampling_state.params.logprobs is not None
            else None,
            cumulative_logprob=req.py_cumulative_logprob
            if req.py_sampling_state.params.logprobs is not None
            else None,
            error=req.py_error,
        )
        if req.py_beam is not None:
            if not req.py_done:
                return  # beams change until the end: only the final response carries them
            resp.beams = req.py_beam.results() if req.py_error is None else None
            best = resp.beams[0] if resp.beams else None
            resp.new_token_ids = list(best.token_ids) if best is not None else []
            resp.num_output_tokens = len(resp.new_token_ids)
            resp.new_logprobs = best.logprobs if best is not None else None
            resp.cumulative_logprob = best.cumulative_logprob if best is not None else None
        if req.py_prompt_logprobs is not None and start == 0:  # sent once, with the first tokens
            resp.prompt_logprobs = req.py_prompt_logprobs
        if req.py_done:
            resp.metrics = request_metrics(req)
        # Sent at the end of the step, once finished requests are freed and the step's stats are
        # recorded, so a caller woken by a final response sees a consistent engine.
        self._outbox.append(resp)

    def _flush_responses(self) -> None:
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        try:
            self._callback(outbox)
        except Exception:
            logger.exception("the response callback failed for requests %s", [r.request_id for r in outbox])

    def _finish(self, req: ExecutorRequest, reason: FinishReason, error: str | None = None) -> None:
        """Ends the request: ``reason``, or an engine failure (``error``; reason NOT_FINISHED)."""
        req.finish_reason = reason
        req.py_error = error
        req.py_finish_time = time.monotonic()
        req.state = LlmRequestState.GENERATION_COMPLETE
        self._respond(req)
        self.timelines.finished(req.request_id, req.py_finish_reason)

    def _free_finished(self) -> None:
        if not self._deferred_free:
            return
        done = self._deferred_free
        self._deferred_free = []
        if self._pipeline:  # still in the pipe (cancelled meanwhile): freed once it lands
            in_flight = {r.request_id for step in self._pipeline for r in step.batch.all_requests}
            self._deferred_free = [r for r in done if r.request_id in in_flight]
            done = [r for r in done if r.request_id not in in_flight]
        for req in done:
            self.resource_manager.free_resources(req, store_for_reuse=req.py_finish_reason != "error")
            if self.speculator is not None:
                self.speculator.free(req)
        self.active.remove_ids({r.request_id for r in done})

    def _fail_batch(self, batch: ScheduledRequests, exc: BaseException) -> None:
        """Fails the batch's requests; an error marked ``fatal`` (a parallel rank died) then kills the loop."""
        logger.error("step failed for requests %s: %r", [r.request_id for r in batch.all_requests], exc)
        message = f"{type(exc).__name__}: {exc}"
        for req in batch.all_requests:
            if not req.py_done:
                self._finish(req, FinishReason.NOT_FINISHED, message)
                self._deferred_free.append(req)
        self._free_finished()
        if getattr(exc, "fatal", False):
            raise exc

    def _fail_everything(self, exc: BaseException) -> None:
        message = f"executor loop died: {type(exc).__name__}: {exc}"
        pending = list(self.active) + list(self._waiting) + [req for req, _ in self._compiling]
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, ExecutorRequest):
                pending.append(item)
            elif isinstance(item, _Arrivals):
                pending.extend(item.requests)
        for req in pending:
            if not req.py_done:
                try:
                    self._finish(req, FinishReason.NOT_FINISHED, message)
                except Exception:
                    logger.exception("could not report the failure of request %d", req.request_id)
        self._flush_responses()

    # ------------------------------------------------------------------ stats
    def _record_stats(self, batch: ScheduledRequests, t0: float) -> None:
        kv = self.kv_cache_manager
        kv_stats = kv.get_kv_cache_stats() if kv is not None else {}
        stat = {
            "iter": self._iter,
            "timestamp": time.time(),
            "iter_latency_ms": (time.perf_counter() - t0) * 1e3,
            "num_active_requests": len(self.active),
            "num_waiting_requests": len(self._waiting) + self._queue.qsize(),
            "num_scheduled_requests": len(batch),
            "num_context_requests": len(batch.context_requests),
            "num_generation_requests": len(batch.generation_requests),
            "num_paused_requests": len(batch.paused_requests),
            "num_tokens": self._step_num_tokens,
            "num_micro_batches_in_flight": (
                self._micro_batches if self.pipeline_depth > 1 else int(len(batch) > 0)
            ),
            "kv_cache_stats": kv_stats,
            **self._stats_extra,
        }
        if self.preemption.mode == "swap":
            stat["preemption"] = self.preemption.stats()
        if self.speculator is not None:
            if self.pipeline_depth == 1:  # a pipeline's iteration is not its micro-batch's time
                self.speculator.observe_step(batch, stat["iter_latency_ms"] / 1e3)
            stat["spec_decode"] = self.speculator.stats.entry()
            if stat["spec_decode"]["num_requests_with_drafts"]:
                self.speculator.stats.maybe_log()
        self._stats.append(stat)
        self._last_progress = time.monotonic()
        if self.log_stats_every and self._iter % self.log_stats_every == 0:
            logger.info("%s", format_iteration_stats(stat))
        self._iter += 1
