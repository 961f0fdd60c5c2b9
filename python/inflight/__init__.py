"""inflight: an LLM inference runtime (a C++ batch manager bound through nanobind, a Python executor)."""

from __future__ import annotations

from inflight import _C  # noqa: F401  (fails loudly here if the native module is missing)
from inflight.cuda import cuda_available
from inflight.llm import LLM, RequestError
from inflight.llm_args import KvCacheConfig, LlmArgs, SchedulerConfig, SpeculativeConfig
from inflight.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from inflight.request_handle import RequestHandle
from inflight.sampling_params import BeamSearchParams, GuidedDecodingParams, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "GuidedDecodingParams",
    "KvCacheConfig",
    "LlmArgs",
    "RequestError",
    "RequestHandle",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "SpeculativeConfig",
    "__version__",
    "cuda_available",
]
