"""The step channel of a parallel engine: rank 0 tells every rank what to run (a step's plan, the KV
pool to allocate, a heartbeat, shut down), and the data paths of each rank (:func:`data_paths`: shared
memory between ranks of one host, else the torch.distributed groups' backends).

A message is a fixed-size int64 header broadcast from rank 0, plus a payload for a step (token ids,
positions, slot mapping, lengths, logits rows and block tables, concatenated, then the KV block copies
to make before the step: the copy-on-write pairs of beam search); the followers rebuild the
:class:`~inflight.layers.attention.AttentionMetadata` from it, and copy those blocks in their own pool
first (:func:`copy_pool_blocks`), so every rank's pool stays the same as rank 0's.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from inflight.layers.attention import AttentionMetadata
from inflight.parallel.comm import TensorParallel
from inflight.parallel.distributed import DEFAULT_TIMEOUT_S, ProcessGroups
from inflight.parallel.mapping import Mapping
from inflight.parallel.shm import hosts_of, make_shm_comm

__all__ = [
    "DTYPES",
    "HEARTBEAT",
    "KV",
    "SHUTDOWN",
    "STEP",
    "PipeLink",
    "StepChannel",
    "allocate_caches",
    "copy_pool_blocks",
    "data_paths",
    "decode_block_copies",
    "decode_step",
    "encode_step",
]

# Channel commands (header[0]).
STEP, KV, HEARTBEAT, SHUTDOWN = 1, 2, 3, 4
_HEADER = 9  # the command and up to 8 fields
# A KV message's dtype field indexes this (int8: the INT8 KV cache, codes plus per-token scales;
# float8_e4m3fn: the FP8 KV cache, E4M3 bytes).
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn)


def encode_step(
    input_ids: torch.Tensor, md: AttentionMetadata, block_copies=()
) -> tuple[list[int], torch.Tensor]:
    """A step's plan as header fields and one int64 payload; ``block_copies``: the ``(src, dst)`` KV
    block copies every rank makes before the step (in order)."""
    tables = md.block_tables
    parts = [
        input_ids.reshape(-1),
        md.positions,
        md.slot_mapping,
        md.seq_lens,
        md.kv_lens,
        md.logits_indices,
        tables.reshape(-1),
    ]
    copies = [v for pair in block_copies for v in pair]
    payload = torch.cat(
        [p.detach().to("cpu", torch.int64) for p in parts] + [torch.tensor(copies, dtype=torch.int64)]
    )
    fields = [
        md.num_tokens,
        md.batch_size,
        md.num_contexts,
        tables.shape[1],
        md.logits_indices.numel(),
        md.tokens_per_block,
        payload.numel(),
        len(copies) // 2,
    ]
    return fields, payload


def payload_size(fields: list[int]) -> int:
    return fields[6]


def num_logits(fields: list[int]) -> int:
    return fields[4]


def decode_block_copies(fields: list[int], payload: torch.Tensor) -> list[tuple[int, int]]:
    """The ``(src, dst)`` block copies of a step message (the end of its payload)."""
    n = fields[7]
    if n == 0:
        return []
    flat = payload[payload.numel() - 2 * n :].tolist()
    return list(zip(flat[0::2], flat[1::2]))


def decode_step(
    fields: list[int], payload: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, AttentionMetadata]:
    num_tokens, batch, num_contexts, max_blocks, n_logits, tpb, _size, n_copies = fields[:8]
    sizes = [num_tokens, num_tokens, num_tokens, batch, batch, n_logits, batch * max_blocks, 2 * n_copies]
    ids, positions, slots, seq_lens, kv_lens, logits_indices, tables, _copies = torch.split(payload, sizes)
    seq_lens32 = seq_lens.to(torch.int32)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    torch.cumsum(seq_lens32, 0, out=cu[1:])
    md = AttentionMetadata(
        num_contexts=num_contexts,
        num_tokens=num_tokens,
        tokens_per_block=tpb,
        seq_lens=seq_lens32.to(device),
        cu_seqlens=cu.to(device),
        kv_lens=kv_lens.to(torch.int32).to(device),
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        block_tables=tables.to(torch.int32).view(batch, max_blocks).to(device),
        logits_indices=logits_indices.to(device),
        seq_lens_host=tuple(seq_lens.tolist()),
        kv_lens_host=tuple(kv_lens.tolist()),
    )
    return ids.to(device), md


def _header(cmd: int, fields) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = cmd
    if fields:
        header[1 : 1 + len(fields)] = torch.tensor(list(fields), dtype=torch.int64)
    return header


class StepChannel:
    """Rank 0 -> the other TP ranks of the first pipeline stage: broadcasts of CPU int64 tensors, over
    shared memory when they share a host (a follower waits for its next message without a timeout,
    watching that rank 0 lives), else over the stage's gloo TP group (then rank 0 sends heartbeats
    while idle). With one rank in the stage it sends nothing."""

    def __init__(
        self, group: Any, shm: Any = None, timeout: float = DEFAULT_TIMEOUT_S, size: int = 2
    ) -> None:
        self.group = group
        self.shm = shm
        self.timeout = timeout
        self.size = size
        self.seconds = 0.0  # time in broadcasts, on this rank

    @property
    def needs_heartbeat(self) -> bool:
        return self.shm is None and self.size > 1

    @property
    def transport(self) -> str:
        return "none" if self.size == 1 else "shm" if self.shm is not None else "gloo"

    def _bcast(self, t: torch.Tensor, wait_forever: bool = False) -> None:
        if self.size == 1:
            return
        t0 = time.perf_counter()
        if self.shm is not None:
            self.shm.broadcast(t, 0, float("inf") if wait_forever else self.timeout)
        else:
            dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        self.seconds += time.perf_counter() - t0

    def send(self, cmd: int, *fields: int) -> None:
        self._bcast(_header(cmd, fields))

    def send_step(self, fields: list[int], payload: torch.Tensor) -> None:
        self.send(STEP, *fields)
        self._bcast(payload)

    def recv(self) -> tuple[int, list[int]]:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        self._bcast(header, wait_forever=True)
        values = header.tolist()
        return values[0], values[1:]

    def recv_payload(self, fields: list[int]) -> torch.Tensor:
        payload = torch.empty(payload_size(fields), dtype=torch.int64)
        self._bcast(payload)
        return payload


class PipeLink:
    """Pipeline parallelism: stage -> next stage, point to point over the PP group (same TP rank).
    A message is the header, and for a step the plan's payload and the hidden states; the last stage's
    TP rank 0 sends the logits back to rank 0. Sends are asynchronous (their handles are kept until
    done), so a stage goes on with its next micro-batch while the next stage receives."""

    _DOWN, _UP = 1, 2  # tags: messages down the pipe, logits back up

    def __init__(self, group: Any, mapping: Mapping, hidden_size: int, dtype: torch.dtype, device) -> None:
        self.group = group
        self.mapping = mapping
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = torch.device(device)
        stride = mapping.tp_size
        self.prev = mapping.rank - stride if mapping.pp_rank > 0 else None
        self.next = mapping.rank + stride if mapping.pp_rank < mapping.pp_size - 1 else None
        self.logits_src = (mapping.pp_size - 1) * stride  # the last stage's TP rank 0
        self._pending: list = []  # (work, tensor) of sends not known to be done
        self.seconds = 0.0  # in sends
        self.wait_seconds = 0.0  # waiting for logits: the later stages' compute and the transfer

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        return t if dist.get_backend(self.group) == "gloo" else t.to(self.device)

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        t = self._wire(t.contiguous())
        self._pending.append((dist.isend(t, dst, group=self.group, tag=tag), t))

    def flush(self) -> None:
        """Waits for every send so far (they complete as the next stage receives)."""
        t0 = time.perf_counter()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        self.seconds += time.perf_counter() - t0

    def send(
        self, cmd: int, fields=(), payload: torch.Tensor | None = None, hidden: torch.Tensor | None = None
    ):
        t0 = time.perf_counter()
        self._isend(_header(cmd, fields), self.next, self._DOWN)
        if payload is not None:
            self._isend(payload, self.next, self._DOWN)
            self._isend(hidden, self.next, self._DOWN)
        self.seconds += time.perf_counter() - t0
        if len(self._pending) > 48:  # bound what is kept alive: older sends are long done
            done = self._pending[:-24]
            del self._pending[:-24]
            for work, _ in done:
                work.wait()

    def _recv(self, t: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        wire = self._wire(t)
        dist.recv(wire, src, group=self.group, tag=tag)
        return wire if wire is t else wire.to(t.device)

    def recv(self) -> tuple[int, list[int], torch.Tensor | None, torch.Tensor | None]:
        """The previous stage's next message: (cmd, fields, payload, hidden)."""
        header = self._recv(torch.zeros(_HEADER, dtype=torch.int64), self.prev, self._DOWN).tolist()
        cmd, fields = header[0], header[1:]
        if cmd != STEP:
            return cmd, fields, None, None
        payload = self._recv(torch.empty(payload_size(fields), dtype=torch.int64), self.prev, self._DOWN)
        hidden = torch.empty(fields[0], self.hidden_size, dtype=self.dtype, device=self.device)
        return cmd, fields, payload, self._recv(hidden, self.prev, self._DOWN)

    def send_logits(self, logits: torch.Tensor) -> None:
        t = self._wire(logits.contiguous())
        dist.send(t, 0, group=self.group, tag=self._UP)

    def recv_logits(self, rows: int, vocab: int) -> torch.Tensor:
        """The logits of the oldest micro-batch in the pipe. The sends of later micro-batches stay in
        flight (waiting for them here would deadlock: the next stage takes them only after it has
        handed over these logits)."""
        t0 = time.perf_counter()
        out = self._recv(
            torch.empty(rows, vocab, dtype=torch.float32, device=self.device), self.logits_src, self._UP
        )
        self.wait_seconds += time.perf_counter() - t0
        return out


def data_paths(
    mapping: Mapping, groups: ProcessGroups, device: str, timeout: float
) -> tuple[TensorParallel, StepChannel | None]:
    """This rank's tensor-parallel collectives and, on the first pipeline stage, the step channel:
    shared memory between ranks of one host, else the groups' backends (collective over every rank,
    in this order)."""
    hosts = hosts_of(mapping, groups.control)
    channel = None
    if mapping.pp_rank == 0:
        shm = make_shm_comm(mapping, mapping.tp_group, groups.tp_control, hosts, "cpu", "step channel")
        channel = StepChannel(groups.tp_control, shm, timeout, size=mapping.tp_size)
    tp_shm = make_shm_comm(mapping, mapping.tp_group, groups.tp, hosts, device, "TP group")
    tp = TensorParallel(
        mapping.tp_rank,
        mapping.tp_size,
        groups.tp,
        root=mapping.tp_group[0],
        shm=tp_shm,
        timeout=timeout,
    )
    return tp, channel


def allocate_caches(model: torch.nn.Module, num_blocks: int, tpb: int, dtype: torch.dtype, device) -> list:
    """A follower's KV pool, as its layers' caches (views into the pool and its scales, if int8)."""
    from inflight.executor.resource_manager import allocate_kv_pool, layer_caches

    _, _, _, num_kv_heads, head_dim = model.kv_cache_shape(num_blocks, tpb)
    pool, scales = allocate_kv_pool(model.num_layers, num_kv_heads, head_dim, num_blocks, tpb, dtype, device)
    return layer_caches(pool, scales)


def copy_pool_blocks(caches: list, pairs) -> None:
    """Copies KV block ``src`` into ``dst`` for each pair, in every layer's cache (K and V; an int8
    cache's codes and scales, an fp8 cache's bytes), as rank 0's ``KVCacheResourceManager.copy_blocks``
    does in its pool."""
    for cache in caches:
        if isinstance(cache, torch.Tensor):
            tensors = [cache]
        else:
            tensors = [cache.kv] if getattr(cache, "scales", None) is None else [cache.kv, cache.scales]
        for t in tensors:  # [2, num_blocks, ...]
            for src, dst in pairs:
                t[:, dst].copy_(t[:, src])
