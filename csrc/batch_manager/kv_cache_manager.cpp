// KVCacheManager: block accounting, the free queue and the prefix-reuse tree (TRT-LLM semantics,
// see docs/batch-manager.md).
//
// Data layout, chosen so that the per-step paths (add_token, copy_block_tables, the scheduling
// helpers) are O(1) per block and allocation-free:
//   * blocks_[id] holds the block's refcount, retention priority, its free-list links and its node
//     in the reuse tree (parent, chained hash, children).
//   * free_lists_[p] is an intrusive FIFO of the free blocks of retention priority p; the bitmask
//     non_empty_lists_ finds the lowest non-empty priority without scanning 101 lists.
//   * the reuse tree is stored as parent links plus one hash index (chained hash -> keyed blocks)
//     for all levels. A node is identified by (parent block, tokens); the chained hash already
//     covers the whole prefix, so one index serves every level and the parent/tokens comparison on
//     lookup only guards against 64-bit collisions.
//
// Chained hash (what find_new_context_block returns; reproducible from the tokens alone, e.g. by
// the Python twin). With fin = splitmix64's finalizer, G = 0x9E3779B97F4A7C15, rotl = rotate left:
//   h_root = 0
//   lane[j] = G * (j + 1) for j in 0..3
//   for token i of the block: lane[i % 4] = rotl((lane[i % 4] ^ uint32(token_i)) * G, 31)
//   h_block = h_parent; for j in 0..3: h_block = fin(h_block + G + lane[j])
// Four independent lanes let the multiplies of consecutive tokens overlap instead of forming one
// serial chain per block; the finalizer chain then gives every bit of the key full avalanche over
// the parent key and the lanes. Equal prefixes (not equal block ids)
// give equal keys across requests. A collision could only make two prefills look like duplicates
// to the scheduler: lookups in the tree verify the tokens.
#include "inflight/batch_manager/kv_cache_manager.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace inflight::batch_manager {

namespace {

constexpr BlockIdType kNoBlock = -1;
// Parent id of the first block of a prefix: the root of the reuse tree is not a block.
constexpr BlockIdType kRoot = -1;
constexpr std::uint64_t kRootHash = 0;
constexpr std::uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ULL;
constexpr std::size_t kNumPriorities = static_cast<std::size_t>(kMaxRetentionPriority) + 1;

constexpr std::uint64_t splitmix64_finalizer(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

std::uint64_t chain_hash(std::uint64_t parent_hash, TokenIdType const* tokens, SizeType32 count) {
  std::uint64_t lane[4] = {kGoldenGamma, 2 * kGoldenGamma, 3 * kGoldenGamma, 4 * kGoldenGamma};
  auto const mix = [](std::uint64_t state, TokenIdType token) {
    return std::rotl((state ^ static_cast<std::uint32_t>(token)) * kGoldenGamma, 31);
  };
  SizeType32 i = 0;
  for (; i + 4 <= count; i += 4) {
    lane[0] = mix(lane[0], tokens[i]);
    lane[1] = mix(lane[1], tokens[i + 1]);
    lane[2] = mix(lane[2], tokens[i + 2]);
    lane[3] = mix(lane[3], tokens[i + 3]);
  }
  for (; i < count; ++i) {
    lane[i % 4] = mix(lane[i % 4], tokens[i]);
  }
  std::uint64_t h = parent_hash;
  for (std::uint64_t const l : lane) {
    h = splitmix64_finalizer(h + kGoldenGamma + l);
  }
  return h;
}

SizeType32 ceil_div(SizeType32 a, SizeType32 b) { return (a + b - 1) / b; }

// First token of block `index` in a token array laid out block after block.
template <typename T>
T* block_start(T* tokens, SizeType32 index, SizeType32 tokens_per_block) {
  return tokens + static_cast<std::size_t>(index) * static_cast<std::size_t>(tokens_per_block);
}

template <typename... Parts>
std::string concat(Parts const&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  return message.str();
}

[[noreturn]] void integrity_error(std::string const& what) {
  throw std::logic_error("KVCacheManager integrity check failed: " + what);
}

}  // namespace

struct KVCacheManager::Block {
  SizeType32 ref_count = 0;
  SizeType32 retention_priority = kDefaultRetentionPriority;
  // Links in free_lists_[retention_priority]; meaningful only while ref_count == 0.
  BlockIdType prev_free = kNoBlock;
  BlockIdType next_free = kNoBlock;
  // Reuse-tree node; meaningful only while has_key.
  bool has_key = false;
  BlockIdType parent = kRoot;
  std::uint64_t hash = 0;
  // Position in the parent's children list, for O(1) unlinking.
  SizeType32 child_index = -1;
  std::vector<BlockIdType> children;
};

struct KVCacheManager::ReuseIndex {
  // Contents of keyed blocks: block b's tokens are tokens[b * tpb, (b + 1) * tpb).
  std::vector<TokenIdType> tokens;
  // Every keyed block under its chained hash (a multimap only because of 64-bit collisions).
  std::unordered_multimap<std::uint64_t, BlockIdType> by_hash;
  std::vector<BlockIdType> root_children;
  // Scratch for the iterative subtree drop (reserved once: no allocation on eviction).
  std::vector<BlockIdType> drop_stack;
};

KVCacheManager::KVCacheManager(SizeType32 num_blocks, SizeType32 tokens_per_block, SizeType32 max_seq_len,
                               bool enable_block_reuse)
    : num_blocks_(num_blocks),
      tokens_per_block_(tokens_per_block),
      max_seq_len_(max_seq_len),
      enable_block_reuse_(enable_block_reuse) {
  if (num_blocks < 1) {
    throw std::invalid_argument(concat("num_blocks must be >= 1, got ", num_blocks));
  }
  if (tokens_per_block < 1) {
    throw std::invalid_argument(concat("tokens_per_block must be >= 1, got ", tokens_per_block));
  }
  if (max_seq_len < 1) {
    throw std::invalid_argument(concat("max_seq_len must be >= 1, got ", max_seq_len));
  }
  blocks_.resize(static_cast<std::size_t>(num_blocks));
  free_lists_.resize(kNumPriorities);
  reuse_ = std::make_unique<ReuseIndex>();
  if (enable_block_reuse_) {
    reuse_->tokens.resize(static_cast<std::size_t>(num_blocks) * static_cast<std::size_t>(tokens_per_block));
    reuse_->drop_stack.reserve(static_cast<std::size_t>(num_blocks));
    // At most one key per block: no rehash (and no allocation of buckets) while storing.
    reuse_->by_hash.reserve(static_cast<std::size_t>(num_blocks));
  }
  for (BlockIdType id = 0; id < num_blocks; ++id) {
    push_free_back(id);
  }
  scheduling_num_free_blocks_ = num_free_;
}

KVCacheManager::~KVCacheManager() = default;

SizeType32 KVCacheManager::num_free_blocks() const { return num_free_; }

// ---------------------------------------------------------------------------------------------
// Free queue.

void KVCacheManager::push_free_back(BlockIdType block_id) {
  Block& block = blocks_[static_cast<std::size_t>(block_id)];
  auto const priority = static_cast<std::size_t>(block.retention_priority);
  FreeList& list = free_lists_[priority];
  block.prev_free = list.back;
  block.next_free = kNoBlock;
  if (list.back == kNoBlock) {
    list.front = block_id;
  } else {
    blocks_[static_cast<std::size_t>(list.back)].next_free = block_id;
  }
  list.back = block_id;
  ++list.size;
  non_empty_lists_[priority / 64] |= std::uint64_t{1} << (priority % 64);
  ++num_free_;
  num_free_keyed_ += block.has_key ? 1 : 0;
}

void KVCacheManager::take_free_block(BlockIdType block_id) {
  Block& block = blocks_[static_cast<std::size_t>(block_id)];
  auto const priority = static_cast<std::size_t>(block.retention_priority);
  FreeList& list = free_lists_[priority];
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
    non_empty_lists_[priority / 64] &= ~(std::uint64_t{1} << (priority % 64));
  }
  --num_free_;
  num_free_keyed_ -= block.has_key ? 1 : 0;
}

BlockIdType KVCacheManager::allocate_block(SizeType32 retention_priority) {
  // Callers check num_free_ first, so some list is non-empty.
  std::size_t const priority = non_empty_lists_[0] != 0
                                   ? static_cast<std::size_t>(std::countr_zero(non_empty_lists_[0]))
                                   : 64 + static_cast<std::size_t>(std::countr_zero(non_empty_lists_[1]));
  BlockIdType const block_id = free_lists_[priority].front;
  take_free_block(block_id);
  Block& block = blocks_[static_cast<std::size_t>(block_id)];
  block.ref_count = 1;  // taken (before drop_key, which counts the free blocks losing their key)
  // The memory is about to be overwritten: its cached prefix (and everything chained below it,
  // now unreachable) must no longer be found.
  if (block.has_key) {
    drop_key(block_id);
  }
  block.retention_priority = retention_priority;
  return block_id;
}

void KVCacheManager::release_block(BlockIdType block_id) {
  Block& block = blocks_[static_cast<std::size_t>(block_id)];
  if (--block.ref_count == 0) {
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
    num_free_keyed_ -= block.ref_count == 0 ? 1 : 0;
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

void KVCacheManager::add_sequence(RequestIdType request_id, SizeType32 input_length, SizeType32 beam_width,
                                  LlmRequest* request) {
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
  // Reserved once so that add_token never reallocates; a sequence can outgrow neither bound.
  seq.block_ids.reserve(static_cast<std::size_t>(std::min(max_blocks_per_seq(), num_blocks_)));

  // Prefix lookup. The last prompt token is never reused (its logits must be computed), hence
  // (len - 1) / tpb. The prompt is capped at what the request really holds, so that the lookup
  // never reads past its tokens and k * tpb < prompt_len as set_prepopulated_prompt_len requires.
  SizeType32 num_free_hits = 0;
  if (enable_block_reuse_ && request != nullptr) {
    SizeType32 const lookup_len = std::min({input_length, request->prompt_len(), request->num_tokens()});
    SizeType32 const num_lookup = (lookup_len - 1) / tokens_per_block_;
    TokenIdType const* tokens = request->tokens().data();
    BlockIdType parent = kRoot;
    std::uint64_t parent_hash = kRootHash;
    for (SizeType32 i = 0; i < num_lookup; ++i) {
      TokenIdType const* block_tokens = block_start(tokens, i, tokens_per_block_);
      std::uint64_t const hash = chain_hash(parent_hash, block_tokens, tokens_per_block_);
      BlockIdType const found = find_child(parent, hash, block_tokens);
      if (found == kNoBlock) {
        break;
      }
      seq.block_ids.push_back(found);
      num_free_hits += blocks_[static_cast<std::size_t>(found)].ref_count == 0 ? 1 : 0;
      parent = found;
      parent_hash = hash;
    }
  }
  auto const num_hits = static_cast<SizeType32>(seq.block_ids.size());
  SizeType32 const num_new = num_blocks - num_hits;
  SizeType32 const needed = num_new + num_free_hits;
  if (needed > num_free_) {
    throw std::runtime_error(concat("add_sequence: not enough free KV blocks for request_id ", request_id, ": need ",
                                    needed, ", free ", num_free_));
  }

  // Commit; nothing below can fail. Hits are claimed before allocating so that an allocation can
  // never evict a block this sequence is about to use.
  for (BlockIdType const id : seq.block_ids) {
    Block& block = blocks_[static_cast<std::size_t>(id)];
    if (block.ref_count == 0) {
      take_free_block(id);
    }
    ++block.ref_count;
  }
  for (SizeType32 i = 0; i < num_new; ++i) {
    seq.block_ids.push_back(allocate_block(retention_priority));
  }
  sequences_.emplace(request_id, std::move(seq));

  reused_blocks_ += num_hits;
  missed_blocks_ += num_new;
  alloc_total_blocks_ += num_blocks;
  alloc_new_blocks_ += num_new;
  if (num_hits > 0) {
    request->set_prepopulated_prompt_len(num_hits * tokens_per_block_);
  }
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
  Sequence const& src = sequence(src_id, "fork_sequence");
  if (sequences_.count(dst_id) != 0) {
    throw std::invalid_argument(concat("fork_sequence: request_id ", dst_id, " is already in the KV cache manager"));
  }
  Sequence dst;
  dst.num_tokens = src.num_tokens;
  dst.retention_priority = src.retention_priority;
  dst.block_ids.reserve(static_cast<std::size_t>(std::min(max_blocks_per_seq(), num_blocks_)));
  dst.block_ids = src.block_ids;
  for (BlockIdType b : dst.block_ids) ++blocks_[static_cast<std::size_t>(b)].ref_count;
  sequences_.emplace(dst_id, std::move(dst));
}

std::vector<std::pair<BlockIdType, BlockIdType>> KVCacheManager::take_block_copies() {
  std::vector<std::pair<BlockIdType, BlockIdType>> out;
  out.swap(block_copies_);
  return out;
}

void KVCacheManager::add_token(RequestIdType request_id) {
  Sequence& seq = sequence(request_id, "add_token");
  if (seq.num_tokens >= max_seq_len_) {
    throw std::invalid_argument(concat("add_token: request_id ", request_id, " already holds ", seq.num_tokens,
                                       " tokens, max_seq_len is ", max_seq_len_));
  }
  if (cow_blocks(seq) != 0) {  // the token lands in a last block another sequence holds
    if (num_free_ == 0) {
      throw std::runtime_error(
          concat("add_token: not enough free KV blocks for request_id ", request_id, ": need 1, free 0"));
    }
    copy_on_write(seq);
  }
  // The new token (number num_tokens + 1) starts a block when num_tokens is a multiple of tpb.
  if (seq.num_tokens % tokens_per_block_ == 0) {
    if (num_free_ == 0) {
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
  Sequence& seq = sequence(request_id, "add_tokens");
  if (n < 0) throw std::invalid_argument(concat("add_tokens: n must be >= 0, got ", n));
  if (n > max_seq_len_ - seq.num_tokens) {
    throw std::invalid_argument(concat("add_tokens: request_id ", request_id, " holds ", seq.num_tokens, " tokens; ", n,
                                       " more exceed max_seq_len ", max_seq_len_));
  }
  SizeType32 const blocks_after = ceil_div(seq.num_tokens + n, tokens_per_block_);
  SizeType32 const needed = blocks_after - static_cast<SizeType32>(seq.block_ids.size());
  SizeType32 const cow = n > 0 ? cow_blocks(seq) : 0;
  if (needed + cow > num_free_) {
    throw std::runtime_error(concat("add_tokens: not enough free KV blocks for request_id ", request_id, ": need ",
                                    needed + cow, ", free ", num_free_));
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
  Sequence& seq = sequence(request_id, "rewind");
  if (n < 0 || n >= seq.num_tokens) {
    throw std::invalid_argument(concat("rewind: n must be in [0, ", seq.num_tokens - 1, "] (request_id ", request_id,
                                       " keeps at least one of its ", seq.num_tokens, " tokens), got ", n));
  }
  seq.num_tokens -= n;
  auto const keep = static_cast<std::size_t>(ceil_div(seq.num_tokens, tokens_per_block_));
  while (seq.block_ids.size() > keep) {
    release_block(seq.block_ids.back());
    seq.block_ids.pop_back();
  }
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
  for (auto block = seq.block_ids.rbegin(); block != seq.block_ids.rend(); ++block) {
    release_block(*block);
  }
  sequences_.erase(it);
}

void KVCacheManager::store_context_blocks(LlmRequest const& request) {
  if (!enable_block_reuse_) {
    return;
  }
  Sequence const& seq = sequence(request.request_id(), "store_context_blocks");
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
    std::vector<BlockIdType> const& ids = sequence(request_ids[row], "copy_block_tables").block_ids;
    if (ids.size() > stride) {
      throw std::invalid_argument(concat("copy_block_tables: request_id ", request_ids[row], " holds ", ids.size(),
                                         " blocks, more than row_stride ", row_stride));
    }
    BlockIdType* dst = out + row * stride;
    std::memcpy(dst, ids.data(), ids.size() * sizeof(BlockIdType));
    std::memset(dst + ids.size(), 0, (stride - ids.size()) * sizeof(BlockIdType));
  }
}

KvCacheStats KVCacheManager::get_kv_cache_stats() const {
  KvCacheStats stats;
  stats.max_num_blocks = num_blocks_;
  stats.free_num_blocks = num_free_;
  stats.used_num_blocks = num_blocks_ - num_free_;
  stats.tokens_per_block = tokens_per_block_;
  stats.alloc_total_blocks = alloc_total_blocks_;
  stats.alloc_new_blocks = alloc_new_blocks_;
  stats.reused_blocks = reused_blocks_;
  stats.reusable_num_blocks = num_free_keyed_;
  stats.missed_blocks = missed_blocks_;
  std::int64_t const lookups = reused_blocks_ + missed_blocks_;
  stats.cache_hit_rate = lookups == 0 ? 0.0 : static_cast<double>(reused_blocks_) / static_cast<double>(lookups);
  return stats;
}

// ---------------------------------------------------------------------------------------------
// Scheduling simulation.

void KVCacheManager::start_scheduling() { scheduling_num_free_blocks_ = num_free_; }

void KVCacheManager::scheduling_remove_sequence(RequestIdType request_id) {
  auto it = sequences_.find(request_id);
  if (it == sequences_.end()) {
    return;
  }
  // A block shared with another sequence (prefix reuse) would stay in use after this one goes.
  for (BlockIdType const id : it->second.block_ids) {
    if (blocks_[static_cast<std::size_t>(id)].ref_count == 1) {
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
    return (ceil_div(t + k, tokens_per_block_) - ceil_div(t, tokens_per_block_)) * request.beam_width();
  }
  return 0;
}

SizeType32 KVCacheManager::get_remaining_blocks_to_completion(LlmRequest const& request) const {
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

// ---------------------------------------------------------------------------------------------
// Integrity.

void KVCacheManager::check_integrity() const {
  auto const n = static_cast<std::size_t>(num_blocks_);
  if (blocks_.size() != n) {
    integrity_error(concat("blocks_.size() ", blocks_.size(), " != num_blocks ", num_blocks_));
  }

  // Free lists: well-linked, each block at most once, priorities match, bitmask matches.
  std::vector<char> in_free_list(n, 0);
  SizeType32 listed = 0;
  for (std::size_t p = 0; p < free_lists_.size(); ++p) {
    FreeList const& list = free_lists_[p];
    SizeType32 count = 0;
    BlockIdType prev = kNoBlock;
    for (BlockIdType id = list.front; id != kNoBlock; id = blocks_[static_cast<std::size_t>(id)].next_free) {
      if (id < 0 || id >= num_blocks_) {
        integrity_error(concat("free list ", p, " holds invalid block id ", id));
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
    bool const bit = ((non_empty_lists_[p / 64] >> (p % 64)) & 1U) != 0;
    if (bit != (count != 0)) {
      integrity_error(concat("non-empty bit of free list ", p, " is ", bit, " with ", count, " blocks"));
    }
    listed += count;
  }
  if (listed != num_free_) {
    integrity_error(concat("free lists hold ", listed, " blocks but num_free is ", num_free_));
  }

  // Sequences: block counts, no block twice in one sequence, refcounts == holders.
  std::vector<SizeType32> holders(n, 0);
  std::vector<RequestIdType> last_holder(n, 0);
  std::vector<char> held_by_any(n, 0);
  for (auto const& [request_id, seq] : sequences_) {
    if (seq.num_tokens < 1 || seq.num_tokens > max_seq_len_) {
      integrity_error(
          concat("request_id ", request_id, " holds ", seq.num_tokens, " tokens, outside [1, ", max_seq_len_, "]"));
    }
    auto const expected = static_cast<std::size_t>(ceil_div(seq.num_tokens, tokens_per_block_));
    if (seq.block_ids.size() != expected) {
      integrity_error(concat("request_id ", request_id, " holds ", seq.block_ids.size(), " blocks for ", seq.num_tokens,
                             " tokens, expected ", expected));
    }
    for (BlockIdType const id : seq.block_ids) {
      if (id < 0 || id >= num_blocks_) {
        integrity_error(concat("request_id ", request_id, " holds invalid block id ", id));
      }
      auto const i = static_cast<std::size_t>(id);
      if (held_by_any[i] != 0 && last_holder[i] == request_id) {
        integrity_error(concat("request_id ", request_id, " holds block ", id, " twice"));
      }
      held_by_any[i] = 1;
      last_holder[i] = request_id;
      ++holders[i];
    }
  }
  SizeType32 used = 0;
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
    used += block.ref_count > 0 ? 1 : 0;
  }
  if (used + num_free_ != num_blocks_) {
    integrity_error(concat("free ", num_free_, " + used ", used, " != total ", num_blocks_));
  }

  SizeType32 free_keyed = 0;
  for (std::size_t i = 0; i < n; ++i) {
    free_keyed += blocks_[i].ref_count == 0 && blocks_[i].has_key ? 1 : 0;
  }
  if (free_keyed != num_free_keyed_) {
    integrity_error(concat(free_keyed, " free blocks hold a key but num_free_keyed is ", num_free_keyed_));
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
      if (block.parent < 0 || block.parent >= num_blocks_ || !blocks_[static_cast<std::size_t>(block.parent)].has_key) {
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
      if (child < 0 || child >= num_blocks_ || !blocks_[static_cast<std::size_t>(child)].has_key ||
          blocks_[static_cast<std::size_t>(child)].parent != id) {
        integrity_error(concat("block ", i, " lists child ", child, " whose parent is not block ", i));
      }
    }
  }
  for (BlockIdType const child : reuse_->root_children) {
    if (child < 0 || child >= num_blocks_ || !blocks_[static_cast<std::size_t>(child)].has_key ||
        blocks_[static_cast<std::size_t>(child)].parent != kRoot) {
      integrity_error(concat("root lists child ", child, " which is not a first block"));
    }
  }
  if (reuse_->by_hash.size() != num_keyed) {
    integrity_error(concat("hash index holds ", reuse_->by_hash.size(), " entries for ", num_keyed, " keyed blocks"));
  }
  for (auto const& [hash, id] : reuse_->by_hash) {
    if (id < 0 || id >= num_blocks_ || !blocks_[static_cast<std::size_t>(id)].has_key ||
        blocks_[static_cast<std::size_t>(id)].hash != hash) {
      integrity_error(concat("hash index maps ", hash, " to block ", id, " which does not hold that key"));
    }
  }
}

}  // namespace inflight::batch_manager
