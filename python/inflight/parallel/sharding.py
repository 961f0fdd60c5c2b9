"""What one tensor-parallel rank holds of a decoder layer: the slicing rules, as pure functions of the
sizes (no processes, no torch.distributed).

- Column-parallel projections (q / k / v, gate / up) split their output rows: each *source* tensor is
  sliced before the fused concatenation, so rank r's fused q/k/v is ``cat(q_r, k_r, v_r)``, not a slice
  of ``cat(q, k, v)``.
- Row-parallel projections (o_proj, down_proj) split their input columns; each rank's partial product
  is all-reduced, and a bias is added on TP rank 0 only.
- Attention heads are split evenly. KV heads too when there are at least as many as ranks; when fewer,
  each is replicated over ``tp / num_kv_heads`` consecutive ranks (which needs that to divide).
- The LM head is vocab-parallel: the vocabulary padded to ``tp * ceil(V / tp)`` rows, a contiguous range
  per rank, padded rows never sampled.
- 4-bit weights split only along whole quantisation groups.

Sizes that do not divide are a ``ValueError`` naming the parameter and the sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _divisible(name: str, value: int, tp: int) -> None:
    if value % tp:
        raise ValueError(f"{name}={value} is not divisible by tensor_parallel_size={tp}")


@dataclass(frozen=True)
class AttentionShard:
    """One rank's heads: query heads ``[q_start, q_start + num_heads)`` and KV heads
    ``[kv_start, kv_start + num_kv_heads)`` of the unsharded layer."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int

    @staticmethod
    def of(num_attention_heads: int, num_key_value_heads: int, tp_rank: int, tp_size: int) -> AttentionShard:
        _divisible("num_attention_heads", num_attention_heads, tp_size)
        if num_attention_heads % num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} is not divisible by "
                f"num_key_value_heads={num_key_value_heads}"
            )
        heads = num_attention_heads // tp_size
        if num_key_value_heads >= tp_size:
            _divisible("num_key_value_heads", num_key_value_heads, tp_size)
            kv = num_key_value_heads // tp_size
            kv_start = tp_rank * kv
        else:  # fewer KV heads than ranks: each is replicated over tp / kv consecutive ranks
            if tp_size % num_key_value_heads:
                raise ValueError(
                    f"tensor_parallel_size={tp_size} is not divisible by num_key_value_heads="
                    f"{num_key_value_heads} (KV heads are replicated when there are fewer than the ranks)"
                )
            kv = 1
            kv_start = tp_rank // (tp_size // num_key_value_heads)
        return AttentionShard(heads, kv, tp_rank * heads, kv_start)


@dataclass(frozen=True)
class PipelineStage:
    """What one pipeline stage runs: decoder layers ``layers`` (global indices); the first stage also
    embeds the tokens, the last also applies the final norm and the LM head."""

    layers: range
    first: bool = True
    last: bool = True

    @staticmethod
    def whole(num_layers: int) -> PipelineStage:
        return PipelineStage(range(num_layers))

    @property
    def needs_embedding(self) -> bool:
        return self.first

    def __str__(self) -> str:
        return (
            f"layers {self.layers.start}..{self.layers.stop - 1}"
            + (" +embed" if self.first else "")
            + (" +head" if self.last else "")
        )


def check_tensor_parallel(
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    tp_size: int,
    moe_intermediate_size: int = 0,
) -> None:
    """Raises the ``ValueError`` of the first size that cannot be split over ``tp_size`` ranks (checked
    before any rank starts). ``moe_intermediate_size``: the experts' (0: a dense model)."""
    AttentionShard.of(num_attention_heads, num_key_value_heads, 0, tp_size)
    _divisible("intermediate_size", intermediate_size, tp_size)
    if moe_intermediate_size:
        _divisible("moe_intermediate_size", moe_intermediate_size, tp_size)


def column_shard(
    tensor: torch.Tensor, tp_rank: int, tp_size: int, *, name: str = "out_features"
) -> torch.Tensor:
    """Rank ``tp_rank``'s contiguous block of output rows (dim 0) of one source tensor (a weight, a bias,
    or a 4-bit tensor whose rows are output features)."""
    _divisible(name, tensor.shape[0], tp_size)
    n = tensor.shape[0] // tp_size
    return tensor[tp_rank * n : (tp_rank + 1) * n]


def head_rows(tensor: torch.Tensor, start: int, count: int, head_dim: int) -> torch.Tensor:
    """Rows of heads ``[start, start + count)`` of a per-head projection (q, k or v; dim 0 = heads x head_dim)."""
    return tensor[start * head_dim : (start + count) * head_dim]


def row_shard(
    tensor: torch.Tensor, tp_rank: int, tp_size: int, *, group_size: int = 1, name: str = "in_features"
) -> torch.Tensor:
    """Rank ``tp_rank``'s block of input columns (the last dim) of a row-parallel weight. For a weight
    quantised in groups of ``group_size`` along the input, the block must hold whole groups; pass the
    tensor in *logical* columns (the caller slices packed or per-group tensors by the same range,
    :func:`row_range`)."""
    lo, hi = row_range(tensor.shape[-1], tp_rank, tp_size, group_size=group_size, name=name)
    return tensor[..., lo:hi]


def row_range(
    in_features: int, tp_rank: int, tp_size: int, *, group_size: int = 1, name: str = "in_features"
) -> tuple[int, int]:
    """The input columns ``[lo, hi)`` of rank ``tp_rank`` (whole quantisation groups)."""
    _divisible(name, in_features, tp_size)
    n = in_features // tp_size
    if n % group_size:
        raise ValueError(
            f"{name}={in_features} split over tensor_parallel_size={tp_size} gives {n} columns per rank, "
            f"not a whole number of quantisation groups of {group_size}"
        )
    return tp_rank * n, (tp_rank + 1) * n


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The LM head's rows when split over ``tp_size`` ranks: ``tp * ceil(V / tp)``."""
    return tp_size * -(-vocab_size // tp_size)


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Rank ``tp_rank``'s rows ``[lo, hi)`` of the padded vocabulary; rows at or past ``vocab_size``
    are padding (zero weights, never sampled)."""
    n = padded_vocab_size(vocab_size, tp_size) // tp_size
    return tp_rank * n, (tp_rank + 1) * n


def vocab_shard(weight: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s rows of an LM head (or embedding) ``[V, hidden]``, zero-padded to the padded
    vocabulary's block size."""
    vocab = weight.shape[0]
    lo, hi = vocab_range(vocab, tp_rank, tp_size)
    out = weight.new_zeros((hi - lo, *weight.shape[1:]))
    real = max(0, min(hi, vocab) - lo)
    out[:real] = weight[lo : lo + real]
    return out


def row_parallel_slicer(module, tensor_name: str, tp_rank: int, tp_size: int):
    """What rank ``tp_rank`` keeps of a row-parallel projection's checkpoint tensor ``tensor_name`` (a
    function of the tensor): its input columns, in whole quantisation groups of a 4-/8-bit weight
    (``module.group_size``; int4 codes two per byte); the bias only on rank 0 (the others add zeros, so
    the all-reduced sum holds it once)."""
    group = getattr(module, "group_size", 1)
    lo, hi = row_range(module.in_features * tp_size, tp_rank, tp_size, group_size=group)
    if tensor_name == "bias":
        return lambda t: t if tp_rank == 0 else torch.zeros_like(t)
    if tensor_name in ("scales", "offsets"):
        return lambda t: t[:, lo // group : hi // group]
    if tensor_name == "qweight" and module.qweight.dtype == torch.uint8:  # int4, 2 per byte
        return lambda t: t[:, lo // 2 : hi // 2]
    return lambda t: t[:, lo:hi]
