"""TorchAttentionBackend against a naive per-sequence fp64 reference (plain loops, explicit softmax)."""

from __future__ import annotations

import random

import pytest
import torch
from model_utils import make_attention_metadata

from inflight.layers.torch_attention import TorchAttentionBackend


def _naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions, scale: float):
    """q [n, H, hd] at ``positions``; keys/values [kv_len, KVH, hd] of the whole sequence."""
    num_heads, num_kv_heads = q.shape[1], keys.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    keys, values = keys.double(), values.double()
    for r, p in enumerate(positions):
        for h in range(num_heads):
            kh = h // group  # transformers' repeat_kv: kv head j serves q heads j*group .. (j+1)*group-1
            scores = (keys[: p + 1, kh] @ q[r, h].double()) * scale  # causal: keys 0..p only
            w = torch.exp(scores - scores.max())
            out[r, h] = (w / w.sum()) @ values[: p + 1, kh]
    return out


def _run_case(
    seqs: list[tuple[int, int]],  # (num_cached, num_new), contexts first
    num_contexts: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 8,
    tokens_per_block: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    backend: TorchAttentionBackend | None = None,
):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    total_blocks = sum(-(-(c + n) // tokens_per_block) for c, n in seqs) + 3
    free = list(range(total_blocks))
    rng.shuffle(free)  # non-contiguous, out-of-order block ids
    cache = torch.randn(2, total_blocks, tokens_per_block, num_kv_heads, head_dim, generator=gen).to(dtype)
    flat = cache.view(2, -1, num_kv_heads, head_dim)

    specs, full_k, full_v = [], [], []
    for cached, new in seqs:
        kv_len = cached + new
        blocks = [free.pop() for _ in range(-(-kv_len // tokens_per_block))]
        keys = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        # The cached prefix is already in the cache, as earlier steps (or prefix reuse) left it.
        for p in range(cached):
            slot = blocks[p // tokens_per_block] * tokens_per_block + p % tokens_per_block
            flat[0, slot], flat[1, slot] = keys[p], values[p]
        specs.append((blocks, cached, new))
        full_k.append(keys)
        full_v.append(values)
    md = make_attention_metadata(specs, tokens_per_block, num_contexts=num_contexts, logits="last")
    q = torch.randn(md.num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.cat([fk[c:] for fk, (c, _) in zip(full_k, seqs)])
    v = torch.cat([fv[c:] for fv, (c, _) in zip(full_v, seqs)])
    scale = head_dim**-0.5
    backend = backend or TorchAttentionBackend()
    out = backend.forward(q, k, v, cache, md, scale)
    assert out.shape == q.shape and out.dtype == dtype

    ref, t = [], 0
    for (cached, new), fk, fv in zip(seqs, full_k, full_v):
        ref.append(_naive_attention(q[t : t + new], fk, fv, range(cached, cached + new), scale))
        t += new
    ref = torch.cat(ref)

    # Every token of every sequence sits at its slot (written this step or before).
    for (blocks, _, _), fk, fv in zip(specs, full_k, full_v):
        slots = [
            blocks[p // tokens_per_block] * tokens_per_block + p % tokens_per_block for p in range(len(fk))
        ]
        assert torch.equal(flat[0, slots], fk)
        assert torch.equal(flat[1, slots], fv)
    return out, ref


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_mixed_batch_contexts_and_decodes(num_heads, num_kv_heads):
    seqs = [
        (0, 97),  # fresh prompt, last block partly filled
        (13, 17),  # chunk after a cached prefix (mid-block start)
        (40, 1),  # context chunk of one token
        (96, 1),  # decodes: long, ...
        (1, 1),  # ... second token of a sequence
        (15, 1),  # ... exactly fills a block
        (16, 1),  # ... first token of a new block
    ]
    out, ref = _run_case(seqs, num_contexts=3, num_heads=num_heads, num_kv_heads=num_kv_heads)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize(
    "seqs,num_contexts",
    [
        ([(0, 1)], 1),  # single token prompt
        ([(0, 17)], 1),  # single prompt, no cache: SDPA's causal path
        ([(0, 17), (0, 17)], 2),  # uniform prompts: no query padding
        ([(20, 1), (20, 1), (20, 1)], 0),  # decodes with equal kv_len: no mask
        ([(5, 1), (31, 1), (0, 1)], 0),  # decodes with different kv_len
        ([(8, 3), (2, 3)], 0),  # multi-token "decode" (1 + draft tokens)
        ([(17, 17)], 1),  # chunk starting at a block boundary + cached prefix
    ],
)
def test_edge_shapes(seqs, num_contexts):
    out, ref = _run_case(seqs, num_contexts=num_contexts, num_heads=6, num_kv_heads=2, tokens_per_block=16)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


def test_chunked_prefill_then_decode_over_steps():
    """One sequence through 3 chunks and 4 decodes, the cache carrying over; equal to a single pass."""
    gen = torch.Generator().manual_seed(3)
    tpb, kvh, nh, hd = 5, 1, 3, 16
    blocks = [9, 2, 7, 0, 11, 4, 5]  # 35 slots
    cache = torch.randn(2, 12, tpb, kvh, hd, generator=gen)
    n = 31
    keys, values = torch.randn(n, kvh, hd, generator=gen), torch.randn(n, kvh, hd, generator=gen)
    q = torch.randn(n, nh, hd, generator=gen)
    backend = TorchAttentionBackend()
    outs, start = [], 0
    for chunk in [11, 9, 7, 1, 1, 1, 1]:
        md = make_attention_metadata([(blocks, start, chunk)], tpb, num_contexts=1 if chunk > 1 else 0)
        sl = slice(start, start + chunk)
        outs.append(backend.forward(q[sl], keys[sl], values[sl], cache, md, hd**-0.5))
        start += chunk
    ref = _naive_attention(q, keys, values, range(n), hd**-0.5)
    torch.testing.assert_close(torch.cat(outs).double(), ref, atol=2e-6, rtol=2e-6)


def test_plan_is_rebuilt_for_a_new_metadata_object():
    backend = TorchAttentionBackend()
    for seed, seqs in enumerate([[(0, 9), (3, 1)], [(0, 5)], [(7, 2), (30, 1), (2, 1)]]):
        out, ref = _run_case(seqs, num_contexts=1, num_heads=4, num_kv_heads=2, seed=seed, backend=backend)
        torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


def test_non_contiguous_inputs():
    """The model passes q/k/v as views into one fused qkv tensor."""
    gen = torch.Generator().manual_seed(5)
    tpb, nh, kvh, hd, n = 4, 4, 2, 8, 10
    md = make_attention_metadata([([3, 1, 0], 0, n)], tpb)
    qkv = torch.randn(n, (nh + 2 * kvh) * hd, generator=gen)
    q = qkv[:, : nh * hd].view(n, nh, hd)
    k = qkv[:, nh * hd : (nh + kvh) * hd].view(n, kvh, hd)
    v = qkv[:, (nh + kvh) * hd :].view(n, kvh, hd)
    cache = torch.zeros(2, 4, tpb, kvh, hd)
    out = TorchAttentionBackend().forward(q, k, v, cache, md, hd**-0.5)
    ref = _naive_attention(q, k, v, range(n), hd**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_reference_error(dtype):
    """Against fp64, within 2x the error of the same math done naively in ``dtype``-rounded inputs."""
    seqs = [(0, 33), (12, 5), (40, 1), (3, 1)]
    out, ref = _run_case(seqs, num_contexts=2, num_heads=6, num_kv_heads=2, dtype=dtype, seed=11)
    # The reference already saw the dtype-rounded q/k/v; what remains is rounding inside attention
    # and of the output, about one ulp of the output dtype.
    eps = torch.finfo(dtype).eps
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * eps * max(1.0, ref.abs().max().item()), err
    assert torch.isfinite(out).all()


def test_rejects_inconsistent_metadata():
    md = make_attention_metadata([([0, 1], 2, 3)], 4)
    bad = type(md)(**{**md.__dict__, "kv_lens_host": (2,)})  # kv_len < seq_len
    q = torch.zeros(3, 2, 8)
    k = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match="kv_len"):
        TorchAttentionBackend().forward(q, k, k, torch.zeros(2, 2, 4, 2, 8), bad, 1.0)
