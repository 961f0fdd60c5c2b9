// KVCacheManager, secondary level: offloading evicted reusable blocks, onboarding prefix hits, and
// swapping whole sequences out and in (docs/batch-manager.md, "Secondary level and swap").
//
// The manager moves keys and block ids only; every move of KV contents is queued as a
// KvBlockTransfer for the engine, in the order the moves happened. Rules of the secondary pool:
//   * its free queue works like the primary one (one FIFO per retention priority, the front of the
//     lowest non-empty list taken first), except that a secondary block released without a key goes
//     to the front of the priority-0 list: it caches nothing, so it is the first to take;
//   * a secondary block taken for new contents loses its key and every key chained below it, like a
//     primary block reused without offload;
//   * a secondary block is either free or held by exactly one suspended sequence.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "inflight/batch_manager/kv_cache_manager.h"
#include "kv_cache_manager_internal.h"

namespace inflight::batch_manager {

using namespace kv_detail;

bool KVCacheManager::is_suspended(RequestIdType request_id) const {
  auto it = sequences_.find(request_id);
  return it != sequences_.end() && it->second.suspended;
}

SizeType32 KVCacheManager::get_block_level(BlockIdType block_id) const {
  if (block_id < 0 || static_cast<std::size_t>(block_id) >= blocks_.size()) {
    throw std::invalid_argument(concat("get_block_level: block_id must be in [0, ", blocks_.size() - 1,
                                       "] (num_blocks + num_secondary_blocks - 1), got ", block_id));
  }
  return level_of(block_id);
}

std::vector<KvBlockTransfer> KVCacheManager::take_transfers() {
  std::vector<KvBlockTransfer> out;
  out.swap(transfers_);
  return out;
}

void KVCacheManager::move_key(BlockIdType from, BlockIdType to) {
  Block& src = blocks_[static_cast<std::size_t>(from)];
  Block& dst = blocks_[static_cast<std::size_t>(to)];
  dst.has_key = true;
  dst.parent = src.parent;
  dst.hash = src.hash;
  dst.child_index = src.child_index;
  std::swap(dst.children, src.children);  // dst had none (unkeyed); keeps both buffers allocated
  auto const tpb = static_cast<std::size_t>(tokens_per_block_);
  std::memcpy(reuse_->tokens.data() + static_cast<std::size_t>(to) * tpb,
              reuse_->tokens.data() + static_cast<std::size_t>(from) * tpb, tpb * sizeof(TokenIdType));
  std::vector<BlockIdType>& siblings =
      dst.parent == kRoot ? reuse_->root_children : blocks_[static_cast<std::size_t>(dst.parent)].children;
  siblings[static_cast<std::size_t>(dst.child_index)] = to;
  for (BlockIdType const child : dst.children) {
    blocks_[static_cast<std::size_t>(child)].parent = to;
  }
  auto const [first, last] = reuse_->by_hash.equal_range(dst.hash);
  for (auto it = first; it != last; ++it) {
    if (it->second == from) {
      it->second = to;
      break;
    }
  }
  src.has_key = false;
  src.parent = kRoot;
  src.hash = 0;
  src.child_index = -1;
}

BlockIdType KVCacheManager::take_secondary_block() {
  // Callers check num_free_[kSecondaryLevel] first.
  BlockIdType const block_id = front_free_block(kSecondaryLevel);
  take_free_block(block_id);
  Block& block = blocks_[static_cast<std::size_t>(block_id)];
  block.ref_count = 1;  // taken before drop_key, which counts the free blocks losing their key
  if (block.has_key) {
    drop_key(block_id);
  }
  return block_id;
}

bool KVCacheManager::offload(BlockIdType block_id) {
  Block const& block = blocks_[static_cast<std::size_t>(block_id)];
  // TRT-LLM offloads only blocks of priority >= secondary_offload_min_priority (default 30).
  if (num_free_[kSecondaryLevel] == 0 || block.retention_priority < secondary_offload_min_priority_) {
    return false;
  }
  BlockIdType const victim = front_free_block(kSecondaryLevel);
  if (blocks_[static_cast<std::size_t>(victim)].has_key) {
    // Reusing a cached ancestor of this block would drop this block's key with it: keep the
    // ancestor and drop only this block's key (the caller does), as without a secondary level.
    for (BlockIdType a = block.parent; a != kRoot; a = blocks_[static_cast<std::size_t>(a)].parent) {
      if (a == victim) {
        return false;
      }
    }
  }
  BlockIdType const secondary = take_secondary_block();
  move_key(block_id, secondary);
  Block& target = blocks_[static_cast<std::size_t>(secondary)];
  target.retention_priority = block.retention_priority;  // the cached prefix keeps its retention
  target.ref_count = 0;
  push_free_back(secondary);
  transfers_.push_back({KvTransferKind::kOFFLOAD, block_id, secondary});
  ++offloaded_blocks_;
  return true;
}

BlockIdType KVCacheManager::onboard(BlockIdType secondary) {
  // Callers hold `secondary` out of the free queue (pinned or held by a suspended sequence), so the
  // allocation below, which may offload into the secondary pool, never takes it.
  BlockIdType const primary = allocate_block(blocks_[static_cast<std::size_t>(secondary)].retention_priority);
  // The allocation may have dropped the key (an evicted block was a cached ancestor of it).
  if (blocks_[static_cast<std::size_t>(secondary)].has_key) {
    move_key(secondary, primary);
  }
  transfers_.push_back({KvTransferKind::kONBOARD, secondary, primary});
  ++onboarded_blocks_;
  return primary;
}

SizeType32 KVCacheManager::get_needed_blocks_to_resume(RequestIdType request_id) const {
  Sequence const& seq = sequence(request_id, "get_needed_blocks_to_resume");
  return static_cast<SizeType32>(std::count_if(seq.block_ids.begin() + seq.num_released, seq.block_ids.end(),
                                               [&](BlockIdType id) { return level_of(id) == kSecondaryLevel; }));
}

SizeType32 KVCacheManager::get_needed_secondary_blocks_to_suspend(RequestIdType request_id) const {
  Sequence const& seq = sequence(request_id, "get_needed_secondary_blocks_to_suspend");
  if (seq.suspended) {
    return 0;
  }
  return static_cast<SizeType32>(
      std::count_if(seq.block_ids.begin() + seq.num_released, seq.block_ids.end(),
                    [&](BlockIdType id) { return blocks_[static_cast<std::size_t>(id)].ref_count == 1; }));
}

void KVCacheManager::suspend_sequence(RequestIdType request_id) {
  Sequence& seq = active_sequence(request_id, "suspend_sequence");
  if (attention_window_ > 0) {
    throw std::invalid_argument(concat("suspend_sequence: a sliding-window manager (attention_window ",
                                       attention_window_, ") has no secondary level"));
  }
  SizeType32 const needed = get_needed_secondary_blocks_to_suspend(request_id);
  if (needed > num_free_[kSecondaryLevel]) {
    throw std::runtime_error(concat("suspend_sequence: not enough free secondary KV blocks for request_id ", request_id,
                                    ": need ", needed, ", free ", num_free_[kSecondaryLevel]));
  }
  // Commit; nothing below can fail. Shared blocks stay where they are: the other holders read them.
  std::vector<BlockIdType> freed;
  freed.reserve(static_cast<std::size_t>(needed));
  for (BlockIdType& id : seq.block_ids) {
    Block& block = blocks_[static_cast<std::size_t>(id)];
    if (block.ref_count != 1) {
      continue;
    }
    BlockIdType const secondary = take_secondary_block();
    // Taking it may have dropped this block's key (the reused secondary block was a cached ancestor).
    if (block.has_key) {
      move_key(id, secondary);
    }
    blocks_[static_cast<std::size_t>(secondary)].retention_priority = block.retention_priority;
    transfers_.push_back({KvTransferKind::kOFFLOAD, id, secondary});
    ++offloaded_blocks_;
    freed.push_back(id);
    id = secondary;
  }
  // Last block first, as remove_sequence releases.
  for (auto id = freed.rbegin(); id != freed.rend(); ++id) {
    release_block(*id);
  }
  seq.suspended = true;
  ++num_suspended_;
}

void KVCacheManager::resume_sequence(RequestIdType request_id) {
  Sequence& seq = sequence(request_id, "resume_sequence");
  if (!seq.suspended) {
    throw std::invalid_argument(concat("resume_sequence: request_id ", request_id, " is not suspended"));
  }
  SizeType32 const needed = get_needed_blocks_to_resume(request_id);
  if (needed > num_free_[kPrimaryLevel]) {
    throw std::runtime_error(concat("resume_sequence: not enough free KV blocks for request_id ", request_id, ": need ",
                                    needed, ", free ", num_free_[kPrimaryLevel]));
  }
  // Commit; nothing below can fail. The secondary blocks stay held until every one has been
  // onboarded, so that the offloads the allocations may cause never take one of them.
  std::vector<BlockIdType> freed;
  freed.reserve(static_cast<std::size_t>(needed));
  for (BlockIdType& id : seq.block_ids) {
    if (level_of(id) == kSecondaryLevel) {
      freed.push_back(id);
      id = onboard(id);
    }
  }
  for (auto id = freed.rbegin(); id != freed.rend(); ++id) {
    release_block(*id);
  }
  seq.suspended = false;
  --num_suspended_;
}

}  // namespace inflight::batch_manager
