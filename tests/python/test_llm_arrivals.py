"""What is submitted together arrives together (PyExecutor.arrivals): LLM.generate's batch and the n
sequences of one request reach the loop as one queue item, so the schedule does not depend on how
fast the caller submits; cancels sent inside a block follow its requests; a block on a dead engine
answers its held requests with the error and raises it."""

from __future__ import annotations

import time

import pytest
from llm_utils import LLM_PROMPTS, TIMEOUT, assert_kv_idle, greedy, wait_idle, wait_until

from inflight.sampling_params import SamplingParams


def _first_busy_iteration(llm) -> dict:
    return next(s for s in llm.get_stats() if s["num_scheduled_requests"] > 0)


def test_a_slowly_submitted_batch_starts_in_one_step(make_llm, monkeypatch, hf_greedy_refs):
    """However slowly generate() prepares its requests (here 30 ms each, while the loop is free to
    step), the loop takes the batch as one: all ten prompts are active in its first step (seven
    prefill there; the three that extend another prompt's blocks wait one step to reuse them)."""
    llm = make_llm()
    submit = llm._submit

    def slow_submit(*args, **kwargs):
        time.sleep(0.03)
        return submit(*args, **kwargs)

    monkeypatch.setattr(llm, "_submit", slow_submit)
    outs = llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_refs("llama")
    first = _first_busy_iteration(llm)
    assert first["num_active_requests"] == len(LLM_PROMPTS), first
    # The contrast (the check can fail): submitted one by one outside a block, the loop starts on the
    # first before the others arrive.
    llm2 = make_llm()
    llm2.generate_async(LLM_PROMPTS[0], greedy())
    wait_until(lambda: any(s["num_scheduled_requests"] for s in llm2.get_stats()), what="a first step")
    for p in LLM_PROMPTS[1:3]:
        llm2.generate_async(p, greedy())
    wait_idle(llm2)
    assert _first_busy_iteration(llm2)["num_active_requests"] == 1
    assert_kv_idle(llm)


def test_the_n_sequences_of_a_request_start_together(make_llm, monkeypatch):
    llm = make_llm()
    enqueue = llm.executor.enqueue_request

    def slow_enqueue(req):
        time.sleep(0.03)
        return enqueue(req)

    monkeypatch.setattr(llm.executor, "enqueue_request", slow_enqueue)
    out = llm.generate(LLM_PROMPTS[0], SamplingParams(n=6, temperature=1.0, seed=1, max_tokens=4))
    assert len(out.outputs) == 6
    assert _first_busy_iteration(llm)["num_active_requests"] == 6
    assert_kv_idle(llm)


def test_cancels_inside_an_arrivals_block_follow_its_requests(make_llm):
    """A request aborted by the thread that submitted it, before the block ended (its cancel would
    otherwise reach the loop before the request does, and be ignored): it ends cancelled; the other
    request runs to the end; nothing waits forever."""
    llm = make_llm()
    with llm.executor.arrivals():
        kept = llm.generate_async(LLM_PROMPTS[0], greedy())
        dropped = llm.generate_async(LLM_PROMPTS[1], greedy())
        dropped.abort()
        assert llm.get_stats() == [] or _no_busy_iteration(llm)  # nothing has reached the loop yet
    assert dropped.result(timeout=TIMEOUT).outputs[0].finish_reason == "cancelled"
    assert kept.result(timeout=TIMEOUT).outputs[0].finish_reason == "length"
    assert_kv_idle(llm)


def _no_busy_iteration(llm) -> bool:
    return all(s["num_scheduled_requests"] == 0 for s in llm.get_stats())


def test_an_arrivals_block_on_a_dead_engine_raises_and_answers_its_requests(make_llm):
    """The engine dies while a block holds a request back: the block raises the engine's error and
    the held request's waiter gets it too (the loop never saw the request: no hang)."""
    llm = make_llm()
    with pytest.raises(RuntimeError, match="injected"), llm.executor.arrivals():
        handle = llm.generate_async(LLM_PROMPTS[0], greedy())
        llm.executor.fail(RuntimeError("injected"))
        wait_until(lambda: not llm.is_alive, what="the engine to die")
    out = handle.result(timeout=TIMEOUT)
    assert out.finished and out.outputs[0].finish_reason == "error"
