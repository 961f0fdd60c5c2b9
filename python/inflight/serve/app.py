"""The OpenAI-compatible HTTP API over one in-process :class:`~inflight.llm.LLM` (FastAPI).

:func:`build_app` creates the app of one model: its :class:`~inflight.serve.state.ServerState`
(admission, metrics; ``app.state.server``) in a :class:`~inflight.serve.state.ModelSet`
(``app.state.models``, which :func:`build_models_app` takes for a model repository), the error handlers (every error has OpenAI's body,
``{"error": {"message", "type", "param", "code"}}``) and the routes of :mod:`inflight.serve.routes`.
The endpoints, admission and streaming are described in :mod:`inflight.serve.routes`,
:mod:`inflight.serve.state` and :mod:`inflight.serve.streaming`; the request bodies in
:mod:`inflight.serve.protocol`; the metrics in :mod:`inflight.serve.metrics`. The HTTP API as a
whole: ``docs/api.md``.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inflight import __version__
from inflight.serve.kserve import ROUTES as KSERVE_ROUTES
from inflight.serve.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from inflight.serve.pages import FEED, PAGES
from inflight.serve.protocol import APIError, error_body, validation_error_to_api_error
from inflight.serve.routes import ROUTES
from inflight.serve.schema import RESPONSES, install_openapi
from inflight.serve.state import ModelSet, ServerState, SingleModel

__all__ = ["ModelSet", "ServerState", "build_app", "build_models_app"]

logger = logging.getLogger("inflight.serve")


def build_app(
    llm,
    model_name: str,
    max_queue_size: int = 1024,
    *,
    aliases: tuple[str, ...] = (),
    version: str | None = None,
    stall_timeout: float = 120.0,
    web: bool = True,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The FastAPI app serving ``llm`` as ``model_name`` (and any ``aliases``).

    ``max_queue_size``: most requests in flight (accepted, not finished); the next gets 503 at once.
    The app's :class:`ServerState` is ``app.state.server`` (``draining``, ``in_flight``, ``metrics``).
    ``version`` (``GET /version``): inflight's by default. ``stall_timeout``: seconds without engine
    progress (work pending) after which ``/health`` answers 503. ``web``: serve the chat page (``/``)
    and the dashboard (``/dashboard``) of :mod:`inflight.serve.pages`; the engine-stats feed is served
    either way. ``max_request_bytes``: the largest request body (413 above it; None: no limit).
    """
    models = SingleModel(
        llm,
        model_name,
        max_queue_size,
        tuple(aliases),
        version=version if version is not None else __version__,
        stall_timeout=stall_timeout,
    )
    app = build_models_app(models, web=web, max_request_bytes=max_request_bytes)
    app.state.server = models.state
    return app


def build_models_app(
    models: ModelSet, *, web: bool = True, max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES
) -> FastAPI:
    """The app over a :class:`ModelSet` (``app.state.models``): one model, or a model repository's
    (:mod:`inflight.serve.repository`, whose routes this adds). Request bodies over
    ``max_request_bytes`` get 413 (:class:`~inflight.serve.limits.BodyLimit`)."""
    app = FastAPI(title="inflight", version=models.version, docs_url=None, redoc_url=None)
    app.state.models = models
    app.state.max_request_bytes = max_request_bytes  # the gRPC API's message limit too
    refused = models.metrics.request_rejected.labels(reason="request_too_large")
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, on_refused=refused.inc)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method], response_model=None, responses=RESPONSES[path])
    # Triton's KServe v2 routes (outside the OpenAPI schema of the OpenAI API).
    for method, path, endpoint in KSERVE_ROUTES:
        app.add_api_route(path, endpoint, methods=[method], response_model=None, include_in_schema=False)
    # Outside the OpenAPI schema: HTML pages, assets, and an endless event stream.
    for method, path, endpoint in (PAGES if web else ()) + FEED:
        app.add_api_route(path, endpoint, methods=[method], response_model=None, include_in_schema=False)

    def default_llm():
        state = models.default()
        return state.llm if state is not None else None

    install_openapi(app, default_llm)
    return app


# ---------------------------------------------------------------------------------------------- errors


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    if exc.code not in ("engine_error", "request_cancelled"):  # those are counted as they finish
        reason = exc.code or {400: "invalid_request", 404: "not_found"}.get(exc.status, str(exc.status))
        request.app.state.models.metrics.request_rejected.labels(reason=reason).inc()
    return _error_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    request.app.state.models.metrics.request_rejected.labels(reason="invalid_request").inc()
    return _error_response(validation_error_to_api_error(list(exc.errors())))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(error_body(message, kind), status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    body = error_body(f"internal server error: {type(exc).__name__}: {exc}", "server_error")
    return JSONResponse(body, status_code=500)
