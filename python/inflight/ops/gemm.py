"""CPU GEMMs: weight-only-quantised (W4A16, W8A16), the same weights with int8 activations (A8), W8A8
(int8 activations too) and dense; typed wrappers over the C++ kernels. W8A8 off the CPU:
:func:`w8a8_gemm` (int8 tensor cores on a GPU).

Formats (the canonical interchange layout, shared with the CUDA kernels):

- int4: ``qweight [N, K//2] uint8``, byte ``j`` of a row holds ``k = 2j`` in its low nibble and
  ``k = 2j+1`` in its high nibble; ``scales [N, K//group_size]`` (fp32, bf16 or fp16). Asymmetric:
  ``offsets`` (same shape and dtype), ``w = scale * q + offset`` (GGUF Q4_1); symmetric (``offsets``
  None): ``w = scale * (q - 8)`` (GGUF Q4_0).
- int8: ``qweight [N, K] int8``, ``scales [N, K//group_size]``, ``w = scale * q`` (GGUF Q8_0); the
  same with a ``float8_e4m3fn`` ``qweight``: ``w = scale * float(q)`` (FP8 checkpoints).

``x [M, K]`` is fp32, bf16 or fp16; ``out [M, N]`` and ``bias [N]`` have its dtype. Products and sums
are fp32 and ``out`` is rounded once. ``group_size`` is 32, 64 or 128 (int8 also 16). CPU tensors go to
:mod:`inflight._C` (threads = ``torch.get_num_threads()``); CUDA tensors with fp16/bf16 activations to
:mod:`inflight._C_cuda` on the current stream; anything else (fp32 on a GPU, other devices) to the
plain-torch twins in :mod:`inflight.ops.reference.gemm`.

Tensors cross into C++ as DLPack capsules made by ``torch.utils.dlpack.to_dlpack`` (~0.3 us each;
``Tensor.__dlpack__`` costs ~2 us). :class:`W4A16Weight` / :class:`W8A16Weight` import the weights
once, so a layer's call passes only ``x`` and ``out`` (~1 us of overhead in all).

:func:`dense_gemm` is ``F.linear`` for unquantised fp32 / bf16 / fp16 weights (torch Linear layout
``[N, K]``), tuned for decode batches (M = 1..16).
"""

from __future__ import annotations

import torch
from torch.utils.dlpack import to_dlpack

from inflight import _C
from inflight.cuda import require_cuda_module
from inflight.ops.reference import gemm as reference

__all__ = [
    "A8Weight",
    "W4A16Weight",
    "W8A8Weight",
    "W8A16Weight",
    "dense_gemm",
    "int8_mm",
    "w4a16_gemm",
    "w8a8_gemm",
    "w8a16_gemm",
]


def _cuda(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def _cuda_call(name: str, x: torch.Tensor, n: int, out: torch.Tensor | None, *args) -> torch.Tensor:
    if out is None:
        out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    *head, bias = args
    getattr(require_cuda_module(), name)(
        x.contiguous(), *head, out, bias, torch.cuda.current_stream(x.device).cuda_stream
    )
    return out


def _cap(t: torch.Tensor):
    """A DLPack capsule of a contiguous CPU tensor (inputs are made contiguous; the copy is correct)."""
    if t.requires_grad:
        t = t.detach()
    return to_dlpack(t if t.is_contiguous() else t.contiguous())


def _out(out: torch.Tensor | None, x: torch.Tensor, n: int):
    if out is None:
        out = torch.empty((x.shape[0], n), dtype=x.dtype)
    elif not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(
            f"out must be a contiguous CPU tensor, got device {out.device} and strides {out.stride()}"
        )
    return out, to_dlpack(out.detach())


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    group_size: int,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = x @ dequant(qweight, scales, offsets).T (+ bias)``; returns ``out`` (allocated when None)."""
    if _cuda(x):
        return _cuda_call("w4a16_gemm", x, qweight.shape[0], out, qweight, scales, offsets, group_size, bias)
    if x.device.type != "cpu":
        return reference.w4a16_gemm(x, qweight, scales, offsets, group_size, out=out, bias=bias)
    out, out_cap = _out(out, x, qweight.shape[0])
    _C.w4a16_gemm(
        _cap(x),
        _cap(qweight),
        _cap(scales),
        None if offsets is None else _cap(offsets),
        group_size,
        out_cap,
        None if bias is None else _cap(bias),
        torch.get_num_threads(),
    )
    return out


def w8a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = x @ (scales * qweight).T (+ bias)`` with int8 ``qweight``; returns ``out``. A
    ``torch.float8_e4m3fn`` ``qweight`` (an FP8 checkpoint's weight) runs the same kernels with its
    bytes converted exactly in registers (CPU and CUDA)."""
    fp8 = qweight.dtype == torch.float8_e4m3fn
    if _cuda(x):
        if fp8:
            q = qweight.view(torch.int8)
            return _cuda_call("w8a16_fp8_gemm", x, qweight.shape[0], out, q, scales, group_size, bias)
        return _cuda_call("w8a16_gemm", x, qweight.shape[0], out, qweight, scales, group_size, bias)
    if x.device.type != "cpu":
        return reference.w8a16_gemm(x, qweight, scales, group_size, out=out, bias=bias)
    out, out_cap = _out(out, x, qweight.shape[0])
    _C.w8a16_gemm(
        _cap(x),
        _cap(qweight.view(torch.int8) if fp8 else qweight),
        _cap(scales),
        group_size,
        out_cap,
        None if bias is None else _cap(bias),
        torch.get_num_threads(),
        fp8,
    )
    return out


class _ImportedWeight:
    """A C++ weight object (``self._w``, output features ``self.n``) called on x: ``weight(x, out=None)``
    multiplies a contiguous CPU ``x [M, K]`` into ``out [M, N]`` (allocated when None)."""

    _w: object
    n: int

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out, out_cap = _out(out, x, self.n)
        self._w.gemm(_cap(x), out_cap, torch.get_num_threads())
        return out


class W4A16Weight(_ImportedWeight):
    """int4 weights validated and imported once (CPU); ``weight(x, out=None)`` is :func:`w4a16_gemm`.

    The tensors' memory stays alive with this object and in-place changes to them are seen; build a new
    one after replacing them (e.g. moving them to another device).
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor | None,
        group_size: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        self._w = _C.W4A16Weight(
            _cap(qweight),
            _cap(scales),
            None if offsets is None else _cap(offsets),
            group_size,
            None if bias is None else _cap(bias),
        )
        self.n, self.k, self.group_size = self._w.n, self._w.k, group_size


class W8A16Weight(_ImportedWeight):
    """int8 (or ``float8_e4m3fn``) weights validated and imported once (CPU); ``weight(x, out=None)`` is
    :func:`w8a16_gemm`."""

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, bias: torch.Tensor | None = None
    ) -> None:
        fp8 = qweight.dtype == torch.float8_e4m3fn
        self._w = _C.W8A16Weight(
            _cap(qweight.view(torch.int8) if fp8 else qweight),
            _cap(scales),
            group_size,
            None if bias is None else _cap(bias),
            fp8,
        )
        self.n, self.k, self.group_size = self._w.n, self._w.k, group_size


def int8_mm(q: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """``q [M, K] int8 @ qweight [N, K] int8 .T`` summed exactly: ``[M, N] int32``. On a GPU through
    cuBLASLt's int8 tensor-core GEMM (``torch._int_mm``; it needs K and N multiples of 8 and, in some
    torch versions, more than 16 rows: fewer are padded with zero rows, which add nothing), else in
    float64 there (exact: ``|sum| <= 127 * 128 * K < 2**53``); on the CPU ``torch._int_mm`` (exact).
    Exact for K below 2**31 / (127 * 128) (~132 000; no model comes near)."""
    m, k = q.shape
    n = qweight.shape[0]
    if qweight.shape[1] != k:
        raise ValueError(f"int8_mm: q has K = {k}, qweight has K = {qweight.shape[1]}")
    if q.device.type == "cpu":
        return torch._int_mm(q.contiguous(), qweight.t())
    if q.is_cuda and k % 8 == 0 and n % 8 == 0 and k >= 16:
        rows = max(m, 17)
        qp = q.contiguous() if rows == m else torch.cat([q, q.new_zeros(rows - m, k)])
        return torch._int_mm(qp, qweight.t())[:m]
    return _int8_mm_float64(q, qweight)


def _int8_mm_float64(q: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    return (q.double() @ qweight.double().t()).to(torch.int32)


def w8a8_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    smooth: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A8 on any device (the GPU's path; the CPU has :class:`W8A8Weight`): x quantised per token to
    int8, :func:`int8_mm`, then ``float(sum) * (row_scale * scale) (+ bias)`` rounded once to x's
    dtype, each float operation one elementwise op as the C++ kernel orders them, so the bits equal
    the CPU kernel's and :func:`inflight.ops.reference.gemm.w8a8_gemm`'s. Every division is tensor by
    tensor: on a GPU torch turns a division by a Python scalar into a multiplication by its reciprocal,
    which can differ in the last bit."""
    xs = x.float()
    if smooth is not None:
        xs = xs * smooth.float()
    amax = xs.abs().amax(dim=-1)
    positive = amax > 0
    inv = torch.where(positive, torch.full_like(amax, 127.0) / torch.where(positive, amax, 1.0), 0.0)
    tiny = torch.isinf(inv)  # a row so small that the scale overflows counts as zero (as the CPU kernel)
    inv = torch.where(tiny, 0.0, inv)
    q = torch.round(xs * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    row_scales = torch.where(tiny, 0.0, amax / torch.full_like(amax, 127.0))
    out = int8_mm(q, qweight).float() * (row_scales.unsqueeze(1) * scales.float().unsqueeze(0))
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


class W8A8Weight(_ImportedWeight):
    """W8A8 (SmoothQuant) weights packed once for the CPU kernel: int8 ``qweight [N, K]``, fp32
    ``scales [N]`` per output channel, optional fp32 ``smooth [K]`` (multipliers of x: SmoothQuant's
    ``1 / s``) and ``bias [N]``. ``weight(x, out=None)`` quantises each row of x to int8 (its own
    scale), sums the products exactly in int32 (AVX512-VNNI where the CPU has it, else a portable
    loop: the same bits) and returns ``x``'s dtype; :func:`inflight.ops.reference.gemm.w8a8_gemm` is
    its plain-torch twin. The tensors are copied into the packed layout (not kept)."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        smooth: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        self._w = _C.W8A8Weight(
            _cap(qweight),
            _cap(scales),
            None if smooth is None else _cap(smooth),
            None if bias is None else _cap(bias),
        )
        self.n, self.k = self._w.n, self._w.k
        self.nbytes = self._w.nbytes

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors it was packed from, rebuilt exactly: ``(qweight, scales)``, int8 ``[N, K]`` and
        float32 ``[N]``."""
        qweight = torch.empty(self.n, self.k, dtype=torch.int8)
        scales = torch.empty(self.n, dtype=torch.float32)
        self._w.unpack(to_dlpack(qweight), to_dlpack(scales))
        return qweight, scales


class A8Weight(_ImportedWeight):
    """int4 or int8 weights in the W4A16 / W8A16 formats (``bits`` 4 or 8; ``offsets`` for asymmetric
    int4), packed once for the CPU's A8 GEMM: ``weight(x, out=None)`` quantises each group of 32
    elements of a row of x to int8 (16 for weights in groups of 16: GGUF Q6_K), sums each group's
    products exactly in int32 (AVX512-VNNI where the CPU has it, else a portable loop: the same bits)
    and scales them in fp32, as llama.cpp multiplies its quantised weights. A row's result depends on
    that row alone. ``act_bits=16`` (A16) quantises each group to 16-bit codes instead (held as two
    int8 limbs, each through the same integer products: ~15 bits of the group's largest value, about
    twice the int8 path's arithmetic). :func:`inflight.ops.reference.gemm.a8_gemm` is its plain-torch
    twin (to fp32 rounding). The tensors are copied into the packed layout (not kept); ``nbytes`` is its
    size."""

    def __init__(
        self,
        bits: int,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor | None,
        group_size: int,
        bias: torch.Tensor | None = None,
        act_bits: int = 8,
    ) -> None:
        self._w = _C.A8Weight(
            bits,
            _cap(qweight),
            _cap(scales),
            None if offsets is None else _cap(offsets),
            group_size,
            None if bias is None else _cap(bias),
            act_bits,
        )
        self.n, self.k, self.bits, self.group_size = self._w.n, self._w.k, bits, group_size
        self.act_bits = act_bits
        self.nbytes = self._w.nbytes
        self.asymmetric = offsets is not None

    def embed(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[i]`` = row ``ids[i]`` of an int8 weight dequantised (code x scale in fp32, rounded to
        ``out``'s dtype): a tied int8 embedding's lookup from its head's packed copy. Returns ``out``."""
        self._w.embed(_cap(ids), to_dlpack(out))
        return out

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The tensors it was packed from, rebuilt exactly: ``(qweight, scales, offsets)`` with
        ``qweight`` uint8 ``[N, K//2]`` (4-bit) or int8 ``[N, K]``, ``scales`` (and ``offsets`` for
        asymmetric int4, else None) float32 ``[N, K//group_size]`` (the values given, in fp32)."""
        n, k, g = self.n, self.k, self.k // self.group_size
        if self.bits == 4:
            qweight = torch.empty(n, k // 2, dtype=torch.uint8)
        else:
            qweight = torch.empty(n, k, dtype=torch.int8)
        scales = torch.empty(n, g, dtype=torch.float32)
        offsets = torch.empty(n, g, dtype=torch.float32) if self.asymmetric else None
        self._w.unpack(to_dlpack(qweight), to_dlpack(scales), None if offsets is None else to_dlpack(offsets))
        return qweight, scales, offsets


def dense_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = x @ weight.T (+ bias)`` (``F.linear``) for a 2-D ``x [M, K]`` and ``weight [N, K]`` of one
    dtype (fp32, bf16 or fp16); fp32 sums, ``out`` rounded once. Returns ``out`` (allocated when None).

    ``x`` may be strided (it is copied); ``weight`` must be contiguous: a per-call copy of the weights
    would cost more than the GEMM. Non-CPU tensors go to the plain-torch twin. The checks are kept to a
    few attribute reads (a decode-size call is ~10 us): the binding validates dtypes and shapes.
    """
    if not x.is_cpu:
        return reference.dense_gemm(x, weight, bias=bias, out=out)
    if not weight.is_contiguous():
        raise ValueError(
            f"weight must be contiguous (row-major [n, k]), got strides {weight.stride()} "
            f"for shape {tuple(weight.shape)}"
        )
    if out is None:
        # A non-2-D x gets the binding's message (x must be 2-D), not an IndexError here.
        out = torch.empty(x.shape[0] if x.dim() == 2 else 0, weight.shape[0], dtype=x.dtype)
        out_cap = to_dlpack(out)
    else:
        out, out_cap = _out(out, x, weight.shape[0])
    _C.dense_gemm(
        _cap(x), _cap(weight), None if bias is None else _cap(bias), out_cap, torch.get_num_threads()
    )
    return out
