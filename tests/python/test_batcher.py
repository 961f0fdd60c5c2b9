"""Triton's dynamic batcher (serve/batcher.py) on its own: the arrival window, preferred sizes, the
queue bound, priority levels, queue timeouts (REJECT and DELAY) and cancellation."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import model_config_pb2

from inflight.serve.batcher import (
    QUEUE_FULL,
    TIMED_OUT,
    BatcherError,
    BatchingPolicy,
    DynamicBatcher,
    QueuePolicy,
)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def _released(task: asyncio.Task, within: float) -> bool:
    done, _ = await asyncio.wait({task}, timeout=within)
    return bool(done)


def test_window_holds_until_the_delay_and_flushes_early_at_a_preferred_size():
    async def main():
        executions = []
        b = DynamicBatcher(
            BatchingPolicy(preferred_batch_sizes=(3,), max_queue_delay_us=300_000), 8, executions.append
        )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first = [asyncio.ensure_future(b.acquire(1)) for _ in range(2)]
        assert not await _released(first[0], 0.1)  # 2 < preferred 3: the window holds them
        assert b.queued() == 2
        await asyncio.gather(*first)
        assert loop.time() - t0 >= 0.29  # released by the delay
        assert executions == [2] and b.executing == 2
        t1 = loop.time()
        second = [asyncio.ensure_future(b.acquire(1)) for _ in range(3)]
        tickets = await asyncio.gather(*second)
        assert loop.time() - t1 < 0.2  # the preferred size flushed at once
        assert executions == [2, 3] and b.executing == 5
        for t in tickets:
            b.release(t)
            b.release(t)  # idempotent
        assert b.executing == 2

    run(main())


def test_no_window_releases_at_once_and_capacity_holds_the_rest():
    async def main():
        b = DynamicBatcher(BatchingPolicy(), 2)
        a = await b.acquire(1)
        c = await b.acquire(1)
        third = asyncio.ensure_future(b.acquire(1))
        assert not await _released(third, 0.1)  # the engine is full (capacity 2)
        b.release(a)
        await asyncio.wait_for(third, 1)
        b.release(c)

    run(main())


def test_queue_bound_refuses_at_once():
    async def main():
        b = DynamicBatcher(BatchingPolicy(default_queue_policy=QueuePolicy(max_queue_size=2)), 1)
        running = await b.acquire(1)
        waiting = [asyncio.ensure_future(b.acquire(1)) for _ in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(BatcherError, match=QUEUE_FULL) as info:
            await b.acquire(1)
        assert info.value.status == 503
        b.release(running)
        t = await waiting[0]
        b.release(t)
        b.release(await waiting[1])

    run(main())


def test_priority_level_goes_first_and_maps_to_engine_priority():
    async def main():
        policy = BatchingPolicy(priority_levels=3, default_priority_level=2)
        assert [policy.engine_priority(level) for level in (1, 2, 3)] == [1.0, 2 / 3, 1 / 3]
        assert policy.level(0) == 2
        assert BatchingPolicy().level(0) == 0
        with pytest.raises(BatcherError, match="needs priority_levels"):
            BatchingPolicy().level(1)
        with pytest.raises(BatcherError, match=r"'priority' must be in \[1, 3\]"):
            policy.level(4)
        b = DynamicBatcher(policy, 1)
        running = await b.acquire(1)
        order = []

        async def one(level: int, tag: str):
            t = await b.acquire(1, level)
            order.append(tag)
            return t

        low = asyncio.ensure_future(one(3, "low"))
        await asyncio.sleep(0.01)
        default = asyncio.ensure_future(one(0, "default"))
        await asyncio.sleep(0.01)
        high = asyncio.ensure_future(one(1, "high"))
        await asyncio.sleep(0.01)
        b.release(running)
        for task in (high, default, low):
            b.release(await task)
        assert order == ["high", "default", "low"]

    run(main())


def test_timeout_reject_and_delay():
    async def main():
        reject = DynamicBatcher(
            BatchingPolicy(default_queue_policy=QueuePolicy(default_timeout_us=50_000)), 1
        )
        running = await reject.acquire(1)
        with pytest.raises(BatcherError, match=TIMED_OUT):
            await reject.acquire(1)
        assert reject.queued() == 0
        reject.release(running)

        # DELAY: the timed-out request goes behind one that has not timed out; a request's own
        # timeout overrides the default only where allowed.
        policy = QueuePolicy(timeout_action="DELAY", default_timeout_us=50_000, allow_timeout_override=True)
        b = DynamicBatcher(BatchingPolicy(default_queue_policy=policy), 1)
        running = await b.acquire(1)
        order = []

        async def one(tag: str, timeout_us=None):
            t = await b.acquire(1, 0, timeout_us)
            order.append(tag)
            return t

        early = asyncio.ensure_future(one("early"))
        await asyncio.sleep(0.1)  # `early` timed out: delayed
        late = asyncio.ensure_future(one("late", 10_000_000))
        await asyncio.sleep(0.01)
        b.release(running)
        for task in (late, early):
            b.release(await task)
        assert order == ["late", "early"]

    run(main())


def test_cancelled_waiter_leaves_the_queue_and_gives_back_its_rows():
    async def main():
        b = DynamicBatcher(BatchingPolicy(max_queue_delay_us=10_000_000, preferred_batch_sizes=(4,)), 4)
        waiter = asyncio.ensure_future(b.acquire(1))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert b.queued() == 0 and b.executing == 0

    run(main())


def test_policy_from_the_config_message():
    db = model_config_pb2.ModelDynamicBatching(
        preferred_batch_size=[4, 2],
        max_queue_delay_microseconds=100,
        priority_levels=2,
        default_priority_level=2,
    )
    db.default_queue_policy.max_queue_size = 7
    db.default_queue_policy.timeout_action = model_config_pb2.ModelQueuePolicy.DELAY
    db.priority_queue_policy[1].max_queue_size = 3
    p = BatchingPolicy.from_proto(db)
    assert p.preferred_batch_sizes == (2, 4) and p.max_queue_delay_us == 100
    assert p.queue_policy(2) == QueuePolicy("DELAY", 0, False, 7)
    assert p.queue_policy(1).max_queue_size == 3
    db.default_priority_level = 5
    with pytest.raises(ValueError, match="default_priority_level must be in"):
        BatchingPolicy.from_proto(db)
