"""Triton's dynamic batcher in front of the engine's in-flight batching: one per model whose config has
``dynamic_batching``.

The engine batches every step by itself; what the batcher adds is Triton's admission in front of it.
A request (of ``rows`` rows) waits in the model's queue until a batch is released to the engine. A
batch is released when the queue holds a preferred batch size (``preferred_batch_size``; the largest
that fits is taken), when it holds the largest batch the engine can take, or when its oldest request
has waited ``max_queue_delay_microseconds``, and only as far as the engine has room: the rows
released and not finished stay at most ``capacity`` (the engine's ``max_batch_size``). So while the
engine is full the queue fills, and the queue's order decides who runs next: priority level first
(1 is the highest of ``priority_levels``; 0 means ``default_priority_level``), then arrival.

Each priority level has a queue policy (``default_queue_policy``, or ``priority_queue_policy[level]``):
``max_queue_size`` (0: unbounded) refuses a request beyond it at once with "Exceeds maximum queue
size" (503 / UNAVAILABLE); ``default_timeout_microseconds`` (a request may override it with its
``timeout`` parameter when ``allow_timeout_override``) bounds its wait in the queue, after which
``timeout_action`` REJECT fails it ("Request timeout expired") and DELAY moves it behind every request
that has not timed out. The engine priority of a request follows its level (level 1 of N: 1.0, level
N: 1/N), so the engine's own queue keeps the same order.

Everything runs on the server's event loop (no threads): :meth:`DynamicBatcher.acquire` waits for a
request's release, :meth:`DynamicBatcher.release` returns its rows when it finished.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

QUEUE_FULL = "Exceeds maximum queue size"
TIMED_OUT = "Request timeout expired"


class BatcherError(Exception):
    """A request the batcher refuses: ``status`` is the HTTP status (400 bad parameter, 503 queue)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's ModelQueuePolicy."""

    timeout_action: str = "REJECT"  # or "DELAY"
    default_timeout_us: int = 0  # 0: no timeout
    allow_timeout_override: bool = False
    max_queue_size: int = 0  # 0: unbounded

    @classmethod
    def from_proto(cls, p) -> QueuePolicy:
        from tritonclient.grpc import model_config_pb2

        action = model_config_pb2.ModelQueuePolicy.TimeoutAction.Name(p.timeout_action)
        return cls(
            action, int(p.default_timeout_microseconds), bool(p.allow_timeout_override), int(p.max_queue_size)
        )


@dataclass(frozen=True)
class BatchingPolicy:
    """Triton's ModelDynamicBatching, as this batcher applies it."""

    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    priority_levels: int = 0
    default_priority_level: int = 0
    default_queue_policy: QueuePolicy = field(default_factory=QueuePolicy)
    priority_queue_policy: dict[int, QueuePolicy] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, db) -> BatchingPolicy:
        """From a ``ModelConfig.dynamic_batching`` message; an inconsistent one is a ValueError."""
        levels = int(db.priority_levels)
        default = int(db.default_priority_level)
        if levels and not 1 <= default <= levels:
            raise ValueError(
                f"dynamic_batching.default_priority_level must be in [1, {levels}] when priority_levels is "
                f"{levels}, got {default}"
            )
        sizes = tuple(sorted(int(s) for s in db.preferred_batch_size))
        if any(s < 1 for s in sizes):
            raise ValueError(f"dynamic_batching.preferred_batch_size must be >= 1, got {list(sizes)}")
        per_level = {}
        for level, p in db.priority_queue_policy.items():
            if not 1 <= level <= max(levels, 1):
                raise ValueError(
                    f"dynamic_batching.priority_queue_policy has level {level} outside [1, {levels}]"
                )
            per_level[int(level)] = QueuePolicy.from_proto(p)
        return cls(
            sizes,
            int(db.max_queue_delay_microseconds),
            levels,
            default,
            QueuePolicy.from_proto(db.default_queue_policy),
            per_level,
        )

    def level(self, requested: int) -> int:
        """The priority level of a request that asked for ``requested`` (0: the default)."""
        if not self.priority_levels:
            if requested:
                raise BatcherError(
                    400, "parameter 'priority' needs priority_levels in the model's dynamic_batching"
                )
            return 0
        if requested == 0:
            return self.default_priority_level
        if not 1 <= requested <= self.priority_levels:
            raise BatcherError(
                400,
                f"parameter 'priority' must be in [1, {self.priority_levels}] (priority_levels), got {requested}",
            )
        return requested

    def engine_priority(self, level: int) -> float:
        """The engine's request priority (0-1, higher first) of a level."""
        if not self.priority_levels or level == 0:
            return 0.5
        return (self.priority_levels - level + 1) / self.priority_levels

    def queue_policy(self, level: int) -> QueuePolicy:
        return self.priority_queue_policy.get(level, self.default_queue_policy)


class Ticket:
    """One request's place in the queue."""

    __slots__ = (
        "arrival",
        "deadline",
        "delayed",
        "done",
        "future",
        "level",
        "policy",
        "released_at",
        "rows",
        "seq",
    )

    def __init__(self, rows: int, level: int, policy: QueuePolicy, seq: int, arrival: float, deadline):
        self.rows = rows
        self.level = level
        self.policy = policy
        self.seq = seq
        self.arrival = arrival
        self.deadline = deadline
        self.delayed = False
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.released_at: float | None = None
        self.done = False  # its rows were given back

    @property
    def queue_seconds(self) -> float:
        return (self.released_at or self.arrival) - self.arrival

    def sort_key(self):
        return (self.delayed, self.level, self.seq)


class DynamicBatcher:
    """The queue of one model (see the module doc). ``on_execution`` is called once per released batch."""

    def __init__(self, policy: BatchingPolicy, capacity: int, on_execution=None):
        self.policy = policy
        self.capacity = max(1, capacity)
        self.executing = 0  # rows released and not finished
        self._queue: list[Ticket] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._on_execution = on_execution

    def queued(self) -> int:
        """Requests waiting in the queue."""
        return len(self._queue)

    async def acquire(self, rows: int, priority: int = 0, timeout_us: int | None = None) -> Ticket:
        """Waits until the request is released to the engine; raises :class:`BatcherError` when it is
        refused (a full queue at once, a timeout with REJECT later)."""
        level = self.policy.level(priority)
        policy = self.policy.queue_policy(level)
        if policy.max_queue_size and sum(t.level == level for t in self._queue) >= policy.max_queue_size:
            raise BatcherError(503, QUEUE_FULL)
        timeout = policy.default_timeout_us
        if timeout_us and policy.allow_timeout_override:
            timeout = timeout_us
        loop = asyncio.get_running_loop()
        now = loop.time()
        ticket = Ticket(rows, level, policy, next(self._seq), now, now + timeout / 1e6 if timeout else None)
        self._queue.append(ticket)
        self._pump()
        try:
            await ticket.future
        except asyncio.CancelledError:  # the client went away: give back what it held or drop its place
            if ticket.future.done() and not ticket.future.cancelled() and ticket.future.exception() is None:
                self.release(ticket)
            elif ticket in self._queue:
                self._queue.remove(ticket)
                self._pump()
            raise
        return ticket

    def release(self, ticket: Ticket) -> None:
        """The request's rows finished (idempotent per ticket)."""
        if ticket.released_at is None or ticket.done:
            return
        ticket.done = True
        self.executing -= ticket.rows
        self._pump()

    # -- the queue's clock
    def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for t in list(self._queue):
            if t.deadline is not None and not t.delayed and now >= t.deadline:
                if t.policy.timeout_action == "DELAY":
                    t.delayed = True
                else:
                    self._queue.remove(t)
                    t.future.set_exception(BatcherError(503, TIMED_OUT))
        self._queue.sort(key=Ticket.sort_key)
        free = self.capacity - self.executing
        if self._queue and free > 0 and self._due(now, free):
            self._release_batch(now, free)
        self._arm(loop, now)

    def _due(self, now: float, free: int) -> bool:
        queued = sum(t.rows for t in self._queue)
        largest = max(self.policy.preferred_batch_sizes, default=self.capacity)
        if queued >= min(largest, self.capacity):
            return True
        if any(s <= queued for s in self.policy.preferred_batch_sizes):
            return True
        oldest = min(t.arrival for t in self._queue)
        return now - oldest >= self.policy.max_queue_delay_us / 1e6

    def _release_batch(self, now: float, free: int) -> None:
        queued = sum(t.rows for t in self._queue)
        limit = min(free, queued)
        fitting = [s for s in self.policy.preferred_batch_sizes if s <= limit]
        oldest = min(t.arrival for t in self._queue)
        if fitting and now - oldest < self.policy.max_queue_delay_us / 1e6:
            limit = fitting[-1]  # the largest preferred size that can be formed
        batch, rows = [], 0
        for t in self._queue:
            if rows + t.rows > limit and not (not batch and self._fits_alone(t)):
                break
            batch.append(t)
            rows += t.rows
        for t in batch:
            self._queue.remove(t)
            t.released_at = now
            self.executing += t.rows
            t.future.set_result(None)
        if batch and self._on_execution is not None:
            self._on_execution(len(batch))

    def _fits_alone(self, t: Ticket) -> bool:
        """A request larger than the engine's batch runs alone once nothing else does (no starving)."""
        return t.rows > self.capacity and self.executing == 0

    def _arm(self, loop: asyncio.AbstractEventLoop, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._queue:
            return
        times = [t.deadline for t in self._queue if t.deadline is not None and not t.delayed]
        head = self._queue[0]
        if head.rows <= self.capacity - self.executing or self._fits_alone(head):
            times.append(min(t.arrival for t in self._queue) + self.policy.max_queue_delay_us / 1e6)
        if times:
            self._timer = loop.call_at(max(min(times), now), self._pump)
