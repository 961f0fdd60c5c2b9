"""Weight quantisation: W4A16 round-to-nearest (tensors and whole checkpoints), SmoothQuant W8A8
checkpoints, int4 packing, GGUF import."""

from __future__ import annotations

from inflight.quantization.checkpoint import quantize_checkpoint
from inflight.quantization.gguf_import import q4_0_to_w4a16, q4_1_to_w4a16, q8_0_to_w8a16
from inflight.quantization.smoothquant import W8A8_METHOD, quantize_smoothquant
from inflight.quantization.w4a16 import (
    GROUP_SIZES,
    dequantize_w4,
    dequantize_w8,
    pack_int4,
    quantize_w4,
    quantize_w8,
    unpack_int4,
)

__all__ = [
    "GROUP_SIZES",
    "W8A8_METHOD",
    "dequantize_w4",
    "dequantize_w8",
    "pack_int4",
    "q4_0_to_w4a16",
    "q4_1_to_w4a16",
    "q8_0_to_w8a16",
    "quantize_checkpoint",
    "quantize_smoothquant",
    "quantize_w4",
    "quantize_w8",
    "unpack_int4",
]
