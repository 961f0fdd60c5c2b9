"""A bound on the size of a request body, for every HTTP route (OpenAI's, KServe's, the pages').

:class:`BodyLimit` is ASGI middleware: a request whose ``Content-Length`` exceeds the limit gets 413 before
any of its body is read, and a body sent without a length (chunked) is counted as it arrives and cut off at
the limit, so a hostile client cannot make the server buffer or parse gigabytes of JSON. The 413 has
OpenAI's error body, naming the size and the limit (``inflight serve --max-request-bytes``).
"""

from __future__ import annotations

import json
from typing import Any

DEFAULT_MAX_REQUEST_BYTES = 64 * 2**20


def _body(message: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    return json.dumps({"error": error}).encode()


class BodyLimit:
    """ASGI middleware refusing request bodies over ``max_bytes`` with 413 (None: no limit)."""

    def __init__(self, app, max_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES, on_refused=None) -> None:
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 (or None for no limit), got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused  # called once per refused request (metrics)

    async def _refuse(self, send, message: str) -> None:
        if self.on_refused is not None:
            self.on_refused()
        body = _body(message)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers.append((b"connection", b"close"))  # the rest of the body is not read
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        limit = self.max_bytes
        if scope["type"] != "http" or limit is None:
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = None
                if length is not None and length > limit:
                    await self._refuse(
                        send, f"the request body is {length} bytes; this server accepts at most {limit}"
                    )
                    return
                break
        received = 0
        cut = False
        started = False

        async def limited_receive():
            nonlocal received, cut
            if cut:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    cut = True  # the app sees a client that went away; this middleware answers
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message) -> None:
            nonlocal started
            if cut:
                return  # the app's answer to the cut body is replaced by the 413
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not cut:
                raise
        if cut and not started:
            await self._refuse(send, f"the request body exceeds {limit} bytes, the most this server accepts")
