"""Resource managers: what a request holds besides its C++ state (sequence slot, KV blocks).

``ResourceManager`` keeps them in order and calls them in that order to prepare a step, and in the
reverse order to free a request. The KV cache manager is last, so everything else is in place
before blocks are taken, and blocks are returned first.
"""

from __future__ import annotations

import abc
import itertools
import logging
import math
import mmap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from inflight.batch_manager import KVCacheManager, KvTransferKind, RequestList, SequenceSlotManager
from inflight.executor.kv_secondary_pool import SecondaryKvPool
from inflight.executor.scheduler import ScheduledRequests
from inflight.layers.attention import Fp8KvCache, Int8KvCache, KvCacheLike

logger = logging.getLogger("inflight")

# A persistent secondary tier (KvCacheConfig.host_cache_path) writes its index at shutdown, and after
# offloads at most this often while running, so that a crash loses at most this much of what was cached.
TIER_SAVE_INTERVAL_S = 10.0


class BaseResourceManager(abc.ABC):
    @abc.abstractmethod
    def prepare_resources(self, batch: ScheduledRequests) -> None: ...

    def update_resources(self, batch: ScheduledRequests, finished_contexts: Sequence) -> None:
        """After a step: ``finished_contexts`` are the requests whose last context chunk just ran."""

    @abc.abstractmethod
    def free_resources(self, request, store_for_reuse: bool = True) -> None: ...

    def shutdown(self) -> None:
        """Releases memory; the manager is unusable afterwards."""


class ResourceManager:
    """Ordered resource managers; ``free_resources`` walks them in reverse."""

    def __init__(self, managers: dict[str, BaseResourceManager]):
        self.managers = dict(managers)

    def get(self, name: str) -> BaseResourceManager | None:
        return self.managers.get(name)

    def prepare_resources(self, batch: ScheduledRequests) -> None:
        for m in self.managers.values():
            m.prepare_resources(batch)

    def update_resources(self, batch: ScheduledRequests, finished_contexts: Sequence) -> None:
        for m in self.managers.values():
            m.update_resources(batch, finished_contexts)

    def free_resources(self, request, store_for_reuse: bool = True) -> None:
        for m in reversed(list(self.managers.values())):
            m.free_resources(request, store_for_reuse)

    def shutdown(self) -> None:
        for m in reversed(list(self.managers.values())):
            m.shutdown()


class SeqSlotManager(BaseResourceManager):
    """A dense slot in ``[0, max_num_sequences)`` per running request (C++ SequenceSlotManager): the
    row of the per-request state the model engine keeps on the device (overlap mode's newest tokens),
    as TensorRT-LLM indexes its decoder state. A context gets its slot when it is first scheduled; a
    request keeps it until it finishes or is paused."""

    def __init__(self, max_num_sequences: int):
        self.impl = SequenceSlotManager(max_num_sequences, 180.0)
        self.max_num_sequences = max_num_sequences

    def prepare_resources(self, batch: ScheduledRequests) -> None:
        for req in batch.context_requests:
            if req.seq_slot is None:
                slot = self.impl.get_sequence_slot(True, req.request_id)
                if slot is None:
                    raise RuntimeError(f"no free sequence slot for request {req.request_id}")
                req.seq_slot = slot

    def free_resources(self, request, store_for_reuse: bool = True) -> None:
        self.impl.free_sequence_slot(request.request_id)
        request.seq_slot = None


def _zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor backed by an anonymous mmap (pages committed on first write)."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)  # the tensor keeps the mapping alive
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def allocate_kv_pool(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    num_blocks: int,
    tokens_per_block: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The zero-filled pool ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]`` and,
    for an int8 ``dtype``, its scales ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads]``
    float32 (else None). An fp8 ``dtype`` (``torch.float8_e4m3fn``) gets a uint8 pool of E4M3 bytes
    (:class:`Fp8KvCache`; zero bytes are +0.0) and no scales tensor.

    Never-written slots must not hold NaN/Inf patterns: attention gathers whole blocks (and padding up
    to the longest sequence of the batch), and a masked-out NaN value still poisons softmax @ V. On a CPU
    the pool is an anonymous mapping: zero pages, committed only when first written (lazy allocation).
    torch.empty is not enough there: an allocation below malloc's mmap threshold (up to 32 MiB) recycles
    freed heap memory, garbage included. GPU memory may hold anything, so it is cleared once."""

    def zeros(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        if torch.device(device).type == "cpu":
            return _zeroed_host_tensor(shape, dt)
        return torch.zeros(shape, dtype=dt, device=device)

    storage = torch.uint8 if dtype == torch.float8_e4m3fn else dtype
    pool = zeros((num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim), storage)
    scales = None
    if dtype == torch.int8:
        scales = zeros((num_layers, 2, num_blocks, tokens_per_block, num_kv_heads), torch.float32)
    return pool, scales


def layer_caches(pool: torch.Tensor, scales: torch.Tensor | None) -> list[KvCacheLike]:
    """One cache per layer, views into the pool: tensors, :class:`Int8KvCache` with scales, or for a
    uint8 pool (E4M3 bytes) :class:`Fp8KvCache` with unit scales."""
    if pool.dtype == torch.uint8:
        return [Fp8KvCache(kv) for kv in pool.unbind(0)]
    if scales is None:
        return list(pool.unbind(0))
    return [Int8KvCache(kv, s) for kv, s in zip(pool.unbind(0), scales.unbind(0))]


@dataclass
class WindowKvGroup:
    """The sliding-window layers of one window (VSWA, ``KvCacheConfig(sliding_window_pools=True)``):
    their own KV manager (``attention_window`` = the window) and pool, holding ``layers`` (model layer
    indices, in order) only. Its blocks are released as the window moves, so its pool is bounded by
    the window, not by the sequences' lengths."""

    window: int
    layers: tuple[int, ...]
    kv: KVCacheResourceManager


class KVCacheResourceManager(BaseResourceManager):
    """Owns the KV pool (torch tensors, one per layer) and drives the block accounting of a
    KVCacheManager (the C++ one, or its twin; ``impl``).

    Pool layout per layer: ``[2, num_blocks, tokens_per_block, num_kv_heads, head_dim]``; an int8 pool
    has ``scales`` beside it (one fp32 per token and KV head, :class:`Int8KvCache`). Build it with
    :meth:`allocate`; ``KVCacheResourceManager(impl)`` without a pool does the accounting only (for a
    model engine that does not read KV, as the scheduling simulator's). ``secondary``: the memory of the
    manager's secondary level (its ``num_secondary_blocks`` blocks, :class:`SecondaryKvPool`), into
    which :meth:`prepare_resources` executes the manager's transfers.
    """

    def __init__(
        self,
        impl: Any,
        pool: torch.Tensor | None = None,
        scales: torch.Tensor | None = None,
        secondary: SecondaryKvPool | None = None,
    ):
        self.impl = impl
        self.secondary = secondary
        self.tokens_per_block = impl.tokens_per_block
        self.num_blocks = impl.max_num_blocks
        self.max_seq_len = impl.max_seq_len
        self.pool = pool
        self.scales = scales
        self.dtype = pool.dtype if pool is not None else None
        # Called with each batch of copy-on-write pairs once made here: a parallel engine sends them
        # to its other ranks, whose pools must stay the same (ParallelModel.queue_block_copies).
        self.on_block_copies = None
        self.kv_caches = layer_caches(pool, scales) if pool is not None else []
        self._tier_dirty = False  # offloads since the persistent tier's index was last written
        self._tier_saved_at = time.monotonic()
        # Beam search: the KV sequences of beams other than a request's first get ids from here (far
        # above any request id).
        self._beam_ids = itertools.count(1 << 62)
        # VSWA (add_window_group): the sliding-window layers' managers and pools. This manager then
        # holds the global layers only; kv_caches still lists every layer's cache in model order.
        self.window_groups: list[WindowKvGroup] = []
        self.window_plan = None  # the budget's split (kv_cache_creator.WindowPoolPlan), set by its creator
        self._global_layers: tuple[int, ...] | None = None

    def add_window_group(self, group: WindowKvGroup, num_layers: int) -> None:
        """Registers the KV of ``group``'s layers (``num_layers``: the model's layers; this manager's
        pool holds the ones no group claims, in order). Every sequence operation is then applied to
        each group's manager too, with the same prefix hits (the fewest any manager has)."""
        if group.kv.tokens_per_block != self.tokens_per_block:
            raise ValueError(
                f"window group tokens_per_block {group.kv.tokens_per_block} != {self.tokens_per_block}"
            )
        self.window_groups.append(group)
        claimed = {i for g in self.window_groups for i in g.layers}
        self._global_layers = tuple(i for i in range(num_layers) if i not in claimed)
        if self.pool is not None:
            caches: list[Any] = [None] * num_layers
            for i, cache in zip(self._global_layers, layer_caches(self.pool, self.scales)):
                caches[i] = cache
            for g in self.window_groups:
                for i, cache in zip(g.layers, g.kv.kv_caches):
                    caches[i] = cache
            if any(c is None for c in caches):
                raise ValueError("the global pool and the window groups do not cover every layer")
            self.kv_caches = caches

    def _impls(self) -> list[Any]:
        return [self.impl, *(g.kv.impl for g in self.window_groups)]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        tokens_per_block: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device,
        enable_block_reuse: bool,
        num_secondary_blocks: int = 0,
        host_cache_path: str | None = None,
        identity: dict[str, Any] | None = None,
        attention_window: int = 0,
        kv_encoding: dict[str, str] | None = None,
    ) -> KVCacheResourceManager:
        """A C++ KVCacheManager of ``num_blocks`` blocks and the zero-filled pool they index; with
        ``num_secondary_blocks``, its secondary level and that tier's memory (a file at
        ``host_cache_path``, else host memory). With the file, block reuse and the model's
        ``identity``, the tier is persistent: the cached prefixes a previous engine left in the file
        are adopted (docs/batch-manager.md §3.10) and the index is written again at shutdown.
        ``attention_window``: the manager of the layers of one sliding window (VSWA, §3.11).
        ``kv_encoding``: what the pool's bytes stand for beyond their dtype, recorded by a persistent tier."""
        if attention_window:
            impl = KVCacheManager(
                num_blocks,
                tokens_per_block,
                max_seq_len,
                enable_block_reuse,
                attention_window=attention_window,
            )
        else:
            impl = KVCacheManager(
                num_blocks, tokens_per_block, max_seq_len, enable_block_reuse, num_secondary_blocks
            )
        pool, scales = allocate_kv_pool(
            num_layers, num_kv_heads, head_dim, num_blocks, tokens_per_block, dtype, device
        )
        secondary = None
        if num_secondary_blocks:
            tensors = [pool] if scales is None else [pool, scales]
            persistent = identity if enable_block_reuse else None
            secondary = SecondaryKvPool(
                tensors, num_secondary_blocks, host_cache_path, persistent, kv_encoding
            )
        manager = cls(impl, pool, scales, secondary)
        manager._adopt()
        return manager

    def _adopt(self) -> None:
        """Imports the blocks the persistent tier found in its file into the (fresh) manager."""
        tier = self.secondary
        if tier is None or tier.adopted is None:
            return
        try:
            self.impl.import_secondary_blocks(*tier.adopted.as_block_ids(self.num_blocks))
        except ValueError as exc:  # a well-formed file whose index the manager refuses: start empty
            tier.discard_adopted(f"its index is inconsistent: {exc}")
            return
        n = len(tier.adopted)
        logger.info(
            "KV tier file %s: adopted %d cached blocks (%d tokens) of a previous engine%s",
            tier.path,
            n,
            n * self.tokens_per_block,
            f"; {tier.dropped} dropped" if tier.dropped else "",
        )

    def save_secondary(self, flush: bool = False) -> None:
        """Writes the persistent tier's index (no-op without one): every reusable secondary block whose
        whole prefix is in the tier, with its key and a digest of its bytes. ``flush`` (at shutdown):
        first the primary pool's cached blocks move into the tier's free uncached blocks
        (``offload_reusable_blocks``), so that a prefix served from the primary pool survives too.
        Transfers still queued are executed first, so the tier holds every block the index lists."""
        tier = self.secondary
        if tier is None or not tier.persistent or self.pool is None:
            return
        if flush:
            self.impl.offload_reusable_blocks()
        self._execute(self.impl.take_transfers())
        block_ids, parents, priorities, tokens = self.impl.export_secondary_blocks()
        first = np.int32(self.num_blocks)
        slots = np.asarray(block_ids, np.int32) - first
        parent_slots = np.where(np.asarray(parents) >= 0, np.asarray(parents, np.int32) - first, -1)
        tier.save(slots, parent_slots, priorities, tokens)
        self._tier_dirty = False
        self._tier_saved_at = time.monotonic()

    @property
    def bytes(self) -> int:
        """The pool's bytes, an int8 pool's scales included."""
        if self.pool is None:
            return 0
        extra = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        extra += sum(g.kv.bytes for g in self.window_groups)
        return self.pool.numel() * self.pool.element_size() + extra

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this manager's own pool: its layers' K and V (an int8 pool's scales
        included), a window group's not."""
        if self.pool is None:
            return 0
        own = self.pool[:, :, 0].numel() * self.pool.element_size()
        if self.scales is not None:
            own += self.scales[:, :, 0].numel() * self.scales.element_size()
        return own

    def get_kv_cache_stats(self) -> dict[str, Any]:
        """The KV stats of docs/batch-manager.md as a dict (used/free blocks, hit rate, ...)."""
        stats = self.impl.get_kv_cache_stats().to_dict()
        if self.window_groups:
            stats["window_pools"] = [
                {"window": g.window, "layers": len(g.layers), **g.kv.impl.get_kv_cache_stats().to_dict()}
                for g in self.window_groups
            ]
        return stats

    def prepare_resources(self, batch: ScheduledRequests) -> None:
        kv = self.impl
        groups = self.window_groups
        for req in batch.context_requests:
            if not kv.has_sequence(req.request_id):
                # With reuse this may move the request's context position past cached blocks; a
                # request that wants its prompt's log-probabilities computes every position (no
                # lookup), as vLLM does.
                lookup = req if getattr(req, "py_prompt_logprobs", None) is None else None
                if not groups:
                    kv.add_sequence(req.request_id, req.prompt_len, 1, lookup)
                    continue
                # Every pool reuses the same prefix: the blocks all of them still hold.
                hits = -1
                if lookup is not None and kv.enable_block_reuse:
                    hits = min(impl.count_reusable_blocks(req) for impl in self._impls())
                for impl in self._impls():
                    impl.add_sequence(req.request_id, req.prompt_len, 1, lookup, hits)
            elif groups:
                # A later chunk: the window layers no longer need what its first query cannot see.
                for g in groups:
                    g.kv.impl.slide_window(req.request_id, req.context_current_position, req)
        for req in batch.generation_requests:
            beam = getattr(req, "py_beam", None)
            if beam is not None:
                for impl in self._impls():
                    for sid in beam.seq_ids:  # one token per beam; a shared last block is copied first
                        impl.add_token(sid)
                continue
            k = req.num_draft_tokens
            if k == 0:
                for impl in self._impls():
                    impl.add_token(req.request_id)
                continue
            try:
                kv.add_tokens(req.request_id, 1 + k)  # the newest token and its drafts
            except RuntimeError:
                # The planner counted the drafts; should the pool still be short, drop them (they
                # are optional) rather than the step.
                logger.debug(
                    "request %d: no KV room for %d draft tokens; decoding without", req.request_id, k
                )
                req.draft_tokens = []
                kv.add_token(req.request_id)
            for g in groups:
                g.kv.impl.add_tokens(req.request_id, 1 + req.num_draft_tokens)

        # The moves between the levels first (their order is the manager's), then the copy-on-writes.
        self.execute_transfers(kv.take_transfers())
        self.copy_blocks(kv.take_block_copies())
        for g in groups:
            g.kv.copy_blocks(g.kv.impl.take_block_copies())

    def execute_transfers(self, transfers) -> None:
        """Executes the KV manager's ``(kind, src_block, dst_block)`` moves between its levels **in
        order** (a later one may overwrite an earlier one's source): OFFLOAD copies every tensor of a
        primary block (K and V of every layer, an int8 pool's scales) to its secondary slot, ONBOARD the
        reverse."""
        self._execute(transfers)
        tier = self.secondary
        if (
            self._tier_dirty
            and tier is not None
            and tier.persistent
            and time.monotonic() - self._tier_saved_at >= TIER_SAVE_INTERVAL_S
        ):
            self.save_secondary()

    def _execute(self, transfers) -> None:
        if not transfers or self.pool is None:
            return
        if self.secondary is None:
            raise RuntimeError("the KV manager queued transfers but this pool has no secondary tier's memory")
        tensors = [self.pool] if self.scales is None else [self.pool, self.scales]
        first = self.num_blocks  # secondary block id P + i is the tier's row i
        for kind, src, dst in transfers:
            if kind == KvTransferKind.OFFLOAD:
                self.secondary.offload(tensors, src, dst - first)
                self._tier_dirty = True
            else:
                self.secondary.onboard(tensors, src - first, dst)

    @staticmethod
    def sequences(request) -> list[int]:
        """The KV sequences of ``request``: its own id, or every running beam's (beam 0 is the request's id)."""
        beam = getattr(request, "py_beam", None)
        return list(beam.seq_ids) if beam is not None else [request.request_id]

    def blocks_to_suspend(self, request) -> int:
        """Free secondary blocks :meth:`suspend` needs for ``request`` (every beam's private blocks)."""
        return sum(self.impl.get_needed_secondary_blocks_to_suspend(s) for s in self.sequences(request))

    def blocks_to_resume(self, request) -> int:
        """Free primary blocks :meth:`resume` needs for ``request`` (every beam's secondary blocks)."""
        return sum(self.impl.get_needed_blocks_to_resume(s) for s in self.sequences(request))

    def suspend(self, request) -> bool:
        """Swap-out (preemption_mode="swap"): the request's private blocks move to the secondary level
        (copied by the next :meth:`prepare_resources`); it keeps its tokens and position. A beam request
        moves all its beams or none. False, with nothing changed, when there is no secondary level, the
        request holds no KV, or the level lacks the free blocks."""
        kv = self.impl
        rid = request.request_id
        if self.secondary is None or not kv.has_sequence(rid) or kv.is_suspended(rid):
            return False
        if self.blocks_to_suspend(request) > kv.num_free_secondary_blocks:
            return False
        # Suspending one beam leaves the reference counts of the others' blocks as they were (a suspended
        # sequence still holds its shared blocks), so the count above holds for all of them.
        for sid in self.sequences(request):
            kv.suspend_sequence(sid)
        return True

    def resume(self, request) -> None:
        """Swap-in: the suspended request's blocks (every beam's) come back to the primary pool
        (onboarded by the next :meth:`prepare_resources`); RuntimeError, nothing changed, if the pool
        lacks the free blocks."""
        kv = self.impl
        need = self.blocks_to_resume(request)
        if need > kv.num_free_blocks:
            raise RuntimeError(
                f"resume: not enough free KV blocks for request_id {request.request_id}: need {need}, "
                f"free {kv.num_free_blocks}"
            )
        for sid in self.sequences(request):
            kv.resume_sequence(sid)

    def beam_copy_blocks(self, request) -> int:
        """The blocks a beam request's next decode takes for copy-on-write, which the C++ planner's
        ``get_needed_blocks_one_step`` does not count: a partly filled last block held by ``m`` beams is
        copied for ``m - 1`` of them (the last writer keeps it). 0 for any other request."""
        beam = getattr(request, "py_beam", None)
        if beam is None or len(beam.seq_ids) < 2:
            return 0
        kv, tpb = self.impl, self.tokens_per_block
        holders: dict[int, int] = {}
        for sid in beam.seq_ids:
            if kv.get_num_tokens(sid) % tpb:
                last = kv.get_block_ids(sid)[-1]
                holders[last] = holders.get(last, 0) + 1
        return sum(m - 1 for m in holders.values())

    def copy_blocks(self, pairs) -> None:
        """Executes the KV manager's copy-on-write pairs ``(src_block, dst_block)``: every layer's K and V
        of ``src_block`` into ``dst_block``. A destination is a fresh block no source can be, so the
        copies are independent: one strided copy each (no gathered temporary: a block is ~1.5 MB for
        SmolLM2)."""
        if not pairs or self.pool is None:
            return
        if self.on_block_copies is not None:
            self.on_block_copies(pairs)
        for src, dst in pairs:
            self.pool[:, :, dst].copy_(self.pool[:, :, src])
            if self.scales is not None:
                self.scales[:, :, dst].copy_(self.scales[:, :, src])

    def reorder_beams(self, request, parents: list[int]) -> None:
        """After a beam step: running beam i continues the beam ``parents[i]`` of the step before. Each
        new beam's sequence is a fork of its parent's (all blocks shared); the old sequences are then
        removed (a block no new beam holds is freed). Beam 0 keeps the request's id."""
        beam = request.py_beam
        old = beam.seq_ids
        if len(old) == 1:
            parents = [0] * len(parents)  # the first step: every beam descends from the prompt
        new = [next(self._beam_ids) for _ in parents]
        for kv in self._impls():  # the same sequence ids in every pool
            for sid, p in zip(new, parents):
                kv.fork_sequence(old[p], sid)
            for sid in old:
                kv.remove_sequence(sid)
            kv.fork_sequence(new[0], request.request_id)
            kv.remove_sequence(new[0])
        new[0] = request.request_id
        beam.seq_ids = new

    def rewind(self, request, n: int) -> None:
        """Drops the request's last ``n`` KV tokens (draft tokens that were not kept)."""
        if n > 0 and self.impl.has_sequence(request.request_id):
            for kv in self._impls():
                kv.rewind(request.request_id, n)

    def update_resources(self, batch: ScheduledRequests, finished_contexts: Sequence) -> None:
        if self.impl.enable_block_reuse:
            for req in finished_contexts:
                if self.impl.has_sequence(req.request_id):
                    for kv in self._impls():
                        kv.store_context_blocks(req)

    def free_resources(self, request, store_for_reuse: bool = True) -> None:
        beam = getattr(request, "py_beam", None)
        if beam is not None:
            # The beams' tokens are not the request's (which counts tokens only): nothing is stored
            # here. The prompt's blocks were published when its context finished.
            for kv in self._impls():
                for sid in beam.seq_ids:
                    if kv.has_sequence(sid):
                        kv.remove_sequence(sid)
            beam.seq_ids = [request.request_id]
            return
        for kv in self._impls():
            if kv.has_sequence(request.request_id):
                # Blocks of a request that failed mid-step may hold half-written KV: never publish them.
                kv.remove_sequence(request.request_id, request if store_for_reuse else None)

    def copy_block_tables(self, requests: RequestList, out) -> None:
        self.impl.copy_block_tables(requests, out)

    def shutdown(self) -> None:
        for g in self.window_groups:
            g.kv.shutdown()
        if self.secondary is not None and self.secondary.persistent and self.pool is not None:
            try:
                self.save_secondary(flush=True)
            except (OSError, ValueError) as exc:  # the engine still shuts down; the next one starts empty
                logger.warning("KV tier file %s: index not saved at shutdown: %s", self.secondary.path, exc)
        if self.secondary is not None:
            self.secondary.close()
        self.kv_caches = []
        self.pool = None
        self.scales = None
        self.secondary = None
