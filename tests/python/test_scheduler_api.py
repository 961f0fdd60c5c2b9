"""User-facing scheduler interfaces: SimpleScheduler over C++, twin and user-written schedulers."""

from __future__ import annotations

import importlib.util
import pathlib
import random

import pytest

import inflight.batch_manager as bm
from inflight.batch_manager import (
    CapacitySchedulerPolicy,
    ContextChunkingConfig,
    ContextChunkingPolicy,
    KVCacheManager,
    LlmRequest,
)
from inflight.batch_manager import reference as reference_impl
from inflight.executor.scheduler import (
    BindCapacityScheduler,
    BindMicroBatchScheduler,
    CapacityScheduler,
    MicroBatchScheduler,
    RequestScheduler,
    ScheduledRequests,
    SimpleScheduler,
)
from inflight.executor.simulator import SchedulingSimulator

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _requests(n, seed, max_len=120):
    rng = random.Random(seed)
    return [
        LlmRequest(i, rng.randint(1, 12), [rng.randrange(50) for _ in range(rng.randint(1, max_len))])
        for i in range(n)
    ]


def _run(scheduler_factory, reqs, num_blocks=64, tpb=8):
    kv = KVCacheManager(num_blocks, tpb, 256)
    sim = SchedulingSimulator(scheduler_factory(kv), kv)
    for r in reqs:
        sim.add_request(r)
    records = sim.run(max_steps=5000)
    assert kv.num_free_blocks == num_blocks
    return records, sim


@pytest.mark.parametrize("policy", list(CapacitySchedulerPolicy.__members__))
def test_cpp_and_twin_halves_mix_in_simple_scheduler(policy):
    def make(kv, cap_ref, mb_ref):
        chunk = ContextChunkingConfig(ContextChunkingPolicy.EQUAL_PROGRESS, 8)
        return SimpleScheduler(
            BindCapacityScheduler(6, kv, policy=policy, reference=cap_ref),
            BindMicroBatchScheduler(4, 48, chunk, reference=mb_ref),
        )

    results = []
    for cap_ref, mb_ref in [(False, False), (True, False), (False, True), (True, True)]:
        records, sim = _run(lambda kv, c=cap_ref, m=mb_ref: make(kv, c, m), _requests(30, seed=1))
        results.append(
            [(r.context_ids, r.context_chunk_sizes, r.generation_ids, r.paused_ids) for r in records]
        )
        assert {r.request_id: r.get_tokens() for r in sim.finished}  # every request finished
    assert all(r == results[0] for r in results[1:])


def test_policy_names_as_strings_and_bad_names():
    kv = KVCacheManager(8, 4, 64)
    assert (
        BindCapacityScheduler(2, kv, policy="max_utilization").impl.policy
        == CapacitySchedulerPolicy.MAX_UTILIZATION
    )
    with pytest.raises(ValueError, match="capacity_scheduler_policy.*'FASTEST'"):
        BindCapacityScheduler(2, kv, policy="FASTEST")
    with pytest.raises(ValueError, match="max_batch_size.*0"):
        BindMicroBatchScheduler(0)
    with pytest.raises(ValueError, match="max_num_tokens.*-5"):
        BindMicroBatchScheduler(4, -5)
    with pytest.raises(TypeError, match="capacity_scheduler"):
        SimpleScheduler(object(), BindMicroBatchScheduler(4))
    with pytest.raises(TypeError):
        CapacityScheduler()  # abstract


@pytest.mark.parametrize("reference", [False, True])
def test_bind_capacity_scheduler_passes_window_managers(reference):
    """window_managers reach impl.schedule: a prompt of 40 needs 4 blocks of a window pool (W 20,
    tpb 10), so a pool of 3 keeps it out although the main pool has room; C++ and twin alike."""
    module = reference_impl if reference else bm
    kv = module.KVCacheManager(100, 10, 400)
    window = module.KVCacheManager(3, 10, 400, attention_window=20)
    request = LlmRequest(1, 50, [1] * 40)
    alone = BindCapacityScheduler(4, kv, reference=reference)
    both = BindCapacityScheduler(4, kv, reference=reference, window_managers=[window])
    assert alone.window_managers == [] and both.window_managers == [window]
    assert [r.request_id for r in alone.schedule_request([request])[0]] == [1]
    assert list(both.schedule_request([request])[0]) == []
    if not reference:
        fitting, _ = both.impl.schedule([request], kv, window_managers=[])  # the keyword of the binding
        assert [r.request_id for r in fitting] == [1]
        with pytest.raises(TypeError):
            both.impl.schedule([request], kv, [reference_impl.KVCacheManager(3, 10, 400)])


def test_user_written_capacity_scheduler_example():
    spec = importlib.util.spec_from_file_location("custom_scheduler", EXAMPLES / "custom_scheduler.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    reqs = _requests(16, seed=3, max_len=200)
    records, sim = _run(
        lambda kv: SimpleScheduler(mod.ShortestPromptFirst(3, kv), BindMicroBatchScheduler(3, 1024)),
        reqs,
        num_blocks=80,
        tpb=8,
    )
    started = [i for rec in records for i in rec.context_ids]
    lengths = {r.request_id: r.prompt_len for r in reqs}
    assert len(started) == 16 and not any(rec.paused_ids for rec in records)
    # Among requests waiting at the same time it always picks the shortest: all arrived at step 0,
    # so the admission order is sorted by prompt length.
    assert [lengths[i] for i in started] == sorted(lengths[i] for i in started)
    assert all(r.num_generated_tokens == r.max_new_tokens for r in sim.finished)


def test_a_whole_request_scheduler_can_be_user_written():
    class GenerationFirst(RequestScheduler):
        """Decode steps never share a forward with a prefill (a simple latency-first policy)."""

        def __init__(self, kv):
            self.inner = SimpleScheduler(BindCapacityScheduler(8, kv), BindMicroBatchScheduler(8, 256))

        def schedule_request(self, active_requests, inflight_request_ids):
            out = self.inner.schedule_request(active_requests, inflight_request_ids)
            if out.generation_requests:
                return ScheduledRequests(
                    [], out.generation_requests, out.paused_requests, out.num_fitting_requests
                )
            return out

    records, sim = _run(GenerationFirst, _requests(20, seed=5))
    assert all(not (rec.context_ids and rec.generation_ids) for rec in records)
    assert len(sim.finished) == 20


def test_micro_batch_interface_user_written():
    class OneAtATime(MicroBatchScheduler):
        def schedule(self, active_requests, inflight_request_ids):
            for r in active_requests:
                if r.request_id in inflight_request_ids:
                    continue
                if r.is_context_init_state:
                    r.set_context_chunk_size(r.context_remaining_length)
                    return [r], []
                return [], [r]
            return [], []

    records, sim = _run(
        lambda kv: SimpleScheduler(BindCapacityScheduler(4, kv), OneAtATime()), _requests(5, seed=7)
    )
    assert all(len(rec.context_ids) + len(rec.generation_ids) == 1 for rec in records)
    assert len(sim.finished) == 5


def test_scheduler_output_counts_tokens():
    reqs = _requests(3, seed=0)
    for r in reqs:
        r.set_context_chunk_size(5)
    out = ScheduledRequests(reqs[:2], [reqs[2]], [], 3)
    assert out.batch_size == 3
    assert out.num_tokens == sum(min(5, r.prompt_len) for r in reqs[:2]) + 1
