"""FP8 (E4M3) KV cache above the ops (test_kv_fp8.py has the encoder and the kernels): the
configuration, the pool and its budget, both attention backends, the fused CPU layer stack, and the
engine end to end on a tiny random Llama, against the same engine with an fp32 KV cache.
"""

from __future__ import annotations

import argparse
import copy
import logging

import pytest
import torch
from llm_utils import LLM_PROMPTS, LLM_TPB, greedy
from model_utils import PagedKV, make_attention_metadata, make_tiny_model

from inflight import KvCacheConfig
from inflight.executor import kv_cache_creator
from inflight.executor.kv_cache_creator import cpu_kv_budget, kv_bytes_per_token
from inflight.executor.resource_manager import KVCacheResourceManager
from inflight.executor.step_channel import allocate_caches
from inflight.layers.attention import Fp8KvCache
from inflight.layers.fused_cpu import FusedCpuLayers
from inflight.layers.native_attention import NativeAttentionBackend
from inflight.layers.torch_attention import TorchAttentionBackend
from inflight.llm_args import LlmArgs, add_cli_arguments
from inflight.ops.reference import attention as ref

FP8 = torch.float8_e4m3fn


# ---- configuration ----------------------------------------------------------------------------------


def test_kv_cache_config_accepts_fp8_and_names_the_rest():
    for spelling in ("fp8", "FP8", " fp8_e4m3 ", "float8_e4m3fn", "torch.float8_e4m3fn", FP8):
        assert KvCacheConfig(dtype=spelling).dtype == "fp8"
    for bad in ("fp8_e5m2", "fp4", "int4", torch.uint8, torch.float8_e5m2, 8):
        with pytest.raises(ValueError, match=r"KvCacheConfig.dtype must be 'auto', .*'int8' or 'fp8'") as e:
            KvCacheConfig(dtype=bad)
        assert "fp8_e4m3" in str(e.value) and repr(bad) in str(e.value)
    p = argparse.ArgumentParser()
    add_cli_arguments(p)
    args = LlmArgs.from_cli(p.parse_args(["--kv-cache-dtype", "fp8"]), model="m")
    assert args.kv_cache_config.dtype == "fp8"


def test_fp8_kv_cache_checks_its_tensor():
    kv = torch.zeros(2, 3, 4, 2, 8, dtype=torch.uint8)
    c = Fp8KvCache(kv)
    assert c.k_scale == c.v_scale == 1.0 and c.values.dtype == FP8 and c.shape == kv.shape
    with pytest.raises(ValueError, match=r"Fp8KvCache.kv must be uint8 \(E4M3 bytes\)"):
        Fp8KvCache(kv.view(FP8))
    with pytest.raises(ValueError, match=r"Fp8KvCache.k_scale must be a finite float > 0"):
        Fp8KvCache(kv, k_scale=0.0)


# ---- the pool and its budget ------------------------------------------------------------------------


def test_fp8_pool_is_bytes_without_scales():
    m = KVCacheResourceManager.allocate(3, 2, 64, 10, 4, 64, FP8, torch.device("cpu"), False)
    assert m.pool.dtype == torch.uint8 and m.scales is None
    assert all(isinstance(c, Fp8KvCache) for c in m.kv_caches) and len(m.kv_caches) == 3
    assert m.bytes == 3 * 2 * 10 * 4 * 2 * 64
    m.kv_caches[1].kv[:, 5].fill_(0x38)  # 1.0; the per-layer objects are views into the pool
    m.copy_blocks([(5, 2)])
    assert bool((m.pool[1, :, 2] == 0x38).all()) and bool((m.pool[0, :, 2] == 0).all())
    model = type("M", (), {"num_layers": 3, "kv_cache_shape": lambda self, nb, tpb: (2, nb, tpb, 2, 64)})()
    follower = allocate_caches(model, 10, 4, FP8, "cpu")  # a parallel rank's pool
    assert [type(c) for c in follower] == [Fp8KvCache] * 3 and follower[0].kv.dtype == torch.uint8


@pytest.mark.parametrize("head_dim", [64, 128])
def test_budget_holds_4x_the_tokens_of_fp32_in_the_same_bytes(monkeypatch, head_dim):
    monkeypatch.setattr(kv_cache_creator, "available_host_memory", lambda: 3 << 30)
    cfg = KvCacheConfig(tokens_per_block=32)
    budgets = {}
    for dtype in (torch.float32, torch.bfloat16, FP8):
        budgets[dtype] = cpu_kv_budget(cfg, kv_bytes_per_token(30, 3, head_dim, dtype), 8192)
    fp32, bf16, fp8 = budgets[torch.float32], budgets[torch.bfloat16], budgets[FP8]
    assert fp8.bytes_per_token == 2 * 30 * 3 * head_dim
    assert fp8.num_tokens >= 3.99 * fp32.num_tokens
    assert fp8.num_tokens >= 1.99 * bf16.num_tokens
    assert abs(fp8.bytes - fp32.bytes) <= 32 * fp32.bytes_per_token


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_engine_budget_log_line_shows_the_fp8_capacity(make_llm, tiny_model_dir, monkeypatch):
    """Two engines given the same memory: fp8 KV holds ~4x the tokens of fp32 KV, the line says
    "fp8 e4m3", and the pool it allocates is what the line says."""
    monkeypatch.setattr(kv_cache_creator, "available_host_memory", lambda: 64 << 20)
    path = tiny_model_dir("llama", head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    log = logging.getLogger("inflight")
    level = log.level
    budgets = {}
    for dtype in ("float32", "fp8"):
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
        assert ("fp8 e4m3" in lines[0]) == (dtype == "fp8"), lines[0]
        assert llm.executor.kv_cache_manager.bytes == llm.kv_budget.bytes
    assert budgets["fp8"].num_tokens >= 3.9 * budgets["float32"].num_tokens


# ---- attention backends -----------------------------------------------------------------------------


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_backend_equals_torch_backend_fp8(dtype, window):
    """Contexts, chunks after cached tokens and decodes in one step: both backends store the same
    bytes and attend alike."""
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
    init = ref.quantize_kv_fp8(torch.randn(2, b + 2, tpb, kvh, hd, generator=gen))
    outs, caches = [], []
    for backend in (NativeAttentionBackend(), TorchAttentionBackend()):
        cache = Fp8KvCache(init.clone(), k_scale=0.5, v_scale=1.5)
        outs.append(backend.forward(q, k, v, cache, md, hd**-0.5, window))
        caches.append(cache)
    assert torch.equal(caches[0].kv, caches[1].kv)
    assert outs[0].dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)


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
def test_fused_stack_fp8_matches_python_layers(tmp_path, arch, dtype):
    """The fused stack over an FP8 cache (unit and non-unit scales) against the Python layers (the
    native backend, layer by layer) over the same cache (Gemma 3: a sliding-window layer, its own RoPE
    table and head_dim 256)."""
    overrides = dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=192) if arch == "llama" else {}
    model = _load(make_tiny_model(tmp_path, arch, with_tokenizer=False, **overrides), dtype)
    assert FusedCpuLayers.unsupported_reason(model) is None
    kv_fused = PagedKV.for_model(model, num_blocks=32, tokens_per_block=4, dtype=FP8)
    kv_fused.kv_caches[-1] = Fp8KvCache(kv_fused.kv_caches[-1].kv, k_scale=0.25, v_scale=3.0)
    kv_ref = copy.deepcopy(kv_fused)
    got = _run(model, kv_fused)
    assert isinstance(model.fused_layers(), FusedCpuLayers)
    assert model.fused_layers().accepts(kv_fused.kv_caches, dtype, 5)  # the fused path really ran
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
        da, db = ref.dequantize_kv_fp8(a.kv), ref.dequantize_kv_fp8(b.kv)
        # The two paths' K/V differ by rounding at most: one E4M3 step (1/8 relative) where they differ.
        assert bool(((da - db).abs() <= 0.13 * torch.maximum(da.abs(), db.abs()) + 2**-9).all())


def test_fused_stack_fp8_close_to_float_cache(tmp_path):
    """The same model and steps with an fp32 cache: fp8 KV changes the logits by a little."""
    model = _load(make_tiny_model(tmp_path, "llama", with_tokenizer=False), torch.float32)
    got = _run(model, PagedKV.for_model(model, num_blocks=32, tokens_per_block=4, dtype=FP8))
    want = _run(model, PagedKV.for_model(model, num_blocks=32, tokens_per_block=4))
    for g, w in zip(got, want):
        rel = ((g - w).norm() / w.norm()).item()
        assert 0 < rel < 0.08, f"relative logits error {rel:.3g}"


# ---- the engine -------------------------------------------------------------------------------------


def _generate(llm):
    return [o.outputs[0].token_ids for o in llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)]


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_engine_fp8_greedy_matches_fp32_kv(make_llm, backend):
    """A tiny random Llama, ten prompts (block reuse among them), 24 greedy tokens each: fp8 KV
    against fp32 KV, same engine otherwise (native: the fused CPU stack; torch: the Python layers).
    Most prompts give the same tokens, the rest diverge late."""
    cfg = dict(max_tokens=4096, tokens_per_block=LLM_TPB)
    want = _generate(make_llm(attention_backend=backend, kv_cache_config=KvCacheConfig(**cfg)))
    llm = make_llm(attention_backend=backend, kv_cache_config=KvCacheConfig(dtype="fp8", **cfg))
    caches = llm.executor.kv_cache_manager.kv_caches
    assert isinstance(caches[0], Fp8KvCache)
    model = llm.executor.model_engine.model
    fused = model.fused_layers()
    assert (fused is not None and fused.accepts(caches, model.dtype, 1)) == (backend == "native")
    got = _generate(llm)
    same = sum(g == w for g, w in zip(got, want))
    prefix = [_common_prefix(g, w) for g, w in zip(got, want)]
    assert same >= 7, f"{same}/10 identical; common prefixes {prefix}"
    assert sum(prefix) >= 0.7 * sum(len(w) for w in want), prefix


def test_engine_fp8_fused_and_python_layers_agree(make_llm):
    """The native backend with and without the fused stack over an fp8 pool: the same greedy tokens."""
    cfg = KvCacheConfig(max_tokens=4096, tokens_per_block=LLM_TPB, dtype="fp8")
    fused = make_llm(kv_cache_config=cfg)
    want = _generate(fused)
    llm = make_llm(kv_cache_config=cfg)
    llm.executor.model_engine.model._fused = False
    got = _generate(llm)
    same = sum(g == w for g, w in zip(got, want))
    assert same >= 8, f"{same}/10 identical"
