"""Beam search under the MAX_UTILIZATION capacity policy with swap preemption
(``SchedulerConfig(preemption_mode="swap")``, ``KvCacheConfig(host_cache_size=...)``): a paused beam
request has all its beam sequences suspended into the secondary KV tier and resumed together, so its
beams stay those of transformers' ``generate(num_beams=K)``; greedy requests sharing the pool keep the
tokens of a run without preemption; nothing is prefilled twice; a beam request the tier cannot take is
kept (others make room), never recomputed, and nothing hangs."""

from __future__ import annotations

import json

import pytest
import torch
from llm_utils import LLM_PROMPTS, LLM_TPB, TIMEOUT, assert_kv_idle, greedy, hf_generate
from model_utils import load_hf_reference
from test_beam_search import beam_params, hf_beams, scores

from inflight import KvCacheConfig, SchedulerConfig
from inflight.llm import RequestError

MAX_NEW = 12
POOL_BLOCKS = 24  # of 8 tokens: a few requests at a time, so the scheduler pauses some


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return load_hf_reference(tiny_model_dir("llama"), torch.float32)


def _swap_llm(make_llm, host_cache_size=1 << 20, overlap=False, pool_blocks=POOL_BLOCKS):
    return make_llm(
        disable_overlap_scheduler=not overlap,
        kv_cache_config=KvCacheConfig(
            max_tokens=pool_blocks * LLM_TPB,
            tokens_per_block=LLM_TPB,
            enable_block_reuse=False,
            host_cache_size=host_cache_size,
        ),
        scheduler_config=SchedulerConfig(capacity_scheduler_policy="MAX_UTILIZATION", preemption_mode="swap"),
    )


def _record_beam_swaps(llm) -> list[tuple[int, int]]:
    """(request id, number of KV sequences suspended) for every beam request swapped out."""
    ex = llm.executor
    kv = ex.kv_cache_manager
    swap_out, seen = ex.preemption.swap_out, []

    def look(req) -> bool:
        out = swap_out(req)
        if out and req.py_beam is not None:
            seen.append((req.request_id, sum(kv.impl.is_suspended(s) for s in req.py_beam.seq_ids)))
        return out

    ex.preemption.swap_out = look
    return seen


def _prefill_counts(llm) -> dict[int, tuple[int, int]]:
    """request id -> (context tokens scheduled, prompt tokens)."""
    return {
        e["id"]: (sum(n for _, n in e["chunks"]), e["prompt_tokens"])
        for e in llm.executor.timelines.snapshot()
    }


# Beam requests (K, n) on four prompts, and greedy requests on the rest: together they need far more
# than the 24 blocks.
BEAM_CASES = [(0, 4, 2), (1, 3, 3), (3, 2, 1), (4, 4, 4)]
GREEDY_IDX = [8, 5, 6, 2, 9]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_beams_and_greedy_under_swap_preemption(make_llm, hf, hf_greedy_refs, overlap):
    llm = _swap_llm(make_llm, overlap=overlap)
    beam_swaps = _record_beam_swaps(llm)
    prompts = [LLM_PROMPTS[i] for i, _, _ in BEAM_CASES] + [LLM_PROMPTS[i] for i in GREEDY_IDX]
    params = [beam_params(k, n, max_new=MAX_NEW, ignore_eos=True) for _, k, n in BEAM_CASES]
    params += [greedy()] * len(GREEDY_IDX)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (i, k, n), out in zip(BEAM_CASES, outs):
        ref = hf_beams(hf, LLM_PROMPTS[i], k, n, max_new=MAX_NEW, eos_token_id=None)
        assert [c.token_ids for c in out.outputs] == [t for t, _ in ref], (i, k, n)
        assert scores(out, 1.0) == pytest.approx([s for _, s in ref], rel=1e-6, abs=1e-5)
    refs = hf_greedy_refs("llama")
    for i, out in zip(GREEDY_IDX, outs[len(BEAM_CASES) :]):
        assert out.outputs[0].token_ids == refs[i], i
    stats = llm.get_stats()
    swaps = stats[-1]["preemption"]
    assert swaps["num_swapped_out"] > 0 and swaps["num_recomputed"] == 0, swaps
    assert swaps["num_swapped_in"] == swaps["num_swapped_out"] and swaps["num_swapped_requests"] == 0
    assert swaps["num_beams_restarted"] == 0, swaps
    # Beam requests themselves were swapped out, every one of their K sequences at once.
    widths = {out.request_id: k for (_, k, _), out in zip(BEAM_CASES, outs)}
    assert beam_swaps, f"no beam request was swapped out: the test proves nothing ({swaps})"
    for rid, suspended in beam_swaps:
        assert suspended in (1, widths[rid]), (rid, suspended)  # 1: paused before its first decode
    assert any(suspended > 1 for _, suspended in beam_swaps), beam_swaps
    for rid, (prefilled, prompt) in _prefill_counts(llm).items():
        assert prefilled == prompt, (rid, prefilled, prompt)  # no second prefill, beams included
    kv = llm.executor.kv_cache_manager
    assert kv.get_kv_cache_stats()["used_num_secondary_blocks"] == 0
    assert not any(o.outputs[0].finish_reason == "error" for o in outs)
    kv.impl.check_integrity()
    assert_kv_idle(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_beams_the_tier_cannot_take_are_kept_not_recomputed(make_llm, hf, hf_greedy_refs, overlap):
    """The tier never has room for a beam request (its blocks to suspend are made larger than the tier;
    greedy requests still swap): chosen as a victim, a beam request is kept and scheduled again at the
    front, the others make room for it. The beams are still transformers', the greedy tokens
    unchanged, no beam request is ever recomputed or prefilled twice."""
    llm = _swap_llm(make_llm, overlap=overlap)
    ex = llm.executor
    kv = ex.kv_cache_manager
    real_need = kv.blocks_to_suspend

    def need(req) -> int:
        return kv.impl.num_secondary_blocks + 1 if req.py_beam is not None else real_need(req)

    kv.blocks_to_suspend = need
    recomputed = []
    real_free = ex.resource_manager.free_resources

    def free(req, store_for_reuse=True):
        if req.py_beam is not None and not req.py_done:
            recomputed.append(req.request_id)
        real_free(req, store_for_reuse)

    ex.resource_manager.free_resources = free
    # Greedy requests first: the beam requests, behind them, are the scheduler's victims.
    prompts = [LLM_PROMPTS[i] for i in GREEDY_IDX] + [LLM_PROMPTS[i] for i, _, _ in BEAM_CASES]
    params = [greedy()] * len(GREEDY_IDX)
    params += [beam_params(k, n, max_new=MAX_NEW, ignore_eos=True) for _, k, n in BEAM_CASES]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (i, k, n), out in zip(BEAM_CASES, outs[len(GREEDY_IDX) :]):
        ref = hf_beams(hf, LLM_PROMPTS[i], k, n, max_new=MAX_NEW, eos_token_id=None)
        assert [c.token_ids for c in out.outputs] == [t for t, _ in ref], (i, k, n)
    refs = hf_greedy_refs("llama")
    for i, out in zip(GREEDY_IDX, outs):
        assert out.outputs[0].token_ids == refs[i], i
    swaps = llm.get_stats()[-1]["preemption"]
    assert swaps["num_beams_kept"] > 0, f"no beam request was kept: the test proves nothing ({swaps})"
    assert not recomputed, recomputed
    beam_ids = {out.request_id for out in outs[len(GREEDY_IDX) :]}
    for rid, (prefilled, prompt) in _prefill_counts(llm).items():
        if rid in beam_ids:
            assert prefilled == prompt, (rid, prefilled, prompt)
    assert_kv_idle(llm)


def test_beams_under_max_utilization_need_swap(make_llm):
    recompute = make_llm(scheduler_config=SchedulerConfig("max_utilization"))
    with pytest.raises(
        RequestError, match=r"preemption_mode='swap'.*host_cache_size.*got preemption_mode='recompute'"
    ) as e:
        recompute.generate(LLM_PROMPTS[0], beam_params(2, 1), use_tqdm=False)
    assert e.value.param == "use_beam_search"
    static = make_llm(scheduler_config=SchedulerConfig("static_batch"))
    with pytest.raises(RequestError, match="needs capacity_scheduler_policy GUARANTEED_NO_EVICT"):
        static.generate(LLM_PROMPTS[0], beam_params(2, 1), use_tqdm=False)


def test_swapped_beams_never_hold_the_pool_between_them(make_llm, hf, tiny_model_dir):
    """A pool of 14 blocks, most of them the shared blocks of beam requests (a 57-token prompt's 7
    full blocks among them): the blocks a swapped-out beam request's beams share stay in the primary
    pool, so two of them swapped out at once could hold it with neither able to come back. Such a swap
    is refused (the request is kept, others make room): everything finishes with transformers' beams
    and tokens, nothing fails, nothing waits forever (chunked prefill and the overlap scheduler on)."""
    cfg = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = LLM_TPB * 2 * cfg["num_hidden_layers"] * heads * head_dim * 4  # fp32 K and V
    llm = make_llm(
        disable_overlap_scheduler=False,
        enable_chunked_prefill=True,
        max_num_tokens=16,
        kv_cache_config=KvCacheConfig(
            max_tokens=14 * LLM_TPB, tokens_per_block=LLM_TPB, host_cache_size=8 * block_bytes
        ),
        scheduler_config=SchedulerConfig(capacity_scheduler_policy="MAX_UTILIZATION", preemption_mode="swap"),
    )
    assert llm.executor.kv_cache_manager.impl.num_secondary_blocks == 8
    # (prompt index, K, max_tokens); None: greedy.
    cases = [(2, 2, 12), (1, 2, 4), (1, 2, 5), (8, 4, 7), (9, None, 22), (9, 2, 12)]
    params = [greedy(m) if k is None else beam_params(k, 1, max_new=m, ignore_eos=True) for _, k, m in cases]
    with llm.executor.arrivals():  # the same schedule on every machine
        handles = [llm.generate_async(LLM_PROMPTS[i], p) for (i, _, _), p in zip(cases, params)]
    outs = [h.result(timeout=TIMEOUT) for h in handles]  # a deadlock fails here instead of hanging
    for (i, k, m), out in zip(cases, outs):
        if k is None:
            assert out.outputs[0].token_ids == hf_generate(
                hf, LLM_PROMPTS[i], max_new_tokens=m, eos_token_id=None
            )
        else:
            ref = hf_beams(hf, LLM_PROMPTS[i], k, 1, max_new=m, eos_token_id=None)
            assert [c.token_ids for c in out.outputs] == [t for t, _ in ref], (i, k, m)
        assert all(c.finish_reason == "length" for c in out.outputs)
    swaps = llm.get_stats()[-1]["preemption"]
    assert swaps["num_swapped_out"] > 0 and swaps["num_beams_kept"] > 0, swaps
    assert_kv_idle(llm)


def test_beam_requests_that_hold_the_pool_restart_the_latest(make_llm, hf, tiny_model_dir):
    """Seven beam requests and two greedy ones in 14 blocks, a tier of one block (no beam request fits
    in it): at times the running beam requests hold the pool between them and none can go on. The
    latest of them then restarts from its prompt (its tokens dropped, not folded), so the others
    finish; every output is still transformers', nothing fails, nothing waits forever."""
    cfg = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = LLM_TPB * 2 * cfg["num_hidden_layers"] * heads * head_dim * 4  # fp32 K and V
    llm = make_llm(
        disable_overlap_scheduler=False,
        kv_cache_config=KvCacheConfig(
            max_tokens=14 * LLM_TPB,
            tokens_per_block=LLM_TPB,
            enable_block_reuse=True,
            host_cache_size=block_bytes,
        ),
        scheduler_config=SchedulerConfig(capacity_scheduler_policy="MAX_UTILIZATION", preemption_mode="swap"),
    )
    # (prompt index, K, n, max_tokens); K None: greedy.
    cases = [
        (2, 4, 1, 9), (9, None, 1, 4), (6, 2, 1, 6), (5, 4, 4, 10), (3, 4, 3, 9),
        (6, 4, 4, 10), (1, 2, 1, 7), (1, 3, 3, 8), (4, None, 1, 9),
    ]  # fmt: skip
    params = [
        greedy(m) if k is None else beam_params(k, n, max_new=m, ignore_eos=True) for _, k, n, m in cases
    ]
    with llm.executor.arrivals():  # the same schedule on every machine
        handles = [llm.generate_async(LLM_PROMPTS[i], p) for (i, *_), p in zip(cases, params)]
    outs = [h.result(timeout=TIMEOUT) for h in handles]
    for (i, k, n, m), out in zip(cases, outs):
        if k is None:
            assert out.outputs[0].token_ids == hf_generate(
                hf, LLM_PROMPTS[i], max_new_tokens=m, eos_token_id=None
            )
        else:
            ref = hf_beams(hf, LLM_PROMPTS[i], k, n, max_new=m, eos_token_id=None)
            assert [c.token_ids for c in out.outputs] == [t for t, _ in ref], (i, k, n, m)
        assert all(c.finish_reason == "length" for c in out.outputs)
    swaps = llm.get_stats()[-1]["preemption"]
    assert swaps["num_beams_restarted"] > 0, (
        f"no beam request was restarted: the test proves nothing ({swaps})"
    )
    assert_kv_idle(llm)
