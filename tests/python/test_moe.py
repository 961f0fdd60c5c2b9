"""Mixture-of-experts models (Mixtral, Qwen3-MoE): the grouped expert GEMMs against a naive per-token
loop, the router against transformers', config parsing and refusals, both checkpoint layouts, the
variants the shared parity suite (test_models.py / test_llm_generate.py, where "mixtral" and
"qwen3_moe" are in ARCHS) does not cover, and the experts sharded over two tensor-parallel ranks."""

from __future__ import annotations

import importlib.util
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from model_utils import PagedKV, load_hf_reference, make_tiny_model

from inflight.models import ModelConfig, load_model
from inflight.models.moe import grouped_experts, route
from inflight.utils.checkpoint_files import iter_safetensors

ATOL = 1e-4


def _naive(x, ids, weights, gate_up, down):
    """The reference: every token, every chosen expert, one at a time."""
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = gate_up[e] @ x[t]
            out[t] += weights[t, j] * (down[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "per-expert-linear"])
@pytest.mark.parametrize(
    "tokens,experts,top_k", [(1, 4, 2), (7, 4, 2), (16, 8, 3), (33, 6, 1), (5, 16, 4), (40, 4, 4)]
)
def test_grouped_experts_equal_a_naive_per_token_loop(tokens, experts, top_k, grouped_mm):
    if grouped_mm and not hasattr(F, "grouped_mm"):
        pytest.skip("torch has no F.grouped_mm")
    g = torch.Generator().manual_seed(tokens * 100 + experts * 10 + top_k)
    hidden, inter = 24, 20
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3
    down = torch.randn(experts, hidden, inter, generator=g) * 0.3
    router = torch.randn(experts, hidden, generator=g)
    weights, ids = route(x, router, top_k, norm_topk_prob=True, fp32_weights=True)
    # A second routing: every token to the same top_k experts (the others get no rows at all).
    same = torch.arange(top_k).flip(0).expand(tokens, top_k).contiguous()
    for ids_, w_ in ((ids, weights), (same, torch.rand(tokens, top_k, generator=g))):
        got = grouped_experts(x, ids_, w_, gate_up, down, grouped_mm=grouped_mm)
        torch.testing.assert_close(got, _naive(x, ids_, w_, gate_up, down), atol=1e-5, rtol=1e-5)
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    if tokens * top_k < experts:
        assert (counts == 0).any()  # some expert idle: the empty groups are exercised
    if tokens > experts:
        assert (counts > 1).any()  # some expert shared by several tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,norm", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_router_and_block_equal_transformers(arch, norm, dtype):
    """The router bit for bit, and one sparse block (its default grouped_mm experts) in fp32 / bf16."""
    from model_utils import make_tiny_config
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from inflight.models.moe import SparseMoeBlock

    overrides = {} if arch == "mixtral" else {"norm_topk_prob": norm}
    hf_config = make_tiny_config(arch, **overrides)
    hf_config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    hf = (MixtralSparseMoeBlock if arch == "mixtral" else Qwen3MoeSparseMoeBlock)(hf_config).to(dtype)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    config = ModelConfig.from_dict(hf_config.to_dict())
    ours = SparseMoeBlock(config, dtype, "cpu")
    ours.router.copy_(hf.gate.weight)
    ours.experts_gate_up.copy_(hf.experts.gate_up_proj)
    ours.experts_down.copy_(hf.experts.down_proj)
    x = torch.randn(37, config.hidden_size).to(dtype)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x)
        want = hf(x[None])[0]
    weights, ids = route(x, ours.router, ours.top_k, ours.norm_topk_prob, ours.fp32_weights)
    assert torch.equal(ids, hf_ids) and weights.dtype == hf_weights.dtype
    assert torch.equal(weights, hf_weights)
    got = ours(x)
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# ---- whole models --------------------------------------------------------------------------------


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def _check_against_transformers(path, max_seq_len=None):
    """Prefill logits and 6 greedy tokens through the paged cache, against transformers in fp32."""
    model = load_model(path, dtype=torch.float32, attention_backend="torch", max_seq_len=max_seq_len).model
    hf = load_hf_reference(path)
    prompt = _prompt(29, seed=3)
    kv = PagedKV.for_model(model, tokens_per_block=4)
    ids, pos, md = kv.step([(0, prompt)], logits="all")
    logits = model(ids, pos, md, kv.kv_caches)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=1e-5)
    tokens = [int(logits[-1].argmax())]
    for _ in range(5):
        ids, pos, md = kv.step([(0, [tokens[-1]])])
        tokens.append(int(model(ids, pos, md, kv.kv_caches)[0].argmax()))
    with torch.no_grad():
        want = hf.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    assert tokens == want[0, len(prompt) :].tolist()
    return model


def test_qwen3_moe_without_norm_topk_prob_and_mlp_only_layers(tmp_path):
    """norm_topk_prob False (the routing weights sum to less than 1) and mlp_only_layers: of three
    layers the middle one is dense, the others sparse."""
    path = make_tiny_model(
        tmp_path,
        "qwen3_moe",
        with_tokenizer=False,
        num_hidden_layers=3,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    )
    model = _check_against_transformers(path)
    assert [layer.moe is not None for layer in model.layers] == [True, False, True]
    assert model.config.moe_layers == (True, False, True) and not model.config.norm_topk_prob


def test_mixtral_top1_of_many_experts_with_tied_embeddings(tmp_path):
    path = make_tiny_model(
        tmp_path,
        "mixtral",
        with_tokenizer=False,
        num_local_experts=6,
        num_experts_per_tok=1,
        tie_word_embeddings=True,
    )
    _check_against_transformers(path)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_stacked_checkpoint_layout_loads_the_same_weights(tmp_path, arch):
    """transformers' save_pretrained(save_original_format=False) stores stacked expert tensors."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path, arch, with_tokenizer=False)
    stacked = tmp_path / "stacked"
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    hf.save_pretrained(str(stacked), save_original_format=False)
    names = [n for n, _ in iter_safetensors(stacked)]
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names), names
    a = load_model(path, dtype=torch.float32, attention_backend="torch").model
    b = load_model(stacked, dtype=torch.float32, attention_backend="torch").model
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_bfloat16_close_to_transformers(tmp_path, arch):
    path = make_tiny_model(tmp_path, arch, with_tokenizer=False)
    ids = _prompt(31, seed=5)
    model = load_model(path, dtype=torch.bfloat16, attention_backend="torch").model
    kv = PagedKV.for_model(model, tokens_per_block=8)
    input_ids, positions, md = kv.step([(0, ids)], logits="all")
    logits = model(input_ids, positions, md, kv.kv_caches)
    with torch.no_grad():
        ref32 = load_hf_reference(path)(torch.tensor([ids])).logits[0]
        ref16 = load_hf_reference(path, dtype=torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    ours_err, hf_err = (logits - ref32).abs().max().item(), (ref16 - ref32).abs().max().item()
    assert ours_err <= 2 * hf_err + 1e-3, (ours_err, hf_err)


def test_fused_cpu_stack_runs_the_python_layers(tmp_path):
    """No fused expert kernel: with the native backend a MoE model runs its Python layers (and a MoE
    layer offers no dense gate_up_proj / down_proj the fused stack could take)."""
    path = make_tiny_model(tmp_path, "mixtral", with_tokenizer=False)
    model = load_model(path, dtype=torch.float32, attention_backend="native").model
    assert model.layers[0].gate_up_proj is None and model.layers[0].down_proj is None
    assert model.fused_layers() is None
    kv = PagedKV.for_model(model, tokens_per_block=4)
    ids = _prompt(9, seed=4)
    input_ids, positions, md = kv.step([(0, ids)], logits="all")
    with torch.no_grad():
        ref = load_hf_reference(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model(input_ids, positions, md, kv.kv_caches), ref, atol=ATOL, rtol=1e-5)


def test_missing_and_misshapen_expert_tensors_are_named(tmp_path):
    from inflight.models import LlamaForCausalLM

    path = make_tiny_model(tmp_path, "mixtral", with_tokenizer=False)
    config = ModelConfig.from_hf_dir(path)
    weights = dict(iter_safetensors(path))
    gone = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    with pytest.raises(ValueError, match=r"missing tensors \(1\): " + gone.replace(".", r"\.")):
        LlamaForCausalLM(config).load_weights((k, v) for k, v in weights.items() if k != gone)
    bad = dict(weights, **{"model.layers.0.block_sparse_moe.experts.0.w3.weight": torch.zeros(95, 64)})
    with pytest.raises(ValueError, match=r"experts\.0\.w3\.weight.*\(96, 64\)"):
        LlamaForCausalLM(config).load_weights(bad.items())


# ---- config --------------------------------------------------------------------------------------

_QWEN3_MOE_HUB = {  # Qwen3-30B-A3B's config.json (hub form: num_experts, top-level rope_theta), shrunk
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 192,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 512,
    "max_window_layers": 48,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "sliding_window": None,
    "use_sliding_window": False,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
}
_MIXTRAL_HUB = {  # Mixtral-8x7B-v0.1's, shrunk
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "router_aux_loss_coef": 0.02,
    "router_jitter_noise": 0.1,  # training-only noise: ignored at inference, by transformers too
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def test_hub_configs_parse():
    q = ModelConfig.from_dict(_QWEN3_MOE_HUB)
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size) == (16, 4, 32)
    assert q.norm_topk_prob and q.qk_norm and q.moe_layers == (True,) * 4 and q.sliding_window is None
    assert q.is_sparse(0) and not ModelConfig.from_dict(dict(_QWEN3_MOE_HUB, num_experts=0)).num_experts
    step2 = ModelConfig.from_dict(dict(_QWEN3_MOE_HUB, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert step2.moe_layers == (False, True, False, False)
    no_norm = {k: v for k, v in _QWEN3_MOE_HUB.items() if k != "norm_topk_prob"}
    assert not ModelConfig.from_dict(no_norm).norm_topk_prob  # Qwen3MoeConfig's default
    m = ModelConfig.from_dict(_MIXTRAL_HUB)
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (8, 2, 96)
    assert m.norm_topk_prob and not m.qk_norm and not m.attention_bias and m.moe_layers == (True, True)
    assert hash(m) == hash(ModelConfig.from_dict(_MIXTRAL_HUB))


@pytest.mark.parametrize(
    "base,change,match",
    [
        (_QWEN3_MOE_HUB, {"num_experts_per_tok": 17}, "num_experts_per_tok"),
        (_QWEN3_MOE_HUB, {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        (_QWEN3_MOE_HUB, {"mlp_only_layers": "0"}, "mlp_only_layers"),
        (_QWEN3_MOE_HUB, {"norm_topk_prob": 1}, "norm_topk_prob"),
        (_QWEN3_MOE_HUB, {"moe_intermediate_size": 0}, "moe_intermediate_size"),
        (_MIXTRAL_HUB, {"num_local_experts": 0}, "num_experts"),
        (_MIXTRAL_HUB, {"hidden_act": "gelu"}, "gelu"),
        (
            _MIXTRAL_HUB,
            {"quantization_config": {"quant_method": "inflight_w4a16", "group_size": 32}},
            "quantization_config",
        ),
    ],
)
def test_unsupported_moe_configs_raise(base, change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(dict(base, **change))


def test_sliding_windows_are_refused_when_they_would_matter():
    # Mixtral applies sliding_window in every layer, as Mistral does.
    m = ModelConfig.from_dict(dict(_MIXTRAL_HUB, sliding_window=128))
    assert m.check_max_seq_len(128) == 128
    with pytest.raises(ValueError, match="sliding_window"):
        m.check_max_seq_len(129)
    # Qwen3-MoE: in every layer when use_sliding_window (no max_window_layers, unlike Qwen3).
    q = dict(_QWEN3_MOE_HUB, sliding_window=64)
    assert ModelConfig.from_dict(q).sliding_window is None
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_dict(dict(q, use_sliding_window=True)).check_max_seq_len(65)


def test_inflight_quantize_refuses_moe(tmp_path, capsys):
    from inflight.cli import main

    path = make_tiny_model(tmp_path, "qwen3_moe", with_tokenizer=False)
    assert main(["quantize", "--model", str(path), "--out", str(tmp_path / "q")]) == 2
    assert "mixture-of-experts" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf not installed")
@pytest.mark.parametrize(
    "arch,used,match",
    [
        ("llama", None, "without llama.expert_used_count"),
        ("qwen2", 2, "architecture 'qwen2' are not supported"),
    ],
)
def test_gguf_mixture_of_experts_refusals(tmp_path, arch, used, match):
    """MoE GGUF files load (test_gguf_moe.py); one without its top-k, or of an architecture without
    experts here, is refused by name."""
    import gguf

    from inflight.models.loader import load_config

    path = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_head_count(4)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_vocab_size(8)
    w.add_expert_count(8)
    if used is not None:
        w.add_expert_used_count(used)
    w.add_tensor("token_embd.weight", torch.zeros(8, 16).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=match):
        load_config(path)


# ---- tensor parallelism ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist

    from inflight.parallel import Mapping, init_process_groups
    from inflight.parallel.comm import TensorParallel

    torch.set_num_threads(1)
    os.environ["INFLIGHT_TP_TRANSPORT"] = "gloo"
    mapping = Mapping(world, rank, world, 1)
    groups = init_process_groups(mapping, init_method=f"tcp://127.0.0.1:{port}", timeout=60)
    tp = TensorParallel(mapping.tp_rank, mapping.tp_size, groups.tp)
    model = load_model(path, dtype="float32", attention_backend="torch", tp=tp).model
    sparse = [layer.moe for layer in model.layers if layer.moe is not None]
    assert sparse and all(b.intermediate_size == model.config.moe_intermediate_size // 2 for b in sparse)
    kv = PagedKV(model.num_layers, model.num_kv_heads, model.config.head_dim, tokens_per_block=4)
    if rank == 0:
        full = load_model(path, dtype="float32", attention_backend="torch").model
        kv_full = PagedKV.for_model(full, tokens_per_block=4)
    prompt = list(range(3, 22))
    steps = [[("a", prompt), ("b", prompt[:6])]] + [[("a", [7]), ("b", [9])] for _ in range(2)]
    for batch in steps:
        ids, pos, md = kv.step(batch, logits="all")
        out = model(ids, pos, md, kv.kv_caches)
        if rank == 0:
            ids_f, pos_f, md_f = kv_full.step(batch, logits="all")
            want = full(ids_f, pos_f, md_f, kv_full.kv_caches)
            torch.testing.assert_close(out, want, rtol=0, atol=1e-4)
        else:
            assert out is None
    dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_experts_sharded_over_two_ranks_match_one(tmp_path, arch):
    """tp=2: each rank holds half of every expert's intermediate dimension; logits within 1e-4."""
    path = make_tiny_model(tmp_path, arch, with_tokenizer=False, vocab_size=128)
    mp.start_processes(_tp_worker, args=(2, _free_port(), str(path)), nprocs=2, start_method="spawn")


def test_tp_sizes_that_do_not_divide_the_experts_are_refused_up_front(tmp_path):
    from inflight import LLM

    path = make_tiny_model(tmp_path, "qwen3_moe", with_tokenizer=False, moe_intermediate_size=63)
    assert json.loads((path / "config.json").read_text())["moe_intermediate_size"] == 63
    with pytest.raises(
        ValueError, match="moe_intermediate_size=63 is not divisible by tensor_parallel_size=2"
    ):
        LLM(str(path), dtype="float32", tensor_parallel_size=2)
