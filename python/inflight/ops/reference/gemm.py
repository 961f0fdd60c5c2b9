"""Plain-torch twins of :mod:`inflight.ops.gemm`: dequantise the whole weight (fp32), then matmul (dense
weights are only widened to fp32).

They define the numerics the kernels are tested against, and serve devices without a kernel.
"""

from __future__ import annotations

import torch

__all__ = [
    "a8_gemm",
    "dense_gemm",
    "dequantize_w4",
    "dequantize_w8",
    "quantize_a8_activations",
    "quantize_w8a8_activations",
    "unpack_int4",
    "w4a16_gemm",
    "w8a8_gemm",
    "w8a16_gemm",
]


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """``[N, K//2] uint8 -> [N, K] uint8`` in 0..15 (low nibble = even k, high nibble = odd k)."""
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(
            f"qweight must be a 2-D uint8 tensor, got {qweight.dtype} of shape {tuple(qweight.shape)}"
        )
    q = torch.stack((qweight & 0x0F, qweight >> 4), dim=-1)
    return q.reshape(qweight.shape[0], qweight.shape[1] * 2)


def _group_view(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[int, int, int]:
    n, k = q.shape
    if group_size < 1 or k % group_size != 0:
        raise ValueError(f"group_size must divide k ({k}), got {group_size}")
    if tuple(scales.shape) != (n, k // group_size):
        raise ValueError(f"scales must have shape {(n, k // group_size)}, got {tuple(scales.shape)}")
    return n, k, k // group_size


def dequantize_w4(
    qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """fp32 ``[N, K]``: ``scale * q + offset``, or ``scale * (q - 8)`` when ``offsets`` is None."""
    q = unpack_int4(qweight).to(torch.float32)
    n, k, g = _group_view(q, scales, group_size)
    q = q.view(n, g, group_size)
    s = scales.to(torch.float32).unsqueeze(-1)
    if offsets is None:
        w = s * (q - 8.0)
    else:
        if tuple(offsets.shape) != tuple(scales.shape):
            raise ValueError(f"offsets must have shape {tuple(scales.shape)}, got {tuple(offsets.shape)}")
        w = s * q + offsets.to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k)


def dequantize_w8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 ``[N, K]``: ``scale * q`` for int8 (or ``float8_e4m3fn``) ``qweight [N, K]``."""
    if qweight.dtype not in (torch.int8, torch.float8_e4m3fn) or qweight.dim() != 2:
        raise ValueError(
            f"qweight must be a 2-D int8 or float8_e4m3fn tensor, got {qweight.dtype} of shape "
            f"{tuple(qweight.shape)}"
        )
    n, k, g = _group_view(qweight, scales, group_size)
    w = qweight.to(torch.float32).view(n, g, group_size) * scales.to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k)


def _linear_fp32(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None
) -> torch.Tensor:
    y = x.to(torch.float32) @ w.to(x.device).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    group_size: int,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return _linear_fp32(x, dequantize_w4(qweight, scales, offsets, group_size), bias, out)


def w8a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return _linear_fp32(x, dequantize_w8(qweight, scales, group_size), bias, out)


def dense_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in fp32, rounded once to ``x``'s dtype (or written into ``out``)."""
    return _linear_fp32(x, weight.to(torch.float32), bias, out)


def quantize_w8a8_activations(
    x: torch.Tensor, smooth: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's per-token quantisation: ``(q [M, K] int8, row_scales [M] fp32)`` with
    ``xs = x * smooth``, ``row_scale = max|xs| / 127`` and ``q = round_half_even(xs * (127 / max|xs|))``
    (q = 0 for an all-zero row; q = 0 and row_scale = 0 for one so small that 127 / max|xs| overflows), the
    float operations the C++ kernel does, in its order."""
    xs = x.float()
    if smooth is not None:
        xs = xs * smooth.float()
    amax = xs.abs().amax(dim=-1)
    # A tensor divided by a tensor: torch's scalar / tensor multiplies by a reciprocal (off by an ulp).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    tiny = torch.isinf(inv)  # a row so small that the scale overflows counts as zero
    inv = torch.where(tiny, torch.zeros_like(inv), inv)
    q = torch.round(xs * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q, torch.where(tiny, torch.zeros_like(amax), amax / 127.0)


def w8a8_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    smooth: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ (scales[:, None] * qweight).T (+ bias)`` with x quantised per token to int8 first
    (:func:`quantize_w8a8_activations`), the products summed exactly (int64 here), then
    ``float(sum) * (row_scale * scale) (+ bias)`` rounded once to x's dtype: bit for bit what the
    C++ W8A8 kernel returns."""
    q, row_scales = quantize_w8a8_activations(x, smooth)
    acc = (q.to(torch.int64) @ qweight.to(torch.int64).T).to(torch.float32)
    out = acc * (row_scales.unsqueeze(1) * scales.float().unsqueeze(0))
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def a8_group(group_size: int) -> int:
    """The A8 kernels' activation group for weights in groups of ``group_size``: 16 for groups of 16
    (GGUF Q6_K), else 32."""
    return 16 if group_size == 16 else 32


A16_MAX = 32512  # A16's largest code (127 * 256): its high int8 limb stays within [-127, 127]


def quantize_a8_activations(
    x: torch.Tensor, group: int = 32, act_bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """The A8 GEMM's activations: ``(q [M, K], d [M, K // group] fp32)`` with, per group of ``group``
    elements of a row, ``d = max|x| / Q`` and ``q = round_half_even(x * (Q / max|x|))`` (0 for an
    all-zero group, and q = 0, d = 0 for one so small that Q / max|x| overflows): the float operations of the C++ kernels, in their order. ``act_bits`` 8: Q = 127,
    q int8; 16 (A16): Q = :data:`A16_MAX`, q int16 (the kernels hold it as two int8 limbs)."""
    if act_bits not in (8, 16):
        raise ValueError(f"act_bits must be 8 or 16, got {act_bits!r}")
    m, k = x.shape
    if k % group != 0:
        raise ValueError(f"x.shape[1] ({k}) must be a multiple of the activation group ({group})")
    qmax = 127.0 if act_bits == 8 else float(A16_MAX)
    xg = x.float().view(m, k // group, group)
    amax = xg.abs().amax(dim=-1, keepdim=True)
    # A tensor divided by a tensor: torch's scalar / tensor multiplies by a reciprocal (off by an ulp).
    inv = torch.where(amax > 0, torch.full_like(amax, qmax) / amax, torch.zeros_like(amax))
    tiny = torch.isinf(inv)  # amax so small that the scale overflows: the group counts as zero
    inv = torch.where(tiny, torch.zeros_like(inv), inv)
    q = torch.round(xg * inv).clamp(-qmax, qmax).to(torch.int8 if act_bits == 8 else torch.int16)
    d = torch.where(tiny, torch.zeros_like(amax), amax / qmax)
    return q.view(m, k), d.squeeze(-1)


def a8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    act_bits: int = 8,
) -> torch.Tensor:
    """The A8 (``act_bits=8``) or A16 GEMM's numerics in plain torch: ``x`` quantised per group
    (:func:`quantize_a8_activations`, group :func:`a8_group`), multiplied by the dequantised ``weight [N, K]`` (fp32, e.g.
    :func:`dequantize_w4`) in float64, ``+ bias``, rounded once to x's dtype. The kernels sum each
    group's integer products exactly and scale them in fp32, so they agree with this to fp32 rounding
    (not bit for bit: their per-group fp32 multiply-adds round)."""
    q, d = quantize_a8_activations(x, a8_group(group_size), act_bits)
    g = a8_group(group_size)
    xq = (q.view(q.shape[0], -1, g).double() * d.double().unsqueeze(-1)).view(q.shape)
    out = xq @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
