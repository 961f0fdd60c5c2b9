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
    """Holds ``[rows, 2, head_dim]`` (cos, signed sin) in the model dtype, for positions ``0 .. rows - 1``.

    The sin half is stored sign-folded (``[-sin, sin]``) so that ``rotate_half(x) * sin`` becomes
    ``roll(x, head_dim/2) * signed_sin``: one roll instead of slice/neg/cat, bitwise the same
    result since negation is exact.

    On the CPU the table starts at :data:`INITIAL_ROWS` positions and grows (:meth:`ensure`) to the
    positions a step uses, up to ``max_positions``: a model that may see 32k positions but serves
    short requests does not hold the whole table (Gemma 3: two tables of 64 MiB each at 32k). On
    other devices, and after ``.to()`` one, it is whole (a growth check would synchronise the step,
    and CUDA graphs hold its address). The rows are computed in blocks of a fixed shape, each small
    enough to run on one thread, so a row's bits never depend on when it was computed or on the
    thread count: a grown table equals the whole one.
    """

    INITIAL_ROWS = 4096

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
        self.dtype = dtype
        self._inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling)
        # Positions per block: under 16k elements, below ATen's grain for splitting an op over threads.
        self._block = max(1, 16384 // head_dim)
        on_cpu = device is None or torch.device(device).type == "cpu"
        rows = min(max_positions, self.INITIAL_ROWS) if on_cpu else max_positions
        table = self._rows(0, rows).to(device=device)
        self.register_buffer("cos_sin", table, persistent=False)

    @property
    def rows(self) -> int:
        """Positions the table holds now."""
        return self.cos_sin.shape[0]

    @property
    def grows(self) -> bool:
        """True while the table is on the CPU and holds fewer than ``max_positions`` rows."""
        return self.rows < self.max_positions and self.cos_sin.device.type == "cpu"

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start .. stop - 1`` in the model dtype, on the CPU (``start`` a multiple of the block)."""
        blocks = []
        for first in range(start, stop, self._block):
            pos = torch.arange(first, first + self._block, dtype=torch.int64).float()
            freqs = pos[:, None] * self._inv_freq[None, :]  # same fp32 products as transformers
            emb = torch.cat((freqs, freqs), dim=-1)
            half = self.head_dim // 2
            sin = emb.sin()
            signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            blocks.append(torch.stack((emb.cos(), signed_sin), dim=1).to(dtype=self.dtype))
        table = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        return table[: stop - start]  # the last block may run past stop

    def ensure(self, positions: int) -> None:
        """Grow the table to hold at least ``positions`` rows (at least doubling it, at most
        ``max_positions``); a no-op when it already does. Past ``max_positions`` the readers refuse
        the position."""
        have = self.rows
        if positions <= have or have >= self.max_positions:
            return
        want = min(self.max_positions, max(positions, 2 * have))
        start = have - have % self._block  # recompute the last partial block whole
        extra = self._rows(start, want).to(device=self.cos_sin.device)
        self.cos_sin = torch.cat((self.cos_sin[:start], extra))

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        self.dtype = self.cos_sin.dtype  # .half() / .float() convert the table: grown rows follow
        if self.cos_sin.device.type != "cpu" and self.rows < self.max_positions:
            self.ensure(self.max_positions)  # whole off the CPU
        return out

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather once per step: (cos, signed_sin), each ``[T, 1, head_dim]`` to broadcast over heads."""
        cs = self.cos_sin.index_select(0, positions)
        return cs[:, 0:1, :], cs[:, 1:2, :]


def grow_tables(tables, positions: torch.Tensor) -> None:
    """Grows the tables (None entries skipped; all of one model, so they grow together) to hold the
    step's ``positions``: one max over them, and only while the first table still grows."""
    tables = [t for t in tables if t is not None]
    if tables and tables[0].grows and positions.numel():
        top = int(positions.max()) + 1
        for table in tables:
            table.ensure(top)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x`` of shape ``[T, heads, head_dim]``."""
    rotated = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)
    return x * cos + rotated * signed_sin
