"""The OpenAI-compatible HTTP API over one in-process :class:`~inflight.llm.LLM` (FastAPI).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming with SSE),
``GET /v1/models``, ``/health``, ``/metrics`` (Prometheus text), ``/version``.

The engine runs on its own worker thread; handlers only submit (``generate_async``) and await the
returned handles, so the event loop never blocks on the engine. A client that goes away cancels its
request (``handle.abort()``): a stream through the generator's cancellation, a plain request through a
task that waits for the ASGI ``http.disconnect`` message while the result is awaited.

Admission: a request is refused with 503 while the server drains (SIGTERM) or after the engine died,
and when ``max_queue_size`` requests are already in flight (accepted and not finished).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inflight.sampling_params import SamplingParams
from inflight.serve.metrics import ServerMetrics
from inflight.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    build_sampling_params,
    chat_logprobs,
    check_extra_fields,
    error_body,
    parse_messages,
    parse_prompt,
    validation_error_to_api_error,
)

logger = logging.getLogger("inflight.serve")

_DONE = b"data: [DONE]\n\n"
_END = object()


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _finite(x: float) -> float:
    # JSON has no -inf; a token of probability 0 gets vLLM's floor.
    return x if math.isfinite(x) else -9999.0


class ServerState:
    """What the handlers share: the engine, admission bookkeeping, metrics."""

    def __init__(self, llm, model_name: str, max_queue_size: int, aliases: tuple[str, ...] = ()):
        if isinstance(max_queue_size, bool) or not isinstance(max_queue_size, int) or max_queue_size < 1:
            raise ValueError(f"max_queue_size must be an integer >= 1, got {max_queue_size!r}")
        self.llm = llm
        self.model_name = model_name
        self.model_names = (model_name, *aliases)
        self.max_queue_size = max_queue_size
        self.in_flight = 0
        self.draining = False
        self.jobs: set[_Job] = set()
        self.created = int(time.time())
        self.metrics = ServerMetrics(llm, lambda: self.in_flight)
        self._token_strs: dict[int, str] = {}

    # -- engine facts
    @property
    def tokenizer(self):
        return getattr(self.llm, "tokenizer", None)

    def engine_alive(self) -> bool:
        return self.llm.is_alive

    def token_str(self, tid: int) -> str:
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
            raise APIError(404, f"The model `{name}` does not exist (this server serves "
                                f"{', '.join(repr(n) for n in self.model_names)}).",
                           param="model", code="model_not_found")

    def check_serving(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down and accepts no new requests",
                           type="service_unavailable", code="server_draining", headers={"Retry-After": "5"})
        if not self.engine_alive():
            raise APIError(503, "the inference engine is not running", type="service_unavailable",
                           code="engine_dead")

    def admit(self) -> None:
        self.check_serving()
        if self.in_flight >= self.max_queue_size:
            raise APIError(503, f"the server is busy: {self.in_flight} requests in flight (max_queue_size="
                                f"{self.max_queue_size}); retry later", type="service_unavailable",
                           code="queue_full", headers={"Retry-After": "1"})
        self.in_flight += 1

    def release(self, job: _Job | None) -> None:
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


class _Job:
    """One HTTP request's engine requests (one handle per prompt): metrics and cleanup."""

    def __init__(self, state: ServerState, handles: list, prompt_lens: list[int]):
        self.state = state
        self.handles = handles
        self.prompt_lens = prompt_lens
        self.final: list[Any] = [None] * len(handles)
        self.seen = [0] * len(handles)
        self.closed = False
        state.jobs.add(self)

    def observe(self, i: int, out) -> None:
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


async def _merge(handles: list) -> AsyncIterator[tuple[int, Any]]:
    """Streams several handles' outputs as (handle index, cumulative output), as they come."""
    if len(handles) == 1:
        async for out in handles[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, h) -> None:
        try:
            async for out in h:
                queue.put_nowait((i, out))
            queue.put_nowait((i, _END))
        except Exception as exc:  # noqa: BLE001  (handed to the consumer)
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _gather_unless_disconnected(request: Request, handles: list) -> list | None:
    """The handles' final outputs, or None when the client disconnected first."""
    results = asyncio.ensure_future(asyncio.gather(*handles))
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({results, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not results.done():
            results.cancel()
    if results.done() and not results.cancelled():
        return results.result()
    return None


class _SSEResponse(StreamingResponse):
    """A stream whose job is closed whatever happens, even if the body generator never started
    (a client that left before the response began)."""

    def __init__(self, content, job: _Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._job.close()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _failure(comp) -> APIError | None:
    if comp.finish_reason == "error":
        return APIError(500, f"the engine failed on this request: {comp.error or 'unknown error'}",
                        type="server_error", code="engine_error")
    if comp.finish_reason == "cancelled":
        return APIError(503, "the request was cancelled (the server is shutting down)", type="service_unavailable",
                        code="request_cancelled")
    return None


# ---------------------------------------------------------------------------------------------- logprobs


def _completion_logprobs(state: ServerState, token_ids: list[int], entries: list[dict], offset: int) -> dict:
    """OpenAI's legacy completions logprobs for some tokens (``offset``: text length before them)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        s = state.token_str(tid)
        tokens.append(s)
        token_lps.append(_finite(entry.get(tid, -math.inf)))
        tops.append({state.token_str(t): _finite(lp) for t, lp in entry.items()})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(state: ServerState, token_ids: list[int], entries: list[dict], top_n: int) -> dict:
    content = []
    for tid, entry in zip(token_ids, entries):
        s = state.token_str(tid)
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({
            "token": s, "logprob": _finite(entry.get(tid, -math.inf)), "bytes": list(s.encode()),
            "top_logprobs": [{"token": (ts := state.token_str(t)), "logprob": _finite(lp), "bytes": list(ts.encode())}
                             for t, lp in ranked],
        })
    return {"content": content}


def _new_entries(comp) -> tuple[list[int], list[dict]]:
    """The token ids and logprob entries of a streamed output's delta."""
    ids = comp.token_ids_diff
    if comp.logprobs is None:
        return ids, []
    start = len(comp.token_ids) - len(ids)
    return ids, comp.logprobs[start:start + len(ids)]


# ---------------------------------------------------------------------------------------------- the app


def build_app(llm, model_name: str, max_queue_size: int = 1024, *, aliases: tuple[str, ...] = (),
              version: str | None = None) -> FastAPI:
    """The FastAPI app serving ``llm`` as ``model_name`` (and any ``aliases``).

    ``max_queue_size``: most requests in flight (accepted, not finished); the next gets 503 at once.
    The app's :class:`ServerState` is ``app.state.server`` (``draining``, ``in_flight``, ``metrics``).
    """
    if version is None:
        from inflight import __version__ as version
    state = ServerState(llm, model_name, max_queue_size, tuple(aliases))
    app = FastAPI(title="inflight", version=version, docs_url=None, redoc_url=None)
    app.state.server = state

    # -------------------------------------------------------------------- errors
    def error_response(exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.code not in ("engine_error", "request_cancelled"):  # those are counted as they finish
            reason = exc.code or {400: "invalid_request", 404: "not_found"}.get(exc.status, str(exc.status))
            state.metrics.request_rejected.labels(reason=reason).inc()
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        state.metrics.request_rejected.labels(reason="invalid_request").inc()
        return error_response(validation_error_to_api_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)

    # -------------------------------------------------------------------- plain endpoints
    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse(error_body("the server is shutting down", "service_unavailable",
                                           code="server_draining"), status_code=503)
        if not state.engine_alive():
            return JSONResponse(error_body("the inference engine is not running", "service_unavailable",
                                           code="engine_dead"), status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def get_version():
        return {"version": version}

    @app.get("/v1/models")
    async def models():
        cfg = getattr(llm, "model_config", None)
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "inflight",
                 "root": model_name, "parent": None, "max_model_len": llm.max_seq_len,
                 "vocab_size": getattr(cfg, "vocab_size", None)} for name in state.model_names]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics():
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    # -------------------------------------------------------------------- shared request plumbing
    def check_fit(ids: list[int], params: SamplingParams, explicit_max: bool, prompt_field: str,
                  max_field: str) -> SamplingParams:
        limit = llm.max_seq_len
        n = len(ids)
        if n >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens, and the {prompt_field} has "
                              f"{n} tokens (at least one must be left for the output). Shorten the "
                              f"{prompt_field}.", param=prompt_field, code="context_length_exceeded")
        if not llm.args.enable_chunked_prefill and n > llm.args.max_num_tokens:
            raise bad_request(f"The {prompt_field} has {n} tokens, more than max_num_tokens={llm.args.max_num_tokens} "
                              "(the server was started without --enable-chunked-prefill).",
                              param=prompt_field, code="context_length_exceeded")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            if not explicit_max:  # the default (16 for completions) shrinks to what fits
                return params.replace(max_tokens=limit - n)
            raise bad_request(f"This model's maximum context length is {limit} tokens, but {n + params.max_tokens} "
                              f"were requested ({n} in the {prompt_field}, {params.max_tokens} for {max_field}). "
                              f"Reduce {max_field} or the {prompt_field}.", param=max_field,
                              code="context_length_exceeded")
        return params

    async def tokenize(prompt: str) -> list[int]:
        if len(prompt) > 4096:  # long prompts are tokenized off the event loop
            return await asyncio.to_thread(llm.encode, prompt)
        return llm.encode(prompt)

    def submit(prompts: list[list[int]], params: list[SamplingParams], stream: bool, prompt_field: str) -> _Job:
        state.admit()
        handles = []
        try:
            for ids, sp in zip(prompts, params):
                handles.append(llm.generate_async(ids, sp, streaming=stream))
        except Exception as exc:
            for h in handles:
                h.abort()
            state.release(None)
            if isinstance(exc, ValueError):
                msg = str(exc)
                param = "stop_token_ids" if msg.startswith("stop_token_ids") else prompt_field
                raise bad_request(msg, param=param) from None
            if isinstance(exc, RuntimeError):
                raise APIError(503, f"the inference engine is not accepting requests: {exc}",
                               type="service_unavailable", code="engine_dead") from None
            raise
        return _Job(state, handles, [len(p) for p in prompts])

    def header(kind: str, rid: str, created: int) -> dict:
        return {"id": rid, "object": kind, "created": created, "model": model_name}

    # -------------------------------------------------------------------- /v1/completions
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        state.check_model(body.model)
        state.check_serving()
        check_extra_fields(body)
        items = parse_prompt(body.prompt)
        base = build_sampling_params(body, body.max_tokens, body.logprobs)
        if state.tokenizer is None:
            if any(isinstance(p, str) for p in items):
                raise bad_request("prompt: this model has no tokenizer files, so prompts must be lists of token ids",
                                  param="prompt")
            if base.stop:
                raise bad_request("stop: this model has no tokenizer files; use stop_token_ids", param="stop")
        prompts = [await tokenize(p) if isinstance(p, str) else p for p in items]
        explicit = "max_tokens" in body.model_fields_set
        params = [check_fit(ids, base, explicit, "prompt", "max_tokens") for ids in prompts]
        job = submit(prompts, params, body.stream, "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        n = base.n
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _SSEResponse(_completion_stream(state, job, header("text_completion", rid, created), n,
                                                   include_usage), job)
        try:
            outs = await _gather_unless_disconnected(request, job.handles)
            if outs is None:
                return Response(status_code=499)  # the client is gone; nobody reads this
            for i, out in enumerate(outs):
                job.observe(i, out)
        finally:
            job.close()
        choices = []
        for i, out in enumerate(outs):
            for comp in out.outputs:
                if (err := _failure(comp)) is not None:
                    raise err
                choice = {"index": i * n + comp.index, "text": comp.text, "logprobs": None,
                          "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason,
                          "token_ids": comp.token_ids, "prompt_token_ids": out.prompt_token_ids}
                if comp.logprobs is not None:
                    choice["logprobs"] = _completion_logprobs(state, comp.token_ids, comp.logprobs, 0)
                choices.append(choice)
        usage = _usage(sum(job.prompt_lens), sum(len(c.token_ids) for o in outs for c in o.outputs))
        return JSONResponse({**header("text_completion", rid, created), "choices": choices, "usage": usage})

    # -------------------------------------------------------------------- /v1/chat/completions
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state.check_model(body.model)
        state.check_serving()
        check_extra_fields(body)
        messages = parse_messages(body.messages)
        if body.max_completion_tokens is not None:
            max_tokens, max_field = body.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_field = body.max_tokens, "max_tokens"
        top_n = chat_logprobs(body)
        params = build_sampling_params(body, max_tokens, top_n,
                                       rename={"max_tokens": max_field, "logprobs": "top_logprobs"})
        if state.tokenizer is None:
            raise bad_request("messages: this model has no tokenizer files, so it has no chat template; use "
                              "/v1/completions with token-id prompts", param="messages")
        try:
            if sum(len(m["content"]) for m in messages) > 4096:
                ids = await asyncio.to_thread(llm.apply_chat_template, messages, body.add_generation_prompt)
            else:
                ids = llm.apply_chat_template(messages, body.add_generation_prompt)
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
        except Exception as exc:  # noqa: BLE001  (a template that fails on these messages: jinja errors)
            raise bad_request(f"messages: the chat template failed: {type(exc).__name__}: {exc}",
                              param="messages") from None
        params = check_fit(ids, params, True, "messages", max_field)
        job = submit([ids], [params], body.stream, "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _SSEResponse(_chat_stream(state, job, header("chat.completion.chunk", rid, created), params.n,
                                             include_usage, top_n), job)
        try:
            outs = await _gather_unless_disconnected(request, job.handles)
            if outs is None:
                return Response(status_code=499)
            job.observe(0, outs[0])
        finally:
            job.close()
        out = outs[0]
        choices = []
        for comp in out.outputs:
            if (err := _failure(comp)) is not None:
                raise err
            choice = {"index": comp.index, "message": {"role": "assistant", "content": comp.text},
                      "logprobs": None, "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason,
                      "token_ids": comp.token_ids}
            if top_n is not None:
                choice["logprobs"] = _chat_logprobs(state, comp.token_ids, comp.logprobs or [], top_n)
            choices.append(choice)
        usage = _usage(len(ids), sum(len(c.token_ids) for c in out.outputs))
        return JSONResponse({**header("chat.completion", rid, created), "choices": choices, "usage": usage,
                             "prompt_token_ids": ids})

    return app


# ---------------------------------------------------------------------------------------------- streams


def _error_chunk(err: APIError) -> bytes:
    return _sse(err.body())


async def _completion_stream(state: ServerState, job: _Job, head: dict, n: int, include_usage: bool):
    finished: set[int] = set()
    offsets: dict[int, int] = {}
    try:
        async for i, out in _merge(job.handles):
            job.observe(i, out)
            for comp in out.outputs:
                idx = i * n + comp.index
                if idx in finished:
                    continue
                if (err := _failure(comp)) is not None:
                    yield _error_chunk(err)
                    yield _DONE
                    return
                if not comp.text_diff and not comp.token_ids_diff and comp.finish_reason is None:
                    continue
                ids, entries = _new_entries(comp)
                logprobs = None
                if comp.logprobs is not None:
                    logprobs = _completion_logprobs(state, ids, entries, offsets.get(idx, 0))
                offsets[idx] = offsets.get(idx, 0) + len(comp.text_diff)
                if comp.finish_reason is not None:
                    finished.add(idx)
                choice = {"index": idx, "text": comp.text_diff, "logprobs": logprobs,
                          "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason, "token_ids": ids}
                yield _sse({**head, "choices": [choice]})
        if include_usage:
            completion = sum(job.seen)
            yield _sse({**head, "choices": [], "usage": _usage(sum(job.prompt_lens), completion)})
        yield _DONE
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.exception("completion stream failed")
        yield _error_chunk(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))
        yield _DONE
    finally:
        job.close()


async def _chat_stream(state: ServerState, job: _Job, head: dict, n: int, include_usage: bool, top_n: int | None):
    finished: set[int] = set()
    try:
        for k in range(n):
            yield _sse({**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        async for _, out in _merge(job.handles):
            job.observe(0, out)
            for comp in out.outputs:
                if comp.index in finished:
                    continue
                if (err := _failure(comp)) is not None:
                    yield _error_chunk(err)
                    yield _DONE
                    return
                if not comp.text_diff and not comp.token_ids_diff and comp.finish_reason is None:
                    continue
                ids, entries = _new_entries(comp)
                delta = {"content": comp.text_diff} if comp.text_diff or comp.finish_reason is None else {}
                choice = {"index": comp.index, "delta": delta, "logprobs": None,
                          "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason, "token_ids": ids}
                if top_n is not None:
                    choice["logprobs"] = _chat_logprobs(state, ids, entries, top_n)
                if comp.finish_reason is not None:
                    finished.add(comp.index)
                yield _sse({**head, "choices": [choice]})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(sum(job.prompt_lens), sum(job.seen))})
        yield _DONE
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.exception("chat stream failed")
        yield _error_chunk(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))
        yield _DONE
    finally:
        job.close()
