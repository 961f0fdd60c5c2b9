"""Kernels: typed wrappers over the C++ (CPU) and CUDA implementations.

Plain-torch twins of every op live in :mod:`inflight.ops.reference`.
"""

from __future__ import annotations

from inflight._C import cpu_best_isa, cpu_isa, set_cpu_isa

__all__ = ["cpu_best_isa", "cpu_isa", "set_cpu_isa"]
