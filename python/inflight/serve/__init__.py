"""The OpenAI-compatible server: ``inflight serve MODEL`` (see :mod:`inflight.serve.server`).

``build_app(llm, model_name, max_queue_size)`` makes the FastAPI app of an in-process LLM;
``run_server(args)`` runs it under uvicorn with a graceful SIGTERM drain. Both are imported lazily,
so that ``inflight.serve.cli`` works without the ``serve`` extra installed.
"""

from __future__ import annotations

__all__ = ["build_app", "make_server", "run_server"]


def __getattr__(name: str):
    if name == "build_app":
        from inflight.serve.app import build_app

        return build_app
    if name in ("run_server", "make_server"):
        from inflight.serve import server

        return getattr(server, name)
    raise AttributeError(f"module 'inflight.serve' has no attribute {name!r}")
