"""Which part of the model one process runs: the rank math of tensor and pipeline parallelism.

``world_size = tp_size * pp_size`` processes ("ranks"). As in TensorRT-LLM, the tensor-parallel rank
varies fastest: ``tp_rank = rank % tp_size`` and ``pp_rank = rank // tp_size``. A pipeline stage is
the ``tp_size`` consecutive ranks that share a ``pp_rank`` (its TP group: they split each layer of the
stage and all-reduce inside it); a PP group is the ``pp_size`` ranks that share a ``tp_rank``, one per
stage, strided by ``tp_size`` (hidden states go from stage to stage along it). With tp=2, pp=2:

    rank      0  1  2  3
    tp_rank   0  1  0  1      TP groups (0, 1) and (2, 3)
    pp_rank   0  0  1  1      PP groups (0, 2) and (1, 3)

Layers are split evenly over the stages; when they do not divide, the first ``num_layers % pp_size``
stages get one layer more.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass


def _check_size(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Mapping:
    """One rank's place in a ``tp_size x pp_size`` grid of processes (see the module docstring).
    ``Mapping()`` is the single-process engine, which never touches ``torch.distributed``."""

    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        for name, lo in (("world_size", 1), ("tp_size", 1), ("pp_size", 1), ("rank", 0)):
            object.__setattr__(self, name, _check_size(name, getattr(self, name), lo))
        if self.world_size != self.tp_size * self.pp_size:
            raise ValueError(
                f"world_size={self.world_size} must equal tensor_parallel_size x pipeline_parallel_size "
                f"= {self.tp_size} x {self.pp_size} = {self.tp_size * self.pp_size}"
            )
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")

    # ---------------------------------------------------------------------------------- this rank
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_group(self) -> tuple[int, ...]:
        """The ranks of this rank's stage (its tensor-parallel peers, itself included), in tp_rank order."""
        start = self.pp_rank * self.tp_size
        return tuple(range(start, start + self.tp_size))

    @property
    def pp_group(self) -> tuple[int, ...]:
        """One rank per stage with this rank's tp_rank, first stage first."""
        return tuple(range(self.tp_rank, self.world_size, self.tp_size))

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_pp_rank(self) -> int | None:
        """The rank this rank receives hidden states from (None on the first stage)."""
        return None if self.is_first_pp_rank else self.rank - self.tp_size

    @property
    def next_pp_rank(self) -> int | None:
        """The rank this rank sends hidden states to (None on the last stage)."""
        return None if self.is_last_pp_rank else self.rank + self.tp_size

    # ------------------------------------------------------------------------------- the whole grid
    def tp_groups(self) -> list[tuple[int, ...]]:
        """Every TP group, stage by stage (every rank must create them all, in this order)."""
        return [self.for_rank(p * self.tp_size).tp_group for p in range(self.pp_size)]

    def pp_groups(self) -> list[tuple[int, ...]]:
        """Every PP group, by tp_rank."""
        return [self.for_rank(t).pp_group for t in range(self.tp_size)]

    def for_rank(self, rank: int) -> Mapping:
        """The same grid, seen from another rank."""
        return dataclasses.replace(self, rank=rank)

    def layer_range(self, num_layers: int) -> range:
        """The decoder layers this rank's stage runs: an even split, the first ``num_layers % pp_size``
        stages one layer longer."""
        num_layers = _check_size("num_hidden_layers", num_layers, 1)
        if num_layers < self.pp_size:
            raise ValueError(
                f"num_hidden_layers={num_layers} is fewer than pipeline_parallel_size={self.pp_size}: "
                "every stage needs a layer"
            )
        base, extra = divmod(num_layers, self.pp_size)
        p = self.pp_rank
        start = p * base + min(p, extra)
        return range(start, start + base + (1 if p < extra else 0))

    def __str__(self) -> str:
        return f"rank {self.rank}/{self.world_size} (tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size})"
