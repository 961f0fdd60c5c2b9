"""Pure-Python twins of the C++ batch-manager components: the executable specification.

Each class here has the interface of its C++ counterpart in ``inflight._C`` (same constructor
arguments, method and property names, return shapes and exception types) and takes the same bound
``LlmRequest`` objects, so it can stand in for the C++ class anywhere. ``tests/python/test_twins.py``
drives the C++ classes and these twins with the same random traces and asserts identical decisions
step by step. Semantics: ``shared/docs/batch-manager.md`` (TensorRT-LLM's).

Exceptions: ``ValueError`` for bad arguments and unknown request ids (C++ ``std::invalid_argument``),
``RuntimeError`` for running out of KV blocks and for failed integrity checks.

Written for clarity, not speed: the twins favour the obvious data structure over the fast one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from inflight.batch_manager import (
    DEFAULT_RETENTION_PRIORITY,
    CapacitySchedulerPolicy,
    ContextChunkingPolicy,
    KvCacheStats,
    LlmRequestState,
)

if TYPE_CHECKING:
    from inflight.batch_manager import ContextChunkingConfig, LlmRequest

__all__ = [
    "DEFAULT_RETENTION_PRIORITY",
    "CapacityScheduler",
    "KVCacheManager",
    "MicroBatchScheduler",
    "SequenceSlotManager",
]

# A cached block's key: every token of the prefix it closes (its own tokens plus its ancestors').
# Equal keys <=> equal (parent key, block tokens) chains, which is what the C++ chained hash encodes.
BlockKey = tuple[int, ...]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _state_value(state: Any) -> int:
    return int(state.value) if hasattr(state, "value") else int(state)


def _state_name(state: Any) -> str:
    return getattr(state, "name", str(state))


def _in_window(request: LlmRequest, until_state: Any, after_state: Any) -> bool:
    """State in the half-open window [until_state, after_state)."""
    return request.has_reached_state(until_state) and not request.has_reached_state(after_state)


def _check_window(until_state: Any, after_state: Any) -> None:
    if _state_value(until_state) >= _state_value(after_state):
        raise ValueError(
            f"no_schedule_until_state ({_state_name(until_state)}) must be before no_schedule_after_state "
            f"({_state_name(after_state)}): the state window is empty"
        )


# --------------------------------------------------------------------------------------------------
# KVCacheManager
# --------------------------------------------------------------------------------------------------


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    retention_priority: int = DEFAULT_RETENTION_PRIORITY
    key: BlockKey | None = None


@dataclass
class _Sequence:
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    # The request's kv_retention_priority (default without a request), for blocks added later.
    retention_priority: int = DEFAULT_RETENTION_PRIORITY


class KVCacheManager:
    """Accounting of a paged KV pool: block ids, free queue, prefix-reuse cache.

    Invariants (``check_integrity`` verifies them):
      * a block is free (ref_count 0, in the free list of its retention priority) or in use
        (ref_count = number of sequences holding it, in no free list).
      * free lists: one FIFO per retention priority (release order). Allocation takes the front of
        the lowest-priority non-empty list.
      * a sequence holds ceil(num_tokens / tpb) distinct blocks, in token order.
      * reuse cache: ``_cached`` maps a key (the prefix tokens) to the one block holding it, and that
        block's ``key`` is that key. The cached keys are closed under taking a parent (a key is only
        created under an existing parent and dropping a key drops everything below it).
    """

    def __init__(
        self,
        num_blocks: int,
        tokens_per_block: int,
        max_seq_len: int,
        enable_block_reuse: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self._num_blocks = num_blocks
        self._tokens_per_block = tokens_per_block
        self._max_seq_len = max_seq_len
        self._enable_block_reuse = bool(enable_block_reuse)
        self._blocks = [_Block(block_id) for block_id in range(num_blocks)]
        # Retention priority -> its free blocks in release order (dict: ordered, O(1) removal).
        self._free_lists: dict[int, dict[int, None]] = {
            DEFAULT_RETENTION_PRIORITY: dict.fromkeys(range(num_blocks))
        }
        self._sequences: dict[int, _Sequence] = {}
        self._cached: dict[BlockKey, int] = {}
        self._scheduling_num_free_blocks = num_blocks
        self._alloc_total_blocks = 0
        self._alloc_new_blocks = 0
        self._reused_blocks = 0
        self._missed_blocks = 0

    # ---- properties ------------------------------------------------------------------------------

    @property
    def max_num_blocks(self) -> int:
        return self._num_blocks

    @property
    def tokens_per_block(self) -> int:
        return self._tokens_per_block

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def max_blocks_per_seq(self) -> int:
        return _ceil_div(self._max_seq_len, self._tokens_per_block)

    @property
    def enable_block_reuse(self) -> bool:
        return self._enable_block_reuse

    @property
    def num_free_blocks(self) -> int:
        return sum(len(free_list) for free_list in self._free_lists.values())

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - self.num_free_blocks

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    @property
    def scheduling_num_free_blocks(self) -> int:
        return self._scheduling_num_free_blocks

    def has_sequence(self, request_id: int) -> bool:
        return request_id in self._sequences

    # ---- sequences -------------------------------------------------------------------------------

    def add_sequence(
        self,
        request_id: int,
        input_length: int,
        beam_width: int = 1,
        request: LlmRequest | None = None,
    ) -> None:
        """Allocates ceil(input_length / tpb) blocks for the whole prompt (matched prefix first).

        Raises ValueError for a bad argument and RuntimeError (state unchanged) when the free
        blocks do not suffice.
        """
        if request_id in self._sequences:
            raise ValueError(f"add_sequence: request_id {request_id} is already in the KV cache manager")
        if not 1 <= input_length <= self._max_seq_len:
            raise ValueError(
                f"add_sequence: input_length must be in [1, {self._max_seq_len}] (max_seq_len), got {input_length}"
            )
        if beam_width != 1:
            raise ValueError(f"add_sequence: only beam_width 1 is supported, got beam_width {beam_width}")
        self._check_request_id("add_sequence", request_id, request)

        num_blocks = _ceil_div(input_length, self._tokens_per_block)
        hits: list[int] = []
        if self._enable_block_reuse and request is not None:
            tokens = request.get_tokens()
            # Capped at what the request holds, so that hits * tpb < prompt_len always.
            hits = self._match_prefix(tokens, min(input_length, request.prompt_len, len(tokens)))
        num_new = num_blocks - len(hits)
        # A hit block that sits in the free queue leaves it, so it counts against the free blocks.
        num_free_needed = num_new + sum(1 for block_id in hits if self._blocks[block_id].ref_count == 0)
        if num_free_needed > self.num_free_blocks:
            raise RuntimeError(
                f"add_sequence: not enough free KV blocks for request_id {request_id}: "
                f"need {num_free_needed}, free {self.num_free_blocks}"
            )

        # Hits are claimed first, so that allocating the new blocks cannot evict one of them.
        for block_id in hits:
            self._acquire(block_id)
        priority = request.kv_retention_priority if request is not None else DEFAULT_RETENTION_PRIORITY
        new_blocks = [self._allocate_block(priority) for _ in range(num_new)]
        self._sequences[request_id] = _Sequence(hits + new_blocks, input_length, priority)

        self._reused_blocks += len(hits)
        self._missed_blocks += num_new
        self._alloc_total_blocks += num_blocks
        self._alloc_new_blocks += num_new
        if hits:
            request.set_prepopulated_prompt_len(len(hits) * self._tokens_per_block)

    def add_token(self, request_id: int) -> None:
        """One more token; a new block (of the sequence's retention priority) when it starts one."""
        sequence = self._sequence(request_id, "add_token")
        if sequence.num_tokens >= self._max_seq_len:
            raise ValueError(
                f"add_token: request_id {request_id} already holds {sequence.num_tokens} tokens, "
                f"max_seq_len is {self._max_seq_len}"
            )
        if sequence.num_tokens % self._tokens_per_block == 0:  # the new token starts a block
            if self.num_free_blocks == 0:
                raise RuntimeError(
                    f"add_token: not enough free KV blocks for request_id {request_id}: need 1, free 0"
                )
            sequence.block_ids.append(self._allocate_block(sequence.retention_priority))
            self._alloc_total_blocks += 1
            self._alloc_new_blocks += 1
        sequence.num_tokens += 1

    def remove_sequence(self, request_id: int, request: LlmRequest | None = None) -> None:
        """Stores the computed full blocks (reuse on), then frees the blocks, last block first."""
        sequence = self._sequence(request_id, "remove_sequence")
        self._check_request_id("remove_sequence", request_id, request)
        if self._enable_block_reuse and request is not None:
            # Only tokens whose KV was computed: a context still running has computed its position.
            num_stored = min(sequence.num_tokens, request.num_tokens)
            if request.is_context_init_state:
                num_stored = min(num_stored, request.context_current_position)
            self._store_blocks(
                request.get_tokens(), num_stored, sequence.block_ids, request.kv_retention_priority
            )
        # Last block first: the leaves of a prefix are evicted before their parents.
        for block_id in reversed(sequence.block_ids):
            self._release(block_id)
        del self._sequences[request_id]

    def store_context_blocks(self, request: LlmRequest) -> None:
        """Publishes the full prompt blocks of a request whose context finished (reuse only)."""
        if not self._enable_block_reuse:
            return
        sequence = self._sequence(request.request_id, "store_context_blocks")
        tokens = request.get_tokens()
        num_stored = min(request.prompt_len, len(tokens), sequence.num_tokens)
        self._store_blocks(tokens, num_stored, sequence.block_ids, request.kv_retention_priority)

    def get_block_ids(self, request_id: int) -> list[int]:
        return list(self._sequence(request_id, "get_block_ids").block_ids)

    def get_num_tokens(self, request_id: int) -> int:
        return self._sequence(request_id, "get_num_tokens").num_tokens

    def copy_block_tables(self, request_ids: Iterable[Any], out: Any) -> None:
        """Row i of ``out`` (int32 [rows, cols], C-contiguous, numpy or CPU torch) = the blocks of
        the i-th sequence, the rest of that row 0; other rows untouched. ``request_ids`` holds ids
        or requests (a RequestList)."""
        ids = [r.request_id if hasattr(r, "request_id") else r for r in request_ids]
        table = np.asarray(out)  # a view: a CPU torch tensor shares its memory with it
        if table.ndim != 2 or table.dtype != np.int32 or not table.flags.c_contiguous:
            raise TypeError(
                f"copy_block_tables: out must be a 2-D C-contiguous int32 array, got "
                f"{table.ndim}-D {table.dtype}{'' if table.flags.c_contiguous else ' (not C-contiguous)'}"
            )
        num_rows, row_stride = table.shape
        if len(ids) > num_rows:
            raise ValueError(
                f"copy_block_tables: num_rows must be >= request_ids.size() {len(ids)}, got {num_rows}"
            )
        for row, request_id in enumerate(ids):
            block_ids = self._sequence(request_id, "copy_block_tables").block_ids
            if len(block_ids) > row_stride:
                raise ValueError(
                    f"copy_block_tables: request_id {request_id} holds {len(block_ids)} blocks, "
                    f"more than row_stride {row_stride}"
                )
            table[row, :] = 0
            table[row, : len(block_ids)] = block_ids

    def get_kv_cache_stats(self) -> KvCacheStats:
        stats = KvCacheStats()
        stats.max_num_blocks = self._num_blocks
        stats.free_num_blocks = self.num_free_blocks
        stats.used_num_blocks = self.num_used_blocks
        stats.tokens_per_block = self._tokens_per_block
        stats.alloc_total_blocks = self._alloc_total_blocks
        stats.alloc_new_blocks = self._alloc_new_blocks
        stats.reused_blocks = self._reused_blocks
        stats.missed_blocks = self._missed_blocks
        lookups = self._reused_blocks + self._missed_blocks
        stats.cache_hit_rate = self._reused_blocks / lookups if lookups else 0.0
        return stats

    # ---- scheduling simulation (no real state changes) -------------------------------------------

    def start_scheduling(self) -> None:
        self._scheduling_num_free_blocks = self.num_free_blocks

    def scheduling_remove_sequence(self, request_id: int) -> None:
        """Counts as freed the sequence's blocks that no other sequence holds (unknown id: no-op)."""
        sequence = self._sequences.get(request_id)
        if sequence is None:
            return
        self._scheduling_num_free_blocks += sum(
            1 for block_id in sequence.block_ids if self._blocks[block_id].ref_count == 1
        )

    def get_needed_blocks_one_step(self, request: LlmRequest, two_steps_lookahead: bool = False) -> int:
        tpb = self._tokens_per_block
        if request.is_context_init_state:
            if not request.is_first_context_chunk:
                return 0  # the whole prompt was allocated with the first chunk
            # Prefix hits are not subtracted: a hit block may be free, and taking it costs a free block.
            return _ceil_div(request.prompt_len + request.num_draft_tokens, tpb)
        if request.is_generation_in_progress_state:
            num_past = request.prompt_len + request.num_generated_tokens - 1
            num_steps = 2 if two_steps_lookahead else 1
            if num_past + num_steps > self._max_seq_len:
                return 0
            new_blocks = _ceil_div(num_past + num_steps, tpb) - _ceil_div(num_past, tpb)
            return new_blocks * request.beam_width
        return 0

    def get_remaining_blocks_to_completion(self, request: LlmRequest) -> int:
        tpb = self._tokens_per_block
        num_context_blocks = request.prompt_len // tpb  # shared by the beams
        num_total_blocks = _ceil_div(request.prompt_len + request.max_new_tokens, tpb)
        sequence = self._sequences.get(request.request_id)
        num_held = len(sequence.block_ids) if sequence is not None else 0
        if num_held < num_context_blocks:
            remaining = (
                num_context_blocks - num_held + (num_total_blocks - num_context_blocks) * request.beam_width
            )
        else:
            remaining = (num_total_blocks - num_held) * request.beam_width
        # Negative only when tokens were added past max_new_tokens: never hand out blocks not free.
        return max(remaining, 0)

    def find_new_context_block(self, request: LlmRequest) -> Hashable | None:
        """Key of the request's first reusable prompt block not yet cached (None: all cached/none/off)."""
        if not self._enable_block_reuse:
            return None
        tokens = request.get_tokens()
        for key in self._prompt_block_keys(tokens, min(request.prompt_len, len(tokens))):
            if key not in self._cached:
                return key
        return None

    # ---- integrity -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raises RuntimeError describing the first violated invariant."""

        def fail(what: str) -> None:
            raise RuntimeError(f"KVCacheManager integrity check failed: {what}")

        free_list_of: dict[int, int] = {}  # free block -> priority of the list holding it
        for priority, free_list in self._free_lists.items():
            for block_id in free_list:
                if block_id in free_list_of:
                    fail(f"block {block_id} appears twice in the free lists")
                free_list_of[block_id] = priority

        holders = [0] * self._num_blocks
        for request_id, sequence in self._sequences.items():
            expected = _ceil_div(sequence.num_tokens, self._tokens_per_block)
            if len(sequence.block_ids) != expected:
                fail(
                    f"request_id {request_id} holds {len(sequence.block_ids)} blocks for "
                    f"{sequence.num_tokens} tokens, expected {expected}"
                )
            if len(set(sequence.block_ids)) != len(sequence.block_ids):
                fail(f"request_id {request_id} holds a block twice")
            for block_id in sequence.block_ids:
                holders[block_id] += 1

        for block in self._blocks:
            block_id = block.block_id
            if block.ref_count != holders[block_id]:
                fail(
                    f"block {block_id} has ref_count {block.ref_count} but {holders[block_id]} sequences hold it"
                )
            is_free = block_id in free_list_of
            if is_free != (block.ref_count == 0):
                fail(
                    f"block {block_id} with ref_count {block.ref_count} is {'' if is_free else 'not '}in a free list"
                )
            if is_free and free_list_of[block_id] != block.retention_priority:
                fail(
                    f"block {block_id} of retention priority {block.retention_priority} is in free list "
                    f"{free_list_of[block_id]}"
                )
            if block.key is not None and self._cached.get(block.key) != block_id:
                fail(f"the key of block {block_id} does not map to it")

        num_used = sum(1 for block in self._blocks if block.ref_count > 0)
        if num_used + len(free_list_of) != self._num_blocks:
            fail(f"free {len(free_list_of)} + used {num_used} != total {self._num_blocks}")

        tpb = self._tokens_per_block
        for key, block_id in self._cached.items():
            if self._blocks[block_id].key != key:
                fail(f"the reuse cache maps a key to block {block_id}, which does not hold that key")
            if not self._enable_block_reuse:
                fail(f"block {block_id} holds a key with reuse disabled")
            if len(key) > tpb and key[:-tpb] not in self._cached:
                fail(f"keyed block {block_id} has no keyed parent")

    # ---- internals -------------------------------------------------------------------------------

    def _sequence(self, request_id: int, caller: str) -> _Sequence:
        sequence = self._sequences.get(request_id)
        if sequence is None:
            raise ValueError(f"{caller}: request_id {request_id} is not in the KV cache manager")
        return sequence

    @staticmethod
    def _check_request_id(caller: str, request_id: int, request: LlmRequest | None) -> None:
        if request is not None and request.request_id != request_id:
            raise ValueError(
                f"{caller}: request->request_id() {request.request_id} does not match request_id {request_id}"
            )

    def _prompt_block_keys(self, tokens: Sequence[int], prompt_len: int) -> Iterable[BlockKey]:
        """Keys of the first (prompt_len - 1) // tpb full blocks: the last prompt token is never reused."""
        tpb = self._tokens_per_block
        for i in range((prompt_len - 1) // tpb):
            yield tuple(tokens[: (i + 1) * tpb])

    def _match_prefix(self, tokens: Sequence[int], prompt_len: int) -> list[int]:
        """Blocks of the longest cached chain of prompt blocks from the root (stops at the first miss)."""
        hits = []
        for key in self._prompt_block_keys(tokens, prompt_len):
            block_id = self._cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _acquire(self, block_id: int) -> None:
        """One more holder of a (cached) block; a free one leaves the free queue, keeping its key."""
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free_lists[block.retention_priority][block_id]
        block.ref_count += 1

    def _allocate_block(self, retention_priority: int) -> int:
        """Takes the front of the lowest-priority non-empty free list, for new contents."""
        priority = min(p for p, free_list in self._free_lists.items() if free_list)
        block_id = next(iter(self._free_lists[priority]))
        del self._free_lists[priority][block_id]
        block = self._blocks[block_id]
        if block.key is not None:
            self._drop_key(block.key)
        block.ref_count = 1
        block.retention_priority = retention_priority
        return block_id

    def _release(self, block_id: int) -> None:
        """One holder fewer; at zero the block goes to the back of its priority's free list."""
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free_lists.setdefault(block.retention_priority, {})[block_id] = None

    def _drop_key(self, key: BlockKey) -> None:
        """Forgets a cached key and every key chained below it (they extend it)."""
        for cached_key in [k for k in self._cached if k[: len(key)] == key]:
            self._blocks[self._cached.pop(cached_key)].key = None

    def _store_blocks(
        self,
        tokens: Sequence[int],
        num_tokens: int,
        block_ids: Sequence[int],
        retention_priority: int,
    ) -> None:
        """Publishes the full blocks of the first num_tokens tokens, walking the cache by content.

        Every block of ours takes the request's retention priority (a block it reused too, as
        TensorRT-LLM gives a reused block the priority of the request now holding it). Where the
        cache already holds another block with the same prefix, the walk moves through it and our
        block stays unkeyed; elsewhere our block is keyed.
        """
        tpb = self._tokens_per_block
        for i in range(num_tokens // tpb):
            key = tuple(tokens[: (i + 1) * tpb])
            block = self._blocks[block_ids[i]]
            block.retention_priority = retention_priority
            if key in self._cached:
                continue
            if block.key is not None:
                # Unreachable while the cache is consistent (a keyed block of ours would have been
                # found above); a stale key is dropped rather than left to corrupt the cache.
                self._drop_key(block.key)
            block.key = key
            self._cached[key] = block.block_id


# --------------------------------------------------------------------------------------------------
# CapacityScheduler
# --------------------------------------------------------------------------------------------------


_CAPACITY_POLICIES = (
    CapacitySchedulerPolicy.MAX_UTILIZATION,
    CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
    CapacitySchedulerPolicy.STATIC_BATCH,
)


class CapacityScheduler:
    """Which active requests may hold KV memory this step, and which are paused."""

    def __init__(
        self,
        max_num_requests: int,
        policy: Any = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
        no_schedule_until_state: Any = LlmRequestState.CONTEXT_INIT,
        no_schedule_after_state: Any = LlmRequestState.GENERATION_COMPLETE,
        two_steps_lookahead: bool = False,
    ) -> None:
        if max_num_requests < 1:
            raise ValueError(f"max_num_requests must be >= 1, got {max_num_requests}")
        _check_window(no_schedule_until_state, no_schedule_after_state)
        if policy not in _CAPACITY_POLICIES:
            raise ValueError(
                f"policy must be MAX_UTILIZATION, GUARANTEED_NO_EVICT or STATIC_BATCH, got {policy}"
            )
        self._max_num_requests = max_num_requests
        self._policy = policy
        self._no_schedule_until_state = no_schedule_until_state
        self._no_schedule_after_state = no_schedule_after_state
        self._two_steps_lookahead = bool(two_steps_lookahead)

    @property
    def max_num_requests(self) -> int:
        return self._max_num_requests

    @property
    def policy(self) -> CapacitySchedulerPolicy:
        return self._policy

    @property
    def no_schedule_until_state(self) -> LlmRequestState:
        return self._no_schedule_until_state

    @property
    def no_schedule_after_state(self) -> LlmRequestState:
        return self._no_schedule_after_state

    @property
    def two_steps_lookahead(self) -> bool:
        return self._two_steps_lookahead

    def schedule(
        self, active_requests: Iterable[LlmRequest], kv_cache_manager: Any
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        """(fitting, paused), both in the order of ``active_requests`` (descending priority)."""
        active = list(active_requests)
        if kv_cache_manager is None:
            return self._schedule_max_requests(active), []
        if self.policy == CapacitySchedulerPolicy.MAX_UTILIZATION:
            return self._schedule_max_utilization(active, kv_cache_manager)
        static_batch = self.policy == CapacitySchedulerPolicy.STATIC_BATCH
        return self._schedule_no_evict(active, kv_cache_manager, static_batch), []

    def _in_window(self, request: LlmRequest) -> bool:
        return _in_window(request, self.no_schedule_until_state, self.no_schedule_after_state)

    def _schedule_max_requests(self, active: list[LlmRequest]) -> list[LlmRequest]:
        return [r for r in active if self._in_window(r)][: self.max_num_requests]

    def _delays_duplicate_prefills(self, kv: Any) -> bool:
        return kv.enable_block_reuse and self.policy != CapacitySchedulerPolicy.STATIC_BATCH

    def _blocks_in_production(self, active: list[LlmRequest], kv: Any) -> set[Hashable]:
        """First new blocks of the contexts already past their first chunk (being produced)."""
        marked = set()
        for r in active:
            if self._in_window(r) and r.is_context_init_state and not r.is_first_context_chunk:
                key = kv.find_new_context_block(r)
                if key is not None:
                    marked.add(key)
        return marked

    @staticmethod
    def _is_duplicate_prefill(r: LlmRequest, kv: Any, marked: set[Hashable]) -> bool:
        """For a context on its first chunk: its first new block is being produced by another
        request (skip it this step); else marks that block as produced by this one."""
        if not (r.is_context_init_state and r.is_first_context_chunk):
            return False
        key = kv.find_new_context_block(r)
        if key in marked:
            return True
        if key is not None:
            marked.add(key)
        return False

    def _schedule_no_evict(self, active: list[LlmRequest], kv: Any, static_batch: bool) -> list[LlmRequest]:
        marked = self._blocks_in_production(active, kv) if self._delays_duplicate_prefills(kv) else None
        scheduled: list[LlmRequest] = []
        pending: list[LlmRequest] = []
        reserved_blocks = 0
        # Generating requests are always kept and reserve what they need to finish.
        for r in active:
            if not self._in_window(r):
                continue
            if len(scheduled) >= self.max_num_requests:
                break
            if r.is_generation_in_progress_state:
                scheduled.append(r)
                reserved_blocks += kv.get_remaining_blocks_to_completion(r)
            else:
                pending.append(r)
        any_generating = bool(scheduled)

        available_blocks = kv.num_free_blocks - reserved_blocks
        # The others in order, while they fit; the first that does not stops admission.
        for r in pending:
            if len(scheduled) >= self.max_num_requests:
                break
            if marked is not None and self._is_duplicate_prefill(r, kv, marked):
                continue
            if static_batch and any_generating and r.is_context_init_state and r.is_first_context_chunk:
                break
            needed_blocks = kv.get_remaining_blocks_to_completion(r)
            if needed_blocks > available_blocks:
                break
            scheduled.append(r)
            available_blocks -= needed_blocks
        return scheduled

    def _is_started(self, r: LlmRequest) -> bool:
        return self._in_window(r) and (
            (r.is_context_init_state and not r.is_first_context_chunk) or r.is_generation_in_progress_state
        )

    def _schedule_max_utilization(
        self, active: list[LlmRequest], kv: Any
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        kv.start_scheduling()
        marked = self._blocks_in_production(active, kv) if self._delays_duplicate_prefills(kv) else None
        scheduled: list[LlmRequest] = []
        paused: list[LlmRequest] = []
        scheduled_blocks = 0
        end = len(active)  # requests from `end` on were paused (the victim and all behind it)
        i = 0
        while i < end:
            r = active[i]
            if not self._in_window(r) or (marked is not None and self._is_duplicate_prefill(r, kv, marked)):
                i += 1
                continue
            needed_blocks = kv.get_needed_blocks_one_step(r, self.two_steps_lookahead)
            while not (
                len(scheduled) < self.max_num_requests
                and scheduled_blocks + needed_blocks <= kv.scheduling_num_free_blocks
            ):
                # Pause the last started request among r and those behind it, then try r again.
                victim = next((j for j in range(end - 1, i - 1, -1) if self._is_started(active[j])), None)
                if victim is None:
                    return scheduled, paused
                kv.scheduling_remove_sequence(active[victim].request_id)
                paused.append(active[victim])
                end = victim
                if victim == i:
                    return scheduled, paused
            scheduled.append(r)
            scheduled_blocks += needed_blocks
            i += 1
        return scheduled, paused


# --------------------------------------------------------------------------------------------------
# MicroBatchScheduler
# --------------------------------------------------------------------------------------------------


class MicroBatchScheduler:
    """Which fitting requests run in this forward pass, with their context chunk sizes."""

    def __init__(
        self,
        ctx_chunk_config: ContextChunkingConfig | None = None,
        max_context_length: int | None = None,
        no_schedule_until_state: Any = LlmRequestState.CONTEXT_INIT,
        no_schedule_after_state: Any = LlmRequestState.GENERATION_TO_COMPLETE,
    ) -> None:
        if max_context_length is not None and max_context_length < 1:
            raise ValueError(f"max_context_length must be >= 1, got {max_context_length}")
        _check_window(no_schedule_until_state, no_schedule_after_state)
        self._ctx_chunk_config = ctx_chunk_config
        self._max_context_length = max_context_length
        self._no_schedule_until_state = no_schedule_until_state
        self._no_schedule_after_state = no_schedule_after_state

    @property
    def ctx_chunk_config(self) -> ContextChunkingConfig | None:
        return self._ctx_chunk_config

    @property
    def max_context_length(self) -> int | None:
        return self._max_context_length

    def schedule(
        self,
        active_requests: Iterable[LlmRequest],
        inflight_request_ids: Iterable[int],
        max_batch_size: int,
        max_num_tokens: int | None,
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        """(context_requests, generation_requests); sets chunk sizes and may shorten draft tokens."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_num_tokens is not None and max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        inflight = set(inflight_request_ids)
        chunking = self.ctx_chunk_config
        max_ctx = self.max_context_length

        context: list[LlmRequest] = []
        generation: list[LlmRequest] = []
        to_chunk: list[LlmRequest] = []  # contexts collected for chunking, in order
        batch_num_tokens = 0  # generation requests and unchunked contexts
        chunked_num_tokens = 0  # collected contexts: whole remaining prompt (+ drafts on a last chunk)
        all_context_fits = True
        num_scheduled = 0
        for r in active_requests:
            if r.request_id in inflight or not _in_window(
                r, self._no_schedule_until_state, self._no_schedule_after_state
            ):
                continue
            if r.is_context_init_state:
                if chunking is None:
                    num_tokens = r.context_remaining_length + r.num_draft_tokens
                    if max_ctx is not None and num_tokens > max_ctx:
                        raise ValueError(
                            f"context of request {r.request_id} has {num_tokens} tokens, more than "
                            f"max_context_length {max_ctx} (enable context chunking)"
                        )
                    if max_num_tokens is not None and batch_num_tokens + num_tokens > max_num_tokens:
                        break
                    batch_num_tokens += num_tokens
                    r.set_context_chunk_size(r.context_remaining_length)
                    context.append(r)
                else:
                    r.set_context_chunk_size(r.context_remaining_length)
                    num_draft = r.num_draft_tokens if r.is_last_context_chunk and r.has_draft_tokens else 0
                    num_tokens = r.context_chunk_size + num_draft
                    if max_ctx is not None and num_tokens > max_ctx:
                        all_context_fits = False
                    to_chunk.append(r)
                    chunked_num_tokens += num_tokens
            else:
                num_tokens = r.beam_width + r.num_draft_tokens
                if max_num_tokens is not None and batch_num_tokens + num_tokens > max_num_tokens:
                    break
                batch_num_tokens += num_tokens
                generation.append(r)
            num_scheduled += 1
            if num_scheduled >= max_batch_size:
                break

        if chunking is not None and to_chunk:
            if max_num_tokens is not None and chunked_num_tokens > max_num_tokens - batch_num_tokens:
                all_context_fits = False
            capacity = max_num_tokens - batch_num_tokens if max_num_tokens is not None else None
            if not all_context_fits:
                self.set_ctx_requests_chunk_size(
                    to_chunk, chunking.chunking_policy, capacity, chunking.chunk_unit_size, max_ctx
                )
            self.fit_draft_tokens(to_chunk, capacity, chunking.chunk_unit_size, max_ctx)
            context = [r for r in to_chunk if r.context_chunk_size > 0]
        return context, generation

    @staticmethod
    def set_ctx_requests_chunk_size(
        contexts_to_be_chunked: Sequence[LlmRequest],
        policy: Any,
        ctx_tokens_capacity: int | None,
        chunk_unit_size: int,
        max_context_length: int | None,
    ) -> None:
        """Chunk sizes by policy for contexts that do not all fit whole (all reset to 0 first)."""
        if chunk_unit_size < 1:
            raise ValueError(f"chunk_unit_size must be >= 1, got {chunk_unit_size}")
        for r in contexts_to_be_chunked:
            r.set_context_chunk_size(0)
        capacity = ctx_tokens_capacity
        max_ctx = max_context_length
        if policy == ContextChunkingPolicy.EQUAL_PROGRESS:
            num_ctx_tokens = 0
            num_tokens_grown = 1
            while (capacity is None or num_ctx_tokens < capacity) and num_tokens_grown > 0:
                num_tokens_grown = 0
                for r in contexts_to_be_chunked:
                    past_chunk = r.context_chunk_size
                    r.set_context_chunk_size(past_chunk + chunk_unit_size)  # clamps to what remains
                    increment = r.context_chunk_size - past_chunk
                    if (capacity is not None and num_ctx_tokens + increment > capacity) or (
                        max_ctx is not None and r.context_chunk_size > max_ctx
                    ):
                        r.set_context_chunk_size(past_chunk)
                        continue
                    num_ctx_tokens += increment
                    num_tokens_grown += increment
        elif policy == ContextChunkingPolicy.FIRST_COME_FIRST_SERVED:
            for r in contexts_to_be_chunked:
                remaining = r.context_remaining_length
                chunk = remaining
                if capacity is not None:
                    chunk = min(capacity, chunk)
                if max_ctx is not None:
                    chunk = min(max_ctx, chunk)
                if chunk != remaining:
                    chunk = chunk // chunk_unit_size * chunk_unit_size
                r.set_context_chunk_size(chunk)
                if capacity is not None:
                    capacity -= r.context_chunk_size
        else:
            raise ValueError(f"policy must be FIRST_COME_FIRST_SERVED or EQUAL_PROGRESS, got {policy}")

    @staticmethod
    def fit_draft_tokens(
        contexts_to_be_chunked: Sequence[LlmRequest],
        ctx_tokens_capacity: int | None,
        chunk_unit_size: int,
        max_context_length: int | None,
    ) -> None:
        """Drops the draft tokens of last chunks that would cost an extra unit or pass a limit."""
        num_used = sum(r.context_chunk_size for r in contexts_to_be_chunked)
        for r in contexts_to_be_chunked:
            if not (r.is_last_context_chunk and r.has_draft_tokens):
                continue
            chunk = r.context_chunk_size
            # Room left in the last unit: drafts never start a new unit (so never a new KV block).
            room = (chunk_unit_size - chunk % chunk_unit_size) % chunk_unit_size
            if max_context_length is not None:
                room = min(room, max_context_length - chunk)
            if ctx_tokens_capacity is not None:
                room = min(room, ctx_tokens_capacity - num_used)
            room = max(room, 0)
            num_draft = r.num_draft_tokens
            num_used += min(room, num_draft)
            if room < num_draft:
                r.truncate_draft_tokens(room)


# --------------------------------------------------------------------------------------------------
# SequenceSlotManager
# --------------------------------------------------------------------------------------------------


class SequenceSlotManager:
    """Request ids -> dense slots in [0, max_num_slots). Free slots form a FIFO (freed to the back)."""

    def __init__(self, max_num_slots: int, max_idle_seconds: float = 180.0) -> None:
        if max_num_slots < 1:
            raise ValueError(f"max_num_slots must be >= 1, got {max_num_slots}")
        if not max_idle_seconds >= 0:
            raise ValueError(f"max_idle_seconds must be >= 0, got {max_idle_seconds}")
        self._max_num_slots = max_num_slots
        self._max_idle_seconds = float(max_idle_seconds)
        self._free_slots: deque[int] = deque(range(max_num_slots))
        self._slots: dict[int, int] = {}  # request id -> slot
        self._last_used: dict[int, float] = {}  # request id -> time.monotonic()

    @property
    def max_num_slots(self) -> int:
        return self._max_num_slots

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_used_slots(self) -> int:
        return len(self._slots)

    def get_sequence_slot(self, start: bool, request_id: int) -> int | None:
        """The request's slot (refreshing its time), else a new one when ``start``; None when full."""
        if request_id in self._slots:
            self._last_used[request_id] = time.monotonic()
            return self._slots[request_id]
        if not start or not self._free_slots:
            return None
        slot = self._free_slots.popleft()
        self._slots[request_id] = slot
        self._last_used[request_id] = time.monotonic()
        return slot

    def free_sequence_slot(self, request_id: int) -> None:
        """Frees the request's slot; unknown ids are ignored."""
        slot = self._slots.pop(request_id, None)
        if slot is None:
            return
        del self._last_used[request_id]
        self._free_slots.append(slot)

    def free_idle_sequence_slots(self) -> list[int]:
        """Frees the slots unused for longer than max_idle_seconds, in slot order (so the free FIFO
        stays deterministic); returns their request ids."""
        now = time.monotonic()
        idle = sorted(
            (slot, request_id)
            for request_id, slot in self._slots.items()
            if now - self._last_used[request_id] > self._max_idle_seconds
        )
        for _, request_id in idle:
            self.free_sequence_slot(request_id)
        return [request_id for _, request_id in idle]
