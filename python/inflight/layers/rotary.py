"""Rotary position embedding (rotate-half convention, as transformers' Llama), incl. llama3 / linear scaling.

The cos/sin table is computed once in fp32 exactly as transformers computes it (``positions.float() *
inv_freq``, then cos/sin) and stored in the model dtype: transformers casts cos/sin to the activation
dtype before use, so casting the table once gives the same numbers with no per-step cast.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies; op for op as transformers' ``ROPE_INIT_FUNCTIONS``."""
    inv_freq = 1.0 / (
        rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim)
    )
    rope_type = "default" if rope_scaling is None else rope_scaling["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        factor = rope_scaling["factor"]
        low_freq_factor = rope_scaling["low_freq_factor"]
        high_freq_factor = rope_scaling["high_freq_factor"]
        old_context_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise ValueError(f"rope_type {rope_type!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Holds ``[max_positions, 2, head_dim]`` (cos, signed sin) in the model dtype.

    The sin half is stored sign-folded (``[-sin, sin]``) so that ``rotate_half(x) * sin`` becomes
    ``roll(x, head_dim/2) * signed_sin``: one roll instead of slice/neg/cat, bitwise the same
    result since negation is exact.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]  # same fp32 products as transformers
        emb = torch.cat((freqs, freqs), dim=-1)
        half = head_dim // 2
        sin = emb.sin()
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        table = torch.stack((emb.cos(), signed_sin), dim=1).to(dtype=dtype, device=device)
        self.register_buffer("cos_sin", table, persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather once per step: (cos, signed_sin), each ``[T, 1, head_dim]`` to broadcast over heads."""
        cs = self.cos_sin.index_select(0, positions)
        return cs[:, 0:1, :], cs[:, 1:2, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x`` of shape ``[T, heads, head_dim]``."""
    rotated = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)
    return x * cos + rotated * signed_sin
