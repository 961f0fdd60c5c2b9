"""FP8 checkpoints (quant_method "fp8": E4M3 weights with 128 x 128 block or per-tensor
``weight_scale_inv``): the kernels on E4M3 bytes against the plain-torch reference on every ISA path,
and a tiny FP8 checkpoint written here equal to its dequantised reference model (greedy tokens
identical to transformers on the dequantised weights, logits as close as fp32 sums allow)."""

from __future__ import annotations

import json

import pytest
import torch
from llm_utils import LLM_PROMPTS, hf_greedy
from model_utils import make_tiny_model
from safetensors.torch import load_file, save_file

from inflight import LLM, KvCacheConfig, SamplingParams
from inflight.layers.quantized_linear import W8A16Linear
from inflight.ops import gemm as ops
from inflight.ops.reference import gemm as ref
from inflight.quantization.fp8 import fp8_scales, iter_fp8_tensors, parse_fp8_config

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


def _all_finite_e4m3(gen: torch.Generator, shape) -> torch.Tensor:
    """Random E4M3 bytes over every finite code (subnormals and both zeros included, no NaN)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    return codes[torch.randint(0, len(codes), shape, generator=gen)].view(torch.float8_e4m3fn)


def test_e4m3_conversion_is_exact_on_every_path(isa):
    # One row per code: x = e_j picks column j, so out = scale * fp8(code) with nothing summed.
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    k = 256
    q = torch.zeros(len(codes), k, dtype=torch.uint8)
    q[:, 3] = codes
    x = torch.zeros(1, k)
    x[0, 3] = 1.0
    got = ops.w8a16_gemm(x, q.view(torch.float8_e4m3fn), torch.ones(len(codes), k // 128), 128)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(got[0], want)


@pytest.mark.parametrize("m", [1, 3, 4, 16, 64])
def test_fp8_gemm_matches_the_reference(isa, m):
    gen = torch.Generator().manual_seed(m)
    n, k = 70, 384
    q = _all_finite_e4m3(gen, (n, k))
    s = torch.rand(n, k // 128, generator=gen) * 0.01 + 0.001
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 1.6e-2)):
        x = torch.randn(m, k, generator=gen).to(dtype)
        want = ref.w8a16_gemm(x, q, s, 128)
        got = ops.w8a16_gemm(x, q, s, 128)
        assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
        assert torch.equal(ops.W8A16Weight(q, s, 128)(x), got)


def test_block_and_tensor_scales_expand_exactly():
    s = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = fp8_scales(s, 200, 256, (128, 128))  # 200 rows: the second row block is partial
    assert out.shape == (200, 2) and torch.equal(out[0], s[0]) and torch.equal(out[199], s[1])
    assert torch.equal(fp8_scales(torch.tensor(0.5), 3, 96, None), torch.full((3, 3), 0.5))  # group 32
    with pytest.raises(
        ValueError, match=r"weight_scale_inv must have shape \[ceil\(n / 128\), ceil\(k / 128\)\]"
    ):
        fp8_scales(s, 300, 256, (128, 128))
    with pytest.raises(ValueError, match="weight_block_size must be"):
        parse_fp8_config({"quant_method": "fp8", "weight_block_size": [128, 100]})
    with pytest.raises(ValueError, match="activation_scheme must be 'dynamic'"):
        parse_fp8_config({"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(ValueError, match="without their pair"):
        list(iter_fp8_tensors([("model.layers.0.mlp.up_proj.weight_scale_inv", s)], (128, 128)))


def _write_fp8(src, dst, block):
    """An FP8 copy of checkpoint ``src`` (its projections quantised per block or per tensor) and the
    dequantised reference: the float checkpoint of exactly the values the FP8 one holds."""
    tensors = load_file(str(src / "model.safetensors"))
    fp8, deq = {}, {}
    for name, w in tensors.items():
        if not name.endswith(tuple(p + ".weight" for p in PROJ)):
            fp8[name] = deq[name] = w
            continue
        n, k = w.shape
        if block is None:
            scale = w.abs().max() / FP8_MAX
            q = (w / scale).to(torch.float8_e4m3fn)
            back = q.float() * scale
            scale_inv = scale.reshape(())
        else:
            bn, bk = block
            nb, kb = -(-n // bn), -(-k // bk)
            blocks = torch.nn.functional.pad(w, (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
            scale_inv = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [nb, kb]
            full = scale_inv.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            q = (w / full).to(torch.float8_e4m3fn)
            back = q.float() * full
        fp8[name] = q
        fp8[name + "_scale_inv"] = scale_inv.float()
        deq[name] = back
    for out, ts, quant in ((dst / "fp8", fp8, True), (dst / "deq", deq, False)):
        out.mkdir()
        save_file(ts, str(out / "model.safetensors"))
        cfg = json.loads((src / "config.json").read_text())
        if quant:
            cfg["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": list(block) if block is not None else None,
            }
        (out / "config.json").write_text(json.dumps(cfg))
    return dst / "fp8", dst / "deq"


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block128", "per_tensor"])
def test_tiny_fp8_checkpoint_equals_its_dequantised_reference(tmp_path, block):
    src = make_tiny_model(
        tmp_path, "llama", with_tokenizer=False, hidden_size=256, intermediate_size=384, num_hidden_layers=2
    )
    fp8_dir, deq_dir = _write_fp8(src, tmp_path, block)
    prompts = LLM_PROMPTS[:4]
    want = hf_greedy(deq_dir, prompts, 12)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    results = {}
    for name, path in (("fp8", fp8_dir), ("deq", deq_dir)):
        with LLM(str(path), dtype="float32", kv_cache_config=KvCacheConfig(max_tokens=2048)) as llm:
            if name == "fp8":
                layer = llm.executor.model_engine.model.layers[0]
                assert isinstance(layer.qkv_proj, W8A16Linear) and layer.qkv_proj.weight_format == "fp8_e4m3"
                assert layer.qkv_proj.qweight.dtype == torch.float8_e4m3fn
                assert (
                    layer.down_proj.group_size == 128
                )  # 384 = 3 x 128 (per tensor: the largest that divides)
            results[name] = llm.generate(prompts, params, use_tqdm=False)
    for i, (a, b, w) in enumerate(zip(results["fp8"], results["deq"], want)):
        assert list(a.outputs[0].token_ids) == w, i
        assert list(b.outputs[0].token_ids) == w, i
        la = torch.tensor([float(lp[t]) for lp, t in zip(a.outputs[0].logprobs, w)])
        lb = torch.tensor([float(lp[t]) for lp, t in zip(b.outputs[0].logprobs, w)])
        torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)
