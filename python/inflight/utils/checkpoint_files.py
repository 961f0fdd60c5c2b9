"""Reading a Hugging Face checkpoint directory's safetensors files, one tensor at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


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
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, f.get_tensor(name)
