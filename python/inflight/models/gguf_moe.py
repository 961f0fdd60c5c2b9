"""Mixture-of-experts GGUF files: the config fields and the expert tensors of llama.cpp's layout.

llama.cpp stores a sparse layer's experts stacked, one tensor per projection: ``blk.N.ffn_gate_exps``
and ``blk.N.ffn_up_exps`` ``[E, I, H]`` (rows first), ``blk.N.ffn_down_exps`` ``[E, H, I]``, and the
router as ``blk.N.ffn_gate_inp`` ``[E, H]``. Two architectures use them here:

- ``qwen3moe`` (Qwen3-MoE): ``{arch}.expert_count``, ``.expert_used_count`` and
  ``.expert_feed_forward_length`` (each expert's intermediate size); the routing weights of the top-k
  experts are renormalised, as llama.cpp computes this architecture (``{arch}.expert_weights_norm``,
  where a file has it, decides instead);
- ``llama`` with ``llama.expert_count`` (Mixtral): ``feed_forward_length`` is each expert's size; the
  routing weights are always renormalised; Q and K rows are permuted as in any llama file.

The expert tensors of a block-quantised type the weight-only GEMMs run (Q4_0 / Q4_1 / Q4_K as W4A16,
Q5_0 / Q8_0 / Q6_K as W8A16) are repacked one expert at a time, bit for bit, into per-expert linear
layers (:class:`~inflight.models.moe.SparseMoeBlock` with quantised experts); other types are
dequantised into the stacked dense experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

# The internal names _hf_name gives the stacked tensors (never a model's own names: the loaders turn
# them into per-expert tensors).
STACKED = {
    "ffn_gate_exps.weight": "mlp.experts.gate_exps.weight",
    "ffn_up_exps.weight": "mlp.experts.up_exps.weight",
    "ffn_down_exps.weight": "mlp.experts.down_exps.weight",
}
_STACKED_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate|up|down)_exps\.weight")
# The model's module of each part: gate and up are the two shards of one fused gate_up layer.
MODULE_OF_PART = {"gate": "experts_gate_up", "up": "experts_gate_up", "down": "experts_down"}


def stacked_part(hf_name: str) -> tuple[int, str] | None:
    """(layer, "gate" | "up" | "down") of a stacked expert tensor's internal name, else None."""
    m = _STACKED_NAME.fullmatch(hf_name)
    return None if m is None else (int(m.group(1)), m.group(2))


def moe_config(field, arch: str, experts: int) -> dict[str, Any]:
    """The Hugging Face config fields of a MoE GGUF file (``field(key, default)`` reads its metadata)."""
    p = f"{arch}."
    used = field(p + "expert_used_count")
    if used is None:
        raise ValueError(f"GGUF {p}expert_count={experts} without {p}expert_used_count")
    if arch == "llama":
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": int(experts),
            "num_experts_per_tok": int(used),
        }
    if arch != "qwen3moe":
        raise ValueError(f"GGUF mixture-of-experts files of architecture {arch!r} are not supported")
    inter = field(p + "expert_feed_forward_length")
    if inter is None:
        raise ValueError(f"GGUF {p}expert_count={experts} without {p}expert_feed_forward_length")
    norm = field(p + "expert_weights_norm", True)
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(used),
        "moe_intermediate_size": int(inter),
        "norm_topk_prob": bool(norm),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


@dataclass
class ExpertSlice:
    """One expert's rows of a stacked GGUF tensor, shaped like a 2-D GGUF tensor (what the repacking
    functions read: ``tensor_type`` and ``data`` ``[rows, bytes per row]``)."""

    tensor_type: Any
    data: np.ndarray


def expert_slices(t) -> list[ExpertSlice]:
    """The experts of stacked tensor ``t`` (``data`` ``[E, rows, bytes per row]``), in order."""
    if t.data.ndim != 3:
        raise ValueError(
            f"GGUF tensor {t.name!r} must be 3-D [experts, rows, columns], got shape {t.data.shape}"
        )
    return [ExpertSlice(t.tensor_type, t.data[e]) for e in range(t.data.shape[0])]


def expert_names(model_type: str, layer: int, part: str, num_experts: int) -> list[str]:
    """The per-expert checkpoint prefixes (``...experts.{e}.{w}.``) of ``part`` in the model's layout."""
    from inflight.models.moe import checkpoint_names

    module, parts = checkpoint_names(model_type)
    tensor = parts[("gate", "up", "down").index(part)]
    return [f"model.layers.{layer}.{module}.experts.{e}.{tensor}." for e in range(num_experts)]
