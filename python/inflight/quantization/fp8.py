"""FP8 checkpoints (``quantization_config.quant_method = "fp8"``, as Qwen3 and DeepSeek ship them and
transformers' ``FineGrainedFP8Config`` writes them): linear weights stored as OCP FP8 E4M3
(``float8_e4m3fn``) with a ``weight_scale_inv`` beside each, the multiplier that dequantises it: one per
``weight_block_size = [bn, bk]`` block (usually 128 x 128), or one per tensor.

They run as W8A16 layers whose bytes are E4M3 values (:class:`~inflight.layers.quantized_linear.W8A16Linear`
with ``weight_format="fp8_e4m3"``): the kernels convert each byte exactly in registers and multiply by the
group's scale. A block scale becomes the scale of every row of its block and every group of ``bk``
columns (group size ``bk``; a per-tensor scale: the largest group size dividing ``K``), so
``scales * fp8(q)`` is exactly ``weight_scale_inv * float(weight)``: the checkpoint's own dequantisation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["FP8_METHOD", "fp8_group_size", "fp8_scales", "iter_fp8_tensors", "parse_fp8_config"]

FP8_METHOD = "fp8"
_LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_fp8_config(q: dict[str, Any]) -> dict[str, Any]:
    """The checked ``quantization_config`` of an FP8 checkpoint."""
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt must be 'e4m3' (E4M3 weights), got {fmt!r}")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", None):
        raise ValueError(
            f"quantization_config.activation_scheme must be 'dynamic' (activations are not quantised "
            f"here: weights only), got {scheme!r}"
        )
    block = q.get("weight_block_size")
    if block is not None:
        if (
            not isinstance(block, (list, tuple))
            or len(block) != 2
            or any(not isinstance(b, int) or b < 16 or b % 16 for b in block)
        ):
            raise ValueError(
                f"quantization_config.weight_block_size must be [rows, cols], multiples of 16, got {block!r}"
            )
        block = (int(block[0]), int(block[1]))
    skip = tuple(q.get("modules_to_not_convert") or ())
    return {"quant_method": FP8_METHOD, "weight_block_size": block, "modules_to_not_convert": skip}


def fp8_group_size(in_features: int, block: tuple[int, int] | None) -> int:
    """The W8A16 group size of a layer with ``in_features`` columns."""
    if block is not None:
        if in_features % block[1]:
            raise ValueError(
                f"an FP8 layer's in_features ({in_features}) must be a multiple of weight_block_size[1] "
                f"({block[1]})"
            )
        return block[1]
    for g in (128, 64, 32, 16):
        if in_features % g == 0:
            return g
    raise ValueError(f"an FP8 layer's in_features ({in_features}) must be a multiple of 16")


def fp8_scales(scale_inv: torch.Tensor, n: int, k: int, block: tuple[int, int] | None) -> torch.Tensor:
    """``weight_scale_inv`` -> fp32 W8A16 scales ``[n, k // group]`` (each block's value repeated)."""
    group = fp8_group_size(k, block)
    s = scale_inv.to(torch.float32)
    if block is None:
        if s.numel() != 1:
            raise ValueError(f"a per-tensor weight_scale_inv must hold one value, got shape {tuple(s.shape)}")
        return s.reshape(1, 1).expand(n, k // group).contiguous()
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(s.shape) != want:
        raise ValueError(
            f"weight_scale_inv must have shape [ceil(n / {bn}), ceil(k / {bk})] = {list(want)}, "
            f"got {list(s.shape)}"
        )
    return s.repeat_interleave(bn, dim=0)[:n].contiguous()


def iter_fp8_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with every FP8 linear weight and its ``weight_scale_inv`` turned into
    ``<prefix>.qweight`` (the E4M3 tensor) and ``<prefix>.scales``; the rest pass through. A weight
    without its scale (or the reverse) is an error naming it."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if name.endswith(".weight_scale_inv"):
            prefix = name[: -len("weight_scale_inv")]
            key = "scale"
        elif name.endswith(".weight") and tensor.dtype == torch.float8_e4m3fn:
            prefix = name[: -len("weight")]
            key = "weight"
        else:
            yield name, tensor
            continue
        if not prefix.rstrip(".").endswith(_LINEAR_SUFFIXES):
            raise ValueError(f"FP8 tensor {name!r} is not a linear projection's weight (not supported)")
        parts = pending.setdefault(prefix, {})
        parts[key] = tensor
        if len(parts) == 2:
            del pending[prefix]
            w = parts["weight"]
            yield prefix + "qweight", w
            yield prefix + "scales", fp8_scales(parts["scale"], w.shape[0], w.shape[1], block)
    if pending:
        missing = sorted(p + ("weight_scale_inv" if "weight" in v else "weight") for p, v in pending.items())
        raise ValueError(f"FP8 checkpoint: tensors without their pair: {missing[:8]}")
