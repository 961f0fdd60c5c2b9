"""Mixture-of-experts MLPs: ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM``.

A sparse layer's MLP is a router (``gate``, no bias) and ``E`` SwiGLU experts. Per token, as
transformers 5 computes it (``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter`` and its default
``grouped_mm`` experts path):

- ``probs = softmax(gate(x))`` in fp32, the ``top_k`` largest kept; Mixtral always renormalises them to
  sum 1, Qwen3-MoE only with ``norm_topk_prob``. Mixtral keeps these routing weights in fp32,
  Qwen3-MoE casts them to the model dtype;
- each chosen expert computes ``down(silu(gate_e(x)) * up_e(x))`` in the model dtype, the result is
  multiplied by its routing weight (so in fp32 for Mixtral), the ``top_k`` products are summed in the
  router's order and the sum is cast to the model dtype.

The experts run as grouped GEMMs: the (token, expert) pairs are sorted by expert and each expert
multiplies only its own rows, in one ``torch.nn.functional.grouped_mm`` per projection on the CPU (one
``F.linear`` per expert that received rows elsewhere). There is no per-token work in Python.

Quantised experts (a GGUF file's 4- and 8-bit expert tensors, see ``gguf_moe``) are instead one
W4A16 / W8A16 layer per expert and projection (gate and up fused), run by the weight-only GEMM kernels
on the rows routed to that expert, one expert after another (:func:`quantized_experts`).

Dense experts' weights are stacked, ``[E, 2 * I, H]`` (gate rows, then up rows) and ``[E, H, I]``,
and loaded from the per-expert tensors of a Hugging Face checkpoint (the hub's layout, which
transformers' ``save_pretrained`` writes too): Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate,
up, down) and ``block_sparse_moe.gate``; Qwen3-MoE ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` and
``mlp.gate``. Checkpoints saved with ``save_original_format=False`` (transformers' stacked
``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``) are split into those names first.

Tensor parallelism splits every expert along its intermediate dimension (gate / up rows, down columns),
like the dense MLP; the router is replicated, and the layer's all-reduce sums the partial outputs.
A MoE layer has no ``gate_up_proj`` / ``down_proj`` projections, so the fused CPU layer stack (which
has no expert kernel) runs the Python layers for these models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.dlpack import to_dlpack

from inflight.layers.quantized_linear import W4A16Linear, W8A16Linear
from inflight.parallel.comm import SINGLE, TensorParallel
from inflight.parallel.sharding import column_shard, row_shard
from inflight.utils.dtypes import dtype_name

# The ``config`` arguments below are :class:`~inflight.models.config.ModelConfig` objects (not imported:
# config.py imports this module for its MoE fields).
ModelConfig = Any

__all__ = [
    "MOE_MODEL_TYPES",
    "SparseMoeBlock",
    "checkpoint_names",
    "grouped_experts",
    "moe_fields",
    "quantized_experts",
    "route",
    "split_stacked_experts",
    "validate_moe",
]

# model_type -> (the MLP's module name in a checkpoint, the expert's (gate, up, down) tensor names)
_CHECKPOINT_NAMES: dict[str, tuple[str, tuple[str, str, str]]] = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
MOE_MODEL_TYPES = tuple(_CHECKPOINT_NAMES)


def checkpoint_names(model_type: str) -> tuple[str, tuple[str, str, str]]:
    """(the MLP's module name in a checkpoint, the expert's (gate, up, down) tensor names)."""
    return _CHECKPOINT_NAMES[model_type]


# ---- config ----------------------------------------------------------------------------------------


def _int_field(d: dict[str, Any], key: str, default: int) -> int:
    value = d.get(key)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


def moe_fields(d: dict[str, Any], model_type: str, quantization: Any = None) -> dict[str, Any]:
    """The :class:`~inflight.models.config.ModelConfig` MoE fields of a Hugging Face config dict
    (empty for a dense architecture, or a Qwen3-MoE config without any sparse layer). Defaults are
    transformers' ``MixtralConfig`` / ``Qwen3MoeConfig`` ones."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    n_layers = _int_field(d, "num_hidden_layers", 0)
    # transformers 5 writes num_local_experts for both (its attribute_map); the hub's Qwen3-MoE
    # configs say num_experts.
    key = "num_local_experts" if "num_local_experts" in d else "num_experts"
    if model_type == "mixtral":
        num_experts = _int_field(d, key, 8)
        top_k = _int_field(d, "num_experts_per_tok", 2)
        inter = _int_field(d, "intermediate_size", 14336)
        norm_topk_prob = True
        sparse = [True] * n_layers
    else:
        num_experts = _int_field(d, key, 128)
        top_k = _int_field(d, "num_experts_per_tok", 8)
        inter = _int_field(d, "moe_intermediate_size", 768)
        norm_topk_prob = d.get("norm_topk_prob", False)
        if not isinstance(norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be a boolean, got {norm_topk_prob!r}")
        step = _int_field(d, "decoder_sparse_step", 1)
        if step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
        dense = d.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise ValueError(f"mlp_only_layers must be a list of layer indices, got {dense!r}")
        # Qwen3MoeDecoderLayer: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer.
        sparse = [i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(n_layers)]
    if not any(sparse):
        return {}  # every MLP dense: the plain model
    if quantization is not None:
        raise ValueError(
            f"quantization_config ({quantization['quant_method']}) is not supported for "
            "mixture-of-experts models (num_experts > 0)"
        )
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": inter,
        "norm_topk_prob": norm_topk_prob,
        "moe_layers": tuple(sparse),
    }


def validate_moe(c: ModelConfig) -> None:
    """Raise ValueError on inconsistent MoE fields of a ModelConfig (a dense one passes)."""
    if c.num_experts == 0:
        if any(c.moe_layers):
            raise ValueError("moe_layers marks sparse layers, but num_experts is 0")
        return
    if c.model_type not in MOE_MODEL_TYPES:
        raise ValueError(
            f"mixture of experts (num_experts={c.num_experts}) is supported for {list(MOE_MODEL_TYPES)}, "
            f"not model_type {c.model_type!r}"
        )
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if c.num_experts_per_tok > c.num_experts:
        raise ValueError(
            f"num_experts_per_tok ({c.num_experts_per_tok}) must be <= num_experts ({c.num_experts})"
        )
    if len(c.moe_layers) != c.num_hidden_layers or not any(c.moe_layers):
        raise ValueError(
            f"moe_layers must mark each of the {c.num_hidden_layers} layers sparse or dense, at least "
            f"one sparse, got {c.moe_layers!r}"
        )


# ---- compute ---------------------------------------------------------------------------------------


def _kernel_weight(layer: nn.Module):
    """The C++ weight object of an expert's layer (W4A16Weight, W8A16Weight or DenseWeight)."""
    if isinstance(layer, (W4A16Linear, W8A16Linear)):
        return layer.kernel_weight()._w
    return layer.kernel_weight()


def route(
    x: torch.Tensor,  # [T, H]
    router: torch.Tensor,  # [E, H]
    top_k: int,
    norm_topk_prob: bool,
    fp32_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights [T, top_k], expert ids [T, top_k] int64), best first: softmax in fp32, top-k,
    renormalised if ``norm_topk_prob``; the weights stay fp32 if ``fp32_weights`` (Mixtral), else are
    cast to ``x``'s dtype (Qwen3-MoE)."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if fp32_weights else weights.to(x.dtype)), ids


def _use_grouped_mm(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and hasattr(F, "grouped_mm")


def grouped_experts(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # [T, k] int64
    weights: torch.Tensor,  # [T, k]
    gate_up: torch.Tensor,  # [E, 2 * I, H]: gate rows then up rows
    down: torch.Tensor,  # [E, H, I]
    grouped_mm: bool | None = None,  # None: F.grouped_mm on the CPU, an F.linear per expert elsewhere
) -> torch.Tensor:  # [T, H], x's dtype
    """``sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` for ``e = expert_ids[t, j]``,
    the experts run as grouped GEMMs over the rows routed to each."""
    num_tokens, hidden = x.shape
    top_k = expert_ids.shape[1]
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    flat = expert_ids.reshape(-1)  # slot t * k + j -> its expert
    order = torch.argsort(flat, stable=True)  # the slots grouped by expert
    rows = x.index_select(0, order // top_k)  # [S, H]
    counts = torch.bincount(flat, minlength=num_experts)
    if grouped_mm if grouped_mm is not None else _use_grouped_mm(x):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets)
        out = F.grouped_mm(F.silu(h[:, :inter]) * h[:, inter:], down.transpose(1, 2), offs=offsets)
    else:
        out = rows.new_empty(rows.shape[0], hidden)
        start = 0
        for e, n in enumerate(counts.tolist()):  # one GEMM per expert that has rows
            if n:
                h = F.linear(rows[start : start + n], gate_up[e])
                out[start : start + n] = F.linear(F.silu(h[:, :inter]) * h[:, inter:], down[e])
                start += n
    # Weighted in the routing weights' dtype (fp32 for Mixtral), back in slot order, summed per token.
    out = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    per_slot = torch.empty_like(out).index_copy_(0, order, out)
    return per_slot.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def quantized_experts(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # [T, k] int64
    weights: torch.Tensor,  # [T, k]
    gate_up: Sequence[nn.Module],  # per expert: x [n, H] -> [n, 2 * I] (gate columns, then up)
    down: Sequence[nn.Module],  # per expert: [n, I] -> [n, H]
    fused: Any = None,  # an inflight._C.MoeExperts of the same layers: one C++ call for all experts
) -> torch.Tensor:  # [T, H], x's dtype
    """:func:`grouped_experts` with per-expert layers (quantised weights): each expert that has rows
    runs its two GEMMs on them, in expert order (in Python, one layer call each, or all in one
    ``fused`` call); the weighting and the sum are the same."""
    num_tokens, hidden = x.shape
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x.index_select(0, order // top_k)
    counts = torch.bincount(flat, minlength=len(gate_up))
    out = rows.new_empty(rows.shape[0], hidden)
    if fused is not None:
        fused.run(to_dlpack(rows), to_dlpack(counts), to_dlpack(out), torch.get_num_threads())
    else:
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                h = gate_up[e](rows[start : start + n])
                inter = h.shape[1] // 2
                out[start : start + n] = down[e](F.silu(h[:, :inter]) * h[:, inter:])
                start += n
    out = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    per_slot = torch.empty_like(out).index_copy_(0, order, out)
    return per_slot.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


class SparseMoeBlock(nn.Module):
    """One sparse layer's MLP: ``forward(x [T, H]) -> [T, H]`` (this rank's partial sum under tensor
    parallelism). Parameters are uninitialised until loaded (:meth:`checkpoint_targets`).

    ``expert_layers``: None for dense stacked experts, or the layer classes (``(in_features,
    output_sizes, bias=, dtype=, device=)`` like the model's linears) of each expert's gate_up and
    down projections: quantised experts, one layer each (one rank only)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str | None,
        tp: TensorParallel = SINGLE,
        expert_layers: tuple[Callable[..., nn.Module], Callable[..., nn.Module]] | None = None,
    ) -> None:
        super().__init__()
        inter = config.moe_intermediate_size
        if inter % tp.size:
            raise ValueError(
                f"moe_intermediate_size={inter} is not divisible by tensor_parallel_size={tp.size}"
            )
        if expert_layers is not None and tp.enabled:
            raise ValueError(
                f"quantised experts (a GGUF file's) run with tensor_parallel_size=1 only, got {tp.size}; "
                "load it with quantization=None to dequantise them"
            )
        self.tp = tp
        self.model_type = config.model_type
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.fp32_weights = config.model_type == "mixtral"
        self.intermediate_size = inter // tp.size  # this rank's part of each expert
        e, h, i = config.num_experts, config.hidden_size, self.intermediate_size
        kw = {"dtype": dtype, "device": device}
        self.router = nn.Parameter(torch.empty(e, h, **kw), requires_grad=False)
        self.quantized = expert_layers is not None
        self._fused: tuple[Any, Any] | None = None  # (the first expert's kernel weight, its MoeExperts)
        if self.quantized:
            gate_up, down = expert_layers
            self.expert_gate_up = nn.ModuleList(gate_up(h, (i, i), bias=False, **kw) for _ in range(e))
            self.expert_down = nn.ModuleList(down(i, (h,), bias=False, **kw) for _ in range(e))
        else:
            self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, h, **kw), requires_grad=False)
            self.experts_down = nn.Parameter(torch.empty(e, h, i, **kw), requires_grad=False)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, intermediate_size={self.intermediate_size}, "
            f"norm_topk_prob={self.norm_topk_prob}"
        )

    def _expert_names(self, prefix: str) -> Iterator[tuple[str, int, int]]:
        """(checkpoint name, expert, part: 0 gate / 1 up / 2 down) of every expert tensor."""
        module, parts = _CHECKPOINT_NAMES[self.model_type]
        for e in range(self.num_experts):
            for part, tensor in enumerate(parts):
                yield f"{prefix}.{module}.experts.{e}.{tensor}.weight", e, part

    def checkpoint_targets(self, prefix: str) -> dict[str, Any]:
        """HF tensor name -> destination (the router, or ``(self, shard, "weight")`` for load_shard)."""
        module = _CHECKPOINT_NAMES[self.model_type][0]
        targets: dict[str, Any] = {f"{prefix}.{module}.gate.weight": self.router}
        for name, e, part in self._expert_names(prefix):
            if not self.quantized:
                targets[name] = (self, 3 * e + part, "weight")
                continue
            layer = self.expert_down[e] if part == 2 else self.expert_gate_up[e]
            stem = name[: -len("weight")]
            for tensor_name in layer.checkpoint_tensor_names():
                targets[stem + tensor_name] = (layer, 0 if part == 2 else part, tensor_name)
        return targets

    def shard_slicers(self, prefix: str) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """This rank's rows of each expert's gate / up, columns of its down (empty with one rank)."""
        tp = self.tp
        if not tp.enabled:
            return {}
        name = "moe_intermediate_size"
        rows = lambda t: column_shard(t, tp.rank, tp.size, name=name)  # noqa: E731
        cols = lambda t: row_shard(t, tp.rank, tp.size, name=name)  # noqa: E731
        return {n: cols if part == 2 else rows for n, _, part in self._expert_names(prefix)}

    @torch.no_grad()
    def load_shard(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        """Copy expert ``shard // 3``'s gate (``shard % 3 == 0``), up (1) or down (2) weight into place."""
        if name != "weight":
            raise KeyError(f"SparseMoeBlock has no checkpoint tensor {name!r}")
        e, part = divmod(shard, 3)
        i = self.intermediate_size
        dst = self.experts_down[e] if part == 2 else self.experts_gate_up[e, part * i : (part + 1) * i]
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(
                f"shape mismatch for {name}: expected {tuple(dst.shape)}, got {tuple(tensor.shape)}"
            )
        dst.copy_(tensor)

    def _fused_experts(self):
        """The C++ expert group of the quantised experts (built once; again after a reload, which gives
        the layers new kernel weights)."""
        first = _kernel_weight(self.expert_gate_up[0])
        if self._fused is None or self._fused[0] is not first:
            from inflight import _C

            op = _C.MoeExperts(
                [_kernel_weight(m) for m in self.expert_gate_up],
                [_kernel_weight(m) for m in self.expert_down],
                self.router.shape[1],
                self.intermediate_size,
                dtype_name(self.router.dtype),
            )
            self._fused = (first, op)
        return self._fused[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, self.router, self.top_k, self.norm_topk_prob, self.fp32_weights)
        if self.quantized:
            fused = self._fused_experts() if x.device.type == "cpu" else None
            return quantized_experts(x, ids, weights, self.expert_gate_up, self.expert_down, fused)
        return grouped_experts(x, ids, weights, self.experts_gate_up, self.experts_down)


def make_moe_block(
    config: ModelConfig,
    layer: int,
    dtype: torch.dtype,
    device,
    tp: TensorParallel = SINGLE,
    expert_layers: tuple[Callable[..., nn.Module], Callable[..., nn.Module]] | None = None,
) -> SparseMoeBlock | None:
    """Layer ``layer``'s MoE MLP, or None when its MLP is dense."""
    if not config.is_sparse(layer):
        return None
    return SparseMoeBlock(config, dtype, device, tp, expert_layers)


def split_stacked_experts(
    weights: Iterable[tuple[str, torch.Tensor]], model_type: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with transformers' stacked expert tensors (``save_original_format=False``:
    ``{p}.mlp.experts.gate_up_proj`` [E, 2I, H], ``{p}.mlp.experts.down_proj`` [E, H, I], and for
    Mixtral ``{p}.mlp.gate.weight``) renamed / split into the per-expert names of the hub layout."""
    module, (gate, up, down) = _CHECKPOINT_NAMES[model_type]
    for name, tensor in weights:
        if not name.startswith("model.layers."):
            yield name, tensor
        elif name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len(".mlp.experts.gate_up_proj")]
            if tensor.dim() != 3 or tensor.shape[1] % 2:
                raise ValueError(
                    f"{name!r} must be [experts, 2 * intermediate, hidden], got {tuple(tensor.shape)}"
                )
            i = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{module}.experts.{e}.{gate}.weight", tensor[e, :i]
                yield f"{prefix}.{module}.experts.{e}.{up}.weight", tensor[e, i:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len(".mlp.experts.down_proj")]
            if tensor.dim() != 3:
                raise ValueError(
                    f"{name!r} must be [experts, hidden, intermediate], got {tuple(tensor.shape)}"
                )
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{module}.experts.{e}.{down}.weight", tensor[e]
        elif module != "mlp" and name.endswith(".mlp.gate.weight"):
            yield name[: -len(".mlp.gate.weight")] + f".{module}.gate.weight", tensor
        else:
            yield name, tensor
