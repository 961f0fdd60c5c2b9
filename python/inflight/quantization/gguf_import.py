"""GGUF block formats -> the canonical W4A16 / W8A16 layout, by repacking (never dequantise-requantise).

llama.cpp's blocks hold 32 consecutive weights of a row:

- Q4_0 (18 bytes): fp16 ``d``, then 16 bytes whose low nibbles are elements 0..15 and high nibbles
  elements 16..31; ``w = d * (q - 8)``  ->  symmetric W4A16, group 32, ``scales = d``.
- Q4_1 (20 bytes): fp16 ``d``, fp16 ``m``, 16 bytes as in Q4_0; ``w = d * q + m``
  ->  asymmetric W4A16, group 32, ``scales = d``, ``offsets = m`` (fp16, bit for bit).
- Q8_0 (34 bytes): fp16 ``d``, 32 int8; ``w = d * q``  ->  W8A16, group 32, ``scales = d``.

The integers and fp16 scales are moved, not recomputed, so :func:`inflight.ops.reference.gemm.dequantize_w4`
/ ``dequantize_w8`` of the result equal ``gguf.quants.dequantize`` of the block data exactly (the
products ``d * q`` are exact in fp32). Inputs are the raw bytes as ``gguf.GGUFReader`` exposes them:
``uint8 [rows, blocks_per_row * block_bytes]``.
"""

from __future__ import annotations

import numpy as np
import torch

from inflight.quantization.w4a16 import pack_int4

__all__ = ["GGUF_BLOCK", "q4_0_offsets", "q4_0_to_w4a16", "q4_1_to_w4a16", "q8_0_to_w8a16"]

GGUF_BLOCK = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _blocks(data: np.ndarray, kind: str) -> np.ndarray:
    data = np.ascontiguousarray(np.asarray(data, dtype=np.uint8))
    if data.ndim != 2 or data.shape[1] % _BLOCK_BYTES[kind] != 0:
        raise ValueError(f"{kind} data must be uint8 [rows, blocks * {_BLOCK_BYTES[kind]}], got {data.shape}")
    return data.reshape(data.shape[0], -1, _BLOCK_BYTES[kind])


def _fp16(raw: np.ndarray) -> torch.Tensor:
    """[rows, blocks, 2] bytes -> fp16 [rows, blocks], bit for bit."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].copy())


def _repack_nibbles(qs: np.ndarray) -> torch.Tensor:
    """GGUF [rows, blocks, 16] (element j low, j+16 high) -> canonical [rows, blocks * 16]."""
    rows, nblk, _ = qs.shape
    q = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # [rows, blocks, 32], elements in order
    return pack_int4(torch.from_numpy(q.reshape(rows, nblk * GGUF_BLOCK)))


def q4_0_to_w4a16(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 rows -> ``(qweight uint8 [rows, K//2], scales fp16 [rows, K//32])`` (symmetric)."""
    b = _blocks(data, "Q4_0")
    return _repack_nibbles(b[..., 2:]), _fp16(b[..., 0:2])


def q4_1_to_w4a16(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows -> ``(qweight, scales fp16, offsets fp16)`` (asymmetric, value-space offset)."""
    b = _blocks(data, "Q4_1")
    return _repack_nibbles(b[..., 4:]), _fp16(b[..., 0:2]), _fp16(b[..., 2:4])


def q8_0_to_w8a16(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows -> ``(qweight int8 [rows, K], scales fp16 [rows, K//32])``."""
    b = _blocks(data, "Q8_0")
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(b.shape[0], -1)
    return torch.from_numpy(q.copy()), _fp16(b[..., 0:2])


def q4_0_offsets(scales: torch.Tensor) -> torch.Tensor:
    """Offsets that make a symmetric (Q4_0) tensor asymmetric: ``-8 * d`` (exact in fp16: a power of two)."""
    return scales * -8.0
