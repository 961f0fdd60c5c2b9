"""Plain-torch twins of every op in :mod:`inflight.ops` (the references the kernels are tested against)."""

from __future__ import annotations

from inflight.ops.reference.attention import context_attention, paged_attention, store_kv
from inflight.ops.reference.gemm import dense_gemm, dequantize_w4, dequantize_w8, w4a16_gemm, w8a16_gemm
from inflight.ops.reference.sampling import sample, sampling_uniform

__all__ = [
    "context_attention",
    "dense_gemm",
    "dequantize_w4",
    "dequantize_w8",
    "paged_attention",
    "sample",
    "sampling_uniform",
    "store_kv",
    "w4a16_gemm",
    "w8a16_gemm",
]
