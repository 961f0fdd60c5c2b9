"""The rank math of tensor and pipeline parallelism (Mapping) without processes, and the process
groups on real gloo ranks (spawned processes on this machine)."""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inflight.parallel import Mapping, destroy_process_groups, init_process_groups
from inflight.parallel import distributed as distributed_module

# ---------------------------------------------------------------------------------------- the math


def test_tp2_pp2_rank_math_and_groups():
    grid = [Mapping(world_size=4, rank=r, tp_size=2, pp_size=2) for r in range(4)]
    assert [(m.tp_rank, m.pp_rank) for m in grid] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [m.tp_group for m in grid] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [m.pp_group for m in grid] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert grid[0].tp_groups() == [(0, 1), (2, 3)] and grid[3].pp_groups() == [(0, 2), (1, 3)]
    assert [(m.prev_pp_rank, m.next_pp_rank) for m in grid] == [(None, 2), (None, 3), (0, None), (1, None)]
    assert [(m.is_first_pp_rank, m.is_last_pp_rank) for m in grid] == [(True, False)] * 2 + [
        (False, True)
    ] * 2


@pytest.mark.parametrize("tp,pp", [(1, 1), (4, 1), (1, 4), (2, 3), (3, 2), (4, 2)])
def test_groups_partition_the_ranks(tp, pp):
    m = Mapping(world_size=tp * pp, rank=0, tp_size=tp, pp_size=pp)
    for groups, size in ((m.tp_groups(), tp), (m.pp_groups(), pp)):
        assert sorted(r for g in groups for r in g) == list(range(tp * pp))
        assert all(len(g) == size for g in groups)
    for r in range(tp * pp):
        mr = m.for_rank(r)
        assert mr.rank in mr.tp_group and mr.rank in mr.pp_group
        assert set(mr.tp_group) & set(mr.pp_group) == {r}  # one shared rank: itself
        assert mr.tp_group[mr.tp_rank] == r and mr.pp_group[mr.pp_rank] == r


@pytest.mark.parametrize(
    "num_layers,pp,want",
    [(4, 1, [4]), (4, 2, [2, 2]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]), (8, 3, [3, 3, 2]), (3, 3, [1, 1, 1])],
)
def test_layer_split_is_even_first_stages_longer(num_layers, pp, want):
    ranges = [Mapping(world_size=pp, rank=p, pp_size=pp).layer_range(num_layers) for p in range(pp)]
    assert [len(r) for r in ranges] == want
    assert [i for r in ranges for i in r] == list(range(num_layers))  # contiguous, in order, no gaps


def test_mapping_errors_name_the_sizes():
    with pytest.raises(ValueError, match=r"world_size=4 must equal .* = 2 x 1 = 2"):
        Mapping(world_size=4, rank=0, tp_size=2, pp_size=1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        Mapping(world_size=2, rank=2, tp_size=2)
    with pytest.raises(ValueError, match=r"tp_size must be an int >= 1, got 0"):
        Mapping(world_size=1, tp_size=0)
    with pytest.raises(ValueError, match=r"pp_size must be an int >= 1, got True"):
        Mapping(pp_size=True)
    with pytest.raises(ValueError, match=r"num_hidden_layers=2 is fewer than pipeline_parallel_size=3"):
        Mapping(world_size=3, rank=0, pp_size=3).layer_range(2)


def test_a_single_process_never_touches_torch_distributed(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.distributed was called for tp = pp = 1")

    for name in ("init_process_group", "new_group", "is_initialized", "destroy_process_group"):
        monkeypatch.setattr(distributed_module.dist, name, refuse)
    groups = init_process_groups(Mapping())
    assert not groups.initialized and groups.tp is None and groups.control is None
    destroy_process_groups(groups)


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds > 0, got 0"):
        init_process_groups(Mapping(), timeout=0)


# ------------------------------------------------------------------------------ real gloo ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, tp: int, pp: int, url: str, results) -> None:
    torch.set_num_threads(1)
    groups = init_process_groups(
        Mapping(world_size=world, rank=rank, tp_size=tp, pp_size=pp), init_method=url, timeout=60
    )
    try:
        out = {}
        for name in ("tp", "pp", "control"):
            # Each rank contributes 2**rank: the sum names exactly the members of the group.
            x = torch.tensor([float(2**rank)])
            dist.all_reduce(x, group=getattr(groups, name))
            out[name] = int(x.item())
        results.put((rank, out))
    finally:
        destroy_process_groups(groups)


def test_groups_on_four_gloo_ranks():
    world, tp, pp = 4, 2, 2
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    url = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(
        _worker, args=(world, tp, pp, url, results), nprocs=world, join=True, start_method="spawn"
    )
    got = dict(results.get(timeout=30) for _ in range(world))
    for rank in range(world):
        m = Mapping(world_size=world, rank=rank, tp_size=tp, pp_size=pp)
        want = {
            "tp": sum(2**r for r in m.tp_group),
            "pp": sum(2**r for r in m.pp_group),
            "control": 2**world - 1,
        }
        assert got[rank] == want, (rank, got[rank], want)


def test_a_missing_rank_fails_within_the_timeout():
    """Rank 0 of 2 alone: joining must fail after the explicit timeout, not hang (torch's default
    would wait 30 minutes)."""
    url = f"tcp://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0/2 .* failed within timeout=2 s"):
        init_process_groups(Mapping(world_size=2, rank=0, tp_size=2), init_method=url, timeout=2)
    assert time.monotonic() - t0 < 30
    assert not dist.is_initialized()
