"""Streaming and asyncio use of LLM.generate_async: cumulative outputs with deltas, awaiting,
binding to an event loop, abort. Every wait is bounded by a timeout."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest
from llm_utils import LLM_PROMPTS, TIMEOUT, assert_kv_idle, greedy

from inflight.outputs import RequestOutput
from inflight.sampling_params import SamplingParams


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


async def _collect(handle) -> list[RequestOutput]:
    return [o async for o in handle]


def _check_stream(items: list[RequestOutput], n: int = 1) -> None:
    """Cumulative items, deltas that add up to the final output, exactly one finished item (the last)."""
    assert items, "no output was streamed"
    assert [o.finished for o in items] == [False] * (len(items) - 1) + [True]
    for k in range(n):
        seqs = [o.outputs[k] for o in items]
        for prev, cur in itertools.pairwise(seqs):
            assert cur.token_ids[: len(prev.token_ids)] == prev.token_ids, "token_ids are not cumulative"
            assert cur.text.startswith(prev.text), "text is not cumulative"
        final = seqs[-1]
        assert [t for s in seqs for t in s.token_ids_diff] == final.token_ids
        assert "".join(s.text_diff for s in seqs) == final.text
        for s in seqs:
            assert s.token_ids[len(s.token_ids) - len(s.token_ids_diff) :] == s.token_ids_diff


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_streaming_matches_offline(make_llm, hf_greedy_refs, overlap):
    want = hf_greedy_refs("llama")
    llm = make_llm(disable_overlap_scheduler=not overlap)

    async def main():
        handles = [llm.generate_async(p, greedy(), streaming=True) for p in LLM_PROMPTS]
        return await asyncio.gather(*(_collect(h) for h in handles))

    streams = _run(main())
    for i, items in enumerate(streams):
        _check_stream(items)
        assert items[-1].outputs[0].token_ids == want[i]
        assert items[-1].outputs[0].finish_reason == "length"
        assert len(items) > 1, "the output was not streamed token by token"
    assert_kv_idle(llm)


def test_streaming_with_preemption(make_llm, hf_greedy_refs):
    """Paused and recomputed requests stream each token once, in order."""
    from llm_utils import LLM_TPB

    from inflight.llm_args import KvCacheConfig, SchedulerConfig

    want = hf_greedy_refs("llama")
    llm = make_llm(
        kv_cache_config=KvCacheConfig(max_tokens=20 * LLM_TPB, tokens_per_block=LLM_TPB),
        scheduler_config=SchedulerConfig(capacity_scheduler_policy="MAX_UTILIZATION"),
    )

    async def main():
        with llm.executor.arrivals():  # the same schedule on every machine
            handles = [llm.generate_async(p, greedy(), streaming=True) for p in LLM_PROMPTS]
        return await asyncio.gather(*(_collect(h) for h in handles))

    streams = _run(main())
    assert sum(s["num_paused_requests"] for s in llm.get_stats()) > 0, "nothing was paused"
    for i, items in enumerate(streams):
        _check_stream(items)
        assert items[-1].outputs[0].token_ids == want[i]
    assert_kv_idle(llm)


def test_streaming_text(make_llm):
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    offline = llm.generate("Hello world", params, use_tqdm=False).outputs[0]
    items = _run(_collect(llm.generate_async("Hello world", params, streaming=True)))
    _check_stream(items)
    final = items[-1].outputs[0]
    assert final.text == offline.text and final.token_ids == offline.token_ids
    assert final.text and items[-1].prompt == "Hello world"


def test_streaming_n_outputs(make_llm):
    llm = make_llm()
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12, ignore_eos=True)
    offline = llm.generate(LLM_PROMPTS[0], params, use_tqdm=False)
    items = _run(_collect(llm.generate_async(LLM_PROMPTS[0], params, streaming=True)))
    _check_stream(items, n=2)
    assert [c.token_ids for c in items[-1].outputs] == [c.token_ids for c in offline.outputs]


def test_streaming_without_tokenizer(make_llm, tiny_model_dir):
    llm = make_llm(model=tiny_model_dir("llama", with_tokenizer=False))
    items = _run(_collect(llm.generate_async(LLM_PROMPTS[1], greedy(8), streaming=True)))
    _check_stream(items)
    assert all(o.outputs[0].text == "" and o.outputs[0].text_diff == "" for o in items)
    assert len(items[-1].outputs[0].token_ids) == 8


def test_await_handle(make_llm, hf_greedy_refs):
    want = hf_greedy_refs("llama")
    llm = make_llm()

    async def main():
        plain = await llm.generate_async(LLM_PROMPTS[0], greedy())
        streamed = await llm.generate_async(
            LLM_PROMPTS[1], greedy(), streaming=True
        )  # awaiting: the final one
        return plain, streamed

    plain, streamed = _run(main())
    assert plain.finished and plain.outputs[0].token_ids == want[0]
    assert streamed.finished and streamed.outputs[0].token_ids == want[1]
    with pytest.raises(TypeError):
        _run(_collect(llm.generate_async(LLM_PROMPTS[0], greedy())))  # not streaming: not iterable


def test_handle_created_in_sync_code_binds_to_the_loop_that_awaits_it(make_llm, hf_greedy_refs, monkeypatch):
    want = hf_greedy_refs("llama")
    llm = make_llm()
    engine = llm.executor.model_engine
    forward = engine.forward

    def slow_forward(inputs):
        time.sleep(0.005)  # keeps requests running while the loops are set up
        return forward(inputs)

    monkeypatch.setattr(engine, "forward", slow_forward)
    # Created with no event loop anywhere; still running when a loop first awaits it.
    h1 = llm.generate_async(LLM_PROMPTS[2], greedy())
    assert not h1.done
    assert _run(_await(h1)).outputs[0].token_ids == want[2]
    # A loop on another thread iterates a streaming one, created here.
    h2 = llm.generate_async(LLM_PROMPTS[3], greedy(), streaming=True)
    started, box = threading.Event(), {}

    async def consume():
        it = h2.__aiter__()
        first = await it.__anext__()  # now bound to this thread's loop
        started.set()
        return [first] + [o async for o in it]

    def other_thread():
        try:
            box["items"] = _run(consume())
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=other_thread)
    t.start()
    assert started.wait(TIMEOUT)
    if not h2.done:
        # Bound to the other thread's running loop: this loop may not take it over.
        with pytest.raises(RuntimeError, match="event loop"):
            _run(_await(h2))
    t.join(TIMEOUT)
    assert not t.is_alive() and "error" not in box, box.get("error")
    _check_stream(box["items"])
    assert box["items"][-1].outputs[0].token_ids == want[3]
    assert h2.result(timeout=TIMEOUT).outputs[0].token_ids == want[3]
    # Finished, and its loop is gone: another loop may await it.
    assert _run(_await(h2)).outputs[0].token_ids == want[3]


async def _await(handle):
    return await handle


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_abort_mid_stream(make_llm, overlap):
    llm = make_llm(disable_overlap_scheduler=not overlap)
    others = [llm.generate_async(p, greedy()) for p in LLM_PROMPTS[:3]]
    params = greedy(200)
    offline = llm.generate(LLM_PROMPTS[5], params, use_tqdm=False).outputs[0].token_ids

    async def main():
        h = llm.generate_async(LLM_PROMPTS[5], params, streaming=True)
        items = []
        async for o in h:
            items.append(o)
            if len(items) == 3:
                h.abort()
                h.abort()  # twice: still one final output
        return h, items

    h, items = _run(main())
    _check_stream(items)
    final = items[-1]
    assert final.finished and final.outputs[0].finish_reason == "cancelled"
    n = len(final.outputs[0].token_ids)
    assert 3 <= n < 200 and final.outputs[0].token_ids == offline[:n]
    res = h.result(timeout=TIMEOUT)
    assert res.finished and res.outputs[0].finish_reason == "cancelled"
    assert (
        res.outputs[0].token_ids == final.outputs[0].token_ids
        and res.outputs[0].text == final.outputs[0].text
    )
    for o in others:
        assert o.result(timeout=TIMEOUT).outputs[0].finish_reason == "length"
    assert_kv_idle(llm)  # every block of the aborted request came back


def test_abort_before_it_runs(make_llm):
    llm = make_llm(max_batch_size=1)
    blocker = llm.generate_async(LLM_PROMPTS[8], greedy(100))

    async def main():
        h = llm.generate_async(LLM_PROMPTS[0], greedy(), streaming=True)
        h.abort()
        return [o async for o in h]

    items = _run(main())
    assert len(items) == 1 and items[0].finished and items[0].outputs[0].finish_reason == "cancelled"
    blocker.abort()
    assert blocker.result(timeout=TIMEOUT).outputs[0].finish_reason == "cancelled"
    assert_kv_idle(llm)


def test_abort_after_finish_is_a_no_op(make_llm, hf_greedy_refs):
    want = hf_greedy_refs("llama")
    llm = make_llm()
    h = llm.generate_async(LLM_PROMPTS[4], greedy(), streaming=True)
    items = _run(_collect(h))
    h.abort()
    res = h.result(timeout=TIMEOUT)
    assert res.outputs[0].finish_reason == "length" and res.outputs[0].token_ids == want[4]
    # Nothing more is streamed, and iterating it again replays the same outputs and ends.
    again = _run(_collect(h))
    assert len(again) == len(items) and again[-1].outputs[0].finish_reason == "length"
    # The id of the finished request means nothing to the engine any more: a later request with
    # another id is not affected by the late abort.
    h2 = llm.generate_async(LLM_PROMPTS[4], greedy())
    h.abort()
    assert h2.result(timeout=TIMEOUT).outputs[0].token_ids == want[4]
    assert_kv_idle(llm)
