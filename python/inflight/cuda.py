"""Lazy access to the CUDA extension module.

`inflight._C_cuda` is linked against the static CUDA runtime, so importing it needs no libcudart and
no driver; it exists only when the package was built with a CUDA compiler. Nothing here is imported
by `import inflight` beyond this file, and nothing here touches the GPU until asked.
"""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def cuda_module() -> ModuleType | None:
    """The compiled CUDA module, or None when the package was built without CUDA."""
    try:
        from inflight import _C_cuda
    except ImportError:
        return None
    return _C_cuda


def cuda_compiled() -> bool:
    """True when the CUDA kernels were compiled into this installation."""
    return cuda_module() is not None


def cuda_available() -> bool:
    """True when the CUDA kernels were compiled in and a CUDA device is usable (driver present)."""
    mod = cuda_module()
    return mod is not None and mod.device_count() > 0


def require_cuda_module() -> ModuleType:
    """The CUDA module; RuntimeError saying why when it cannot be used."""
    mod = cuda_module()
    if mod is None:
        raise RuntimeError(
            "inflight was built without CUDA kernels (no CUDA compiler at build time, or "
            "INFLIGHT_ENABLE_CUDA=OFF); rebuild with nvcc on PATH to use them"
        )
    if mod.device_count() == 0:
        raise RuntimeError("no CUDA device is available (no NVIDIA driver or GPU on this machine)")
    return mod
