"""The secondary KV tier's memory: where blocks offloaded from the primary pool live (docs/batch-manager.md
§3.9; the KVCacheManager does the accounting, this holds the bytes and copies them).

Layout: one tensor per tensor of the primary pool (an fp pool has one, an int8 pool two: the codes and
their fp32 scales), each ``[num_blocks, *primary.shape[:2], *primary.shape[3:]]`` for a primary tensor
``[num_layers, 2, num_primary_blocks, ...]``: block-major, so that one block of one tensor is one
contiguous run of bytes (an offload writes whole pages of a file, an onboard reads them back in order).
Secondary block id ``P + i`` (``P`` the primary pool's size) is row ``i``.

Where it lives:

- a CPU engine: an anonymous private mapping (zero pages, committed when first written), or, with
  ``path``, a file on local disk mapped shared: the kernel writes dirty pages back and reads them in on
  demand, so the tier may be larger than memory. The file is created (or truncated) at start-up, its
  blocks reserved with ``posix_fallocate`` (a full disk is an error now, not a SIGBUS at the first
  write), and left in place at shutdown; its contents are not adopted by a later engine.
- a GPU engine: pinned host memory (or the mapped file, pageable), the copies asynchronous on the
  current stream, so ordered with the forwards around them. Nothing here touches CUDA for a CPU pool.

A slot is never read before it was written (the manager onboards only what it offloaded), so nothing
is cleared.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence

import torch

_ALIGN = 4096  # each tensor of a file-backed pool starts on a page


def _secondary_shape(primary: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
    return (num_blocks, *primary.shape[:2], *primary.shape[3:])


class SecondaryKvPool:
    """``num_blocks`` secondary blocks shaped like the primary pool's tensors ``primary`` (see the module doc)."""

    def __init__(
        self,
        primary: Sequence[torch.Tensor],
        num_blocks: int,
        path: str | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.path = path
        self.device = primary[0].device
        shapes = [_secondary_shape(t, num_blocks) for t in primary]
        sizes = [math.prod(s) * t.element_size() for s, t in zip(shapes, primary)]
        offsets, end = [], 0
        for n in sizes:
            offsets.append(end)
            end += -(-n // _ALIGN) * _ALIGN
        self.nbytes = offsets[-1] + sizes[-1]  # the file's size (pages between the tensors included)
        if path is not None:
            buf = self._map_file(path, self.nbytes)
        elif self.device.type == "cpu":
            buf = mmap.mmap(-1, self.nbytes)
        else:
            buf = None
        self.tensors: list[torch.Tensor] = []
        for shape, n, off, t in zip(shapes, sizes, offsets, primary):
            if buf is None:  # pinned: the device's copies to and from it can be asynchronous
                self.tensors.append(torch.empty(shape, dtype=t.dtype, pin_memory=True))
            else:  # each tensor keeps the mapping alive
                count = n // t.element_size()
                self.tensors.append(torch.frombuffer(buf, dtype=t.dtype, count=count, offset=off).view(shape))
        self._non_blocking = self.device.type == "cuda" and buf is None

    @staticmethod
    def _map_file(path: str, nbytes: int) -> mmap.mmap:
        if os.path.isdir(path):
            raise ValueError(f"KvCacheConfig.host_cache_path must be a file, got the directory {path!r}")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ValueError(
                f"KvCacheConfig.host_cache_path={path!r}: the directory {parent!r} does not exist"
            )
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise ValueError(
                    f"KvCacheConfig.host_cache_path={path!r}: cannot reserve {nbytes} bytes for "
                    f"KvCacheConfig.host_cache_size ({exc.strerror}); free disk space or lower it"
                ) from None
            return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping holds its own reference to the file

    def describe(self) -> str:
        return self.where(self.path, self.device)

    @staticmethod
    def where(path: str | None, device: torch.device) -> str:
        """Where a tier at ``path`` (None: in memory) for an engine on ``device`` lives, in words."""
        if path is not None:
            return f"file {path}"
        return "host memory" if torch.device(device).type == "cpu" else "pinned host memory"

    def offload(self, primary: Sequence[torch.Tensor], block: int, slot: int) -> None:
        """Primary block ``block`` (every layer's K and V of each tensor) into secondary row ``slot``."""
        for p, s in zip(primary, self.tensors):
            s[slot].copy_(p[:, :, block], non_blocking=self._non_blocking)

    def onboard(self, primary: Sequence[torch.Tensor], slot: int, block: int) -> None:
        """Secondary row ``slot`` back into primary block ``block``."""
        for p, s in zip(primary, self.tensors):
            p[:, :, block].copy_(s[slot], non_blocking=self._non_blocking)
