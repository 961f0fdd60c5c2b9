"""Server-sent event streams of ``/v1/completions`` and ``/v1/chat/completions`` (``stream: true``).

A stream merges its job's handles (several prompts, or ``n`` choices) as their outputs come, sends
one chunk per new piece of a choice, then the usage chunk when asked for
(``stream_options.include_usage``) and ``data: [DONE]``. A failed or cancelled output ends the
stream with an error chunk and ``[DONE]``. A client that goes away cancels the stream's generator,
and :class:`SSEResponse` closes the job (aborting what still runs) whatever happens.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from inflight.serve.protocol import APIError
from inflight.serve.responses import (
    chat_logprobs,
    completion_logprobs,
    failure,
    new_entries,
    prompt_logprobs,
    usage,
)
from inflight.serve.state import Job, ServerState

logger = logging.getLogger("inflight.serve")

DONE = b"data: [DONE]\n\n"
_END = object()


def sse(obj: dict) -> bytes:
    """One SSE event of a JSON object."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _internal_error(exc: Exception) -> bytes:
    return sse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").body())


async def merge(handles: list) -> AsyncIterator[tuple[int, Any]]:
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


class SSEResponse(StreamingResponse):
    """A stream whose job is closed whatever happens, even if the body generator never started
    (a client that left before the response began)."""

    def __init__(self, content, job: Job):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._job.close()


def _first_prompt_logprobs(state: ServerState, out, idx: int, sent: set[int] | None) -> dict:
    """vLLM's ``prompt_logprobs`` for choice ``idx``'s chunk: in the first chunk of the choice that goes
    out once the prompt's log-probabilities are known (they come with the first token, so in practice
    the choice's first chunk), then never again; nothing when the request did not ask (``sent`` None)."""
    if sent is None or idx in sent or out.prompt_logprobs is None:
        return {}
    sent.add(idx)
    return {"prompt_logprobs": prompt_logprobs(state, out.prompt_logprobs)}


async def completion_stream(
    state: ServerState, job: Job, head: dict, n: int, include_usage: bool, with_prompt_logprobs: bool = False
):
    """The chunks of a streamed completion: choice ``i * n + k`` is prompt ``i``'s ``k``-th. With
    ``with_prompt_logprobs`` a choice's first chunk also carries its prompt's ``prompt_logprobs``."""
    finished: set[int] = set()
    offsets: dict[int, int] = {}
    prompt_sent: set[int] | None = set() if with_prompt_logprobs else None
    try:
        async for i, out in merge(job.handles):
            job.observe(i, out)
            for comp in out.outputs:
                idx = i * n + comp.index
                if idx in finished:
                    continue
                if (err := failure(comp)) is not None:
                    yield sse(err.body())
                    yield DONE
                    return
                if not comp.text_diff and not comp.token_ids_diff and comp.finish_reason is None:
                    continue
                ids, entries = new_entries(comp)
                logprobs = None
                if comp.logprobs is not None:
                    logprobs = completion_logprobs(state, ids, entries, offsets.get(idx, 0))
                offsets[idx] = offsets.get(idx, 0) + len(comp.text_diff)
                if comp.finish_reason is not None:
                    finished.add(idx)
                choice = {
                    "index": idx,
                    "text": comp.text_diff,
                    "logprobs": logprobs,
                    "finish_reason": comp.finish_reason,
                    "stop_reason": comp.stop_reason,
                    "token_ids": ids,
                    **_first_prompt_logprobs(state, out, idx, prompt_sent),
                }
                yield sse({**head, "choices": [choice]})
        if include_usage:
            total = usage(sum(job.prompt_lens), sum(job.seen), job.final if job.predicted else None)
            yield sse({**head, "choices": [], "usage": total})
        yield DONE
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.exception("completion stream failed")
        yield _internal_error(exc)
        yield DONE
    finally:
        job.close()


async def chat_stream(
    state: ServerState,
    job: Job,
    head: dict,
    n: int,
    include_usage: bool,
    top_n: int | None,
    with_prompt_logprobs: bool = False,
):
    """The chunks of a streamed chat completion: a role chunk per choice, then the content deltas (with
    ``with_prompt_logprobs``, a choice's first content chunk carries ``prompt_logprobs``)."""
    finished: set[int] = set()
    prompt_sent: set[int] | None = set() if with_prompt_logprobs else None
    try:
        for k in range(n):
            role = {
                "index": k,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield sse({**head, "choices": [role]})
        async for _, out in merge(job.handles):
            job.observe(0, out)
            for comp in out.outputs:
                if comp.index in finished:
                    continue
                if (err := failure(comp)) is not None:
                    yield sse(err.body())
                    yield DONE
                    return
                if not comp.text_diff and not comp.token_ids_diff and comp.finish_reason is None:
                    continue
                ids, entries = new_entries(comp)
                delta = {"content": comp.text_diff} if comp.text_diff or comp.finish_reason is None else {}
                choice = {
                    "index": comp.index,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": comp.finish_reason,
                    "stop_reason": comp.stop_reason,
                    "token_ids": ids,
                }
                if top_n is not None:
                    choice["logprobs"] = chat_logprobs(state, ids, entries, top_n)
                choice.update(_first_prompt_logprobs(state, out, comp.index, prompt_sent))
                if comp.finish_reason is not None:
                    finished.add(comp.index)
                yield sse({**head, "choices": [choice]})
        if include_usage:
            total = usage(sum(job.prompt_lens), sum(job.seen), job.final if job.predicted else None)
            yield sse({**head, "choices": [], "usage": total})
        yield DONE
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.exception("chat stream failed")
        yield _internal_error(exc)
        yield DONE
    finally:
        job.close()
