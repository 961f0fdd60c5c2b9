"""The process groups of a parallel engine, on torch.distributed (gloo on CPU, NCCL on CUDA).

:func:`init_process_groups` joins the default group with an explicit timeout (torch's own default
is 30 minutes, which turns a dead rank into a half-hour hang) and creates, on every rank and in the
same order, every TP group, every PP group and one gloo control group over all ranks (small host
messages, also when the data groups are NCCL). A single-process mapping never touches
torch.distributed.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from inflight.parallel.mapping import Mapping

logger = logging.getLogger("inflight.parallel")

# How long a collective (and joining the group) may wait for the other ranks before it fails.
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's groups. All None for a single-process mapping."""

    mapping: Mapping
    backend: str | None = None
    tp: Any = None  # the ranks of this stage
    pp: Any = None  # one rank per stage, this rank's tp_rank
    control: Any = None  # gloo, every rank
    tp_control: Any = None  # gloo, the ranks of this stage (the TP group itself on a CPU)

    @property
    def initialized(self) -> bool:
        return self.control is not None


def _timeout(seconds: float) -> datetime.timedelta:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {seconds!r}")
    return datetime.timedelta(seconds=float(seconds))


def default_backend(device: str) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def init_process_groups(
    mapping: Mapping,
    *,
    device: str = "cpu",
    init_method: str = "env://",
    timeout: float = DEFAULT_TIMEOUT_S,
    store: Any = None,
) -> ProcessGroups:
    """Joins (or checks) the default group for ``mapping`` and creates the TP, PP and control groups.

    ``init_method``: ``env://`` under torchrun (MASTER_ADDR / MASTER_PORT), or ``tcp://host:port``;
    ``store``: a ``torch.distributed.Store`` to rendezvous on instead (``init_method`` is then unused).
    Raises ``RuntimeError`` naming the rank, the method and the timeout when the other ranks do not
    arrive in time, and ``ValueError`` when an existing default group disagrees with ``mapping``."""
    td = _timeout(timeout)
    if not mapping.is_distributed:
        return ProcessGroups(mapping)
    backend = default_backend(device)
    if dist.is_initialized():
        if (dist.get_world_size(), dist.get_rank()) != (mapping.world_size, mapping.rank):
            raise ValueError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the mapping is {mapping}"
            )
    else:
        _forget_failed_inits()
        where = init_method if store is None else "a store"
        rendezvous = {"init_method": init_method} if store is None else {"store": store}
        try:
            dist.init_process_group(
                backend,
                world_size=mapping.world_size,
                rank=mapping.rank,
                timeout=td,
                **rendezvous,
            )
        except Exception as exc:
            raise RuntimeError(
                f"{mapping}: joining the process group ({backend}, {where}) failed within "
                f"timeout={td.total_seconds():g} s: {type(exc).__name__}: {exc}"
            ) from exc
    # new_group is collective: every rank creates every group, in the same order, and keeps its own.
    tp = pp = None
    for ranks in mapping.tp_groups():
        group = dist.new_group(list(ranks), timeout=td, backend=backend)
        if mapping.rank in ranks:
            tp = group
    for ranks in mapping.pp_groups():
        group = dist.new_group(list(ranks), timeout=td, backend=backend)
        if mapping.rank in ranks:
            pp = group
    control = dist.new_group(list(range(mapping.world_size)), timeout=td, backend="gloo")
    # Host messages within a stage (the step channel): the TP group itself when it is gloo, else a gloo
    # twin of it.
    tp_control = tp
    if backend != "gloo":
        for ranks in mapping.tp_groups():
            group = dist.new_group(list(ranks), timeout=td, backend="gloo")
            if mapping.rank in ranks:
                tp_control = group
    logger.info("%s: process groups ready (%s, timeout %g s)", mapping, backend, td.total_seconds())
    return ProcessGroups(mapping, backend=backend, tp=tp, pp=pp, control=control, tp_control=tp_control)


def _forget_failed_inits() -> None:
    """torch numbers process groups per process (the number is part of each group's store keys), and a
    default group that failed to initialise still used up a number: a later engine in this process
    would then name its groups differently from its freshly started ranks and wait for keys they never
    write. With no default group there are no groups, so the count restarts at 0 (what
    destroy_process_group does too)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized() and getattr(world, "group_count", 0):
        world.group_count = 0


def destroy_process_groups(groups: ProcessGroups) -> None:
    """Leaves torch.distributed (every group with it). A no-op for a single-process mapping."""
    if groups.initialized and dist.is_initialized():
        dist.destroy_process_group()
