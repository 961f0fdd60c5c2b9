"""INT8 KV cache, the ops: store_kv quantises each (token, KV head) row with its own fp32 scale
(max |x| / 127) and the CPU attention kernels read the int8 codes with their scales, on every ISA path
this CPU has (the forced portable one included), with and without a sliding window.

Exact where the logic is exact: the codes and scales store_kv writes equal the plain-torch quantiser
(ops/reference/attention.py: quantize_kv) bit for bit, and every element comes back within scale / 2.
Relative where it is numerical: attention over an int8 cache is compared with the fp32 reference on
the *dequantised* cache (fp32 q: tightly; bf16 / fp16 q: within 2x of the reference's own
low-precision error on the same inputs). The backends, the fused stack and the engine are in
test_kv_int8_engine.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from model_utils import make_attention_metadata

from inflight import _C
from inflight.ops import attention as ops
from inflight.ops.reference import attention as ref

_ISA_RANK = {"portable": 0, "avx2": 1, "avx512f": 2, "avx512": 3}
ISAS = [i for i in _ISA_RANK if _ISA_RANK[i] <= _ISA_RANK[_C.cpu_best_isa()]]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GQA = [(9, 3), (8, 2), (4, 4)]


@pytest.fixture(autouse=True)
def one_thread():
    """One thread unless a test sets more (see test_ops_attention.py)."""
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


def _rows(n: int, kvh: int, hd: int, gen: torch.Generator, spread: float = 2.0) -> torch.Tensor:
    """Rows of different magnitudes (log-normal, ``spread``: so scales differ per token and head),
    one all-zero row and one with a single outlier (most of its codes round to 0)."""
    x = torch.randn(n, kvh, hd, generator=gen) * torch.exp(spread * torch.randn(n, kvh, 1, generator=gen))
    if n > 2:
        x[1, 0] = 0.0
        x[2, -1] = 0.01 * torch.randn(hd, generator=gen)
        x[2, -1, hd // 3] = 40.0
    return x


class _Int8Cache:
    """An int8 paged cache holding ``seqs = [(num_cached, num_new), ...]`` (the layout of
    test_ops_attention._Cache): shuffled blocks, every slot (unwritten ones too) holding valid codes
    with finite scales, the cached prefix of each sequence stored; ``new_k`` / ``new_v`` (float, of
    ``dtype``) are this step's rows."""

    def __init__(self, seqs, num_kv_heads, head_dim, dtype, tpb=16, seed=0):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.tpb = tpb
        num_blocks = sum(-(-(c + n) // tpb) for c, n in seqs) + 3
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        garbage = torch.randn(2, num_blocks, tpb, num_kv_heads, head_dim, generator=gen)
        self.cache, self.scales = ref.quantize_kv(garbage)
        self.blocks, new_k, new_v = [], [], []
        for cached, new in seqs:
            kv_len = cached + new
            blocks = [ids.pop() for _ in range(-(-kv_len // tpb))]
            keys = _rows(kv_len, num_kv_heads, head_dim, gen, spread=0.5).to(dtype)
            values = _rows(kv_len, num_kv_heads, head_dim, gen, spread=0.5).to(dtype)
            slots = torch.tensor([blocks[p // tpb] * tpb + p % tpb for p in range(cached)], dtype=torch.int64)
            ref.store_kv(keys[:cached], values[:cached], self.cache, slots, self.scales)
            self.blocks.append(blocks)
            new_k.append(keys[cached:])
            new_v.append(values[cached:])
        self.new_k, self.new_v = torch.cat(new_k), torch.cat(new_v)
        self.md = make_attention_metadata(
            [(b, c, n) for b, (c, n) in zip(self.blocks, seqs)], tpb, num_contexts=len(seqs)
        )


_REF_CACHE: dict = {}


def _references(key, fn, q, *args, **kwargs):
    """(reference in q's dtype, fp32 reference on the same rounded q), both on the dequantised cache."""
    if key not in _REF_CACHE:
        _REF_CACHE[key] = (fn(q, *args, **kwargs), fn(q.float(), *args, **kwargs))
    return _REF_CACHE[key]


def _atol(scales: torch.Tensor, head_dim: int) -> float:
    """fp32 tolerance against the reference. Where head_dim is a multiple of 32 the kernels round each
    tile's probabilities (times the V scales) to int16 codes, and so does the reference, but their
    probabilities differ in the last bits (exp2 polynomial against torch's softmax), so a code can
    land one step apart: up to max|v| / 32767 per flipped code (the weights sum to 1); allow 4."""
    if head_dim % 32:
        return 2e-5
    return 2e-5 + 4 * 127 * scales[1].max().item() / 32767


def _check_close(
    out: torch.Tensor, out_ref_lowp: torch.Tensor, ref32: torch.Tensor, atol: float = 2e-5
) -> None:
    assert torch.isfinite(out).all()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref32, atol=atol, rtol=1e-5)
        return
    err = (out.float() - ref32).abs().max().item()
    err_ref = (out_ref_lowp.float() - ref32).abs().max().item()
    assert err <= 2 * err_ref + 1e-6, f"error {err:.3g} vs the reference's own {err_ref:.3g}"


# ---- store_kv ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 17, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_store_kv_int8_round_trip(isa, dtype, head_dim):
    """Codes and scales equal the reference quantiser's; every element comes back within scale / 2;
    padding slots and every other slot are untouched."""
    gen = torch.Generator().manual_seed(head_dim)
    nb, tpb, kvh, n, nh = 7, 5, 3, 17, 6
    cache = torch.randint(-127, 128, (2, nb, tpb, kvh, head_dim), generator=gen, dtype=torch.int8)
    scales = torch.rand(2, nb, tpb, kvh, generator=gen)
    before, before_scales = cache.clone(), scales.clone()
    # k / v as the model passes them: views into one fused qkv row (head_dim contiguous only).
    qkv = torch.cat(
        [torch.randn(n, nh * head_dim, generator=gen), _rows(n, 2 * kvh, head_dim, gen).reshape(n, -1)], 1
    ).to(dtype)
    k = qkv[:, nh * head_dim : (nh + kvh) * head_dim].view(n, kvh, head_dim)
    v = qkv[:, (nh + kvh) * head_dim :].view(n, kvh, head_dim)
    assert not k.is_contiguous()
    slots = torch.randperm(nb * tpb, generator=gen)[:n]
    slots[[3, 11]] = -1  # padding tokens: skipped
    ops.store_kv(k, v, cache, slots, kv_scales=scales)

    want, want_scales = before.clone(), before_scales.clone()
    ref.store_kv(k, v, want, slots, want_scales)
    assert torch.equal(cache, want) and torch.equal(scales, want_scales)

    keep = slots >= 0
    flat = cache.view(2, nb * tpb, kvh, head_dim)[:, slots[keep]]
    flat_scales = scales.view(2, nb * tpb, kvh)[:, slots[keep]]
    for i, x in enumerate((k, v)):
        x = x[keep].float()
        s = flat_scales[i]
        torch.testing.assert_close(s, x.abs().amax(-1) / 127, rtol=0, atol=0)
        err = (ref.dequantize_kv(flat[i], s) - x).abs()
        # scale / 2 of rounding, plus the two fp32 roundings of x / scale and code * scale.
        assert bool((err <= s[..., None] * (0.5 + 1e-5) + 1e-30).all()), f"max error {err.max():.3g}"
        assert int(flat[i].abs().max()) == 127  # the largest element of a non-zero row maps to +-127
    assert torch.equal(flat[0][1, 0], torch.zeros(head_dim, dtype=torch.int8))  # the all-zero row ...
    assert flat_scales[0][1, 0].item() == 0.0  # ... has scale 0
    untouched = torch.ones(nb * tpb, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.equal(
        cache.view(2, nb * tpb, kvh, head_dim)[:, untouched], before.view(2, -1, kvh, head_dim)[:, untouched]
    )
    assert torch.equal(
        scales.view(2, nb * tpb, kvh)[:, untouched], before_scales.view(2, -1, kvh)[:, untouched]
    )


def test_store_kv_int8_parallel_equals_serial():
    """A long prompt (stored by several threads) gets the codes of one thread."""
    gen = torch.Generator().manual_seed(3)
    n, kvh, hd = 2000, 3, 64
    k, v = (
        torch.randn(n, kvh, hd, generator=gen).bfloat16(),
        torch.randn(n, kvh, hd, generator=gen).bfloat16(),
    )
    slots = torch.randperm(2048, generator=gen)[:n]
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        cache = torch.zeros(2, 64, 32, kvh, hd, dtype=torch.int8)
        scales = torch.zeros(2, 64, 32, kvh)
        ops.store_kv(k, v, cache, slots, kv_scales=scales)
        outs.append((cache, scales))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# ---- paged_attention --------------------------------------------------------------------------------

DECODE_BATCHES = {"mixed": [17, 1, 1025, 97, 32, 33], "long": [1025]}


@pytest.mark.parametrize("batch", list(DECODE_BATCHES), ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA, ids=lambda x: str(x))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_paged_attention_int8_matches_reference(isa, dtype, head_dim, num_heads, num_kv_heads, batch):
    kv_lens = DECODE_BATCHES[batch]
    c = _Int8Cache([(n, 0) for n in kv_lens], num_kv_heads, head_dim, dtype, seed=head_dim + num_heads)
    q = torch.randn(len(kv_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(7)).to(dtype)
    args = (c.cache, c.md.block_tables, c.md.kv_lens, head_dim**-0.5)
    out = ops.paged_attention(q, *args, kv_scales=c.scales)
    assert out.shape == q.shape and out.dtype == dtype
    key = ("paged", dtype, head_dim, num_heads, num_kv_heads, batch)
    _check_close(
        out, *_references(key, ref.paged_attention, q, *args, kv_scales=c.scales), _atol(c.scales, head_dim)
    )


@pytest.mark.parametrize("head_dim", [16, 48, 80, 32, 256])
def test_int8_other_head_dims(isa, head_dim):
    """Head dims outside the unrolled set (run-time head_dim paths) and the other instantiations."""
    c = _Int8Cache([(0, 21), (37, 1)], 2, head_dim, torch.float32, tpb=8)
    ops.store_kv(c.new_k, c.new_v, c.cache, c.md.slot_mapping, kv_scales=c.scales)
    q = torch.randn(c.md.num_tokens, 6, head_dim, generator=torch.Generator().manual_seed(2))
    args = (c.cache, c.md.block_tables, c.md.cu_seqlens, c.md.kv_lens, 0.3)
    torch.testing.assert_close(
        ops.context_attention(q, *args, kv_scales=c.scales),
        ref.context_attention(q, *args, kv_scales=c.scales),
        atol=_atol(c.scales, head_dim),
        rtol=1e-5,
    )
    pargs = (c.cache, c.md.block_tables, c.md.kv_lens, 0.3)
    torch.testing.assert_close(
        ops.paged_attention(q[:2], *pargs, kv_scales=c.scales),
        ref.paged_attention(q[:2], *pargs, kv_scales=c.scales),
        atol=_atol(c.scales, head_dim),
        rtol=1e-5,
    )


def test_int8_results_independent_of_thread_count(isa):
    """The decode split over threads (partitions merged by log-sum-exp) reads the scales right."""
    c = _Int8Cache([(1025, 0), (300, 0)], 3, 64, torch.float32)
    q = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(0))
    args = (c.cache, c.md.block_tables, c.md.kv_lens, 0.125)
    expected = ref.paged_attention(q, *args, kv_scales=c.scales)
    for n in (1, 2, 4):
        torch.set_num_threads(n)
        got = ops.paged_attention(q, *args, kv_scales=c.scales)
        torch.testing.assert_close(got, expected, atol=_atol(c.scales, 64), rtol=1e-5)


# ---- context_attention ------------------------------------------------------------------------------

CONTEXT_BATCHES = {
    "mixed": [(0, 97), (13, 17), (40, 1), (0, 1), (16, 33)],
    "long_prefix": [(1000, 25), (0, 3), (200, 1)],
}


@pytest.mark.parametrize("batch", list(CONTEXT_BATCHES), ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA[:2], ids=lambda x: str(x))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_context_attention_int8_matches_reference(isa, dtype, head_dim, num_heads, num_kv_heads, batch):
    """This step's K/V stored by the kernel (equal to the reference's), then attention over the
    earlier chunks' and this chunk's keys."""
    c = _Int8Cache(CONTEXT_BATCHES[batch], num_kv_heads, head_dim, dtype, seed=head_dim * num_heads)
    want_cache, want_scales = c.cache.clone(), c.scales.clone()
    ref.store_kv(c.new_k, c.new_v, want_cache, c.md.slot_mapping, want_scales)
    ops.store_kv(c.new_k, c.new_v, c.cache, c.md.slot_mapping, kv_scales=c.scales)
    assert torch.equal(c.cache, want_cache) and torch.equal(c.scales, want_scales)
    q = torch.randn(c.md.num_tokens, num_heads, head_dim, generator=torch.Generator().manual_seed(11)).to(
        dtype
    )
    args = (c.cache, c.md.block_tables, c.md.cu_seqlens, c.md.kv_lens, head_dim**-0.5)
    out = ops.context_attention(q, *args, kv_scales=c.scales)
    assert out.shape == q.shape and out.dtype == dtype
    key = ("context", dtype, head_dim, num_heads, num_kv_heads, batch)
    _check_close(
        out, *_references(key, ref.context_attention, q, *args, kv_scales=c.scales), _atol(c.scales, head_dim)
    )


def test_int8_chunked_prefill_equals_one_pass(isa):
    """A prompt in three chunks (each reading the earlier ones' codes from the cache) stores the codes
    of one pass, token by token, and attends alike."""
    tpb, kvh, nh, hd, n = 16, 3, 9, 64, 200
    gen = torch.Generator().manual_seed(4)
    blocks = [9, 2, 7, 0, 11, 4, 5, 13, 1, 8, 3, 6, 12]
    keys, values = torch.randn(n, kvh, hd, generator=gen), torch.randn(n, kvh, hd, generator=gen)
    q = torch.randn(n, nh, hd, generator=gen)
    caches = [
        (torch.zeros(2, 14, tpb, kvh, hd, dtype=torch.int8), torch.zeros(2, 14, tpb, kvh)) for _ in range(2)
    ]
    (cache, scales), (one_cache, one_scales) = caches
    outs, start = [], 0
    for chunk in (77, 100, 23):
        md = make_attention_metadata([(blocks, start, chunk)], tpb)
        sl = slice(start, start + chunk)
        ops.store_kv(keys[sl], values[sl], cache, md.slot_mapping, kv_scales=scales)
        args = (md.block_tables, md.cu_seqlens, md.kv_lens, hd**-0.5)
        outs.append(ops.context_attention(q[sl], cache, *args, kv_scales=scales))
        start += chunk
    md = make_attention_metadata([(blocks, 0, n)], tpb)
    ops.store_kv(keys, values, one_cache, md.slot_mapping, kv_scales=one_scales)
    assert torch.equal(cache, one_cache) and torch.equal(scales, one_scales)
    one = ops.context_attention(
        q, one_cache, md.block_tables, md.cu_seqlens, md.kv_lens, hd**-0.5, kv_scales=one_scales
    )
    torch.testing.assert_close(torch.cat(outs), one, atol=2e-6, rtol=2e-6)


# ---- sliding window ---------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 7, 32, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dt)
def test_int8_window_matches_reference(isa, dtype, window):
    """Decode and prefill under a window (Gemma 3's head_dim 256 with 4 query heads on 1 KV head)."""
    kv_lens = DECODE_BATCHES["mixed"]
    c = _Int8Cache([(n, 0) for n in kv_lens], 1, 256, dtype, seed=1)
    q = torch.randn(len(kv_lens), 4, 256, generator=torch.Generator().manual_seed(8)).to(dtype)
    args = (c.cache, c.md.block_tables, c.md.kv_lens, 256**-0.5)
    out = ops.paged_attention(q, *args, window=window, kv_scales=c.scales)
    key = ("paged_window", dtype, window)
    refs = _references(key, ref.paged_attention, q, *args, window=window, kv_scales=c.scales)
    _check_close(out, *refs, _atol(c.scales, 256))

    c = _Int8Cache(CONTEXT_BATCHES["long_prefix"], 1, 256, dtype, seed=2)
    ops.store_kv(c.new_k, c.new_v, c.cache, c.md.slot_mapping, kv_scales=c.scales)
    q = torch.randn(c.md.num_tokens, 4, 256, generator=torch.Generator().manual_seed(9)).to(dtype)
    args = (c.cache, c.md.block_tables, c.md.cu_seqlens, c.md.kv_lens, 256**-0.5)
    out = ops.context_attention(q, *args, window=window, kv_scales=c.scales)
    key = ("context_window", dtype, window)
    refs = _references(key, ref.context_attention, q, *args, window=window, kv_scales=c.scales)
    _check_close(out, *refs, _atol(c.scales, 256))


def test_int8_window_decode_split_over_threads(isa):
    lens = [1025, 300, 2000, 129]
    c = _Int8Cache([(n, 0) for n in lens], 1, 256, torch.float32, seed=4)
    q = torch.randn(len(lens), 4, 256, generator=torch.Generator().manual_seed(5))
    args = (c.cache, c.md.block_tables, c.md.kv_lens, 0.0625)
    expected = ref.paged_attention(q, *args, window=300, kv_scales=c.scales)
    for n in (1, 2, 4):
        torch.set_num_threads(n)
        got = ops.paged_attention(q, *args, window=300, kv_scales=c.scales)
        torch.testing.assert_close(got, expected, atol=_atol(c.scales, 256), rtol=1e-5)


# ---- int8 against float KV --------------------------------------------------------------------------


def test_int8_attention_close_to_float_cache():
    """The quantisation error itself: attention over the int8 cache stays within a few per cent of
    attention over the float cache it was quantised from (what the engine's accuracy rests on)."""
    gen = torch.Generator().manual_seed(0)
    tpb, kvh, nh, hd, n = 16, 3, 9, 64, 300
    keys, values = torch.randn(n, kvh, hd, generator=gen), torch.randn(n, kvh, hd, generator=gen)
    md = make_attention_metadata([(list(range(19)), 0, n)], tpb)
    q = torch.randn(n, nh, hd, generator=gen)
    float_cache = torch.zeros(2, 19, tpb, kvh, hd)
    ops.store_kv(keys, values, float_cache, md.slot_mapping)
    cache, scales = torch.zeros(2, 19, tpb, kvh, hd, dtype=torch.int8), torch.zeros(2, 19, tpb, kvh)
    ops.store_kv(keys, values, cache, md.slot_mapping, kv_scales=scales)
    args = (md.block_tables, md.cu_seqlens, md.kv_lens, hd**-0.5)
    exact = ops.context_attention(q, float_cache, *args)
    got = ops.context_attention(q, cache, *args, kv_scales=scales)
    rel = (got - exact).norm() / exact.norm()
    assert 0 < rel.item() < 0.02, f"relative error {rel.item():.3g}"


# ---- validation -------------------------------------------------------------------------------------


def test_int8_bad_arguments_name_the_argument():
    c = _Int8Cache([(20, 0), (5, 0)], 2, 64, torch.float32)
    q = torch.randn(2, 4, 64)
    bt, kl = c.md.block_tables, c.md.kv_lens
    k = torch.randn(1, 2, 64)
    slot = torch.tensor([0])
    with pytest.raises(ValueError, match=r"an int8 kv_cache needs kv_scales, float32 \[2, num_blocks"):
        ops.paged_attention(q, c.cache, bt, kl, 1.0)
    with pytest.raises(ValueError, match=r"an int8 kv_cache needs kv_scales"):
        ops.store_kv(k, k, c.cache, slot)
    with pytest.raises(TypeError, match=r"kv_scales must be float32, got float16"):
        ops.paged_attention(q, c.cache, bt, kl, 1.0, kv_scales=c.scales.half())
    with pytest.raises(
        ValueError, match=r"kv_scales must have shape \[2, num_blocks, tokens_per_block, num_kv_heads\]"
    ):
        ops.store_kv(k, k, c.cache, slot, kv_scales=c.scales[:, :2])
    with pytest.raises(ValueError, match=r"kv_scales is only for an int8 kv_cache; this kv_cache is float32"):
        ops.paged_attention(q, c.cache.float(), bt, kl, 1.0, kv_scales=c.scales)
    with pytest.raises(
        TypeError, match=r"kv_cache must have the dtype of q \(float32\), got int32 \(or be int8"
    ):
        ops.context_attention(q, c.cache.int(), bt, torch.tensor([0, 1, 2], dtype=torch.int32), kl, 1.0)
    with pytest.raises(ValueError, match="kv_scales must be contiguous"):
        ops.store_kv(k, k, c.cache, slot, kv_scales=c.scales.transpose(2, 3).contiguous().transpose(2, 3))
