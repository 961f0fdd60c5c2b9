"""Request priorities in the executor: admission order, and no stall behind a started request."""

from __future__ import annotations

import time

from inflight import KvCacheConfig, SamplingParams, SchedulerConfig


def _slow_forward(llm, seconds: float):
    engine = llm.executor.model_engine
    orig = engine.forward

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return orig(*args, **kwargs)

    engine.forward = slow


def test_high_priority_request_is_admitted_first(make_llm):
    llm = make_llm(max_batch_size=1)
    _slow_forward(llm, 0.02)
    first = llm.generate_async([5] * 10, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    low = llm.generate_async(
        [6] * 10, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), priority=0.1
    )
    high = llm.generate_async(
        [7] * 10, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), priority=0.9
    )
    for h in (first, low, high):
        h.result(timeout=60)
    # max_batch_size=1: requests run one after another; the high-priority one overtakes the
    # low-priority one that was waiting, but not the request already running.
    queue = {
        name: h.result().metrics["queue_time"] for name, h in (("first", first), ("low", low), ("high", high))
    }
    assert queue["first"] < queue["high"] < queue["low"], queue


def test_no_stall_when_a_high_priority_request_cannot_fit_behind_a_started_context(make_llm):
    # 24 blocks of 8 tokens. A: 100-token prompt, chunked 16 tokens per step, holds 13 blocks from its
    # first chunk on. B (higher priority) needs 12 blocks to completion while only 11 are free: placed
    # ahead of A, B would stop GUARANTEED_NO_EVICT admission and A would never finish its prefill.
    llm = make_llm(
        kv_cache_config=KvCacheConfig(max_tokens=192, tokens_per_block=8),
        scheduler_config=SchedulerConfig("GUARANTEED_NO_EVICT"),
        enable_chunked_prefill=True,
        max_num_tokens=16,
    )
    _slow_forward(llm, 0.05)
    a = llm.generate_async(
        [11] * 100, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), priority=0.2
    )
    deadline = time.monotonic() + 30
    while not any(s["num_context_requests"] for s in llm.get_stats()):
        assert time.monotonic() < deadline, "A never started"
        time.sleep(0.01)
    b = llm.generate_async(
        [12] * 60, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), priority=0.9
    )
    out_a, out_b = a.result(timeout=60), b.result(timeout=60)
    assert len(out_a.outputs[0].token_ids) == 20 and len(out_b.outputs[0].token_ids) == 30
