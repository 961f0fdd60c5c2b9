// KVCacheManager::check_integrity: every invariant of kv_cache_manager.h, recomputed from scratch
// over both levels (docs/batch-manager.md §3.8). Tests call it after every step.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "inflight/batch_manager/kv_cache_manager.h"
#include "kv_cache_manager_internal.h"

namespace inflight::batch_manager {

using namespace kv_detail;

void KVCacheManager::check_integrity() const {
  auto const n = static_cast<std::size_t>(num_blocks_) + static_cast<std::size_t>(num_secondary_blocks_);
  auto const total = static_cast<BlockIdType>(n);
  if (blocks_.size() != n) {
    integrity_error(concat("blocks_.size() ", blocks_.size(), " != num_blocks + num_secondary_blocks ", n));
  }
  SizeType32 const level_size[kNumLevels] = {num_blocks_, num_secondary_blocks_};

  // Free lists: well-linked, each block at most once, levels and priorities match, bitmask matches.
  std::vector<char> in_free_list(n, 0);
  SizeType32 listed[kNumLevels] = {0, 0};
  for (std::size_t index = 0; index < free_lists_.size(); ++index) {
    FreeList const& list = free_lists_[index];
    auto const level = static_cast<SizeType32>(index / kNumPriorities);
    std::size_t const p = index % kNumPriorities;
    SizeType32 count = 0;
    BlockIdType prev = kNoBlock;
    for (BlockIdType id = list.front; id != kNoBlock; id = blocks_[static_cast<std::size_t>(id)].next_free) {
      if (id < 0 || id >= total) {
        integrity_error(concat("free list ", p, " of level ", level, " holds invalid block id ", id));
      }
      if (level_of(id) != level) {
        integrity_error(concat("block ", id, " of level ", level_of(id), " is in a free list of level ", level));
      }
      Block const& block = blocks_[static_cast<std::size_t>(id)];
      if (in_free_list[static_cast<std::size_t>(id)] != 0) {
        integrity_error(concat("block ", id, " appears twice in the free lists"));
      }
      in_free_list[static_cast<std::size_t>(id)] = 1;
      if (block.prev_free != prev) {
        integrity_error(concat("block ", id, " in free list ", p, " has a wrong prev link"));
      }
      if (static_cast<std::size_t>(block.retention_priority) != p) {
        integrity_error(
            concat("block ", id, " of retention priority ", block.retention_priority, " is in free list ", p));
      }
      if (block.ref_count != 0) {
        integrity_error(concat("free block ", id, " has ref_count ", block.ref_count));
      }
      prev = id;
      ++count;
    }
    if (list.back != prev) {
      integrity_error(concat("free list ", p, " has a wrong back"));
    }
    if (count != list.size) {
      integrity_error(concat("free list ", p, " holds ", count, " blocks but records size ", list.size));
    }
    bool const bit = ((non_empty_lists_[level][p / 64] >> (p % 64)) & 1U) != 0;
    if (bit != (count != 0)) {
      integrity_error(
          concat("non-empty bit of free list ", p, " of level ", level, " is ", bit, " with ", count, " blocks"));
    }
    listed[level] += count;
  }
  for (SizeType32 level = 0; level < kNumLevels; ++level) {
    if (listed[level] != num_free_[level]) {
      integrity_error(
          concat("free lists of level ", level, " hold ", listed[level], " blocks but num_free is ", num_free_[level]));
    }
  }

  // Sequences: block counts, no block twice in one sequence, refcounts == holders.
  std::vector<SizeType32> holders(n, 0);
  std::vector<RequestIdType> last_holder(n, 0);
  std::vector<char> held_by_any(n, 0);
  std::vector<char> held_by_suspended(n, 0);
  SizeType32 suspended = 0;
  for (auto const& [request_id, seq] : sequences_) {
    suspended += seq.suspended ? 1 : 0;
    if (seq.num_tokens < 1 || seq.num_tokens > max_seq_len_) {
      integrity_error(
          concat("request_id ", request_id, " holds ", seq.num_tokens, " tokens, outside [1, ", max_seq_len_, "]"));
    }
    auto const expected = static_cast<std::size_t>(ceil_div(seq.num_tokens, tokens_per_block_));
    if (seq.block_ids.size() != expected) {
      integrity_error(concat("request_id ", request_id, " holds ", seq.block_ids.size(), " blocks for ", seq.num_tokens,
                             " tokens, expected ", expected));
    }
    if (seq.num_released < 0 || static_cast<std::size_t>(seq.num_released) > seq.block_ids.size()) {
      integrity_error(concat("request_id ", request_id, " records ", seq.num_released, " released blocks of ",
                             seq.block_ids.size()));
    }
    if (seq.num_released > 0 && attention_window_ == 0) {
      integrity_error(concat("request_id ", request_id, " has released blocks without an attention window"));
    }
    auto const held = seq.block_ids.begin() + seq.num_released;
    if (std::any_of(seq.block_ids.begin(), held, [](BlockIdType id) { return id != kNoBlock; }) ||
        std::any_of(held, seq.block_ids.end(), [](BlockIdType id) { return id < 0; })) {
      integrity_error(concat("request_id ", request_id, ": its first ", seq.num_released,
                             " entries must be -1 (released by the window) and the others blocks"));
    }
    if (attention_window_ > 0 &&
        seq.num_released > std::max(seq.num_tokens - attention_window_ + 1, 0) / tokens_per_block_) {
      integrity_error(concat("request_id ", request_id, " released ", seq.num_released,
                             " blocks, more than its window ", attention_window_, " allows at ", seq.num_tokens,
                             " tokens"));
    }
    for (auto it = held; it != seq.block_ids.end(); ++it) {
      BlockIdType const id = *it;
      if (id < 0 || id >= total) {
        integrity_error(concat("request_id ", request_id, " holds invalid block id ", id));
      }
      if (!seq.suspended && level_of(id) != kPrimaryLevel) {
        integrity_error(concat("active request_id ", request_id, " holds secondary block ", id));
      }
      auto const i = static_cast<std::size_t>(id);
      held_by_suspended[i] = seq.suspended ? 1 : 0;
      if (held_by_any[i] != 0 && last_holder[i] == request_id) {
        integrity_error(concat("request_id ", request_id, " holds block ", id, " twice"));
      }
      held_by_any[i] = 1;
      last_holder[i] = request_id;
      ++holders[i];
    }
  }
  if (suspended != num_suspended_) {
    integrity_error(concat(suspended, " sequences are suspended but num_suspended is ", num_suspended_));
  }
  SizeType32 used[kNumLevels] = {0, 0};
  for (std::size_t i = 0; i < n; ++i) {
    Block const& block = blocks_[i];
    if (block.ref_count != holders[i]) {
      integrity_error(
          concat("block ", i, " has ref_count ", block.ref_count, " but ", holders[i], " sequences hold it"));
    }
    if ((block.ref_count == 0) != (in_free_list[i] != 0)) {
      integrity_error(concat("block ", i, " with ref_count ", block.ref_count, " is ",
                             in_free_list[i] != 0 ? "" : "not ", "in a free list"));
    }
    SizeType32 const level = level_of(static_cast<BlockIdType>(i));
    if (level == kSecondaryLevel && block.ref_count > 0 && (block.ref_count != 1 || held_by_suspended[i] == 0)) {
      integrity_error(concat("secondary block ", i, " has ref_count ", block.ref_count,
                             "; it may only be held by one suspended sequence"));
    }
    used[level] += block.ref_count > 0 ? 1 : 0;
  }
  for (SizeType32 level = 0; level < kNumLevels; ++level) {
    if (used[level] + num_free_[level] != level_size[level]) {
      integrity_error(concat("level ", level, ": free ", num_free_[level], " + used ", used[level], " != total ",
                             level_size[level]));
    }
  }

  SizeType32 free_keyed[kNumLevels] = {0, 0};
  for (std::size_t i = 0; i < n; ++i) {
    free_keyed[level_of(static_cast<BlockIdType>(i))] += blocks_[i].ref_count == 0 && blocks_[i].has_key ? 1 : 0;
  }
  for (SizeType32 level = 0; level < kNumLevels; ++level) {
    if (free_keyed[level] != num_free_keyed_[level]) {
      integrity_error(concat("level ", level, ": ", free_keyed[level], " free blocks hold a key but num_free_keyed is ",
                             num_free_keyed_[level]));
    }
  }

  // Reuse tree.
  std::size_t num_keyed = 0;
  auto const tpb = static_cast<std::size_t>(tokens_per_block_);
  for (std::size_t i = 0; i < n; ++i) {
    Block const& block = blocks_[i];
    auto const id = static_cast<BlockIdType>(i);
    if (!block.has_key) {
      if (!block.children.empty()) {
        integrity_error(concat("unkeyed block ", i, " has ", block.children.size(), " children"));
      }
      continue;
    }
    if (!enable_block_reuse_) {
      integrity_error(concat("block ", i, " holds a key with reuse disabled"));
    }
    ++num_keyed;
    std::uint64_t parent_hash = kRootHash;
    std::vector<BlockIdType> const* siblings = &reuse_->root_children;
    if (block.parent != kRoot) {
      if (block.parent < 0 || block.parent >= total || !blocks_[static_cast<std::size_t>(block.parent)].has_key) {
        integrity_error(concat("keyed block ", i, " has parent ", block.parent, " which is not a keyed block"));
      }
      Block const& parent = blocks_[static_cast<std::size_t>(block.parent)];
      parent_hash = parent.hash;
      siblings = &parent.children;
    }
    if (block.child_index < 0 || static_cast<std::size_t>(block.child_index) >= siblings->size() ||
        (*siblings)[static_cast<std::size_t>(block.child_index)] != id) {
      integrity_error(concat("keyed block ", i, " is not reachable from its parent's children"));
    }
    TokenIdType const* tokens = reuse_->tokens.data() + i * tpb;
    if (chain_hash(parent_hash, tokens, tokens_per_block_) != block.hash) {
      integrity_error(concat("keyed block ", i, " has a hash that does not match its parent and tokens"));
    }
    if (find_child(block.parent, block.hash, tokens) != id) {
      integrity_error(concat("the key of block ", i, " does not map to it"));
    }
    for (BlockIdType const child : block.children) {
      if (child < 0 || child >= total || !blocks_[static_cast<std::size_t>(child)].has_key ||
          blocks_[static_cast<std::size_t>(child)].parent != id) {
        integrity_error(concat("block ", i, " lists child ", child, " whose parent is not block ", i));
      }
    }
  }
  for (BlockIdType const child : reuse_->root_children) {
    if (child < 0 || child >= total || !blocks_[static_cast<std::size_t>(child)].has_key ||
        blocks_[static_cast<std::size_t>(child)].parent != kRoot) {
      integrity_error(concat("root lists child ", child, " which is not a first block"));
    }
  }
  if (reuse_->by_hash.size() != num_keyed) {
    integrity_error(concat("hash index holds ", reuse_->by_hash.size(), " entries for ", num_keyed, " keyed blocks"));
  }
  for (auto const& [hash, id] : reuse_->by_hash) {
    if (id < 0 || id >= total || !blocks_[static_cast<std::size_t>(id)].has_key ||
        blocks_[static_cast<std::size_t>(id)].hash != hash) {
      integrity_error(concat("hash index maps ", hash, " to block ", id, " which does not hold that key"));
    }
  }
}

}  // namespace inflight::batch_manager
