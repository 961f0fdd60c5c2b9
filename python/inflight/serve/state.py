"""What the server's routes share: :class:`ModelSet` (the models served, by name: one for ``inflight
serve MODEL``, a repository's for ``--model-repository``), :class:`ServerState` (one model: its engine,
admission, metrics) and :class:`Job` (one HTTP request's engine requests).

Admission: a request is refused with 503 while the server drains (SIGTERM) or after the engine died,
and when ``max_queue_size`` requests are already in flight (accepted and not finished). Every
accepted request becomes a :class:`Job`, which records its metrics as its outputs arrive and, when
closed, aborts what is still running and releases its place.

The engine runs on its own worker thread; the state only submits (``llm.generate_async``) and
tokenizes (long prompts off the event loop), so the event loop never blocks on the engine. It uses
the public members of :class:`~inflight.llm.LLM` only.
"""

from __future__ import annotations

import abc
import asyncio
import time
from typing import Any

from inflight.sampling_params import SamplingParams
from inflight.serve.metrics import ModelMetrics, ServerMetrics, TritonStats
from inflight.serve.protocol import APIError, bad_request

MODEL_VERSION = "1"  # the version every model is served as (KServe, Triton's metrics)

# Prompts (characters) longer than this are tokenized on a worker thread, off the event loop.
_LONG_TEXT = 4096


class ServerState:
    """The engine, its names, the admission bookkeeping and the metrics (``app.state.server``).

    ``draining`` (set on SIGTERM: new requests get 503), ``in_flight`` (requests accepted and not
    finished), ``max_queue_size`` and ``metrics`` are public; :meth:`abort_all` cancels every request
    in flight.
    """

    def __init__(
        self,
        llm,
        model_name: str,
        max_queue_size: int,
        aliases: tuple[str, ...] = (),
        *,
        version: str = "",
        stall_timeout: float = 120.0,
        metrics: ModelMetrics | None = None,
        triton: TritonStats | None = None,
        batching=None,
    ):
        if isinstance(max_queue_size, bool) or not isinstance(max_queue_size, int) or max_queue_size < 1:
            raise ValueError(f"max_queue_size must be an integer >= 1, got {max_queue_size!r}")
        self.llm = llm
        self.model_name = model_name
        self.model_names = (model_name, *aliases)
        self.model_version = MODEL_VERSION
        self.version = version
        self.max_queue_size = max_queue_size
        # /health turns 503 when the engine had work pending and finished no iteration for this long.
        self.stall_timeout = stall_timeout
        self.in_flight = 0
        self.draining = False
        # Set when the model is being unloaded or replaced: new requests are refused with this reason.
        self.retiring: str | None = None
        self.jobs: set[Job] = set()
        self.created = int(time.time())
        if metrics is None:  # a state of its own (tests): a registry of its own
            metrics = ServerMetrics(lambda: [self]).for_model(model_name)
        self.metrics = metrics
        self.triton = triton if triton is not None else TritonStats()
        self.batcher = None
        if batching is not None:  # Triton's dynamic batcher (serve/batcher.py)
            from inflight.serve.batcher import DynamicBatcher

            # The engine's batch bounds what the batcher releases (the engine holds up to twice that).
            self.batcher = DynamicBatcher(batching, llm.args.max_batch_size, self.triton.record_execution)
        self._token_strs: dict[int, str] = {}

    # -- engine facts
    @property
    def tokenizer(self):
        return self.llm.tokenizer

    def engine_alive(self) -> bool:
        return self.llm.is_alive

    def engine_stalled(self) -> bool:
        return self.llm.stall_seconds > self.stall_timeout

    def max_active_requests(self) -> int:
        """Most requests the engine runs at once (its active batch); 0 once the engine was freed."""
        if self.llm is None:
            return 0
        executor = getattr(self.llm, "executor", None)
        return getattr(executor, "max_num_active_requests", None) or self.llm.args.max_batch_size

    def queued(self) -> int:
        """Requests waiting in this model's dynamic-batcher queue."""
        return self.batcher.queued() if self.batcher is not None else 0

    def token_str(self, tid: int) -> str:
        """The text of one token (cached), as the logprobs of the responses show it."""
        s = self._token_strs.get(tid)
        if s is None:
            tok = self.tokenizer
            s = tok.decode([tid]) if tok is not None else f"token_id:{tid}"
            if len(self._token_strs) < 1_000_000:
                self._token_strs[tid] = s
        return s

    # -- admission
    def check_serving(self) -> None:
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down and accepts no new requests",
                type="service_unavailable",
                code="server_draining",
                headers={"Retry-After": "5"},
            )
        if self.retiring is not None:
            raise APIError(
                503,
                f"model '{self.model_name}' is {self.retiring} and accepts no new requests",
                type="service_unavailable",
                code="model_unavailable",
            )
        if not self.engine_alive():
            raise APIError(
                503, "the inference engine is not running", type="service_unavailable", code="engine_dead"
            )

    def admit(self) -> None:
        self.check_serving()
        if self.in_flight >= self.max_queue_size:
            raise APIError(
                503,
                f"the server is busy: {self.in_flight} requests in flight (max_queue_size="
                f"{self.max_queue_size}); retry later",
                type="service_unavailable",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self.in_flight += 1

    def release(self, job: Job | None) -> None:
        self.in_flight -= 1
        if job is not None:
            self.jobs.discard(job)
            if job.ticket is not None:
                self.batcher.release(job.ticket)

    def abort_all(self) -> int:
        """Cancels every running request (the drain timeout); returns how many jobs were running."""
        jobs = list(self.jobs)
        for job in jobs:
            for h in job.handles:
                h.abort()
        return len(jobs)

    # -- requests
    async def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids; a prompt the engine refuses to tokenize (too large, not valid
        Unicode) is a 400 naming ``prompt``."""
        try:
            if len(prompt) > _LONG_TEXT:
                return await asyncio.to_thread(self.llm.encode, prompt, add_special_tokens)
            return self.llm.encode(prompt, add_special_tokens)
        except ValueError as exc:
            raise bad_request(str(exc), param="prompt") from None

    async def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool
    ) -> list[int]:
        if sum(len(m["content"]) for m in messages) > _LONG_TEXT:
            return await asyncio.to_thread(self.llm.apply_chat_template, messages, add_generation_prompt)
        return self.llm.apply_chat_template(messages, add_generation_prompt)

    def check_fit(
        self, ids: list[int], params: SamplingParams, explicit_max: bool, prompt_field: str, max_field: str
    ) -> SamplingParams:
        """``params`` for a prompt of ``ids``, or a 400 when it cannot fit the context (a default
        ``max_tokens``, ``explicit_max`` False, shrinks to what fits instead)."""
        limit = self.llm.max_seq_len
        n = len(ids)
        if n >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, and the {prompt_field} has "
                f"{n} tokens (at least one must be left for the output). Shorten the {prompt_field}.",
                param=prompt_field,
                code="context_length_exceeded",
            )
        args = self.llm.args
        if not args.enable_chunked_prefill and n > args.max_num_tokens:
            raise bad_request(
                f"The {prompt_field} has {n} tokens, more than max_num_tokens={args.max_num_tokens} "
                "(the server was started without --enable-chunked-prefill).",
                param=prompt_field,
                code="context_length_exceeded",
            )
        if params.max_tokens is not None and n + params.max_tokens > limit:
            if not explicit_max:  # the default (16 for completions) shrinks to what fits
                return params.replace(max_tokens=limit - n)
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but {n + params.max_tokens} "
                f"were requested ({n} in the {prompt_field}, {params.max_tokens} for {max_field}). "
                f"Reduce {max_field} or the {prompt_field}.",
                param=max_field,
                code="context_length_exceeded",
            )
        return params

    def submit(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        stream: bool,
        prompt_field: str,
        guided_field: str | None = None,
        priority: float = 0.5,
    ) -> Job:
        """Admits one HTTP request and submits its prompts (one engine request each)."""
        self.admit()
        handles = []
        try:
            with self.llm.executor.arrivals():  # one HTTP request's prompts start together
                for ids, sp in zip(prompts, params):
                    handles.append(self.llm.generate_async(ids, sp, streaming=stream, priority=priority))
        except Exception as exc:
            for h in handles:
                h.abort()
            self.release(None)
            if isinstance(exc, ValueError):
                msg, param = str(exc), getattr(exc, "param", "prompt")
                if param == "prompt":  # the prompt as this endpoint calls it (chat: messages)
                    param = prompt_field
                elif param == "logprobs" and prompt_field == "messages":  # chat's field is top_logprobs
                    param, msg = "top_logprobs", "top_logprobs" + msg[len("logprobs") :]
                elif param == "guided_decoding":  # the request's own field (response_format, guided_*)
                    param = guided_field or param
                raise bad_request(msg, param=param) from None
            if isinstance(exc, RuntimeError):
                raise APIError(
                    503,
                    f"the inference engine is not accepting requests: {exc}",
                    type="service_unavailable",
                    code="engine_dead",
                ) from None
            raise
        job = Job(self, handles, [len(p) for p in prompts])
        job.predicted = any(sp.prediction is not None for sp in params)
        return job


class Job:
    """One HTTP request's engine requests (one handle per prompt): metrics and cleanup."""

    def __init__(self, state: ServerState, handles: list, prompt_lens: list[int]):
        self.state = state
        self.handles = handles
        self.prompt_lens = prompt_lens
        self.final: list[Any] = [None] * len(handles)
        self.seen = [0] * len(handles)
        self.closed = False
        self.predicted = False  # the request carried a prediction (usage reports its draft tokens)
        self.ticket = None  # its place in the dynamic batcher, given back when it closes
        state.jobs.add(self)

    def observe(self, i: int, out) -> None:
        """Handle ``i``'s latest (cumulative) output; its metrics are recorded once it finished."""
        self.seen[i] = sum(len(c.token_ids) for c in out.outputs)
        if out.finished and self.final[i] is None:
            self.final[i] = out
            self.state.metrics.record_finished(out, self.prompt_lens[i], self.seen[i])

    def close(self) -> None:
        """Aborts what is still running (the client is gone or the handler failed); idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            for i, h in enumerate(self.handles):
                if self.final[i] is not None:
                    continue
                if h.done:
                    self.observe(i, h.result(timeout=0))
                else:
                    h.abort()
                    self.state.metrics.record_aborted(self.prompt_lens[i], self.seen[i])
        finally:
            self.state.release(self)


class ModelSet(abc.ABC):
    """The models a server serves, by name (``app.state.models``): the routes look a model up here.

    ``draining`` (SIGTERM) applies to every model, ``in_flight`` and :meth:`abort_all` cover every
    engine still running requests (a model being unloaded included). Subclasses say which models
    serve (:meth:`serving`), which still run requests (:meth:`running`) and why a name has no model
    (:meth:`missing`).
    """

    def __init__(self, version: str, max_queue_size: int = 1024, stall_timeout: float = 120.0):
        self.version = version
        self.max_queue_size = max_queue_size
        self.stall_timeout = stall_timeout
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.running)
        self._draining = False

    # -- to override
    @abc.abstractmethod
    def serving(self) -> list[ServerState]:
        """The models taking requests."""

    def running(self) -> list[ServerState]:
        """Every model with an engine (taking requests or finishing its last ones)."""
        return self.serving()

    def missing(self, name: str) -> str | None:
        """Why ``name`` has no serving model ("not found" or a reason); None when it serves."""
        return None if self.lookup(name) is not None else "not found"

    def failed(self) -> list[str]:
        """Models that should serve and could not load (the server is then not ready)."""
        return []

    def index(self) -> list[dict]:
        """Triton's repository index: every model with its state (and the reason when not ready)."""
        return [{"name": s.model_name, "version": MODEL_VERSION, "state": "READY"} for s in self.serving()]

    async def load(self, name: str, config: str | None = None) -> None:
        """(Re)loads a model (Triton's explicit model control); a server of one model refuses."""
        raise APIError(
            400,
            "explicit model load is not allowed: this server serves one model and has no model repository",
        )

    async def unload(self, name: str) -> None:
        raise APIError(
            400,
            "explicit model unload is not allowed: this server serves one model and has no model repository",
        )

    # -- shared
    def lookup(self, name: str) -> ServerState | None:
        for state in self.serving():
            if name in state.model_names:
                return state
        return None

    def default(self) -> ServerState | None:
        """The model of requests that name none (the OpenAI routes, the pages): the first serving."""
        states = self.serving()
        return states[0] if states else None

    def names(self) -> list[str]:
        return [n for s in self.serving() for n in s.model_names]

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        for state in self.running():
            state.draining = value

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.running())

    def abort_all(self) -> int:
        return sum(s.abort_all() for s in self.running())

    def openai_state(self, name: str | None) -> ServerState:
        """The model of an OpenAI request's ``model`` field, or a 404 naming the served ones."""
        if name is None:
            state = self.default()
            if state is None:
                raise APIError(
                    503, "no model is loaded", type="service_unavailable", code="model_unavailable"
                )
            return state
        state = self.lookup(name)
        if state is None:
            served = ", ".join(repr(n) for n in self.names()) or "no model"
            raise APIError(
                404,
                f"The model `{name}` does not exist (this server serves {served}).",
                param="model",
                code="model_not_found",
            )
        return state


class SingleModel(ModelSet):
    """The one model of ``inflight serve MODEL``."""

    def __init__(
        self, llm, model_name: str, max_queue_size: int, aliases=(), *, version: str, stall_timeout: float
    ):
        super().__init__(version, max_queue_size, stall_timeout)
        self.state = ServerState(
            llm,
            model_name,
            max_queue_size,
            tuple(aliases),
            version=version,
            stall_timeout=stall_timeout,
            metrics=self.metrics.for_model(model_name),
        )

    def serving(self) -> list[ServerState]:
        return [self.state]
