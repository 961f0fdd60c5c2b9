// KVCacheManager internals shared by its implementation files (kv_cache_manager.cpp: free queue,
// reuse tree, sequences, planning; kv_cache_manager_secondary.cpp: the secondary level and swap;
// kv_cache_manager_integrity.cpp: check_integrity). Not part of the public headers.
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
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "inflight/batch_manager/kv_cache_manager.h"

namespace inflight::batch_manager {

namespace kv_detail {

inline constexpr BlockIdType kNoBlock = -1;
// Parent id of the first block of a prefix: the root of the reuse tree is not a block.
inline constexpr BlockIdType kRoot = -1;
inline constexpr std::uint64_t kRootHash = 0;
inline constexpr std::uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ULL;
inline constexpr std::size_t kNumPriorities = static_cast<std::size_t>(kMaxRetentionPriority) + 1;

constexpr std::uint64_t splitmix64_finalizer(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

inline std::uint64_t chain_hash(std::uint64_t parent_hash, TokenIdType const* tokens, SizeType32 count) {
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

inline SizeType32 ceil_div(SizeType32 a, SizeType32 b) { return (a + b - 1) / b; }

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

[[noreturn]] inline void integrity_error(std::string const& what) {
  throw std::logic_error("KVCacheManager integrity check failed: " + what);
}

}  // namespace kv_detail

struct KVCacheManager::Block {
  SizeType32 ref_count = 0;
  SizeType32 retention_priority = kDefaultRetentionPriority;
  // Links in the free list of (level, retention_priority); meaningful only while ref_count == 0.
  BlockIdType prev_free = kv_detail::kNoBlock;
  BlockIdType next_free = kv_detail::kNoBlock;
  // Reuse-tree node; meaningful only while has_key.
  bool has_key = false;
  BlockIdType parent = kv_detail::kRoot;
  std::uint64_t hash = 0;
  // Position in the parent's children list, for O(1) unlinking.
  SizeType32 child_index = -1;
  std::vector<BlockIdType> children;
};

struct KVCacheManager::ReuseIndex {
  // Contents of keyed blocks (both levels): block b's tokens are tokens[b * tpb, (b + 1) * tpb).
  std::vector<TokenIdType> tokens;
  // Every keyed block under its chained hash (a multimap only because of 64-bit collisions).
  std::unordered_multimap<std::uint64_t, BlockIdType> by_hash;
  std::vector<BlockIdType> root_children;
  // Scratch for the iterative subtree drop (reserved once: no allocation on eviction).
  std::vector<BlockIdType> drop_stack;
};

}  // namespace inflight::batch_manager
