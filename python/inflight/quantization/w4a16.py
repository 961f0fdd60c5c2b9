"""W4A16 round-to-nearest quantisation and the int4 packing of the canonical layout.

Layout (see :mod:`inflight.ops.gemm`): ``qweight [N, K//2] uint8`` with ``k = 2j`` in the low nibble
of byte ``j`` and ``k = 2j+1`` in the high nibble; ``scales`` / ``offsets [N, K//group_size]``.

- asymmetric (GGUF Q4_1's scheme): per group ``scale = (max - min) / 15``, ``offset = min``,
  ``q = round((w - offset) / scale)`` in 0..15, ``w ~ scale * q + offset``;
- symmetric (GGUF Q4_0's scheme): ``scale = m / -8`` where ``m`` is the group's value of largest
  magnitude (so it maps exactly to ``q = 0``), ``q = round(w / scale) + 8`` in 0..15,
  ``w ~ scale * (q - 8)``.

``q`` is computed from the scale and offset *after* rounding them to ``scale_dtype``, so the stored
integers are the best ones for the stored scales.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from inflight.ops.reference.gemm import dequantize_w4, dequantize_w8, unpack_int4

__all__ = [
    "GROUP_SIZES",
    "dequantize_w4",
    "dequantize_w8",
    "pack_int4",
    "quantize_checkpoint",
    "quantize_w4",
    "quantize_w8",
    "unpack_int4",
]

GROUP_SIZES = (32, 64, 128)
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[N, K] uint8`` values in 0..15 -> ``[N, K//2] uint8`` (even k low nibble, odd k high)."""
    if q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] % 2 != 0:
        raise ValueError(f"q must be a 2-D uint8 tensor with an even number of columns, got {q.dtype} "
                         f"of shape {tuple(q.shape)}")
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"q values must be in 0..15, got a maximum of {int(q.max())}")
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _check(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> None:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D floating-point tensor, got {w.dtype} of shape {tuple(w.shape)}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if w.shape[1] % group_size != 0:
        raise ValueError(f"w.shape[1] ({w.shape[1]}) must be a multiple of group_size ({group_size})")
    if scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {[str(d) for d in _SCALE_DTYPES]}, got {scale_dtype}")


@torch.no_grad()
def quantize_w4(
    w: torch.Tensor,
    group_size: int = 128,
    symmetric: bool = False,
    scale_dtype: torch.dtype = torch.float16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest int4 of ``w [N, K]``: ``(qweight [N, K//2] uint8, scales, offsets or None)``."""
    _check(w, group_size, scale_dtype)
    n, k = w.shape
    g = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    if symmetric:
        idx = g.abs().argmax(dim=-1, keepdim=True)
        scale = (g.gather(-1, idx) / -8.0).to(scale_dtype)
        s = scale.to(torch.float32)
        inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
        q = torch.round(g * inv) + 8.0
        offsets = None
    else:
        lo = g.amin(dim=-1, keepdim=True)
        hi = g.amax(dim=-1, keepdim=True)
        scale = ((hi - lo) / 15.0).to(scale_dtype)
        offset = lo.to(scale_dtype)
        s = scale.to(torch.float32)
        inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
        q = torch.round((g - offset.to(torch.float32)) * inv)
        offsets = offset.reshape(n, k // group_size).contiguous()
    q = q.clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return pack_int4(q), scale.reshape(n, k // group_size).contiguous(), offsets


@torch.no_grad()
def quantize_w8(
    w: torch.Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric int8 (GGUF Q8_0's scheme): ``(qweight [N, K] int8, scales)``."""
    _check(w, group_size, scale_dtype)
    n, k = w.shape
    g = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    scale = (g.abs().amax(dim=-1, keepdim=True) / 127.0).to(scale_dtype)
    s = scale.to(torch.float32)
    inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
    q = torch.round(g * inv).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return q, scale.reshape(n, k // group_size).contiguous()


# ---- whole checkpoints (`inflight quantize`) ----------------------------------------------------------

QUANT_METHOD = "inflight_w4a16"
# The projections of a llama-family layer that become W4A16 (embeddings, norms, LM head stay float).
_LINEAR_SUFFIXES = tuple(
    f"{p}.weight"
    for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
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
    from safetensors.torch import save_file

    from inflight.models.config import ModelConfig
    from inflight.models.loader import iter_safetensors

    src, dst = Path(model_dir), Path(out_dir)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if src.resolve() == dst.resolve():
        raise ValueError(f"out_dir must differ from model_dir ({str(src)!r})")
    with open(src / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(f"{str(src)!r} is already quantised ({config['quantization_config']})")
    ModelConfig.from_dict(config)  # refuse what the runtime would not load, before the work

    tensors: dict[str, torch.Tensor] = {}
    quantized = 0
    for name, tensor in iter_safetensors(src):
        if name.endswith(_LINEAR_SUFFIXES) and name.startswith("model.layers."):
            if tensor.shape[1] % group_size != 0:
                raise ValueError(f"{name}: in_features ({tensor.shape[1]}) is not a multiple of group_size "
                                 f"({group_size}); choose a group size that divides it")
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
        raise ValueError(f"no linear layer weights (model.layers.*.{_LINEAR_SUFFIXES[0]}, ...) in {str(src)!r}")

    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "group_size": group_size, "symmetric": symmetric}
    with open(dst / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    for item in src.iterdir():
        if item.is_file() and item.name != "config.json" and not item.name.endswith(_WEIGHT_FILES) \
                and item.name != "model.safetensors.index.json":
            shutil.copy2(item, dst / item.name)
    return dst
