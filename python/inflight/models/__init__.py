"""Native llama-family models (Llama 2/3, Mistral, Qwen2, SmolLM2, TinyLlama) and their loaders."""

from __future__ import annotations

from inflight.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from inflight.models.llama import LlamaForCausalLM
from inflight.models.loader import iter_safetensors, load_hf_model, resolve_dtype

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelConfig",
    "iter_safetensors",
    "load_hf_model",
    "resolve_dtype",
]
