// KVCacheManager, persistence of the secondary level: listing its reusable blocks with their reuse
// keys (export_secondary_blocks) and adopting such a list into a fresh manager
// (import_secondary_blocks), so that a tier kept in a file survives an engine restart
// (docs/batch-manager.md §3.10). The manager knows ids and keys only: the engine stores the list
// beside the blocks' bytes and checks that both belong to the same model.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <utility>
#include <vector>

#include "inflight/batch_manager/kv_cache_manager.h"
#include "kv_cache_manager_internal.h"

namespace inflight::batch_manager {

using namespace kv_detail;

KvSecondaryBlocks KVCacheManager::export_secondary_blocks() const {
  KvSecondaryBlocks out;
  if (!enable_block_reuse_ || num_secondary_blocks_ == 0) {
    return out;
  }
  auto const tpb = static_cast<std::size_t>(tokens_per_block_);
  // Memo of "this block and all its ancestors are keyed secondary blocks": 0 unknown, 1 yes, 2 no.
  std::vector<std::uint8_t> state(blocks_.size(), 0);
  std::vector<BlockIdType> path;
  auto const whole_prefix_secondary = [&](BlockIdType id) {
    path.clear();
    std::uint8_t result = 1;
    for (BlockIdType b = id; b != kRoot; b = blocks_[static_cast<std::size_t>(b)].parent) {
      auto const i = static_cast<std::size_t>(b);
      if (state[i] != 0) {
        result = state[i];
        break;
      }
      if (level_of(b) != kSecondaryLevel || !blocks_[i].has_key) {
        result = 2;
        break;
      }
      path.push_back(b);
    }
    for (BlockIdType const b : path) {
      state[static_cast<std::size_t>(b)] = result;
    }
    return result == 1;
  };
  auto const append = [&](BlockIdType id) {
    Block const& block = blocks_[static_cast<std::size_t>(id)];
    out.block_ids.push_back(id);
    out.parents.push_back(block.parent);
    out.priorities.push_back(block.retention_priority);
    TokenIdType const* tokens = block_start(reuse_->tokens.data(), id, tokens_per_block_);
    out.tokens.insert(out.tokens.end(), tokens, tokens + tpb);
  };
  for (std::size_t p = 0; p < kNumPriorities; ++p) {
    FreeList const& list = free_lists_[static_cast<std::size_t>(kSecondaryLevel) * kNumPriorities + p];
    for (BlockIdType id = list.front; id != kNoBlock; id = blocks_[static_cast<std::size_t>(id)].next_free) {
      if (blocks_[static_cast<std::size_t>(id)].has_key && whole_prefix_secondary(id)) {
        append(id);
      }
    }
  }
  for (BlockIdType id = num_blocks_; id < num_blocks_ + num_secondary_blocks_; ++id) {
    Block const& block = blocks_[static_cast<std::size_t>(id)];
    if (block.ref_count > 0 && block.has_key && whole_prefix_secondary(id)) {
      append(id);
    }
  }
  return out;
}

void KVCacheManager::import_secondary_blocks(KvSecondaryBlocks const& in) {
  char const* const caller = "import_secondary_blocks";
  if (!enable_block_reuse_) {
    throw std::invalid_argument(concat(caller, ": block reuse is disabled (enable_block_reuse=false)"));
  }
  std::size_t const n = in.block_ids.size();
  auto const tpb = static_cast<std::size_t>(tokens_per_block_);
  if (in.parents.size() != n || in.priorities.size() != n) {
    throw std::invalid_argument(concat(caller, ": parents has ", in.parents.size(), " entries and priorities ",
                                       in.priorities.size(), "; both must have block_ids' ", n));
  }
  if (in.tokens.size() != n * tpb) {
    throw std::invalid_argument(concat(caller, ": tokens has ", in.tokens.size(), " entries, expected ", n * tpb,
                                       " (block_ids' ", n, " x tokens_per_block ", tpb, ")"));
  }
  if (n > static_cast<std::size_t>(num_secondary_blocks_)) {
    throw std::invalid_argument(
        concat(caller, ": ", n, " blocks listed, more than num_secondary_blocks ", num_secondary_blocks_));
  }
  if (!sequences_.empty() || !reuse_->by_hash.empty() || !transfers_.empty()) {
    throw std::invalid_argument(concat(caller, ": the manager is not fresh (", sequences_.size(), " sequences, ",
                                       reuse_->by_hash.size(), " cached blocks, ", transfers_.size(),
                                       " pending transfers); import into a new manager"));
  }
  if (n == 0) {
    return;
  }
  BlockIdType const first = num_blocks_;
  BlockIdType const last = num_blocks_ + num_secondary_blocks_ - 1;
  // Validation; nothing changes until every entry passed.
  std::vector<std::int64_t> index_of(static_cast<std::size_t>(num_secondary_blocks_), -1);
  for (std::size_t i = 0; i < n; ++i) {
    BlockIdType const id = in.block_ids[i];
    if (id < first || id > last) {
      throw std::invalid_argument(concat(caller, ": block_ids[", i, "] = ", id,
                                         " is not a secondary block id (must be in [", first, ", ", last, "])"));
    }
    std::int64_t& slot = index_of[static_cast<std::size_t>(id - first)];
    if (slot != -1) {
      throw std::invalid_argument(
          concat(caller, ": block_ids[", i, "] = ", id, " is listed twice (also block_ids[", slot, "])"));
    }
    slot = static_cast<std::int64_t>(i);
    if (in.priorities[i] < kMinRetentionPriority || in.priorities[i] > kMaxRetentionPriority) {
      throw std::invalid_argument(concat(caller, ": priorities[", i, "] must be in [0, 100], got ", in.priorities[i]));
    }
  }
  std::vector<std::int64_t> parent_index(n, -1);
  for (std::size_t i = 0; i < n; ++i) {
    BlockIdType const p = in.parents[i];
    if (p == kRoot) {
      continue;
    }
    if (p < first || p > last || index_of[static_cast<std::size_t>(p - first)] == -1) {
      throw std::invalid_argument(
          concat(caller, ": parents[", i, "] = ", p, " is not a listed block (a parent must be listed too, or -1)"));
    }
    parent_index[i] = index_of[static_cast<std::size_t>(p - first)];
  }
  // Depth of each entry below the root (-1 unknown, -2 on the current walk: a cycle).
  std::vector<SizeType32> depth(n, -1);
  std::vector<std::int64_t> walk;
  for (std::size_t i = 0; i < n; ++i) {
    walk.clear();
    std::int64_t cur = static_cast<std::int64_t>(i);
    while (cur != -1 && depth[static_cast<std::size_t>(cur)] == -1) {
      depth[static_cast<std::size_t>(cur)] = -2;
      walk.push_back(cur);
      cur = parent_index[static_cast<std::size_t>(cur)];
    }
    if (cur != -1 && depth[static_cast<std::size_t>(cur)] == -2) {
      throw std::invalid_argument(
          concat(caller, ": block_ids[", i, "] = ", in.block_ids[i], ": its chain of parents has a cycle"));
    }
    SizeType32 d = cur == -1 ? -1 : depth[static_cast<std::size_t>(cur)];
    for (auto it = walk.rbegin(); it != walk.rend(); ++it) {
      depth[static_cast<std::size_t>(*it)] = ++d;
    }
  }
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return depth[a] < depth[b]; });
  std::vector<std::uint64_t> hash(n);
  for (std::size_t const i : order) {
    std::uint64_t const parent_hash =
        parent_index[i] == -1 ? kRootHash : hash[static_cast<std::size_t>(parent_index[i])];
    hash[i] = chain_hash(parent_hash, in.tokens.data() + i * tpb, tokens_per_block_);
  }
  // One key per block: no two entries under one parent with the same tokens.
  std::vector<std::size_t> by_key(order);
  std::sort(by_key.begin(), by_key.end(), [&](std::size_t a, std::size_t b) {
    if (in.parents[a] != in.parents[b]) return in.parents[a] < in.parents[b];
    if (hash[a] != hash[b]) return hash[a] < hash[b];
    return a < b;
  });
  for (std::size_t g = 0; g < n;) {
    std::size_t end = g + 1;
    while (end < n && in.parents[by_key[end]] == in.parents[by_key[g]] && hash[by_key[end]] == hash[by_key[g]]) {
      ++end;
    }
    for (std::size_t a = g; a < end; ++a) {
      for (std::size_t b = a + 1; b < end; ++b) {
        if (std::memcmp(in.tokens.data() + by_key[a] * tpb, in.tokens.data() + by_key[b] * tpb,
                        tpb * sizeof(TokenIdType)) == 0) {
          std::size_t const i = std::min(by_key[a], by_key[b]);
          std::size_t const j = std::max(by_key[a], by_key[b]);
          throw std::invalid_argument(concat(caller, ": block_ids[", i, "] = ", in.block_ids[i], " and block_ids[", j,
                                             "] = ", in.block_ids[j],
                                             " hold the same key (the same parent and tokens)"));
        }
      }
    }
    g = end;
  }

  // Commit: every secondary block leaves the free queue (a fresh manager holds none), the listed
  // ones are keyed parents first and freed in the listed order, the rest cache nothing.
  for (BlockIdType id = first; id <= last; ++id) {
    take_free_block(id);
  }
  for (std::size_t const i : order) {
    set_key(in.block_ids[i], in.parents[i], hash[i], in.tokens.data() + i * tpb);
  }
  for (std::size_t i = 0; i < n; ++i) {
    blocks_[static_cast<std::size_t>(in.block_ids[i])].retention_priority = in.priorities[i];
    push_free_back(in.block_ids[i]);
  }
  for (BlockIdType id = last; id >= first; --id) {
    if (index_of[static_cast<std::size_t>(id - first)] == -1) {
      blocks_[static_cast<std::size_t>(id)].retention_priority = kMinRetentionPriority;
      push_free_front(id);
    }
  }
}

SizeType32 KVCacheManager::offload_reusable_blocks() {
  if (!enable_block_reuse_ || num_secondary_blocks_ == 0) {
    return 0;
  }
  std::vector<std::pair<SizeType32, BlockIdType>> order;  // (ancestors, id)
  for (BlockIdType id = 0; id < num_blocks_; ++id) {
    Block const& block = blocks_[static_cast<std::size_t>(id)];
    if (block.ref_count != 0 || !block.has_key || block.retention_priority < secondary_offload_min_priority_) {
      continue;
    }
    SizeType32 depth = 0;
    for (BlockIdType a = block.parent; a != kRoot; a = blocks_[static_cast<std::size_t>(a)].parent) {
      ++depth;
    }
    order.emplace_back(depth, id);
  }
  std::sort(order.begin(), order.end());
  SizeType32 moved = 0;
  for (auto const& [depth, id] : order) {
    if (num_free_[kSecondaryLevel] == 0 ||
        blocks_[static_cast<std::size_t>(front_free_block(kSecondaryLevel))].has_key) {
      break;
    }
    take_free_block(id);  // offload moves the key of a block out of the free queue
    moved += offload(id) ? 1 : 0;
    push_free_back(id);
  }
  return moved;
}

}  // namespace inflight::batch_manager
