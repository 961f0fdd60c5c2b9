"""The A8 GEMM (grouped int4 / int8 weights x int8 activations quantised per group of 32 on the fly)
and its A16 mode (16-bit codes as two int8 limbs): against the plain-torch twin over every format, row
counts 1-17, 64 and 256, awkward k and n; bit for bit the same on every ISA path the machine has and
at every row count (batch invariance); the activation quantisation itself exact (ties to even, signed
zeros, the limbs' edges); and the errors it raises."""

from __future__ import annotations

import itertools

import pytest
import torch

from inflight import _C
from inflight.layers.quantized_linear import W4A16Linear, W8A16Linear
from inflight.ops.gemm import A8Weight
from inflight.ops.reference.gemm import (
    a8_gemm,
    a8_group,
    dequantize_w4,
    dequantize_w8,
    quantize_a8_activations,
)
from inflight.quantization.w4a16 import quantize_w4, quantize_w8

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]

# (bits, group_size, symmetric): GGUF Q4_1 / Q4_K (asymmetric int4, 32), Q4_0 (symmetric), the
# `inflight quantize` groups (64, 128), Q8_0 / Q5_0 (int8, 32) and Q6_K (int8, 16).
FORMATS = [(4, 32, False), (4, 32, True), (4, 64, False), (4, 128, True), (8, 32, True), (8, 16, True)]
FORMAT_IDS = [f"int{b}-g{g}-{'sym' if s else 'asym'}" for b, g, s in FORMATS]


ACT_BITS = [8, 16]
ACT_IDS = ["a8", "a16"]


def _weight(
    bits: int,
    group: int,
    sym: bool,
    n: int,
    k: int,
    seed: int,
    scale_dtype=torch.float16,
    bias=True,
    act_bits: int = 8,
):
    """(A8Weight, the dequantised fp32 weight, bias) of a random [n, k] weight."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    if bits == 4:
        q, s, o = quantize_w4(w, group, sym, scale_dtype)
        return A8Weight(4, q, s, o, group, b, act_bits), dequantize_w4(q, s, o, group), b
    q, s = quantize_w8(w, group, scale_dtype)
    return A8Weight(8, q, s, None, group, b, act_bits), dequantize_w8(q, s, group), b


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within two roundings to the output dtype (the reference's own, of its float64 value, and the
    kernel's, of its fp32 sum: one ulp apart where they straddle a rounding boundary) plus fp32 sums'
    error."""
    exact = want.double()
    ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}[got.dtype]
    tol = exact.abs() * 2 * ulp + 1e-5 * exact.abs().max()
    assert ((got.double() - exact).abs() <= tol).all(), (got.double() - exact).abs().max()


@pytest.mark.parametrize("act_bits", ACT_BITS, ids=ACT_IDS)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("m", [*range(1, 18), 64, 256])
def test_a8_matches_the_reference(fmt, m, act_bits):
    bits, group, sym = fmt
    n, k = 100, 384  # a partial panel of 64 channels and a partial block of 16
    w, deq, bias = _weight(bits, group, sym, n, k, seed=m, act_bits=act_bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1000 + m)) * 3
    if m > 2:
        x[1] = 0  # an all-zero row: scale 0 in every group, out = bias
        x[2, :32] = 0  # one all-zero group
    got = w(x)
    _close(got, a8_gemm(x.double().float(), deq, group, bias, act_bits).to(torch.float64))
    if m > 2:
        assert torch.equal(got[1], bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("act_bits", ACT_BITS, ids=ACT_IDS)
def test_a8_input_and_scale_dtypes(fmt, dtype, scale_dtype, act_bits):
    bits, group, sym = fmt
    n, k = 65, 256
    w, deq, _ = _weight(
        bits, group, sym, n, k, seed=3, scale_dtype=scale_dtype, bias=False, act_bits=act_bits
    )
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(11)).to(dtype)
    got = w(x)
    assert got.dtype == dtype and got.shape == (7, n)
    _close(got, a8_gemm(x, deq, group, None, act_bits).to(torch.float64))


@pytest.mark.parametrize("n,k", [(1, 32), (17, 96), (63, 160), (64, 64), (129, 1056), (960, 576)])
def test_a8_awkward_shapes(n, k):
    for (bits, group, sym), act_bits in itertools.product([(4, 32, False), (8, 16, True)], ACT_BITS):
        w, deq, bias = _weight(bits, group, sym, n, k, seed=n, act_bits=act_bits)
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(k))
        _close(w(x), a8_gemm(x, deq, group, bias, act_bits).double())


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("act_bits", ACT_BITS, ids=ACT_IDS)
def test_a8_is_bit_identical_on_every_isa_and_row_count(fmt, dtype, act_bits):
    """The portable loop and the VNNI tiles do the same operations in the same order; a row's result
    is the same alone, in a batch of any size and under any thread split."""
    bits, group, sym = fmt
    w, _, _ = _weight(bits, group, sym, 200, 512, seed=5, bias=dtype == torch.float32, act_bits=act_bits)
    x = (torch.randn(37, 512, generator=torch.Generator().manual_seed(9)) * 4).to(dtype)
    before, threads = _C.cpu_isa(), torch.get_num_threads()
    results = {}
    try:
        for isa in ("portable", "avx2", "avx512f", "avx512"):
            if _C.set_cpu_isa(isa) != isa:
                continue
            results[isa] = w(x)
            for m in (1, 2, 3, 4, 5, 17):
                for r0 in range(0, 37 - m + 1, 11):
                    assert torch.equal(w(x[r0 : r0 + m]), results[isa][r0 : r0 + m]), (isa, m, r0)
            torch.set_num_threads(1)
            assert torch.equal(w(x), results[isa]), (isa, "one thread")
            torch.set_num_threads(threads)
    finally:
        _C.set_cpu_isa(before)
        torch.set_num_threads(threads)
    first = next(iter(results.values()))
    for isa, got in results.items():
        assert torch.equal(got, first), f"{isa} differs from {next(iter(results))}"


def test_a8_activation_quantisation_is_exact():
    """An identity int8 weight with unit scales returns the quantised activations times their group
    scale; with max |x| = 127 per group that scale is 1, so out == q: ties round to even, -0.0 is 0,
    every element at the limits."""
    k = 64
    ident = torch.eye(k, dtype=torch.int8)
    w = A8Weight(8, ident, torch.ones(k, k // 32, dtype=torch.float16), None, 32)
    row = torch.zeros(1, k)
    row[0, :8] = torch.tensor([127.0, 27.5, 26.5, -2.5, -3.5, 0.5, -0.0, -127.0])
    row[0, 32:40] = torch.tensor([-127.0, 1.49, -1.51, 126.5, 0.25, 64.0, 100.5, 99.5])
    got = w(row)
    want = torch.zeros(1, k)
    want[0, :8] = torch.tensor([127.0, 28, 26, -2, -4, 0, 0, -127])
    want[0, 32:40] = torch.tensor([-127.0, 1, -2, 126, 0, 64, 100, 100])
    assert torch.equal(got, want)
    q, d = quantize_a8_activations(row, 32)
    assert torch.equal(q.float(), want) and torch.equal(d, torch.ones(1, 2))


# A group of SmolLM2's layer-0 activations where x * (127 / max|x|) is exactly 27.5 (element 6): the
# correctly rounded 127 / max|x| makes it a tie (to even: 28); torch's scalar / tensor (a multiply by
# the reciprocal) gave 27.499998 (27).
SMOLLM2_TIE = [
    0.008711890317499638,
    -0.49766236543655396,
    -0.03348304703831673,
    -0.0037502238992601633,
    -0.004985720384865999,
    -0.0004264102899469435,
    0.10776153206825256,
    0.023301683366298676,
    -0.00017384419334121048,
    -0.0032472782768309116,
    0.004513388965278864,
    -0.0026503039989620447,
    0.007032489869743586,
    0.006437702104449272,
    -0.010485319420695305,
    0.028742240741848946,
    -0.005602375138550997,
    0.0038486262783408165,
    -0.028541063889861107,
    0.03280079364776611,
    -0.0027815070934593678,
    -0.0010725859319791198,
    0.008397002704441547,
    -0.003389415331184864,
    0.005003214348107576,
    -0.021727245301008224,
    0.028094971552491188,
    0.19554519653320312,
    -0.0013382723554968834,
    -0.0,
    -0.021604789420962334,
    -0.0013259720290079713,
]


def test_a8_twin_quantises_exactly_as_the_kernel():
    """Through an identity int8 weight with unit fp32 scales the kernel returns q * d (one rounding),
    which the twin's (q, d) reproduce bit for bit: over 200k random activations of mixed magnitudes,
    and on a real tie."""
    gen = torch.Generator().manual_seed(0)
    ident = A8Weight(8, torch.eye(32, dtype=torch.int8), torch.ones(32, 1), None, 32)
    x = torch.randn(6400, 32, generator=gen) * torch.rand(6400, 1, generator=gen).pow(4) * 100
    x = torch.cat([x, torch.tensor([SMOLLM2_TIE])])
    q, d = quantize_a8_activations(x, 32)
    assert torch.equal(ident(x), q.float() * d)
    assert int(q[-1, 6]) == 28


def test_a16_activation_quantisation_is_exact():
    """A16 through an identity int8 weight (unit scales, max |x| = 32512 per group: scale 1): out == q,
    ties to even, and the codes where the low limb wraps (l = q - 256 h at -128 / 127) come back whole."""
    k = 64
    ident = torch.eye(k, dtype=torch.int8)
    w = A8Weight(8, ident, torch.ones(k, k // 32, dtype=torch.float16), None, 32, act_bits=16)
    vals = [32512.0, -32512.0, 27.5, 26.5, -2.5, -0.0, 127.5, 128.5, -128.5, -129.0, 255.5, 256.0, -256.5]
    vals += [383.0, 384.0, -32385.0, -32384.5, 32383.5, 1.49, -1.51, 0.5, 100.25]
    row = torch.zeros(1, k)
    row[0, : len(vals)] = torch.tensor(vals)
    row[0, 32] = -32512.0  # the second group's scale is 1 too
    row[0, 33:40] = torch.tensor([-32511.5, 32510.5, -0.75, 12345.5, -12344.5, 7.0, -7.0])
    want = torch.round(row)  # half to even
    got = w(row)
    assert torch.equal(got, want)
    q, d = quantize_a8_activations(row, 32, act_bits=16)
    assert q.dtype == torch.int16 and torch.equal(q.float(), want) and torch.equal(d, torch.ones(1, 2))


def test_a16_twin_quantises_exactly_as_the_kernel():
    """As the int8 case: through an identity int8 weight with unit fp32 scales the A16 kernel returns
    q * d (one rounding), bit for bit the twin's, over 200k activations of mixed magnitudes."""
    gen = torch.Generator().manual_seed(1)
    ident = A8Weight(8, torch.eye(32, dtype=torch.int8), torch.ones(32, 1), None, 32, act_bits=16)
    x = torch.randn(6400, 32, generator=gen) * torch.rand(6400, 1, generator=gen).pow(4) * 100
    x = torch.cat([x, torch.tensor([SMOLLM2_TIE])])
    q, d = quantize_a8_activations(x, 32, act_bits=16)
    assert torch.equal(ident(x), q.float() * d)


@pytest.mark.parametrize("act_bits", ACT_BITS, ids=ACT_IDS)
def test_groups_too_small_to_scale_count_as_zero(act_bits):
    """A group whose max |x| is so small (denormal) that Q / max|x| overflows quantises to zero codes with
    d = 0, on every ISA and in the twin; its zeros stay zeros (an infinite scale turned 0 into -Q), and
    the row's other groups are unaffected."""
    k = 64
    w = A8Weight(8, torch.eye(k, dtype=torch.int8), torch.ones(k, k // 32), None, 32, None, act_bits)
    x = torch.zeros(2, k)
    x[0, :4] = torch.tensor([1e-39, -2e-39, 0.0, 5e-40])
    x[0, 32:35] = torch.tensor([3.0, -1.5, 0.25])
    x[1, :32] = 1e-30  # small but scalable: kept
    q, d = quantize_a8_activations(x, 32, act_bits)
    assert torch.equal(q[0, :32], torch.zeros(32, dtype=q.dtype)) and d[0, 0] == 0
    before = _C.cpu_isa()
    try:
        for isa in ("portable", "avx2", "avx512f", "avx512"):
            if _C.set_cpu_isa(isa) != isa:
                continue
            got = w(x)
            assert torch.equal(got, q.float() * d.repeat_interleave(32, dim=1)), isa
            assert torch.equal(got[0, :32], torch.zeros(32)), isa
            assert got[0, 32] == 3.0 and got[1, 0] > 0, isa
    finally:
        _C.set_cpu_isa(before)


def test_a8_group_and_twin_agree_on_real_model_scales():
    # The reference's activation group: 16 for Q6_K's groups of 16, 32 otherwise.
    assert [a8_group(g) for g in (16, 32, 64, 128)] == [16, 32, 32, 32]


@pytest.mark.parametrize("act_bits,bound", [(8, 0.01), (16, 1e-4)], ids=ACT_IDS)
def test_a8_is_close_to_the_float_product(act_bits, bound):
    """The quantisation error only: per-group int8 (A16: 16-bit) activations on a well-scaled int4
    product (measured: 5e-3 and 2e-5); A16 also with outliers (1 % of the elements 50x larger)."""
    w, deq, _ = _weight(4, 32, False, 256, 512, seed=2, bias=False, act_bits=act_bits)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(32, 512, generator=gen)
    exact = x.double() @ deq.double().T
    rel = (w(x).double() - exact).norm() / exact.norm()
    assert rel < bound
    x = x * torch.where(torch.rand(32, 512, generator=gen) < 0.01, 50.0, 1.0)
    exact = x.double() @ deq.double().T
    assert (w(x).double() - exact).norm() / exact.norm() < 10 * bound


def test_a8_weight_errors_name_the_argument():
    q, s, o = quantize_w4(torch.randn(8, 64), 32, False, torch.float16)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        A8Weight(3, q, s, o, 32)
    q8, s8 = quantize_w8(torch.randn(8, 64), 32, torch.float16)
    with pytest.raises(ValueError, match="offsets must be None"):
        A8Weight(8, q8, s8, s8, 32)
    with pytest.raises(ValueError, match="group_size"):
        A8Weight(4, q, s, o, 16)
    with pytest.raises(ValueError, match="act_bits must be 8 or 16, got 12"):
        A8Weight(4, q, s, o, 32, None, 12)
    with pytest.raises(ValueError, match="act_bits must be 8 or 16"):
        quantize_a8_activations(torch.randn(2, 64), 32, act_bits=4)
    w = A8Weight(4, q, s, o, 32, torch.zeros(8))
    with pytest.raises(ValueError, match="k"):
        w(torch.randn(2, 32))
    with pytest.raises(TypeError, match="bias"):
        w(torch.randn(2, 64, dtype=torch.bfloat16))
    assert w(torch.randn(0, 64)).shape == (0, 8)
    assert w.nbytes > 0 and (w.n, w.k, w.bits, w.group_size) == (8, 64, 4, 32)


@pytest.mark.parametrize("mode,act_bits", [("int8", 8), ("int16", 16)], ids=ACT_IDS)
@pytest.mark.parametrize("cls", [W4A16Linear, W8A16Linear])
def test_layers_run_int8_activations_on_request(cls, mode, act_bits):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 128), torch.randn(96)
    layer = cls.from_weight(weight, bias, group_size=32)
    x = torch.randn(3, 5, 128)
    float_out = layer(x)
    assert layer.set_activation_quantization(mode) is True
    assert f"{mode} activations" in repr(layer)
    assert layer.kernel_weight().act_bits == act_bits
    got = layer(x)
    if cls is W4A16Linear:
        deq = dequantize_w4(layer.qweight, layer.scales, layer.offsets, 32)
    else:
        deq = dequantize_w8(layer.qweight, layer.scales, 32)
    _close(got.view(15, 96), a8_gemm(x.view(15, 128), deq, 32, bias, act_bits).double())
    assert not torch.equal(got, float_out)
    assert layer.set_activation_quantization("none") is False
    assert torch.equal(layer(x), float_out)
    with pytest.raises(ValueError, match="activation_quantization"):
        layer.set_activation_quantization("int4")


def test_fp8_weights_keep_their_weight_only_kernel():
    layer = W8A16Linear(64, (32,), weight_format="fp8_e4m3", group_size=32)
    assert layer.supports_int8_activations() is False
    assert layer.set_activation_quantization("int8") is False
    assert layer.activation_quantization == "none"
