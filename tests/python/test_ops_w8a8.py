"""The W8A8 GEMM (int8 weights x per-token int8 activations, int32 sums) against its plain-torch twin:
bit-identical on every ISA the machine has, for row counts 1-17, 64, 256 and awkward k."""

from __future__ import annotations

import pytest
import torch

from inflight import _C
from inflight.ops.gemm import W8A8Weight
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
