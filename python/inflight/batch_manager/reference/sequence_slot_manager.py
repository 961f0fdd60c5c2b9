"""Pure-Python twin of ``SequenceSlotManager``: ``csrc/batch_manager/sequence_slot_manager.cpp``
and ``csrc/include/inflight/batch_manager/sequence_slot_manager.h``.

Maps request ids to dense slots in ``[0, max_num_slots)``, so that per-slot buffers can be indexed
by slot.

Data and its invariants:

* ``_free_slots`` is a FIFO: it starts as ``0 .. max_num_slots - 1``, a slot is taken from the
  front and a freed slot goes to the back. ``_slots`` (request id -> slot) and ``_free_slots``
  partition the slots: every slot is in exactly one of them, once.
* ``_last_used`` has the same keys as ``_slots``: the ``time.monotonic()`` of the last
  ``get_sequence_slot`` for that request (the C++ uses ``steady_clock``).
* ``free_idle_sequence_slots`` frees in slot order, not in dict order, so the free FIFO (and so
  the slots handed out next) does not depend on hashing.

Semantics: ``docs/batch-manager.md``.
"""

from __future__ import annotations

import time
from collections import deque

__all__ = ["SequenceSlotManager"]


class SequenceSlotManager:
    """Request ids -> dense slots in [0, max_num_slots). Free slots form a FIFO (freed to the back)."""

    def __init__(self, max_num_slots: int, max_idle_seconds: float = 180.0) -> None:
        if max_num_slots < 1:
            raise ValueError(f"max_num_slots must be >= 1, got {max_num_slots}")
        if not max_idle_seconds >= 0:
            raise ValueError(f"max_idle_seconds must be >= 0, got {max_idle_seconds}")
        self._max_num_slots = max_num_slots
        self._max_idle_seconds = float(max_idle_seconds)
        self._free_slots: deque[int] = deque(range(max_num_slots))
        self._slots: dict[int, int] = {}  # request id -> slot
        self._last_used: dict[int, float] = {}  # request id -> time.monotonic()

    @property
    def max_num_slots(self) -> int:
        return self._max_num_slots

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_used_slots(self) -> int:
        return len(self._slots)

    def get_sequence_slot(self, start: bool, request_id: int) -> int | None:
        """The request's slot (refreshing its time), else a new one when ``start``; None when full."""
        if request_id in self._slots:
            self._last_used[request_id] = time.monotonic()
            return self._slots[request_id]
        if not start or not self._free_slots:
            return None
        slot = self._free_slots.popleft()
        self._slots[request_id] = slot
        self._last_used[request_id] = time.monotonic()
        return slot

    def free_sequence_slot(self, request_id: int) -> None:
        """Frees the request's slot; unknown ids are ignored."""
        slot = self._slots.pop(request_id, None)
        if slot is None:
            return
        del self._last_used[request_id]
        self._free_slots.append(slot)

    def free_idle_sequence_slots(self) -> list[int]:
        """Frees the slots unused for longer than max_idle_seconds, in slot order (so the free FIFO
        stays deterministic); returns their request ids."""
        now = time.monotonic()
        idle = sorted(
            (slot, request_id)
            for request_id, slot in self._slots.items()
            if now - self._last_used[request_id] > self._max_idle_seconds
        )
        for _, request_id in idle:
            self.free_sequence_slot(request_id)
        return [request_id for _, request_id in idle]
