"""W4A16 / W8A16 CPU GEMM kernels against their plain-torch twins (dequantise in fp32, then matmul), for
every ISA path this CPU has (the portable one always), all group sizes, symmetric and asymmetric
weights, fp32/bf16/fp16 activations and fp32/bf16/fp16 scales, at awkward shapes."""

from __future__ import annotations

import pytest
import torch

from inflight import _C
from inflight.ops import gemm as ops
from inflight.ops.reference import gemm as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (M, N, K-in-groups): batch 1..33, N odd / prime / large, K a few groups (K % 128 != 0 included).
SHAPES = [(1, 17, 4), (3, 97, 9), (16, 1536, 2), (33, 50, 5)]


def _tol(dtype: torch.dtype) -> float:
    # fp32: the kernels' own error (bf16 hi+lo split of x, fp32 sums) is ~1e-5; the limit is the spec's.
    # bf16 / fp16 outputs: one rounding of the result (2^-8 / 2^-11 relative) on both sides.
    return {torch.float32: 1e-3, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    scale = want.float().abs().max().clamp_min(1e-6)
    err = (got.float() - want.float()).abs().max() / scale
    assert err <= _tol(dtype), f"relative error {err.item():.3g} > {_tol(dtype)}"


def _w4(n: int, k: int, group_size: int, symmetric: bool, scale_dtype: torch.dtype, gen: torch.Generator):
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // group_size, generator=gen) * 0.02 + 0.002).to(scale_dtype)
    offsets = None if symmetric else (torch.randn(n, k // group_size, generator=gen) * 0.05).to(scale_dtype)
    return qweight, scales, offsets


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_w4a16_matches_reference(isa, group_size, symmetric, dtype):
    gen = torch.Generator().manual_seed(group_size + 7 * symmetric)
    for i, (m, n, groups) in enumerate(SHAPES):
        k = groups * group_size
        scale_dtype = DTYPES[i % 3]
        qweight, scales, offsets = _w4(n, k, group_size, symmetric, scale_dtype, gen)
        x = torch.randn(m, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype) if i % 2 else None
        want = ref.w4a16_gemm(x, qweight, scales, offsets, group_size, bias=bias)
        got = ops.w4a16_gemm(x, qweight, scales, offsets, group_size, bias=bias)
        _close(got, want, dtype)
        # The prepared-weight object is the same kernel.
        packed = ops.W4A16Weight(qweight, scales, offsets, group_size, bias)
        assert torch.equal(packed(x), got)


@pytest.mark.parametrize("group_size", [16, 32, 64, 128])  # 16: GGUF Q6_K's sub-blocks (int8 only)
@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a16_matches_reference(isa, group_size, dtype):
    gen = torch.Generator().manual_seed(group_size)
    for i, (m, n, groups) in enumerate(SHAPES):
        k = groups * group_size
        qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
        scales = (torch.rand(n, k // group_size, generator=gen) * 0.01 + 0.001).to(DTYPES[i % 3])
        x = torch.randn(m, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype) if i % 2 else None
        want = ref.w8a16_gemm(x, qweight, scales, group_size, bias=bias)
        got = ops.w8a16_gemm(x, qweight, scales, group_size, bias=bias)
        _close(got, want, dtype)
        assert torch.equal(ops.W8A16Weight(qweight, scales, group_size, bias)(x), got)


def test_w8a16_groups_of_16_on_every_batched_path(isa):
    # k a multiple of 32 lets batched bf16 x take the dequantised panels (two scales per 32 weights),
    # fp32 x the tiled kernel; an odd number of groups of 16 keeps bf16 off the panels.
    gen = torch.Generator().manual_seed(16)
    for m, k in ((48, 512), (48, 16 * 33), (5, 512)):
        qweight = torch.randint(-32, 32, (70, k), dtype=torch.int8, generator=gen)
        scales = torch.rand(70, k // 16, generator=gen) * 0.01 + 0.001
        for dtype in DTYPES:
            x = torch.randn(m, k, generator=gen).to(dtype)
            _close(ops.w8a16_gemm(x, qweight, scales, 16), ref.w8a16_gemm(x, qweight, scales, 16), dtype)


def test_fp32_is_much_tighter_than_the_spec(isa):
    gen = torch.Generator().manual_seed(1)
    qweight, scales, offsets = _w4(64, 576, 32, False, torch.float16, gen)
    x = torch.randn(5, 576, generator=gen)
    want = ref.w4a16_gemm(x, qweight, scales, offsets, 32)
    got = ops.w4a16_gemm(x, qweight, scales, offsets, 32)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_long_rows_use_the_fallback_kernel(isa):
    # k beyond the AVX-512 kernel's per-thread scratch (64 KiB for fp32 x) takes the in-register path.
    gen = torch.Generator().manual_seed(2)
    k = 17408
    for symmetric in (False, True):
        qweight, scales, offsets = _w4(5, k, 128, symmetric, torch.float16, gen)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(2, k, generator=gen).to(dtype)
            _close(
                ops.w4a16_gemm(x, qweight, scales, offsets, 128),
                ref.w4a16_gemm(x, qweight, scales, offsets, 128),
                dtype,
            )


@pytest.mark.parametrize("k", [576, 6144])
def test_batched_fp32_paths_are_exact_fp32_math(isa, k):
    # m >= 4 takes the batched (tiled) kernels on AVX-512: every M-tile remainder (4..17 rows), N not a
    # multiple of the tile, and a k long enough to shrink the M tile (6144: 3 rows per tile). Their math is
    # fp32 FMA on exactly dequantised weights, so they match the fp32 reference far below the spec's 1e-3.
    gen = torch.Generator().manual_seed(k)
    for symmetric in (False, True):
        qweight, scales, offsets = _w4(37, k, 32, symmetric, torch.float16, gen)
        q8 = torch.randint(-127, 128, (37, k), dtype=torch.int8, generator=gen)
        for m in range(4, 18):
            x = torch.randn(m, k, generator=gen)
            for got, want in (
                (
                    ops.w4a16_gemm(x, qweight, scales, offsets, 32),
                    ref.w4a16_gemm(x, qweight, scales, offsets, 32),
                ),
                (ops.w8a16_gemm(x, q8, scales, 32), ref.w8a16_gemm(x, q8, scales, 32)),
            ):
                torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())


@pytest.fixture
def not_invariant():
    """The previous, row-count-dependent strategies (LLM(batch_invariant=False)), restored afterwards."""
    before = _C.batch_invariant()
    _C.set_batch_invariant(False)
    yield
    _C.set_batch_invariant(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_not_invariant_batched_int4_rows_agree_with_each_other(isa, not_invariant, dtype):
    """Not batch-invariant, fp32 / fp16 x: the tiles (2-11 rows) and, on AVX-512, FmaPanel (12 rows and
    up) dequantise exactly as W4Fma does, so a row's bits are the same at every m >= 2; and they match
    the reference."""
    gen = torch.Generator().manual_seed(13)
    n, k = 71, 640
    for symmetric in (False, True):
        qweight, scales, offsets = _w4(n, k, 32, symmetric, torch.bfloat16, gen)
        x = torch.randn(40, k, generator=gen).to(dtype)
        full = ops.w4a16_gemm(x, qweight, scales, offsets, 32)
        _close(full, ref.w4a16_gemm(x, qweight, scales, offsets, 32), dtype)
        for m in (2, 5, 11, 12, 17):
            got = ops.w4a16_gemm(x[:m], qweight, scales, offsets, 32)
            assert torch.equal(got, full[:m]), f"m={m}: rows differ from the same rows at m=40"


def test_batched_bf16_equals_the_bf16_dequantised_weights(isa, not_invariant):
    # Not batch-invariant, bf16 x with many rows: the weights are dequantised (s * q + o in fp32), rounded
    # to bf16, and multiplied in fp32 (AVX-512: L2-sized panels through the dense bf16 kernel). That is the
    # model dequantised to bf16, so the result equals fp32 math on those bf16 weights up to the final
    # rounding to bf16 (1 ulp). (Batch-invariant, the rows take the decode kernels: test_w4a16_matches_reference.)
    gen = torch.Generator().manual_seed(11)
    k = 640
    for symmetric in (False, True):
        qweight, scales, offsets = _w4(203, k, 32, symmetric, torch.float16, gen)
        q8 = torch.randint(-127, 128, (203, k), dtype=torch.int8, generator=gen)
        w4 = ref.dequantize_w4(qweight, scales, offsets, 32).float().to(torch.bfloat16).float()
        w8 = ref.dequantize_w8(q8, scales, 32).float().to(torch.bfloat16).float()
        for m in (12, 16, 37):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            for got, w in (
                (ops.w4a16_gemm(x, qweight, scales, offsets, 32), w4),
                (ops.w8a16_gemm(x, q8, scales, 32), w8),
            ):
                want = x.float() @ w.T
                if isa == "avx512":
                    torch.testing.assert_close(
                        got.float(), want, rtol=2**-8, atol=1e-4 * want.abs().max().item()
                    )
                _close(got, want.to(torch.bfloat16), torch.bfloat16)


def test_threads_do_not_change_results(isa):
    gen = torch.Generator().manual_seed(3)
    qweight, scales, offsets = _w4(301, 384, 64, False, torch.float16, gen)
    q8 = torch.randint(-128, 128, (301, 384), dtype=torch.int8, generator=gen)
    x = torch.randn(7, 384, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.w4a16_gemm(x, qweight, scales, offsets, 64), ops.w8a16_gemm(x, q8, scales, 64)
        torch.set_num_threads(max(2, before))
        many = ops.w4a16_gemm(x, qweight, scales, offsets, 64), ops.w8a16_gemm(x, q8, scales, 64)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_out_is_written_in_place_and_inputs_may_be_strided():
    gen = torch.Generator().manual_seed(4)
    qweight, scales, offsets = _w4(40, 256, 32, False, torch.float16, gen)
    x = torch.randn(256, 6, generator=gen).T  # non-contiguous: copied, still correct
    out = torch.full((6, 40), float("nan"))
    got = ops.w4a16_gemm(x, qweight, scales, offsets, 32, out=out)
    assert got is out
    _close(out, ref.w4a16_gemm(x, qweight, scales, offsets, 32), torch.float32)
    empty = ops.w4a16_gemm(torch.empty(0, 256), qweight, scales, offsets, 32)
    assert empty.shape == (0, 40)


def test_bad_arguments_name_the_parameter():
    gen = torch.Generator().manual_seed(5)
    qweight, scales, offsets = _w4(8, 128, 32, False, torch.float16, gen)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128, got 48"):
        ops.w4a16_gemm(x, qweight, scales[:, :2].contiguous(), offsets[:, :2].contiguous(), 48)
    with pytest.raises(
        ValueError, match=r"scales must have shape \[n, k // group_size\] = \[8, 4\], got \[8, 2\]"
    ):
        ops.w4a16_gemm(x, qweight, scales[:, :2].contiguous(), offsets, 32)
    with pytest.raises(TypeError, match=r"offsets must have the dtype of scales \(float16\), got float32"):
        ops.w4a16_gemm(x, qweight, scales, offsets.float(), 32)
    with pytest.raises(TypeError, match="qweight must be uint8, got int8"):
        ops.w4a16_gemm(x, qweight.to(torch.int8), scales, offsets, 32)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16, got float64"):
        ops.w4a16_gemm(x.double(), qweight, scales, offsets, 32)
    with pytest.raises(TypeError, match=r"out must have the dtype of x \(float32\), got bfloat16"):
        ops.w4a16_gemm(x, qweight, scales, offsets, 32, out=torch.empty(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out must have shape \[m, n\] = \[2, 8\], got \[2, 9\]"):
        ops.w4a16_gemm(x, qweight, scales, offsets, 32, out=torch.empty(2, 9))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        ops.w4a16_gemm(x, qweight, scales, offsets, 32, out=torch.empty(8, 2).T)
    with pytest.raises(
        ValueError,
        match=r"k \(2 \* qweight.shape\[1\]\) must be a positive multiple of group_size \(64\), got 96",
    ):
        ops.w4a16_gemm(
            torch.randn(2, 96), torch.zeros(8, 48, dtype=torch.uint8), torch.ones(8, 1).half(), None, 64
        )
    with pytest.raises(
        ValueError, match=r"x.shape\[1\] must be k \(2 \* qweight.shape\[1\]\) = 128, got shape \[2, 64\]"
    ):
        ops.W4A16Weight(qweight, scales, offsets, 32)(torch.randn(2, 64))
    with pytest.raises(TypeError, match="qweight must be int8, got uint8"):
        ops.w8a16_gemm(x, torch.zeros(8, 128, dtype=torch.uint8), scales, 32)
    # Groups of 16 are an int8 format only.
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128, got 16"):
        ops.w4a16_gemm(x, qweight, torch.ones(8, 8).half(), None, 16)
    with pytest.raises(ValueError, match="group_size must be 16, 32, 64 or 128, got 8"):
        ops.w8a16_gemm(x, torch.zeros(8, 128, dtype=torch.int8), torch.ones(8, 16).half(), 8)


def test_set_cpu_isa_is_capped_and_restorable():
    before = _C.cpu_isa()
    try:
        assert _C.set_cpu_isa("portable") == "portable"
        assert _C.set_cpu_isa("avx512") == _C.cpu_best_isa() or _C.cpu_best_isa() != "avx512"
    finally:
        _C.set_cpu_isa(before)


# ---- batch invariance: a row's bits do not depend on the rows beside it -------------------------------

# Row counts of the batch-invariance tests: every M tile of every path (1-3, 4, 6, 8, 12 ...), 64 (chunks).
_BATCH_ROWS = [*range(2, 18), 64]


def _assert_rows_invariant(fn, x: torch.Tensor) -> None:
    """Each row of fn(x[:m]) equals fn of that row alone, bit for bit, for every m in _BATCH_ROWS."""
    alone = torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])
    for m in _BATCH_ROWS:
        got = fn(x[:m])
        bad = [i for i in range(m) if not torch.equal(got[i], alone[i])]
        assert not bad, f"m={m}: rows {bad[:8]} differ from the same rows computed alone"


@pytest.fixture
def invariant():
    """Batch-invariant kernels (the default), restored afterwards."""
    before = _C.batch_invariant()
    _C.set_batch_invariant(True)
    yield
    _C.set_batch_invariant(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["dense", "w4", "w4_sym", "w8", "fp8", "w8a8"])
def test_gemm_row_is_batch_invariant(isa, invariant, kind, dtype):
    """A row computed at M = 1 equals the same row inside M = 2..17 and 64, on every ISA path: the
    strategy (GEMV or tiles, panels, group sums) and the per-element reduction order never depend on M."""
    gen = torch.Generator().manual_seed(len(kind) + 3 * DTYPES.index(dtype))
    n, k, group = 133, 320, 32  # n not a multiple of any tile; k a few groups, not a multiple of 128
    x = torch.randn(64, k, generator=gen).to(dtype)
    if kind == "dense":
        w = torch.randn(n, k, generator=gen).to(dtype)
        _assert_rows_invariant(lambda a: ops.dense_gemm(a, w), x)
    elif kind.startswith("w4"):
        qweight, scales, offsets = _w4(n, k, group, kind == "w4_sym", torch.float32, gen)
        weight = ops.W4A16Weight(qweight, scales, offsets, group, None)
        _assert_rows_invariant(weight, x)
    elif kind == "w8a8":  # exact int32 sums (w8a8_gemm.h): invariant by construction; checked here
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        scales = torch.rand(n, generator=gen) * 0.02 + 0.002
        smooth = torch.rand(k, generator=gen) + 0.5
        _assert_rows_invariant(ops.W8A8Weight(codes, scales, smooth, None), x)
    else:
        if kind == "fp8":
            codes = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn)
        else:
            codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.002
        weight = ops.W8A16Weight(codes, scales, group, None)
        _assert_rows_invariant(weight, x)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["w4", "w8", "fp8"])
def test_batched_rows_equal_decode_rows_across_blocks(isa, invariant, kind, group_size, dtype):
    """Many rows with long K: on AVX-512 the rows go through panels (int4: W4Dot's nibbles dequantised
    once per panel, x prepared per block of rows; int8 / fp8: W8Fma's q * scale once per panel, x
    widened per block), which must give the one-row kernels' bits. K of ~4000 puts 6-30 rows in a
    block, so 80 rows cross block and panel boundaries; N = 37 ends in a partial tile; scales of every
    float type, with offsets or without (int4), and a bias."""
    gen = torch.Generator().manual_seed(group_size + DTYPES.index(dtype) + 10 * len(kind))
    k = {32: 4000, 64: 4032, 128: 3968}[group_size]  # a partial last 128-chunk for 32 and 64
    n, m = 37, 80
    for i in range(2):
        scale_dtype = DTYPES[(i + group_size // 32) % 3]
        bias = torch.randn(n, generator=gen).to(dtype) if i == 0 else None
        if kind == "w4":
            qweight, scales, offsets = _w4(n, k, group_size, i == 1, scale_dtype, gen)
            weight = ops.W4A16Weight(qweight, scales, offsets, group_size, bias)
        else:
            if kind == "fp8":
                codes = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn)
            else:
                codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
            scales = (torch.rand(n, k // group_size, generator=gen) * 0.02 + 0.002).to(scale_dtype)
            weight = ops.W8A16Weight(codes, scales, group_size, bias)
        x = torch.randn(m, k, generator=gen).to(dtype)
        got = weight(x)
        alone = torch.cat([weight(x[j : j + 1]) for j in range(m)])
        bad = [j for j in range(m) if not torch.equal(got[j], alone[j])]
        assert not bad, f"rows {bad[:8]} of {m} differ from the same rows computed alone"
        if kind == "w4":
            want = ref.w4a16_gemm(x, qweight, scales, offsets, group_size, bias=bias)
        else:
            want = ref.w8a16_gemm(x, codes, scales, group_size, bias=bias)
        _close(got, want, dtype)


@pytest.mark.parametrize("k", [576, 8192, 16448])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8_rows_with_16bit_x_sum_as_with_fp32_x(isa, invariant, dtype, k):
    """Int8 weights with bf16 / fp16 x: the one-row and thin kernels widen x to fp32 once per tile of
    rows into a per-thread scratch (k = 576: whole tiles of rows fit; 8192: fewer rows per tile; 16448:
    not one row, x is read as it is). Either way each output is the fp32-x row rounded once to the
    dtype, bit for bit, at 1-5 rows, and it matches the plain-torch reference."""
    gen = torch.Generator().manual_seed(k)
    n, group = 21, 64
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.002
    weight = ops.W8A16Weight(codes, scales, group, None)
    x = torch.randn(5, k, generator=gen).to(dtype)
    for m in range(1, 6):
        got, want = weight(x[:m]), weight(x[:m].float()).to(dtype)
        bad = [i for i in range(m) if not torch.equal(got[i], want[i])]
        assert not bad, f"m={m}: rows {bad} differ from the fp32-x rows rounded to {dtype}"
    _close(weight(x), ref.w8a16_gemm(x, codes, scales, group), dtype)


def test_gemm_batch_invariance_switch_is_process_wide():
    before = _C.batch_invariant()
    try:
        assert _C.set_batch_invariant(False) is False and not _C.batch_invariant()
        assert _C.set_batch_invariant(True) is True and _C.batch_invariant()
    finally:
        _C.set_batch_invariant(before)
