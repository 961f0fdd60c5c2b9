"""Kernels: typed wrappers over the C++ (CPU) and CUDA implementations.

Plain-torch twins of every op live in :mod:`inflight.ops.reference`.
"""

from __future__ import annotations

from inflight._C import batch_invariant, cpu_best_isa, cpu_features, cpu_isa, set_batch_invariant, set_cpu_isa
from inflight.ops.attention import context_attention, paged_attention, store_kv
from inflight.ops.gemm import dense_gemm, w4a16_gemm, w8a16_gemm
from inflight.ops.sampling import sample, sampling_uniform


def cpu_info() -> dict:
    """The CPU as the kernels see it: vendor, brand string (``model``), family / model / stepping, the
    feature flags (``amx_tile`` / ``amx_bf16`` / ``amx_int8`` only when Linux granted this process the
    tile state; ``amx_cpu`` when CPUID alone has AMX), the ISA the kernels run (``isa``, which
    ``INFLIGHT_CPU_ISA`` or :func:`set_cpu_isa` may lower), the best one (``best_isa``) and whether the
    kernels are batch-invariant (``batch_invariant``: ``INFLIGHT_BATCH_INVARIANT``, :func:`set_batch_invariant`)."""
    return {
        **cpu_features(),
        "isa": cpu_isa(),
        "best_isa": cpu_best_isa(),
        "batch_invariant": batch_invariant(),
    }


def describe_cpu() -> str:
    """One line for benchmark headers: brand, vendor, ISA in use and the extensions of note."""
    info = cpu_info()
    extras = [
        name for name in ("avx512bf16", "avx512vnni", "avx512fp16", "amx_bf16", "amx_int8") if info.get(name)
    ]
    if info.get("amx_cpu") and not info.get("amx_tile"):
        extras.append("AMX present but not granted")
    mode = "" if info["batch_invariant"] else ", not batch-invariant"
    return (
        f"{info['model'] or '?'} ({info['vendor'] or '?'}), kernels {info['isa']}{mode}, "
        f"{' '.join(extras) or 'no extensions'}"
    )


__all__ = [
    "batch_invariant",
    "context_attention",
    "cpu_best_isa",
    "cpu_features",
    "cpu_info",
    "cpu_isa",
    "dense_gemm",
    "describe_cpu",
    "paged_attention",
    "sample",
    "sampling_uniform",
    "set_batch_invariant",
    "set_cpu_isa",
    "store_kv",
    "w4a16_gemm",
    "w8a16_gemm",
]
