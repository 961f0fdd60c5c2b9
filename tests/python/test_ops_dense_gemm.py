"""Dense CPU GEMM (``out = x @ weight.T + bias``) against its plain-torch fp32 twin, for every ISA path
this CPU has (the portable one always), fp32/bf16/fp16, with and without bias, at decode batch sizes and
awkward shapes (partial N tiles, K tails, M beyond one register tile and one L2 chunk)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.dlpack import to_dlpack

from inflight import _C
from inflight.ops import gemm as ops
from inflight.ops.reference import gemm as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BATCHES = [1, 2, 3, 7, 16, 17, 33, 64, 100]
# (N, K): one output, a partial 4-row tile with a K below one vector, SmolLM2's qkv and down shapes, a
# wide N with a K tail, a long K with an odd N.
SHAPES = [(1, 576), (5, 33), (960, 576), (17, 1536), (3072, 100)]
# Explicit (mantissa bits, smallest normal exponent) of each output type: one rounding is half a unit in
# the last place of the result.
_FORMAT = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool, gen: torch.Generator):
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    return x, w, bias


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """fp32: within the fp32 summation error of the reference (rtol 1e-5 of sum |x w| + |bias|).
    bf16/fp16: the exact fp32 result rounded once: at most half an output ulp away from the fp32
    reference, plus that fp32 summation error."""
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0])
    want = ref.dense_gemm(x.float(), w.float(), None if bias is None else bias.float())
    magnitude = x.float().abs() @ w.float().abs().T
    if bias is not None:
        magnitude = magnitude + bias.float().abs()
    tol = 1e-5 * magnitude + 1e-30
    if got.dtype != torch.float32:
        mant, emin = _FORMAT[got.dtype]
        top = torch.maximum(want.abs(), got.float().abs()).clamp_min(2.0**emin)
        tol = tol + 0.5 * torch.exp2(torch.floor(torch.log2(top)) - mant)
    err = (got.float() - want).abs()
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"error {worst:.3g} x the tolerance (max abs error {err.max().item():.3g})"


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_gemm_matches_reference(isa, dtype, with_bias):
    gen = torch.Generator().manual_seed(11 + DTYPES.index(dtype) + 3 * with_bias)
    for n, k in SHAPES:
        for m in BATCHES:
            x, w, bias = _inputs(m, n, k, dtype, with_bias, gen)
            _check(ops.dense_gemm(x, w, bias), x, w, bias)


def test_m_beyond_one_l2_chunk(isa):
    # Many M tiles over several L2-sized chunks of weight rows (512 KiB each), with a partial last chunk.
    gen = torch.Generator().manual_seed(12)
    for dtype in (torch.float32, torch.bfloat16):
        x, w, bias = _inputs(45, 1201, 257, dtype, True, gen)
        _check(ops.dense_gemm(x, w, bias), x, w, bias)


def test_each_output_reads_only_its_own_weight_row(isa):
    # N = 6: the last tile is partial (its missing rows are computed from a clamped row, never stored);
    # an inf in row 5 must reach column 5 only, a NaN in row 0 column 0 only.
    for dtype in DTYPES:
        x = torch.ones(3, 40, dtype=dtype)
        w = torch.ones(6, 40, dtype=dtype)
        w[5, 39] = float("inf")
        w[0, 0] = float("nan")
        out = ops.dense_gemm(x, w)
        assert torch.isinf(out[:, 5]).all() and torch.isnan(out[:, 0]).all()
        assert torch.equal(out[:, 1:5].float(), torch.full((3, 4), 40.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_is_rounded_to_nearest_even(isa, dtype):
    # With u the output's unit in the last place at 1: 1 + u/2 lies halfway between 1 and 1 + u, and even
    # rounds down to 1; 1 + 3u/2 lies between 1 + u (odd) and 1 + 2u, and even rounds up. The small
    # terms are exact in the input type, the fp32 sums exact.
    u = 2.0 ** -(_FORMAT[dtype][0])
    x = torch.tensor([[1.0, u / 2], [1.0, 3 * u / 2], [-1.0, -u / 2]], dtype=dtype)
    w = torch.ones(1, 2, dtype=dtype)
    assert ops.dense_gemm(x, w)[:, 0].float().tolist() == [1.0, 1.0 + 2 * u, -1.0]


def test_threads_do_not_change_results(isa):
    gen = torch.Generator().manual_seed(13)
    x, w, bias = _inputs(7, 301, 384, torch.float32, True, gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.dense_gemm(x, w, bias)
        torch.set_num_threads(max(2, before))
        many = ops.dense_gemm(x, w, bias)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_out_is_written_in_place_and_x_may_be_strided():
    gen = torch.Generator().manual_seed(14)
    w = torch.randn(40, 256, generator=gen)
    x = torch.randn(256, 6, generator=gen).T  # non-contiguous: copied, still correct
    out = torch.full((6, 40), float("nan"))
    got = ops.dense_gemm(x, w, out=out)
    assert got is out
    _check(out, x, w, None)
    assert ops.dense_gemm(torch.empty(0, 256), w).shape == (0, 40)
    # Parameters that require grad are fine (the kernel only reads them).
    lin = torch.nn.Linear(256, 40)
    with torch.no_grad():
        _check(ops.dense_gemm(x.contiguous(), lin.weight, lin.bias), x.contiguous(), lin.weight, lin.bias)


def test_exported_from_ops():
    import inflight.ops
    import inflight.ops.reference

    assert inflight.ops.dense_gemm is ops.dense_gemm
    assert inflight.ops.reference.dense_gemm is ref.dense_gemm


def test_bad_arguments_name_the_parameter():
    x = torch.randn(2, 64)
    w = torch.randn(8, 64)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16, got float64"):
        ops.dense_gemm(x.double(), w)
    with pytest.raises(TypeError, match=r"weight must have the dtype of x \(float32\), got bfloat16"):
        ops.dense_gemm(x, w.bfloat16())
    with pytest.raises(ValueError, match=r"weight must have shape \[n, k\] = \[8, 64\], got \[8, 63\]"):
        ops.dense_gemm(x, torch.randn(8, 63))
    with pytest.raises(ValueError, match=r"weight must be 2-D \[n, k\], got shape \[64\]"):
        ops.dense_gemm(x, torch.randn(64))
    with pytest.raises(ValueError, match=r"x must be 2-D \[m, k\], got shape \[1, 2, 64\]"):
        ops.dense_gemm(torch.randn(1, 2, 64), w, out=torch.empty(1, 8))
    with pytest.raises(ValueError, match=r"bias must have shape \[n\] = \[8\], got \[9\]"):
        ops.dense_gemm(x, w, torch.randn(9))
    with pytest.raises(TypeError, match=r"bias must have the dtype of x \(float32\), got float16"):
        ops.dense_gemm(x, w, torch.randn(8).half())
    with pytest.raises(ValueError, match=r"out must have shape \[m, n\] = \[2, 8\], got \[2, 9\]"):
        ops.dense_gemm(x, w, out=torch.empty(2, 9))
    with pytest.raises(TypeError, match=r"out must have the dtype of x \(float32\), got bfloat16"):
        ops.dense_gemm(x, w, out=torch.empty(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        ops.dense_gemm(x, w, out=torch.empty(8, 2).T)
    with pytest.raises(ValueError, match=r"weight must be contiguous \(row-major \[n, k\]\)"):
        ops.dense_gemm(x, torch.randn(64, 8).T)


def test_binding_checks_strides_and_threads():
    # The binding is also called directly (e.g. by other C++-facing code): strided arrays get an error
    # naming them instead of being read wrongly.
    x = torch.randn(2, 64)
    w = torch.randn(8, 64)
    out = torch.empty(2, 8)
    with pytest.raises(ValueError, match=r"x must be contiguous \(row-major\), got strides \[1, 2\]"):
        _C.dense_gemm(to_dlpack(torch.randn(64, 2).T), to_dlpack(w), None, to_dlpack(out), 1)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        _C.dense_gemm(to_dlpack(x), to_dlpack(torch.randn(8, 128)[:, ::2]), None, to_dlpack(out), 1)
    with pytest.raises(ValueError, match="out must be contiguous"):
        _C.dense_gemm(to_dlpack(x), to_dlpack(w), None, to_dlpack(torch.empty(8, 2).T), 1)
    with pytest.raises(ValueError, match="num_threads must be >= 1, got 0"):
        _C.dense_gemm(to_dlpack(x), to_dlpack(w), None, to_dlpack(out), 0)
    # A size-1 dimension may have any stride (torch calls such a tensor contiguous).
    row = torch.randn(64).as_strided((1, 64), (7, 1))
    assert row.is_contiguous()
    _C.dense_gemm(to_dlpack(row), to_dlpack(w), None, to_dlpack(out[:1]), 1)
    _check(out[:1], row, w, None)
