// KVCacheManager: block accounting, the free queue and the prefix-reuse tree (TRT-LLM semantics,
// see docs/batch-manager.md). The secondary level and swap are in kv_cache_manager_secondary.cpp,
// the sliding window in kv_cache_manager_window.cpp,
// check_integrity in kv_cache_manager_integrity.cpp, the shared internals (the chained hash,
// Block, ReuseIndex) in kv_cache_manager_internal.h.
//
// Data layout, chosen so that the per-step paths (add_token, copy_block_tables, the scheduling
// helpers) are O(1) per block and allocation-free:
//   * blocks_[id] holds the block's refcount, retention priority, its free-list links and its node
//     in the reuse tree (parent, chained hash, children); primary ids first, then secondary ids.
//   * free_lists_[level * 101 + p] is an intrusive FIFO of the free blocks of that level and
//     retention priority p; the bitmask non_empty_lists_[level] finds the lowest non-empty priority
//     without scanning 101 lists.
//   * the reuse tree is stored as parent links plus one hash index (chained hash -> keyed blocks)
//     for all depths and both levels. A node is identified by (parent block, tokens); the chained
//     hash already covers the whole prefix, so one index serves every depth and the parent/tokens
//     comparison on lookup only guards against 64-bit collisions.
#include "inflight/batch_manager/kv_cache_manager.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "kv_cache_manager_internal.h"

namespace inflight::batch_manager {

using namespace kv_detail;

KVCacheManager::KVCacheManager(SizeType32 num_blocks, SizeType32 tokens_per_block, SizeType32 max_seq_len,
                               bool enable_block_reuse, SizeType32 num_secondary_blocks,
                               SizeType32 secondary_offload_min_priority, SizeType32 attention_window)
    : num_blocks_(num_blocks),
      tokens_per_block_(tokens_per_block),
      max_seq_len_(max_seq_len),
      enable_block_reuse_(enable_block_reuse),
      num_secondary_blocks_(num_secondary_blocks),
      secondary_offload_min_priority_(secondary_offload_min_priority),
      attention_window_(attention_window) {
  if (num_blocks < 1) {
    throw std::invalid_argument(concat("num_blocks must be >= 1, got ", num_blocks));
  }
  if (tokens_per_block < 1) {
    throw std::invalid_argument(concat("tokens_per_block must be >= 1, got ", tokens_per_block));
  }
  if (max_seq_len < 1) {
    throw std::invalid_argument(concat("max_seq_len must be >= 1, got ", max_seq_len));
  }
  if (num_secondary_blocks < 0 || num_secondary_blocks > std::numeric_limits<SizeType32>::max() - num_blocks) {
    throw std::invalid_argument(concat("num_secondary_blocks must be in [0, ",
                                       std::numeric_limits<SizeType32>::max() - num_blocks, "], got ",
                                       num_secondary_blocks));
  }
  if (secondary_offload_min_priority < kMinRetentionPriority ||
      secondary_offload_min_priority > kMaxRetentionPriority) {
    throw std::invalid_argument(
        concat("secondary_offload_min_priority must be in [0, 100], got ", secondary_offload_min_priority));
  }
  if (attention_window < 0) {
    throw std::invalid_argument(concat("attention_window must be >= 0 (0: no window), got ", attention_window));
  }
  if (attention_window > 0 && num_secondary_blocks > 0) {
    throw std::invalid_argument(concat("attention_window ", attention_window, " with num_secondary_blocks ",
                                       num_secondary_blocks, ": a sliding-window manager has no secondary level"));
  }
  std::size_t const total = static_cast<std::size_t>(num_blocks) + static_cast<std::size_t>(num_secondary_blocks);
  blocks_.resize(total);
  free_lists_.resize(kNumLevels * kNumPriorities);
  reuse_ = std::make_unique<ReuseIndex>();
  if (enable_block_reuse_) {
    reuse_->tokens.resize(total * static_cast<std::size_t>(tokens_per_block));
    reuse_->drop_stack.reserve(total);
    // At most one key per block: no rehash (and no allocation of buckets) while storing.
    reuse_->by_hash.reserve(total);
  }
  for (BlockIdType id = 0; id < static_cast<BlockIdType>(total); ++id) {
    push_free_back(id);
  }
  scheduling_num_free_blocks_ = num_free_[kPrimaryLevel];
}

KVCacheManager::~KVCacheManager() = default;

SizeType32 KVCacheManager::num_free_blocks() const { return num_free_[kPrimaryLevel]; }

// ---------------------------------------------------------------------------------------------
// Free queue.

KVCacheManager::FreeList& KVCacheManager::free_list(BlockIdType block_id) {
  auto const level = static_cast<std::size_t>(level_of(block_id));
  auto const priority = static_cast<std::size_t>(blocks_[static_cast<std::size_t>(block_id)].retention_priority);
  return free_lists_[level * kNumPriorities + priority];
}

void KVCacheManager::push_free_back(BlockIdType block_id) {
  Block& block = blocks_[static_cast<std::size_t>(block_id)];
  SizeType32 const level = level_of(block_id);
  auto const priority = static_cast<std::size_t>(block.retention_priority);
  FreeList& list = free_list(block_id);
  block.prev_free = list.back;
  block.next_free = kNoBlock;
  if (list.back == kNoBlock) {
    list.front = block_id;
  } else {
    blocks_[static_cast<std::size_t>(list.back)].next_free = block_id;
  }
  list.back = block_id;
  ++list.size;
  non_empty_lists_[level][priority / 64] |= std::uint64_t{1} << (priority % 64);
  ++num_free_[level];
  num_free_keyed_[level] += block.has_key ? 1 : 0;
}

void KVCacheManager::push_free_front(BlockIdType block_id) {
  Block& block = blocks_[static_cast<std::size_t>(block_id)];
  SizeType32 const level = level_of(block_id);
  auto const priority = static_cast<std::size_t>(block.retention_priority);
  FreeList& list = free_list(block_id);
  block.prev_free = kNoBlock;
  block.next_free = list.front;
  if (list.front == kNoBlock) {
    list.back = block_id;
  } else {
    blocks_[static_cast<std::size_t>(list.front)].prev_free = block_id;
  }
  list.front = block_id;
  ++list.size;
  non_empty_lists_[level][priority / 64] |= std::uint64_t{1} << (priority % 64);
  ++num_free_[level];
  num_free_keyed_[level] += block.has_key ? 1 : 0;
}

void KVCacheManager::take_free_block(BlockIdType block_id) {
  Block& block = blocks_[static_cast<std::size_t>(block_id)];
  SizeType32 const level = level_of(block_id);
  auto const priority = static_cast<std::size_t>(block.retention_priority);
  FreeList& list = free_list(block_id);
  if (block.prev_free == kNoBlock) {
    list.front = block.next_free;
  } else {
    blocks_[static_cast<std::size_t>(block.prev_free)].next_free = block.next_free;
  }
  if (block.next_free == kNoBlock) {
    list.back = block.prev_free;
  } else {
    blocks_[static_cast<std::size_t>(block.next_free)].prev_free = block.prev_free;
  }
  block.prev_free = kNoBlock;
  block.next_free = kNoBlock;
  if (--list.size == 0) {
    non_empty_lists_[level][priority / 64] &= ~(std::uint64_t{1} << (priority % 64));
  }
  --num_free_[level];
  num_free_keyed_[level] -= block.has_key ? 1 : 0;
}

BlockIdType KVCacheManager::front_free_block(SizeType32 level) const {
  std::uint64_t const* bits = non_empty_lists_[level];
  std::size_t const priority = bits[0] != 0 ? static_cast<std::size_t>(std::countr_zero(bits[0]))
                                            : 64 + static_cast<std::size_t>(std::countr_zero(bits[1]));
  return free_lists_[static_cast<std::size_t>(level) * kNumPriorities + priority].front;
}

BlockIdType KVCacheManager::allocate_block(SizeType32 retention_priority) {
  // Callers check num_free_[kPrimaryLevel] first, so some primary list is non-empty.
  BlockIdType const block_id = front_free_block(kPrimaryLevel);
  take_free_block(block_id);
  Block& block = blocks_[static_cast<std::size_t>(block_id)];
  block.ref_count = 1;  // taken (before drop_key, which counts the free blocks losing their key)
  // The memory is about to be overwritten: its cached prefix moves to the secondary level, or it
  // (and everything chained below it, now unreachable) must no longer be found.
  if (block.has_key && !offload(block_id)) {
    drop_key(block_id);
  }
  block.retention_priority = retention_priority;
  return block_id;
}

void KVCacheManager::release_block(BlockIdType block_id) {
  Block& block = blocks_[static_cast<std::size_t>(block_id)];
  if (--block.ref_count != 0) {
    return;
  }
  if (level_of(block_id) == kSecondaryLevel && !block.has_key) {
    // A secondary block caches nothing without a key: it is the first one to take for new contents.
    block.retention_priority = kMinRetentionPriority;
    push_free_front(block_id);
  } else {
    push_free_back(block_id);
  }
}

// ---------------------------------------------------------------------------------------------
// Reuse tree.

BlockIdType KVCacheManager::find_child(BlockIdType parent, std::uint64_t hash, TokenIdType const* tokens) const {
  auto const bytes = static_cast<std::size_t>(tokens_per_block_) * sizeof(TokenIdType);
  auto const [first, last] = reuse_->by_hash.equal_range(hash);
  for (auto it = first; it != last; ++it) {
    BlockIdType const candidate = it->second;
    if (blocks_[static_cast<std::size_t>(candidate)].parent == parent &&
        std::memcmp(block_start(reuse_->tokens.data(), candidate, tokens_per_block_), tokens, bytes) == 0) {
      return candidate;
    }
  }
  return kNoBlock;
}

void KVCacheManager::set_key(BlockIdType block_id, BlockIdType parent, std::uint64_t hash, TokenIdType const* tokens) {
  auto const tpb = static_cast<std::size_t>(tokens_per_block_);
  Block& block = blocks_[static_cast<std::size_t>(block_id)];
  block.has_key = true;
  block.parent = parent;
  block.hash = hash;
  std::memcpy(reuse_->tokens.data() + static_cast<std::size_t>(block_id) * tpb, tokens, tpb * sizeof(TokenIdType));
  std::vector<BlockIdType>& siblings =
      parent == kRoot ? reuse_->root_children : blocks_[static_cast<std::size_t>(parent)].children;
  block.child_index = static_cast<SizeType32>(siblings.size());
  siblings.push_back(block_id);
  reuse_->by_hash.emplace(hash, block_id);
}

void KVCacheManager::drop_key(BlockIdType block_id) {
  Block& top = blocks_[static_cast<std::size_t>(block_id)];
  // Unlink the subtree's root from its parent (swap-remove, fixing the moved sibling's index);
  // the descendants' parents are dropped with them, so only this one link needs care.
  std::vector<BlockIdType>& siblings =
      top.parent == kRoot ? reuse_->root_children : blocks_[static_cast<std::size_t>(top.parent)].children;
  BlockIdType const moved = siblings.back();
  siblings[static_cast<std::size_t>(top.child_index)] = moved;
  blocks_[static_cast<std::size_t>(moved)].child_index = top.child_index;
  siblings.pop_back();

  std::vector<BlockIdType>& stack = reuse_->drop_stack;
  stack.push_back(block_id);
  while (!stack.empty()) {
    BlockIdType const id = stack.back();
    stack.pop_back();
    Block& block = blocks_[static_cast<std::size_t>(id)];
    auto const [first, last] = reuse_->by_hash.equal_range(block.hash);
    for (auto it = first; it != last; ++it) {
      if (it->second == id) {
        reuse_->by_hash.erase(it);
        break;
      }
    }
    stack.insert(stack.end(), block.children.begin(), block.children.end());
    block.children.clear();
    num_free_keyed_[level_of(id)] -= block.ref_count == 0 ? 1 : 0;
    block.has_key = false;
    block.parent = kRoot;
    block.hash = 0;
    block.child_index = -1;
  }
}

void KVCacheManager::store_blocks(std::vector<TokenIdType> const& tokens, SizeType32 num_tokens,
                                  std::vector<BlockIdType> const& block_ids, SizeType32 retention_priority) {
  auto const tpb = static_cast<std::size_t>(tokens_per_block_);
  std::size_t const num_full =
      std::min({static_cast<std::size_t>(std::max(num_tokens, 0)) / tpb, tokens.size() / tpb, block_ids.size()});
  BlockIdType parent = kRoot;
  std::uint64_t parent_hash = kRootHash;
  for (std::size_t i = 0; i < num_full; ++i) {
    TokenIdType const* block_tokens = tokens.data() + i * tpb;
    std::uint64_t const hash = chain_hash(parent_hash, block_tokens, tokens_per_block_);
    BlockIdType const ours = block_ids[i];
    BlockIdType const found = find_child(parent, hash, block_tokens);
    if (ours == kNoBlock) {
      // Released by the window: its contents are gone, so the walk can only pass through a node that
      // caches the same prefix; below a prefix that is not cached nothing can be keyed.
      if (found == kNoBlock) {
        return;
      }
      parent = found;
      parent_hash = hash;
      continue;
    }
    if (found == kNoBlock) {
      // The tree maps a content prefix to at most one node, so a keyed block of ours would have
      // been found on this path; a key here would be stale. Dropping it keeps the tree consistent.
      if (blocks_[static_cast<std::size_t>(ours)].has_key) {
        drop_key(ours);
      }
      set_key(ours, parent, hash, block_tokens);
      parent = ours;
    } else {
      // Same contents already cached (ours, or another block computed concurrently): walk on
      // through the cached node; our block stays as it is and is freed plain.
      parent = found;
    }
    // Our blocks are in use (we hold them), so changing their priority moves no free list.
    blocks_[static_cast<std::size_t>(ours)].retention_priority = retention_priority;
    parent_hash = hash;
  }
}

SizeType32 KVCacheManager::match_prefix(TokenIdType const* tokens, SizeType32 num_lookup,
                                        std::vector<BlockIdType>* hits) const {
  BlockIdType parent = kRoot;
  std::uint64_t parent_hash = kRootHash;
  SizeType32 num_hits = 0;
  for (; num_hits < num_lookup; ++num_hits) {
    TokenIdType const* block_tokens = block_start(tokens, num_hits, tokens_per_block_);
    std::uint64_t const hash = chain_hash(parent_hash, block_tokens, tokens_per_block_);
    BlockIdType const found = find_child(parent, hash, block_tokens);
    if (found == kNoBlock) {
      break;
    }
    if (hits != nullptr) {
      hits->push_back(found);
    }
    parent = found;
    parent_hash = hash;
  }
  return num_hits;
}

SizeType32 KVCacheManager::count_reusable_blocks(LlmRequest const& request) const {
  if (!enable_block_reuse_) {
    return 0;
  }
  SizeType32 const lookup_len = std::min(request.prompt_len(), request.num_tokens());
  return match_prefix(request.tokens().data(), std::max(lookup_len - 1, 0) / tokens_per_block_, nullptr);
}

// ---------------------------------------------------------------------------------------------
// Sequences.

KVCacheManager::Sequence& KVCacheManager::sequence(RequestIdType request_id, char const* caller) {
  auto it = sequences_.find(request_id);
  if (it == sequences_.end()) {
    throw std::invalid_argument(concat(caller, ": request_id ", request_id, " is not in the KV cache manager"));
  }
  return it->second;
}

KVCacheManager::Sequence const& KVCacheManager::sequence(RequestIdType request_id, char const* caller) const {
  auto it = sequences_.find(request_id);
  if (it == sequences_.end()) {
    throw std::invalid_argument(concat(caller, ": request_id ", request_id, " is not in the KV cache manager"));
  }
  return it->second;
}

KVCacheManager::Sequence& KVCacheManager::active_sequence(RequestIdType request_id, char const* caller) {
  Sequence& seq = sequence(request_id, caller);
  if (seq.suspended) {
    throw std::invalid_argument(concat(caller, ": request_id ", request_id, " is suspended (resume_sequence first)"));
  }
  return seq;
}

void KVCacheManager::add_sequence(RequestIdType request_id, SizeType32 input_length, SizeType32 beam_width,
                                  LlmRequest* request, SizeType32 max_reused_blocks) {
  if (sequences_.count(request_id) != 0) {
    throw std::invalid_argument(concat("add_sequence: request_id ", request_id, " is already in the KV cache manager"));
  }
  if (input_length < 1 || input_length > max_seq_len_) {
    throw std::invalid_argument(
        concat("add_sequence: input_length must be in [1, ", max_seq_len_, "] (max_seq_len), got ", input_length));
  }
  if (beam_width != 1) {
    throw std::invalid_argument(concat("add_sequence: only beam_width 1 is supported, got beam_width ", beam_width));
  }
  if (request != nullptr && request->request_id() != request_id) {
    throw std::invalid_argument(concat("add_sequence: request->request_id() ", request->request_id(),
                                       " does not match request_id ", request_id));
  }
  SizeType32 const retention_priority =
      request != nullptr ? request->kv_retention_priority() : kDefaultRetentionPriority;
  if (retention_priority < kMinRetentionPriority || retention_priority > kMaxRetentionPriority) {
    throw std::invalid_argument(
        concat("add_sequence: kv_retention_priority must be in [0, 100], got ", retention_priority));
  }

  SizeType32 const num_blocks = ceil_div(input_length, tokens_per_block_);
  Sequence seq;
  seq.num_tokens = input_length;
  seq.retention_priority = retention_priority;
  // Reserved once so that add_token never reallocates.
  seq.block_ids.reserve(max_block_entries());

  // Prefix lookup. The last prompt token is never reused (its logits must be computed), hence
  // (len - 1) / tpb. The prompt is capped at what the request really holds, so that the lookup
  // never reads past its tokens and k * tpb < prompt_len as set_prepopulated_prompt_len requires.
  SizeType32 num_free_hits = 0;
  SizeType32 num_secondary_hits = 0;
  if (enable_block_reuse_ && request != nullptr) {
    SizeType32 const lookup_len = std::min({input_length, request->prompt_len(), request->num_tokens()});
    SizeType32 num_lookup = (lookup_len - 1) / tokens_per_block_;
    if (max_reused_blocks >= 0) {
      num_lookup = std::min(num_lookup, max_reused_blocks);
    }
    match_prefix(request->tokens().data(), num_lookup, &seq.block_ids);
    for (BlockIdType const found : seq.block_ids) {
      if (level_of(found) == kSecondaryLevel) {
        ++num_secondary_hits;  // onboarded into a fresh primary block
      } else {
        num_free_hits += blocks_[static_cast<std::size_t>(found)].ref_count == 0 ? 1 : 0;
      }
    }
  }
  auto const num_hits = static_cast<SizeType32>(seq.block_ids.size());
  SizeType32 const num_new = num_blocks - num_hits;
  SizeType32 const needed = num_new + num_free_hits + num_secondary_hits;
  if (needed > num_free_[kPrimaryLevel]) {
    throw std::runtime_error(concat("add_sequence: not enough free KV blocks for request_id ", request_id, ": need ",
                                    needed, ", free ", num_free_[kPrimaryLevel]));
  }

  // Commit; nothing below can fail. Hits are claimed before allocating so that an allocation can
  // never evict a block this sequence is about to use. A free secondary hit is pinned the same way
  // (ref_count 1, out of the free queue) until its contents have moved to primary; one held by a
  // suspended sequence stays that sequence's.
  std::vector<BlockIdType> pinned;
  for (BlockIdType const id : seq.block_ids) {
    Block& block = blocks_[static_cast<std::size_t>(id)];
    if (level_of(id) == kSecondaryLevel) {
      if (block.ref_count == 0) {
        take_free_block(id);
        block.ref_count = 1;
        pinned.push_back(id);
      }
      continue;
    }
    if (block.ref_count == 0) {
      take_free_block(id);
    }
    ++block.ref_count;
  }
  if (num_secondary_hits > 0) {
    for (BlockIdType& id : seq.block_ids) {
      if (level_of(id) == kSecondaryLevel) {
        id = onboard(id);
      }
    }
  }
  for (SizeType32 i = 0; i < num_new; ++i) {
    seq.block_ids.push_back(allocate_block(retention_priority));
  }
  // The onboarded secondary blocks hold no key any more: back to the secondary free queue, last first.
  for (auto id = pinned.rbegin(); id != pinned.rend(); ++id) {
    release_block(*id);
  }
  Sequence& added = sequences_.emplace(request_id, std::move(seq)).first->second;

  reused_blocks_ += num_hits;
  secondary_reused_blocks_ += num_secondary_hits;
  missed_blocks_ += num_new;
  alloc_total_blocks_ += num_blocks;
  alloc_new_blocks_ += num_new;
  if (num_hits > 0) {
    request->set_prepopulated_prompt_len(num_hits * tokens_per_block_);
  }
  // The first query is the first token not reused: what it cannot see is released (stored first).
  slide(added, num_hits * tokens_per_block_, request);
}

SizeType32 KVCacheManager::cow_blocks(Sequence const& seq) const {
  if (seq.num_tokens % tokens_per_block_ == 0 || seq.block_ids.empty()) return 0;  // the next token starts a block
  return blocks_[static_cast<std::size_t>(seq.block_ids.back())].ref_count > 1 ? 1 : 0;
}

void KVCacheManager::copy_on_write(Sequence& seq) {
  BlockIdType const shared = seq.block_ids.back();
  BlockIdType const fresh = allocate_block(seq.retention_priority);
  --blocks_[static_cast<std::size_t>(shared)].ref_count;  // still >= 1: another sequence holds it
  seq.block_ids.back() = fresh;
  block_copies_.emplace_back(shared, fresh);
  ++alloc_total_blocks_;
  ++alloc_new_blocks_;
}

void KVCacheManager::fork_sequence(RequestIdType src_id, RequestIdType dst_id) {
  Sequence const& src = active_sequence(src_id, "fork_sequence");
  if (sequences_.count(dst_id) != 0) {
    throw std::invalid_argument(concat("fork_sequence: request_id ", dst_id, " is already in the KV cache manager"));
  }
  Sequence dst;
  dst.num_tokens = src.num_tokens;
  dst.retention_priority = src.retention_priority;
  dst.num_released = src.num_released;
  dst.block_ids.reserve(max_block_entries());
  dst.block_ids = src.block_ids;
  for (auto b = dst.block_ids.begin() + dst.num_released; b != dst.block_ids.end(); ++b) {
    ++blocks_[static_cast<std::size_t>(*b)].ref_count;
  }
  sequences_.emplace(dst_id, std::move(dst));
}

std::vector<std::pair<BlockIdType, BlockIdType>> KVCacheManager::take_block_copies() {
  std::vector<std::pair<BlockIdType, BlockIdType>> out;
  out.swap(block_copies_);
  return out;
}

void KVCacheManager::add_token(RequestIdType request_id) {
  Sequence& seq = active_sequence(request_id, "add_token");
  if (seq.num_tokens >= max_seq_len_) {
    throw std::invalid_argument(concat("add_token: request_id ", request_id, " already holds ", seq.num_tokens,
                                       " tokens, max_seq_len is ", max_seq_len_));
  }
  slide(seq, seq.num_tokens, nullptr);  // the new token is the next query
  if (cow_blocks(seq) != 0) {           // the token lands in a last block another sequence holds
    if (num_free_[kPrimaryLevel] == 0) {
      throw std::runtime_error(
          concat("add_token: not enough free KV blocks for request_id ", request_id, ": need 1, free 0"));
    }
    copy_on_write(seq);
  }
  // The new token (number num_tokens + 1) starts a block when num_tokens is a multiple of tpb.
  if (seq.num_tokens % tokens_per_block_ == 0) {
    if (num_free_[kPrimaryLevel] == 0) {
      throw std::runtime_error(
          concat("add_token: not enough free KV blocks for request_id ", request_id, ": need 1, free 0"));
    }
    seq.block_ids.push_back(allocate_block(seq.retention_priority));
    ++alloc_total_blocks_;
    ++alloc_new_blocks_;
  }
  ++seq.num_tokens;
}

void KVCacheManager::add_tokens(RequestIdType request_id, SizeType32 n) {
  Sequence& seq = active_sequence(request_id, "add_tokens");
  if (n < 0) throw std::invalid_argument(concat("add_tokens: n must be >= 0, got ", n));
  if (n > max_seq_len_ - seq.num_tokens) {
    throw std::invalid_argument(concat("add_tokens: request_id ", request_id, " holds ", seq.num_tokens, " tokens; ", n,
                                       " more exceed max_seq_len ", max_seq_len_));
  }
  if (n > 0) {
    slide(seq, seq.num_tokens, nullptr);  // the first new token is the next query
  }
  SizeType32 const blocks_after = ceil_div(seq.num_tokens + n, tokens_per_block_);
  SizeType32 const needed = blocks_after - static_cast<SizeType32>(seq.block_ids.size());
  SizeType32 const cow = n > 0 ? cow_blocks(seq) : 0;
  if (needed + cow > num_free_[kPrimaryLevel]) {
    throw std::runtime_error(concat("add_tokens: not enough free KV blocks for request_id ", request_id, ": need ",
                                    needed + cow, ", free ", num_free_[kPrimaryLevel]));
  }
  if (cow != 0) copy_on_write(seq);
  for (SizeType32 i = 0; i < needed; ++i) {
    seq.block_ids.push_back(allocate_block(seq.retention_priority));
  }
  alloc_total_blocks_ += needed;
  alloc_new_blocks_ += needed;
  seq.num_tokens += n;
}

void KVCacheManager::rewind(RequestIdType request_id, SizeType32 n) {
  Sequence& seq = active_sequence(request_id, "rewind");
  if (n < 0 || n >= seq.num_tokens) {
    throw std::invalid_argument(concat("rewind: n must be in [0, ", seq.num_tokens - 1, "] (request_id ", request_id,
                                       " keeps at least one of its ", seq.num_tokens, " tokens), got ", n));
  }
  if (seq.num_released > 0) {
    // The window cannot move back over the blocks it released: the query at the new end must still
    // see W tokens.
    SizeType32 const max_n = seq.num_tokens - (seq.num_released * tokens_per_block_ + attention_window_ - 1);
    if (n > max_n) {
      throw std::invalid_argument(concat("rewind: n must be in [0, ", max_n, "] (request_id ", request_id, " released ",
                                         seq.num_released, " blocks to its window ", attention_window_, "), got ", n));
    }
  }
  seq.num_tokens -= n;
  auto const keep = static_cast<std::size_t>(ceil_div(seq.num_tokens, tokens_per_block_));
  while (seq.block_ids.size() > keep) {
    if (seq.block_ids.back() != kNoBlock) {
      release_block(seq.block_ids.back());
    }
    seq.block_ids.pop_back();
  }
  seq.num_released = std::min(seq.num_released, static_cast<SizeType32>(seq.block_ids.size()));
}

void KVCacheManager::remove_sequence(RequestIdType request_id, LlmRequest* request) {
  auto it = sequences_.find(request_id);
  if (it == sequences_.end()) {
    throw std::invalid_argument(concat("remove_sequence: request_id ", request_id, " is not in the KV cache manager"));
  }
  if (request != nullptr && request->request_id() != request_id) {
    throw std::invalid_argument(concat("remove_sequence: request->request_id() ", request->request_id(),
                                       " does not match request_id ", request_id));
  }
  Sequence& seq = it->second;
  if (enable_block_reuse_ && request != nullptr) {
    // Only tokens whose KV was computed may be published: the sequence may hold tokens not yet
    // sampled into the request, and a context still running has computed only up to its position.
    SizeType32 num_stored = std::min(seq.num_tokens, request->num_tokens());
    if (request->is_context_init_state()) {
      num_stored = std::min(num_stored, request->context_current_position());
    }
    store_blocks(request->tokens(), num_stored, seq.block_ids, request->kv_retention_priority());
  }
  // Last block first: the leaves of a prefix reach the free queue before their parents and are
  // therefore evicted first, keeping the cached prefixes usable for longer.
  for (auto block = seq.block_ids.rbegin(); block != seq.block_ids.rend() - seq.num_released; ++block) {
    release_block(*block);
  }
  num_suspended_ -= seq.suspended ? 1 : 0;
  sequences_.erase(it);
}

void KVCacheManager::store_context_blocks(LlmRequest const& request) {
  if (!enable_block_reuse_) {
    return;
  }
  Sequence const& seq = active_sequence(request.request_id(), "store_context_blocks");
  SizeType32 const num_stored = std::min({request.prompt_len(), request.num_tokens(), seq.num_tokens});
  store_blocks(request.tokens(), num_stored, seq.block_ids, request.kv_retention_priority());
}

std::vector<BlockIdType> const& KVCacheManager::get_block_ids(RequestIdType request_id) const {
  return sequence(request_id, "get_block_ids").block_ids;
}

SizeType32 KVCacheManager::get_num_tokens(RequestIdType request_id) const {
  return sequence(request_id, "get_num_tokens").num_tokens;
}

void KVCacheManager::copy_block_tables(std::vector<RequestIdType> const& request_ids, BlockIdType* out,
                                       std::int64_t num_rows, std::int64_t row_stride) const {
  if (num_rows < 0 || static_cast<std::int64_t>(request_ids.size()) > num_rows) {
    throw std::invalid_argument(
        concat("copy_block_tables: num_rows must be >= request_ids.size() ", request_ids.size(), ", got ", num_rows));
  }
  if (row_stride < 0) {
    throw std::invalid_argument(concat("copy_block_tables: row_stride must be >= 0, got ", row_stride));
  }
  if (out == nullptr && !request_ids.empty()) {
    throw std::invalid_argument("copy_block_tables: out must not be null");
  }
  // On an error the rows written so far stay written; the manager's own state never changes.
  auto const stride = static_cast<std::size_t>(row_stride);
  for (std::size_t row = 0; row < request_ids.size(); ++row) {
    Sequence const& seq = sequence(request_ids[row], "copy_block_tables");
    if (seq.suspended) {
      throw std::invalid_argument(
          concat("copy_block_tables: request_id ", request_ids[row], " is suspended (resume_sequence first)"));
    }
    std::vector<BlockIdType> const& ids = seq.block_ids;
    if (ids.size() > stride) {
      throw std::invalid_argument(concat("copy_block_tables: request_id ", request_ids[row], " holds ", ids.size(),
                                         " blocks, more than row_stride ", row_stride));
    }
    BlockIdType* dst = out + row * stride;
    std::memcpy(dst, ids.data(), ids.size() * sizeof(BlockIdType));
    std::memset(dst + ids.size(), 0, (stride - ids.size()) * sizeof(BlockIdType));
    std::memset(dst, 0, static_cast<std::size_t>(seq.num_released) * sizeof(BlockIdType));
  }
}

KvCacheStats KVCacheManager::get_kv_cache_stats() const {
  KvCacheStats stats;
  stats.max_num_blocks = num_blocks_;
  stats.free_num_blocks = num_free_[kPrimaryLevel];
  stats.used_num_blocks = num_blocks_ - num_free_[kPrimaryLevel];
  stats.tokens_per_block = tokens_per_block_;
  stats.alloc_total_blocks = alloc_total_blocks_;
  stats.alloc_new_blocks = alloc_new_blocks_;
  stats.reused_blocks = reused_blocks_;
  stats.reusable_num_blocks = num_free_keyed_[kPrimaryLevel];
  stats.missed_blocks = missed_blocks_;
  std::int64_t const lookups = reused_blocks_ + missed_blocks_;
  stats.cache_hit_rate = lookups == 0 ? 0.0 : static_cast<double>(reused_blocks_) / static_cast<double>(lookups);
  stats.max_num_secondary_blocks = num_secondary_blocks_;
  stats.free_num_secondary_blocks = num_free_[kSecondaryLevel];
  stats.used_num_secondary_blocks = num_secondary_blocks_ - num_free_[kSecondaryLevel];
  stats.reusable_num_secondary_blocks = num_free_keyed_[kSecondaryLevel];
  stats.offloaded_blocks = offloaded_blocks_;
  stats.onboarded_blocks = onboarded_blocks_;
  stats.secondary_reused_blocks = secondary_reused_blocks_;
  stats.secondary_hit_rate =
      lookups == 0 ? 0.0 : static_cast<double>(secondary_reused_blocks_) / static_cast<double>(lookups);
  return stats;
}

// ---------------------------------------------------------------------------------------------
// Scheduling simulation.

void KVCacheManager::start_scheduling() { scheduling_num_free_blocks_ = num_free_[kPrimaryLevel]; }

void KVCacheManager::scheduling_remove_sequence(RequestIdType request_id) {
  auto it = sequences_.find(request_id);
  if (it == sequences_.end()) {
    return;
  }
  // A block shared with another sequence (prefix reuse) would stay in use after this one goes; the
  // secondary blocks of a suspended sequence free no primary block.
  std::vector<BlockIdType> const& ids = it->second.block_ids;
  for (auto id = ids.begin() + it->second.num_released; id != ids.end(); ++id) {
    if (blocks_[static_cast<std::size_t>(*id)].ref_count == 1 && level_of(*id) == kPrimaryLevel) {
      ++scheduling_num_free_blocks_;
    }
  }
}

SizeType32 KVCacheManager::get_needed_blocks_one_step(LlmRequest const& request, bool two_steps_lookahead) const {
  if (request.is_context_init_state()) {
    if (!request.is_first_context_chunk()) {
      return 0;  // the whole prompt was allocated with the first chunk
    }
    // Prefix hits are not subtracted (TRT-LLM): the hit blocks may be free and must be counted.
    return ceil_div(request.prompt_len() + request.num_draft_tokens(), tokens_per_block_);
  }
  if (request.is_generation_in_progress_state()) {
    SizeType32 const t = request.prompt_len() + request.num_generated_tokens() - 1;
    SizeType32 const steps = two_steps_lookahead ? 2 : 1;
    if (t + steps > max_seq_len_) {
      return 0;
    }
    // A speculative step writes the input token and its drafts: 1 + num_draft_tokens per step (TRT-LLM),
    // never past max_seq_len.
    SizeType32 const k = std::min(steps * (1 + request.num_draft_tokens()), max_seq_len_ - t);
    SizeType32 new_blocks = ceil_div(t + k, tokens_per_block_) - ceil_div(t, tokens_per_block_);
    if (attention_window_ > 0) {
      // The step first releases the blocks its first query (position t) no longer sees.
      auto it = sequences_.find(request.request_id());
      SizeType32 const num_released = it == sequences_.end() ? 0 : it->second.num_released;
      SizeType32 const dead = std::max<SizeType32>(0, t - attention_window_ + 1) / tokens_per_block_;
      new_blocks = std::max<SizeType32>(0, new_blocks - std::max<SizeType32>(0, dead - num_released));
    }
    return new_blocks * request.beam_width();
  }
  return 0;
}

SizeType32 KVCacheManager::get_remaining_blocks_to_completion(LlmRequest const& request) const {
  if (attention_window_ > 0) {
    return remaining_blocks_in_window(request);
  }
  // 64-bit: prompt_len + max_new_tokens may pass INT32_MAX for a request that sets a huge
  // max_new_tokens and relies on max_seq_len / end ids to stop.
  std::int64_t const tpb = tokens_per_block_;
  std::int64_t const c = request.prompt_len() / tpb;
  std::int64_t const total = (std::int64_t{request.prompt_len()} + request.max_new_tokens() + tpb - 1) / tpb;
  auto it = sequences_.find(request.request_id());
  std::int64_t const h = it == sequences_.end() ? 0 : static_cast<std::int64_t>(it->second.block_ids.size());
  std::int64_t const beam_width = request.beam_width();
  std::int64_t remaining = h < c ? c - h + (total - c) * beam_width : (total - h) * beam_width;
  if (h >= c && beam_width > 1 && request.prompt_len() % tokens_per_block_ != 0 &&
      request.num_tokens() <= request.prompt_len() + 1) {
    // The prompt's partial last block, held once, is copied for every other beam on the first decode
    // step (copy-on-write).
    remaining += beam_width - 1;
  }
  // A sequence can hold more than T blocks only in degenerate cases (tokens added past
  // max_new_tokens); a negative count would hand other requests blocks that are not free.
  return static_cast<SizeType32>(std::clamp<std::int64_t>(remaining, 0, std::numeric_limits<SizeType32>::max()));
}

SizeType32 KVCacheManager::remaining_blocks_in_window(LlmRequest const& request) const {
  // The prompt is held whole when added; a decode step (1 + k tokens) sees at most W + k positions,
  // i.e. ceil((W + k) / tpb) + 1 blocks per beam. Remaining: the most the sequence will hold at once
  // minus what it holds (its released blocks not counted).
  std::int64_t const tpb = tokens_per_block_;
  std::int64_t const total = (std::int64_t{request.prompt_len()} + request.max_new_tokens() + tpb - 1) / tpb;
  std::int64_t const per_beam =
      std::min(total, (std::int64_t{attention_window_} + request.num_draft_tokens() + tpb - 1) / tpb + 1);
  std::int64_t const peak = per_beam * request.beam_width();
  auto it = sequences_.find(request.request_id());
  std::int64_t remaining = 0;
  if (it == sequences_.end()) {
    remaining = std::max((std::int64_t{request.prompt_len()} + tpb - 1) / tpb, peak);
  } else {
    Sequence const& seq = it->second;
    remaining = peak - (static_cast<std::int64_t>(seq.block_ids.size()) - seq.num_released);
  }
  return static_cast<SizeType32>(std::clamp<std::int64_t>(remaining, 0, std::numeric_limits<SizeType32>::max()));
}

std::optional<std::uint64_t> KVCacheManager::find_new_context_block(LlmRequest const& request) const {
  if (!enable_block_reuse_) {
    return std::nullopt;
  }
  SizeType32 const lookup_len = std::min(request.prompt_len(), request.num_tokens());
  SizeType32 const num_lookup = (lookup_len - 1) / tokens_per_block_;
  TokenIdType const* tokens = request.tokens().data();
  BlockIdType parent = kRoot;
  std::uint64_t parent_hash = kRootHash;
  for (SizeType32 i = 0; i < num_lookup; ++i) {
    TokenIdType const* block_tokens = block_start(tokens, i, tokens_per_block_);
    std::uint64_t const hash = chain_hash(parent_hash, block_tokens, tokens_per_block_);
    BlockIdType const found = find_child(parent, hash, block_tokens);
    if (found == kNoBlock) {
      return hash;
    }
    parent = found;
    parent_hash = hash;
  }
  return std::nullopt;
}

}  // namespace inflight::batch_manager
