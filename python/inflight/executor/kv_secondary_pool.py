"""The secondary KV tier's memory: where blocks offloaded from the primary pool live (docs/batch-manager.md
§3.9; the KVCacheManager does the accounting, this holds the bytes and copies them), and, in a file, what
makes it survive a restart (§3.10).

Layout: one tensor per tensor of the primary pool (an fp pool has one, an int8 pool two: the codes and
their fp32 scales), each ``[num_blocks, *primary.shape[:2], *primary.shape[3:]]`` for a primary tensor
``[num_layers, 2, num_primary_blocks, ...]``: block-major, so that one block of one tensor is one
contiguous run of bytes (an offload writes whole pages of a file, an onboard reads them back in order).
Secondary block id ``P + i`` (``P`` the primary pool's size) is row ``i``.

Where it lives:

- a CPU engine: an anonymous private mapping (zero pages, committed when first written), or, with
  ``path``, a file on local disk mapped shared: the kernel writes dirty pages back and reads them in on
  demand, so the tier may be larger than memory. A new file's blocks are reserved with
  ``posix_fallocate`` (a full disk is an error now, not a SIGBUS at the first write).
- a GPU engine: pinned host memory (or the mapped file, pageable), the copies asynchronous on the
  current stream, so ordered with the forwards around them. Nothing here touches CUDA for a CPU pool.

A persistent tier (``path`` and an ``identity``): the file starts with a header region, then the
tensors (each on a page):

    [0, 48)   magic b"INFLIGHT-KVTIER\0", u32 format version, u32 0, u64 meta bytes, u64 entries,
              u64 index bytes (little-endian)
    [48, 80)  SHA-256 of bytes [0, 48) followed by the meta and the index
    [80, ..)  meta: JSON of the identity (model, weights' digest, activation dtype, parallel mapping)
              and of the layout (each tensor's dtype and shape, tokens_per_block, num_layers, KV heads,
              head dim, num_blocks); then the index, five arrays of one entry per block: int32 slot,
              int32 parent slot (-1: the first block of a prefix), int32 retention priority, 32-byte
              SHA-256 of the block's bytes (every tensor's row, in order), int32 tokens
              [entries, tokens_per_block]

:meth:`SecondaryKvPool.save` writes it (the block bytes are flushed first, so that an index on disk
never vouches for bytes that are not); a new engine opening the file reads it back
(:attr:`SecondaryKvPool.adopted`) when the magic, version, checksum, size, identity and layout all
match, and verifies every block's digest against the mapped bytes: a block whose bytes changed (the
slot was reused after the last save, and the engine then died) is dropped with every block below it.
Any other mismatch is logged with its reason and the tier starts empty (the file truncated and
reserved again): a file is never half-trusted.

Costs: a block digest is SHA-256 over ~1.7 GB/s per core on the EPYC (computed once per block between
two saves: an offload into a slot forgets its digest); the index is ~(44 + 4 x tokens_per_block) bytes
per block. A slot is never read before it was written (the manager onboards only what it offloaded or
adopted), so nothing is cleared.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import mmap
import os
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("inflight")

_ALIGN = 4096  # each tensor of a file-backed pool starts on a page
MAGIC = b"INFLIGHT-KVTIER\0"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<16sIIQQQ")  # magic, version, 0, meta bytes, entries, index bytes
_DIGEST = 32  # SHA-256
_PAYLOAD = _FIXED.size + _DIGEST
_META_MAX = 64 << 10  # room for the meta JSON


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _index_entry_bytes(tokens_per_block: int) -> int:
    return 3 * 4 + _DIGEST + 4 * tokens_per_block


def header_bytes(num_blocks: int, tokens_per_block: int) -> int:
    """The header region of a persistent tier file of ``num_blocks`` blocks (page-aligned)."""
    return _align(_PAYLOAD + _META_MAX + num_blocks * _index_entry_bytes(tokens_per_block))


def _secondary_shape(primary: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
    return (num_blocks, *primary.shape[:2], *primary.shape[3:])


class AdoptedBlocks:
    """The index entries a persistent tier adopted at start-up, as slots (rows of the tier): the
    manager's ``import_secondary_blocks`` takes them as ids ``P + slot`` (see :meth:`as_block_ids`)."""

    def __init__(self, slots, parents, priorities, tokens) -> None:
        self.slots = np.ascontiguousarray(slots, dtype=np.int32)
        self.parents = np.ascontiguousarray(parents, dtype=np.int32)
        self.priorities = np.ascontiguousarray(priorities, dtype=np.int32)
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.slots)

    def as_block_ids(self, first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(block_ids, parents, priorities, tokens)`` for a manager whose secondary ids start at ``first``."""
        parents = np.where(self.parents >= 0, self.parents + first, -1).astype(np.int32)
        return (self.slots + np.int32(first)).astype(np.int32), parents, self.priorities, self.tokens


class SecondaryKvPool:
    """``num_blocks`` secondary blocks shaped like the primary pool's tensors ``primary`` (see the module
    doc). With ``path`` and ``identity`` (a JSON-able dict naming the model: the engine's
    :func:`~inflight.executor.py_executor_creator.model_identity`) the tier is persistent: a matching file
    is adopted (:attr:`adopted`) and :meth:`save` writes its index. ``encoding``: what the cache's bytes
    stand for beyond their dtype (``{"int8_key_rotation": ...}``), recorded with the layout."""

    def __init__(
        self,
        primary: Sequence[torch.Tensor],
        num_blocks: int,
        path: str | None = None,
        identity: dict[str, Any] | None = None,
        encoding: dict[str, str] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.path = path
        self.device = primary[0].device
        self.persistent = path is not None and identity is not None
        self.tokens_per_block = int(primary[0].shape[3])
        shapes = [_secondary_shape(t, num_blocks) for t in primary]
        sizes = [math.prod(s) * t.element_size() for s, t in zip(shapes, primary)]
        first = header_bytes(num_blocks, self.tokens_per_block) if self.persistent else 0
        offsets, end = [], first
        for n in sizes:
            offsets.append(end)
            end += _align(n)
        self.nbytes = offsets[-1] + sizes[-1]  # the file's size (pages between the tensors included)
        self.meta: dict[str, Any] = {}
        if self.persistent:
            self.meta = {
                "identity": identity,
                "layout": {
                    "tensors": [
                        [str(t.dtype).removeprefix("torch."), list(sh)] for t, sh in zip(primary, shapes)
                    ],
                    "tokens_per_block": self.tokens_per_block,
                    "num_layers": int(primary[0].shape[0]),
                    "num_kv_heads": int(primary[0].shape[4]) if primary[0].dim() > 4 else 0,
                    "head_dim": int(primary[0].shape[5]) if primary[0].dim() > 5 else 0,
                    "num_blocks": num_blocks,
                    "file_bytes": self.nbytes,
                    # What the bytes stand for beyond their dtype (INT8: keys rotated or not).
                    "kv_encoding": encoding,
                },
            }
            if len(self._meta_bytes()) > _META_MAX:
                raise ValueError(
                    f"the KV tier's identity is too long ({len(self._meta_bytes())} bytes of JSON)"
                )
        self.adopted: AdoptedBlocks | None = None  # what a persistent tier found in its file
        self.dropped = 0  # index entries of that file not adopted (their bytes changed, or a parent's did)
        self.rejected: str | None = None  # why an existing file was not adopted (None: adopted or new)
        self._digests: dict[int, bytes] = {}  # slot -> digest of its bytes, valid until it is written
        index = None
        self._lock_fd: int | None = None
        if path is not None:
            self._check_path(path)
            self._lock_fd = self._lock(path)
        if self.persistent:
            index, self.rejected = self._read_index(path)
            if self.rejected is not None:
                logger.warning(
                    "KV tier file %s not adopted (%s): starting an empty tier; the file is rebuilt",
                    path,
                    self.rejected,
                )
        self._buf = None
        if path is not None:
            buf = self._map_file(path, self.nbytes, keep=index is not None)
        elif self.device.type == "cpu":
            buf = mmap.mmap(-1, self.nbytes)
        else:
            buf = None
        self._buf = buf
        self.tensors: list[torch.Tensor] = []
        for shape, n, off, t in zip(shapes, sizes, offsets, primary):
            if buf is None:  # pinned: the device's copies to and from it can be asynchronous
                self.tensors.append(torch.empty(shape, dtype=t.dtype, pin_memory=True))
            else:  # each tensor keeps the mapping alive
                count = n // t.element_size()
                self.tensors.append(torch.frombuffer(buf, dtype=t.dtype, count=count, offset=off).view(shape))
        self._non_blocking = self.device.type == "cuda" and buf is None
        if index is not None:
            self.adopted = self._verified(index)

    # ---- the file ----------------------------------------------------------------------------------

    @staticmethod
    def _map_file(path: str, nbytes: int, keep: bool = False) -> mmap.mmap:
        """Maps the tier's file: kept as it is (``keep``: a persistent tier adopting it), else created
        or truncated and its ``nbytes`` reserved."""
        SecondaryKvPool._check_path(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | (0 if keep else os.O_TRUNC), 0o600)
        try:
            if not keep:
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

    @staticmethod
    def _check_path(path: str) -> None:
        if os.path.isdir(path):
            raise ValueError(f"KvCacheConfig.host_cache_path must be a file, got the directory {path!r}")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ValueError(
                f"KvCacheConfig.host_cache_path={path!r}: the directory {parent!r} does not exist"
            )

    @staticmethod
    def _lock(path: str) -> int:
        """An exclusive lock on the tier's file for this pool's life (two engines on one file would
        overwrite each other's blocks): the descriptor holding it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"KvCacheConfig.host_cache_path={path!r} is in use by another engine (the file is locked); "
                "give each engine its own file"
            ) from None
        return fd

    def close(self) -> None:
        """Releases the file's lock (the mapping lives on while a tensor refers to it)."""
        if getattr(self, "_lock_fd", None) is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __del__(self) -> None:
        self.close()

    def _meta_bytes(self) -> bytes:
        return json.dumps(self.meta, sort_keys=True, separators=(",", ":")).encode()

    def _read_index(self, path: str) -> tuple[dict[str, np.ndarray] | None, str | None]:
        """The index of an existing tier file and None, or None and why it is not adopted (None, None:
        there is no file yet). The header is checked before the file's size, so that a file of
        another model or layout is reported as such rather than as one of another size."""
        try:
            size = os.path.getsize(path)
        except OSError:
            return None, None
        if size == 0:
            return None, None
        tpb = self.tokens_per_block
        with open(path, "rb") as f:
            fixed = f.read(_PAYLOAD)
            if len(fixed) < _PAYLOAD:
                return None, f"truncated: {size} bytes, less than a header"
            magic, version, _, meta_len, entries, index_len = _FIXED.unpack(fixed[: _FIXED.size])
            if magic != MAGIC:
                return None, "bad magic: not a KV tier file, or its engine never saved an index"
            if version != FORMAT_VERSION:
                return None, f"format version {version}, this build reads {FORMAT_VERSION}"
            if meta_len > _META_MAX or _PAYLOAD + meta_len + index_len > size:
                return (
                    None,
                    f"truncated or corrupt header (meta {meta_len} bytes, index {index_len}, file {size})",
                )
            payload = f.read(meta_len + index_len)
        if hashlib.sha256(fixed[: _FIXED.size] + payload).digest() != fixed[_FIXED.size :]:
            return None, "checksum mismatch of the header and index"
        try:
            stored = json.loads(payload[:meta_len])
        except ValueError:
            return None, "corrupt meta"
        for part in ("identity", "layout"):
            mine, theirs = self.meta[part], stored.get(part) if isinstance(stored, dict) else None
            if theirs != mine:
                if not isinstance(theirs, dict):
                    return None, f"no {part} recorded"
                diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
                what = "; ".join(f"{k}: file {theirs.get(k)!r}, this engine {mine.get(k)!r}" for k in diff)
                return None, f"another {'model' if part == 'identity' else 'layout'} ({what})"
        if size != self.nbytes:
            what = "truncated" if size < self.nbytes else "extended"
            return None, f"{what}: {size} bytes, the recorded layout takes {self.nbytes}"
        n = int(entries)
        if n > self.num_blocks or index_len != n * _index_entry_bytes(tpb):
            return None, f"corrupt index ({n} entries in {index_len} bytes)"
        raw = payload[meta_len:]
        cuts = np.cumsum([0, 4 * n, 4 * n, 4 * n, _DIGEST * n, 4 * n * tpb])
        part = [raw[cuts[i] : cuts[i + 1]] for i in range(5)]
        index = {
            "slots": np.frombuffer(part[0], np.int32),
            "parents": np.frombuffer(part[1], np.int32),
            "priorities": np.frombuffer(part[2], np.int32),
            "digests": np.frombuffer(part[3], np.uint8).reshape(n, _DIGEST),
            "tokens": np.frombuffer(part[4], np.int32).reshape(n, tpb),
        }
        if n and (index["slots"].min() < 0 or index["slots"].max() >= self.num_blocks):
            return None, "corrupt index (a slot outside the tier)"
        return index, None

    def _verified(self, index: dict[str, np.ndarray]) -> AdoptedBlocks:
        """The entries whose block bytes still have their recorded digest, and whose parent is adopted."""
        slots, parents = index["slots"].tolist(), index["parents"].tolist()
        position = {slot: i for i, slot in enumerate(slots)}
        good = [self.block_digest(slot) == bytes(index["digests"][i]) for i, slot in enumerate(slots)]
        for i, slot in enumerate(slots):
            if good[i]:
                self._digests[slot] = bytes(index["digests"][i])
        state: dict[int, bool] = {}

        def adopted(i: int) -> bool:
            walk: list[int] = []
            on_walk: set[int] = set()
            while True:
                if i in state:
                    result = state[i]
                    break
                if i in on_walk or not good[i]:  # a cycle (the manager would refuse it), or changed bytes
                    result = False
                    break
                walk.append(i)
                on_walk.add(i)
                p = parents[i]
                if p == -1 or p not in position:
                    result = p == -1
                    break
                i = position[p]
            for j in walk:
                state[j] = result
            return result

        keep = [i for i in range(len(slots)) if adopted(i)]
        self.dropped = len(slots) - len(keep)
        if self.dropped:
            logger.warning(
                "KV tier file %s: %d of %d cached blocks dropped: their bytes no longer match the index "
                "(written into after the last save, or corrupt), or a block above them was",
                self.path,
                self.dropped,
                len(slots),
            )
        return AdoptedBlocks(
            index["slots"][keep], index["parents"][keep], index["priorities"][keep], index["tokens"][keep]
        )

    def discard_adopted(self, reason: str) -> None:
        """Forgets what was adopted (the manager refused it): the tier starts empty."""
        logger.warning("KV tier file %s not adopted (%s): starting an empty tier", self.path, reason)
        self.rejected, self.adopted = reason, None
        self._digests.clear()

    def block_digest(self, slot: int) -> bytes:
        """SHA-256 of row ``slot`` of every tensor, in order (cached until the slot is written)."""
        digest = self._digests.get(slot)
        if digest is None:
            h = hashlib.sha256()
            for t in self.tensors:
                h.update(t[slot].view(torch.uint8).numpy())
            digest = h.digest()
            self._digests[slot] = digest
        return digest

    def save(self, slots, parents, priorities, tokens) -> None:
        """Writes the index of a persistent tier: the reusable blocks (as slots; ``parents`` are slots
        or -1) with their keys, and a digest of each block's bytes. The block bytes reach the file
        first, then the header and index (each flushed)."""
        if not self.persistent or self._buf is None:
            return
        slots = np.ascontiguousarray(slots, dtype=np.int32)
        n = len(slots)
        digests = b"".join(self.block_digest(int(s)) for s in slots)
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(n, self.tokens_per_block)
        index = b"".join(
            (
                slots.tobytes(),
                np.ascontiguousarray(parents, dtype=np.int32).tobytes(),
                np.ascontiguousarray(priorities, dtype=np.int32).tobytes(),
                digests,
                tokens.tobytes(),
            )
        )
        meta = self._meta_bytes()
        fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, 0, len(meta), n, len(index))
        header = fixed + hashlib.sha256(fixed + meta + index).digest() + meta + index
        self._buf.flush()  # the blocks' bytes on disk before an index vouches for them
        self._buf[: len(header)] = header
        self._buf.flush(0, _align(len(header)))

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
        self._digests.pop(slot, None)
        for p, s in zip(primary, self.tensors):
            s[slot].copy_(p[:, :, block], non_blocking=self._non_blocking)

    def onboard(self, primary: Sequence[torch.Tensor], slot: int, block: int) -> None:
        """Secondary row ``slot`` back into primary block ``block``."""
        for p, s in zip(primary, self.tensors):
            p[:, :, block].copy_(s[slot], non_blocking=self._non_blocking)
