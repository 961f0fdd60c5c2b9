// KVCacheManager: accounting of a paged KV pool in two levels (block ids only; the memory is owned
// by Python). Semantics: docs/batch-manager.md (TRT-LLM's).
//
// Block ids: primary blocks are 0 .. num_blocks - 1 (the pool the kernels read, laid out by id),
// secondary blocks num_blocks .. num_blocks + num_secondary_blocks - 1 (host or disk memory; the
// engine maps id - num_blocks to its slot there). A block's level is fixed by its id.
//
// Invariants (check_integrity() verifies them):
//   * every block is either free (ref_count == 0, in exactly one free list of its level) or in use
//     (ref_count == number of sequences holding it, in no free list); per level free + used == size.
//   * a sequence holds ceil(num_tokens / tokens_per_block) blocks, in token order, none twice. An
//     active sequence holds primary blocks only; a suspended one also holds secondary blocks (its
//     private blocks, moved there by suspend_sequence), each held by that one sequence only.
//   * free lists: one FIFO per (level, retention priority); together a level's lists are its free
//     queue in release order. Allocation takes the front of the lowest-priority non-empty list.
//   * reuse tree (both levels): a cached block is keyed by (parent key, its tpb tokens); the key is
//     content-addressed through a chained 64-bit hash, verified token by token on lookup. A block
//     holds at most one key; a key belongs to at most one block. A block keeps its key while free;
//     when a primary block's memory is taken for new contents its key moves to a secondary block
//     (offload) or is dropped with all keys chained below it; a secondary block's key moves back to
//     a primary block on a prefix hit (onboard) or is dropped when the secondary block is reused.
//   * the manager copies nothing: every move of KV between levels is queued as a KvBlockTransfer,
//     in the order the engine must execute them (take_transfers).
//   * sliding window (attention_window W > 0, the layers of one window; docs/batch-manager.md
//     §3.11): a sequence keeps one block_ids entry per block, so entry i always covers tokens
//     [i * tpb, (i + 1) * tpb); an entry is -1 once its block is released because no later query
//     can see it. Released entries are a prefix (num_released of them), at most
//     max(0, num_tokens - W + 1) / tpb, and hold no reference. Such a manager has no secondary level.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "inflight/batch_manager/llm_request.h"

namespace inflight::batch_manager {

// A pending move of one block's KV between the levels (see take_transfers).
enum class KvTransferKind : std::int32_t {
  kOFFLOAD = 0,  // primary -> secondary: must run before the primary block is overwritten
  kONBOARD = 1,  // secondary -> primary: must run before the forward that reads the primary block
};

struct KvBlockTransfer {
  KvTransferKind kind = KvTransferKind::kOFFLOAD;
  BlockIdType src_block = 0;
  BlockIdType dst_block = 0;
  bool operator==(KvBlockTransfer const&) const = default;
};

inline constexpr SizeType32 kPrimaryLevel = 0;
inline constexpr SizeType32 kSecondaryLevel = 1;
// TRT-LLM's default: an evicted reusable block is offloaded only if its retention priority is >= this.
inline constexpr SizeType32 kDefaultSecondaryOffloadMinPriority = 30;

// The reusable blocks of the secondary level with their reuse keys, as export_secondary_blocks lists
// them and import_secondary_blocks adopts them (a persistent tier: docs/batch-manager.md §3.10).
// Entry i: secondary block block_ids[i], its parent in the reuse tree parents[i] (the block id of
// another entry, or -1: the block is the first of a prefix), its retention priority priorities[i],
// and its tokens tokens[i * tpb, (i + 1) * tpb). A key is its parent's key plus its tokens: nothing
// else (no LoRA id or salt) enters a reuse key in this manager.
struct KvSecondaryBlocks {
  std::vector<BlockIdType> block_ids;
  std::vector<BlockIdType> parents;
  std::vector<SizeType32> priorities;
  std::vector<TokenIdType> tokens;
  std::size_t size() const { return block_ids.size(); }
  bool operator==(KvSecondaryBlocks const&) const = default;
};

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
  // Secondary level (all 0 without one). Used secondary blocks are those of suspended sequences.
  SizeType32 max_num_secondary_blocks = 0;
  SizeType32 free_num_secondary_blocks = 0;
  SizeType32 used_num_secondary_blocks = 0;
  SizeType32 reusable_num_secondary_blocks = 0;  // free secondary blocks holding a cached prefix
  std::int64_t offloaded_blocks = 0;             // offload transfers queued (evictions and suspends)
  std::int64_t onboarded_blocks = 0;             // onboard transfers queued (prefix hits and resumes)
  std::int64_t secondary_reused_blocks = 0;      // prompt blocks served from the secondary level
  double secondary_hit_rate = 0.0;               // secondary_reused / (reused + missed); 0 when both are 0
};

class KVCacheManager {
 public:
  // Throws std::invalid_argument naming the argument for num_blocks < 1, tokens_per_block < 1,
  // max_seq_len < 1, num_secondary_blocks < 0, secondary_offload_min_priority outside [0, 100],
  // attention_window < 0, or attention_window > 0 with num_secondary_blocks > 0.
  // num_secondary_blocks = 0 is the one-level manager exactly; attention_window = 0 releases nothing
  // (global attention).
  KVCacheManager(SizeType32 num_blocks, SizeType32 tokens_per_block, SizeType32 max_seq_len,
                 bool enable_block_reuse = false, SizeType32 num_secondary_blocks = 0,
                 SizeType32 secondary_offload_min_priority = kDefaultSecondaryOffloadMinPriority,
                 SizeType32 attention_window = 0);
  ~KVCacheManager();
  KVCacheManager(KVCacheManager const&) = delete;
  KVCacheManager& operator=(KVCacheManager const&) = delete;

  SizeType32 max_num_blocks() const { return num_blocks_; }
  SizeType32 tokens_per_block() const { return tokens_per_block_; }
  SizeType32 max_seq_len() const { return max_seq_len_; }
  SizeType32 max_blocks_per_seq() const { return (max_seq_len_ + tokens_per_block_ - 1) / tokens_per_block_; }
  bool enable_block_reuse() const { return enable_block_reuse_; }
  // The window W of the layers this manager serves (0: global layers, nothing released).
  SizeType32 attention_window() const { return attention_window_; }
  // Primary level: the blocks the kernels read, that sequences are allocated from.
  SizeType32 num_free_blocks() const;
  SizeType32 num_used_blocks() const { return num_blocks_ - num_free_blocks(); }
  bool has_sequence(RequestIdType request_id) const { return sequences_.count(request_id) != 0; }
  SizeType32 num_sequences() const { return static_cast<SizeType32>(sequences_.size()); }
  SizeType32 num_secondary_blocks() const { return num_secondary_blocks_; }
  SizeType32 num_free_secondary_blocks() const { return num_free_[kSecondaryLevel]; }
  SizeType32 num_used_secondary_blocks() const { return num_secondary_blocks_ - num_free_[kSecondaryLevel]; }
  SizeType32 secondary_offload_min_priority() const { return secondary_offload_min_priority_; }
  SizeType32 num_suspended_sequences() const { return num_suspended_; }
  // False for an unknown id.
  bool is_suspended(RequestIdType request_id) const;
  // kPrimaryLevel or kSecondaryLevel; std::invalid_argument outside [0, num_blocks + num_secondary_blocks).
  SizeType32 get_block_level(BlockIdType block_id) const;

  // Allocates ceil(input_length / tpb) blocks for the whole prompt (with a window: the first context
  // chunk; later chunks come with add_tokens). With reuse and a request, the first
  // (prompt_len - 1) / tpb full blocks are looked up in the reuse tree first, at most
  // max_reused_blocks of them when it is >= 0 (an engine with several managers reuses what all of
  // them hold: the minimum of their count_reusable_blocks); a hit of k blocks calls
  // request->set_prepopulated_prompt_len(k * tpb). A hit on a secondary block is onboarded: it costs
  // a free primary block, which takes the key over (an onboard transfer). With a window, the blocks
  // no query from k * tpb on can see are then released (slide_window).
  // Throws (state unchanged) when the id is already present, input_length is not in
  // [1, max_seq_len], beam_width != 1, or there are not enough free blocks (message names needed
  // and free).
  //
  // A suspended sequence (suspend_sequence) is rejected with std::invalid_argument by add_token,
  // add_tokens, rewind, fork_sequence (as src_id), store_context_blocks and copy_block_tables.
  void add_sequence(RequestIdType request_id, SizeType32 input_length, SizeType32 beam_width,
                    LlmRequest* request = nullptr, SizeType32 max_reused_blocks = -1);
  // The prompt blocks add_sequence would reuse for the request now (0 with reuse off).
  SizeType32 count_reusable_blocks(LlmRequest const& request) const;
  // Sliding window: releases the blocks no query at first_query_pos or later can see, those whose
  // tokens all precede first_query_pos - W + 1, oldest first (no-op without a window). With reuse and
  // a request, the full blocks released are first stored for reuse as remove_sequence would store
  // them (the walk passes released blocks whose prefix is cached and stops at one that is not).
  // Throws std::invalid_argument for an unknown or suspended id, first_query_pos outside
  // [0, num_tokens], or a request of another id.
  void slide_window(RequestIdType request_id, SizeType32 first_query_pos, LlmRequest const* request = nullptr);
  // The blocks the sequence holds (those released by the window not counted).
  SizeType32 get_num_held_blocks(RequestIdType request_id) const;
  // One more token; a new block when it starts one. With a window, first slides it to the new token
  // (slide_window at num_tokens, storing nothing). Throws for an unknown id, past max_seq_len, or with
  // no free block.
  void add_token(RequestIdType request_id);
  // n more tokens at once (a speculative step's 1 + k), all or nothing: the blocks they start are
  // allocated in order. With a window and n > 0, first slides it to the first new token (kept even
  // when the allocation then fails). Throws std::invalid_argument for an unknown id, n < 0 or past
  // max_seq_len, and std::runtime_error (no block allocated; message names needed and free) without
  // enough free blocks.
  void add_tokens(RequestIdType request_id, SizeType32 n);
  // Pops the last n tokens (rejected drafts): every block left empty is released, last block first.
  // Rewound tokens are never stored for reuse (remove_sequence publishes only the tokens held). Throws
  // std::invalid_argument for an unknown id or n outside [0, num_tokens - 1] (a sequence keeps a token),
  // and, once the window released blocks, for n > num_tokens - (num_released * tpb + W - 1): the
  // window cannot move back over what it released.
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
  // The transfers between levels queued since the last call, in order, and forgets them. Execute them
  // in this order (a later one may overwrite the source of an earlier one), all before the next
  // forward, and before the block copies taken at the same point: between two drains no block is
  // freed after a copy-on-write is queued (the executor frees and suspends before it allocates), so a
  // copy never needs to precede a transfer.
  std::vector<KvBlockTransfer> take_transfers();
  // Swap-out: every private block (ref_count 1) of the sequence moves to a free secondary block (an
  // offload transfer each, keys moving along; the secondary pool evicts its lowest-priority, oldest
  // cached blocks for room) and its primary block is freed, last first. Blocks shared with another
  // sequence stay held in primary. The sequence keeps its tokens and is suspended: only resume,
  // remove and the getters accept it. All or nothing: std::runtime_error (state unchanged) naming
  // needed and free secondary blocks; std::invalid_argument for an unknown or suspended id, or on a
  // sliding-window manager.
  void suspend_sequence(RequestIdType request_id);
  // Swap-in: each secondary block of a suspended sequence gets a fresh primary block (an onboard
  // transfer each, its key moving back), restoring the block table; the secondary blocks are freed.
  // All or nothing: std::runtime_error (state unchanged) naming needed and free primary blocks;
  // std::invalid_argument for an unknown id or a sequence not suspended.
  void resume_sequence(RequestIdType request_id);
  // Free primary blocks resume_sequence needs (its secondary blocks; 0 when not suspended).
  SizeType32 get_needed_blocks_to_resume(RequestIdType request_id) const;
  // Free secondary blocks suspend_sequence needs (its private blocks; 0 when already suspended).
  SizeType32 get_needed_secondary_blocks_to_suspend(RequestIdType request_id) const;
  // Frees the blocks held (not those the window released), last block first. With reuse and a
  // request, first stores the full blocks of
  // the tokens the sequence holds (capped, for a request still in context, at the tokens already
  // computed: context_current_position). Throws for an unknown id. A suspended sequence is accepted
  // (its secondary blocks return to the secondary free queue).
  void remove_sequence(RequestIdType request_id, LlmRequest* request = nullptr);
  // Publishes the full prompt blocks of a request whose context finished (no-op without reuse).
  void store_context_blocks(LlmRequest const& request);

  // Both accept a suspended sequence (its block ids then mix the levels). An entry released by the
  // window is -1.
  std::vector<BlockIdType> const& get_block_ids(RequestIdType request_id) const;
  SizeType32 get_num_tokens(RequestIdType request_id) const;
  // Writes the block ids of each sequence into row i of out[num_rows][row_stride]; unused entries
  // of those rows are set to 0, and so are the entries released by the window (the kernels never
  // read them). Throws if a sequence has more blocks than row_stride or
  // request_ids.size() > num_rows.
  void copy_block_tables(std::vector<RequestIdType> const& request_ids, BlockIdType* out, std::int64_t num_rows,
                         std::int64_t row_stride) const;

  KvCacheStats get_kv_cache_stats() const;

  // Scheduling simulation (no real state changes).
  void start_scheduling();
  SizeType32 scheduling_num_free_blocks() const { return scheduling_num_free_blocks_; }
  // Adds back to the simulated free count the primary blocks of that sequence no other sequence holds.
  void scheduling_remove_sequence(RequestIdType request_id);
  // With a window, less what the step's slide releases first (the blocks its first query no longer sees).
  SizeType32 get_needed_blocks_one_step(LlmRequest const& request, bool two_steps_lookahead) const;
  // With a window, bounded by it: the most blocks the sequence will hold at once minus those it holds.
  SizeType32 get_remaining_blocks_to_completion(LlmRequest const& request) const;
  // Chained key (64-bit) of the first of the request's first (prompt_len - 1) / tpb full prompt
  // blocks that is not in the reuse tree; nullopt when all are cached, there are none, or reuse
  // is off. Used by the capacity scheduler to delay duplicate prefills.
  std::optional<std::uint64_t> find_new_context_block(LlmRequest const& request) const;

  // Persistence of the secondary level (kv_cache_manager_persist.cpp).
  //
  // Every keyed secondary block whose ancestors are all keyed secondary blocks (a prefix that lies
  // wholly in the secondary level, so that its KV is all in the tier's memory): first the free ones
  // in free-queue order (retention priority ascending, oldest first), then those held by suspended
  // sequences, by id. A secondary block below a primary ancestor is left out.
  KvSecondaryBlocks export_secondary_blocks() const;
  // Adopts an export into this fresh manager (reuse on, no sequence, no key, no pending transfer):
  // each block is keyed at its id under its parent and freed with its priority, in the listed order
  // (so the free queue is the exported one); the other secondary blocks cache nothing and go to the
  // front of the priority-0 list. A later add_sequence whose prompt starts with an adopted prefix
  // onboards those blocks. All or nothing: std::invalid_argument (state unchanged) naming the entry
  // for arrays of different lengths, more entries than secondary blocks, an id that is not a
  // secondary block or is listed twice, a priority outside [0, 100], a parent that is not a listed
  // block, a cycle of parents, two entries with one key; and for a manager that is not fresh.
  void import_secondary_blocks(KvSecondaryBlocks const& blocks);
  // Before a shutdown that keeps the tier: moves the keys of the free cached primary blocks (of
  // priority >= secondary_offload_min_priority) to free secondary blocks, fewest ancestors first
  // (then by id), an offload transfer each, so that they are exported too. Stops when the secondary
  // level has no free block without a key: it evicts nothing of the tier. Returns the blocks moved.
  SizeType32 offload_reusable_blocks();

  // Throws std::logic_error describing the first violated invariant.
  void check_integrity() const;

 private:
  struct Block;
  struct Sequence {
    std::vector<BlockIdType> block_ids;
    SizeType32 num_tokens = 0;
    // Blocks allocated later by add_token get the priority of the request that added the sequence.
    SizeType32 retention_priority = kDefaultRetentionPriority;
    bool suspended = false;       // swapped out: private blocks in the secondary level
    SizeType32 num_released = 0;  // sliding window: block_ids[0, num_released) are -1 (released)
  };
  // An intrusive FIFO threaded through Block::prev_free / next_free, so that releasing and taking a
  // block is O(1) and allocation-free (a std::list would allocate a node on every release).
  struct FreeList {
    BlockIdType front = -1;
    BlockIdType back = -1;
    SizeType32 size = 0;
  };
  static constexpr int kNumLevels = 2;
  // Reuse tree storage (block contents, hash index): see kv_cache_manager.cpp.
  struct ReuseIndex;

  // Free-queue and reuse-tree internals: see kv_cache_manager.cpp.
  SizeType32 level_of(BlockIdType block_id) const { return block_id >= num_blocks_ ? kSecondaryLevel : kPrimaryLevel; }
  FreeList& free_list(BlockIdType block_id);
  // Front of the lowest-priority non-empty free list of the level (callers check it has a free block).
  BlockIdType front_free_block(SizeType32 level) const;
  BlockIdType allocate_block(SizeType32 retention_priority);
  void release_block(BlockIdType block_id);
  void push_free_back(BlockIdType block_id);
  void push_free_front(BlockIdType block_id);
  void take_free_block(BlockIdType block_id);
  void drop_key(BlockIdType block_id);
  // The reuse-tree node of `from` (key, parent link, children, hash-index entry) becomes `to`'s;
  // neither block may be in a free list (the free-keyed counts are the callers').
  void move_key(BlockIdType from, BlockIdType to);
  BlockIdType find_child(BlockIdType parent, std::uint64_t hash, TokenIdType const* tokens) const;
  void set_key(BlockIdType block_id, BlockIdType parent, std::uint64_t hash, TokenIdType const* tokens);
  void store_blocks(std::vector<TokenIdType> const& tokens, SizeType32 num_tokens,
                    std::vector<BlockIdType> const& block_ids, SizeType32 retention_priority);
  // Walks the reuse tree from the root along the first num_lookup full blocks of tokens, stopping at
  // the first one not cached; appends each cached block to *hits (when not null); returns the count.
  SizeType32 match_prefix(TokenIdType const* tokens, SizeType32 num_lookup, std::vector<BlockIdType>* hits) const;
  // Sliding window (kv_cache_manager_window.cpp): releases the blocks dead at first_query_pos,
  // stored for reuse first with reuse on and a request (see slide_window).
  void slide(Sequence& seq, SizeType32 first_query_pos, LlmRequest const* request);
  // Capacity of a sequence's block_ids: a window sequence keeps entries for released blocks, so it can
  // have more entries than the pool has blocks.
  std::size_t max_block_entries() const;
  // Secondary level (kv_cache_manager_secondary.cpp). offload: moves the key of a primary block
  // being reused to a free secondary block, if its priority and the pool allow; false otherwise.
  bool offload(BlockIdType block_id);
  // A free secondary block for new contents (its key, and the keys below it, dropped), taken out of
  // the free queue with ref_count 1.
  BlockIdType take_secondary_block();
  // A fresh primary block for the contents of secondary block `secondary` (key moved, transfer queued).
  BlockIdType onboard(BlockIdType secondary);
  // 1 when the next token of seq lands in a last block another sequence also holds (copy-on-write).
  SizeType32 cow_blocks(Sequence const& seq) const;
  // Gives seq a private copy of its shared last block (call after checking a block is free).
  void copy_on_write(Sequence& seq);
  Sequence& sequence(RequestIdType request_id, char const* caller);
  Sequence const& sequence(RequestIdType request_id, char const* caller) const;
  // As sequence(), and rejects a suspended sequence (std::invalid_argument).
  Sequence& active_sequence(RequestIdType request_id, char const* caller);
  // get_remaining_blocks_to_completion with a window (attention_window_ > 0).
  SizeType32 remaining_blocks_in_window(LlmRequest const& request) const;

  SizeType32 num_blocks_;
  SizeType32 tokens_per_block_;
  SizeType32 max_seq_len_;
  bool enable_block_reuse_;
  SizeType32 num_secondary_blocks_;
  SizeType32 secondary_offload_min_priority_;
  SizeType32 attention_window_;
  // Indexed by block id, primary then secondary; Block is complete in the .cpp (a vector of an
  // incomplete type is allowed since C++17 as long as its members are only used there).
  std::vector<Block> blocks_;
  // free_lists_[level * 101 + p]: free blocks of that level and retention priority p, in release order.
  std::vector<FreeList> free_lists_;
  // Bit p of non_empty_lists_[level] set <=> that level's list p is non-empty (lowest in O(1)).
  std::uint64_t non_empty_lists_[kNumLevels][2] = {{0, 0}, {0, 0}};
  SizeType32 num_free_[kNumLevels] = {0, 0};
  SizeType32 num_free_keyed_[kNumLevels] = {0, 0};  // free blocks with a key in the reuse tree (reusable)
  std::unordered_map<RequestIdType, Sequence> sequences_;
  SizeType32 num_suspended_ = 0;
  SizeType32 scheduling_num_free_blocks_ = 0;
  std::int64_t alloc_total_blocks_ = 0;
  std::int64_t alloc_new_blocks_ = 0;
  std::int64_t reused_blocks_ = 0;
  std::int64_t missed_blocks_ = 0;
  std::int64_t offloaded_blocks_ = 0;
  std::int64_t onboarded_blocks_ = 0;
  std::int64_t secondary_reused_blocks_ = 0;
  std::unique_ptr<ReuseIndex> reuse_;
  std::vector<std::pair<BlockIdType, BlockIdType>> block_copies_;  // pending copy-on-writes
  std::vector<KvBlockTransfer> transfers_;                         // pending transfers between levels
};

}  // namespace inflight::batch_manager
