"""``load_model``: what ``LLM(model=...)`` accepts, resolved to a model, its config and tokenizer."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inflight.models.config import ModelConfig

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Any  # a transformers tokenizer, or None (token-id prompts only)
    dtype: torch.dtype


def make_attention_backend(name: str):
    if name == "torch":
        from inflight.layers.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"attention_backend must be 'torch', got {name!r}")


def auto_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    """The checkpoint's dtype; on a CPU float16 becomes bfloat16 (CPU float16 matmuls are slow)."""
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = names.get(config.checkpoint_dtype or "float32", torch.float32)
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.bfloat16
    return dtype


def load_tokenizer(path: Path):
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_model(model: str | os.PathLike, *, dtype: torch.dtype | None, device: torch.device,
               attention_backend: str, max_seq_len: int | None) -> LoadedModel:
    """``model``: a Hugging Face model directory, a ``.gguf`` file, or a known short name
    (``smollm2``). ``dtype`` None means auto."""
    from inflight.models import gguf_loader
    from inflight.models.llama import LlamaForCausalLM
    from inflight.models.loader import iter_safetensors

    known = gguf_loader.resolve_known_model(str(model)) if isinstance(model, str) else None
    path = known if known is not None else Path(os.fspath(model)).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        reader, config = gguf_loader.read_gguf(path)
        # Dequantised weights: bfloat16 by default (the fp32 copy is twice the memory traffic).
        dtype = dtype if dtype is not None else (torch.bfloat16 if device.type == "cpu" else torch.float16)
        weights = gguf_loader.iter_gguf_tensors(reader, config, dtype)
        tokenizer_fn = lambda: gguf_loader.load_gguf_tokenizer(path)  # noqa: E731
    elif path.is_dir():
        config = ModelConfig.from_hf_dir(path)
        dtype = dtype if dtype is not None else auto_dtype(config, device)
        weights = iter_safetensors(path)
        tokenizer_fn = lambda: load_tokenizer(path)  # noqa: E731
    else:
        raise ValueError(
            f"model must be a Hugging Face model directory, a .gguf file or one of "
            f"{sorted(gguf_loader.KNOWN_MODELS)}, got {str(model)!r}"
        )
    config.check_max_seq_len(max_seq_len if max_seq_len is not None else config.max_position_embeddings)
    backend = make_attention_backend(attention_backend)
    net = LlamaForCausalLM(config, dtype, backend, max_seq_len=max_seq_len, device=device)
    net.load_weights(weights)
    net.eval()
    return LoadedModel(net, config, tokenizer_fn(), dtype)
