"""The OpenAI-compatible server, ``inflight serve MODEL`` (:mod:`inflight.serve.server`: the command
and the uvicorn server with its graceful SIGTERM drain), and its load generator, ``inflight bench
serve`` (:mod:`inflight.serve.bench`).

``build_app(llm, model_name, max_queue_size)`` makes the FastAPI app of an in-process LLM
(:mod:`inflight.serve.app`). It is imported on first use: it needs FastAPI (the ``serve`` extra),
and this package must import without it so that ``inflight --help`` works. Nothing else is
imported here, so that ``python -m inflight.serve.server`` runs its module only once.
"""

from __future__ import annotations

__all__ = ["build_app"]


def __getattr__(name: str):
    if name == "build_app":
        # An optional-dependency boundary: inflight.serve.app imports fastapi.
        from inflight.serve.app import build_app

        return build_app
    raise AttributeError(f"module 'inflight.serve' has no attribute {name!r}")
