"""Pure-Python twin of ``KVCacheManager``: ``csrc/batch_manager/kv_cache_manager.cpp`` and
``csrc/include/inflight/batch_manager/kv_cache_manager.h``.

Accounting only: the twin hands out block ids, like the C++ class; the KV memory itself is a tensor
owned by Python. Requests are borrowed for the duration of a call and never stored.

Data and its invariants (``KVCacheManager.check_integrity`` verifies them and raises RuntimeError
naming the first one violated):

* ``_blocks[i]`` is block ``i`` (the pool owns every block): primary blocks ``0 .. num_blocks - 1``,
  then secondary blocks ``num_blocks .. num_blocks + num_secondary_blocks - 1``; ``level`` is fixed by
  the id. A block is either free (``ref_count`` 0, in exactly one free list: the one of its level and
  ``retention_priority``) or in use (``ref_count`` = the number of sequences holding it, in no free
  list); per level, free + used = the level's size.
* ``_free_lists[level][p]`` holds the free blocks of that level and retention priority ``p`` in
  release order, oldest first (a dict used as an ordered set, so that a prefix hit can take a block
  out of the middle). Together a level's lists are its free queue: a release appends to the back of
  its list (a secondary block released without a key goes to the front of the priority-0 list: it
  caches nothing), an allocation takes the front of the lowest-priority non-empty list.
* ``_sequences[request_id]`` holds ``ceil(num_tokens / tokens_per_block)`` distinct blocks in token
  order; a block may be shared by several sequences only through prefix reuse or forks. An active
  sequence holds primary blocks only; a suspended one also holds secondary blocks, each held by it
  alone.
* ``_cached`` maps a key to the one block holding it (either level), and that block's ``key`` is that
  key. A key is the tuple of every token of the prefix its block closes. Keys are closed under taking
  a parent (``key[:-tokens_per_block]``): a key is only set under an existing parent, and dropping a
  key drops every key that extends it. A free block keeps its key until its memory is taken; a
  primary block's key then moves to a secondary block (offload) when the priority and the secondary
  pool allow, and a secondary block's key moves to a primary block on a hit (onboard).
* ``_transfers`` lists the moves of KV between levels not yet taken, in the order they happened.
* Sliding window (``attention_window`` W > 0, for the layers of one window; docs/batch-manager.md
  §3.11): a sequence's ``block_ids`` entry is ``-1`` for a block released because no query of the
  sequence can see it any more (every one of its tokens is before ``q - W + 1`` for the sequence's
  next query position ``q``). Released entries form a prefix of ``block_ids``; the list keeps one
  entry per block of the sequence, so block ``i`` still covers tokens ``[i * tpb, (i + 1) * tpb)``.

Where the twin deliberately differs from the C++ in representation (never in decisions): the C++
identifies a cached prefix by a chained 64-bit hash, checked token by token on lookup, and
``find_new_context_block`` returns that hash; the twin uses the prefix tuple itself and returns it.
Callers only compare the result for equality or with ``None``.

Semantics: ``docs/batch-manager.md``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from inflight.batch_manager import (
    DEFAULT_RETENTION_PRIORITY,
    DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY,
    PRIMARY_LEVEL,
    SECONDARY_LEVEL,
    KvCacheStats,
    KvTransferKind,
)

if TYPE_CHECKING:
    from inflight.batch_manager import LlmRequest

__all__ = ["KVCacheManager"]

# A cached block's key: every token of the prefix it closes (its own tokens plus its ancestors').
# Equal keys <=> equal (parent key, block tokens) chains, which is what the C++ chained hash encodes.
BlockKey = tuple[int, ...]
# A pending move between levels: (kind, src_block, dst_block), as take_transfers returns it.
Transfer = tuple[KvTransferKind, int, int]
_MIN_RETENTION_PRIORITY = 0
_INT32_MAX = 2**31 - 1


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Block:
    block_id: int
    level: int = PRIMARY_LEVEL
    ref_count: int = 0
    retention_priority: int = DEFAULT_RETENTION_PRIORITY
    key: BlockKey | None = None


@dataclass
class _Sequence:
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    # The request's kv_retention_priority (default without a request), for blocks added later.
    retention_priority: int = DEFAULT_RETENTION_PRIORITY
    suspended: bool = False  # swapped out: its private blocks are secondary blocks
    num_released: int = 0  # sliding window: entries block_ids[:num_released] are -1 (released)


class KVCacheManager:
    """Accounting of a paged KV pool: block ids, free queue, prefix-reuse cache.

    The invariants are listed in the module docstring; ``check_integrity`` verifies them.
    """

    def __init__(
        self,
        num_blocks: int,
        tokens_per_block: int,
        max_seq_len: int,
        enable_block_reuse: bool = False,
        num_secondary_blocks: int = 0,
        secondary_offload_min_priority: int = DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY,
        attention_window: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if not 0 <= num_secondary_blocks <= _INT32_MAX - num_blocks:
            raise ValueError(
                f"num_secondary_blocks must be in [0, {_INT32_MAX - num_blocks}], got {num_secondary_blocks}"
            )
        if not 0 <= secondary_offload_min_priority <= 100:
            raise ValueError(
                f"secondary_offload_min_priority must be in [0, 100], got {secondary_offload_min_priority}"
            )
        if attention_window < 0:
            raise ValueError(f"attention_window must be >= 0 (0: no window), got {attention_window}")
        if attention_window and num_secondary_blocks:
            raise ValueError(
                f"attention_window {attention_window} with num_secondary_blocks {num_secondary_blocks}: "
                "a sliding-window manager has no secondary level"
            )
        self._attention_window = attention_window
        self._num_blocks = num_blocks
        self._num_secondary_blocks = num_secondary_blocks
        self._secondary_offload_min_priority = secondary_offload_min_priority
        self._tokens_per_block = tokens_per_block
        self._max_seq_len = max_seq_len
        self._enable_block_reuse = bool(enable_block_reuse)
        total = num_blocks + num_secondary_blocks
        self._blocks = [
            _Block(block_id, PRIMARY_LEVEL if block_id < num_blocks else SECONDARY_LEVEL)
            for block_id in range(total)
        ]
        # Per level: retention priority -> its free blocks in release order (dict: ordered, O(1) removal).
        self._free_lists: list[dict[int, dict[int, None]]] = [
            {DEFAULT_RETENTION_PRIORITY: dict.fromkeys(range(num_blocks))},
            {DEFAULT_RETENTION_PRIORITY: dict.fromkeys(range(num_blocks, total))},
        ]
        self._sequences: dict[int, _Sequence] = {}
        self._cached: dict[BlockKey, int] = {}
        self._scheduling_num_free_blocks = num_blocks
        self._alloc_total_blocks = 0
        self._alloc_new_blocks = 0
        self._block_copies: list[tuple[int, int]] = []  # pending copy-on-writes (take_block_copies)
        self._reused_blocks = 0
        self._missed_blocks = 0
        self._transfers: list[Transfer] = []  # pending moves between levels (take_transfers)
        self._offloaded_blocks = 0
        self._onboarded_blocks = 0
        self._secondary_reused_blocks = 0

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
    def attention_window(self) -> int:
        """The window W of the layers this manager serves (0: global layers, nothing released)."""
        return self._attention_window

    @property
    def num_free_blocks(self) -> int:
        """Free primary blocks (the level sequences are allocated from)."""
        return self._num_free(PRIMARY_LEVEL)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - self.num_free_blocks

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    @property
    def scheduling_num_free_blocks(self) -> int:
        return self._scheduling_num_free_blocks

    @property
    def num_secondary_blocks(self) -> int:
        return self._num_secondary_blocks

    @property
    def num_free_secondary_blocks(self) -> int:
        return self._num_free(SECONDARY_LEVEL)

    @property
    def num_used_secondary_blocks(self) -> int:
        return self._num_secondary_blocks - self._num_free(SECONDARY_LEVEL)

    @property
    def secondary_offload_min_priority(self) -> int:
        return self._secondary_offload_min_priority

    @property
    def num_suspended_sequences(self) -> int:
        return sum(1 for sequence in self._sequences.values() if sequence.suspended)

    def has_sequence(self, request_id: int) -> bool:
        return request_id in self._sequences

    def is_suspended(self, request_id: int) -> bool:
        """Whether the sequence is swapped out (False for an unknown id)."""
        sequence = self._sequences.get(request_id)
        return sequence is not None and sequence.suspended

    def get_block_level(self, block_id: int) -> int:
        """PRIMARY_LEVEL (ids below max_num_blocks) or SECONDARY_LEVEL."""
        if not 0 <= block_id < len(self._blocks):
            raise ValueError(
                f"get_block_level: block_id must be in [0, {len(self._blocks) - 1}] "
                f"(num_blocks + num_secondary_blocks - 1), got {block_id}"
            )
        return self._blocks[block_id].level

    # ---- sequences -------------------------------------------------------------------------------

    def add_sequence(
        self,
        request_id: int,
        input_length: int,
        beam_width: int = 1,
        request: LlmRequest | None = None,
        max_reused_blocks: int = -1,
    ) -> None:
        """Allocates ceil(input_length / tpb) blocks (matched prefix first): the whole prompt, or with
        a window the first context chunk (later chunks come with ``add_tokens``).
        ``max_reused_blocks`` >= 0 caps the prefix hits (an engine with several managers reuses the
        blocks every one of them holds: the minimum of their ``count_reusable_blocks``). With a
        window, the blocks no query can see are released at once (:meth:`slide_window`).

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
            if max_reused_blocks >= 0:
                hits = hits[:max_reused_blocks]
        num_new = num_blocks - len(hits)
        num_secondary_hits = sum(1 for b in hits if self._blocks[b].level == SECONDARY_LEVEL)
        # A hit block that sits in the free queue leaves it, so it counts against the free blocks; a
        # secondary hit is onboarded into a fresh primary block.
        num_free_needed = (
            num_new
            + num_secondary_hits
            + sum(
                1 for b in hits if self._blocks[b].level == PRIMARY_LEVEL and self._blocks[b].ref_count == 0
            )
        )
        if num_free_needed > self.num_free_blocks:
            raise RuntimeError(
                f"add_sequence: not enough free KV blocks for request_id {request_id}: "
                f"need {num_free_needed}, free {self.num_free_blocks}"
            )

        # Hits are claimed first, so that allocating the new blocks cannot evict one of them. A free
        # secondary hit is pinned the same way until its contents moved to primary; one held by a
        # suspended sequence stays that sequence's.
        pinned = []
        for block_id in hits:
            block = self._blocks[block_id]
            if block.level == SECONDARY_LEVEL:
                if block.ref_count == 0:
                    del self._free_lists[SECONDARY_LEVEL][block.retention_priority][block_id]
                    block.ref_count = 1
                    pinned.append(block_id)
                continue
            self._acquire(block_id)
        hits = [self._onboard(b) if self._blocks[b].level == SECONDARY_LEVEL else b for b in hits]
        priority = request.kv_retention_priority if request is not None else DEFAULT_RETENTION_PRIORITY
        new_blocks = [self._allocate_block(priority) for _ in range(num_new)]
        for block_id in reversed(pinned):  # they hold no key any more
            self._release(block_id)
        self._sequences[request_id] = _Sequence(hits + new_blocks, input_length, priority)

        self._reused_blocks += len(hits)
        self._secondary_reused_blocks += num_secondary_hits
        self._missed_blocks += num_new
        self._alloc_total_blocks += num_blocks
        self._alloc_new_blocks += num_new
        if hits:
            request.set_prepopulated_prompt_len(len(hits) * self._tokens_per_block)
        if self._attention_window:
            self._slide(self._sequences[request_id], len(hits) * self._tokens_per_block, request)

    def count_reusable_blocks(self, request: LlmRequest) -> int:
        """The prompt blocks :meth:`add_sequence` would reuse for ``request`` now (0 with reuse off)."""
        if not self._enable_block_reuse:
            return 0
        tokens = request.get_tokens()
        return len(self._match_prefix(tokens, min(request.prompt_len, len(tokens))))

    def slide_window(self, request_id: int, first_query_pos: int, request: LlmRequest | None = None) -> None:
        """Releases the blocks that no query at ``first_query_pos`` or later can see: those whose
        tokens all precede ``first_query_pos - attention_window + 1`` (no-op without a window). With
        reuse and ``request``, a released full block is stored for reuse first (its prefix keyed, as
        :meth:`remove_sequence` would), if its parent is cached."""
        sequence = self._active_sequence(request_id, "slide_window")
        if not 0 <= first_query_pos <= sequence.num_tokens:
            raise ValueError(
                f"slide_window: first_query_pos must be in [0, {sequence.num_tokens}] (the tokens of "
                f"request_id {request_id}), got {first_query_pos}"
            )
        self._check_request_id("slide_window", request_id, request)
        self._slide(sequence, first_query_pos, request)

    def get_num_held_blocks(self, request_id: int) -> int:
        """The blocks the sequence holds (its released window blocks not counted)."""
        sequence = self._sequence(request_id, "get_num_held_blocks")
        return len(sequence.block_ids) - sequence.num_released

    def _slide(self, sequence: _Sequence, first_query_pos: int, request: LlmRequest | None) -> None:
        window = self._attention_window
        if not window:
            return
        tpb = self._tokens_per_block
        num_dead = max(0, first_query_pos - window + 1) // tpb
        if num_dead <= sequence.num_released:
            return
        if self._enable_block_reuse and request is not None:
            self._store_blocks(
                request.get_tokens(),
                min(num_dead * tpb, request.num_tokens),
                sequence.block_ids,
                request.kv_retention_priority,
            )
        for i in range(sequence.num_released, num_dead):  # oldest first: evicted first
            self._release(sequence.block_ids[i])
            sequence.block_ids[i] = -1
        sequence.num_released = num_dead

    def _cow_blocks(self, sequence) -> int:
        """1 when the next token lands in a last block another sequence also holds."""
        if sequence.num_tokens % self._tokens_per_block == 0 or not sequence.block_ids:
            return 0
        return 1 if self._blocks[sequence.block_ids[-1]].ref_count > 1 else 0

    def _copy_on_write(self, sequence) -> None:
        shared = sequence.block_ids[-1]
        fresh = self._allocate_block(sequence.retention_priority)
        self._blocks[shared].ref_count -= 1  # still >= 1: another sequence holds it
        sequence.block_ids[-1] = fresh
        self._block_copies.append((shared, fresh))
        self._alloc_total_blocks += 1
        self._alloc_new_blocks += 1

    def fork_sequence(self, src_id: int, dst_id: int) -> None:
        """Beam search: ``dst_id`` holds the very blocks of ``src_id`` (each ref_count + 1) and its token
        count; a later write into the shared, partly filled last block copies it first."""
        src = self._active_sequence(src_id, "fork_sequence")
        if dst_id in self._sequences:
            raise ValueError(f"fork_sequence: request_id {dst_id} is already in the KV cache manager")
        dst = _Sequence(list(src.block_ids), src.num_tokens, src.retention_priority)
        dst.num_released = src.num_released
        for block_id in dst.block_ids[dst.num_released :]:
            self._blocks[block_id].ref_count += 1
        self._sequences[dst_id] = dst

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src_block, dst_block) copy-on-writes since the last call, in order (then forgotten)."""
        out, self._block_copies = self._block_copies, []
        return out

    def take_transfers(self) -> list[Transfer]:
        """The (kind, src_block, dst_block) moves between levels since the last call, in order (then
        forgotten): to execute in that order before the next forward, and before the block copies."""
        out, self._transfers = self._transfers, []
        return out

    def suspend_sequence(self, request_id: int) -> None:
        """Swap-out: each private block (ref_count 1) moves to a free secondary block (offload), its
        primary block freed, last first; shared blocks stay held. All or nothing."""
        sequence = self._active_sequence(request_id, "suspend_sequence")
        if self._attention_window:
            raise ValueError(
                f"suspend_sequence: a sliding-window manager (attention_window {self._attention_window}) "
                "has no secondary level"
            )
        needed = self.get_needed_secondary_blocks_to_suspend(request_id)
        free = self._num_free(SECONDARY_LEVEL)
        if needed > free:
            raise RuntimeError(
                f"suspend_sequence: not enough free secondary KV blocks for request_id {request_id}: "
                f"need {needed}, free {free}"
            )
        freed = []
        for i, block_id in enumerate(sequence.block_ids):
            block = self._blocks[block_id]
            if block.ref_count != 1:
                continue  # shared: the other holders read it where it is
            secondary = self._take_secondary_block()
            if block.key is not None:  # (taking the secondary block may have dropped it)
                self._move_key(block_id, secondary)
            self._blocks[secondary].retention_priority = block.retention_priority
            self._transfers.append((KvTransferKind.OFFLOAD, block_id, secondary))
            self._offloaded_blocks += 1
            freed.append(block_id)
            sequence.block_ids[i] = secondary
        for block_id in reversed(freed):
            self._release(block_id)
        sequence.suspended = True

    def resume_sequence(self, request_id: int) -> None:
        """Swap-in: each secondary block of a suspended sequence moves to a fresh primary block
        (onboard); the secondary blocks are freed once all moved. All or nothing."""
        sequence = self._sequence(request_id, "resume_sequence")
        if not sequence.suspended:
            raise ValueError(f"resume_sequence: request_id {request_id} is not suspended")
        needed = self.get_needed_blocks_to_resume(request_id)
        if needed > self.num_free_blocks:
            raise RuntimeError(
                f"resume_sequence: not enough free KV blocks for request_id {request_id}: "
                f"need {needed}, free {self.num_free_blocks}"
            )
        freed = []
        for i, block_id in enumerate(sequence.block_ids):
            if self._blocks[block_id].level == SECONDARY_LEVEL:
                freed.append(block_id)
                sequence.block_ids[i] = self._onboard(block_id)
        for block_id in reversed(freed):
            self._release(block_id)
        sequence.suspended = False

    def get_needed_blocks_to_resume(self, request_id: int) -> int:
        """Free primary blocks resume_sequence needs (the secondary blocks; 0 when not suspended)."""
        sequence = self._sequence(request_id, "get_needed_blocks_to_resume")
        return sum(1 for b in sequence.block_ids if b >= 0 and self._blocks[b].level == SECONDARY_LEVEL)

    def get_needed_secondary_blocks_to_suspend(self, request_id: int) -> int:
        """Free secondary blocks suspend_sequence needs (the private blocks; 0 when suspended)."""
        sequence = self._sequence(request_id, "get_needed_secondary_blocks_to_suspend")
        if sequence.suspended:
            return 0
        return sum(1 for b in sequence.block_ids if b >= 0 and self._blocks[b].ref_count == 1)

    def add_token(self, request_id: int) -> None:
        """One more token; a new block (of the sequence's retention priority) when it starts one."""
        sequence = self._active_sequence(request_id, "add_token")
        if sequence.num_tokens >= self._max_seq_len:
            raise ValueError(
                f"add_token: request_id {request_id} already holds {sequence.num_tokens} tokens, "
                f"max_seq_len is {self._max_seq_len}"
            )
        self._slide(sequence, sequence.num_tokens, None)  # the new token is the next query
        if self._cow_blocks(sequence):
            if self.num_free_blocks == 0:
                raise RuntimeError(
                    f"add_token: not enough free KV blocks for request_id {request_id}: need 1, free 0"
                )
            self._copy_on_write(sequence)
        if sequence.num_tokens % self._tokens_per_block == 0:  # the new token starts a block
            if self.num_free_blocks == 0:
                raise RuntimeError(
                    f"add_token: not enough free KV blocks for request_id {request_id}: need 1, free 0"
                )
            sequence.block_ids.append(self._allocate_block(sequence.retention_priority))
            self._alloc_total_blocks += 1
            self._alloc_new_blocks += 1
        sequence.num_tokens += 1

    def add_tokens(self, request_id: int, n: int) -> None:
        """``n`` more tokens at once (a speculative step's 1 + k), all or nothing."""
        sequence = self._active_sequence(request_id, "add_tokens")
        if n < 0:
            raise ValueError(f"add_tokens: n must be >= 0, got {n}")
        if n > self._max_seq_len - sequence.num_tokens:
            raise ValueError(
                f"add_tokens: request_id {request_id} holds {sequence.num_tokens} tokens; {n} more exceed "
                f"max_seq_len {self._max_seq_len}"
            )
        tpb = self._tokens_per_block
        if n > 0:
            self._slide(sequence, sequence.num_tokens, None)  # the first new token is the next query
        needed = -(-(sequence.num_tokens + n) // tpb) - len(sequence.block_ids)
        cow = self._cow_blocks(sequence) if n > 0 else 0
        if needed + cow > self.num_free_blocks:
            raise RuntimeError(
                f"add_tokens: not enough free KV blocks for request_id {request_id}: need {needed + cow}, "
                f"free {self.num_free_blocks}"
            )
        if cow:
            self._copy_on_write(sequence)
        for _ in range(needed):
            sequence.block_ids.append(self._allocate_block(sequence.retention_priority))
        self._alloc_total_blocks += needed
        self._alloc_new_blocks += needed
        sequence.num_tokens += n

    def rewind(self, request_id: int, n: int) -> None:
        """Pops the last ``n`` tokens; blocks left empty are released, last block first."""
        sequence = self._active_sequence(request_id, "rewind")
        if not 0 <= n < sequence.num_tokens:
            raise ValueError(
                f"rewind: n must be in [0, {sequence.num_tokens - 1}] (request_id {request_id} keeps at least "
                f"one of its {sequence.num_tokens} tokens), got {n}"
            )
        if sequence.num_released:
            # The window cannot move back over the blocks it released.
            keep = sequence.num_released * self._tokens_per_block + self._attention_window - 1
            if n > sequence.num_tokens - keep:
                raise ValueError(
                    f"rewind: n must be in [0, {sequence.num_tokens - keep}] (request_id {request_id} released "
                    f"{sequence.num_released} blocks to its window {self._attention_window}), got {n}"
                )
        sequence.num_tokens -= n
        keep = -(-sequence.num_tokens // self._tokens_per_block)
        while len(sequence.block_ids) > keep:
            block_id = sequence.block_ids.pop()
            if block_id >= 0:
                self._release(block_id)
        sequence.num_released = min(sequence.num_released, len(sequence.block_ids))

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
        # Last block first: the leaves of a prefix are evicted before their parents (a suspended
        # sequence's secondary blocks return to the secondary free queue).
        for block_id in reversed(sequence.block_ids[sequence.num_released :]):
            self._release(block_id)
        del self._sequences[request_id]

    def store_context_blocks(self, request: LlmRequest) -> None:
        """Publishes the full prompt blocks of a request whose context finished (reuse only)."""
        if not self._enable_block_reuse:
            return
        sequence = self._active_sequence(request.request_id, "store_context_blocks")
        tokens = request.get_tokens()
        num_stored = min(request.prompt_len, len(tokens), sequence.num_tokens)
        self._store_blocks(tokens, num_stored, sequence.block_ids, request.kv_retention_priority)

    def get_block_ids(self, request_id: int) -> list[int]:
        """The sequence's blocks in token order; -1 for a block released by the window."""
        return list(self._sequence(request_id, "get_block_ids").block_ids)

    def get_num_tokens(self, request_id: int) -> int:
        return self._sequence(request_id, "get_num_tokens").num_tokens

    def copy_block_tables(self, request_ids: Iterable[Any], out: Any) -> None:
        """Row i of ``out`` (int32 [rows, cols], C-contiguous, numpy or CPU torch) = the blocks of
        the i-th sequence (a block released by the window as 0: the kernels never read it), the rest of
        that row 0; other rows untouched. ``request_ids`` holds ids
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
            sequence = self._sequence(request_id, "copy_block_tables")
            if sequence.suspended:
                raise ValueError(
                    f"copy_block_tables: request_id {request_id} is suspended (resume_sequence first)"
                )
            block_ids = sequence.block_ids
            if len(block_ids) > row_stride:
                raise ValueError(
                    f"copy_block_tables: request_id {request_id} holds {len(block_ids)} blocks, "
                    f"more than row_stride {row_stride}"
                )
            table[row, :] = 0
            table[row, : len(block_ids)] = block_ids
            table[row, : sequence.num_released] = 0

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
        # Free blocks that still hold a cached prefix (a hit takes them back without recomputing).
        stats.reusable_num_blocks = self._num_free_keyed(PRIMARY_LEVEL)
        stats.max_num_secondary_blocks = self._num_secondary_blocks
        stats.free_num_secondary_blocks = self.num_free_secondary_blocks
        stats.used_num_secondary_blocks = self.num_used_secondary_blocks
        stats.reusable_num_secondary_blocks = self._num_free_keyed(SECONDARY_LEVEL)
        stats.offloaded_blocks = self._offloaded_blocks
        stats.onboarded_blocks = self._onboarded_blocks
        stats.secondary_reused_blocks = self._secondary_reused_blocks
        stats.secondary_hit_rate = self._secondary_reused_blocks / lookups if lookups else 0.0
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
            1
            for block_id in sequence.block_ids[sequence.num_released :]
            if self._blocks[block_id].ref_count == 1 and self._blocks[block_id].level == PRIMARY_LEVEL
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
            # A speculative step writes the input token and its drafts (1 + k), never past max_seq_len.
            num_new = min(num_steps * (1 + request.num_draft_tokens), self._max_seq_len - num_past)
            new_blocks = _ceil_div(num_past + num_new, tpb) - _ceil_div(num_past, tpb)
            if self._attention_window:
                # The step first releases what its first query no longer sees.
                sequence = self._sequences.get(request.request_id)
                num_released = sequence.num_released if sequence is not None else 0
                dead = max(0, num_past - self._attention_window + 1) // tpb
                new_blocks = max(0, new_blocks - max(0, dead - num_released))
            return new_blocks * request.beam_width
        return 0

    def get_remaining_blocks_to_completion(self, request: LlmRequest) -> int:
        tpb = self._tokens_per_block
        if self._attention_window:
            return self._remaining_blocks_in_window(request)
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
            if (
                request.beam_width > 1
                and request.prompt_len % tpb != 0
                and request.num_tokens <= request.prompt_len + 1
            ):
                # The prompt's partial last block, held once, is copied for every other beam on the
                # first decode step (copy-on-write).
                remaining += request.beam_width - 1
        # Negative only when tokens were added past max_new_tokens: never hand out blocks not free.
        return max(remaining, 0)

    def _remaining_blocks_in_window(self, request: LlmRequest) -> int:
        """get_remaining_blocks_to_completion with a window: the prompt is held whole when added, and
        a decode step (1 + k tokens) sees at most ``W + k`` positions, i.e. ``ceil((W + k) / tpb) + 1``
        blocks per beam; the most the sequence will hold minus what it holds."""
        tpb = self._tokens_per_block
        num_total_blocks = _ceil_div(request.prompt_len + request.max_new_tokens, tpb)
        per_beam = min(
            num_total_blocks, _ceil_div(self._attention_window + request.num_draft_tokens, tpb) + 1
        )
        peak = per_beam * request.beam_width
        sequence = self._sequences.get(request.request_id)
        if sequence is None:
            return max(_ceil_div(request.prompt_len, tpb), peak)
        return max(peak - (len(sequence.block_ids) - sequence.num_released), 0)

    def find_new_context_block(self, request: LlmRequest) -> Hashable | None:
        """Key of the request's first reusable prompt block not yet cached (None: all cached/none/off)."""
        if not self._enable_block_reuse:
            return None
        tokens = request.get_tokens()
        for key in self._prompt_block_keys(tokens, min(request.prompt_len, len(tokens))):
            if key not in self._cached:
                return key
        return None

    # ---- persistence -----------------------------------------------------------------------------

    def export_secondary_blocks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The keyed secondary blocks whose ancestors are all keyed secondary blocks, as int32 arrays
        ``(block_ids [n], parents [n], priorities [n], tokens [n, tokens_per_block])`` (a parent is the
        block id of another entry, or -1 for the first block of a prefix): free ones in free-queue
        order (priority ascending, oldest first), then those held by suspended sequences, by id."""
        tpb = self._tokens_per_block
        rows: list[tuple[int, int, int, BlockKey]] = []
        if self._enable_block_reuse and self._num_secondary_blocks:

            def whole_prefix_secondary(key: BlockKey) -> bool:
                return all(
                    self._blocks[self._cached[key[:end]]].level == SECONDARY_LEVEL
                    for end in range(tpb, len(key) + 1, tpb)
                )

            def row(block_id: int) -> tuple[int, int, int, BlockKey]:
                block = self._blocks[block_id]
                parent = self._cached[block.key[:-tpb]] if len(block.key) > tpb else -1
                return block_id, parent, block.retention_priority, block.key[-tpb:]

            lists = self._free_lists[SECONDARY_LEVEL]
            for priority in sorted(lists):
                for block_id in lists[priority]:
                    key = self._blocks[block_id].key
                    if key is not None and whole_prefix_secondary(key):
                        rows.append(row(block_id))
            for block in self._blocks[self._num_blocks :]:
                if block.ref_count > 0 and block.key is not None and whole_prefix_secondary(block.key):
                    rows.append(row(block.block_id))
        n = len(rows)
        return (
            np.array([r[0] for r in rows], dtype=np.int32),
            np.array([r[1] for r in rows], dtype=np.int32),
            np.array([r[2] for r in rows], dtype=np.int32),
            np.array([r[3] for r in rows], dtype=np.int32).reshape(n, tpb),
        )

    def import_secondary_blocks(self, block_ids, parents, priorities, tokens) -> None:
        """Adopts an :meth:`export_secondary_blocks` list into this fresh manager (reuse on, no
        sequence, nothing cached, no pending transfer): each block keyed at its id under its parent
        and freed with its priority in the listed order; the other secondary blocks cache nothing and
        go to the front of the priority-0 list. ValueError naming the entry (state unchanged) for a
        malformed list."""
        caller = "import_secondary_blocks"
        tpb = self._tokens_per_block
        tokens_array = np.asarray(tokens)
        if tokens_array.ndim != 2:
            raise ValueError(
                f"{caller}: tokens must be [n, tokens_per_block], got shape {list(tokens_array.shape)}"
            )
        if tokens_array.shape[1] != tpb:
            raise ValueError(
                f"{caller}: tokens must have tokens_per_block {tpb} columns, got {tokens_array.shape[1]}"
            )
        if not self._enable_block_reuse:
            raise ValueError(f"{caller}: block reuse is disabled (enable_block_reuse=false)")
        block_ids = [int(b) for b in np.asarray(block_ids).reshape(-1)]
        parents = [int(p) for p in np.asarray(parents).reshape(-1)]
        priorities = [int(p) for p in np.asarray(priorities).reshape(-1)]
        n = len(block_ids)
        if len(parents) != n or len(priorities) != n:
            raise ValueError(
                f"{caller}: parents has {len(parents)} entries and priorities {len(priorities)}; "
                f"both must have block_ids' {n}"
            )
        if tokens_array.size != n * tpb:
            raise ValueError(
                f"{caller}: tokens has {tokens_array.size} entries, expected {n * tpb} "
                f"(block_ids' {n} x tokens_per_block {tpb})"
            )
        if n > self._num_secondary_blocks:
            raise ValueError(
                f"{caller}: {n} blocks listed, more than num_secondary_blocks {self._num_secondary_blocks}"
            )
        if self._sequences or self._cached or self._transfers:
            raise ValueError(
                f"{caller}: the manager is not fresh ({len(self._sequences)} sequences, {len(self._cached)} "
                f"cached blocks, {len(self._transfers)} pending transfers); import into a new manager"
            )
        if n == 0:
            return
        first, last = self._num_blocks, self._num_blocks + self._num_secondary_blocks - 1
        index_of: dict[int, int] = {}
        for i, block_id in enumerate(block_ids):
            if not first <= block_id <= last:
                raise ValueError(
                    f"{caller}: block_ids[{i}] = {block_id} is not a secondary block id "
                    f"(must be in [{first}, {last}])"
                )
            if block_id in index_of:
                raise ValueError(
                    f"{caller}: block_ids[{i}] = {block_id} is listed twice (also block_ids[{index_of[block_id]}])"
                )
            index_of[block_id] = i
            if not 0 <= priorities[i] <= 100:
                raise ValueError(f"{caller}: priorities[{i}] must be in [0, 100], got {priorities[i]}")
        parent_index = []
        for i, parent in enumerate(parents):
            if parent != -1 and parent not in index_of:
                raise ValueError(
                    f"{caller}: parents[{i}] = {parent} is not a listed block (a parent must be listed too, or -1)"
                )
            parent_index.append(index_of[parent] if parent != -1 else -1)
        keys: list[BlockKey | None] = [None] * n
        for i in range(n):
            walk, cur, seen = [], i, set()
            while cur != -1 and keys[cur] is None:
                if cur in seen:
                    raise ValueError(
                        f"{caller}: block_ids[{i}] = {block_ids[i]}: its chain of parents has a cycle"
                    )
                seen.add(cur)
                walk.append(cur)
                cur = parent_index[cur]
            key: BlockKey = () if cur == -1 else keys[cur]
            for j in reversed(walk):
                key = key + tuple(int(t) for t in tokens_array[j])
                keys[j] = key
        owner: dict[BlockKey, int] = {}
        for i, key in enumerate(keys):
            if key in owner:
                j = owner[key]
                raise ValueError(
                    f"{caller}: block_ids[{j}] = {block_ids[j]} and block_ids[{i}] = {block_ids[i]} hold the "
                    "same key (the same parent and tokens)"
                )
            owner[key] = i

        unlisted = [b for b in range(first, last + 1) if b not in index_of]
        lists: dict[int, dict[int, None]] = {_MIN_RETENTION_PRIORITY: dict.fromkeys(unlisted)}
        for block_id in unlisted:
            self._blocks[block_id].retention_priority = _MIN_RETENTION_PRIORITY
        for i, block_id in enumerate(block_ids):
            block = self._blocks[block_id]
            block.key = keys[i]
            block.retention_priority = priorities[i]
            self._cached[keys[i]] = block_id
            lists.setdefault(priorities[i], {})[block_id] = None
        self._free_lists[SECONDARY_LEVEL] = lists

    def offload_reusable_blocks(self) -> int:
        """Before a shutdown that keeps the tier: the keys of the free cached primary blocks (priority
        >= secondary_offload_min_priority) move to free secondary blocks, fewest ancestors first (then
        by id), an offload each; stops when the secondary level has no free uncached block. Returns
        the blocks moved."""
        if not self._enable_block_reuse or not self._num_secondary_blocks:
            return 0
        tpb = self._tokens_per_block
        order = sorted(
            (len(b.key) // tpb - 1, b.block_id)
            for b in self._blocks[: self._num_blocks]
            if b.ref_count == 0
            and b.key is not None
            and b.retention_priority >= self._secondary_offload_min_priority
        )
        moved = 0
        for _, block_id in order:
            if (
                self._num_free(SECONDARY_LEVEL) == 0
                or self._blocks[self._front(SECONDARY_LEVEL)].key is not None
            ):
                break
            block = self._blocks[block_id]
            primary = self._free_lists[PRIMARY_LEVEL]
            del primary[block.retention_priority][block_id]
            moved += 1 if self._offload(block_id) else 0
            primary.setdefault(block.retention_priority, {})[block_id] = None
        return moved

    # ---- integrity -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raises RuntimeError describing the first violated invariant."""

        def fail(what: str) -> None:
            raise RuntimeError(f"KVCacheManager integrity check failed: {what}")

        free_list_of: dict[int, tuple[int, int]] = {}  # free block -> (level, priority) of its list
        for level, lists in enumerate(self._free_lists):
            for priority, free_list in lists.items():
                for block_id in free_list:
                    if block_id in free_list_of:
                        fail(f"block {block_id} appears twice in the free lists")
                    if self._blocks[block_id].level != level:
                        fail(
                            f"block {block_id} of level {self._blocks[block_id].level} is in a free list "
                            f"of level {level}"
                        )
                    free_list_of[block_id] = (level, priority)

        holders = [0] * len(self._blocks)
        held_by_suspended = [False] * len(self._blocks)
        for request_id, sequence in self._sequences.items():
            expected = _ceil_div(sequence.num_tokens, self._tokens_per_block)
            if len(sequence.block_ids) != expected:
                fail(
                    f"request_id {request_id} holds {len(sequence.block_ids)} blocks for "
                    f"{sequence.num_tokens} tokens, expected {expected}"
                )
            released = sequence.block_ids[: sequence.num_released]
            held = sequence.block_ids[sequence.num_released :]
            if released and not self._attention_window:
                fail(f"request_id {request_id} has released blocks without an attention window")
            if any(b != -1 for b in released) or any(b < 0 for b in held):
                fail(
                    f"request_id {request_id}: its first {sequence.num_released} entries must be -1 "
                    "(released by the window) and the others blocks"
                )
            if (
                self._attention_window
                and sequence.num_released
                > max(0, sequence.num_tokens - self._attention_window + 1) // self._tokens_per_block
            ):
                fail(
                    f"request_id {request_id} released {sequence.num_released} blocks, more than its "
                    f"window {self._attention_window} allows at {sequence.num_tokens} tokens"
                )
            if len(set(held)) != len(held):
                fail(f"request_id {request_id} holds a block twice")
            for block_id in held:
                if not sequence.suspended and self._blocks[block_id].level != PRIMARY_LEVEL:
                    fail(f"active request_id {request_id} holds secondary block {block_id}")
                holders[block_id] += 1
                held_by_suspended[block_id] = sequence.suspended

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
            if is_free and free_list_of[block_id][1] != block.retention_priority:
                fail(
                    f"block {block_id} of retention priority {block.retention_priority} is in free list "
                    f"{free_list_of[block_id][1]}"
                )
            if (
                block.level == SECONDARY_LEVEL
                and block.ref_count > 0
                and (block.ref_count != 1 or not held_by_suspended[block_id])
            ):
                fail(
                    f"secondary block {block_id} has ref_count {block.ref_count}; it may only be held "
                    "by one suspended sequence"
                )
            if block.key is not None and self._cached.get(block.key) != block_id:
                fail(f"the key of block {block_id} does not map to it")

        for level, size in ((PRIMARY_LEVEL, self._num_blocks), (SECONDARY_LEVEL, self._num_secondary_blocks)):
            num_used = sum(1 for b in self._blocks if b.level == level and b.ref_count > 0)
            num_free = sum(1 for lv, _ in free_list_of.values() if lv == level)
            if num_used + num_free != size:
                fail(f"level {level}: free {num_free} + used {num_used} != total {size}")

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

    def _active_sequence(self, request_id: int, caller: str) -> _Sequence:
        """As _sequence, rejecting a suspended sequence."""
        sequence = self._sequence(request_id, caller)
        if sequence.suspended:
            raise ValueError(f"{caller}: request_id {request_id} is suspended (resume_sequence first)")
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

    def _num_free(self, level: int) -> int:
        return sum(len(free_list) for free_list in self._free_lists[level].values())

    def _num_free_keyed(self, level: int) -> int:
        return sum(1 for b in self._blocks if b.level == level and b.ref_count == 0 and b.key is not None)

    def _front(self, level: int) -> int:
        """The front of the level's lowest-priority non-empty free list (callers check one is free)."""
        lists = self._free_lists[level]
        priority = min(p for p, free_list in lists.items() if free_list)
        return next(iter(lists[priority]))

    def _acquire(self, block_id: int) -> None:
        """One more holder of a (cached) primary block; a free one leaves the free queue, keeping its key."""
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free_lists[PRIMARY_LEVEL][block.retention_priority][block_id]
        block.ref_count += 1

    def _allocate_block(self, retention_priority: int) -> int:
        """Takes the front of the lowest-priority non-empty primary free list, for new contents; its
        cached prefix, if any, is offloaded to the secondary level or dropped."""
        block_id = self._front(PRIMARY_LEVEL)
        block = self._blocks[block_id]
        del self._free_lists[PRIMARY_LEVEL][block.retention_priority][block_id]
        block.ref_count = 1
        if block.key is not None and not self._offload(block_id):
            self._drop_key(block.key)
        block.retention_priority = retention_priority
        return block_id

    def _release(self, block_id: int) -> None:
        """One holder fewer; at zero the block goes to the back of its priority's free list (a
        secondary block without a key to the front of the priority-0 list: it caches nothing)."""
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count != 0:
            return
        lists = self._free_lists[block.level]
        if block.level == SECONDARY_LEVEL and block.key is None:
            block.retention_priority = _MIN_RETENTION_PRIORITY
            lists[block.retention_priority] = {block_id: None, **lists.get(block.retention_priority, {})}
        else:
            lists.setdefault(block.retention_priority, {})[block_id] = None

    def _take_secondary_block(self) -> int:
        """A free secondary block for new contents (its key and the keys below dropped), ref_count 1."""
        block_id = self._front(SECONDARY_LEVEL)
        block = self._blocks[block_id]
        del self._free_lists[SECONDARY_LEVEL][block.retention_priority][block_id]
        block.ref_count = 1
        if block.key is not None:
            self._drop_key(block.key)
        return block_id

    def _offload(self, block_id: int) -> bool:
        """Moves the key of a primary block being reused to a free secondary block (an offload), if
        its priority and the secondary pool allow."""
        block = self._blocks[block_id]
        if (
            self._num_free(SECONDARY_LEVEL) == 0
            or block.retention_priority < self._secondary_offload_min_priority
        ):
            return False
        victim = self._blocks[self._front(SECONDARY_LEVEL)]
        if victim.key is not None and block.key[: len(victim.key)] == victim.key:
            return False  # reusing a cached ancestor would drop this block's key anyway: keep it
        secondary = self._take_secondary_block()
        self._move_key(block_id, secondary)
        target = self._blocks[secondary]
        target.retention_priority = block.retention_priority
        target.ref_count = 0
        self._free_lists[SECONDARY_LEVEL].setdefault(target.retention_priority, {})[secondary] = None
        self._transfers.append((KvTransferKind.OFFLOAD, block_id, secondary))
        self._offloaded_blocks += 1
        return True

    def _onboard(self, secondary: int) -> int:
        """A fresh primary block for the contents of a secondary block held out of the free queue."""
        primary = self._allocate_block(self._blocks[secondary].retention_priority)
        if self._blocks[secondary].key is not None:  # (the allocation may have dropped it)
            self._move_key(secondary, primary)
        self._transfers.append((KvTransferKind.ONBOARD, secondary, primary))
        self._onboarded_blocks += 1
        return primary

    def _move_key(self, src: int, dst: int) -> None:
        key = self._blocks[src].key
        self._blocks[src].key = None
        self._blocks[dst].key = key
        self._cached[key] = dst

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
        block stays unkeyed; elsewhere our block is keyed. A block released by the window (-1) is
        walked through where the cache holds its prefix; elsewhere the walk ends (nothing below an
        uncached prefix can be keyed).
        """
        tpb = self._tokens_per_block
        for i in range(num_tokens // tpb):
            key = tuple(tokens[: (i + 1) * tpb])
            if block_ids[i] < 0:
                if key in self._cached:
                    continue
                return
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
