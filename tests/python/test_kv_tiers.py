"""The secondary KV tier in the engine (KvCacheConfig.host_cache_size / host_cache_path) and swap
preemption (SchedulerConfig.preemption_mode="swap"), on tiny random Llamas: the transfers move every
tensor of a block exactly, a prefix evicted from the primary pool comes back from the tier (memory or
a file) with fewer prefill tokens and the same tokens, a request paused under MAX_UTILIZATION is swapped
out and in without a second prefill, and bad values are refused by name. The accounting itself is
tested in test_kv_secondary.py (C++ and twin).
"""

from __future__ import annotations

import json
import logging
import os
import random

import pytest
import torch
from llm_utils import LLM_PROMPTS, LLM_TPB, assert_kv_idle, greedy

from inflight.batch_manager import LlmRequest, LlmRequestState, RequestList
from inflight.executor.kv_secondary_pool import header_bytes
from inflight.executor.preemption import Preemption
from inflight.executor.resource_manager import KVCacheResourceManager
from inflight.executor.scheduler import ScheduledRequests
from inflight.llm_args import KvCacheConfig, LlmArgs, SchedulerConfig

# ---- the transfers, on the resource manager alone ----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "file"])
def test_suspend_resume_moves_every_tensor_of_a_block(tmp_path, dtype, on_disk):
    """Swap out a 17-token sequence (5 blocks of 4) and back in: the tier's rows hold exactly its blocks
    (an int8 pool's scales too; an fp8 pool is one uint8 tensor of E4M3 bytes), and after the primary blocks were overwritten the resumed blocks hold
    the original bytes again."""
    path = str(tmp_path / "tier.bin") if on_disk else None
    rm = KVCacheResourceManager.allocate(
        3, 2, 8, 6, 4, 32, dtype, torch.device("cpu"), False, num_secondary_blocks=7, host_cache_path=path
    )
    tensors = [rm.pool] if rm.scales is None else [rm.pool, rm.scales]
    assert len(rm.secondary.tensors) == len(tensors) == (2 if dtype == torch.int8 else 1)
    gen = torch.Generator().manual_seed(0)
    for t in tensors:
        t.copy_((100 * torch.rand(t.shape, generator=gen)).to(t.dtype))
    kv = rm.impl
    kv.add_sequence(1, 17, 1, None)
    blocks = kv.get_block_ids(1)
    assert len(blocks) == 5
    want = [torch.stack([t[:, :, b].clone() for b in blocks]) for t in tensors]
    assert rm.suspend(LlmRequest(1, 4, list(range(17))))
    sec = kv.get_block_ids(1)
    assert all(kv.get_block_level(b) == 1 for b in sec)
    rm.prepare_resources(ScheduledRequests())  # executes the offloads
    for w, s in zip(want, rm.secondary.tensors):
        assert torch.equal(s[[b - 6 for b in sec]], w)
    for t in tensors:
        t.zero_()
    rm.resume(LlmRequest(1, 4, list(range(17))))
    rm.prepare_resources(ScheduledRequests())  # executes the onboards
    back = kv.get_block_ids(1)
    for w, t in zip(want, tensors):
        assert torch.equal(torch.stack([t[:, :, b] for b in back]), w)
    kv.remove_sequence(1)
    kv.check_integrity()
    if on_disk:
        assert os.path.getsize(path) == rm.secondary.nbytes
    rm.shutdown()


def test_swapped_requests_come_back_in_order_and_nothing_overtakes_them():
    """Preemption.schedulable, exactly: 8 primary blocks of 4 tokens; A, B, C decode (2 blocks each and 1
    more for the next token), C then B are swapped out, D (a new 8-token prompt) waits behind them."""
    rm = KVCacheResourceManager.allocate(
        1, 1, 4, 8, 4, 32, torch.float32, torch.device("cpu"), False, num_secondary_blocks=5
    )
    kv = rm.impl
    reqs = []
    for rid in (1, 2, 3):
        r = LlmRequest(rid, 4, list(range(8)))
        kv.add_sequence(rid, 8, 1, None)
        r.state = LlmRequestState.GENERATION_IN_PROGRESS
        r.add_new_token(5)
        reqs.append(r)
    a, b, c = reqs
    d = LlmRequest(4, 4, list(range(8)))
    preemption = Preemption("swap", rm)
    active = RequestList([a, b, c, d])
    assert preemption.schedulable(active) is active  # nothing swapped out: the list itself
    assert preemption.swap_out(c) and preemption.swap_out(b)
    assert not preemption.swap_out(a)  # 2 blocks needed, 1 free in the tier: recomputed instead
    assert preemption.num_recomputed == 1 and not kv.is_suspended(1)
    assert kv.num_free_blocks == 6
    # A's next block (1), then B: 1 + 1 + 2 <= 6 free, resumed (4 free left); C: 2 + 1 + 2 > 4: cut.
    shown = preemption.schedulable(active)
    assert [r.request_id for r in shown] == [1, 2]
    assert not kv.is_suspended(2) and kv.is_suspended(3) and kv.num_free_blocks == 4
    rm.prepare_resources(ScheduledRequests())  # the onboards
    kv.remove_sequence(1)  # A finished: 6 free
    active = RequestList([b, c, d])
    assert preemption.schedulable(active) is active  # C resumed: 1 + 1 + 2 <= 6; D shown again
    assert kv.num_suspended_sequences == 0 and preemption.num_swapped_in == 2
    assert preemption.stats() == {
        "num_swapped_out": 2,
        "num_swapped_in": 2,
        "num_recomputed": 1,
        "num_beams_kept": 0,
        "num_beams_restarted": 0,
        "num_swapped_requests": 0,
    }
    kv.check_integrity()


# ---- a prefix evicted from the primary pool, back from the tier --------------------------------------

PREFIX_TPB = 32
POOL_TOKENS = 1280  # 40 blocks: the 1,000-token prefix (31 full blocks) and one other prompt at most


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    from model_utils import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("long"), "llama", max_position_embeddings=2048)


def _block_bytes(model_dir, dtype: str) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    # int8: codes + one fp32 scale; fp8: one byte per element
    per_head = {"int8": head_dim + 4, "fp8": head_dim}.get(dtype, 4 * head_dim)
    return PREFIX_TPB * 2 * cfg["num_hidden_layers"] * heads * per_head


def _prefix_prompts() -> list[list[int]]:
    """A 1,000-token prefix with a suffix, two unrelated 1,000-token prompts that evict it from the
    primary pool, and the prefix again with another suffix."""
    rng = random.Random(7)

    def rand(n: int) -> list[int]:
        return [rng.randrange(3, 384) for _ in range(n)]

    prefix = rand(1000)
    return [prefix + rand(3), rand(1000), rand(1000), prefix + rand(4)]


def _run_sequentially(make_llm, model_dir, prompts, **kv_kwargs):
    """One prompt at a time; (tokens per prompt, context tokens scheduled per prompt, the LLM)."""
    kv = KvCacheConfig(tokens_per_block=PREFIX_TPB, **kv_kwargs)
    llm = make_llm(model=model_dir, kv_cache_config=kv)
    outs = [llm.generate([p], greedy(8), use_tqdm=False)[0] for p in prompts]
    chunks = {e["id"]: sum(n for _, n in e["chunks"]) for e in llm.executor.timelines.snapshot()}
    prefilled = [chunks[o.request_id] for o in outs]
    return [o.outputs[0].token_ids for o in outs], prefilled, llm


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "file"])
def test_evicted_prefix_is_onboarded_from_the_tier(make_llm, long_model, tmp_path, kv_dtype, on_disk):
    prompts = _prefix_prompts()
    block_bytes = _block_bytes(long_model, kv_dtype)
    # Without a tier the prefix is evicted and prefilled again; with a big primary pool it stays there.
    base, base_prefilled, _ = _run_sequentially(
        make_llm, long_model, prompts, max_tokens=POOL_TOKENS, dtype=kv_dtype
    )
    assert base_prefilled[3] == len(prompts[3]), (
        "the prefix stayed in the primary pool: the test proves nothing"
    )
    kept, _, _ = _run_sequentially(make_llm, long_model, prompts, max_tokens=4 * POOL_TOKENS, dtype=kv_dtype)

    path = str(tmp_path / "kv-tier.bin") if on_disk else None
    tier_blocks = 100
    toks, prefilled, llm = _run_sequentially(
        make_llm,
        long_model,
        prompts,
        max_tokens=POOL_TOKENS,
        dtype=kv_dtype,
        host_cache_size=tier_blocks * block_bytes + block_bytes // 2,  # a part block is not counted
        host_cache_path=path,
    )
    # The prefix KV comes back bit for bit: the same tokens as a primary-pool hit on it.
    assert toks == kept
    if kv_dtype == "auto":  # fp32: also as recomputing it
        assert toks == base
    assert prefilled[:3] == base_prefilled[:3]
    assert prefilled[3] == len(prompts[3]) - 31 * PREFIX_TPB  # only the tail past the 31 cached blocks
    stats = llm.executor.kv_cache_manager.get_kv_cache_stats()
    assert stats["max_num_secondary_blocks"] == tier_blocks
    assert stats["onboarded_blocks"] >= 31 and stats["secondary_reused_blocks"] >= 31, stats
    assert stats["offloaded_blocks"] >= 31 and stats["secondary_hit_rate"] > 0, stats
    assert llm.kv_budget.num_secondary_blocks == tier_blocks
    assert_kv_idle(llm)
    if on_disk:
        assert os.path.isfile(path)
        size = os.path.getsize(path)
        assert size == llm.executor.kv_cache_manager.secondary.nbytes
        assert size >= tier_blocks * block_bytes
        if kv_dtype == "auto":
            # The header region of the persistent tier (its index), then the blocks.
            assert size == header_bytes(tier_blocks, PREFIX_TPB) + tier_blocks * block_bytes


# ---- swap preemption ---------------------------------------------------------------------------------


def _preempting_llm(make_llm, mode: str, overlap: bool, reuse: bool, host_cache_size: int | None = 1 << 20):
    return make_llm(
        disable_overlap_scheduler=not overlap,
        kv_cache_config=KvCacheConfig(
            max_tokens=24 * LLM_TPB,
            tokens_per_block=LLM_TPB,
            enable_block_reuse=reuse,
            host_cache_size=host_cache_size,
        ),
        scheduler_config=SchedulerConfig(capacity_scheduler_policy="MAX_UTILIZATION", preemption_mode=mode),
    )


def _prefill_counts(llm) -> dict[int, tuple[int, int]]:
    """request id -> (context tokens scheduled, prompt tokens)."""
    return {
        e["id"]: (sum(n for _, n in e["chunks"]), e["prompt_tokens"])
        for e in llm.executor.timelines.snapshot()
    }


@pytest.mark.parametrize("reuse", [False, True], ids=["noreuse", "reuse"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_swap_preemption_prefills_once(make_llm, hf_greedy_refs, overlap, reuse):
    want = hf_greedy_refs("llama")  # transformers, one prompt at a time: no preemption
    llm = _preempting_llm(make_llm, "swap", overlap, reuse)
    outs = llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.get_stats()
    assert sum(s["num_paused_requests"] for s in stats) > 0, "no request was paused: the test proves nothing"
    swaps = stats[-1]["preemption"]
    assert swaps["num_swapped_out"] > 0 and swaps["num_recomputed"] == 0, swaps
    assert swaps["num_swapped_in"] == swaps["num_swapped_out"] and swaps["num_swapped_requests"] == 0
    for rid, (prefilled, prompt) in _prefill_counts(llm).items():
        # No second prefill: each prompt's context tokens once (fewer after a prefix hit).
        assert prefilled == prompt if not reuse else 0 < prefilled <= prompt, (rid, prefilled, prompt)
    kv = llm.executor.kv_cache_manager.get_kv_cache_stats()
    assert kv["offloaded_blocks"] > 0 and kv["onboarded_blocks"] > 0, kv
    assert kv["used_num_secondary_blocks"] == 0
    assert_kv_idle(llm)


def test_swap_mid_context(make_llm, hf_greedy_refs):
    """Chunked prefill (16-token steps): a request paused between two chunks of its prompt is swapped
    out and goes on with its next chunk once back."""
    llm = make_llm(
        enable_chunked_prefill=True,
        max_num_tokens=16,
        kv_cache_config=KvCacheConfig(
            max_tokens=24 * LLM_TPB,
            tokens_per_block=LLM_TPB,
            enable_block_reuse=False,
            host_cache_size=1 << 20,
        ),
        scheduler_config=SchedulerConfig(capacity_scheduler_policy="MAX_UTILIZATION", preemption_mode="swap"),
    )
    ex = llm.executor
    swap_out, mid_context = ex.preemption.swap_out, []

    def look(req) -> bool:
        mid_context.append(bool(req.is_context_init_state))
        return swap_out(req)

    ex.preemption.swap_out = look
    outs = llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_refs("llama")
    assert any(mid_context), f"no context was paused between chunks: the test proves nothing ({mid_context})"
    for prefilled, prompt in _prefill_counts(llm).values():
        assert prefilled == prompt
    assert_kv_idle(llm)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_swap_preemption_with_quantised_kv(make_llm, kv_dtype):
    """An int8 pool's blocks (codes and scales) or an fp8 pool's (E4M3 bytes) swapped out and in: the
    tokens of the same engine with a pool that needs no preemption."""
    big = make_llm(kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=LLM_TPB, dtype=kv_dtype))
    want = [o.outputs[0].token_ids for o in big.generate(LLM_PROMPTS, greedy(), use_tqdm=False)]
    llm = make_llm(
        kv_cache_config=KvCacheConfig(
            max_tokens=24 * LLM_TPB, tokens_per_block=LLM_TPB, dtype=kv_dtype, host_cache_size=1 << 20
        ),
        scheduler_config=SchedulerConfig(capacity_scheduler_policy="MAX_UTILIZATION", preemption_mode="swap"),
    )
    outs = llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    swaps = llm.get_stats()[-1]["preemption"]
    assert swaps["num_swapped_out"] > 0 and swaps["num_recomputed"] == 0, swaps
    assert_kv_idle(llm)


def test_recompute_prefills_again(make_llm, hf_greedy_refs):
    """The contrast to the test above (the count can fail): recompute prefills a paused request again."""
    llm = _preempting_llm(make_llm, "recompute", False, False, host_cache_size=None)
    outs = llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_refs("llama")
    assert any(prefilled > prompt for prefilled, prompt in _prefill_counts(llm).values())


def test_cancel_while_swapped_out(make_llm, hf_greedy_refs):
    """The first request swapped out is cancelled at once (the loop takes the cancel before it could
    resume it): it ends "cancelled", its secondary blocks are freed, the others are unaffected."""
    llm = _preempting_llm(make_llm, "swap", False, False)
    ex = llm.executor
    swap_out, cancelled = ex.preemption.swap_out, []

    def swap_out_and_cancel(req) -> bool:
        out = swap_out(req)
        if out and not cancelled:
            cancelled.append(req.request_id)
            ex.cancel_request(req.request_id)
        return out

    cancel, suspended_then = ex._cancel, []

    def cancel_and_look(ids) -> None:
        suspended_then.extend(ex.kv_cache_manager.impl.is_suspended(i) for i in ids)
        cancel(ids)

    ex.preemption.swap_out = swap_out_and_cancel
    ex._cancel = cancel_and_look
    outs = llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)
    assert cancelled, "no request was swapped out: the test proves nothing"
    assert suspended_then == [True]
    want = hf_greedy_refs("llama")
    for o, w in zip(outs, want):
        if o.request_id == cancelled[0]:
            assert o.outputs[0].finish_reason == "cancelled"
        else:
            assert o.outputs[0].finish_reason == "length" and o.outputs[0].token_ids == w
    assert llm.executor.kv_cache_manager.get_kv_cache_stats()["used_num_secondary_blocks"] == 0
    assert_kv_idle(llm)


def test_swap_falls_back_to_recompute_when_the_tier_is_full(make_llm, hf_greedy_refs, tiny_model_dir):
    block_bytes = _block_bytes(tiny_model_dir("llama"), "auto") // PREFIX_TPB * LLM_TPB
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("inflight")
    log.addHandler(handler)
    try:
        llm = _preempting_llm(make_llm, "swap", False, False, host_cache_size=2 * block_bytes)
        outs = llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)
    finally:
        log.removeHandler(handler)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_refs("llama")
    swaps = llm.get_stats()[-1]["preemption"]
    assert swaps["num_recomputed"] > 1, swaps
    assert sum("has no room to swap it out" in r.getMessage() for r in records) == 1
    assert_kv_idle(llm)


# ---- bad values ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(host_cache_size=-1), r"KvCacheConfig.host_cache_size must be None or an integer >= 0, got -1"),
        (
            dict(host_cache_size=1.5),
            r"KvCacheConfig.host_cache_size must be None or an integer >= 0, got 1.5",
        ),
        (
            dict(host_cache_path="/tmp/kv.bin"),
            r"host_cache_path='/tmp/kv.bin' needs KvCacheConfig.host_cache_size",
        ),
        (
            dict(host_cache_path=3, host_cache_size=1 << 20),
            r"host_cache_path must be None or a file path, got 3",
        ),
    ],
)
def test_bad_tier_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KvCacheConfig(**kwargs)


def test_bad_preemption_mode():
    with pytest.raises(
        ValueError, match=r"preemption_mode must be one of \['recompute', 'swap'\], got 'page'"
    ):
        SchedulerConfig(preemption_mode="page")


def test_swap_needs_a_tier():
    with pytest.raises(
        ValueError, match=r"preemption_mode='swap' needs KvCacheConfig.host_cache_size.*got None"
    ):
        LlmArgs(scheduler_config=SchedulerConfig(preemption_mode="swap"))
    with pytest.raises(ValueError, match=r"host_cache_size .*not supported by a parallel engine"):
        LlmArgs(kv_cache_config=KvCacheConfig(host_cache_size=1 << 20), tensor_parallel_size=2)


def test_tier_smaller_than_a_block_is_refused(make_llm, tiny_model_dir):
    block_bytes = _block_bytes(tiny_model_dir("llama"), "auto") // PREFIX_TPB * LLM_TPB
    kv = KvCacheConfig(max_tokens=4096, tokens_per_block=LLM_TPB, host_cache_size=block_bytes - 1)
    with pytest.raises(
        ValueError, match=rf"host_cache_size must be 0, None or at least one KV block \({block_bytes} "
    ):
        make_llm(kv_cache_config=kv)


@pytest.mark.parametrize("where", ["missing-dir", "a-dir"])
def test_bad_tier_path(make_llm, tmp_path, where):
    path = tmp_path / "nope" / "kv.bin" if where == "missing-dir" else tmp_path
    kv = KvCacheConfig(
        max_tokens=4096, tokens_per_block=LLM_TPB, host_cache_size=1 << 20, host_cache_path=path
    )
    match = "does not exist" if where == "missing-dir" else "must be a file, got the directory"
    with pytest.raises(ValueError, match=rf"KvCacheConfig.host_cache_path.*{match}"):
        make_llm(kv_cache_config=kv)
