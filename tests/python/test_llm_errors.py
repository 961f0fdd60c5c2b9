"""LLM API failure paths: bad arguments (while other requests run), a failing forward, a dying
loop, and cancellation at scale. Every wait is bounded (TIMEOUT) so that a bug fails, not hangs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from llm_utils import LLM_PROMPTS, LLM_TPB, TIMEOUT, assert_kv_idle, greedy, wait_idle, wait_until

from inflight.llm import LLM
from inflight.llm_args import KvCacheConfig
from inflight.sampling_params import SamplingParams

VOCAB = 384


def _slow_forward(monkeypatch, llm, delay: float = 0.01) -> None:
    """Each step takes at least ``delay`` s, so that requests stay in flight while the test acts."""
    engine = llm.executor.model_engine
    orig = engine.forward

    def forward(inputs):
        time.sleep(delay)
        return orig(inputs)

    monkeypatch.setattr(engine, "forward", forward)


# ---- bad arguments ------------------------------------------------------------------------------

BAD_SAMPLING = [
    ({"top_p": 1.5}, r"top_p.*1\.5"),
    ({"top_p": 0.0}, r"top_p.*0"),
    ({"temperature": -0.5}, r"temperature.*-0\.5"),
    ({"temperature": float("nan")}, r"temperature.*nan"),
    ({"top_k": -2}, r"top_k.*-2"),
    ({"min_p": 1.5}, r"min_p.*1\.5"),
    ({"max_tokens": 0}, r"max_tokens.*0"),
    ({"max_tokens": True}, r"max_tokens.*True"),
    ({"min_tokens": -1}, r"min_tokens.*-1"),
    ({"min_tokens": 5, "max_tokens": 2}, r"min_tokens.*5"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty.*0"),
    ({"presence_penalty": 2.5}, r"presence_penalty.*2\.5"),
    ({"frequency_penalty": -3}, r"frequency_penalty.*-3"),
    ({"seed": -1}, r"seed.*-1"),
    ({"n": 0}, r"\bn\b.*0"),
    ({"logprobs": -1}, r"logprobs.*-1"),
    ({"stop": [""]}, r"stop"),
    ({"stop": [1, 2]}, r"stop"),
    ({"stop_token_ids": [-1]}, r"stop_token_ids.*-1"),
]


@pytest.mark.parametrize(
    "kwargs,pattern",
    BAD_SAMPLING,
    ids=[next(iter(k)) + "=" + repr(v)[:12] for k, v in ((k, k[next(iter(k))]) for k, _ in BAD_SAMPLING)],
)
def test_invalid_sampling_params(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_unsupported_sampling_field_is_refused():
    with pytest.raises((TypeError, ValueError), match="best_of"):
        SamplingParams(best_of=2)


def test_bad_llm_arguments(make_llm):
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_llm(max_num_seqs=8)  # a vLLM name we do not take: an error, never silently ignored
    with pytest.raises(ValueError, match="bogus_option"):
        make_llm(bogus_option=True)
    with pytest.raises(ValueError, match="max_batch_size.*0"):
        make_llm(max_batch_size=0)
    with pytest.raises(ValueError, match="max_num_tokens.*-1"):
        make_llm(max_num_tokens=-1)
    with pytest.raises(ValueError, match="dtype.*int8"):
        make_llm(dtype="int8")
    with pytest.raises(ValueError, match="max_seq_len.*100000"):
        make_llm(max_seq_len=100000)
    with pytest.raises(ValueError, match="max_tokens"):
        KvCacheConfig(max_tokens=0)
    with pytest.raises(ValueError, match="tokens_per_block.*12"):
        KvCacheConfig(tokens_per_block=12)


def test_bad_requests_leave_others_unaffected(make_llm, hf_greedy_refs, tiny_model_dir, monkeypatch):
    """Every bad call is a ValueError naming the parameter or value, raised at once; requests already
    in flight (submitted with generate_async before) complete exactly as they would have."""
    want = hf_greedy_refs("llama")
    llm = make_llm(max_seq_len=128, max_num_tokens=64)
    _slow_forward(monkeypatch, llm)
    idx = [0, 3, 8, 9]
    inflight = [llm.generate_async(LLM_PROMPTS[i], greedy(), streaming=(i % 2 == 0)) for i in idx]
    ok = LLM_PROMPTS[1]
    assert llm.generate([], greedy(), use_tqdm=False) == []  # a list in, a list out: not an error
    bad_calls = [
        (lambda: llm.generate([[]], greedy(), use_tqdm=False), r"prompt.*empty"),
        (lambda: llm.generate_async([], greedy()), r"prompt.*empty"),
        (lambda: llm.generate("", greedy(), use_tqdm=False), r"prompt.*empty"),
        (lambda: llm.generate([5, VOCAB], greedy(), use_tqdm=False), rf"{VOCAB}.*vocabulary"),
        (lambda: llm.generate_async([5, -1], greedy()), r"-1.*vocabulary"),
        (lambda: llm.generate([[5], [7, 100000]], greedy(), use_tqdm=False), r"100000"),
        (lambda: llm.generate([3] * 100, greedy(40), use_tqdm=False), r"max_tokens 40.*max_seq_len=128"),
        (lambda: llm.generate_async([3] * 128, SamplingParams()), r"max_seq_len=128"),
        (lambda: llm.generate([3] * 65, greedy(4), use_tqdm=False), r"65.*max_num_tokens=64"),
        (
            lambda: llm.generate(ok, SamplingParams(stop_token_ids=[VOCAB + 5]), use_tqdm=False),
            rf"stop_token_ids.*{VOCAB + 5}",
        ),
        (lambda: llm.generate([ok, ok], [greedy()], use_tqdm=False), r"sampling_params.*1.*2"),
        (lambda: llm.generate(ok, {"temperature": 0}, use_tqdm=False), r"sampling_params"),
        (lambda: llm.generate_async(3.5, greedy()), r"prompt"),
        (lambda: llm.generate([1.0, 2.0], greedy(), use_tqdm=False), r"prompt"),
        (lambda: llm.generate_async([True, 5], greedy()), r"prompt"),
        (lambda: llm.generate(None, greedy(), use_tqdm=False), r"prompt"),
        (lambda: llm.generate(ok, SamplingParams(top_p=1.5), use_tqdm=False), r"top_p.*1\.5"),
        (lambda: llm.generate_async(ok, SamplingParams(temperature=-1)), r"temperature.*-1"),
        (lambda: LLM(tiny_model_dir("llama"), max_num_seqs=4), r"max_num_seqs"),
    ]
    for call, pattern in bad_calls:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=pattern):
            call()
        assert time.monotonic() - t0 < 5, "a bad request was not refused at once"
    assert not all(h.done for h in inflight), "the requests finished before the bad calls: nothing was tested"
    for i, h in zip(idx, inflight):
        out = h.result(timeout=TIMEOUT)
        assert out.outputs[0].token_ids == want[i] and out.outputs[0].finish_reason == "length"
    # And the engine still serves.
    assert llm.generate(ok, greedy(), use_tqdm=False).outputs[0].token_ids == want[1]
    assert_kv_idle(llm)


def test_a_bad_prompt_fails_the_whole_call(make_llm):
    """generate() validates every prompt (and its SamplingParams) before it submits any: nothing of a
    call that raises runs."""
    llm = make_llm()
    cases = [
        ([LLM_PROMPTS[0], []], greedy()),
        ([LLM_PROMPTS[0], [VOCAB]], greedy()),
        ([LLM_PROMPTS[0], LLM_PROMPTS[1]], [greedy(), SamplingParams(stop_token_ids=[VOCAB])]),
    ]
    for prompts, params in cases:
        with pytest.raises(ValueError):
            llm.generate(prompts, params, use_tqdm=False)
    time.sleep(0.2)
    wait_idle(llm)
    assert llm.get_stats() == [], "a request of a call that raised was run"


# ---- a failing step -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["forward", "prepare"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_step_error_fails_that_batch_only(make_llm, hf_greedy_refs, monkeypatch, overlap, where):
    want = hf_greedy_refs("llama")
    # At most 3 requests per step: the failing step holds some of the six, the others wait.
    llm = make_llm(disable_overlap_scheduler=not overlap, max_batch_size=3)
    engine = llm.executor.model_engine
    orig = getattr(engine, where)
    k = 5
    state = {"calls": 0, "batch": None}

    def failing(*args, **kwargs):
        state["calls"] += 1
        if state["calls"] == k:
            batch = args[0]
            reqs = batch.sampled_requests if where == "forward" else batch.all_requests
            state["batch"] = {r.request_id for r in reqs}
            raise RuntimeError(f"injected failure in {where} #{k}")
        return orig(*args, **kwargs)

    monkeypatch.setattr(engine, where, failing)
    idx = [0, 1, 2, 3, 4, 8]
    handles = [llm.generate_async(LLM_PROMPTS[i], greedy()) for i in idx]
    outs = [h.result(timeout=TIMEOUT) for h in handles]
    assert state["batch"], "the failure was never injected"
    for i, out in zip(idx, outs):
        c = out.outputs[0]
        if out.request_id in state["batch"]:
            assert c.finish_reason == "error", (i, c)
            assert f"injected failure in {where} #{k}" in c.error
            assert len(c.token_ids) < len(want[i]) and c.token_ids == want[i][: len(c.token_ids)]
        else:
            assert c.finish_reason == "length" and c.token_ids == want[i]
    assert 0 < len(state["batch"]) < len(idx), "the failing step should hold some, not all, requests"
    assert_kv_idle(llm)
    # The engine keeps serving, with correct results.
    again = llm.generate([LLM_PROMPTS[i] for i in idx], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [want[i] for i in idx]
    assert all(o.outputs[0].finish_reason == "length" for o in again)
    assert_kv_idle(llm)


# ---- a dying loop -------------------------------------------------------------------------------


class _Fatal(BaseException):
    """Not an Exception: the loop must report it all the same."""


@pytest.mark.parametrize("exc_type", [_Fatal, RuntimeError])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_loop_death_wakes_every_waiter(make_llm, monkeypatch, overlap, exc_type):
    # At most 4 active requests (2 x max_batch_size): the others wait in the executor's queue.
    llm = make_llm(disable_overlap_scheduler=not overlap, max_batch_size=2)
    _slow_forward(monkeypatch, llm)
    orig = llm.executor.scheduler.schedule_request
    calls = {"n": 0}
    all_submitted = threading.Event()

    def schedule_request(active, inflight_ids):
        calls["n"] += 1
        if calls["n"] == 1:
            all_submitted.wait(TIMEOUT)  # the loop must not die before every request is in
        if calls["n"] == 4:
            raise exc_type("scheduler exploded")
        return orig(active, inflight_ids)

    monkeypatch.setattr(llm.executor.scheduler, "schedule_request", schedule_request)
    handles = [llm.generate_async(p, greedy()) for p in LLM_PROMPTS[:5]]
    streaming = llm.generate_async(LLM_PROMPTS[6], greedy(), streaming=True)
    all_submitted.set()

    async def stream():
        return [o async for o in streaming]

    items = asyncio.run(asyncio.wait_for(stream(), TIMEOUT))
    assert items[-1].finished and items[-1].outputs[0].finish_reason == "error"
    for h in handles:
        c = h.result(timeout=TIMEOUT).outputs[0]
        assert c.finish_reason == "error"
        assert "scheduler exploded" in c.error
    wait_until(lambda: not llm.executor.is_alive, what="the loop to be reported dead")
    # New calls fail at once, naming the cause.
    for call in (
        lambda: llm.generate(LLM_PROMPTS[1], greedy(), use_tqdm=False),
        lambda: llm.generate_async(LLM_PROMPTS[1], greedy()),
        lambda: llm.generate_async(LLM_PROMPTS[1], greedy(), streaming=True),
    ):
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="scheduler exploded"):
            call()
        assert time.monotonic() - t0 < 5
    handles[0].abort()  # a no-op now, not an error
    llm.shutdown()  # returns (the fixture would fail the test if it hung)


# ---- cancellation at scale ----------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_abort_half_of_100_concurrent(make_llm, monkeypatch, overlap):
    """100 requests at once (more than run at a time: some wait in the queue), every other one
    aborted mid-flight: the others produce exactly the tokens of an unaborted run, the aborted ones
    end "cancelled", and every block comes back."""
    llm = make_llm(
        disable_overlap_scheduler=not overlap,
        max_batch_size=32,
        kv_cache_config=KvCacheConfig(max_tokens=8192, tokens_per_block=LLM_TPB, enable_block_reuse=False),
    )
    prompts = [LLM_PROMPTS[i % 10][: 4 + i % 13] + [3 + i] for i in range(100)]
    params = greedy(20)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_kv_idle(llm)
    n_iter = llm.get_stats()[-1]["iter"]  # (the stats keep a window of iterations: count by number)
    _slow_forward(monkeypatch, llm, 0.005)  # a margin for the aborts to land mid-generation
    with llm.executor.arrivals():  # all 100 at once, however slowly this machine submits them
        handles = [llm.generate_async(p, params, streaming=(i % 4 == 1)) for i, p in enumerate(prompts)]
    # Abort once generation is under way.
    wait_until(lambda: llm.get_stats()[-1]["iter"] >= n_iter + 3, what="a few iterations")
    for h in handles[::2]:
        h.abort()
    outs = [h.result(timeout=TIMEOUT) for h in handles]
    for i, out in enumerate(outs):
        c = out.outputs[0]
        assert out.finished
        if i % 2 == 0:
            assert c.finish_reason == "cancelled", (i, c.finish_reason)
            assert len(c.token_ids) < 20 and c.token_ids == ref[i][: len(c.token_ids)]
        else:
            assert c.finish_reason == "length" and c.token_ids == ref[i], i
    assert_kv_idle(llm)
    # Aborting finished requests changes nothing.
    for h in handles:
        h.abort()
    assert [h.result(timeout=TIMEOUT).outputs[0].finish_reason for h in handles[:4]] == [
        "cancelled",
        "length",
        "cancelled",
        "length",
    ]
    assert_kv_idle(llm)
