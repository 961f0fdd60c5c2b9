"""inflight: an LLM inference runtime (a C++ batch manager bound through nanobind, a Python executor)."""

from __future__ import annotations

from inflight import _C  # noqa: F401  (fails loudly here if the native module is missing)
from inflight.cuda import cuda_available

__version__ = "0.1.0"

__all__ = ["__version__", "cuda_available"]
