"""Tensor parallelism across processes: one scheduler on rank 0, the other ranks run their shard.

Rank 0 runs the whole engine unchanged (the :class:`PyExecutor`, the C++ batch manager, a user's
scheduler) over a :class:`ParallelModel`: each forward first broadcasts the step's plan (the model
inputs: token ids, positions and the attention metadata) to every rank over the gloo control group,
then every rank runs its slice of the layers (an all-reduce after each o_proj and down_proj, inside
the model) and the vocab-parallel logits are gathered on rank 0, which samples. The followers
(:func:`run_follower`) do nothing but receive plans and run them; they never schedule, so they cannot
diverge from rank 0 whatever the scheduler does.

The channel has four messages, each a fixed-size int64 header broadcast from rank 0 (plus a payload
for a step): STEP, KV (allocate the KV pool: every rank gets the same number of blocks, decided once
on rank 0), HEARTBEAT (sent while idle, so the followers' collectives never reach their timeout) and
SHUTDOWN.

Launch (:meth:`Cluster.start`): on one machine the caller is rank 0 and spawns the other ranks; under
``torchrun`` every process is started by torchrun and the ranks meet on its store. Start-up is
staged through keys of a TCPStore (joined, loaded, error), polled while the spawned processes are
watched, so a rank that fails while starting makes ``LLM(...)`` raise within seconds with that rank's
traceback instead of waiting out a collective.

Failure contract: a rank that raises writes its traceback to the store and exits; a collective with a
dead rank fails on rank 0 with :class:`RankFailure` (``fatal``: the executor fails every request and
dies; later calls raise). The heartbeat thread also watches the spawned processes, so a rank killed
while the engine is idle is noticed within a second. Rank 0 dying makes the followers' next
collective fail, and they exit. ``shutdown()`` joins the followers with a bound, then SIGTERM, then
SIGKILL.
"""

from __future__ import annotations

import base64
import datetime
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from inflight.executor.step_channel import (
    DTYPES,
    HEARTBEAT,
    KV,
    SHUTDOWN,
    STEP,
    PipeLink,
    StepChannel,
    allocate_caches,
    copy_pool_blocks,
    data_paths,
    decode_block_copies,
    decode_step,
)
from inflight.parallel.comm import TensorParallel
from inflight.parallel.distributed import (
    DEFAULT_TIMEOUT_S,
    ProcessGroups,
    destroy_process_groups,
    init_process_groups,
)
from inflight.parallel.mapping import Mapping
from inflight.parallel.sharding import PipelineStage

logger = logging.getLogger("inflight")

__all__ = [
    "Cluster",
    "RankFailure",
    "ShardSpec",
    "follower_rank_from_env",
    "run_follower",
    "spawned_follower_main",
]

# How long start-up waits for each stage (join, load) before it gives up, at most.
_POLL_S = 0.05


class RankFailure(RuntimeError):
    """A rank of a parallel engine died, raised or stopped answering. ``fatal``: the engine cannot
    go on (the executor fails every request and stops)."""

    fatal = True

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class ShardSpec:
    """What every rank needs to load its shard and join the groups (picklable: it crosses to spawned
    processes)."""

    model: str
    dtype: Any
    device: str
    attention_backend: str | None
    max_seq_len: int | None
    quantization: str | None
    tp_size: int
    pp_size: int
    timeout: float = DEFAULT_TIMEOUT_S
    num_threads: int = 1
    activation_quantization: str | None = None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def load(self, device: torch.device, tp: TensorParallel, stage: PipelineStage | None):
        """This rank's shard: :func:`~inflight.models.loader.load_model` with these arguments."""
        from inflight.models.loader import load_model

        return load_model(
            self.model,
            dtype=self.dtype,
            device=device,
            attention_backend=self.attention_backend,
            max_seq_len=self.max_seq_len,
            quantization=self.quantization,
            tp=tp,
            stage=stage,
            activation_quantization=self.activation_quantization,
        )

    def device_of(self, local_rank: int) -> str:
        """CUDA ranks get one device each (``cuda:local_rank``); CPU ranks share the CPU."""
        return f"cuda:{local_rank}" if self.device.startswith("cuda") else self.device


# ---------------------------------------------------------------------------------------------- start-up


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store(host: str, port: int, world: int, is_master: bool, timeout: float):
    return dist.TCPStore(
        host,
        port,
        world,
        is_master,
        datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def follower_rank_from_env() -> int | None:
    """Under torchrun (or any env:// launch): this process's global rank; None when not launched so."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"])
    return None


def _env_store(world: int, timeout: float):
    """The store of a torchrun / env:// launch, namespaced for inflight. torchrun's agent hosts one
    on MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE); without an agent rank 0 hosts it."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    rank = int(os.environ["RANK"])
    base = _store(host, port, world, rank == 0 and not agent, timeout)
    return dist.PrefixStore("inflight/", base), base


def _threads_per_rank(local_ranks: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Cluster:
    """Rank 0's view of a parallel engine: the mapping, the groups, the store, the spawned ranks."""

    def __init__(
        self,
        spec: ShardSpec,
        mapping: Mapping,
        store: Any,
        procs: dict[int, Any],
        base_store: Any = None,
    ) -> None:
        self.spec = spec
        self.mapping = mapping
        self.store = store
        self._base_store = base_store  # kept alive (a master store serves while it lives)
        self.procs = procs  # rank -> subprocess.Popen (spawned here; empty under torchrun)
        self.groups: ProcessGroups | None = None
        self.tp = TensorParallel()
        self.channel: StepChannel | None = None
        self.link: PipeLink | None = None  # pipeline parallelism: to the next stage (set by the caller)
        self._prev_threads = torch.get_num_threads()
        self._closed = False

    # ---- start-up

    @classmethod
    def start(cls, spec: ShardSpec) -> Cluster:
        """Rank 0: spawns the other ranks (or, under torchrun, meets them) and joins the groups. The
        caller then loads its shard and calls :meth:`wait_loaded`."""
        world = spec.world_size
        env_rank = follower_rank_from_env()
        procs: dict[int, Any] = {}
        if env_rank is not None:
            if int(os.environ["WORLD_SIZE"]) != world:
                raise ValueError(
                    f"tensor_parallel_size x pipeline_parallel_size = {world} must equal the launcher's "
                    f"WORLD_SIZE={os.environ['WORLD_SIZE']}"
                )
            if env_rank != 0:
                raise RuntimeError(f"rank {env_rank} is a follower: run_follower(), not Cluster.start()")
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            spec = _with_threads(spec, _threads_per_rank(local))
            store, base = _env_store(world, spec.timeout)
        else:
            spec = _with_threads(spec, _threads_per_rank(world))
            port = _free_port()
            base = _store("127.0.0.1", port, world, True, spec.timeout)
            store = dist.PrefixStore("inflight/", base)
            # Fresh interpreters running inflight's follower entry point, not multiprocessing: the
            # caller's script is never re-imported (no __main__ guard needed, notebooks work).
            blob = base64.b64encode(pickle.dumps(spec)).decode()
            for rank in range(1, world):
                cmd = [
                    sys.executable,
                    "-m",
                    "inflight.executor.follower",
                    "127.0.0.1",
                    str(port),
                    str(rank),
                    blob,
                ]
                procs[rank] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        mapping = Mapping(world, 0, spec.tp_size, spec.pp_size)
        cluster = cls(spec, mapping, store, procs, base)
        try:
            torch.set_num_threads(spec.num_threads)
            cluster._wait_stage("joined", "join")
            cluster.groups = init_process_groups(
                mapping,
                device=spec.device,
                timeout=spec.timeout,
                store=dist.PrefixStore("pg/", store),
            )
            cluster.tp, cluster.channel = data_paths(mapping, cluster.groups, spec.device, spec.timeout)
        except BaseException:
            cluster.shutdown()
            raise
        logger.info(
            "parallel engine: %s, %d process(es) %s, %d CPU thread(s) per rank, TP data over %s",
            cluster.describe(),
            world,
            "spawned here" if procs else "launched by torchrun",
            spec.num_threads,
            cluster.tp.transport,
        )
        return cluster

    def describe(self) -> str:
        return f"tp={self.mapping.tp_size} pp={self.mapping.pp_size}"

    def wait_loaded(self) -> None:
        """Blocks until every rank has loaded its shard; raises :class:`RankFailure` with the failing
        rank's traceback as soon as one fails."""
        self._wait_stage("loaded", "load its shard")

    def _wait_stage(self, key: str, what: str) -> None:
        keys = [f"{key}/{r}" for r in range(1, self.mapping.world_size)]
        deadline = time.monotonic() + self.spec.timeout
        while not self.store.check(keys):
            failure = self.failure(wait=0.0)
            if failure is not None:
                raise RankFailure(f"parallel engine start-up failed: {failure}")
            if time.monotonic() > deadline:
                missing = [k for k in keys if not self.store.check([k])]
                raise RankFailure(
                    f"parallel engine start-up: {', '.join(missing)} not reached within "
                    f"timeout={self.spec.timeout:g} s (ranks that did not {what})"
                )
            time.sleep(_POLL_S)

    # ---- failures

    def _error_of(self, rank: int) -> str | None:
        try:
            if self.store.check([f"error/{rank}"]):
                return self.store.get(f"error/{rank}").decode(errors="replace")
        except Exception:  # noqa: BLE001  (the store may be gone with the process hosting it)
            return None
        return None

    def failure(self, wait: float = 1.0) -> str | None:
        """A description of the first failed follower (its traceback when it wrote one), or None.
        ``wait``: how long to give a process that broke a collective to show as exited."""
        deadline = time.monotonic() + wait
        while True:
            for rank in range(1, self.mapping.world_size):
                error = self._error_of(rank)
                proc = self.procs.get(rank)
                code = proc.poll() if proc is not None else None
                if error is not None:
                    return f"rank {rank} raised:\n{error}"
                if proc is not None and code is not None:
                    return f"rank {rank} (pid {proc.pid}) {_describe_exit(code)}"
                if proc is not None and not _pid_exists(proc.pid):  # reaped by someone else
                    return f"rank {rank} (pid {proc.pid}) is gone"
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_S)

    # ---- shutdown

    def shutdown(self, graceful: bool = False) -> None:
        """Leaves the groups, then joins every spawned rank: ``graceful`` (they were told to exit) waits
        up to 5 s first; then SIGTERM, then SIGKILL, each bounded."""
        if self._closed:
            return
        self._closed = True
        if self.groups is not None:
            try:
                destroy_process_groups(self.groups)
            except Exception:
                logger.exception("leaving the process groups failed")
        for proc in self.procs.values():
            steps = ((None, 5.0),) if graceful else ()
            for stop, wait in (*steps, (proc.terminate, 2.0), (proc.kill, 2.0)):
                if proc.poll() is not None:
                    break
                if stop is not None:
                    stop()
                try:
                    proc.wait(wait)
                except subprocess.TimeoutExpired:
                    pass
        torch.set_num_threads(self._prev_threads)
        self.store = None
        self._base_store = None


def _with_threads(spec: ShardSpec, threads: int) -> ShardSpec:
    import dataclasses

    return dataclasses.replace(spec, num_threads=threads)


# ---------------------------------------------------------------------------------------------- followers

# Fault injection for the failure tests: INFLIGHT_FAULT="rank=R,stage=load" makes rank R raise while it
# loads its shard, "rank=R,stage=step,after=N" at its N-th step.
FAULT_ENV = "INFLIGHT_FAULT"


def _fault(rank: int, stage: str, count: int = 0) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    fields = dict(kv.split("=", 1) for kv in spec.split(",") if "=" in kv)
    due = stage != "step" or count >= int(fields.get("after", 0))
    if int(fields.get("rank", -1)) == rank and fields.get("stage") == stage and due:
        raise RuntimeError(f"injected fault ({FAULT_ENV}={spec!r}) on rank {rank}")


def spawned_follower_main(argv: list[str]) -> int:
    """The entry point of a rank spawned by :meth:`Cluster.start` (``python -m inflight.executor.follower
    HOST PORT RANK SPEC``): connects to rank 0's store, then :func:`run_follower`."""
    host, port, rank, blob = argv
    spec = pickle.loads(base64.b64decode(blob))
    base = _store(host, int(port), spec.world_size, False, spec.timeout)
    store = dist.PrefixStore("inflight/", base)
    return run_follower(spec, int(rank), store, local_rank=int(rank))


def run_follower(spec: ShardSpec, rank: int, store: Any = None, local_rank: int | None = None) -> int:
    """A follower rank: join the groups, load the shard, then run the steps rank 0 broadcasts until
    SHUTDOWN (returns 0) or a failure (its traceback is written to the store; returns 1)."""
    from inflight.models.loader import load_config

    base = None
    if store is None:  # torchrun / env://
        local = int(os.environ.get("LOCAL_WORLD_SIZE", spec.world_size))
        spec = _with_threads(spec, _threads_per_rank(local))
        store, base = _env_store(spec.world_size, spec.timeout)
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_rank = rank if local_rank is None else local_rank
    groups = None
    tp = None
    try:
        torch.set_num_threads(spec.num_threads)
        mapping = Mapping(spec.world_size, rank, spec.tp_size, spec.pp_size)
        device = torch.device(spec.device_of(local_rank))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store.set(f"joined/{rank}", "1")
        groups = init_process_groups(
            mapping, device=spec.device, timeout=spec.timeout, store=dist.PrefixStore("pg/", store)
        )
        tp, channel = data_paths(mapping, groups, spec.device, spec.timeout)
        _fault(rank, "load")
        config = load_config(spec.model)
        loaded = spec.load(device, tp, stage_of(mapping, config.num_hidden_layers))
        link = None
        if mapping.pp_size > 1:
            link = PipeLink(groups.pp, mapping, config.hidden_size, loaded.dtype, device)
        store.set(f"loaded/{rank}", "1")
        _follow(loaded.model, channel, link, mapping, device)
        return 0
    except Exception as exc:  # noqa: BLE001
        text = traceback.format_exc()
        if _is_peer_loss(exc):
            logger.error("rank %d: rank 0 is gone (%s); exiting", rank, exc)
        else:
            logger.error("rank %d failed:\n%s", rank, text)
        abort_shm(tp)
        try:
            store.set(f"error/{rank}", text)
        except Exception:  # noqa: BLE001  (the store died with rank 0)
            pass
        return 1
    finally:
        del base
        if groups is not None:
            try:
                destroy_process_groups(groups)
            except Exception:  # noqa: BLE001
                pass


def abort_shm(tp: Any) -> None:
    """Wakes the ranks waiting for this one in a shared-memory collective (they raise naming it)
    instead of leaving them to wait for this process to exit."""
    shm = getattr(tp, "shm", None)
    if shm is not None:
        try:
            shm.abort()
        except Exception:  # noqa: BLE001
            pass


def _is_peer_loss(exc: BaseException) -> bool:
    text = str(exc).lower()
    markers = ("connection closed", "connection reset", "broken pipe", "timed out", "rank 0 (pid")
    return any(s in text for s in markers)


def stage_of(mapping: Mapping, num_layers: int) -> PipelineStage:
    """The pipeline stage of ``mapping``'s rank: its layers, and whether it embeds / has the head."""
    return PipelineStage(
        mapping.layer_range(num_layers),
        first=mapping.pp_rank == 0,
        last=mapping.pp_rank == mapping.pp_size - 1,
    )


@torch.inference_mode()
def _follow(
    model: torch.nn.Module,
    channel: StepChannel | None,
    link: PipeLink | None,
    mapping: Mapping,
    device: torch.device,
) -> None:
    """The follower loop: messages from rank 0 (first stage: the step channel) or from the previous
    stage (the pipe link), each passed down the pipe before it is acted on."""
    caches = None
    steps = 0
    forward = link is not None and link.next is not None
    while True:
        if channel is not None:
            cmd, fields = channel.recv()
            payload = channel.recv_payload(fields) if cmd == STEP else None
            hidden = None
        else:
            cmd, fields, payload, hidden = link.recv()
        if cmd == STEP:
            if caches is None:
                raise RuntimeError("a step arrived before the KV pool was allocated")
            ids, md = decode_step(fields, payload, device)
            steps += 1
            _fault(mapping.rank, "step", steps)
            # Beam search's copy-on-write blocks, made in this rank's pool as rank 0 made them in its.
            copy_pool_blocks(caches, decode_block_copies(fields, payload))
            out = model(ids, md.positions, md, caches, hidden=hidden)
            if forward:
                link.send(STEP, fields, payload, out)
            elif link is not None and mapping.tp_rank == 0:  # the last stage: logits to rank 0
                link.send_logits(out)
            continue
        if forward:
            link.send(cmd, fields)
        if cmd == HEARTBEAT:
            continue
        if cmd == SHUTDOWN:
            if link is not None:
                link.flush()
            return
        if cmd == KV:
            num_blocks, tpb, dtype_index = fields[:3]
            caches = None  # the old pool first
            caches = allocate_caches(model, num_blocks, tpb, DTYPES[dtype_index], device)
        else:
            raise RuntimeError(f"unknown channel command {cmd}")
