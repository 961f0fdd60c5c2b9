"""The published OpenAPI schema: the response bodies and the status codes each endpoint really returns.

The handlers build their bodies as plain dicts (the streams as SSE); the models here describe those
bodies for ``/openapi.json``, so that schema-driven clients and fuzzers see what the server does:
200 with the body below (or ``text/event-stream`` when ``stream`` is true), and the errors of
``docs/api.md`` with OpenAI's error body — 400 for any invalid request (never FastAPI's 422), 404 for
an unknown model, 500 for an engine failure, 503 while draining, when the engine is dead or stalled,
or when the queue is full. ``tests/python/test_schema_fuzz.py`` checks real responses against it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int]
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # with the request's prompt_logprobs


class CompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int]
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # with the request's prompt_logprobs


class ChatCompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int]


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: int
    vocab_size: int | None = None


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: str


class VersionResponse(BaseModel):
    version: str


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


def _errors(*codes: int) -> dict[int, dict[str, Any]]:
    text = {
        400: "invalid request",
        404: "unknown model",
        413: "request body over the server's --max-request-bytes",
        500: "engine failure",
        503: "draining, engine not running or stalled, or the queue is full",
    }
    return {code: {"model": ErrorResponse, "description": text[code]} for code in codes}


_SSE = {"text/event-stream": {"schema": {"type": "string"}}}

# path -> the route's documented responses (FastAPI's ``responses=``).
RESPONSES: dict[str, dict[int, dict[str, Any]]] = {
    "/health": {200: {"model": HealthResponse}, **_errors(503)},
    "/version": {200: {"model": VersionResponse}},
    "/v1/models": {200: {"model": ModelList}},
    "/metrics": {
        200: {
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "description": "Prometheus text format",
        }
    },
    "/v1/completions": {
        200: {"model": CompletionResponse, "content": _SSE},
        **_errors(400, 404, 413, 500, 503),
    },
    "/v1/chat/completions": {
        200: {"model": ChatCompletionResponse, "content": _SSE},
        **_errors(400, 404, 413, 500, 503),
    },
    "/tokenize": {200: {"model": TokenizeResponse}, **_errors(400, 404, 413)},
    "/detokenize": {200: {"model": DetokenizeResponse}, **_errors(400, 404, 413)},
}


def _ranges(vocab_size: int, max_seq_len: int, max_n: int, max_logprobs: int) -> dict[str, dict[str, Any]]:
    """The request fields' allowed ranges (the checks of SamplingParams and of the engine) as JSON
    Schema keywords, with this model's vocabulary, context and n."""
    token_ids = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
    }
    max_new = {"minimum": 1, "maximum": max_seq_len - 1}
    return {
        "n": {"minimum": 1, "maximum": max_n},
        "max_tokens": max_new,
        "max_completion_tokens": max_new,
        "min_tokens": {"minimum": 0, "maximum": max_seq_len - 1},
        "temperature": {"minimum": 0},
        "top_p": {"exclusiveMinimum": 0, "maximum": 1},
        "min_p": {"minimum": 0, "maximum": 1},
        "top_k": {"minimum": -1},
        "repetition_penalty": {"minimum": 1e-6, "maximum": 1e6},
        "presence_penalty": {"minimum": -2, "maximum": 2},
        "frequency_penalty": {"minimum": -2, "maximum": 2},
        "logprobs": {"minimum": 0, "maximum": max_logprobs},
        "prompt_logprobs": {"minimum": 0, "maximum": max_logprobs},
        "top_logprobs": {"minimum": 0, "maximum": max_logprobs},
        "seed": {"minimum": 0, "maximum": 2**63 - 1},
        "prompt": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                token_ids,
                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                {"type": "array", "minItems": 1, "items": token_ids},
            ]
        },
        "stop_token_ids": {"anyOf": [token_ids, {"type": "null"}]},
    }


def install_openapi(app: FastAPI, llm: Callable[[], Any]) -> None:
    """Replaces FastAPI's generated schema by one without the 422 it never returns, and with the
    ranges of the request fields: those of the LLM ``llm()`` gives when the schema is first built (its
    vocabulary and context, ``max_n`` and ``max_logprobs``; none when it gives None)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            engine = llm()
            ranges = (
                _ranges(
                    engine.model_config.vocab_size,
                    engine.max_seq_len,
                    engine.args.max_n,
                    engine.args.max_logprobs,
                )
                if engine is not None
                else {}
            )
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                for field, prop in components.get(name, {}).get("properties", {}).items():
                    if field in ranges:
                        if "anyOf" in ranges[field]:
                            prop.pop("anyOf", None)
                            prop.pop("type", None)
                        prop.update(ranges[field])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
