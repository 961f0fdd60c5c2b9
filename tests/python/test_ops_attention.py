"""CPU attention ops (store_kv, paged_attention, context_attention) against their plain-torch twins,
on every ISA path this CPU has (the forced portable one included), with and without a sliding
window, and NativeAttentionBackend against TorchAttentionBackend.

fp32 must match the fp32 reference tightly. bf16 / fp16 must stay within 2x of the reference's own
low-precision error, both measured against the fp32 reference on the same (rounded) inputs.
"""

from __future__ import annotations

import random

import pytest
import torch
from model_utils import PagedKV, make_attention_metadata

from inflight import _C
from inflight.layers.native_attention import NativeAttentionBackend
from inflight.layers.torch_attention import TorchAttentionBackend
from inflight.ops import attention as ops
from inflight.ops.reference import attention as ref

_ISA_RANK = {"portable": 0, "avx2": 1, "avx512f": 2, "avx512": 3}
ISAS = [i for i in _ISA_RANK if _ISA_RANK[i] <= _ISA_RANK[_C.cpu_best_isa()]]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GQA = [(4, 4), (9, 3), (8, 2)]  # (num_heads, num_kv_heads): ratios 1, 3, 4


@pytest.fixture(autouse=True)
def one_thread():
    """One thread unless a test sets more: on a shared 2-core machine a second OpenMP thread (torch's
    and ours) can wait a scheduler tick at every join, which makes the grid slow, not different.
    The multi-threaded paths are covered by test_results_independent_of_thread_count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=ISAS)
def isa(request):
    before = _C.cpu_isa()
    assert _C.set_cpu_isa(request.param) == request.param
    yield request.param
    _C.set_cpu_isa(before)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Cache:
    """A paged cache holding ``seqs = [(num_cached, num_new), ...]``: shuffled block ids, the last
    block of each sequence partly filled, random finite garbage in every unwritten slot. The cached
    prefix of each sequence is already stored; ``new_k`` / ``new_v`` are this step's rows."""

    def __init__(self, seqs, num_kv_heads, head_dim, dtype, tpb=16, seed=0):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.tpb = tpb
        num_blocks = sum(-(-(c + n) // tpb) for c, n in seqs) + 3
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        self.cache = torch.randn(2, num_blocks, tpb, num_kv_heads, head_dim, generator=gen).to(dtype)
        flat = self.cache.view(2, -1, num_kv_heads, head_dim)
        self.blocks, new_k, new_v = [], [], []
        for cached, new in seqs:
            kv_len = cached + new
            blocks = [ids.pop() for _ in range(-(-kv_len // tpb))]
            keys = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen).to(dtype)
            values = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen).to(dtype)
            slots = [blocks[p // tpb] * tpb + p % tpb for p in range(cached)]
            flat[0, slots], flat[1, slots] = keys[:cached], values[:cached]
            self.blocks.append(blocks)
            new_k.append(keys[cached:])
            new_v.append(values[cached:])
        self.new_k, self.new_v = torch.cat(new_k), torch.cat(new_v)
        self.md = make_attention_metadata(
            [(b, c, n) for b, (c, n) in zip(self.blocks, seqs)], tpb, num_contexts=len(seqs)
        )


# References depend only on the inputs, not on the ISA under test: computed once per case.
_REF_CACHE: dict = {}


def _references(key, fn, q, cache, *args):
    """(reference in the inputs' dtype, fp32 reference on the same rounded inputs)."""
    if key not in _REF_CACHE:
        _REF_CACHE[key] = (fn(q, cache, *args), fn(q.float(), cache.float(), *args))
    return _REF_CACHE[key]


def _check_close(out: torch.Tensor, out_ref_lowp: torch.Tensor, ref32: torch.Tensor) -> None:
    assert torch.isfinite(out).all()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref32, atol=2e-5, rtol=1e-5)
        return
    err = (out.float() - ref32).abs().max().item()
    err_ref = (out_ref_lowp.float() - ref32).abs().max().item()
    assert err <= 2 * err_ref + 1e-6, f"error {err:.3g} vs the reference's own {err_ref:.3g}"


# ---- store_kv ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_store_kv_writes_exactly_the_slots(isa, dtype):
    gen = torch.Generator().manual_seed(1)
    nb, tpb, kvh, hd, n, nh = 7, 5, 3, 64, 17, 6
    cache = torch.randn(2, nb, tpb, kvh, hd, generator=gen).to(dtype)
    before = cache.clone()
    # k / v as the model passes them: views into one fused qkv row (head_dim contiguous only).
    qkv = torch.randn(n, (nh + 2 * kvh) * hd, generator=gen).to(dtype)
    k = qkv[:, nh * hd : (nh + kvh) * hd].view(n, kvh, hd)
    v = qkv[:, (nh + kvh) * hd :].view(n, kvh, hd)
    assert not k.is_contiguous()
    slots = torch.randperm(nb * tpb, generator=gen)[:n]
    slots[[3, 11]] = -1  # padding tokens: skipped
    ops.store_kv(k, v, cache, slots)
    expected = before.clone()
    ref.store_kv(k, v, expected, slots)
    assert torch.equal(cache, expected)
    flat = cache.view(2, nb * tpb, kvh, hd)
    keep = slots >= 0
    assert torch.equal(flat[0, slots[keep]], k[keep]) and torch.equal(flat[1, slots[keep]], v[keep])
    untouched = torch.ones(nb * tpb, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.equal(flat[:, untouched], before.view(2, nb * tpb, kvh, hd)[:, untouched])


# ---- paged_attention --------------------------------------------------------------------------------

# (kv lens of one decode batch): awkward lengths in one batch, and a lone long sequence, which
# is split into partitions across threads and merged by log-sum-exp.
DECODE_BATCHES = {"mixed": [17, 1, 1025, 97, 32, 33], "long": [1025]}


@pytest.mark.parametrize("batch", list(DECODE_BATCHES), ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA, ids=lambda x: str(x))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_paged_attention_matches_reference(isa, dtype, head_dim, num_heads, num_kv_heads, batch):
    kv_lens = DECODE_BATCHES[batch]
    c = _Cache([(n, 0) for n in kv_lens], num_kv_heads, head_dim, dtype, seed=head_dim + num_heads)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(kv_lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    args = (c.cache, c.md.block_tables, c.md.kv_lens, scale)
    out = ops.paged_attention(q, *args)
    assert out.shape == q.shape and out.dtype == dtype
    key = ("paged", dtype, head_dim, num_heads, num_kv_heads, batch)
    _check_close(out, *_references(key, ref.paged_attention, q, *args))


def test_paged_attention_strided_q_and_out_argument(isa):
    """q as a view (heads of a fused projection); results land in the given out tensor."""
    c = _Cache([(40, 0), (3, 0)], 2, 64, torch.float32)
    gen = torch.Generator().manual_seed(3)
    qk = torch.randn(2, 8 + 2, 64, generator=gen)
    q = qk[:, :8]
    out = torch.full((2, 8, 64), float("nan"))
    res = ops.paged_attention(q, c.cache, c.md.block_tables, c.md.kv_lens, 0.125, out=out)
    assert res is out
    torch.testing.assert_close(
        out, ref.paged_attention(q, c.cache, c.md.block_tables, c.md.kv_lens, 0.125), atol=2e-5, rtol=1e-5
    )


def test_results_independent_of_thread_count(isa):
    """The decode partition split and merge (which depend on the thread count) and the context work
    distribution do not change the results."""
    c = _Cache([(1025, 0), (300, 0)], 3, 64, torch.float32)
    q = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(0))
    cc = _Cache([(0, 200), (300, 40)], 3, 64, torch.bfloat16, seed=1)
    ops.store_kv(cc.new_k, cc.new_v, cc.cache, cc.md.slot_mapping)
    qc = torch.randn(240, 9, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    decode, context = [], []
    for n in (1, 2, 4):
        torch.set_num_threads(n)
        decode.append(ops.paged_attention(q, c.cache, c.md.block_tables, c.md.kv_lens, 0.125))
        context.append(
            ops.context_attention(qc, cc.cache, cc.md.block_tables, cc.md.cu_seqlens, cc.md.kv_lens, 0.125)
        )
    for o in decode[1:]:
        torch.testing.assert_close(o, decode[0], atol=1e-6, rtol=1e-6)
    for o in context[1:]:
        assert torch.equal(o, context[0])  # same per-row arithmetic whichever thread runs it


# ---- context_attention ------------------------------------------------------------------------------

# (num_cached, num_new) per sequence: fresh prompts (partly filled last blocks), chunks after a
# cached prefix starting mid-block and at a block boundary, one-token chunks, and a chunk whose
# kv_len reaches 1025 (kept apart from the 97-token prompt: the padded reference would pay 97 x 1025).
CONTEXT_BATCHES = {
    "mixed": [(0, 97), (13, 17), (40, 1), (0, 1), (16, 33)],
    "long_prefix": [(1000, 25), (0, 3), (200, 1)],
}


@pytest.mark.parametrize("batch", list(CONTEXT_BATCHES), ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA, ids=lambda x: str(x))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_context_attention_matches_reference(isa, dtype, head_dim, num_heads, num_kv_heads, batch):
    seqs = CONTEXT_BATCHES[batch]
    c = _Cache(seqs, num_kv_heads, head_dim, dtype, seed=head_dim * num_heads)
    ops.store_kv(c.new_k, c.new_v, c.cache, c.md.slot_mapping)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(c.md.num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    args = (c.cache, c.md.block_tables, c.md.cu_seqlens, c.md.kv_lens, scale)
    out = ops.context_attention(q, *args)
    assert out.shape == q.shape and out.dtype == dtype
    key = ("context", dtype, head_dim, num_heads, num_kv_heads, batch)
    _check_close(out, *_references(key, ref.context_attention, q, *args))


@pytest.mark.parametrize("head_dim", [16, 48, 80, 96, 32, 256])
def test_other_head_dims(isa, head_dim):
    """Head dims outside the unrolled set (run-time head_dim paths) and the other instantiations."""
    seqs = [(0, 21), (37, 1)]
    c = _Cache(seqs, 2, head_dim, torch.float32, tpb=8)
    ops.store_kv(c.new_k, c.new_v, c.cache, c.md.slot_mapping)
    q = torch.randn(c.md.num_tokens, 6, head_dim, generator=torch.Generator().manual_seed(2))
    args = (c.cache, c.md.block_tables, c.md.cu_seqlens, c.md.kv_lens, 0.3)
    torch.testing.assert_close(
        ops.context_attention(q, *args), ref.context_attention(q, *args), atol=2e-5, rtol=1e-5
    )
    pargs = (c.cache, c.md.block_tables, c.md.kv_lens, 0.3)
    torch.testing.assert_close(
        ops.paged_attention(q[:2], *pargs), ref.paged_attention(q[:2], *pargs), atol=2e-5, rtol=1e-5
    )


def test_chunked_prefill_equals_one_pass(isa):
    """A prompt in three chunks (each reading the earlier ones from the cache) equals one pass."""
    tpb, kvh, nh, hd, n = 16, 3, 9, 64, 200
    gen = torch.Generator().manual_seed(4)
    blocks = [9, 2, 7, 0, 11, 4, 5, 13, 1, 8, 3, 6, 12]
    keys, values = torch.randn(n, kvh, hd, generator=gen), torch.randn(n, kvh, hd, generator=gen)
    q = torch.randn(n, nh, hd, generator=gen)
    cache = torch.randn(2, 14, tpb, kvh, hd, generator=gen)
    outs, start = [], 0
    for chunk in (77, 100, 23):
        md = make_attention_metadata([(blocks, start, chunk)], tpb)
        sl = slice(start, start + chunk)
        ops.store_kv(keys[sl], values[sl], cache, md.slot_mapping)
        outs.append(ops.context_attention(q[sl], cache, md.block_tables, md.cu_seqlens, md.kv_lens, hd**-0.5))
        start += chunk
    md = make_attention_metadata([(blocks, 0, n)], tpb)
    one = ops.context_attention(q, cache, md.block_tables, md.cu_seqlens, md.kv_lens, hd**-0.5)
    torch.testing.assert_close(torch.cat(outs), one, atol=2e-6, rtol=2e-6)


# ---- sliding window ---------------------------------------------------------------------------------

# 4096: longer than every sequence here, i.e. no window in effect.
WINDOWS = [1, 7, 32, 4096]
# head_dim -> (num_heads, num_kv_heads); 256 with 4 query heads on 1 KV head is Gemma 3's.
WINDOW_HEADS = {64: (9, 3), 256: (4, 1)}


def _naive(q, c, lens, q_lens, scale, window):
    """Attention per query token in fp32 with the window written out: the query at position p sees
    keys p - window < j <= p (all j <= p for window 0). Decode when every q_len is 1."""
    flat = c.cache.float().view(2, -1, *c.cache.shape[3:])
    group = q.shape[1] // c.cache.shape[3]
    rows, t = [], 0
    for b, (kv_len, q_len) in enumerate(zip(lens, q_lens)):
        slots = [c.blocks[b][j // c.tpb] * c.tpb + j % c.tpb for j in range(kv_len)]
        k = flat[0, slots].repeat_interleave(group, 1)
        v = flat[1, slots].repeat_interleave(group, 1)
        for r in range(q_len):
            pos = kv_len - q_len + r
            lo = max(0, pos - window + 1) if window else 0
            s = torch.einsum("hd,jhd->hj", q[t].float(), k[lo : pos + 1]) * scale
            rows.append(torch.einsum("hj,jhd->hd", s.softmax(-1), v[lo : pos + 1]))
            t += 1
    return torch.stack(rows)


@pytest.mark.parametrize("window", [0, 1, 5, 16, 40])
def test_reference_window_is_the_explicit_mask(window):
    """The reference's window mask against a per-token loop with the window written out."""
    gen = torch.Generator().manual_seed(12)
    c = _Cache([(n, 0) for n in (1, 17, 50)], 2, 16, torch.float32, tpb=8)
    q = torch.randn(3, 4, 16, generator=gen)
    out = ref.paged_attention(q, c.cache, c.md.block_tables, c.md.kv_lens, 0.3, window=window)
    torch.testing.assert_close(out, _naive(q, c, [1, 17, 50], [1, 1, 1], 0.3, window), atol=1e-5, rtol=1e-5)
    seqs = [(0, 21), (30, 9), (40, 1)]
    c = _Cache(seqs, 2, 16, torch.float32, tpb=8)
    ref.store_kv(c.new_k, c.new_v, c.cache, c.md.slot_mapping)
    q = torch.randn(c.md.num_tokens, 4, 16, generator=gen)
    out = ref.context_attention(
        q, c.cache, c.md.block_tables, c.md.cu_seqlens, c.md.kv_lens, 0.3, window=window
    )
    lens, q_lens = [a + n for a, n in seqs], [n for _, n in seqs]
    torch.testing.assert_close(out, _naive(q, c, lens, q_lens, 0.3, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("head_dim", list(WINDOW_HEADS))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_paged_attention_window_matches_reference(isa, dtype, head_dim, window):
    num_heads, num_kv_heads = WINDOW_HEADS[head_dim]
    kv_lens = DECODE_BATCHES["mixed"]
    c = _Cache([(n, 0) for n in kv_lens], num_kv_heads, head_dim, dtype, seed=head_dim + 1)
    q = torch.randn(len(kv_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(8)).to(dtype)
    args = (c.cache, c.md.block_tables, c.md.kv_lens, head_dim**-0.5)
    out = ops.paged_attention(q, *args, window=window)
    key = ("paged_window", dtype, head_dim, window)
    _check_close(out, *_references(key, lambda *a: ref.paged_attention(*a, window=window), q, *args))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("batch", list(CONTEXT_BATCHES), ids=str)
@pytest.mark.parametrize("head_dim", list(WINDOW_HEADS))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_context_attention_window_matches_reference(isa, dtype, head_dim, batch, window):
    """Fresh prompts and chunks after cached tokens (kv lens off the block size), so windows start
    mid-tile, inside earlier chunks, and (1000 cached) far past the first key tiles."""
    num_heads, num_kv_heads = WINDOW_HEADS[head_dim]
    c = _Cache(CONTEXT_BATCHES[batch], num_kv_heads, head_dim, dtype, seed=head_dim + 2)
    ops.store_kv(c.new_k, c.new_v, c.cache, c.md.slot_mapping)
    q = torch.randn(c.md.num_tokens, num_heads, head_dim, generator=torch.Generator().manual_seed(9)).to(
        dtype
    )
    args = (c.cache, c.md.block_tables, c.md.cu_seqlens, c.md.kv_lens, head_dim**-0.5)
    out = ops.context_attention(q, *args, window=window)
    key = ("context_window", dtype, head_dim, batch, window)
    _check_close(out, *_references(key, lambda *a: ref.context_attention(*a, window=window), q, *args))


def test_window_zero_is_unchanged(isa):
    """window=0 is the default, bit for bit, and so is a window at least as long as every sequence."""
    c = _Cache([(n, 0) for n in DECODE_BATCHES["mixed"]], 3, 64, torch.bfloat16)
    q = torch.randn(6, 9, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    args = (c.cache, c.md.block_tables, c.md.kv_lens, 0.125)
    out = ops.paged_attention(q, *args)
    assert torch.equal(ops.paged_attention(q, *args, window=0), out)
    assert torch.equal(ops.paged_attention(q, *args, window=1025), out)
    cc = _Cache(CONTEXT_BATCHES["long_prefix"], 3, 64, torch.bfloat16, seed=2)
    ops.store_kv(cc.new_k, cc.new_v, cc.cache, cc.md.slot_mapping)
    qc = torch.randn(cc.md.num_tokens, 9, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    cargs = (cc.cache, cc.md.block_tables, cc.md.cu_seqlens, cc.md.kv_lens, 0.125)
    out = ops.context_attention(qc, *cargs)
    assert torch.equal(ops.context_attention(qc, *cargs, window=0), out)
    assert torch.equal(ops.context_attention(qc, *cargs, window=1025), out)
    # Positional, after out.
    res = torch.empty_like(out)
    assert ops.context_attention(qc, *cargs, res, 0) is res and torch.equal(res, out)


@pytest.mark.parametrize("window", [100, 300, 512])
def test_window_decode_split_over_threads(isa, window):
    """Windowed decode split into partitions (several threads) and merged: partitions cover only the
    window, and the result matches the reference whatever the thread count."""
    lens = [1025, 300, 2000, 129]
    c = _Cache([(n, 0) for n in lens], 1, 256, torch.float32, seed=4)
    q = torch.randn(len(lens), 4, 256, generator=torch.Generator().manual_seed(5))
    args = (c.cache, c.md.block_tables, c.md.kv_lens, 0.0625)
    expected = ref.paged_attention(q, *args, window=window)
    for n in (1, 2, 4):
        torch.set_num_threads(n)
        torch.testing.assert_close(
            ops.paged_attention(q, *args, window=window), expected, atol=2e-5, rtol=1e-5
        )


@pytest.mark.parametrize("window", [1, 30, 130])
def test_chunked_prefill_with_window_equals_one_pass(isa, window):
    """Windows reaching back into earlier chunks: three chunks equal one pass, and the reference."""
    tpb, kvh, nh, hd, n = 16, 1, 4, 256, 200
    gen = torch.Generator().manual_seed(6)
    blocks = [9, 2, 7, 0, 11, 4, 5, 13, 1, 8, 3, 6, 12]
    keys, values = torch.randn(n, kvh, hd, generator=gen), torch.randn(n, kvh, hd, generator=gen)
    q = torch.randn(n, nh, hd, generator=gen)
    cache = torch.randn(2, 14, tpb, kvh, hd, generator=gen)
    outs, start = [], 0
    for chunk in (77, 100, 23):
        md = make_attention_metadata([(blocks, start, chunk)], tpb)
        sl = slice(start, start + chunk)
        ops.store_kv(keys[sl], values[sl], cache, md.slot_mapping)
        outs.append(
            ops.context_attention(
                q[sl], cache, md.block_tables, md.cu_seqlens, md.kv_lens, hd**-0.5, window=window
            )
        )
        start += chunk
    md = make_attention_metadata([(blocks, 0, n)], tpb)
    args = (cache, md.block_tables, md.cu_seqlens, md.kv_lens, hd**-0.5)
    one = ops.context_attention(q, *args, window=window)
    torch.testing.assert_close(torch.cat(outs), one, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(one, ref.context_attention(q, *args, window=window), atol=2e-5, rtol=1e-5)


def test_bad_window_names_the_argument():
    c = _Cache([(20, 0), (5, 0)], 2, 64, torch.float32)
    q = torch.randn(2, 4, 64)
    args = (c.cache, c.md.block_tables, c.md.kv_lens, 1.0)
    cargs = (c.cache, c.md.block_tables, torch.tensor([0, 1, 2], dtype=torch.int32), c.md.kv_lens, 1.0)
    for call in (
        lambda **kw: ops.paged_attention(q, *args, **kw),
        lambda **kw: ops.context_attention(q, *cargs, **kw),
    ):
        with pytest.raises(ValueError, match="window must be >= 0, got -1"):
            call(window=-1)
        for bad in (1.5, True, "8", None):
            with pytest.raises(TypeError, match="window must be an int"):
                call(window=bad)


# ---- validation -------------------------------------------------------------------------------------


def test_bad_arguments_name_the_argument():
    c = _Cache([(20, 0), (5, 0)], 2, 64, torch.float32)
    q = torch.randn(2, 4, 64)
    bt, kl = c.md.block_tables, c.md.kv_lens
    with pytest.raises(TypeError, match="block_tables must be int32, got int64"):
        ops.paged_attention(q, c.cache, bt.long(), kl, 1.0)
    with pytest.raises(TypeError, match=r"kv_cache must have the dtype of q \(bfloat16\), got float32"):
        ops.paged_attention(q.bfloat16(), c.cache, bt, kl, 1.0)
    with pytest.raises(ValueError, match=r"kv_lens\[1\] = 99"):
        ops.paged_attention(q, c.cache, bt, torch.tensor([20, 99], dtype=torch.int32), 1.0)
    bad = bt.clone()
    bad[0, 0] = 1000
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\] = 1000"):
        ops.paged_attention(q, c.cache, bad, kl, 1.0)
    with pytest.raises(ValueError, match="num_heads"):
        ops.paged_attention(torch.randn(2, 3, 64), c.cache, bt, kl, 1.0)
    with pytest.raises(ValueError, match=r"out must be contiguous \(row-major\), got strides"):
        ops.paged_attention(q, c.cache, bt, kl, 1.0, out=torch.empty(2, 64, 4).transpose(1, 2))
    with pytest.raises(
        ValueError,
        match=r"kv_cache must be 5-D \[2, num_blocks, tokens_per_block, num_kv_heads, head_dim\], got shape",
    ):
        ops.paged_attention(q, c.cache[0], bt, kl, 1.0)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.context_attention(q, c.cache, bt, cu, kl, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        k = torch.randn(1, 2, 64)
        ops.store_kv(k, k, c.cache, torch.tensor([10**6]))
    with pytest.raises(TypeError, match=r"v must have the dtype of k \(float32\), got float16"):
        ops.store_kv(k, k.half(), c.cache, torch.tensor([0]))


# ---- NativeAttentionBackend -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_native_backend_equals_torch_backend_mixed_batch(isa, dtype):
    seqs = [(0, 97), (13, 17), (96, 1), (1, 1), (15, 1), (1024, 1)]
    outs = []
    for backend in (NativeAttentionBackend(), TorchAttentionBackend()):
        c = _Cache(seqs, 3, 64, dtype, seed=5)
        md = make_attention_metadata(
            [(b, cc, n) for b, (cc, n) in zip(c.blocks, seqs)], c.tpb, num_contexts=2
        )
        q = torch.randn(md.num_tokens, 9, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
        outs.append((backend.forward(q, c.new_k, c.new_v, c.cache, md, 0.125), c.cache))
    (out, cache), (out_t, cache_t) = outs
    assert torch.equal(cache, cache_t)
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(out.float(), out_t.float(), atol=tol, rtol=tol)


def test_native_backend_multi_token_decodes():
    """Decode steps with 1 + draft tokens go through context_attention."""
    seqs = [(0, 9), (8, 3), (2, 3)]
    outs = []
    for backend in (NativeAttentionBackend(), TorchAttentionBackend()):
        c = _Cache(seqs, 2, 64, torch.float32, seed=8)
        md = make_attention_metadata(
            [(b, cc, n) for b, (cc, n) in zip(c.blocks, seqs)], c.tpb, num_contexts=1
        )
        q = torch.randn(md.num_tokens, 8, 64, generator=torch.Generator().manual_seed(6))
        outs.append(backend.forward(q, c.new_k, c.new_v, c.cache, md, 0.125))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    # head_dim 64 (an unrolled instantiation), GQA 4.
    return tiny_model_dir(
        "llama", with_tokenizer=False, head_dim=64, num_attention_heads=8, num_key_value_heads=2
    )


def _greedy(path, backend, prompts, steps: int, kv_dtype: torch.dtype = torch.float32):
    from inflight.models import load_model

    model = load_model(path, dtype=torch.float32, attention_backend=backend).model
    kv = PagedKV.for_model(model, tokens_per_block=4, num_blocks=128, dtype=kv_dtype)
    tokens = {i: list(p) for i, p in enumerate(prompts)}
    all_logits = []
    with torch.inference_mode():
        # Chunked prefill of prompt 0 beside a whole prompt 1, then batched greedy decodes.
        ids, pos, md = kv.step([(0, tokens[0][:7]), (1, tokens[1])])
        model(ids, pos, md, kv.kv_caches)
        ids, pos, md = kv.step([(0, tokens[0][7:])])
        logits = model(ids, pos, md, kv.kv_caches)
        tokens[0].append(int(logits[0].argmax()))
        ids, pos, md = kv.step([(1, tokens[1][-1:])], num_contexts=0)
        logits = model(ids, pos, md, kv.kv_caches)
        tokens[1].append(int(logits[0].argmax()))
        for _ in range(steps):
            ids, pos, md = kv.step([(i, tokens[i][-1:]) for i in tokens], num_contexts=0)
            logits = model(ids, pos, md, kv.kv_caches)
            all_logits.append(logits)
            for i, toks in tokens.items():
                toks.append(int(logits[i].argmax()))
    return tokens, torch.cat(all_logits)


def test_native_backend_greedy_tokens_equal_torch_backend(tiny_llama):
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 384, (19,), generator=gen).tolist(),
        torch.randint(3, 384, (6,), generator=gen).tolist(),
    ]
    toks_n, logits_n = _greedy(tiny_llama, NativeAttentionBackend(), prompts, 12)
    toks_t, logits_t = _greedy(tiny_llama, TorchAttentionBackend(), prompts, 12)
    assert toks_n == toks_t
    torch.testing.assert_close(logits_n, logits_t, atol=1e-4, rtol=1e-4)


def test_native_backend_greedy_tokens_equal_torch_backend_int8_kv(tiny_llama):
    """The same over an INT8 KV cache (test_kv_int8.py has the kernels): the native backend (the
    fused stack, then the kernels) and the torch backend store the same codes and read them alike."""
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, 384, (19,), generator=gen).tolist(),
        torch.randint(3, 384, (6,), generator=gen).tolist(),
    ]
    toks_n, logits_n = _greedy(tiny_llama, NativeAttentionBackend(), prompts, 12, torch.int8)
    toks_t, logits_t = _greedy(tiny_llama, TorchAttentionBackend(), prompts, 12, torch.int8)
    assert toks_n == toks_t
    torch.testing.assert_close(logits_n, logits_t, atol=1e-3, rtol=1e-3)
