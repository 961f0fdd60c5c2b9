"""Sliding-window KV pools (VSWA, ``KvCacheConfig(sliding_window_pools=True)``) end to end, on the tiny
Gemma 3 of model_utils (layer 0 slides with a window of 8 tokens, layer 1 is global): greedy tokens
identical to transformers with whole and chunked prefill, prefix reuse (prefixes of 16 and 32 tokens,
longer than the window), preemption and speculative decoding; the window pool's blocks stay bounded by
the window while the global pool grows with the sequence; integrity of every manager after every step.
"""

from __future__ import annotations

import pytest
from llm_utils import LLM_MAX_NEW, LLM_PARENT_IDX, LLM_PROMPTS, LLM_TPB, greedy, hf_greedy

from inflight import KvCacheConfig, SamplingParams, SchedulerConfig, SpeculativeConfig
from inflight.executor.kv_cache_creator import plan_window_pools
from inflight.executor.resource_manager import KVCacheResourceManager

WINDOW = 8  # the tiny Gemma 3's sliding_window


def _vswa(**kw) -> KvCacheConfig:
    kw.setdefault("max_tokens", 4096)
    return KvCacheConfig(tokens_per_block=LLM_TPB, sliding_window_pools=True, **kw)


def _ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _window_cap(drafts: int = 0) -> int:
    """The most blocks one decoding sequence holds in the window pool: ceil((W + k) / tpb) + 1."""
    return -(-(WINDOW + drafts) // LLM_TPB) + 1


@pytest.fixture
def watch(monkeypatch):
    """Records, after every prepare_resources, each sequence's held blocks per pool, and checks the
    integrity of every manager (the global one and each window's)."""
    seen: list[dict] = []
    original = KVCacheResourceManager.prepare_resources

    def prepare(self, batch):
        original(self, batch)
        if not self.window_groups:
            return
        self.impl.check_integrity()
        for g in self.window_groups:
            g.kv.impl.check_integrity()
        for req in batch.generation_requests:
            rid = req.request_id
            seen.append(
                {
                    "tokens": self.impl.get_num_tokens(rid),
                    "global": len(self.impl.get_block_ids(rid)),
                    "window": [g.kv.impl.get_num_held_blocks(rid) for g in self.window_groups],
                    "drafts": req.num_draft_tokens,
                }
            )

    monkeypatch.setattr(KVCacheResourceManager, "prepare_resources", prepare)
    return seen


def _assert_clean(llm) -> None:
    kv = llm.executor.kv_cache_manager
    assert kv.window_groups, "the engine runs without window pools: the test shows nothing"
    for impl in (kv.impl, *(g.kv.impl for g in kv.window_groups)):
        impl.check_integrity()
        assert impl.num_sequences == 0
        assert impl.num_used_blocks == 0


@pytest.fixture
def fused_steps(monkeypatch):
    """Counts the steps the fused CPU stack ran with a window pool (it reads the pool's own tables)."""
    from inflight.layers.fused_cpu import FusedCpuLayers

    seen = {"windowed": 0}
    original = FusedCpuLayers.forward

    def forward(self, hidden, cos_sin, metadata, kv_caches, *args, **kwargs):
        if metadata.window_metadata:
            seen["windowed"] += 1
        return original(self, hidden, cos_sin, metadata, kv_caches, *args, **kwargs)

    monkeypatch.setattr(FusedCpuLayers, "forward", forward)
    return seen


@pytest.mark.parametrize("fused", [True, False], ids=["fused-stack", "python-layers"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
def test_greedy_identical_to_transformers_with_reuse(
    make_llm, hf_greedy_refs, watch, fused_steps, monkeypatch, chunked, fused
):
    if not fused:
        monkeypatch.setenv("INFLIGHT_FUSED_LAYERS", "0")
    kwargs = {"enable_chunked_prefill": True, "max_num_tokens": 16} if chunked else {}
    llm = make_llm("gemma3", kv_cache_config=_vswa(), **kwargs)
    ref = hf_greedy_refs("gemma3")
    # The parents first: their blocks (stored as their windows slid, and at the end) serve the children.
    parents = [LLM_PROMPTS[i] for i in LLM_PARENT_IDX]
    assert _ids(llm.generate(parents, greedy(), use_tqdm=False)) == [ref[i] for i in LLM_PARENT_IDX]
    children = [i for i in range(len(LLM_PROMPTS)) if i not in LLM_PARENT_IDX]
    assert _ids(llm.generate([LLM_PROMPTS[i] for i in children], greedy(), use_tqdm=False)) == [
        ref[i] for i in children
    ]
    stats = llm.get_stats()[-1]["kv_cache_stats"]
    assert stats["reused_blocks"] > 0
    # The children's prefixes (16 and 32 tokens) are longer than the window: its pool reused them too.
    assert stats["window_pools"][0]["reused_blocks"] > 0
    assert watch, "no decode step was seen"
    for row in watch:
        assert row["window"][0] <= _window_cap(row["drafts"]), row
        assert row["global"] == -(-row["tokens"] // LLM_TPB), row
    assert (fused_steps["windowed"] > 0) == fused
    _assert_clean(llm)


def test_long_request_holds_window_bounded_blocks(make_llm, tiny_model_dir, watch):
    """A 300-token prompt and 60 new tokens: the global layer holds every token's block, the sliding
    layer at most ceil(W / tpb) + 1 blocks at every decode step."""
    prompt = (LLM_PROMPTS[8] * 6)[:300]
    llm = make_llm("gemma3", kv_cache_config=_vswa(), enable_chunked_prefill=True, max_num_tokens=64)
    out = _ids(llm.generate([prompt], greedy(60), use_tqdm=False))
    assert out == hf_greedy(tiny_model_dir("gemma3"), [prompt], 60)
    assert len(watch) == 59  # every decode step (the first token comes from the prefill)
    for row in watch:
        assert row["global"] == -(-row["tokens"] // LLM_TPB)
        assert row["window"][0] <= _window_cap()
    last = watch[-1]
    assert last["global"] >= 45 and last["window"][0] <= 2  # 359 tokens: 45 blocks against 2
    _assert_clean(llm)


def test_preemption_and_speculation_change_nothing(make_llm, tiny_model_dir):
    """A pool small enough that MAX_UTILIZATION pauses and recomputes requests, with n-gram drafts
    (the window managers rewind with the global one): outputs equal transformers'."""
    prompts = [p[:12] * 3 for p in (LLM_PROMPTS[0], LLM_PROMPTS[3], LLM_PROMPTS[8], LLM_PROMPTS[1] * 2)]
    ref = hf_greedy(tiny_model_dir("gemma3"), prompts, 40)
    sched = SchedulerConfig(capacity_scheduler_policy="MAX_UTILIZATION")
    # 24 blocks of both layers, split for sequences of 128 tokens: 30 global blocks (the four requests
    # need 40) and 18 in the window pool.
    kv = _vswa(max_tokens=24 * LLM_TPB, enable_block_reuse=False)
    for spec in (None, SpeculativeConfig(method="ngram", max_draft_len=3)):
        llm = make_llm(
            "gemma3", kv_cache_config=kv, scheduler_config=sched, speculative_config=spec, max_seq_len=128
        )
        assert _ids(llm.generate(prompts, greedy(40), use_tqdm=False)) == ref
        assert sum(s["num_paused_requests"] for s in llm.get_stats()) > 0, "no preemption: shows nothing"
        _assert_clean(llm)


def test_the_split_gains_and_is_logged(make_llm, caplog):
    with caplog.at_level("INFO", logger="inflight"):
        llm = make_llm("gemma3", kv_cache_config=_vswa())
    text = caplog.text
    assert "sliding-window pools (VSWA)" in text, text
    kv = llm.executor.kv_cache_manager
    # 4096 tokens in one pool: 512 blocks for both layers. Split: a whole 512-token sequence in the
    # global layer, 2 blocks per decoding sequence in the window layer.
    plan = plan_window_pools((WINDOW, 0), 512, LLM_TPB, 512)
    assert kv.num_blocks == plan.num_global_blocks > 512
    assert kv.window_groups[0].kv.num_blocks == plan.window_blocks[WINDOW] < 512
    assert plan.sequences > 1.5 * plan.sequences_without  # at most 2x with one of two layers sliding
    assert kv.bytes <= 4096 * 2 * 2 * 1 * 32 * 4  # within the budget of one pool (fp32, 2 layers)


def test_plan_refuses_what_does_not_gain():
    assert plan_window_pools((0, 0), 100, 8, 512) is None  # no window
    assert plan_window_pools((8, 8), 100, 8, 512) is None  # no global layer
    assert plan_window_pools((600, 0), 100, 8, 512) is None  # the window covers max_seq_len


def test_unsupported_combinations_are_clear_errors(make_llm):
    with pytest.raises(ValueError, match="sliding_window_pools.*host_cache_size"):
        KvCacheConfig(sliding_window_pools=True, host_cache_size=1 << 20)
    llm = make_llm("gemma3", kv_cache_config=_vswa())
    with pytest.raises(ValueError, match="use_beam_search.*sliding_window_pools"):
        llm.generate(
            [LLM_PROMPTS[0]], SamplingParams(use_beam_search=True, best_of=2, max_tokens=4), use_tqdm=False
        )
    # Other requests are untouched by the refusal.
    assert len(_ids(llm.generate([LLM_PROMPTS[1]], greedy(LLM_MAX_NEW), use_tqdm=False))[0]) == LLM_MAX_NEW


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantized_kv_in_window_pools(make_llm, dtype):
    """The window pools hold the KV dtype of the engine: int8 codes with scales, E4M3 bytes; tokens as
    with one pool of that dtype."""
    prompts = LLM_PROMPTS[:6]
    one = make_llm(
        "gemma3", kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=LLM_TPB, dtype=dtype)
    )
    ref = _ids(one.generate(prompts, greedy(), use_tqdm=False))
    llm = make_llm("gemma3", kv_cache_config=_vswa(dtype=dtype))
    assert _ids(llm.generate(prompts, greedy(), use_tqdm=False)) == ref
    _assert_clean(llm)


def test_gemma3_270m_8k_request_holds_window_bounded_blocks(watch):
    """The real Gemma 3 270M (15 layers slide over 512 tokens, 3 are global), an 8,192-token prompt in
    chunks of 1,024: at every decode step the global pool holds every block of the request and the
    window pool at most ceil(512 / 32) + 1, every manager intact."""
    import random

    from inflight.llm import LLM

    rng = random.Random(0)
    prompt = [rng.randrange(1000, 200000) for _ in range(8192)]
    llm = LLM(
        "gemma3-270m",
        kv_cache_config=KvCacheConfig(max_tokens=16384, sliding_window_pools=True),
        max_seq_len=8192 + 64,
        enable_chunked_prefill=True,
        max_num_tokens=1024,
    )
    try:
        kv = llm.executor.kv_cache_manager
        assert [g.window for g in kv.window_groups] == [512] and len(kv.window_groups[0].layers) == 15
        out = _ids(llm.generate([prompt], greedy(8), use_tqdm=False))
        assert len(out[0]) == 8
        assert len(watch) == 7
        for row in watch:
            assert row["global"] == -(-row["tokens"] // 32)
            assert row["window"][0] <= 512 // 32 + 1
        assert watch[-1]["global"] == 257  # 8,199 tokens
        _assert_clean(llm)
    finally:
        llm.shutdown()
