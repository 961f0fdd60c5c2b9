"""The model's ends inside the fused layer stack (inflight.layers.fused_cpu): the token embedding, each
token's RoPE row read from the whole table by position, the final norm of the logits rows and the LM
head, all in the stack's one C++ call.

The reference is the same model and the same stack with the ends in Python (``embedding.embed`` /
``F.embedding`` and Gemma's scale, ``index_select`` of the RoPE rows, ``index_select`` + the norm
module, the head's kernel through its Python wrapper): the logits must be bit-identical, since both
run the same kernels with the same rounding points. Covered: an untied dense head (llama), tied dense
tables (qwen3, gemma3 with its sqrt(hidden) scale), the int8 embedding / LM head of a GGUF file
(W8A16Embedding, swapped in) and its A8 head (int8 activations), fp32 and bf16, 4-bit and dense layers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_utils import PagedKV
from test_fused_layers import _STEPS, _load, _quantized_dir, _run_steps

from inflight.layers.fused_cpu import FusedCpuLayers
from inflight.layers.quantized_linear import W8A16Embedding
from inflight.quantization.w4a16 import quantize_w8


def _with_int8_embedding(model):
    """Replaces the model's tied table by a W8A16Embedding of it (a GGUF file's Q8_0 embedding: the
    lookup and the LM head), as the GGUF loader builds it."""
    table = model.embed_tokens.detach().float()
    emb = W8A16Embedding(table.shape[0], table.shape[1], dtype=model.dtype, group_size=32)
    q, s = quantize_w8(table, 32, torch.float16)
    emb.load_shard(0, "qweight", q)
    emb.load_shard(0, "scales", s)
    model.embedding = emb
    model.embed_tokens = None
    model.lm_head = None
    model.invalidate_fused_layers()
    return model


def _ends(model, on: bool) -> None:
    fused = model.fused_layers()
    if not hasattr(fused, "_saved_ends"):
        fused._saved_ends = (fused.head_vocab, fused.has_embedding)
    vocab, embed = fused._saved_ends
    fused.head_vocab, fused.has_embedding = (vocab, embed) if on else (0, False)


def _compare(model):
    fused = model.fused_layers()
    assert isinstance(fused, FusedCpuLayers)
    assert fused.has_head and fused.has_embedding
    kv_stack = PagedKV.for_model(model, num_blocks=32, tokens_per_block=4)
    kv_python = copy.deepcopy(kv_stack)
    _ends(model, True)
    got = _run_steps(model, kv_stack, _STEPS)
    _ends(model, False)
    want = _run_steps(model, kv_python, _STEPS)
    _ends(model, True)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype == torch.float32 and g.shape == w.shape
        assert torch.equal(g, w), f"step {i}: max difference {(g - w).abs().max().item()}"
    for layer, (a, b) in enumerate(zip(kv_stack.kv_caches, kv_python.kv_caches)):
        assert torch.equal(a, b), f"layer {layer}: the caches differ"


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", ["w4a16", "dense"])
def test_ends_in_the_stack_give_the_python_models_bits(tmp_path, arch, dtype, weights):
    if weights == "w4a16":
        path = _quantized_dir(tmp_path, arch)
    else:
        from model_utils import make_tiny_model

        path = make_tiny_model(tmp_path, arch, with_tokenizer=False)
    _compare(_load(path, dtype))


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activations", [None, "int8"])
def test_int8_embedding_and_head_in_the_stack(tmp_path, arch, dtype, activations):
    model = _with_int8_embedding(_load(_quantized_dir(tmp_path, arch), dtype))
    if activations is not None:
        assert model.set_activation_quantization(activations) > 0
    _compare(model)


def test_ends_stay_in_python_when_switched_off(tmp_path, monkeypatch):
    model = _load(_quantized_dir(tmp_path, "qwen3"), torch.float32)
    monkeypatch.setenv("INFLIGHT_FUSED_ENDS", "0")
    fused = model.fused_layers()
    assert fused is not None and not fused.has_head and not fused.has_embedding


def _stack_and_step(tmp_path):
    model = _load(_quantized_dir(tmp_path, "qwen3"), torch.float32)
    kv = PagedKV.for_model(model, num_blocks=32, tokens_per_block=4)
    ids, positions, md = kv.step([("a", [3, 4, 5, 6])], logits="all")
    return model, model.fused_layers(), kv, ids, positions, md


def test_bad_ends_are_refused_by_name(tmp_path):
    """An id outside the vocabulary, a position outside the RoPE table, a logits row outside the step:
    each a ValueError naming the value and the limit, raised before any kernel runs."""
    model, fused, kv, ids, positions, md = _stack_and_step(tmp_path)
    vocab = model.config.vocab_size
    hidden = torch.zeros(4, model.config.hidden_size)

    def run(**kw):
        args = dict(positions=positions, logits_rows=md.logits_indices, input_ids=ids)
        args.update(kw)
        fused.forward(hidden, model.rotary.cos_sin, md, kv.kv_caches, **args)

    with pytest.raises(
        ValueError, match=rf"input_ids\[2\] = {vocab} is outside the vocabulary \(0 \.\. {vocab - 1}\)"
    ):
        run(input_ids=torch.tensor([3, 4, vocab, 6]))
    with pytest.raises(ValueError, match=r"input_ids\[0\] = -1 is outside the vocabulary"):
        run(input_ids=torch.tensor([-1, 4, 5, 6]))
    rows = model.rotary.cos_sin.shape[0]
    with pytest.raises(ValueError, match=rf"positions\[3\] = {rows} is outside cos_sin's {rows} rows"):
        run(positions=torch.tensor([0, 1, 2, rows]))
    with pytest.raises(ValueError, match=r"logits_rows\[1\] = 4 is not a token of this step \(0 \.\. 3\)"):
        run(logits_rows=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"at most num_tokens \(4\) rows, got 5"):
        run(logits_rows=torch.tensor([0, 1, 2, 3, 3]))
    # The stack still runs after the refusals (nothing was left half done).
    run()


def test_stack_without_ends_refuses_their_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_FUSED_ENDS", "0")
    model, fused, kv, ids, positions, md = _stack_and_step(tmp_path)
    stack = fused._stack
    assert not stack.has_head and not stack.has_embedding
    hidden = torch.zeros(4, model.config.hidden_size)
    fused.head_vocab = 7  # pretend, to reach the binding's own check
    with pytest.raises(ValueError, match=r"logits need a head: call set_head\(\) first"):
        fused.forward(
            hidden, model.rotary.cos_sin, md, kv.kv_caches, positions=positions, logits_rows=md.logits_indices
        )
    fused.head_vocab = 0
    fused.has_embedding = True
    with pytest.raises(ValueError, match=r"input_ids need an embedding: call set_embedding\(\) first"):
        fused.forward(hidden, model.rotary.cos_sin, md, kv.kv_caches, positions=positions, input_ids=ids)
