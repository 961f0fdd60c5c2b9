"""W4A16 round-to-nearest quantisation and the int4 packing of the canonical layout.

Layout (see :mod:`inflight.ops.gemm`): ``qweight [N, K//2] uint8`` with ``k = 2j`` in the low nibble
of byte ``j`` and ``k = 2j+1`` in the high nibble; ``scales`` / ``offsets [N, K//group_size]``.

- asymmetric (GGUF Q4_1's scheme): per group ``scale = (max - min) / 15``, ``offset = min``,
  ``q = round((w - offset) / scale)`` in 0..15, ``w ~ scale * q + offset``;
- symmetric (GGUF Q4_0's scheme): ``scale = m / -8`` where ``m`` is the group's value of largest
  magnitude (so it maps exactly to ``q = 0``), ``q = round(w / scale) + 8`` in 0..15,
  ``w ~ scale * (q - 8)``.

``q`` is computed from the scale and offset *after* rounding them to ``scale_dtype``, so the stored
integers are the best ones for the stored scales.
"""

from __future__ import annotations

import torch

from inflight.ops.reference.gemm import dequantize_w4, dequantize_w8, unpack_int4

__all__ = [
    "GROUP_SIZES",
    "QUANT_METHOD",
    "W8_GROUP_SIZES",
    "dequantize_w4",
    "dequantize_w8",
    "pack_int4",
    "quantize_w4",
    "quantize_w8",
    "unpack_int4",
]

GROUP_SIZES = (32, 64, 128)
# int8 weights also run with groups of 16 (GGUF Q6_K's sub-blocks; see gguf_import).
W8_GROUP_SIZES = (16,) + GROUP_SIZES
# The quantization_config["quant_method"] of a checkpoint written by quantize_checkpoint.
QUANT_METHOD = "inflight_w4a16"
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[N, K] uint8`` values in 0..15 -> ``[N, K//2] uint8`` (even k low nibble, odd k high)."""
    if q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] % 2 != 0:
        raise ValueError(
            f"q must be a 2-D uint8 tensor with an even number of columns, got {q.dtype} "
            f"of shape {tuple(q.shape)}"
        )
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"q values must be in 0..15, got a maximum of {int(q.max())}")
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _check(
    w: torch.Tensor, group_size: int, scale_dtype: torch.dtype, allowed: tuple[int, ...] = GROUP_SIZES
) -> None:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D floating-point tensor, got {w.dtype} of shape {tuple(w.shape)}")
    if group_size not in allowed:
        raise ValueError(f"group_size must be one of {allowed}, got {group_size!r}")
    if w.shape[1] % group_size != 0:
        raise ValueError(f"w.shape[1] ({w.shape[1]}) must be a multiple of group_size ({group_size})")
    if scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {[str(d) for d in _SCALE_DTYPES]}, got {scale_dtype}")


@torch.no_grad()
def quantize_w4(
    w: torch.Tensor,
    group_size: int = 128,
    symmetric: bool = False,
    scale_dtype: torch.dtype = torch.float16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest int4 of ``w [N, K]``: ``(qweight [N, K//2] uint8, scales, offsets or None)``."""
    _check(w, group_size, scale_dtype)
    n, k = w.shape
    g = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    if symmetric:
        idx = g.abs().argmax(dim=-1, keepdim=True)
        scale = (g.gather(-1, idx) / -8.0).to(scale_dtype)
        s = scale.to(torch.float32)
        inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
        q = torch.round(g * inv) + 8.0
        offsets = None
    else:
        lo = g.amin(dim=-1, keepdim=True)
        hi = g.amax(dim=-1, keepdim=True)
        scale = ((hi - lo) / 15.0).to(scale_dtype)
        offset = lo.to(scale_dtype)
        s = scale.to(torch.float32)
        inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
        q = torch.round((g - offset.to(torch.float32)) * inv)
        offsets = offset.reshape(n, k // group_size).contiguous()
    q = q.clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return pack_int4(q), scale.reshape(n, k // group_size).contiguous(), offsets


@torch.no_grad()
def quantize_w8(
    w: torch.Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric int8 (GGUF Q8_0's scheme): ``(qweight [N, K] int8, scales)``."""
    _check(w, group_size, scale_dtype, W8_GROUP_SIZES)
    n, k = w.shape
    g = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    scale = (g.abs().amax(dim=-1, keepdim=True) / 127.0).to(scale_dtype)
    s = scale.to(torch.float32)
    inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
    q = torch.round(g * inv).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return q, scale.reshape(n, k // group_size).contiguous()
