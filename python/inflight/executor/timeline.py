"""The recent requests' timelines, for the engine dashboard: when each was queued, each context chunk it
ran (and how many tokens), its first token, its end (and why). Written by the executor loop, read by
any thread (``snapshot`` copies under a lock); bounded to the last ``capacity`` requests."""

from __future__ import annotations

import collections
import threading
import time


class Timelines:
    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[int, dict] = collections.OrderedDict()
        self.num_preemptions = 0  # since start
        self.num_tokens = 0  # generated since start

    def _entry(self, request_id: int) -> dict | None:
        return self._entries.get(request_id)

    def queued(self, request_id: int, prompt_len: int, arrival: float) -> None:
        with self._lock:
            self._entries[request_id] = {
                "id": request_id,
                "prompt_tokens": prompt_len,
                "queued": arrival,
                "chunks": [],  # [time, tokens] per context chunk
                "first_token": None,
                "finished": None,
                "finish_reason": None,
                "output_tokens": 0,
                "preemptions": 0,
            }
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def chunk(self, request_id: int, tokens: int) -> None:
        with self._lock:
            e = self._entry(request_id)
            if e is not None:
                e["chunks"].append([time.monotonic(), tokens])

    def token(self, request_id: int) -> None:
        with self._lock:
            self.num_tokens += 1
            e = self._entry(request_id)
            if e is not None:
                e["output_tokens"] += 1
                if e["first_token"] is None:
                    e["first_token"] = time.monotonic()

    def preempted(self, request_id: int) -> None:
        with self._lock:
            self.num_preemptions += 1
            e = self._entry(request_id)
            if e is not None:
                e["preemptions"] += 1

    def finished(self, request_id: int, reason: str | None) -> None:
        with self._lock:
            e = self._entry(request_id)
            if e is not None and e["finished"] is None:
                e["finished"] = time.monotonic()
                e["finish_reason"] = reason

    def snapshot(self, limit: int | None = None) -> list[dict]:
        """Copies of the last ``limit`` requests' entries, oldest first (times are time.monotonic())."""
        with self._lock:
            entries = list(self._entries.values())
            if limit is not None:
                entries = entries[-limit:]
            return [{**e, "chunks": [list(c) for c in e["chunks"]]} for e in entries]
