"""INT8 KV cache above the ops (test_kv_int8.py has the kernels): the configuration, the pool and its
budget, both attention backends, the fused CPU layer stack, and the engine end to end on a tiny random
Llama, against the same engine with an fp32 KV cache.
"""

from __future__ import annotations

import argparse
import copy
import logging

import pytest
import torch
from llm_utils import LLM_PROMPTS, LLM_TPB, greedy
from model_utils import PagedKV, make_attention_metadata, make_tiny_model

from inflight import KvCacheConfig, SchedulerConfig, SpeculativeConfig
from inflight.executor import kv_cache_creator
from inflight.executor.kv_cache_creator import cpu_kv_budget, kv_bytes_per_token
from inflight.executor.resource_manager import KVCacheResourceManager
from inflight.executor.step_channel import allocate_caches
from inflight.layers.attention import (
    Int8KvCache,
    key_rotation_block,
    key_rotation_matrices,
    key_rotation_shifts,
)
from inflight.layers.fused_cpu import FusedCpuLayers
from inflight.layers.native_attention import NativeAttentionBackend
from inflight.layers.torch_attention import TorchAttentionBackend
from inflight.llm_args import LlmArgs, add_cli_arguments
from inflight.ops.reference import attention as ref

# ---- configuration ----------------------------------------------------------------------------------


def test_kv_cache_config_accepts_int8_and_names_the_rest():
    assert KvCacheConfig(dtype="int8").dtype == "int8"
    assert KvCacheConfig(dtype=torch.int8).dtype == "int8"
    assert KvCacheConfig(dtype=" INT8 ").dtype == "int8"
    assert KvCacheConfig(dtype="bf16").dtype == "bfloat16"
    for bad in ("fp4", "int4", torch.uint8, 8):
        with pytest.raises(
            ValueError,
            match=r"KvCacheConfig.dtype must be 'auto', 'float32', 'bfloat16', 'float16', 'int8' or 'fp8'",
        ):
            KvCacheConfig(dtype=bad)
    p = argparse.ArgumentParser()
    add_cli_arguments(p)
    args = LlmArgs.from_cli(p.parse_args(["--kv-cache-dtype", "int8"]), model="m")
    assert args.kv_cache_config.dtype == "int8"


def test_int8_kv_cache_checks_its_tensors():
    kv = torch.zeros(2, 3, 4, 2, 8, dtype=torch.int8)
    Int8KvCache(kv, torch.zeros(2, 3, 4, 2))
    with pytest.raises(ValueError, match=r"Int8KvCache.kv must be int8"):
        Int8KvCache(kv.float(), torch.zeros(2, 3, 4, 2))
    with pytest.raises(ValueError, match=r"Int8KvCache.scales must be float32 \[2, 3, 4, 2\]"):
        Int8KvCache(kv, torch.zeros(2, 3, 4, 8))


# ---- the pool and its budget ------------------------------------------------------------------------


def test_int8_pool_holds_scales_and_copies_them():
    m = KVCacheResourceManager.allocate(3, 2, 64, 10, 4, 64, torch.int8, torch.device("cpu"), False)
    assert m.pool.dtype == torch.int8 and m.scales.shape == (3, 2, 10, 4, 2)
    assert all(isinstance(c, Int8KvCache) for c in m.kv_caches) and len(m.kv_caches) == 3
    assert m.bytes == 3 * 2 * 10 * 4 * 2 * (64 + 4)
    m.kv_caches[1].kv[:, 5].fill_(7)  # the per-layer objects are views into the pool
    m.kv_caches[1].scales[:, 5].fill_(0.5)
    m.copy_blocks([(5, 2)])  # copy-on-write (beam search): codes and scales move together
    assert bool((m.pool[1, :, 2] == 7).all()) and bool((m.scales[1, :, 2] == 0.5).all())
    assert bool((m.scales[0, :, 2] == 0).all())
    model = type("M", (), {"num_layers": 3, "kv_cache_shape": lambda self, nb, tpb: (2, nb, tpb, 2, 64)})()
    follower = allocate_caches(model, 10, 4, torch.int8, "cpu")  # a parallel rank's pool
    assert [type(c) for c in follower] == [Int8KvCache] * 3 and follower[0].scales.shape == (2, 10, 4, 2)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_budget_holds_3_5x_the_tokens_of_fp32_in_the_same_bytes(monkeypatch, head_dim):
    monkeypatch.setattr(kv_cache_creator, "available_host_memory", lambda: 3 << 30)
    cfg = KvCacheConfig(tokens_per_block=32)
    budgets = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        bpt = kv_bytes_per_token(30, 3, head_dim, dtype)
        budgets[dtype] = cpu_kv_budget(cfg, bpt, 8192)
    fp32, bf16, int8 = budgets[torch.float32], budgets[torch.bfloat16], budgets[torch.int8]
    assert int8.bytes_per_token == 2 * 30 * 3 * (head_dim + 4)  # the scales are counted
    assert int8.num_tokens >= 3.5 * fp32.num_tokens
    assert int8.num_tokens >= 1.85 * bf16.num_tokens
    assert abs(int8.bytes - fp32.bytes) <= 32 * fp32.bytes_per_token  # the same bytes, up to a block


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_engine_budget_log_line_shows_the_int8_capacity(make_llm, tiny_model_dir, monkeypatch):
    """The start-up line of two engines given the same memory: int8 KV holds >= 3.5x the tokens
    (head_dim 64: 4 x 64 / (64 + 4) = 3.76), and the pool it allocates is what the line says."""
    monkeypatch.setattr(kv_cache_creator, "available_host_memory", lambda: 64 << 20)
    path = tiny_model_dir("llama", head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    log = logging.getLogger("inflight")
    level = log.level
    budgets = {}
    for dtype in ("float32", "int8"):
        keep = _Keep()
        log.addHandler(keep)
        log.setLevel(logging.INFO)
        try:
            llm = make_llm(model=path, kv_cache_config=KvCacheConfig(tokens_per_block=LLM_TPB, dtype=dtype))
        finally:
            log.removeHandler(keep)
            log.setLevel(level)
        budgets[dtype] = llm.kv_budget
        lines = [m for m in keep.messages if m.startswith("KV cache")]
        assert len(lines) == 1 and f"{llm.kv_budget.num_tokens} tokens" in lines[0], keep.messages
        assert ("int8 + fp32 scales" in lines[0]) == (dtype == "int8"), lines[0]
        assert llm.executor.kv_cache_manager.bytes == llm.kv_budget.bytes
    assert budgets["int8"].num_tokens >= 3.5 * budgets["float32"].num_tokens


# ---- attention backends -----------------------------------------------------------------------------


def _int8_cache(num_blocks, tpb, kvh, hd, seed):
    gen = torch.Generator().manual_seed(seed)
    kv, scales = ref.quantize_kv(torch.randn(2, num_blocks, tpb, kvh, hd, generator=gen))
    return Int8KvCache(kv, scales)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_backend_equals_torch_backend_int8(dtype, window):
    """Contexts, chunks after cached tokens and decodes in one step: both backends store the same
    codes and scales, and attend alike."""
    tpb, kvh, nh, hd = 16, 3, 9, 64
    seqs = [(0, 97), (13, 17), (96, 1), (1, 1), (1024, 1)]
    gen = torch.Generator().manual_seed(5)
    blocks, b = [], 0
    for c, n in seqs:
        nb = -(-(c + n) // tpb)
        blocks.append(list(range(b, b + nb))[::-1])
        b += nb
    md = make_attention_metadata([(bl, c, n) for bl, (c, n) in zip(blocks, seqs)], tpb, num_contexts=2)
    q = torch.randn(md.num_tokens, nh, hd, generator=gen).to(dtype)
    k = torch.randn(md.num_tokens, kvh, hd, generator=gen).to(dtype)
    v = torch.randn(md.num_tokens, kvh, hd, generator=gen).to(dtype)
    outs, caches = [], []
    for backend in (NativeAttentionBackend(), TorchAttentionBackend()):
        cache = _int8_cache(b + 2, tpb, kvh, hd, seed=1)
        outs.append(backend.forward(q, k, v, cache, md, hd**-0.5, window))
        caches.append(cache)
    assert torch.equal(caches[0].kv, caches[1].kv) and torch.equal(caches[0].scales, caches[1].scales)
    assert outs[0].dtype == dtype
    # fp32: the native kernels round q and each tile's probabilities to int16 codes (head_dim 64), the
    # torch backend does not: up to max|v| / 32767 per code, a few codes per output.
    tol = 2e-5 + 8 * 127 * caches[0].scales[1].max().item() / 32767 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        outs[0].float(), outs[1].float(), atol=tol, rtol=1e-5 if dtype == torch.float32 else tol
    )


# ---- the fused CPU layer stack ----------------------------------------------------------------------

_STEPS = [
    [("a", list(range(3, 16))), ("b", [7, 8, 9, 10, 11])],
    [("a", [20, 21, 22, 23, 24, 25, 26]), ("b", [12])],
    [("c", [30, 31, 32]), ("a", [40]), ("b", [41])],
    [("a", [50]), ("b", [51]), ("c", [52])],
]


def _load(path, dtype):
    from inflight.models.loader import load_model

    return load_model(path, dtype=dtype, device=torch.device("cpu"), attention_backend="native").model


def _run(model, kv, steps=_STEPS):
    out = []
    for batch in steps:
        ids, positions, md = kv.step(batch, logits="all")
        out.append(model(ids, positions, md, kv.kv_caches))
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_stack_int8_matches_python_layers(tmp_path, arch, dtype):
    """The fused stack over an INT8 cache against the Python layers over the same cache (Gemma 3: a
    sliding-window layer, its own RoPE table and head_dim 256)."""
    overrides = dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=192) if arch == "llama" else {}
    model = _load(make_tiny_model(tmp_path, arch, with_tokenizer=False, **overrides), dtype)
    assert FusedCpuLayers.unsupported_reason(model) is None
    kv_fused = PagedKV.for_model(model, num_blocks=32, tokens_per_block=4, dtype=torch.int8)
    kv_ref = copy.deepcopy(kv_fused)
    got = _run(model, kv_fused)
    assert isinstance(model.fused_layers(), FusedCpuLayers)
    assert model.fused_layers().accepts(kv_fused.kv_caches, dtype, 5)  # the fused path really ran
    assert all(layer.key_rotation is not None for layer in model.layers)  # both paths rotate q and k
    model._fused = False
    want = _run(model, kv_ref)
    for i, (g, w) in enumerate(zip(got, want)):
        scale = w.abs().max().item()
        tol = (
            dict(rtol=1e-3, atol=1e-3 * scale)
            if dtype == torch.float32
            else dict(rtol=0.05, atol=0.03 * scale)
        )
        torch.testing.assert_close(g, w, **tol, msg=lambda m, i=i: f"step {i}: {m}")
    for a, b in zip(kv_fused.kv_caches, kv_ref.kv_caches):
        da, db = ref.dequantize_kv(a.kv, a.scales), ref.dequantize_kv(b.kv, b.scales)
        # The two paths' K/V differ by rounding at most, i.e. by about one code step.
        step = torch.maximum(a.scales, b.scales)[..., None]
        assert bool(((da - db).abs() <= 1.01 * step + 0.02 * da.abs()).all())


def test_fused_stack_int8_close_to_float_cache(tmp_path):
    """The same model and steps with an fp32 cache: int8 KV changes the logits by a little."""
    model = _load(make_tiny_model(tmp_path, "llama", with_tokenizer=False), torch.float32)
    got = _run(model, PagedKV.for_model(model, num_blocks=32, tokens_per_block=4, dtype=torch.int8))
    want = _run(model, PagedKV.for_model(model, num_blocks=32, tokens_per_block=4))
    for g, w in zip(got, want):
        rel = ((g - w).norm() / w.norm()).item()
        assert 0 < rel < 0.05, f"relative logits error {rel:.3g}"


# ---- key rotation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "head_dim, block", [(8, 8), (16, 16), (64, 64), (80, 16), (96, 32), (128, 128), (256, 128)]
)
def test_key_rotation_is_an_exact_orthogonal_pair(head_dim, block):
    assert key_rotation_block(head_dim) == block
    a, b = key_rotation_shifts(block)
    assert 2 ** (a + b) == block and a - b in (0, 1)
    q_mat, k_mat = key_rotation_matrices(head_dim, torch.float32)
    # Entries +-2**-a / +-2**-b inside the diagonal blocks, zero elsewhere.
    inside = torch.block_diag(*([torch.ones(block, block)] * (head_dim // block))).bool()
    assert bool((q_mat.abs()[inside] == 2.0**-a).all()) and bool((q_mat[~inside] == 0).all())
    assert bool((k_mat.abs()[inside] == 2.0**-b).all()) and bool((k_mat[~inside] == 0).all())
    # (q Q) . (k K) = q . k: Q K^T is the identity, exactly (sums of powers of two).
    assert torch.equal(q_mat @ k_mat.T, torch.eye(head_dim))
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, head_dim, generator=gen), torch.randn(7, head_dim, generator=gen)
    torch.testing.assert_close((q @ q_mat) @ (k @ k_mat).T, q @ k.T, rtol=1e-5, atol=1e-5)


def test_key_rotation_cuts_the_int8_logit_error_of_outlier_channels():
    """Keys whose first channels are 20x the rest (as RoPE'd keys' slow channels are): one int8 scale
    per row gives the other channels a coarse step; rotated, the logits' error is several times smaller."""
    gen = torch.Generator().manual_seed(1)
    head_dim = 64
    k = torch.randn(512, 1, head_dim, generator=gen)
    k[..., :4] *= 20
    q = torch.randn(8, head_dim, generator=gen)
    q_mat, k_mat = key_rotation_matrices(head_dim, torch.float32)

    def logit_error(keys, queries):
        codes, scales = ref.quantize_kv(keys)
        deq = ref.dequantize_kv(codes, scales)[:, 0]
        return ((queries @ deq.T) - (queries @ keys[:, 0].T)).pow(2).mean().sqrt().item()

    plain = logit_error(k, q)
    rotated = logit_error(k @ k_mat, q @ q_mat)
    assert rotated < plain / 3, (plain, rotated)


def test_int8_cache_holds_the_rotated_keys(tmp_path, monkeypatch):
    """The fused stack with rotation on and off (``INFLIGHT_KV_KEY_ROTATION=0``): the cache's keys are
    the unrotated ones times k_mat (to the codes' rounding), its values the same, the logits close."""
    path = make_tiny_model(tmp_path, "llama", with_tokenizer=False)
    runs = {}
    first = None
    for flag in ("1", "0"):
        monkeypatch.setenv("INFLIGHT_KV_KEY_ROTATION", flag)
        model = _load(path, torch.float32)
        if first is None:  # both runs: the same blocks and the same garbage in the unwritten slots
            first = PagedKV.for_model(model, num_blocks=32, tokens_per_block=4, dtype=torch.int8)
        kv = copy.deepcopy(first)
        logits = _run(model, kv)
        assert model.fused_layers().accepts(kv.kv_caches, torch.float32, 5)
        assert all((layer.key_rotation is not None) == (flag == "1") for layer in model.layers)
        runs[flag] = (logits, kv)
    _, k_mat = key_rotation_matrices(model.config.head_dim, torch.float32)
    caches = zip(runs["1"][1].kv_caches, runs["0"][1].kv_caches, first.kv_caches)
    for layer, (on, off, before) in enumerate(caches):
        written = on.scales[0, ..., 0] != before.scales[0, ..., 0]  # [num_blocks, tokens_per_block]
        assert int(written.sum()) == sum(len(ids) for batch in _STEPS for _, ids in batch)
        d_on, d_off = ref.dequantize_kv(on.kv, on.scales), ref.dequantize_kv(off.kv, off.scales)
        k_on, k_off = d_on[0][written], d_off[0][written] @ k_mat
        rel = (k_on - k_off).norm(dim=(-2, -1)) / k_off.norm(dim=(-2, -1))
        assert float(rel.max()) < 0.03, rel
        if layer == 0:  # values are not rotated (later layers' differ by the attention above them)
            torch.testing.assert_close(d_on[1], d_off[1], rtol=0, atol=0)
    for g, w in zip(*(runs[f][0] for f in ("1", "0"))):
        assert ((g - w).norm() / w.norm()).item() < 0.05


def test_fused_stack_checks_key_rotation(tmp_path):
    model = _load(make_tiny_model(tmp_path, "llama", with_tokenizer=False), torch.float32)
    stack = FusedCpuLayers.build(model)._stack
    ints = PagedKV.for_model(model, num_blocks=4, tokens_per_block=4, dtype=torch.int8).kv_caches
    floats = PagedKV.for_model(model, num_blocks=4, tokens_per_block=4).kv_caches
    with pytest.raises(ValueError, match="key_rotation is for an int8 cache"):
        stack.set_kv_caches(floats, None, None, None, key_rotation=16)
    with pytest.raises(ValueError, match=r"key_rotation must be 0 or a power of two dividing head_dim"):
        stack.set_kv_caches([c.kv for c in ints], [c.scales for c in ints], None, None, key_rotation=3)


# ---- the engine -------------------------------------------------------------------------------------


def _generate(llm):
    return [o.outputs[0].token_ids for o in llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)]


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_engine_int8_greedy_matches_fp32_kv(make_llm, backend):
    """A tiny random Llama, ten prompts (block reuse among them), 24 greedy tokens each: int8 KV
    against fp32 KV, same engine otherwise. Most prompts give the same tokens, the rest diverge late."""
    cfg = dict(max_tokens=4096, tokens_per_block=LLM_TPB)
    want = _generate(make_llm(attention_backend=backend, kv_cache_config=KvCacheConfig(**cfg)))
    llm = make_llm(attention_backend=backend, kv_cache_config=KvCacheConfig(dtype="int8", **cfg))
    assert isinstance(llm.executor.kv_cache_manager.kv_caches[0], Int8KvCache)
    got = _generate(llm)
    same = sum(g == w for g, w in zip(got, want))
    prefix = [_common_prefix(g, w) for g, w in zip(got, want)]
    assert same >= 8, f"{same}/10 identical; common prefixes {prefix}"
    assert sum(prefix) >= 0.8 * sum(len(w) for w in want), prefix


def test_engine_int8_composes_with_chunking_speculation_and_preemption(make_llm):
    """int8 KV under chunked prefill with n-gram drafts (multi-token decodes through context
    attention, KV rewound for rejected drafts), and under MAX_UTILIZATION with a pool small enough
    that requests are paused and recomputed: the greedy tokens of plain int8 KV."""
    int8 = KvCacheConfig(max_tokens=4096, tokens_per_block=LLM_TPB, dtype="int8")
    want = _generate(make_llm(kv_cache_config=int8))
    spec = make_llm(
        kv_cache_config=int8,
        enable_chunked_prefill=True,
        max_num_tokens=16,
        speculative_config=SpeculativeConfig(method="ngram", max_draft_len=4),
    )
    assert _generate(spec) == want
    small = KvCacheConfig(
        max_tokens=12 * LLM_TPB, tokens_per_block=LLM_TPB, enable_block_reuse=False, dtype="int8"
    )
    prompts = [p[:12] * 2 for p in (LLM_PROMPTS[0], LLM_PROMPTS[3], LLM_PROMPTS[8], LLM_PROMPTS[1] * 2)]
    plain = make_llm(kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=LLM_TPB, dtype="int8"))
    ref_out = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(40), use_tqdm=False)]
    paused = make_llm(
        kv_cache_config=small, scheduler_config=SchedulerConfig(capacity_scheduler_policy="MAX_UTILIZATION")
    )
    got = [o.outputs[0].token_ids for o in paused.generate(prompts, greedy(40), use_tqdm=False)]
    assert sum(s["num_paused_requests"] for s in paused.get_stats()) > 0, (
        "no preemption: the test shows nothing"
    )
    assert got == ref_out
