"""Native llama-family models (Llama 2/3, Mistral, Qwen2/3, Gemma 3, SmolLM2, TinyLlama, Mixtral,
Qwen3-MoE) and their one loader."""

from __future__ import annotations

from inflight.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from inflight.models.llama import LlamaForCausalLM
from inflight.models.loader import LoadedModel, load_model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "load_model",
]
