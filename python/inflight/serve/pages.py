"""The web pages of ``inflight serve`` and the engine-stats feed they draw from.

- ``GET /``: the chat playground (``static/chat.html``): a conversation streamed from
  ``/v1/chat/completions``, with the sampling settings, a Stop button and per-answer timings.
- ``GET /dashboard``: the engine at work (``static/dashboard.html``), live from ``/v1/engine/stats``.
- ``GET /static/{name}``: their scripts and style sheet. Every asset ships in the wheel: no CDN.
- ``GET /v1/engine/stats``: server-sent events, a snapshot of the engine every 0.25 s (``?once=1``:
  one snapshot as JSON). A snapshot is the engine's own per-iteration stats (the same numbers
  ``/metrics`` reads): requests running / waiting / paused, each recent step's context-chunk and decode
  tokens against the token budget, KV blocks, the prefix-hit rate, generated tokens/s, preemptions, and
  the timelines of the last requests (queued, each prefill chunk, first token, end).

``inflight serve --no-web`` leaves the three pages out (the feed and the API stay).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, StreamingResponse

from inflight.serve.protocol import APIError
from inflight.serve.state import ServerState

STATIC = Path(__file__).with_name("static")
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".svg": "image/svg+xml"}
PERIOD_S = 0.25  # between two snapshots of the feed
STEPS = 120  # recent steps in a snapshot
REQUESTS = 32  # recent requests' timelines in a snapshot


async def _state(request: Request, model: str | None = None) -> ServerState:
    """The model of ``?model=`` (default: the first served)."""
    models = request.app.state.models
    state = models.lookup(model) if model is not None else models.default()
    if state is None:
        what = f"model {model!r} is not served" if model is not None else "no model is loaded"
        raise APIError(404, what, type="invalid_request_error", param="model", code="model_not_found")
    return state


State = Annotated[ServerState, Depends(_state)]


def _page(name: str) -> HTMLResponse:
    return HTMLResponse((STATIC / name).read_text(encoding="utf-8"), headers={"Cache-Control": "no-cache"})


async def chat_page():
    return _page("chat.html")


async def dashboard_page():
    return _page("dashboard.html")


async def static_file(name: str):
    path = STATIC / name
    if "/" in name or name.startswith(".") or path.suffix not in _TYPES or not path.is_file():
        raise APIError(404, f"no static file {name!r}", type="invalid_request_error", code="not_found")
    return FileResponse(path, media_type=_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})


class _Rate:
    """Generated tokens/s between two snapshots of one feed."""

    def __init__(self) -> None:
        self.last: tuple[float, int] | None = None

    def __call__(self, now: float, total: int) -> float:
        prev, self.last = self.last, (now, total)
        if prev is None or now <= prev[0]:
            return 0.0
        return (total - prev[1]) / (now - prev[0])


def engine_snapshot(state: ServerState, rate: _Rate | None = None) -> dict:
    """What the dashboard shows, at this moment."""
    llm = state.llm
    stats = llm.get_stats()
    last = stats[-1] if stats else {}
    kv = last.get("kv_cache_stats") or {}
    executor = llm.executor
    timelines = executor.timelines if executor is not None else None
    now = time.monotonic()
    steps = [
        {
            "iter": s["iter"],
            "context_tokens": max(0, s["num_tokens"] - s["num_generation_requests"]),
            "decode_tokens": s["num_generation_requests"],
            "latency_ms": round(s["iter_latency_ms"], 3),
            "paused": s["num_paused_requests"],
            "micro_batches": s.get("num_micro_batches_in_flight", 0),
        }
        for s in stats[-STEPS:]
        if s["num_tokens"] > 0
    ]

    def ago(t: float | None) -> float | None:
        return None if t is None else round(now - t, 4)

    requests = []
    if timelines is not None:
        for e in timelines.snapshot(REQUESTS):
            requests.append(
                {
                    "id": e["id"],
                    "prompt_tokens": e["prompt_tokens"],
                    "output_tokens": e["output_tokens"],
                    "queued_ago": ago(e["queued"]),
                    "chunks_ago": [[ago(t), n] for t, n in e["chunks"]],
                    "first_token_ago": ago(e["first_token"]),
                    "finished_ago": ago(e["finished"]),
                    "finish_reason": e["finish_reason"],
                    "preemptions": e["preemptions"],
                }
            )
    total_tokens = timelines.num_tokens if timelines is not None else 0
    return {
        "model": state.model_name,
        "parallel": last.get("parallel", llm.parallel if hasattr(llm, "parallel") else "tp=1 pp=1"),
        "time": time.time(),
        "iter": last.get("iter", 0),
        "alive": state.engine_alive(),
        "running": last.get("num_active_requests", 0),
        "waiting": last.get("num_waiting_requests", 0),
        "paused": last.get("num_paused_requests", 0),
        "in_flight": state.in_flight,
        "token_budget": llm.args.max_num_tokens,
        "max_batch_size": llm.args.max_batch_size,
        "kv": {
            "total": kv.get("max_num_blocks", 0),
            "used": kv.get("used_num_blocks", 0),
            "free": kv.get("free_num_blocks", 0),
            "reusable": kv.get("reusable_num_blocks", 0),
            "tokens_per_block": kv.get("tokens_per_block", 0),
            "hit_rate": kv.get("cache_hit_rate", 0.0),
            "reused_blocks": kv.get("reused_blocks", 0),
        },
        "generated_tokens": total_tokens,
        "tokens_per_s": rate(now, total_tokens) if rate is not None else 0.0,
        "preemptions": timelines.num_preemptions if timelines is not None else 0,
        "steps": steps,
        "requests": requests,
    }


async def engine_stats(state: State, request: Request, once: bool = False):
    if once:
        return JSONResponse(engine_snapshot(state))

    async def feed():
        rate = _Rate()
        while not state.draining and not await request.is_disconnected():
            yield f"data: {json.dumps(engine_snapshot(state, rate))}\n\n".encode()
            await asyncio.sleep(PERIOD_S)

    return StreamingResponse(feed(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# (method, path, endpoint): the pages (left out with --no-web) and the feed (always served).
PAGES = (
    ("GET", "/", chat_page),
    ("GET", "/dashboard", dashboard_page),
    ("GET", "/static/{name}", static_file),
)
FEED = (("GET", "/v1/engine/stats", engine_stats),)
