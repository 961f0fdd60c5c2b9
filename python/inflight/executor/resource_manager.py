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
from collections.abc import Sequence
from typing import Any

import torch

from inflight.batch_manager import KVCacheManager, RequestList, SequenceSlotManager
from inflight.executor.scheduler import ScheduledRequests

logger = logging.getLogger("inflight")


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


class KVCacheResourceManager(BaseResourceManager):
    """Owns the KV pool (torch tensors, one per layer) and drives the block accounting of a
    KVCacheManager (the C++ one, or its twin; ``impl``).

    Pool layout per layer: ``[2, num_blocks, tokens_per_block, num_kv_heads, head_dim]``. Build it with
    :meth:`allocate`; ``KVCacheResourceManager(impl)`` without a pool does the accounting only (for a
    model engine that does not read KV, as the scheduling simulator's).
    """

    def __init__(self, impl: Any, pool: torch.Tensor | None = None):
        self.impl = impl
        self.tokens_per_block = impl.tokens_per_block
        self.num_blocks = impl.max_num_blocks
        self.max_seq_len = impl.max_seq_len
        self.pool = pool
        self.dtype = pool.dtype if pool is not None else None
        self.kv_caches = list(pool.unbind(0)) if pool is not None else []
        # Beam search: the KV sequences of beams other than a request's first get ids from here (far
        # above any request id).
        self._beam_ids = itertools.count(1 << 62)

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
    ) -> KVCacheResourceManager:
        """A C++ KVCacheManager of ``num_blocks`` blocks and the zero-filled pool they index."""
        impl = KVCacheManager(num_blocks, tokens_per_block, max_seq_len, enable_block_reuse)
        shape = (num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim)
        # Never-written slots must not hold NaN/Inf patterns: attention gathers whole blocks (and
        # padding up to the longest sequence of the batch), and a masked-out NaN value still poisons
        # softmax @ V. On a CPU the pool is an anonymous mapping: zero pages, committed only when
        # first written (lazy allocation). torch.empty is not enough there: an allocation below
        # malloc's mmap threshold (up to 32 MiB) recycles freed heap memory, garbage included.
        # GPU memory may hold anything, so it is cleared once.
        if device.type == "cpu":
            pool = _zeroed_host_tensor(shape, dtype)
        else:
            pool = torch.zeros(shape, dtype=dtype, device=device)
        return cls(impl, pool)

    @property
    def bytes(self) -> int:
        return 0 if self.pool is None else self.pool.numel() * self.pool.element_size()

    def get_kv_cache_stats(self) -> dict[str, Any]:
        """The KV stats of docs/batch-manager.md as a dict (used/free blocks, hit rate, ...)."""
        return self.impl.get_kv_cache_stats().to_dict()

    def prepare_resources(self, batch: ScheduledRequests) -> None:
        kv = self.impl
        for req in batch.context_requests:
            if not kv.has_sequence(req.request_id):
                # With reuse this may move the request's context position past cached blocks; a
                # request that wants its prompt's log-probabilities computes every position (no
                # lookup), as vLLM does.
                lookup = req if getattr(req, "py_prompt_logprobs", None) is None else None
                kv.add_sequence(req.request_id, req.prompt_len, 1, lookup)
        for req in batch.generation_requests:
            beam = getattr(req, "py_beam", None)
            if beam is not None:
                for sid in beam.seq_ids:  # one token per beam; a shared last block is copied first
                    kv.add_token(sid)
                continue
            k = req.num_draft_tokens
            if k == 0:
                kv.add_token(req.request_id)
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

        self.copy_blocks(kv.take_block_copies())

    def copy_blocks(self, pairs) -> None:
        """Executes the KV manager's copy-on-write pairs ``(src_block, dst_block)``: every layer's K and V
        of ``src_block`` into ``dst_block``. A destination is a fresh block no source can be, so the
        copies are independent: one strided copy each (no gathered temporary: a block is ~1.5 MB for
        SmolLM2)."""
        if not pairs or self.pool is None:
            return
        for src, dst in pairs:
            self.pool[:, :, dst].copy_(self.pool[:, :, src])

    def reorder_beams(self, request, parents: list[int]) -> None:
        """After a beam step: running beam i continues the beam ``parents[i]`` of the step before. Each
        new beam's sequence is a fork of its parent's (all blocks shared); the old sequences are then
        removed (a block no new beam holds is freed). Beam 0 keeps the request's id."""
        kv = self.impl
        beam = request.py_beam
        old = beam.seq_ids
        if len(old) == 1:
            parents = [0] * len(parents)  # the first step: every beam descends from the prompt
        new = [next(self._beam_ids) for _ in parents]
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
            self.impl.rewind(request.request_id, n)

    def update_resources(self, batch: ScheduledRequests, finished_contexts: Sequence) -> None:
        if self.impl.enable_block_reuse:
            for req in finished_contexts:
                if self.impl.has_sequence(req.request_id):
                    self.impl.store_context_blocks(req)

    def free_resources(self, request, store_for_reuse: bool = True) -> None:
        beam = getattr(request, "py_beam", None)
        if beam is not None:
            # The beams' tokens are not the request's (which counts tokens only): nothing is stored
            # here. The prompt's blocks were published when its context finished.
            for sid in beam.seq_ids:
                if self.impl.has_sequence(sid):
                    self.impl.remove_sequence(sid)
            beam.seq_ids = [request.request_id]
            return
        if self.impl.has_sequence(request.request_id):
            # Blocks of a request that failed mid-step may hold half-written KV: never publish them.
            self.impl.remove_sequence(request.request_id, request if store_for_reuse else None)

    def copy_block_tables(self, requests: RequestList, out) -> None:
        self.impl.copy_block_tables(requests, out)

    def shutdown(self) -> None:
        self.kv_caches = []
        self.pool = None
