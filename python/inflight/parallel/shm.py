"""The data path of tensor parallelism between ranks of one machine: a shared-memory segment
(``inflight._C.ShmComm``) instead of gloo's TCP loopback.

On a small CPU machine a gloo all-reduce between two processes costs ~0.6 ms, and a decode step needs two
per layer: more than the step's compute. Ranks that share a host meet in shared memory instead (a few
microseconds a collective). torch.distributed still does everything else: it passes the segment's name,
synchronises the attach, carries the control messages, and remains the data path between hosts and on
GPUs (NCCL). ``INFLIGHT_TP_TRANSPORT`` chooses: ``auto`` (the default: shared memory when every rank of
the TP group runs on this host and the device is a CPU), ``shm`` (require it) or ``gloo``.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

import torch.distributed as dist

from inflight import _C
from inflight.parallel.mapping import Mapping

TRANSPORT_ENV = "INFLIGHT_TP_TRANSPORT"
TRANSPORTS = ("auto", "shm", "gloo")
# Bytes per rank per round; a larger tensor takes several rounds. A segment is 2 x ranks x this (plus
# 64 KiB): 8 MiB at tp=4, within a container's default 64 MiB /dev/shm with room to spare.
SLOT_BYTES = 1 << 20


def transport() -> str:
    value = os.environ.get(TRANSPORT_ENV, "auto").strip().lower()
    if value not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT_ENV} must be one of {list(TRANSPORTS)}, got {value!r}")
    return value


def hosts_of(mapping: Mapping, control_group: Any) -> list[str]:
    """Every rank's host name (collective over every rank)."""
    hosts: list[Any] = [None] * mapping.world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=control_group)
    return hosts


def make_shm_comm(
    mapping: Mapping, ranks: tuple[int, ...], group: Any, hosts: list[str], device: str, what: str
) -> Any | None:
    """This rank's ShmComm over ``ranks`` (``group``: their torch.distributed group), or None when the
    group's backend must carry the data (not one host, a GPU, one rank, ``INFLIGHT_TP_TRANSPORT=gloo``).
    Collective over ``ranks``."""
    choice = transport()
    if len(ranks) == 1 or choice == "gloo":
        return None
    usable = len({hosts[r] for r in ranks}) == 1 and not str(device).startswith("cuda")
    if not usable:
        if choice == "shm":
            raise ValueError(
                f"{TRANSPORT_ENV}=shm needs every rank of the {what} {list(ranks)} on one host and a CPU "
                f"device (hosts {[hosts[r] for r in ranks]}, device {device})"
            )
        return None
    root = ranks[0]
    comm = None
    name: list[Any] = [None]
    if mapping.rank == root:  # created (and sized) before anyone learns its name
        name[0] = f"/inflight-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        comm = _C.ShmComm(name[0], 0, len(ranks), SLOT_BYTES, True)
    dist.broadcast_object_list(name, src=root, group=group)
    if comm is None:
        comm = _C.ShmComm(name[0], ranks.index(mapping.rank), len(ranks), SLOT_BYTES, False)
    dist.barrier(group=group)  # every rank has attached: the name can go
    if mapping.rank == root:
        comm.unlink()
    return comm
