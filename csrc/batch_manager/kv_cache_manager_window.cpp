// KVCacheManager's sliding window (docs/batch-manager.md §3.11): the layers of one attention window
// W only read the last W tokens before each query, so a block whose tokens all precede the window
// of the sequence's next query is released while the sequence keeps running. Its block_ids entry
// stays, as -1, so that entry i keeps covering tokens [i * tpb, (i + 1) * tpb).
#include <algorithm>
#include <cstddef>
#include <stdexcept>

#include "inflight/batch_manager/kv_cache_manager.h"
#include "kv_cache_manager_internal.h"

namespace inflight::batch_manager {

using namespace kv_detail;

std::size_t KVCacheManager::max_block_entries() const {
  // Without a window a sequence holds every one of its entries, so it cannot outgrow the pool.
  SizeType32 const bound = attention_window_ > 0 ? max_blocks_per_seq() : std::min(max_blocks_per_seq(), num_blocks_);
  return static_cast<std::size_t>(bound);
}

void KVCacheManager::slide_window(RequestIdType request_id, SizeType32 first_query_pos, LlmRequest const* request) {
  Sequence& seq = active_sequence(request_id, "slide_window");
  if (first_query_pos < 0 || first_query_pos > seq.num_tokens) {
    throw std::invalid_argument(concat("slide_window: first_query_pos must be in [0, ", seq.num_tokens,
                                       "] (the tokens of request_id ", request_id, "), got ", first_query_pos));
  }
  if (request != nullptr && request->request_id() != request_id) {
    throw std::invalid_argument(concat("slide_window: request->request_id() ", request->request_id(),
                                       " does not match request_id ", request_id));
  }
  slide(seq, first_query_pos, request);
}

SizeType32 KVCacheManager::get_num_held_blocks(RequestIdType request_id) const {
  Sequence const& seq = sequence(request_id, "get_num_held_blocks");
  return static_cast<SizeType32>(seq.block_ids.size()) - seq.num_released;
}

void KVCacheManager::slide(Sequence& seq, SizeType32 first_query_pos, LlmRequest const* request) {
  if (attention_window_ == 0) {
    return;
  }
  // The query at first_query_pos sees tokens [first_query_pos - W + 1, first_query_pos]; later
  // queries see no further back.
  SizeType32 const num_dead = std::max(first_query_pos - attention_window_ + 1, 0) / tokens_per_block_;
  if (num_dead <= seq.num_released) {
    return;
  }
  if (enable_block_reuse_ && request != nullptr) {
    // Stored before the release, so that a later prompt with this prefix hits these blocks.
    store_blocks(request->tokens(), std::min(num_dead * tokens_per_block_, request->num_tokens()), seq.block_ids,
                 request->kv_retention_priority());
  }
  // In token order, the oldest first: the free queue hands them out again in that order.
  for (SizeType32 i = seq.num_released; i < num_dead; ++i) {
    release_block(seq.block_ids[static_cast<std::size_t>(i)]);
    seq.block_ids[static_cast<std::size_t>(i)] = kNoBlock;
  }
  seq.num_released = num_dead;
}

}  // namespace inflight::batch_manager
