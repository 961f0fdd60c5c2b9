"""The collectives a tensor-parallel model runs inside its forward: :class:`TensorParallel`.

A model holds one :class:`TensorParallel`: ``all_reduce`` after each row-parallel projection
(o_proj, down_proj) and ``gather_logits`` after the vocab-parallel LM head. With one rank both are
identities and torch.distributed is never touched. The time spent in them is accumulated
(:meth:`TensorParallel.comm_seconds`), for the benchmarks' "time in communication" column.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist


class TensorParallel:
    """Rank ``rank`` of ``size`` tensor-parallel ranks over ``group`` (a torch.distributed group whose
    first rank, ``root``, receives the gathered logits)."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        group: Any = None,
        root: int = 0,
        shm: Any = None,
        timeout: float = 120.0,
    ) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank must be in 0 .. {size - 1}, got rank={rank}, size={size}")
        if size > 1 and group is None:
            raise ValueError("tensor parallelism over more than one rank needs a process group")
        self.rank = rank
        self.size = size
        self.group = group
        self.root = root  # the global rank of TP rank 0
        # The ranks' shared-memory collectives (inflight._C.ShmComm) when they share a host, else None
        # and the group's backend (gloo / NCCL) carries the data.
        self.shm = shm
        self.timeout = float(timeout)
        self._seconds = 0.0
        self._calls = 0

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums ``t`` over the ranks, in place; returns it."""
        if self.size == 1:
            return t
        t0 = time.perf_counter()
        if self.shm is not None and t.device.type == "cpu" and t.is_contiguous():
            self.shm.all_reduce(t, self.timeout)
        else:
            dist.all_reduce(t, group=self.group)
        self._seconds += time.perf_counter() - t0
        self._calls += 1
        return t

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """The full ``[rows, vocab_size]`` logits on TP rank 0 from every rank's contiguous vocabulary
        block ``[rows, padded_vocab / size]`` (padding rows dropped); None on the other ranks."""
        if self.size == 1:
            return local[:, :vocab_size]
        t0 = time.perf_counter()
        local = local.contiguous()
        if self.shm is not None and local.device.type == "cpu":
            out = local.new_empty((self.size, *local.shape)) if self.rank == 0 else None
            self.shm.gather(local, out, 0, self.timeout)
            parts = list(out.unbind(0)) if out is not None else None
        else:
            parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(local, parts, dst=self.root, group=self.group)
        self._seconds += time.perf_counter() - t0
        self._calls += 1
        if parts is None:
            return None
        return torch.cat(parts, dim=1)[:, :vocab_size]

    def comm_seconds(self) -> tuple[float, int]:
        """Seconds spent in this rank's collectives so far, and how many there were."""
        return self._seconds, self._calls

    @property
    def transport(self) -> str:
        """What carries the data: "shm" (shared memory, one host), the group's backend, or "none"."""
        if self.size == 1:
            return "none"
        return "shm" if self.shm is not None else dist.get_backend(self.group)

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size}, transport={self.transport})"


SINGLE = TensorParallel()
