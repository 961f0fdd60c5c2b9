// KVCacheManager: accounting of a paged KV pool (block ids only; the memory is a torch tensor
// owned by Python). Semantics: docs/batch-manager.md (TRT-LLM's).
//
// Invariants (check_integrity() verifies them):
//   * every block is either free (ref_count == 0, in exactly one free list) or in use
//     (ref_count == number of sequences holding it, in no free list); free + used == max_num_blocks.
//   * a sequence holds ceil(num_tokens / tokens_per_block) blocks, in token order, none twice.
//   * free lists: one FIFO per retention priority; together they are the free queue in release
//     order. Allocation takes the front of the lowest-priority non-empty list.
//   * reuse tree: a cached block is keyed by (parent key, its tpb tokens); the key is
//     content-addressed through a chained 64-bit hash, verified token by token on lookup. A block
//     holds at most one key; a key belongs to at most one block. A block keeps its key while free
//     and loses it (with all keys chained below it) when its memory is taken for new contents.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "inflight/batch_manager/llm_request.h"

namespace inflight::batch_manager {

struct KvCacheStats {
  SizeType32 max_num_blocks = 0;
  SizeType32 free_num_blocks = 0;
  SizeType32 used_num_blocks = 0;
  SizeType32 tokens_per_block = 0;
  std::int64_t alloc_total_blocks = 0;  // blocks handed to sequences (new + reused)
  std::int64_t alloc_new_blocks = 0;    // blocks taken from the free queue for new contents
  std::int64_t reused_blocks = 0;       // prompt blocks served from the reuse tree
  std::int64_t missed_blocks = 0;       // prompt blocks not found in the reuse tree
  double cache_hit_rate = 0.0;          // reused / (reused + missed); 0 when both are 0
  SizeType32 reusable_num_blocks = 0;   // free blocks still holding a cached prefix (counted in free)
};

class KVCacheManager {
 public:
  // Throws std::invalid_argument naming the argument for num_blocks < 1, tokens_per_block < 1,
  // max_seq_len < 1.
  KVCacheManager(SizeType32 num_blocks, SizeType32 tokens_per_block, SizeType32 max_seq_len,
                 bool enable_block_reuse = false);
  ~KVCacheManager();
  KVCacheManager(KVCacheManager const&) = delete;
  KVCacheManager& operator=(KVCacheManager const&) = delete;

  SizeType32 max_num_blocks() const { return num_blocks_; }
  SizeType32 tokens_per_block() const { return tokens_per_block_; }
  SizeType32 max_seq_len() const { return max_seq_len_; }
  SizeType32 max_blocks_per_seq() const { return (max_seq_len_ + tokens_per_block_ - 1) / tokens_per_block_; }
  bool enable_block_reuse() const { return enable_block_reuse_; }
  SizeType32 num_free_blocks() const;
  SizeType32 num_used_blocks() const { return num_blocks_ - num_free_blocks(); }
  bool has_sequence(RequestIdType request_id) const { return sequences_.count(request_id) != 0; }
  SizeType32 num_sequences() const { return static_cast<SizeType32>(sequences_.size()); }

  // Allocates ceil(input_length / tpb) blocks for the whole prompt. With reuse and a request, the
  // first (prompt_len - 1) / tpb full blocks are looked up in the reuse tree first; a hit of k
  // blocks calls request->set_prepopulated_prompt_len(k * tpb). Throws (state unchanged) when the
  // id is already present, input_length is not in [1, max_seq_len], beam_width != 1, or there are
  // not enough free blocks (message names needed and free).
  void add_sequence(RequestIdType request_id, SizeType32 input_length, SizeType32 beam_width,
                    LlmRequest* request = nullptr);
  // One more token; a new block when it starts one. Throws for an unknown id, past max_seq_len,
  // or with no free block.
  void add_token(RequestIdType request_id);
  // n more tokens at once (a speculative step's 1 + k), all or nothing: the blocks they start are
  // allocated in order. Throws std::invalid_argument for an unknown id, n < 0 or past max_seq_len, and
  // std::runtime_error (state unchanged; message names needed and free) without enough free blocks.
  void add_tokens(RequestIdType request_id, SizeType32 n);
  // Pops the last n tokens (rejected drafts): every block left empty is released, last block first.
  // Rewound tokens are never stored for reuse (remove_sequence publishes only the tokens held). Throws
  // std::invalid_argument for an unknown id or n outside [0, num_tokens - 1] (a sequence keeps a token).
  void rewind(RequestIdType request_id, SizeType32 n);
  // Beam search: dst_id (new) holds the very blocks of src_id, each one's ref_count + 1, and its token
  // count and retention priority. Nothing is copied now: a later write into a shared, partly filled last
  // block copies it first (copy-on-write, see take_block_copies). Throws std::invalid_argument for an
  // unknown src_id or a dst_id already present.
  void fork_sequence(RequestIdType src_id, RequestIdType dst_id);
  // The block copies the engine must execute before the next forward, in order, and forgets them:
  // (src_block, dst_block) for each copy-on-write since the last call. add_token / add_tokens make one
  // when the token they add lands in a last block another sequence also holds (the sequence then holds
  // a fresh block, the other keeps the original); it counts as one more block needed.
  std::vector<std::pair<BlockIdType, BlockIdType>> take_block_copies();
  // Frees the blocks, last block first. With reuse and a request, first stores the full blocks of
  // the tokens the sequence holds (capped, for a request still in context, at the tokens already
  // computed: context_current_position). Throws for an unknown id.
  void remove_sequence(RequestIdType request_id, LlmRequest* request = nullptr);
  // Publishes the full prompt blocks of a request whose context finished (no-op without reuse).
  void store_context_blocks(LlmRequest const& request);

  std::vector<BlockIdType> const& get_block_ids(RequestIdType request_id) const;
  SizeType32 get_num_tokens(RequestIdType request_id) const;
  // Writes the block ids of each sequence into row i of out[num_rows][row_stride]; unused entries
  // of those rows are set to 0. Throws if a sequence has more blocks than row_stride or
  // request_ids.size() > num_rows.
  void copy_block_tables(std::vector<RequestIdType> const& request_ids, BlockIdType* out, std::int64_t num_rows,
                         std::int64_t row_stride) const;

  KvCacheStats get_kv_cache_stats() const;

  // Scheduling simulation (no real state changes).
  void start_scheduling();
  SizeType32 scheduling_num_free_blocks() const { return scheduling_num_free_blocks_; }
  // Adds back to the simulated free count the blocks of that sequence no other sequence holds.
  void scheduling_remove_sequence(RequestIdType request_id);
  SizeType32 get_needed_blocks_one_step(LlmRequest const& request, bool two_steps_lookahead) const;
  SizeType32 get_remaining_blocks_to_completion(LlmRequest const& request) const;
  // Chained key (64-bit) of the first of the request's first (prompt_len - 1) / tpb full prompt
  // blocks that is not in the reuse tree; nullopt when all are cached, there are none, or reuse
  // is off. Used by the capacity scheduler to delay duplicate prefills.
  std::optional<std::uint64_t> find_new_context_block(LlmRequest const& request) const;

  // Throws std::logic_error describing the first violated invariant.
  void check_integrity() const;

 private:
  struct Block;
  struct Sequence {
    std::vector<BlockIdType> block_ids;
    SizeType32 num_tokens = 0;
    // Blocks allocated later by add_token get the priority of the request that added the sequence.
    SizeType32 retention_priority = kDefaultRetentionPriority;
  };
  // An intrusive FIFO threaded through Block::prev_free / next_free, so that releasing and taking a
  // block is O(1) and allocation-free (a std::list would allocate a node on every release).
  struct FreeList {
    BlockIdType front = -1;
    BlockIdType back = -1;
    SizeType32 size = 0;
  };
  // Reuse tree storage (block contents, hash index): see kv_cache_manager.cpp.
  struct ReuseIndex;

  // Free-queue and reuse-tree internals: see kv_cache_manager.cpp.
  BlockIdType allocate_block(SizeType32 retention_priority);
  void release_block(BlockIdType block_id);
  void push_free_back(BlockIdType block_id);
  void take_free_block(BlockIdType block_id);
  void drop_key(BlockIdType block_id);
  BlockIdType find_child(BlockIdType parent, std::uint64_t hash, TokenIdType const* tokens) const;
  void set_key(BlockIdType block_id, BlockIdType parent, std::uint64_t hash, TokenIdType const* tokens);
  void store_blocks(std::vector<TokenIdType> const& tokens, SizeType32 num_tokens,
                    std::vector<BlockIdType> const& block_ids, SizeType32 retention_priority);
  // 1 when the next token of seq lands in a last block another sequence also holds (copy-on-write).
  SizeType32 cow_blocks(Sequence const& seq) const;
  // Gives seq a private copy of its shared last block (call after checking a block is free).
  void copy_on_write(Sequence& seq);
  Sequence& sequence(RequestIdType request_id, char const* caller);
  Sequence const& sequence(RequestIdType request_id, char const* caller) const;

  SizeType32 num_blocks_;
  SizeType32 tokens_per_block_;
  SizeType32 max_seq_len_;
  bool enable_block_reuse_;
  // Indexed by block id; Block is complete in the .cpp (a vector of an incomplete type is allowed
  // since C++17 as long as its members are only used there).
  std::vector<Block> blocks_;
  // free_lists_[p]: free blocks of retention priority p, in release order.
  std::vector<FreeList> free_lists_;
  // Bit p set <=> free_lists_[p] is non-empty; finds the lowest non-empty priority in O(1).
  std::uint64_t non_empty_lists_[2] = {0, 0};
  SizeType32 num_free_ = 0;
  SizeType32 num_free_keyed_ = 0;  // free blocks with a key in the reuse tree (reusable)
  std::unordered_map<RequestIdType, Sequence> sequences_;
  SizeType32 scheduling_num_free_blocks_ = 0;
  std::int64_t alloc_total_blocks_ = 0;
  std::int64_t alloc_new_blocks_ = 0;
  std::int64_t reused_blocks_ = 0;
  std::int64_t missed_blocks_ = 0;
  std::unique_ptr<ReuseIndex> reuse_;
  std::vector<std::pair<BlockIdType, BlockIdType>> block_copies_;  // pending copy-on-writes
};

}  // namespace inflight::batch_manager
