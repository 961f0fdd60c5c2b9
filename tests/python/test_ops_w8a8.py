"""The W8A8 GEMM (int8 weights x per-token int8 activations, int32 sums) against its plain-torch twin:
bit-identical on every ISA the machine has, for row counts 1-17, 64, 256 and awkward k; the device
path (ops.gemm.w8a8_gemm: int8 tensor cores on a GPU) bit-identical to both, here on CPU tensors and,
marked ``cuda``, on a GPU."""

from __future__ import annotations

import pytest
import torch

from inflight import _C
from inflight.ops.gemm import W8A8Weight, _int8_mm_float64, int8_mm
from inflight.ops.gemm import w8a8_gemm as w8a8_gemm_any
from inflight.ops.reference.gemm import quantize_w8a8_activations, w8a8_gemm

ISAS = [isa for isa in ("portable", "avx2", "avx512f", "avx512") if _C.set_cpu_isa(isa) == isa]
_C.set_cpu_isa(_C.cpu_best_isa())


@pytest.fixture(params=ISAS)
def isa(request):
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa(_C.cpu_best_isa())


def _weights(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-4
    smooth = torch.rand(k, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    return q, scales, smooth, bias


@pytest.mark.parametrize("m", list(range(1, 18)) + [64, 256])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_w8a8_is_bit_identical_to_the_reference(isa, m, dtype):
    n, k = 80, 131  # a partial 16-column block and k not a multiple of 4
    q, scales, smooth, bias = _weights(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m)).to(dtype)
    if m > 2:
        x[1] = 0  # an all-zero row: scale 0, out = bias
    w = W8A8Weight(q, scales, smooth, bias)
    got = w(x)
    want = w8a8_gemm(x, q, scales, smooth, bias)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("n,k", [(576, 576), (1536, 576), (576, 1536), (33, 7), (16, 4)])
def test_w8a8_shapes_without_smooth_or_bias(isa, n, k):
    q, scales, _, _ = _weights(n, k)
    x = torch.randn(9, k)
    assert torch.equal(W8A8Weight(q, scales)(x), w8a8_gemm(x, q, scales))


def test_w8a8_is_close_to_the_float_product():
    # The quantisation error only: per-token int8 activations on a well-scaled product.
    n, k = 256, 512
    w = torch.randn(n, k) * 0.05
    scales = w.abs().amax(dim=1) / 127
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    x = torch.randn(32, k)
    exact = x @ (q.float() * scales[:, None]).T
    got = W8A8Weight(q, scales)(x)
    rel = (got - exact).norm() / exact.norm()
    assert rel < 0.01


def test_w8a8_rows_do_not_depend_on_the_batch(isa):
    q, scales, smooth, bias = _weights(200, 96)
    w = W8A8Weight(q, scales, smooth, bias)
    x = torch.randn(16, 96)
    batch = w(x)
    for i in range(16):
        assert torch.equal(w(x[i : i + 1]), batch[i : i + 1])


def test_w8a8_activation_quantisation_rounds_half_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, 63.5]])
    q, s = quantize_w8a8_activations(x)
    assert q.tolist() == [[127, 0, 2, -2, 64]] and s.item() == pytest.approx(1.0)


def test_w8a8_row_too_small_to_scale_counts_as_zero(isa):
    """A token whose max |x| is so small (denormal) that 127 / max|x| overflows: zero codes and scale on
    every ISA, in the twin and on the device path (an infinite scale turned its zeros into -max|x|)."""
    q, scales, _, bias = _weights(16, 64)
    x = torch.zeros(2, 64)
    x[0, :3] = torch.tensor([1e-39, -2e-39, 5e-40])
    x[1] = torch.randn(64)
    codes, s = quantize_w8a8_activations(x)
    assert codes[0].abs().sum() == 0 and s[0] == 0 and s[1] > 0
    got = W8A8Weight(q, scales, None, bias)(x)
    assert torch.equal(got[0], bias)
    assert torch.equal(got, w8a8_gemm(x, q, scales, None, bias))
    assert torch.equal(got, w8a8_gemm_any(x, q, scales, None, bias))


def test_w8a8_bad_arguments():
    q, scales, smooth, _ = _weights(32, 64)
    with pytest.raises(TypeError, match="qweight"):
        W8A8Weight(q.float(), scales)
    with pytest.raises(ValueError, match=r"scales"):
        W8A8Weight(q, scales[:5])
    with pytest.raises(ValueError, match=r"smooth"):
        W8A8Weight(q, scales, smooth[:3])
    w = W8A8Weight(q, scales)
    with pytest.raises(ValueError, match="k"):
        w(torch.randn(2, 63))


# ---- W8A8 off the CPU kernel (ops.gemm.w8a8_gemm: the GPU's path) -------------------------------------


@pytest.mark.parametrize("m", [1, 5, 16, 17, 64])
@pytest.mark.parametrize("n,k", [(80, 131), (576, 1536)], ids=["odd", "aligned"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_device_path_is_bit_identical_to_the_reference(m, n, k, dtype):
    """Run here on CPU tensors (its int8 product through torch._int_mm): the same bits as the twin and
    the C++ kernel."""
    q, scales, smooth, bias = _weights(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7 + m)).to(dtype)
    if m > 2:
        x[1] = 0
    got = w8a8_gemm_any(x, q, scales, smooth, bias)
    assert got.dtype == dtype and torch.equal(got, w8a8_gemm(x, q, scales, smooth, bias))
    assert torch.equal(got, W8A8Weight(q, scales, smooth, bias)(x))
    assert torch.equal(w8a8_gemm_any(x, q, scales), w8a8_gemm(x, q, scales))


def test_int8_products_are_exact_on_every_branch():
    """The extremes (-128 weights times 127 activations over a long K) summed exactly: cuBLAS's
    branch and the CPU's (torch._int_mm), and the float64 one the GPU takes for unaligned shapes."""
    k = 14336
    q = torch.full((3, k), 127, dtype=torch.int8)
    q[1] = -127
    q[2, ::2] = -127
    w = torch.full((8, k), -128, dtype=torch.int8)
    w[3, 1::3] = 127
    want = (q.long() @ w.long().T).to(torch.int32)
    assert torch.equal(int8_mm(q, w), want)
    assert torch.equal(_int8_mm_float64(q, w), want)
    with pytest.raises(ValueError, match="K"):
        int8_mm(q, w[:, :-1])


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 16, 17, 100])
@pytest.mark.parametrize("n,k", [(80, 131), (576, 1536)], ids=["odd", "aligned"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_w8a8_equals_the_cpu_kernel(m, n, k, dtype):
    """On a GPU: int8 tensor cores (aligned shapes; fewer than 17 rows padded) or float64 (odd ones),
    bit for bit the CPU kernel's result."""
    q, scales, smooth, bias = _weights(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3 + m)).to(dtype)
    want = W8A8Weight(q, scales, smooth, bias)(x)
    dev = [t.cuda() for t in (x, q, scales, smooth, bias)]
    got = w8a8_gemm_any(*dev)
    assert got.is_cuda and torch.equal(got.cpu(), want)
    acts = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=torch.Generator().manual_seed(m))
    assert torch.equal(int8_mm(acts.cuda(), dev[1]).cpu(), (acts.long() @ q.long().T).to(torch.int32))
