"""Kernels: typed wrappers over the C++ (CPU) and CUDA implementations.

Plain-torch twins of every op live in :mod:`inflight.ops.reference`.
"""

from __future__ import annotations

from inflight._C import cpu_best_isa, cpu_isa, set_cpu_isa
from inflight.ops.attention import context_attention, paged_attention, store_kv
from inflight.ops.gemm import dense_gemm, w4a16_gemm, w8a16_gemm
from inflight.ops.sampling import sample, sampling_uniform

__all__ = [
    "context_attention",
    "cpu_best_isa",
    "cpu_isa",
    "dense_gemm",
    "paged_attention",
    "sample",
    "sampling_uniform",
    "set_cpu_isa",
    "store_kv",
    "w4a16_gemm",
    "w8a16_gemm",
]
