"""GGUF block formats -> the canonical W4A16 / W8A16 layout, by repacking (never dequantise-requantise).

llama.cpp's blocks hold 32 consecutive weights of a row:

- Q4_0 (18 bytes): fp16 ``d``, then 16 bytes whose low nibbles are elements 0..15 and high nibbles
  elements 16..31; ``w = d * (q - 8)``  ->  symmetric W4A16, group 32, ``scales = d``.
- Q4_1 (20 bytes): fp16 ``d``, fp16 ``m``, 16 bytes as in Q4_0; ``w = d * q + m``
  ->  asymmetric W4A16, group 32, ``scales = d``, ``offsets = m`` (fp16, bit for bit).
- Q8_0 (34 bytes): fp16 ``d``, 32 int8; ``w = d * q``  ->  W8A16, group 32, ``scales = d``.
- Q5_0 (22 bytes): fp16 ``d``, 32 high bits (bit j: element j), 16 bytes of low nibbles as in Q4_0;
  ``w = d * (q - 16)``  ->  W8A16, group 32, ``qweight = q - 16`` (in -16..15), ``scales = d``.

The K-quants hold 256 weights per block with a second level of scales:

- Q4_K (144 bytes): fp16 ``d``, fp16 ``dmin``, 12 bytes packing eight 6-bit scales ``sc`` and mins
  ``m`` (one per 32 weights), 128 bytes of nibbles (each 32 bytes: low nibbles one sub-block, high
  nibbles the next); ``w = (d * sc) * q - dmin * m``  ->  asymmetric W4A16, group 32, fp32
  ``scales = d * sc`` and ``offsets = -(dmin * m)``: both products are exact in fp32 (11 x 6 bits), so
  the two-level scales fold into per-32 ones without changing a weight.
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit highs, sixteen int8 scales ``sc``
  (one per 16 weights), fp16 ``d``; ``w = (d * sc) * (q - 32)``  ->  W8A16, group 16, ``qweight =
  q - 32`` (in -32..31), fp32 ``scales = d * sc`` (exact: 11 x 8 bits).

The integers and fp16 scales are moved, not recomputed, so :func:`inflight.ops.reference.gemm.dequantize_w4`
/ ``dequantize_w8`` of the result equal ``gguf.quants.dequantize`` of the block data exactly (the
products ``d * q`` are exact in fp32). Inputs are the raw bytes as ``gguf.GGUFReader`` exposes them:
``uint8 [rows, blocks_per_row * block_bytes]``.
"""

from __future__ import annotations

import numpy as np
import torch

from inflight.quantization.w4a16 import pack_int4

__all__ = [
    "GGUF_BLOCK",
    "q4_0_offsets",
    "q4_0_to_w4a16",
    "q4_1_to_w4a16",
    "q4_k_to_w4a16",
    "q5_0_to_w8a16",
    "q6_k_to_w8a16",
    "q8_0_to_w8a16",
]

GGUF_BLOCK = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q4_K": 144, "Q6_K": 210}


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


def q5_0_to_w8a16(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 rows -> ``(qweight int8 [rows, K] in -16..15, scales fp16 [rows, K//32])``."""
    b = _blocks(data, "Q5_0")
    rows, nblk, _ = b.shape
    high = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [rows, blocks, 1]: bit j is element j's 5th bit
    high = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [rows, blocks, 32]
    qs = b[..., 6:]
    low = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # elements 0..15 low nibbles, 16..31 high
    q = (low | (high << 4)).astype(np.int8) - np.int8(16)
    return torch.from_numpy(q.reshape(rows, nblk * GGUF_BLOCK)), _fp16(b[..., 0:2])


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes per block -> (eight 6-bit scales, eight 6-bit mins), uint8 [..., 8].
    Bytes 0-3: scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7: the same for the
    mins; bytes 8-11: the low 4 bits of scale (low nibble) and min (high nibble) 4-7."""
    a, m, lo = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate((a & 0x3F, (lo & 0x0F) | ((a >> 6) << 4)), axis=-1)
    mins = np.concatenate((m & 0x3F, (lo >> 4) | ((m >> 6) << 4)), axis=-1)
    return scales, mins


def q4_k_to_w4a16(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows -> ``(qweight uint8 [rows, K//2], scales fp32 [rows, K//32], offsets fp32)``."""
    b = _blocks(data, "Q4_K")
    rows, nblk, _ = b.shape
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16).astype(np.float32)  # [rows, blocks, 1]
    dmin = np.ascontiguousarray(b[..., 2:4]).view(np.float16).astype(np.float32)
    sc, mn = _k_scales_mins(b[..., 4:16])
    scales = d * sc.astype(np.float32)  # [rows, blocks, 8], exact
    offsets = -(dmin * mn.astype(np.float32))
    qs = b[..., 16:].reshape(rows, nblk, 4, 1, 32)
    q = np.concatenate((qs & 0x0F, qs >> 4), axis=-2)  # [rows, blocks, 4, 2, 32]: sub-block 2c, 2c + 1
    q = torch.from_numpy(np.ascontiguousarray(q).reshape(rows, nblk * 256))
    return (
        pack_int4(q),
        torch.from_numpy(np.ascontiguousarray(scales).reshape(rows, nblk * 8)),
        torch.from_numpy(np.ascontiguousarray(offsets).reshape(rows, nblk * 8)),
    )


def q6_k_to_w8a16(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K rows -> ``(qweight int8 [rows, K] in -32..31, scales fp32 [rows, K//16])`` (group 16)."""
    b = _blocks(data, "Q6_K")
    rows, nblk, _ = b.shape
    # Each half block (128 weights): 64 bytes of low nibbles (weights 0-63 low, 64-127 high) and 32
    # bytes of 2-bit highs (bits 2i..2i+1 of byte j: weight 32 i + j).
    ql = b[..., 0:128].reshape(rows, nblk, 2, 1, 64)
    low = np.concatenate((ql & 0x0F, ql >> 4), axis=-2).reshape(rows, nblk, 2, 128)
    qh = b[..., 128:192].reshape(rows, nblk, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03  # [rows, blocks, 2, 4, 32]
    q = (low | (high.reshape(rows, nblk, 2, 128) << 4)).astype(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)  # [rows, blocks, 16]
    d = np.ascontiguousarray(b[..., 208:210]).view(np.float16).astype(np.float32)
    scales = d * sc
    return (
        torch.from_numpy(np.ascontiguousarray(q).reshape(rows, nblk * 256)),
        torch.from_numpy(np.ascontiguousarray(scales).reshape(rows, nblk * 16)),
    )
