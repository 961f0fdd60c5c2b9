"""Rank 0's side of a parallel engine: :class:`ParallelModel`, what the model engine calls instead of
the model. Each forward broadcasts the step's plan, runs rank 0's shard (the other ranks run theirs at
the same time), and returns the logits gathered on rank 0. A heartbeat thread keeps gloo followers
from timing out while idle and watches the spawned processes, so a rank killed while the engine is
idle is noticed within a second (docs/architecture.md, "Parallelism").
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from inflight.executor.parallel_runtime import Cluster, RankFailure, abort_shm
from inflight.executor.step_channel import DTYPES, HEARTBEAT, KV, SHUTDOWN, STEP, encode_step, num_logits
from inflight.layers.attention import AttentionMetadata

logger = logging.getLogger("inflight")

__all__ = ["HEARTBEAT_S", "ParallelModel"]

# Seconds between heartbeats while idle, at most (and at most a quarter of the collective timeout).
HEARTBEAT_S = 2.0


class _InPipe:
    """A micro-batch launched down the pipeline: its logits come back from the last stage."""

    def __init__(self, rows: int) -> None:
        self.rows = rows


class ParallelModel:
    """What rank 0's :class:`~inflight.executor.model_engine.ModelEngine` calls instead of the model:
    the same ``(input_ids, positions, metadata, kv_caches) -> logits``, run on every rank.

    With pipeline stages, :meth:`launch` runs rank 0's stage and sends the micro-batch down the pipe
    (returning at once), and :meth:`collect` waits for its logits: the executor keeps up to
    ``pipeline_depth`` micro-batches between the two."""

    def __init__(self, model: torch.nn.Module, cluster: Cluster) -> None:
        self.model = model
        self.cluster = cluster
        self.channel = cluster.channel
        self.link = cluster.link
        self.pipeline_depth = cluster.mapping.pp_size
        self.vocab_size = model.config.vocab_size
        self._lock = threading.Lock()  # one message at a time on the channel, in order
        self._failed: RankFailure | None = None
        self._last_sent = time.monotonic()
        self._stop = threading.Event()
        self.on_failure = None  # called once with the RankFailure (the executor's fail())
        # KV block copies rank 0 made since the last step (beam search's copy-on-write): every rank
        # makes them before that step (KVCacheResourceManager.on_block_copies calls queue_block_copies).
        self._block_copies: list[tuple[int, int]] = []
        self.steps = 0
        self.heartbeats = 0
        self._interval = min(HEARTBEAT_S, cluster.spec.timeout / 4)
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, name="inflight-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def __getattr__(self, name: str):  # the model's other members (num_layers, kv_cache_shape, ...)
        return getattr(self.__dict__["model"], name)

    @property
    def failed(self) -> RankFailure | None:
        return self._failed

    def _fail(self, exc: BaseException | None, during: str) -> RankFailure:
        with_reason = self.cluster.failure(wait=2.0)
        if with_reason is None:
            detail = f"{type(exc).__name__}: {exc}" if exc is not None else "no answer"
            with_reason = f"a rank stopped answering during {during} ({detail})"
        failure = RankFailure(f"parallel engine ({self.cluster.describe()}): {with_reason}")
        first = self._failed is None
        if first:
            self._failed = failure
            abort_shm(self.model.tp)  # a step waiting in the fused stack's all-reduce raises now
            logger.error("%s", failure)
            callback = self.on_failure
            if callback is not None:
                callback(failure)
        return self._failed

    def _check(self) -> None:
        if self._failed is not None:
            raise self._failed

    def allocate_kv(self, num_blocks: int, tokens_per_block: int, dtype: torch.dtype) -> None:
        """Every follower allocates its KV pool: the same number of blocks as rank 0's."""
        with self._lock:
            self._check()
            try:
                fields = (num_blocks, tokens_per_block, DTYPES.index(dtype))
                self.channel.send(KV, *fields)
                if self.link is not None:
                    self.link.send(KV, fields)
            except Exception as exc:
                raise self._fail(exc, "the KV allocation") from exc
            self._last_sent = time.monotonic()

    def queue_block_copies(self, pairs) -> None:
        """``(src, dst)`` KV block copies rank 0 made in its pool; sent with the next step, so that the
        other ranks make them in theirs before running it."""
        with self._lock:
            self._block_copies.extend((int(s), int(d)) for s, d in pairs)

    def __call__(self, input_ids, positions, metadata: AttentionMetadata, kv_caches):
        return self.collect(self.launch(input_ids, positions, metadata, kv_caches))

    def launch(self, input_ids, positions, metadata: AttentionMetadata, kv_caches):
        """Runs the step on every rank of the first stage (the logits, with one stage) and sends it
        down the pipeline (a handle for :meth:`collect`)."""
        with self._lock:
            self._check()
            try:
                fields, payload = encode_step(input_ids, metadata, self._block_copies)
                self._block_copies = []
                self.channel.send_step(fields, payload)
                out = self.model(input_ids, positions, metadata, kv_caches)
                if self.link is not None:
                    self.link.send(STEP, fields, payload, out)
                    out = _InPipe(num_logits(fields))
            except Exception as exc:
                raise self._fail(exc, "a step") from exc
            self._last_sent = time.monotonic()
            self.steps += 1
            return out

    def collect(self, launched):
        """The logits of a launched step (waits for the last stage)."""
        if not isinstance(launched, _InPipe):
            return launched
        with self._lock:
            self._check()
            try:
                return self.link.recv_logits(launched.rows, self.vocab_size)
            except Exception as exc:
                raise self._fail(exc, "a step") from exc

    def comm_stats(self) -> dict[str, float]:
        """Rank 0's seconds in communication so far: the plan broadcasts and the model's collectives
        (all-reduces and the logits gather), and the steps they were spent over."""
        tp = self.model.tp
        seconds, calls = tp.comm_seconds()
        if tp.shm is not None:  # the fused stack calls the shared-memory all-reduce from C++ directly
            seconds, calls = tp.shm.seconds, tp.shm.calls
        return {
            "steps": self.steps,
            "broadcast_s": self.channel.seconds + (self.link.seconds if self.link is not None else 0.0),
            "collectives_s": seconds,
            "collectives": calls,
            "pipe_wait_s": self.link.wait_seconds if self.link is not None else 0.0,
        }

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(min(0.25, self._interval)):
            if self._failed is not None:
                return
            dead = self.cluster.failure(wait=0.0) if self.cluster.procs else None
            if dead is not None:
                self._fail(None, "idle time")
                return
            needed = self.channel.needs_heartbeat or self.link is not None
            if not needed or time.monotonic() - self._last_sent < self._interval:
                continue
            if not self._lock.acquire(timeout=0.1):
                continue  # a step is on the channel
            try:
                if self._failed is None and not self._stop.is_set():
                    self.channel.send(HEARTBEAT)
                    if self.link is not None:
                        self.link.send(HEARTBEAT)
                    self._last_sent = time.monotonic()
                    self.heartbeats += 1
            except Exception as exc:  # noqa: BLE001
                self._lock.release()
                self._fail(exc, "a heartbeat")
                return
            self._lock.release()

    def shutdown(self) -> None:
        """Tells the followers to exit (unless one failed), then shuts the cluster down."""
        self._stop.set()
        self._heartbeat.join(5.0)
        told = False
        with self._lock:
            if self._failed is None:
                try:
                    self.channel.send(SHUTDOWN)
                    if self.link is not None:
                        self.link.send(SHUTDOWN)
                        self.link.flush()
                    told = True
                except Exception:  # noqa: BLE001
                    logger.warning("could not tell the followers to shut down; stopping them")
        self.cluster.shutdown(graceful=told)
        self.model = None
