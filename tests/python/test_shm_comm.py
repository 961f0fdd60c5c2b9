"""inflight._C.ShmComm, the shared-memory collectives of ranks on one machine, on real processes:
all-reduce (fp32 / bf16 / fp16, identical bits on every rank, tensors larger than a slot), gather and
broadcast against plain torch, and a dead rank or a timeout raising promptly instead of hanging."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch
import torch.multiprocessing as mp

from inflight import _C

SLOT = 256  # bytes: every tensor below takes several rounds


def _name() -> str:
    return f"/inflight-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _attach(rank: int, world: int, name: str) -> _C.ShmComm:
    if rank == 0:
        return _C.ShmComm(name, 0, world, SLOT, True)
    deadline = time.monotonic() + 30
    while True:
        try:
            return _C.ShmComm(name, rank, world, SLOT, False)
        except RuntimeError:  # not created (or not sized) yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _data(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def _collectives(rank: int, world: int, name: str, results: str) -> None:
    comm = _attach(rank, world, name)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (1, 7, 300):  # 300 fp32 = 1200 B: five rounds of 256 B
            t = _data(rank, n, dtype)
            comm.all_reduce(t, 30.0)
            want = sum(_data(r, n, dtype).float() for r in range(world)).to(dtype)  # fp32 sum in rank order
            assert torch.equal(t, want), (dtype, n, (t.float() - want.float()).abs().max())
            torch.save(t, f"{results}/allreduce-{rank}-{dtype}-{n}.pt")
    part = torch.arange(100, dtype=torch.int64) + 1000 * rank
    out = torch.empty(world, 100, dtype=torch.int64) if rank == 0 else None
    comm.gather(part, out, 0, 30.0)
    if rank == 0:
        assert torch.equal(out, torch.stack([torch.arange(100) + 1000 * r for r in range(world)]))
    msg = torch.arange(77, dtype=torch.int64) * 3 if rank == 0 else torch.zeros(77, dtype=torch.int64)
    comm.broadcast(msg, 0, 30.0)
    assert torch.equal(msg, torch.arange(77) * 3)
    assert comm.calls > 0 and comm.seconds >= 0
    if rank == 0:
        comm.unlink()


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_match_torch_and_every_rank_gets_the_same_bits(world, tmp_path):
    mp.start_processes(_collectives, args=(world, _name(), str(tmp_path)), nprocs=world, start_method="spawn")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ref = torch.load(tmp_path / f"allreduce-0-{dtype}-300.pt")
        for r in range(1, world):
            assert torch.equal(torch.load(tmp_path / f"allreduce-{r}-{dtype}-300.pt"), ref)


def _meet_once(rank: int, name: str) -> tuple[_C.ShmComm, torch.Tensor]:
    """Two ranks attach and all-reduce once (both alive and in step)."""
    comm = _attach(rank, 2, name)
    t = torch.ones(8)
    comm.all_reduce(t, 30.0)
    return comm, t


def _dies(rank: int, name: str, outcome: str) -> None:
    comm, t = _meet_once(rank, name)
    if rank == 1:
        os._exit(0)  # gone without a word
    t0 = time.monotonic()
    try:
        comm.all_reduce(t, 60.0)
    except RuntimeError as exc:
        with open(outcome, "w") as f:
            f.write(f"{time.monotonic() - t0:.3f} {exc}")


def test_a_rank_that_is_gone_is_reported_within_a_second(tmp_path):
    outcome = tmp_path / "outcome.txt"
    try:
        mp.start_processes(_dies, args=(_name(), str(outcome)), nprocs=2, start_method="spawn")
    except Exception:  # noqa: BLE001  (rank 1's exit is what the test provokes)
        pass
    seconds, message = outcome.read_text().split(" ", 1)
    assert "rank 1 (pid" in message and "is gone" in message, message
    assert float(seconds) < 1.0


def _aborts(rank: int, name: str, outcome: str) -> None:
    comm, t = _meet_once(rank, name)
    if rank == 1:  # fails while its process lives on (e.g. tearing down slowly)
        time.sleep(0.2)
        comm.abort()
        time.sleep(3.0)
        return
    t0 = time.monotonic()
    try:
        comm.all_reduce(t, 60.0)
    except RuntimeError as exc:
        with open(outcome, "w") as f:
            f.write(f"{time.monotonic() - t0:.3f} {comm.aborted_by} {exc}")
    with pytest.raises(RuntimeError, match="aborted by rank 1"):  # and every later collective
        comm.broadcast(t, 0, 60.0)


def test_a_rank_that_aborts_wakes_its_waiting_peers_at_once(tmp_path):
    outcome = tmp_path / "outcome.txt"
    mp.start_processes(_aborts, args=(_name(), str(outcome)), nprocs=2, start_method="spawn")
    seconds, by, message = outcome.read_text().split(" ", 2)
    assert "all_reduce: aborted by rank 1 (it failed)" in message, message
    assert by == "1"
    assert float(seconds) < 1.5  # rank 1's process was alive for 3 s more


def test_abort_is_idempotent_and_the_first_rank_wins():
    comm = _C.ShmComm(_name(), 0, 1, SLOT, True)
    assert comm.aborted_by == -1
    comm.all_reduce(torch.ones(4), 1.0)
    comm.abort()
    comm.abort()
    assert comm.aborted_by == 0
    with pytest.raises(RuntimeError, match="all_reduce: aborted by rank 0"):
        comm.all_reduce(torch.ones(4), 1.0)
    comm.unlink()


def test_a_timeout_names_the_missing_rank():
    comm = _C.ShmComm(_name(), 0, 2, SLOT, True)  # rank 1 never attaches (and the pid slot is empty)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="all_reduce: rank 1 did not arrive within 0.2"):
        comm.all_reduce(torch.ones(4), 0.2)
    assert time.monotonic() - t0 < 2.0
    comm.unlink()


def test_a_segment_too_large_for_dev_shm_is_refused_at_creation():
    """Its pages are reserved when it is created: no SIGBUS later, a message now, and no name left."""
    name = _name()
    with pytest.raises(
        RuntimeError, match=r"reserving \d+ bytes for .* in /dev/shm failed: .*INFLIGHT_TP_TRANSPORT=gloo"
    ):
        _C.ShmComm(name, 0, 2, 1 << 42, True)  # 16 TiB
    assert not os.path.exists("/dev/shm" + name)


def test_bad_arguments_are_refused():
    comm = _C.ShmComm(_name(), 0, 1, SLOT, True)
    with pytest.raises(TypeError):
        comm.all_reduce(torch.ones(4, dtype=torch.int64), 1.0)
    with pytest.raises(ValueError, match="root of a gather needs out"):
        comm.gather(torch.ones(4), None, 0, 1.0)
    with pytest.raises(ValueError, match="out must hold"):
        comm.gather(torch.ones(4), torch.empty(3), 0, 1.0)
    with pytest.raises(RuntimeError, match="rank 2 of world 2"):
        _C.ShmComm(_name(), 2, 2, SLOT, True)
    with pytest.raises(RuntimeError, match="shm_open"):
        _C.ShmComm(_name(), 1, 2, SLOT, False)  # nothing to attach to
    one = torch.arange(5, dtype=torch.float32)
    comm.all_reduce(one, 1.0)  # a world of one: the identity
    assert torch.equal(one, torch.arange(5, dtype=torch.float32))
    comm.unlink()
