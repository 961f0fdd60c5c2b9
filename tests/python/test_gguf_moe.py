"""Mixture-of-experts GGUF files (Qwen3-MoE's ``qwen3moe``, Mixtral's ``llama`` with experts; and dense Qwen3's
``qwen3``, with QK-norm and quantised MLP projections): tiny random
models written as llama.cpp lays them out (stacked ``ffn_*_exps`` experts in 4- and 8-bit block types,
the router, Q/K rows permuted for llama), loaded with the experts kept quantised (one W4A16 / W8A16
layer per expert) and dequantised, against transformers on the same (dequantised) weights."""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import pytest
import torch
from model_utils import PagedKV, load_hf_reference, make_tiny_model, make_tiny_tokenizer

from inflight.layers.quantized_linear import W4A16Linear, W8A16Linear
from inflight.models import load_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf not installed")

ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "qwen3": "qwen3"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (rotate-half halves -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quantized(w: torch.Tensor, kind: str):
    """(the GGUF blocks of ``w`` in ``kind``, their dequantisation as a float32 tensor)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    blocks = quantize(w.float().numpy(), qtype)
    return blocks, torch.from_numpy(dequantize(blocks, qtype).reshape(w.shape).copy())


def _write_gguf(hf, cfg, path, kinds: dict[str, str], tok) -> None:
    """Write ``hf``'s weights as llama.cpp would (experts in ``kinds`` {gate, up, down}), and set
    ``hf``'s expert weights to what the file holds (dequantised), so it is the reference."""
    import gguf

    model_type = cfg.model_type
    arch = ARCH[model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_feed_forward_length(cfg.intermediate_size)
    if model_type != "qwen3":
        w.add_expert_count(cfg.num_local_experts if model_type == "mixtral" else cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if model_type == "qwen3_moe":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    import json

    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_vocab_size(cfg.vocab_size)

    def f32(name, t):
        w.add_tensor(name, np.ascontiguousarray(t.detach().float().numpy()))

    with torch.no_grad():
        f32("token_embd.weight", hf.model.embed_tokens.weight)
        f32("output_norm.weight", hf.model.norm.weight)
        if not cfg.tie_word_embeddings:
            f32("output.weight", hf.lm_head.weight)
        for i, layer in enumerate(hf.model.layers):
            a, b = layer.self_attn, f"blk.{i}."
            q, k = a.q_proj.weight.float().numpy(), a.k_proj.weight.float().numpy()
            if model_type == "mixtral":
                q, k = _permute(q, cfg.num_attention_heads), _permute(k, cfg.num_key_value_heads)
            w.add_tensor(b + "attn_q.weight", np.ascontiguousarray(q))
            w.add_tensor(b + "attn_k.weight", np.ascontiguousarray(k))
            f32(b + "attn_v.weight", a.v_proj.weight)
            f32(b + "attn_output.weight", a.o_proj.weight)
            if model_type in ("qwen3", "qwen3_moe"):
                f32(b + "attn_q_norm.weight", a.q_norm.weight)
                f32(b + "attn_k_norm.weight", a.k_norm.weight)
            f32(b + "attn_norm.weight", layer.input_layernorm.weight)
            f32(b + "ffn_norm.weight", layer.post_attention_layernorm.weight)
            mlp = layer.mlp
            if model_type == "qwen3":  # a dense MLP: quantised 2-D projections
                parts = {"gate": mlp.gate_proj.weight, "up": mlp.up_proj.weight, "down": mlp.down_proj.weight}
                suffix = ""
            else:
                f32(b + "ffn_gate_inp.weight", mlp.gate.weight)
                gate_up, down = mlp.experts.gate_up_proj, mlp.experts.down_proj  # [E, 2I, H], [E, H, I]
                inter = gate_up.shape[1] // 2
                parts = {"gate": gate_up[:, :inter], "up": gate_up[:, inter:], "down": down}
                suffix = "_exps"
            for part, t in parts.items():
                blocks, deq = _quantized(t, kinds[part])
                qtype = gguf.GGMLQuantizationType[kinds[part]]
                w.add_tensor(b + f"ffn_{part}{suffix}.weight", blocks, raw_dtype=qtype)
                t.copy_(deq)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


@pytest.fixture(
    params=[("qwen3_moe", "Q4_0", "Q8_0"), ("mixtral", "Q4_1", "Q5_0"), ("qwen3", "Q4_0", "Q8_0")],
    ids=lambda p: "-".join(p),
)
def moe_gguf(request, tmp_path):
    """(the GGUF path, the transformers reference on its weights, the expert kinds)."""
    model_type, gate_up_kind, down_kind = request.param
    # Every layer sparse (llama.cpp's qwen3moe has no dense layers).
    extra = {"decoder_sparse_step": 1} if model_type == "qwen3_moe" else {}
    hf_dir = make_tiny_model(tmp_path, model_type, with_tokenizer=False, **extra)
    hf = load_hf_reference(hf_dir)
    tok = make_tiny_tokenizer(tmp_path / "tok", vocab_size=hf.config.vocab_size)
    kinds = {"gate": gate_up_kind, "up": gate_up_kind, "down": down_kind}
    path = tmp_path / f"{model_type}.gguf"
    _write_gguf(hf, hf.config, path, kinds, tok)
    return path, hf.eval(), kinds


def _greedy(model, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    kv = PagedKV.for_model(model, tokens_per_block=4)
    ids, pos, md = kv.step([(0, prompt)], logits="all")
    logits = model(ids, pos, md, kv.kv_caches)
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        ids, pos, md = kv.step([(0, [tokens[-1]])])
        tokens.append(int(model(ids, pos, md, kv.kv_caches)[0].argmax()))
    return logits, tokens


@pytest.mark.parametrize("quantization", ["gguf", None], ids=["native-experts", "dequantised"])
def test_moe_gguf_equals_transformers(moe_gguf, quantization, caplog):
    path, hf, kinds = moe_gguf
    with caplog.at_level(logging.INFO, logger="inflight"):
        # Float activations into the native GEMMs: the comparison is with transformers' fp32 to 2e-4
        # ("auto" would give int16 activations on a VNNI CPU: test_a8_engine.py checks those).
        model = load_model(
            path,
            dtype=torch.float32,
            quantization=quantization,
            attention_backend="torch",
            activation_quantization="none",
        ).model
    sparse = [layer.moe for layer in model.layers]
    if path.stem == "qwen3":  # dense: the MLP's projections themselves are native
        assert not any(sparse) and model.config.qk_norm
        native = quantization == "gguf"
        assert all(isinstance(layer.gate_up_proj, W4A16Linear) == native for layer in model.layers)
        assert all(isinstance(layer.down_proj, W8A16Linear) == native for layer in model.layers)
    elif quantization == "gguf":
        w4 = W4A16Linear if kinds["gate"] in ("Q4_0", "Q4_1") else W8A16Linear
        assert all(m.quantized for m in sparse)
        assert all(isinstance(x, w4) for m in sparse for x in m.expert_gate_up)
        assert all(isinstance(x, W8A16Linear) for m in sparse for x in m.expert_down)
        assert "native GGUF weights" in caplog.text
    else:
        assert all(m is not None and not m.quantized for m in sparse)
    prompt = _prompt(23, seed=5)
    logits, tokens = _greedy(model, prompt, 6)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
        want = hf.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)
    assert tokens == want[0, len(prompt) :].tolist()


def test_moe_gguf_generates_through_llm(moe_gguf):
    """The LLM API on the file (its tokenizer from the GGUF metadata), greedy as transformers."""
    from inflight import LLM, SamplingParams

    path, hf, _ = moe_gguf
    prompt = _prompt(17, seed=9)
    with LLM(str(path), dtype="float32", quantization="gguf") as llm:
        out = (
            llm.generate(
                [prompt],
                SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False),
                use_tqdm=False,
            )[0]
            .outputs[0]
            .token_ids
        )
    with torch.no_grad():
        want = hf.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    assert list(out) == want[0, len(prompt) :].tolist()


def test_quantised_experts_refuse_tensor_parallelism():
    from types import SimpleNamespace

    from inflight.models.moe import SparseMoeBlock

    cfg = type("C", (), {"moe_intermediate_size": 64, "model_type": "qwen3_moe", "num_experts": 4,
                         "num_experts_per_tok": 2, "norm_topk_prob": True, "hidden_size": 32})()  # fmt: skip
    tp = SimpleNamespace(rank=0, size=2, enabled=True)  # what the block reads of a TensorParallel
    with pytest.raises(ValueError, match="tensor_parallel_size=1 only, got 2"):
        SparseMoeBlock(cfg, torch.float32, "cpu", tp, expert_layers=(W4A16Linear, W8A16Linear))


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_fused_expert_group_equals_the_per_expert_layers(moe_gguf, tokens):
    """The C++ MoeExperts (one call for every expert of a layer) against the same layers called one
    expert at a time from Python: the same GEMM kernels on the same rows, SiLU and product rounded alike."""
    from inflight.models.moe import quantized_experts, route

    path, _, _ = moe_gguf
    model = load_model(path, dtype=torch.float32, quantization="gguf", attention_backend="torch").model
    block = model.layers[0].moe
    if block is None:
        pytest.skip("a dense model")
    x = torch.randn(tokens, block.router.shape[1], generator=torch.Generator().manual_seed(tokens))
    weights, ids = route(x, block.router, block.top_k, block.norm_topk_prob, block.fp32_weights)
    want = quantized_experts(x, ids, weights, block.expert_gate_up, block.expert_down)
    got = quantized_experts(x, ids, weights, block.expert_gate_up, block.expert_down, block._fused_experts())
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(block(x), got)


def test_fused_expert_group_validates_its_input(moe_gguf):
    from torch.utils.dlpack import to_dlpack

    path, _, _ = moe_gguf
    model = load_model(path, dtype=torch.float32, quantization="gguf", attention_backend="torch").model
    block = model.layers[0].moe
    if block is None:
        pytest.skip("a dense model")
    op = block._fused_experts()
    hidden = block.router.shape[1]
    x, out = torch.randn(4, hidden), torch.empty(4, hidden)
    counts = torch.zeros(block.num_experts, dtype=torch.int64)
    counts[0] = 3
    with pytest.raises(ValueError, match=r"counts must sum to x's rows \(4\), got 3"):
        op.run(to_dlpack(x), to_dlpack(counts), to_dlpack(out), 1)
    counts[0] = 4
    with pytest.raises((TypeError, ValueError), match="x"):
        op.run(to_dlpack(x.double()), to_dlpack(counts), to_dlpack(out), 1)
    op.run(to_dlpack(x), to_dlpack(counts), to_dlpack(out), 1)  # all rows to expert 0: fine


@pytest.mark.parametrize("moe_gguf", [("qwen3", "Q4_0", "Q8_0")], indirect=True, ids=["qwen3"])
def test_tokenizer_cache_keeps_large_vocabularies_once(moe_gguf, tmp_path, monkeypatch):
    """A small vocabulary is converted each time and never cached; one of at least CACHE_MIN_VOCAB
    tokens is cached, read back without converting, and a new version of the file replaces its entry."""
    import os

    import transformers

    from inflight.models import gguf_tokenizer

    path = moe_gguf[0]
    root = tmp_path / "cache"
    monkeypatch.setenv("INFLIGHT_CACHE", str(root))
    conversions = []
    real = transformers.AutoTokenizer.from_pretrained

    def counting(*args, **kwargs):
        if "gguf_file" in kwargs:
            conversions.append(kwargs["gguf_file"])
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counting)
    entries = lambda: sorted(p.name for p in (root / "gguf-tokenizers").glob("*"))  # noqa: E731

    want = gguf_tokenizer.load_gguf_tokenizer(path)
    assert len(want) < gguf_tokenizer.CACHE_MIN_VOCAB and conversions == [path.name]
    assert not (root / "gguf-tokenizers").exists()

    monkeypatch.setattr(gguf_tokenizer, "CACHE_MIN_VOCAB", 0)
    gguf_tokenizer.load_gguf_tokenizer(path)
    first = entries()
    assert len(conversions) == 2 and len(first) == 1 and first[0].startswith(path.stem + "-")
    assert (root / "gguf-tokenizers" / first[0] / "tokenizer.json").is_file()
    cached = gguf_tokenizer.load_gguf_tokenizer(path)
    assert len(conversions) == 2, "the cached entry was not read"
    text = "hello world 123"
    assert cached.encode(text) == want.encode(text) and cached.get_vocab() == want.get_vocab()

    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new version of the file
    gguf_tokenizer.load_gguf_tokenizer(path)
    second = entries()
    assert len(conversions) == 3 and len(second) == 1 and second != first
    other = tmp_path / "elsewhere" / path.name  # the same name, another file: its own entry
    other.parent.mkdir()
    other.write_bytes(path.read_bytes())
    gguf_tokenizer.load_gguf_tokenizer(other)
    assert len(conversions) == 4 and len(entries()) == 2 and set(second) < set(entries())
