"""Load a Hugging Face model directory (config.json + safetensors, single file or sharded index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from inflight.layers.attention import AttentionBackend
from inflight.models.config import ModelConfig
from inflight.models.llama import SUPPORTED_DTYPES, LlamaForCausalLM

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str, config: ModelConfig) -> torch.dtype:
    """``"auto"`` -> the checkpoint's dtype (float32 when it names none); names as in the LLM API."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        resolved = _DTYPE_NAMES.get(config.checkpoint_dtype or "float32", torch.float32)
    elif dtype in _DTYPE_NAMES:
        resolved = _DTYPE_NAMES[dtype]
    else:
        raise ValueError(
            f"dtype must be 'auto', one of {sorted(_DTYPE_NAMES)} or a torch.dtype, got {dtype!r}"
        )
    if resolved not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, got {resolved}")
    return resolved


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those of ``model.safetensors.index.json``, else all ``*.safetensors``."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(
                    f"shard {file.name!r} named by {index.name} is missing in {str(path)!r}"
                )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {others}: only safetensors weights are supported)" if others else ""
        raise FileNotFoundError(f"no *.safetensors weights in {str(path)!r}{hint}")
    return files


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` pairs one tensor at a time, so peak memory stays ~one tensor above the model."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, f.get_tensor(name)


def load_hf_model(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    attention_backend: AttentionBackend | None = None,
    max_seq_len: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build and load the model of a HF directory; raises ValueError for anything unsupported."""
    config = ModelConfig.from_hf_dir(path)
    resolved = resolve_dtype(dtype, config)
    model = LlamaForCausalLM(config, resolved, attention_backend, max_seq_len=max_seq_len, device=device)
    model.load_weights(iter_safetensors(path))
    model.eval()
    return model, config
