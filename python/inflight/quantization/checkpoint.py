"""``inflight quantize``: a round-to-nearest W4A16 copy of a Hugging Face llama-family checkpoint.

The writer knows the checkpoint's tensor names, not the model: whether the runtime supports the
architecture is checked by the caller (the ``inflight quantize`` command validates the config with
:class:`inflight.models.config.ModelConfig` first), so this package never imports ``inflight.models``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from inflight.quantization.w4a16 import GROUP_SIZES, QUANT_METHOD, quantize_w4
from inflight.utils.checkpoint_files import iter_safetensors

__all__ = ["quantize_checkpoint"]

# The projections of a llama-family layer that become W4A16 (embeddings, norms, LM head stay float).
_LINEAR_SUFFIXES = tuple(
    f"{p}.weight"
    for p in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
)
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")


def quantize_checkpoint(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    group_size: int = 128,
    symmetric: bool = False,
) -> Path:
    """RTN W4A16 of a Hugging Face llama-family directory's linear layers.

    Writes ``out_dir/model.safetensors`` (each ``<proj>.weight`` replaced by ``<proj>.qweight`` uint8,
    ``.scales`` fp16 and, asymmetric, ``.offsets`` fp16; every other tensor unchanged), ``config.json``
    with ``quantization_config = {"quant_method": "inflight_w4a16", "group_size", "symmetric"}``, and
    copies the other files (tokenizer, generation config). ``LLM(model=out_dir)`` loads the result.
    """
    src, dst = Path(model_dir), Path(out_dir)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if src.resolve() == dst.resolve():
        raise ValueError(f"out_dir must differ from model_dir ({str(src)!r})")
    with open(src / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(f"{str(src)!r} is already quantised ({config['quantization_config']})")

    tensors: dict[str, torch.Tensor] = {}
    quantized = 0
    for name, tensor in iter_safetensors(src):
        if name.endswith(_LINEAR_SUFFIXES) and name.startswith("model.layers."):
            if tensor.shape[1] % group_size != 0:
                raise ValueError(
                    f"{name}: in_features ({tensor.shape[1]}) is not a multiple of group_size "
                    f"({group_size}); choose a group size that divides it"
                )
            qweight, scales, offsets = quantize_w4(tensor, group_size, symmetric)
            prefix = name[: -len("weight")]
            tensors[prefix + "qweight"] = qweight
            tensors[prefix + "scales"] = scales
            if offsets is not None:
                tensors[prefix + "offsets"] = offsets
            quantized += 1
        else:
            tensors[name] = tensor.contiguous()
    if quantized == 0:
        raise ValueError(
            f"no linear layer weights (model.layers.*.{_LINEAR_SUFFIXES[0]}, ...) in {str(src)!r}"
        )

    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "group_size": group_size,
        "symmetric": symmetric,
    }
    with open(dst / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    copy_side_files(src, dst)
    return dst


def copy_side_files(src: Path, dst: Path) -> None:
    """Copies a checkpoint directory's files other than its weights and config.json (tokenizer,
    generation config, chat template) into a quantised copy."""
    for item in src.iterdir():
        skip = item.name in ("config.json", "model.safetensors.index.json") or item.name.endswith(
            _WEIGHT_FILES
        )
        if item.is_file() and not skip:
            shutil.copy2(item, dst / item.name)
