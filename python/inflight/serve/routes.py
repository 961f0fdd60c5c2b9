"""The endpoints, as plain functions of the server state and the request: ``GET /health``,
``/version``, ``/v1/models``, ``/metrics`` (Prometheus text), ``POST /v1/completions`` and
``/v1/chat/completions`` (both streaming with SSE, :mod:`inflight.serve.streaming`), vLLM's ``POST
/tokenize`` and ``/detokenize``.

Each takes the served :class:`~inflight.serve.state.ModelSet` as ``models`` (FastAPI passes
``app.state.models`` through the :data:`Models` dependency), the completions look up the request's
``model`` there (no ``model``: the first served), and each raises
:class:`~inflight.serve.protocol.APIError` for a request it refuses; :data:`ROUTES` lists them for
:func:`~inflight.serve.app.build_app`.

A client that goes away cancels its request (``handle.abort()``): a stream through the generator's
cancellation, a plain request through a task that waits for the ASGI ``http.disconnect`` message
while the result is awaited.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response

from inflight.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    build_sampling_params,
    check_extra_fields,
    error_body,
    guided_field,
    parse_messages,
    parse_prompt,
)
from inflight.serve.protocol import chat_logprobs as requested_top_logprobs
from inflight.serve.responses import (
    chat_logprobs,
    completion_logprobs,
    failure,
    header,
    prompt_logprobs,
    usage,
)
from inflight.serve.state import ModelSet, ServerState
from inflight.serve.streaming import SSEResponse, chat_stream, completion_stream


async def served_models(request: Request) -> ModelSet:
    # async: FastAPI would run a plain function on a worker thread.
    return request.app.state.models


Models = Annotated[ModelSet, Depends(served_models)]


# ---------------------------------------------------------------------------------------------- plain endpoints


async def health(models: Models):
    if models.draining or any(s.draining for s in models.serving()):
        body = error_body("the server is shutting down", "service_unavailable", code="server_draining")
        return JSONResponse(body, status_code=503)
    for state in models.serving():
        if not state.engine_alive():
            body = error_body(
                f"the inference engine of '{state.model_name}' is not running",
                "service_unavailable",
                code="engine_dead",
            )
            return JSONResponse(body, status_code=503)
        if state.engine_stalled():
            message = (
                f"the inference engine of '{state.model_name}' has made no progress for "
                f"{state.llm.stall_seconds:.0f} s with work pending (stall timeout {state.stall_timeout:g} s)"
            )
            return JSONResponse(
                error_body(message, "service_unavailable", code="engine_stalled"), status_code=503
            )
    return {"status": "ok"}


async def get_version(models: Models):
    return {"version": models.version}


async def list_models(models: Models):
    data = []
    for state in models.serving():
        llm = state.llm
        data += [
            {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "inflight",
                "root": state.model_name,
                "parent": None,
                "max_model_len": llm.max_seq_len,
                "vocab_size": llm.model_config.vocab_size,
            }
            for name in state.model_names
        ]
    return {"object": "list", "data": data}


async def metrics(models: Models):
    body, content_type = models.metrics.render()
    return Response(body, media_type=content_type)


# ---------------------------------------------------------------------------------------------- /tokenize


def _tokenizer_of(state: ServerState, field: str):
    if state.tokenizer is None:
        raise bad_request(f"{field}: this model has no tokenizer files", param=field)
    return state.tokenizer


async def tokenize(models: Models, body: TokenizeRequest):
    """vLLM's: the token ids a prompt or a conversation becomes here (as the completion endpoints
    tokenise it), their count and the context they must fit (``max_model_len``)."""
    state = models.openai_state(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    if body.prompt is not None:
        _tokenizer_of(state, "prompt")
        ids = await state.tokenize(body.prompt, body.add_special_tokens is not False)
    else:
        if body.add_special_tokens:
            raise bad_request(
                "add_special_tokens: with messages the chat template places the special tokens; only false "
                "is accepted",
                param="add_special_tokens",
            )
        ids = await _chat_prompt(state, parse_messages(body.messages), body.add_generation_prompt)
    strs = state.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.llm.max_seq_len, "tokens": ids, "token_strs": strs}


async def detokenize(models: Models, body: DetokenizeRequest):
    """vLLM's: the text of a list of token ids (special tokens included); an id outside the
    vocabulary is a 400 naming its position, its value and the vocabulary size."""
    state = models.openai_state(body.model)
    ids = body.tokens
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("tokens must be a list of integer token ids", param="tokens")
    vocab = state.llm.model_config.vocab_size
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(
            f"tokens[{bad}] = {ids[bad]} is outside the vocabulary [0, {vocab})", param=f"tokens[{bad}]"
        )
    tok = _tokenizer_of(state, "tokens")
    text = await asyncio.to_thread(tok.decode, ids) if len(ids) > 4096 else tok.decode(ids)
    return {"prompt": text}


# ---------------------------------------------------------------------------------------------- disconnects


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


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


# ---------------------------------------------------------------------------------------------- /v1/completions


async def completions(models: Models, body: CompletionRequest, request: Request):
    state = models.openai_state(body.model)
    state.check_serving()
    check_extra_fields(body)
    items = parse_prompt(body.prompt)
    base = build_sampling_params(body, body.max_tokens, body.logprobs)
    if state.tokenizer is None:
        if any(isinstance(p, str) for p in items):
            raise bad_request(
                "prompt: this model has no tokenizer files, so prompts must be lists of token ids",
                param="prompt",
            )
        if base.stop:
            raise bad_request("stop: this model has no tokenizer files; use stop_token_ids", param="stop")
    prompts = [await state.tokenize(p) if isinstance(p, str) else p for p in items]
    explicit = "max_tokens" in body.model_fields_set
    params = [state.check_fit(ids, base, explicit, "prompt", "max_tokens") for ids in prompts]
    job = state.submit(prompts, params, body.stream, "prompt", guided_field(body))
    head = header(state, "text_completion", f"cmpl-{uuid.uuid4().hex}", int(time.time()))
    n = base.n
    if body.stream:
        stream = completion_stream(
            state, job, head, n, _include_usage(body), body.prompt_logprobs is not None
        )
        return SSEResponse(stream, job)
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
            if (err := failure(comp)) is not None:
                raise err
            choice = {
                "index": i * n + comp.index,
                "text": comp.text,
                "logprobs": None,
                "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason,
                "token_ids": comp.token_ids,
                "prompt_token_ids": out.prompt_token_ids,
            }
            if comp.logprobs is not None:
                choice["logprobs"] = completion_logprobs(state, comp.token_ids, comp.logprobs, 0)
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(state, out.prompt_logprobs)
            choices.append(choice)
    total = usage(
        sum(job.prompt_lens),
        sum(len(c.token_ids) for o in outs for c in o.outputs),
        outs if job.predicted else None,
    )
    return JSONResponse({**head, "choices": choices, "usage": total})


# ---------------------------------------------------------------------------------------------- /v1/chat/completions


async def _chat_prompt(
    state: ServerState, messages: list[dict[str, str]], add_generation_prompt: bool
) -> list[int]:
    if state.tokenizer is None:
        raise bad_request(
            "messages: this model has no tokenizer files, so it has no chat template; use "
            "/v1/completions with token-id prompts",
            param="messages",
        )
    try:
        return await state.apply_chat_template(messages, add_generation_prompt)
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None
    except Exception as exc:  # noqa: BLE001  (a template that fails on these messages: jinja errors)
        raise bad_request(
            f"messages: the chat template failed: {type(exc).__name__}: {exc}", param="messages"
        ) from None


async def chat_completions(models: Models, body: ChatCompletionRequest, request: Request):
    state = models.openai_state(body.model)
    state.check_serving()
    check_extra_fields(body)
    messages = parse_messages(body.messages)
    if body.max_completion_tokens is not None:
        max_tokens, max_field = body.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_field = body.max_tokens, "max_tokens"
    top_n = requested_top_logprobs(body)
    params = build_sampling_params(
        body, max_tokens, top_n, rename={"max_tokens": max_field, "logprobs": "top_logprobs"}
    )
    ids = await _chat_prompt(state, messages, body.add_generation_prompt)
    params = state.check_fit(ids, params, True, "messages", max_field)
    job = state.submit([ids], [params], body.stream, "messages", guided_field(body))
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        head = header(state, "chat.completion.chunk", rid, created)
        stream = chat_stream(
            state, job, head, params.n, _include_usage(body), top_n, body.prompt_logprobs is not None
        )
        return SSEResponse(stream, job)
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
        if (err := failure(comp)) is not None:
            raise err
        choice = {
            "index": comp.index,
            "message": {"role": "assistant", "content": comp.text},
            "logprobs": None,
            "finish_reason": comp.finish_reason,
            "stop_reason": comp.stop_reason,
            "token_ids": comp.token_ids,
        }
        if top_n is not None:
            choice["logprobs"] = chat_logprobs(state, comp.token_ids, comp.logprobs or [], top_n)
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(state, out.prompt_logprobs)
        choices.append(choice)
    total = usage(len(ids), sum(len(c.token_ids) for c in out.outputs), outs if job.predicted else None)
    return JSONResponse(
        {
            **header(state, "chat.completion", rid, created),
            "choices": choices,
            "usage": total,
            "prompt_token_ids": ids,
        }
    )


# (method, path, endpoint) of every route, for build_app.
ROUTES = (
    ("GET", "/health", health),
    ("GET", "/version", get_version),
    ("GET", "/v1/models", list_models),
    ("GET", "/metrics", metrics),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
)
