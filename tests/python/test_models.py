"""Native llama-family models against transformers on tiny random checkpoints (CPU, fp32 unless noted)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from model_utils import ARCHS, PagedKV, load_hf_reference, make_tiny_model

from inflight.models import LlamaForCausalLM, ModelConfig, load_model
from inflight.utils.checkpoint_files import iter_safetensors

ATOL = 1e-4


def _prompt(n: int, seed: int = 0, vocab: int = 384) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _load(path, dtype, **kwargs):
    """The engine's loader; the plain-torch attention backend unless the test names one."""
    kwargs.setdefault("attention_backend", "torch")
    loaded = load_model(path, dtype=dtype, **kwargs)
    return loaded.model, loaded.config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch -> (checkpoint path, transformers fp32 model, our fp32 model)."""
    out = {}
    for arch in ARCHS:
        path = make_tiny_model(tmp_path_factory.mktemp(arch), arch, with_tokenizer=False)
        model, _ = _load(path, torch.float32)
        out[arch] = (path, load_hf_reference(path), model)
    return out


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_one_chunk(tiny, arch):
    _, hf, model = tiny[arch]
    ids = _prompt(45)
    kv = PagedKV.for_model(model, tokens_per_block=4)
    input_ids, positions, md = kv.step([(0, ids)], logits="all")
    logits = model(input_ids, positions, md, kv.kv_caches)
    ref = _hf_logits(hf, ids)
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_in_three_chunks(tiny, arch):
    _, hf, model = tiny[arch]
    ids = _prompt(41, seed=1)
    kv = PagedKV.for_model(model, tokens_per_block=4)
    outs, start = [], 0
    for chunk in (13, 17, 11):  # chunk edges fall mid-block
        input_ids, positions, md = kv.step([(0, ids[start : start + chunk])], logits="all")
        outs.append(model(input_ids, positions, md, kv.kv_caches))
        start += chunk
    ref = _hf_logits(hf, ids)
    torch.testing.assert_close(torch.cat(outs), ref, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_greedy_decode(tiny, arch):
    _, hf, model = tiny[arch]
    prompt = _prompt(23, seed=2)
    kv = PagedKV.for_model(model, tokens_per_block=4)
    input_ids, positions, md = kv.step([(0, prompt)])
    step_logits = [model(input_ids, positions, md, kv.kv_caches)[0]]
    tokens = [int(step_logits[-1].argmax())]
    for _ in range(4):  # 5 generated tokens; 4 more forwards, one token each through the paged cache
        input_ids, positions, md = kv.step([(0, [tokens[-1]])])
        step_logits.append(model(input_ids, positions, md, kv.kv_caches)[0])
        tokens.append(int(step_logits[-1].argmax()))
    with torch.no_grad():
        generated = hf.generate(
            torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    assert tokens == generated[0, len(prompt) :].tolist()
    ref = _hf_logits(hf, prompt + tokens)[len(prompt) - 1 : -1]
    torch.testing.assert_close(torch.stack(step_logits), ref, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "mixtral", "qwen3_moe"])
def test_mixed_batch_in_one_forward(tiny, arch):
    """Contexts (fresh, and a chunk after a cached prefix) and decodes share one flattened step."""
    _, hf, model = tiny[arch]
    a, b, c, d = _prompt(19, 3), _prompt(30, 4), _prompt(9, 5), _prompt(26, 6)
    kv = PagedKV.for_model(model, tokens_per_block=4, num_blocks=64)
    # Warm-up step: b's first 12 tokens, c and d's prompts but their last token.
    input_ids, positions, md = kv.step([("b", b[:12]), ("c", c[:-1]), ("d", d[:-1])], logits="all")
    model(input_ids, positions, md, kv.kv_caches)
    input_ids, positions, md = kv.step(
        [("a", a), ("b", b[12:]), ("c", c[-1:]), ("d", d[-1:])], num_contexts=2, logits="last"
    )
    logits = model(input_ids, positions, md, kv.kv_caches)
    ref = torch.stack([_hf_logits(hf, s)[-1] for s in (a, b, c, d)])
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_transformers(tiny, dtype):
    path, hf32, _ = tiny["llama"]
    ids = _prompt(33, seed=7)
    model, _ = _load(path, dtype)
    assert model.embed_tokens.dtype == dtype
    kv = PagedKV.for_model(model, tokens_per_block=8)
    input_ids, positions, md = kv.step([(0, ids[:20])], logits="all")
    first = model(input_ids, positions, md, kv.kv_caches)
    input_ids, positions, md = kv.step([(0, ids[20:])], logits="all")
    logits = torch.cat([first, model(input_ids, positions, md, kv.kv_caches)])
    ref32 = _hf_logits(hf32, ids)
    with torch.no_grad():
        hf_low = load_hf_reference(path, dtype=dtype)
        ref_low = _hf_logits(hf_low, ids)
    ours_err = (logits - ref32).abs().max().item()
    hf_err = (ref_low - ref32).abs().max().item()
    assert torch.isfinite(logits).all()
    # Within 2x transformers' own low-precision error (plus a little slack for tiny errors).
    assert ours_err <= 2 * hf_err + 1e-3, (ours_err, hf_err)


def test_sharded_checkpoint_loads(tmp_path, tiny):
    path = make_tiny_model(tmp_path, "qwen2", with_tokenizer=False, max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    model, _ = _load(path, torch.float32)
    _, _, unsharded = tiny["qwen2"]  # same seed and config: the same weights
    for (name, p), (_, q) in zip(model.named_parameters(), unsharded.named_parameters()):
        assert torch.equal(p, q), name


def test_linear_rope_scaling_matches_transformers(tmp_path):
    path = make_tiny_model(
        tmp_path, "llama", with_tokenizer=False, rope_scaling={"rope_type": "linear", "factor": 3.0}
    )
    model, config = _load(path, torch.float32)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 3.0}
    ids = _prompt(30, seed=8)
    kv = PagedKV.for_model(model)
    input_ids, positions, md = kv.step([(0, ids)], logits="all")
    torch.testing.assert_close(
        model(input_ids, positions, md, kv.kv_caches),
        _hf_logits(load_hf_reference(path), ids),
        atol=ATOL,
        rtol=1e-5,
    )


def test_tied_embeddings_share_the_tensor(tiny):
    assert tiny["qwen2"][2].lm_head is tiny["qwen2"][2].embed_tokens
    assert tiny["llama"][2].lm_head is not tiny["llama"][2].embed_tokens


def test_tokenizer_helper(tmp_path):
    from transformers import AutoTokenizer

    path = make_tiny_model(tmp_path, "mistral", with_tokenizer=True)
    tok = AutoTokenizer.from_pretrained(str(path))
    text = "What is the capital of France?"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert max(ids) < 384 and tok.eos_token_id == 2 and tok.bos_token_id == 1
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<s><|user|>Hi</s><|assistant|>"


# ---- config parsing ---------------------------------------------------------------------------------

_LEGACY_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def test_both_rope_config_forms_parse_the_same(tmp_path, tiny):
    # Hub form (top-level rope_theta / rope_scaling), written by hand...
    (tmp_path / "config.json").write_text(json.dumps(_LEGACY_LLAMA3))
    legacy = ModelConfig.from_hf_dir(tmp_path)
    # ...and transformers 5's save_pretrained form (rope_parameters, no top-level rope_theta).
    saved = json.loads((tiny["llama"][0] / "config.json").read_text())
    assert "rope_theta" not in saved and saved["rope_parameters"]["rope_theta"] == 500000.0
    new = ModelConfig.from_hf_dir(tiny["llama"][0])
    assert legacy.rope_theta == new.rope_theta == 500000.0
    assert legacy.rope_scaling == new.rope_scaling == _LEGACY_LLAMA3["rope_scaling"]
    assert legacy.eos_token_ids == (2, 3) and new.eos_token_ids == (2,)
    assert legacy.checkpoint_dtype == "bfloat16"
    # The old "type" key means the same as "rope_type".
    old_key = dict(_LEGACY_LLAMA3, rope_scaling={"type": "linear", "factor": 2.0})
    assert ModelConfig.from_dict(old_key).rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_config_fields():
    c = ModelConfig.from_dict(dict(_LEGACY_LLAMA3, attention_bias=True))
    assert (c.attention_bias, c.o_proj_bias, c.mlp_bias) == (True, True, False)
    assert c.head_dim == 16 and c.num_kv_heads == 2 and c.sliding_window is None
    q = ModelConfig.from_dict(dict(_LEGACY_LLAMA3, architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    assert (q.attention_bias, q.o_proj_bias) == (True, False)
    no_head_dim = {k: v for k, v in _LEGACY_LLAMA3.items() if k != "head_dim"}
    assert ModelConfig.from_dict(no_head_dim).head_dim == 64 // 8
    no_arch = {k: v for k, v in _LEGACY_LLAMA3.items() if k != "architectures"}
    assert ModelConfig.from_dict(dict(no_arch, model_type="mistral")).architecture == "MistralForCausalLM"
    assert hash(c) == hash(ModelConfig.from_dict(dict(_LEGACY_LLAMA3, attention_bias=True)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.vocab_size = 1  # frozen


@pytest.mark.parametrize(
    "change,match",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
        ({"architectures": ["Qwen2ForCausalLM"], "model_type": "llama"}, "model_type"),
        ({"quantization_config": {"quant_method": "awq"}}, "awq"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ],
)
def test_unsupported_configs_raise(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(dict(_LEGACY_LLAMA3, **change))


def test_sliding_window_refused_only_when_it_would_matter(tmp_path):
    mistral = dict(
        _LEGACY_LLAMA3, architectures=["MistralForCausalLM"], model_type="mistral", rope_scaling=None
    )
    c = ModelConfig.from_dict(dict(mistral, sliding_window=128))
    assert c.sliding_window == 128
    assert c.check_max_seq_len(128) == 128
    with pytest.raises(ValueError, match="sliding_window"):
        c.check_max_seq_len(129)
    assert ModelConfig.from_dict(dict(mistral, sliding_window=None)).sliding_window is None

    qwen = dict(mistral, architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=100)
    assert ModelConfig.from_dict(dict(qwen, use_sliding_window=False)).sliding_window is None
    assert (
        ModelConfig.from_dict(dict(qwen, use_sliding_window=True, max_window_layers=0)).sliding_window == 100
    )
    # Sliding only in layers >= max_window_layers: none of the 2 layers here.
    assert (
        ModelConfig.from_dict(dict(qwen, use_sliding_window=True, max_window_layers=2)).sliding_window is None
    )

    # At load time: the default max_seq_len (max_position_embeddings = 512) exceeds the window.
    path = make_tiny_model(tmp_path, "mistral", with_tokenizer=False, sliding_window=64)
    with pytest.raises(ValueError, match="sliding_window"):
        _load(path, torch.float32)
    model, _ = _load(path, torch.float32, max_seq_len=64)
    assert model.rotary.cos_sin.shape[0] == 64


def test_weight_mismatches_raise(tiny):
    path, _, model = tiny["llama"]
    config = model.config
    weights = dict(iter_safetensors(path))

    fresh = LlamaForCausalLM(config, torch.float32)
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing tensors \(1\): model.layers.1.mlp.up_proj.weight"):
        fresh.load_weights(missing.items())
    with pytest.raises(ValueError, match="unexpected tensors.*model.layers.2.mlp.up_proj.weight"):
        fresh.load_weights([*weights.items(), ("model.layers.2.mlp.up_proj.weight", torch.zeros(1))])
    bad = dict(weights, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(33, 64)})
    with pytest.raises(ValueError, match="k_proj.weight"):
        fresh.load_weights(bad.items())
    # Rotary buffers in old checkpoints are ignored.
    fresh.load_weights([*weights.items(), ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])


def test_bad_arguments_raise(tiny):
    path, _, model = tiny["llama"]
    with pytest.raises(ValueError, match="dtype"):
        LlamaForCausalLM(model.config, torch.int8)
    with pytest.raises(ValueError, match="dtype"):
        _load(path, "float64")
    with pytest.raises(ValueError, match="max_seq_len"):
        _load(path, torch.float32, max_seq_len=513)
    with pytest.raises(ValueError, match="model must be a Hugging Face model directory.*nowhere"):
        _load(path / "nowhere", torch.float32)


def test_gemma3_window_and_local_rope_matter(tiny, tmp_path):
    """The tiny Gemma 3's sliding layer (window 8) and its local RoPE base change the logits of a long
    prompt: transformers without them disagrees with the model that matched it above."""
    import transformers

    path, hf, model = tiny["gemma3"]
    ids = _prompt(40, seed=11)
    kv = PagedKV.for_model(model, tokens_per_block=4)
    input_ids, positions, md = kv.step([(0, ids)], logits="all")
    ours = model(input_ids, positions, md, kv.kv_caches)
    torch.testing.assert_close(ours, _hf_logits(hf, ids), atol=ATOL, rtol=1e-5)
    config = json.loads((path / "config.json").read_text())
    for change in ({"sliding_window": 4096}, {"layer_types": ["full_attention", "full_attention"]}):
        other = transformers.Gemma3TextConfig(**{**config, **change})
        variant = transformers.Gemma3ForCausalLM(other).eval()
        variant.load_state_dict(hf.state_dict())
        assert (_hf_logits(variant, ids) - ours).abs().max() > 1e-2, change
