"""FP8 (E4M3) KV cache, the ops: the encoder of store_kv and the CPU attention kernels over E4M3 bytes,
on every ISA path this CPU has (the forced portable one included), with and without a sliding window.
The configuration, the pool, the backends, the fused stack and the engine are in test_kv_fp8_engine.py.

Exact where the logic is exact: store_kv writes the bytes of torch's ``(x / scale).clamp(-448,
448).to(torch.float8_e4m3fn)`` (round to nearest even, saturating), for every representable value, the
ties between them and random inputs. Relative where it is numerical: attention over an fp8 cache is
compared with the fp32 reference on the *dequantised* cache (fp32 q: 1e-4 relative; bf16 / fp16 q:
within 2x of the reference's own low-precision error on the same inputs).
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
FP8 = torch.float8_e4m3fn
# Scales of K and V the kernel tests use: 1 (the engine's), and ones that are not powers of two.
SCALES = [(1.0, 1.0), (0.37, 2.5)]


@pytest.fixture(autouse=True)
def one_thread():
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


def _finite_values() -> torch.Tensor:
    """The 254 finite E4M3 values (both zeros included), fp32, in code order."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    return vals[~vals.isnan()]


def _store_bytes(
    x: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """store_kv of the flat values ``x`` (as K and V rows of one head) -> (K bytes, V bytes), flat."""
    n = x.numel()
    hd = 16
    rows = -(-n // hd)
    flat = torch.zeros(rows * hd, dtype=x.dtype)
    flat[:n] = x.reshape(-1)
    k = flat.view(rows, 1, hd)
    cache = torch.full((2, rows, 1, 1, hd), 0x55, dtype=torch.uint8)
    ops.store_kv(k, k, cache, torch.arange(rows), k_scale=k_scale, v_scale=v_scale)
    return cache[0].reshape(-1)[:n], cache[1].reshape(-1)[:n]


# ---- the encoder ------------------------------------------------------------------------------------


def test_encoder_is_exact_on_every_representable_value():
    vals = _finite_values()
    kb, vb = _store_bytes(vals)
    want = ref.quantize_kv_fp8(vals)
    assert torch.equal(kb, want) and torch.equal(vb, want)
    # The code is the byte itself (-0.0 included), and it decodes back to the value.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes[~codes.view(FP8).float().isnan()]
    assert torch.equal(kb, finite)
    assert torch.equal(ref.dequantize_kv_fp8(kb), vals)


def test_encoder_rounds_ties_to_even_and_saturates():
    """Midpoints between neighbours (ties: to the even code), just above and below them, values past
    448 (saturated, infinities too), the subnormal range and below the smallest subnormal (to zero)."""
    pos = _finite_values()[:127]  # 0, subnormals, normals up to 448
    mid = (pos[:-1].double() + pos[1:].double()) / 2
    # A midpoint is exact in fp32; nudge it by a few fp32 ulps either side.
    mids = mid.float()
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    extra = torch.tensor(
        [448.0, 449.0, 463.99, 464.0, 465.0, 480.0, 1e4, 3.4e38, float("inf"), 2**-10, 2**-11, 1e-30, 0.0]
    )
    x = torch.cat([mids, up, down, extra])
    x = torch.cat([x, -x])
    kb, _ = _store_bytes(x)
    assert torch.equal(kb, ref.quantize_kv_fp8(x))
    # Ties go to the even code (mantissa bit 0 clear).
    tie = kb[: len(mids)]
    assert bool((tie & 1 == 0).all())
    sat = ref.dequantize_kv_fp8(_store_bytes(torch.tensor([500.0, -1e30, float("-inf")]))[0])
    assert sat.tolist() == [448.0, -448.0, -448.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_encoder_matches_torch_on_random_inputs(dtype):
    """Log-normal magnitudes over ~80 binades (subnormals, normals, out of range), k_scale and v_scale
    that are not powers of two, bf16 / fp16 inputs too; a NaN is stored as 0."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20000, generator=gen) * torch.exp(4 * torch.randn(20000, generator=gen))
    x = x.to(dtype)
    x[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")]).to(dtype)
    for ks, vs in [(1.0, 1.0), (0.37, 2.5), (2.0**-5, 64.0)]:
        kb, vb = _store_bytes(x, ks, vs)
        assert torch.equal(kb, ref.quantize_kv_fp8(x, ks)), (ks, vs)
        assert torch.equal(vb, ref.quantize_kv_fp8(x, vs)), (ks, vs)
    assert kb[0].item() == 0
    # The torch reference itself is torch's conversion.
    y = (x[3:].float() / 0.37).clamp(-448, 448)
    assert torch.equal(ref.quantize_kv_fp8(x[3:], 0.37), y.to(FP8).view(torch.uint8))


@pytest.mark.parametrize("head_dim", [64, 17, 256])
def test_store_kv_fp8_strided_and_padding(head_dim):
    """k / v as views into a fused qkv row, padding slots skipped, every other slot untouched."""
    gen = torch.Generator().manual_seed(head_dim)
    nb, tpb, kvh, n, nh = 7, 5, 3, 17, 6
    cache = torch.randint(0, 0x7F, (2, nb, tpb, kvh, head_dim), generator=gen, dtype=torch.uint8)
    before = cache.clone()
    qkv = torch.randn(n, (nh + 2 * kvh) * head_dim, generator=gen) * 30
    k = qkv[:, nh * head_dim : (nh + kvh) * head_dim].view(n, kvh, head_dim)
    v = qkv[:, (nh + kvh) * head_dim :].view(n, kvh, head_dim)
    assert not k.is_contiguous()
    slots = torch.randperm(nb * tpb, generator=gen)[:n]
    slots[[3, 11]] = -1
    ops.store_kv(k, v, cache, slots, k_scale=0.5, v_scale=3.0)
    want = before.clone()
    ref.store_kv(k, v, want, slots, k_scale=0.5, v_scale=3.0)
    assert torch.equal(cache, want)
    # A float8_e4m3fn view of the same bytes is accepted too.
    again = before.clone()
    ops.store_kv(k, v, again.view(FP8), slots, k_scale=0.5, v_scale=3.0)
    assert torch.equal(again, want)


def test_store_kv_fp8_parallel_equals_serial():
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
        cache = torch.zeros(2, 64, 32, kvh, hd, dtype=torch.uint8)
        ops.store_kv(k, v, cache, slots)
        outs.append(cache)
    assert torch.equal(outs[0], outs[1])


# ---- attention --------------------------------------------------------------------------------------


class _Fp8Cache:
    """An fp8 paged cache holding ``seqs = [(num_cached, num_new), ...]``: shuffled blocks, every slot
    (unwritten ones too) holding finite codes, the cached prefix of each sequence stored;
    ``new_k`` / ``new_v`` (of ``dtype``) are this step's rows."""

    def __init__(self, seqs, num_kv_heads, head_dim, dtype, tpb=16, seed=0, scales=(1.0, 1.0)):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.tpb = tpb
        self.ks, self.vs = scales
        num_blocks = sum(-(-(c + n) // tpb) for c, n in seqs) + 3
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        self.cache = ref.quantize_kv_fp8(
            torch.randn(2, num_blocks, tpb, num_kv_heads, head_dim, generator=gen)
        )
        self.blocks, new_k, new_v = [], [], []
        for cached, new in seqs:
            kv_len = cached + new
            blocks = [ids.pop() for _ in range(-(-kv_len // tpb))]
            keys = (2 * self.ks * torch.randn(kv_len, num_kv_heads, head_dim, generator=gen)).to(dtype)
            values = (2 * self.vs * torch.randn(kv_len, num_kv_heads, head_dim, generator=gen)).to(dtype)
            slots = torch.tensor([blocks[p // tpb] * tpb + p % tpb for p in range(cached)], dtype=torch.int64)
            ref.store_kv(keys[:cached], values[:cached], self.cache, slots, k_scale=self.ks, v_scale=self.vs)
            self.blocks.append(blocks)
            new_k.append(keys[cached:])
            new_v.append(values[cached:])
        self.new_k, self.new_v = torch.cat(new_k), torch.cat(new_v)
        self.md = make_attention_metadata(
            [(b, c, n) for b, (c, n) in zip(self.blocks, seqs)], tpb, num_contexts=len(seqs)
        )

    @property
    def scales(self) -> dict:
        return {"k_scale": self.ks, "v_scale": self.vs}


_REF_CACHE: dict = {}


def _references(key, fn, q, *args, **kwargs):
    """(reference in q's dtype, fp32 reference on the same rounded q), both on the dequantised cache."""
    if key not in _REF_CACHE:
        _REF_CACHE[key] = (fn(q, *args, **kwargs), fn(q.float(), *args, **kwargs))
    return _REF_CACHE[key]


def _check_close(out: torch.Tensor, out_ref_lowp: torch.Tensor, ref32: torch.Tensor) -> None:
    assert torch.isfinite(out).all()
    if out.dtype == torch.float32:
        scale = ref32.abs().max().item()
        torch.testing.assert_close(out, ref32, atol=1e-4 * scale, rtol=1e-4)
        return
    err = (out.float() - ref32).abs().max().item()
    err_ref = (out_ref_lowp.float() - ref32).abs().max().item()
    assert err <= 2 * err_ref + 1e-6, f"error {err:.3g} vs the reference's own {err_ref:.3g}"


DECODE_BATCHES = {"mixed": [17, 1, 1025, 97, 32, 33], "long": [1025]}


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("batch", list(DECODE_BATCHES), ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA, ids=lambda x: str(x))
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_paged_attention_fp8_matches_reference(isa, dtype, head_dim, num_heads, num_kv_heads, batch, scales):
    kv_lens = DECODE_BATCHES[batch]
    c = _Fp8Cache(
        [(n, 0) for n in kv_lens], num_kv_heads, head_dim, dtype, seed=head_dim + num_heads, scales=scales
    )
    q = torch.randn(len(kv_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(7)).to(dtype)
    args = (c.cache, c.md.block_tables, c.md.kv_lens, head_dim**-0.5)
    out = ops.paged_attention(q, *args, **c.scales)
    assert out.shape == q.shape and out.dtype == dtype
    key = ("paged", dtype, head_dim, num_heads, num_kv_heads, batch, scales)
    _check_close(out, *_references(key, ref.paged_attention, q, *args, **c.scales))


CONTEXT_BATCHES = {
    "mixed": [(0, 97), (13, 17), (40, 1), (0, 1), (16, 33)],
    "long_prefix": [(1000, 25), (0, 3), (200, 1)],
}


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("batch", list(CONTEXT_BATCHES), ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA[:2], ids=lambda x: str(x))
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_context_attention_fp8_matches_reference(
    isa, dtype, head_dim, num_heads, num_kv_heads, batch, scales
):
    """This step's K/V stored by the kernel (equal to the reference's bytes), then attention over the
    earlier chunks' and this chunk's keys."""
    c = _Fp8Cache(
        CONTEXT_BATCHES[batch], num_kv_heads, head_dim, dtype, seed=head_dim * num_heads, scales=scales
    )
    want = c.cache.clone()
    ref.store_kv(c.new_k, c.new_v, want, c.md.slot_mapping, **c.scales)
    ops.store_kv(c.new_k, c.new_v, c.cache, c.md.slot_mapping, **c.scales)
    assert torch.equal(c.cache, want)
    q = torch.randn(c.md.num_tokens, num_heads, head_dim, generator=torch.Generator().manual_seed(11)).to(
        dtype
    )
    args = (c.cache, c.md.block_tables, c.md.cu_seqlens, c.md.kv_lens, head_dim**-0.5)
    out = ops.context_attention(q, *args, **c.scales)
    assert out.shape == q.shape and out.dtype == dtype
    key = ("context", dtype, head_dim, num_heads, num_kv_heads, batch, scales)
    _check_close(out, *_references(key, ref.context_attention, q, *args, **c.scales))


@pytest.mark.parametrize("head_dim", [16, 48, 80, 32, 128])
def test_fp8_other_head_dims(isa, head_dim):
    """Head dims outside the unrolled set (run-time head_dim paths) and the other instantiations."""
    c = _Fp8Cache([(0, 21), (37, 1)], 2, head_dim, torch.float32, tpb=8, scales=(0.37, 2.5))
    ops.store_kv(c.new_k, c.new_v, c.cache, c.md.slot_mapping, **c.scales)
    q = torch.randn(c.md.num_tokens, 6, head_dim, generator=torch.Generator().manual_seed(2))
    args = (c.cache, c.md.block_tables, c.md.cu_seqlens, c.md.kv_lens, 0.3)
    _check_close(
        ops.context_attention(q, *args, **c.scales), None, ref.context_attention(q, *args, **c.scales)
    )
    pargs = (c.cache, c.md.block_tables, c.md.kv_lens, 0.3)
    _check_close(
        ops.paged_attention(q[:2], *pargs, **c.scales), None, ref.paged_attention(q[:2], *pargs, **c.scales)
    )


def test_fp8_results_independent_of_thread_count(isa):
    """The decode split over threads (partitions merged by log-sum-exp) applies v_scale once."""
    c = _Fp8Cache([(1025, 0), (300, 0)], 3, 64, torch.float32, scales=(0.37, 2.5))
    q = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(0))
    args = (c.cache, c.md.block_tables, c.md.kv_lens, 0.125)
    expected = ref.paged_attention(q, *args, **c.scales)
    for n in (1, 2, 4):
        torch.set_num_threads(n)
        _check_close(ops.paged_attention(q, *args, **c.scales), None, expected)


def test_fp8_chunked_prefill_equals_one_pass(isa):
    tpb, kvh, nh, hd, n = 16, 3, 9, 64, 200
    gen = torch.Generator().manual_seed(4)
    blocks = [9, 2, 7, 0, 11, 4, 5, 13, 1, 8, 3, 6, 12]
    keys, values = torch.randn(n, kvh, hd, generator=gen), torch.randn(n, kvh, hd, generator=gen)
    q = torch.randn(n, nh, hd, generator=gen)
    cache, one_cache = (torch.zeros(2, 14, tpb, kvh, hd, dtype=torch.uint8) for _ in range(2))
    outs, start = [], 0
    for chunk in (77, 100, 23):
        md = make_attention_metadata([(blocks, start, chunk)], tpb)
        sl = slice(start, start + chunk)
        ops.store_kv(keys[sl], values[sl], cache, md.slot_mapping)
        outs.append(ops.context_attention(q[sl], cache, md.block_tables, md.cu_seqlens, md.kv_lens, hd**-0.5))
        start += chunk
    md = make_attention_metadata([(blocks, 0, n)], tpb)
    ops.store_kv(keys, values, one_cache, md.slot_mapping)
    assert torch.equal(cache, one_cache)
    one = ops.context_attention(q, one_cache, md.block_tables, md.cu_seqlens, md.kv_lens, hd**-0.5)
    torch.testing.assert_close(torch.cat(outs), one, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("window", [1, 7, 32, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dt)
def test_fp8_window_matches_reference(isa, dtype, window):
    """Decode and prefill under a window (Gemma 3's head_dim 256 with 4 query heads on 1 KV head)."""
    kv_lens = DECODE_BATCHES["mixed"]
    c = _Fp8Cache([(n, 0) for n in kv_lens], 1, 256, dtype, seed=1)
    q = torch.randn(len(kv_lens), 4, 256, generator=torch.Generator().manual_seed(8)).to(dtype)
    args = (c.cache, c.md.block_tables, c.md.kv_lens, 256**-0.5)
    out = ops.paged_attention(q, *args, window=window)
    _check_close(
        out, *_references(("paged_window", dtype, window), ref.paged_attention, q, *args, window=window)
    )

    c = _Fp8Cache(CONTEXT_BATCHES["long_prefix"], 1, 256, dtype, seed=2)
    ops.store_kv(c.new_k, c.new_v, c.cache, c.md.slot_mapping)
    q = torch.randn(c.md.num_tokens, 4, 256, generator=torch.Generator().manual_seed(9)).to(dtype)
    args = (c.cache, c.md.block_tables, c.md.cu_seqlens, c.md.kv_lens, 256**-0.5)
    out = ops.context_attention(q, *args, window=window)
    refs = _references(("context_window", dtype, window), ref.context_attention, q, *args, window=window)
    _check_close(out, *refs)


def test_fp8_attention_close_to_float_cache():
    """The quantisation error itself: attention over the fp8 cache stays within a few per cent of
    attention over the float cache it was encoded from (E4M3 keeps 3 mantissa bits: ~3% per element)."""
    gen = torch.Generator().manual_seed(0)
    tpb, kvh, nh, hd, n = 16, 3, 9, 64, 300
    keys, values = torch.randn(n, kvh, hd, generator=gen), torch.randn(n, kvh, hd, generator=gen)
    md = make_attention_metadata([(list(range(19)), 0, n)], tpb)
    q = torch.randn(n, nh, hd, generator=gen)
    float_cache = torch.zeros(2, 19, tpb, kvh, hd)
    ops.store_kv(keys, values, float_cache, md.slot_mapping)
    cache = torch.zeros(2, 19, tpb, kvh, hd, dtype=torch.uint8)
    ops.store_kv(keys, values, cache, md.slot_mapping)
    args = (md.block_tables, md.cu_seqlens, md.kv_lens, hd**-0.5)
    exact = ops.context_attention(q, float_cache, *args)
    got = ops.context_attention(q, cache, *args)
    rel = (got - exact).norm() / exact.norm()
    assert 0 < rel.item() < 0.05, f"relative error {rel.item():.3g}"


def test_fp8_bad_arguments_name_the_argument():
    c = _Fp8Cache([(20, 0), (5, 0)], 2, 64, torch.float32)
    q = torch.randn(2, 4, 64)
    bt, kl = c.md.block_tables, c.md.kv_lens
    k = torch.randn(1, 2, 64)
    slot = torch.tensor([0])
    with pytest.raises(ValueError, match=r"kv_scales is only for an int8 kv_cache; a uint8 \(fp8 e4m3\)"):
        ops.paged_attention(q, c.cache, bt, kl, 1.0, kv_scales=torch.zeros(c.cache.shape[:4]))
    with pytest.raises(ValueError, match=r"k_scale must be a finite float32 > 0, got 0"):
        ops.store_kv(k, k, c.cache, slot, k_scale=0.0)
    with pytest.raises(ValueError, match=r"v_scale must be a finite float32 > 0"):
        ops.paged_attention(q, c.cache, bt, kl, 1.0, v_scale=float("inf"))
    with pytest.raises(ValueError, match=r"k_scale and v_scale are only for a uint8 \(fp8 e4m3\) kv_cache"):
        ops.paged_attention(q, torch.zeros(c.cache.shape), bt, kl, 1.0, k_scale=2.0)
    with pytest.raises(TypeError, match=r"or uint8 holding fp8 e4m3 bytes"):
        ops.context_attention(q, c.cache.int(), bt, torch.tensor([0, 1, 2], dtype=torch.int32), kl, 1.0)
