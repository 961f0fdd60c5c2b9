"""The RoPE table (inflight.layers.rotary.RotaryEmbedding): on the CPU it starts small and grows to the
positions a step uses. Checked: a grown table is bit-identical to the whole one (every dtype, head sizes
whose blocks end mid-row, llama3 scaling), it grows by at least doubling and never past max_positions,
its bits do not depend on the thread count, off the CPU it is whole, and a model whose tables grow
while it runs (fused stack and Python layers; Gemma 3's second table too) gives the logits of the same
model with whole tables."""

from __future__ import annotations

import copy

import pytest
import torch
from model_utils import PagedKV
from test_fused_layers import _STEPS, _load, _run_steps

from inflight.layers.rotary import RotaryEmbedding, compute_inv_freq

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _direct(head_dim: int, positions: int, theta: float, scaling, dtype) -> torch.Tensor:
    """The table in one piece, as transformers' formula gives it (the reference)."""
    inv = compute_inv_freq(head_dim, theta, scaling)
    freqs = torch.arange(positions, dtype=torch.int64).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    half = head_dim // 2
    sin = emb.sin()
    return torch.stack((emb.cos(), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)), dim=1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,scaling", [(64, None), (80, None), (256, None), (128, LLAMA3)])
def test_grown_table_equals_the_whole_one(dtype, head_dim, scaling, monkeypatch):
    monkeypatch.setattr(RotaryEmbedding, "INITIAL_ROWS", 100)
    max_positions = 5000
    rope = RotaryEmbedding(head_dim, max_positions, 10000.0, scaling, dtype)
    whole = RotaryEmbedding(head_dim, max_positions, 10000.0, scaling, dtype)
    whole.ensure(max_positions)
    assert rope.rows == 100 and rope.grows and whole.rows == max_positions and not whole.grows
    assert torch.equal(rope.cos_sin, whole.cos_sin[:100])

    rope.ensure(50)  # already held
    assert rope.rows == 100
    rope.ensure(101)  # at least doubles
    assert rope.rows == 200
    rope.ensure(1234)  # or reaches what is asked
    assert rope.rows == 1234
    assert torch.equal(rope.cos_sin, whole.cos_sin[:1234])
    rope.ensure(10**6)  # capped
    assert rope.rows == max_positions and not rope.grows
    assert rope.cos_sin.dtype == dtype and rope.cos_sin.is_contiguous()
    assert torch.equal(rope.cos_sin, whole.cos_sin)
    torch.testing.assert_close(whole.cos_sin, _direct(head_dim, max_positions, 10000.0, scaling, dtype))


def test_table_bits_do_not_depend_on_the_thread_count(monkeypatch):
    """Each block of rows runs on one thread: the same bits with 1 or 3 threads (3 would split a large
    op at offsets that are not a multiple of the vector width, where ATen finishes with scalar code)."""
    before = torch.get_num_threads()
    tables = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            rope = RotaryEmbedding(80, 3000, 500000.0, None, torch.float32)
            rope.ensure(3000)
            tables.append(rope.cos_sin)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(tables[0], tables[1])


def test_the_table_is_whole_off_the_cpu(monkeypatch):
    monkeypatch.setattr(RotaryEmbedding, "INITIAL_ROWS", 16)
    assert RotaryEmbedding(64, 300, 10000.0, None, torch.float32, device="meta").rows == 300
    rope = RotaryEmbedding(64, 300, 10000.0, None, torch.float32)
    assert rope.rows == 16
    rope.to("meta")
    assert rope.rows == 300 and rope.cos_sin.device.type == "meta" and not rope.grows
    small = RotaryEmbedding(64, 8, 10000.0, None, torch.float32)  # max_positions under the start size
    assert small.rows == 8 and not small.grows


def test_half_converts_the_rows_still_to_come(monkeypatch):
    monkeypatch.setattr(RotaryEmbedding, "INITIAL_ROWS", 16)
    rope = RotaryEmbedding(64, 300, 10000.0, None, torch.float32).half()
    rope.ensure(100)
    want = RotaryEmbedding(64, 300, 10000.0, None, torch.float16)
    want.ensure(300)
    assert rope.cos_sin.dtype == torch.float16 and torch.equal(rope.cos_sin, want.cos_sin[: rope.rows])


@pytest.mark.parametrize("backend", ["native", "torch"], ids=["fused-stack", "python-layers"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_model_with_growing_tables_gives_the_whole_tables_logits(tiny_model_dir, arch, backend, monkeypatch):
    """The steps reach position 22: tables that start at 8 rows grow twice (to 16, then 32) as the model runs."""
    monkeypatch.setattr(RotaryEmbedding, "INITIAL_ROWS", 8)
    path = tiny_model_dir(arch, with_tokenizer=False)
    model = _load(path, torch.float32, backend=backend)
    tables = [model.rotary] + ([model.rotary_local] if model.rotary_local is not None else [])
    assert len(tables) == (2 if arch == "gemma3" else 1)
    assert all(t.rows == 8 and t.grows for t in tables)
    reference = _load(path, torch.float32, backend=backend)
    for t in [reference.rotary, reference.rotary_local]:
        if t is not None:
            t.ensure(t.max_positions)
    kv = PagedKV.for_model(model, num_blocks=32, tokens_per_block=4)
    kv_ref = copy.deepcopy(kv)
    got = _run_steps(model, kv, _STEPS)
    want = _run_steps(reference, kv_ref, _STEPS)
    assert all(t.rows == 32 for t in tables), [t.rows for t in tables]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    if backend == "native":
        assert model.fused_layers() is not None  # the stack ran, reading the grown tables
