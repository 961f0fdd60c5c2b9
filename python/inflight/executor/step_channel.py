"""The step channel of a parallel engine: rank 0 tells every rank what to run (a step's plan, the KV
pool to allocate, a heartbeat, shut down), and the data paths of each rank (:func:`data_paths`: shared
memory between ranks of one host, else the torch.distributed groups' backends).

A message is a fixed-size int64 header broadcast from rank 0, plus a payload for a step (token ids,
positions, slot mapping, lengths, logits rows and block tables, concatenated); the followers rebuild
the :class:`~inflight.layers.attention.AttentionMetadata` from it.
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

__all__ = ["DTYPES", "HEARTBEAT", "KV", "SHUTDOWN", "STEP", "StepChannel", "allocate_caches", "data_paths"]

# Channel commands (header[0]).
STEP, KV, HEARTBEAT, SHUTDOWN = 1, 2, 3, 4
_HEADER = 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # a KV message's dtype field indexes this


class StepChannel:
    """Rank 0 -> every rank: broadcasts of CPU int64 tensors, over shared memory when every rank is on
    this host (a follower waits for its next message without a timeout, watching that rank 0 lives),
    else over the gloo control group (then rank 0 sends heartbeats while idle)."""

    def __init__(self, group: Any, shm: Any = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.group = group
        self.shm = shm
        self.timeout = timeout
        self.seconds = 0.0  # time in broadcasts, on this rank

    @property
    def needs_heartbeat(self) -> bool:
        return self.shm is None

    @property
    def transport(self) -> str:
        return "shm" if self.shm is not None else "gloo"

    def _bcast(self, t: torch.Tensor, wait_forever: bool = False) -> None:
        t0 = time.perf_counter()
        if self.shm is not None:
            self.shm.broadcast(t, 0, float("inf") if wait_forever else self.timeout)
        else:
            dist.broadcast(t, src=0, group=self.group)
        self.seconds += time.perf_counter() - t0

    def send(self, cmd: int, *fields: int) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = cmd
        header[1 : 1 + len(fields)] = torch.tensor(fields, dtype=torch.int64)
        self._bcast(header)

    def send_step(self, input_ids: torch.Tensor, md: AttentionMetadata) -> None:
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
        payload = torch.cat([p.detach().to("cpu", torch.int64) for p in parts])
        self.send(
            STEP,
            md.num_tokens,
            md.batch_size,
            md.num_contexts,
            tables.shape[1],
            md.logits_indices.numel(),
            md.tokens_per_block,
            payload.numel(),
        )
        self._bcast(payload)

    def recv(self) -> tuple[int, list[int]]:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        self._bcast(header, wait_forever=True)
        values = header.tolist()
        return values[0], values[1:]

    def recv_step(self, fields: list[int], device: torch.device) -> tuple[torch.Tensor, AttentionMetadata]:
        num_tokens, batch, num_contexts, max_blocks, num_logits, tpb, size = fields[:7]
        payload = torch.empty(size, dtype=torch.int64)
        self._bcast(payload)
        sizes = [num_tokens, num_tokens, num_tokens, batch, batch, num_logits, batch * max_blocks]
        ids, positions, slots, seq_lens, kv_lens, logits_indices, tables = torch.split(payload, sizes)
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


def data_paths(
    mapping: Mapping, groups: ProcessGroups, device: str, timeout: float
) -> tuple[TensorParallel, StepChannel]:
    """This rank's tensor-parallel collectives and the step channel: shared memory between ranks of
    one host, else the groups' backends (collective over every rank, in this order)."""
    hosts = hosts_of(mapping, groups.control)
    everyone = tuple(range(mapping.world_size))
    control_shm = make_shm_comm(mapping, everyone, groups.control, hosts, "cpu", "step channel")
    tp_shm = make_shm_comm(mapping, mapping.tp_group, groups.tp, hosts, device, "TP group")
    tp = TensorParallel(
        mapping.tp_rank,
        mapping.tp_size,
        groups.tp,
        root=mapping.tp_group[0],
        shm=tp_shm,
        timeout=timeout,
    )
    return tp, StepChannel(groups.control, control_shm, timeout)


def allocate_caches(model: torch.nn.Module, num_blocks: int, tpb: int, dtype: torch.dtype, device) -> list:
    from inflight.executor.resource_manager import _zeroed_host_tensor

    shape = (model.num_layers, *model.kv_cache_shape(num_blocks, tpb))
    if torch.device(device).type == "cpu":
        pool = _zeroed_host_tensor(shape, dtype)
    else:
        pool = torch.zeros(shape, dtype=dtype, device=device)
    return list(pool.unbind(0))
