"""What the server's routes share: :class:`ServerState` (the engine, admission, metrics) and
:class:`Job` (one HTTP request's engine requests).

Admission: a request is refused with 503 while the server drains (SIGTERM) or after the engine died,
and when ``max_queue_size`` requests are already in flight (accepted and not finished). Every
accepted request becomes a :class:`Job`, which records its metrics as its outputs arrive and, when
closed, aborts what is still running and releases its place.

The engine runs on its own worker thread; the state only submits (``llm.generate_async``) and
tokenizes (long prompts off the event loop), so the event loop never blocks on the engine. It uses
the public members of :class:`~inflight.llm.LLM` only.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from inflight.sampling_params import SamplingParams
from inflight.serve.metrics import ServerMetrics
from inflight.serve.protocol import APIError, bad_request

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
    ):
        if isinstance(max_queue_size, bool) or not isinstance(max_queue_size, int) or max_queue_size < 1:
            raise ValueError(f"max_queue_size must be an integer >= 1, got {max_queue_size!r}")
        self.llm = llm
        self.model_name = model_name
        self.model_names = (model_name, *aliases)
        self.version = version
        self.max_queue_size = max_queue_size
        # /health turns 503 when the engine had work pending and finished no iteration for this long.
        self.stall_timeout = stall_timeout
        self.in_flight = 0
        self.draining = False
        self.jobs: set[Job] = set()
        self.created = int(time.time())
        self.metrics = ServerMetrics(llm, lambda: self.in_flight)
        self._token_strs: dict[int, str] = {}

    # -- engine facts
    @property
    def tokenizer(self):
        return self.llm.tokenizer

    def engine_alive(self) -> bool:
        return self.llm.is_alive

    def engine_stalled(self) -> bool:
        return self.llm.stall_seconds > self.stall_timeout

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
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise APIError(
                404,
                f"The model `{name}` does not exist (this server serves {served}).",
                param="model",
                code="model_not_found",
            )

    def check_serving(self) -> None:
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down and accepts no new requests",
                type="service_unavailable",
                code="server_draining",
                headers={"Retry-After": "5"},
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

    def abort_all(self) -> int:
        """Cancels every running request (the drain timeout); returns how many jobs were running."""
        jobs = list(self.jobs)
        for job in jobs:
            for h in job.handles:
                h.abort()
        return len(jobs)

    # -- requests
    async def tokenize(self, prompt: str) -> list[int]:
        """The prompt's token ids; a prompt the engine refuses to tokenize (too large, not valid
        Unicode) is a 400 naming ``prompt``."""
        try:
            if len(prompt) > _LONG_TEXT:
                return await asyncio.to_thread(self.llm.encode, prompt)
            return self.llm.encode(prompt)
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
    ) -> Job:
        """Admits one HTTP request and submits its prompts (one engine request each)."""
        self.admit()
        handles = []
        try:
            for ids, sp in zip(prompts, params):
                handles.append(self.llm.generate_async(ids, sp, streaming=stream))
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
