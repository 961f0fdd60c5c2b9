// KVCacheManager: exact block ids and free-queue orders, prefix reuse, eviction, retention
// priorities, statistics, the scheduling helpers, block tables, errors, and randomized traces
// checked against an independent model.
#include "inflight/batch_manager/kv_cache_manager.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace inflight::batch_manager {
namespace {

using Ids = std::vector<BlockIdType>;
using Tokens = std::vector<TokenIdType>;

Tokens iota_tokens(int count, TokenIdType start = 0) {
  Tokens tokens(static_cast<std::size_t>(count));
  std::iota(tokens.begin(), tokens.end(), start);
  return tokens;
}

Tokens join(Tokens a, Tokens const& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

Tokens head(Tokens const& tokens, int count) { return Tokens(tokens.begin(), tokens.begin() + count); }

LlmRequest make_request(RequestIdType id, Tokens tokens, SizeType32 kv_retention_priority = kDefaultRetentionPriority,
                        SizeType32 max_new_tokens = 8, SizeType32 beam_width = 1) {
  return LlmRequest(id, max_new_tokens, std::move(tokens), 0.5F, beam_width, kv_retention_priority);
}

// Runs the whole remaining context in one chunk and moves to generation, as the executor does.
void finish_context(LlmRequest& request) {
  request.set_context_chunk_size(request.context_remaining_length());
  request.move_to_next_context_chunk();
  request.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
}

// The free queue's order, revealed by allocating one default-priority block at a time (destroys
// the cache: use at the end of a test).
Ids drain(KVCacheManager& kv, RequestIdType first_id = 1000) {
  Ids order;
  for (RequestIdType id = first_id; kv.num_free_blocks() > 0; ++id) {
    kv.add_sequence(id, 1, 1);
    order.push_back(kv.get_block_ids(id).front());
  }
  return order;
}

template <typename Error, typename F>
void expect_error(F&& f, std::string const& fragment) {
  try {
    f();
    ADD_FAILURE() << "expected an exception mentioning \"" << fragment << "\"";
  } catch (Error const& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)
        << "message \"" << error.what() << "\" lacks \"" << fragment << "\"";
  }
}

void expect_same_stats(KvCacheStats const& a, KvCacheStats const& b) {
  EXPECT_EQ(a.free_num_blocks, b.free_num_blocks);
  EXPECT_EQ(a.used_num_blocks, b.used_num_blocks);
  EXPECT_EQ(a.alloc_total_blocks, b.alloc_total_blocks);
  EXPECT_EQ(a.alloc_new_blocks, b.alloc_new_blocks);
  EXPECT_EQ(a.reused_blocks, b.reused_blocks);
  EXPECT_EQ(a.missed_blocks, b.missed_blocks);
  EXPECT_EQ(a.reusable_num_blocks, b.reusable_num_blocks);
}

// Independent implementation of the documented chained hash (kv_cache_manager.cpp header comment).
std::uint64_t reference_key(Tokens const& tokens, int num_blocks, int tpb) {
  constexpr std::uint64_t kG = 0x9E3779B97F4A7C15ULL;
  auto const fin = [](std::uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
  };
  std::uint64_t h = 0;
  for (int b = 0; b < num_blocks; ++b) {
    std::uint64_t lane[4] = {kG, 2 * kG, 3 * kG, 4 * kG};
    for (int i = 0; i < tpb; ++i) {
      auto const token = static_cast<std::uint32_t>(tokens[static_cast<std::size_t>(b * tpb + i)]);
      std::uint64_t const x = (lane[i % 4] ^ token) * kG;
      lane[i % 4] = (x << 31) | (x >> 33);
    }
    for (std::uint64_t const l : lane) {
      h = fin(h + kG + l);
    }
  }
  return h;
}

// ----------------------------------------------------------------------------------------------
// Construction.

TEST(KVCacheManager, ConstructionAndAccessors) {
  KVCacheManager kv(7, 4, 10);
  EXPECT_EQ(kv.max_num_blocks(), 7);
  EXPECT_EQ(kv.tokens_per_block(), 4);
  EXPECT_EQ(kv.max_seq_len(), 10);
  EXPECT_EQ(kv.max_blocks_per_seq(), 3);
  EXPECT_FALSE(kv.enable_block_reuse());
  EXPECT_EQ(kv.num_free_blocks(), 7);
  EXPECT_EQ(kv.num_used_blocks(), 0);
  EXPECT_EQ(kv.num_sequences(), 0);
  KvCacheStats const stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.max_num_blocks, 7);
  EXPECT_EQ(stats.free_num_blocks, 7);
  EXPECT_EQ(stats.used_num_blocks, 0);
  EXPECT_EQ(stats.tokens_per_block, 4);
  EXPECT_EQ(stats.cache_hit_rate, 0.0);
  kv.check_integrity();
}

TEST(KVCacheManager, ConstructorRejectsBadArguments) {
  expect_error<std::invalid_argument>([] { KVCacheManager kv(0, 4, 16); }, "num_blocks must be >= 1, got 0");
  expect_error<std::invalid_argument>([] { KVCacheManager kv(4, 0, 16); }, "tokens_per_block must be >= 1, got 0");
  expect_error<std::invalid_argument>([] { KVCacheManager kv(4, 4, -2); }, "max_seq_len must be >= 1, got -2");
}

// ----------------------------------------------------------------------------------------------
// Allocation order and the free queue.

TEST(KVCacheManager, InitialFreeQueueIsBlockOrder) {
  KVCacheManager kv(5, 4, 32);
  EXPECT_EQ(drain(kv), (Ids{0, 1, 2, 3, 4}));
  kv.check_integrity();
}

TEST(KVCacheManager, AddSequenceAllocatesTheWholePrompt) {
  KVCacheManager kv(8, 4, 64);
  kv.add_sequence(1, 9, 1);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2}));
  EXPECT_EQ(kv.get_num_tokens(1), 9);
  kv.add_sequence(2, 4, 1);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{3}));
  kv.add_sequence(3, 1, 1);
  EXPECT_EQ(kv.get_block_ids(3), (Ids{4}));
  EXPECT_TRUE(kv.has_sequence(2));
  EXPECT_EQ(kv.num_sequences(), 3);
  EXPECT_EQ(kv.num_free_blocks(), 3);
  EXPECT_EQ(kv.num_used_blocks(), 5);
  kv.check_integrity();
}

TEST(KVCacheManager, ReleasedBlocksGoToTheBackLastBlockFirst) {
  KVCacheManager kv(6, 4, 64);
  kv.add_sequence(1, 12, 1);
  kv.add_sequence(2, 4, 1);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2}));
  EXPECT_EQ(kv.get_block_ids(2), (Ids{3}));
  kv.remove_sequence(1);
  EXPECT_FALSE(kv.has_sequence(1));
  kv.check_integrity();
  // Queue: 4, 5 (never used), then 2, 1, 0 (released last block first).
  kv.add_sequence(3, 16, 1);
  EXPECT_EQ(kv.get_block_ids(3), (Ids{4, 5, 2, 1}));
  kv.remove_sequence(2);
  kv.check_integrity();
  EXPECT_EQ(drain(kv), (Ids{0, 3}));
}

TEST(KVCacheManager, AddTokenAllocatesWhenTheTokenStartsABlock) {
  KVCacheManager kv(4, 4, 16);
  kv.add_sequence(1, 3, 1);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0}));
  kv.add_token(1);  // 4 tokens: still one block
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0}));
  kv.add_token(1);  // token 5 starts block 2
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1}));
  for (int i = 0; i < 3; ++i) {
    kv.add_token(1);
  }
  EXPECT_EQ(kv.get_num_tokens(1), 8);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1}));
  kv.add_token(1);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2}));
  KvCacheStats const stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.alloc_total_blocks, 3);
  EXPECT_EQ(stats.alloc_new_blocks, 3);
  EXPECT_EQ(stats.missed_blocks, 1);  // only prompt blocks are looked up
  EXPECT_EQ(stats.reused_blocks, 0);
  kv.check_integrity();
}

TEST(KVCacheManager, OneTokenPerBlock) {
  KVCacheManager kv(3, 1, 3);
  kv.add_sequence(1, 1, 1);
  kv.add_token(1);
  kv.add_token(1);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2}));
  EXPECT_EQ(kv.max_blocks_per_seq(), 3);
  kv.check_integrity();
}

// ----------------------------------------------------------------------------------------------
// Errors.

TEST(KVCacheManager, AddSequenceErrorsLeaveStateUnchanged) {
  KVCacheManager kv(5, 4, 16);
  kv.add_sequence(1, 8, 1);
  KvCacheStats const before = kv.get_kv_cache_stats();
  LlmRequest other = make_request(9, iota_tokens(4));

  expect_error<std::invalid_argument>([&] { kv.add_sequence(1, 4, 1); }, "request_id 1 is already");
  expect_error<std::invalid_argument>([&] { kv.add_sequence(2, 0, 1); },
                                      "input_length must be in [1, 16] (max_seq_len), got 0");
  expect_error<std::invalid_argument>([&] { kv.add_sequence(2, 17, 1); }, "got 17");
  expect_error<std::invalid_argument>([&] { kv.add_sequence(2, 4, 2); },
                                      "only beam_width 1 is supported, got beam_width 2");
  expect_error<std::invalid_argument>([&] { kv.add_sequence(2, 4, 1, &other); },
                                      "request->request_id() 9 does not match request_id 2");
  expect_error<std::runtime_error>([&] { kv.add_sequence(2, 16, 1); }, "need 4, free 3");

  EXPECT_FALSE(kv.has_sequence(2));
  EXPECT_EQ(kv.num_sequences(), 1);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1}));
  expect_same_stats(kv.get_kv_cache_stats(), before);
  kv.check_integrity();
  kv.add_sequence(2, 12, 1);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{2, 3, 4}));
}

TEST(KVCacheManager, FailedAddWithPrefixHitsClaimsNothing) {
  KVCacheManager kv(4, 4, 64, true);
  Tokens const prompt = iota_tokens(12);
  LlmRequest a = make_request(1, prompt);
  kv.add_sequence(1, 12, 1, &a);
  finish_context(a);
  kv.remove_sequence(1, &a);  // stores 0 -> 1 -> 2; queue 3, 2, 1, 0

  // 3 free hits + 2 new blocks = 5 needed, 4 free.
  LlmRequest b = make_request(2, join(prompt, iota_tokens(8, 100)));
  KvCacheStats const before = kv.get_kv_cache_stats();
  expect_error<std::runtime_error>([&] { kv.add_sequence(2, 20, 1, &b); },
                                   "add_sequence: not enough free KV blocks for request_id 2: need 5, free 4");
  EXPECT_EQ(b.prepopulated_prompt_len(), 0);
  EXPECT_EQ(b.context_current_position(), 0);
  expect_same_stats(kv.get_kv_cache_stats(), before);
  kv.check_integrity();

  // The hits stayed cached and queued, and the queue kept its order: the new block is 3.
  LlmRequest c = make_request(3, prompt);
  kv.add_sequence(3, 12, 1, &c);
  EXPECT_EQ(kv.get_block_ids(3), (Ids{0, 1, 3}));
  EXPECT_EQ(c.prepopulated_prompt_len(), 8);
  kv.check_integrity();
}

TEST(KVCacheManager, AddTokenErrorsLeaveStateUnchanged) {
  KVCacheManager kv(2, 4, 5);
  kv.add_sequence(1, 5, 1);
  expect_error<std::invalid_argument>([&] { kv.add_token(1); },
                                      "request_id 1 already holds 5 tokens, max_seq_len is 5");
  EXPECT_EQ(kv.get_num_tokens(1), 5);
  expect_error<std::invalid_argument>([&] { kv.add_token(99); },
                                      "add_token: request_id 99 is not in the KV cache manager");

  KVCacheManager full(1, 4, 16);
  full.add_sequence(1, 4, 1);
  KvCacheStats const before = full.get_kv_cache_stats();
  expect_error<std::runtime_error>([&] { full.add_token(1); }, "need 1, free 0");
  EXPECT_EQ(full.get_num_tokens(1), 4);
  EXPECT_EQ(full.get_block_ids(1), (Ids{0}));
  expect_same_stats(full.get_kv_cache_stats(), before);
  full.check_integrity();
}

// ----------------------------------------------------------------------------------------------
// Speculative decoding: several tokens at once, and rewinding the rejected ones.

TEST(KVCacheManager, AddTokensAllocatesTheBlocksTheTokensStart) {
  KVCacheManager kv(8, 4, 64);
  kv.add_sequence(1, 3, 1);
  kv.add_tokens(1, 1);  // 4 tokens: still block 0
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0}));
  kv.add_tokens(1, 5);  // 9 tokens: blocks 1 and 2, in order
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2}));
  EXPECT_EQ(kv.get_num_tokens(1), 9);
  kv.add_tokens(1, 0);  // nothing
  EXPECT_EQ(kv.get_num_tokens(1), 9);
  KvCacheStats const stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.alloc_total_blocks, 3);
  EXPECT_EQ(stats.alloc_new_blocks, 3);
  EXPECT_EQ(kv.num_free_blocks(), 5);
  kv.check_integrity();
}

TEST(KVCacheManager, RewindReleasesTheBlocksLeftEmptyLastFirst) {
  KVCacheManager kv(8, 4, 64);
  kv.add_sequence(1, 3, 1);
  kv.add_tokens(1, 10);  // 13 tokens: blocks 0, 1, 2, 3
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2, 3}));
  kv.rewind(1, 1);  // 12 tokens: block 3 is empty
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2}));
  kv.rewind(1, 7);  // 5 tokens: block 2 emptied; block 1 keeps one token
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1}));
  EXPECT_EQ(kv.get_num_tokens(1), 5);
  kv.check_integrity();
  // The queue: 4..7 (never used), then 3, then 2 (released as they emptied).
  EXPECT_EQ(drain(kv), (Ids{4, 5, 6, 7, 3, 2}));
}

TEST(KVCacheManager, RewindToOneTokenAndGrowAgain) {
  KVCacheManager kv(4, 2, 16);
  kv.add_sequence(1, 5, 1);  // blocks 0, 1, 2
  kv.rewind(1, 4);           // 1 token: blocks 2, then 1 released
  EXPECT_EQ(kv.get_num_tokens(1), 1);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0}));
  EXPECT_EQ(kv.num_free_blocks(), 3);
  kv.add_tokens(1, 4);  // 5 tokens: from the front of the queue, 3 then 2
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 3, 2}));
  kv.check_integrity();
}

// ----------------------------------------------------------------------------------------------
// Beam search: forked sequences share blocks; a write into a shared partly filled block copies it.

TEST(KVCacheManager, ForkSharesEveryBlockAndCopiesOnWrite) {
  KVCacheManager kv(8, 4, 64);
  kv.add_sequence(1, 6, 1);  // blocks 0 (full), 1 (2 of 4 tokens)
  kv.fork_sequence(1, 2);
  kv.fork_sequence(1, 3);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{0, 1}));
  EXPECT_EQ(kv.get_num_tokens(3), 6);
  EXPECT_EQ(kv.num_free_blocks(), 6);  // nothing allocated: blocks 0 and 1 have ref_count 3
  kv.check_integrity();
  kv.add_token(2);  // lands in block 1, shared: 2 gets a copy (block 2), 1 and 3 keep block 1
  EXPECT_EQ(kv.get_block_ids(2), (Ids{0, 2}));
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1}));
  kv.add_tokens(3, 3);  // 9 tokens: a copy of block 1 (block 3), then block 4 for the 9th
  EXPECT_EQ(kv.get_block_ids(3), (Ids{0, 3, 4}));
  kv.add_token(1);  // block 1 is 1's alone now: no copy
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1}));
  using Copies = std::vector<std::pair<BlockIdType, BlockIdType>>;
  EXPECT_EQ(kv.take_block_copies(), (Copies{{1, 2}, {1, 3}}));
  EXPECT_TRUE(kv.take_block_copies().empty());  // taken once
  kv.check_integrity();
  // A full last block is never copied: the next token starts a new block.
  kv.fork_sequence(1, 4);
  kv.add_tokens(4, 1);  // 8 tokens: block 1 (shared, partly filled) is copied into block 5
  kv.fork_sequence(4, 5);
  kv.add_token(5);  // its 9th token starts a new block (6); the full shared block 5 stays shared
  EXPECT_EQ(kv.get_block_ids(5), (Ids{0, 5, 6}));
  EXPECT_EQ(kv.take_block_copies(), (Copies{{1, 5}}));
  // Removing frees a block only when its last holder goes.
  SizeType32 const free_before = kv.num_free_blocks();
  kv.remove_sequence(4);
  EXPECT_EQ(kv.num_free_blocks(), free_before);  // 0 and 5 are still held by 1/2/3 and 5
  kv.remove_sequence(5);
  EXPECT_EQ(kv.num_free_blocks(), free_before + 2);  // 6 and 5
  kv.check_integrity();
  EXPECT_THROW(kv.fork_sequence(1, 2), std::invalid_argument);   // 2 exists
  EXPECT_THROW(kv.fork_sequence(9, 10), std::invalid_argument);  // 9 does not
}

TEST(KVCacheManager, CopyOnWriteNeedsAFreeBlock) {
  KVCacheManager kv(2, 4, 64);
  kv.add_sequence(1, 6, 1);  // both blocks
  kv.fork_sequence(1, 2);
  EXPECT_THROW(kv.add_token(2), std::runtime_error);
  EXPECT_THROW(kv.add_tokens(2, 1), std::runtime_error);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{0, 1}));  // unchanged
  EXPECT_TRUE(kv.take_block_copies().empty());
  kv.check_integrity();
}

TEST(KVCacheManager, AddTokensAndRewindErrorsLeaveStateUnchanged) {
  KVCacheManager kv(3, 4, 12);
  kv.add_sequence(1, 5, 1);  // blocks 0, 1
  KvCacheStats const before = kv.get_kv_cache_stats();
  expect_error<std::invalid_argument>([&] { kv.add_tokens(1, 8); },
                                      "add_tokens: request_id 1 holds 5 tokens; 8 more exceed max_seq_len 12");
  expect_error<std::invalid_argument>([&] { kv.add_tokens(1, -1); }, "add_tokens: n must be >= 0, got -1");
  expect_error<std::invalid_argument>(
      [&] { kv.rewind(1, 5); }, "rewind: n must be in [0, 4] (request_id 1 keeps at least one of its 5 tokens), got 5");
  expect_error<std::invalid_argument>([&] { kv.rewind(1, -1); }, "got -1");
  expect_error<std::invalid_argument>([&] { kv.rewind(9, 1); }, "rewind: request_id 9 is not in the KV cache manager");
  kv.add_sequence(2, 4, 1);  // block 2: none free now
  KvCacheStats const full = kv.get_kv_cache_stats();
  expect_error<std::runtime_error>([&] { kv.add_tokens(1, 4); }, "need 1, free 0");
  EXPECT_EQ(kv.get_num_tokens(1), 5);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1}));
  expect_same_stats(kv.get_kv_cache_stats(), full);
  EXPECT_EQ(before.alloc_total_blocks + 1, full.alloc_total_blocks);
  kv.check_integrity();
}

TEST(KVCacheManager, RewoundBlocksComeBackUncachedAndStoringStopsAtTheHeldTokens) {
  KVCacheManager kv(8, 2, 32, true);
  LlmRequest req = make_request(1, {1, 2, 3, 4, 5});
  kv.add_sequence(1, 5, 1, &req);  // blocks 0, 1, 2
  finish_context(req);
  kv.store_context_blocks(req);  // [1 2] [3 4] cached (held)
  kv.add_tokens(1, 3);           // the sampled token and two drafts: 8 tokens, blocks 0..3
  req.add_new_token(6);          // only the sampled token is the request's
  kv.rewind(1, 2);               // both drafts rejected: 6 tokens, block 3 released
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2}));
  EXPECT_EQ(kv.get_kv_cache_stats().reusable_num_blocks, 0);  // block 3 held only drafts: no key
  kv.remove_sequence(1, &req);                                // stores the 6 tokens it holds: [1 2] [3 4] [5 6]
  EXPECT_EQ(kv.get_kv_cache_stats().reusable_num_blocks, 3);
  kv.check_integrity();
  LlmRequest again = make_request(2, {1, 2, 3, 4, 5, 6, 7, 8, 9});
  kv.add_sequence(2, 9, 1, &again);
  EXPECT_EQ(again.prepopulated_prompt_len(), 6);
  kv.check_integrity();
}

TEST(KVCacheManager, PlanningCountsAGeneratingRequestsDrafts) {
  KVCacheManager kv(16, 4, 12);
  LlmRequest r = make_request(1, {1, 2, 3});
  finish_context(r);
  r.add_new_token(4);                                     // 3 tokens in KV, the 4th is this step's input
  EXPECT_EQ(kv.get_needed_blocks_one_step(r, false), 0);  // token 4 fits block 1
  r.set_draft_tokens({5, 6, 7});                          // the step writes tokens 4..7
  EXPECT_EQ(kv.get_needed_blocks_one_step(r, false), 1);
  EXPECT_EQ(kv.get_needed_blocks_one_step(r, true), 2);     // two such steps: tokens 4..11
  r.set_draft_tokens({5, 6, 7, 8, 9, 10, 11, 12, 13, 14});  // capped at max_seq_len 12: tokens 4..12
  EXPECT_EQ(kv.get_needed_blocks_one_step(r, false), 2);
}

TEST(KVCacheManager, UnknownIdsAreRejected) {
  KVCacheManager kv(4, 4, 16, true);
  kv.add_sequence(1, 4, 1);
  LlmRequest other = make_request(2, iota_tokens(4));
  expect_error<std::invalid_argument>([&] { kv.remove_sequence(7); },
                                      "remove_sequence: request_id 7 is not in the KV cache manager");
  expect_error<std::invalid_argument>([&] { kv.remove_sequence(1, &other); },
                                      "request->request_id() 2 does not match request_id 1");
  EXPECT_TRUE(kv.has_sequence(1));
  expect_error<std::invalid_argument>([&] { (void)kv.get_block_ids(7); }, "get_block_ids: request_id 7");
  expect_error<std::invalid_argument>([&] { (void)kv.get_num_tokens(7); }, "get_num_tokens: request_id 7");
  expect_error<std::invalid_argument>([&] { kv.store_context_blocks(other); }, "store_context_blocks: request_id 2");
  kv.check_integrity();

  // Without reuse, store_context_blocks does nothing, not even look the id up.
  KVCacheManager plain(4, 4, 16);
  plain.store_context_blocks(other);
  plain.check_integrity();
}

// ----------------------------------------------------------------------------------------------
// Prefix reuse.

TEST(KVCacheManager, ReuseHitGetsTheStoredBlocks) {
  KVCacheManager kv(16, 4, 64, true);
  Tokens const prompt_a = iota_tokens(10);
  LlmRequest a = make_request(1, prompt_a);
  kv.add_sequence(1, 10, 1, &a);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2}));
  EXPECT_EQ(a.prepopulated_prompt_len(), 0);
  kv.store_context_blocks(a);  // 2 full prompt blocks
  kv.check_integrity();

  LlmRequest b = make_request(2, join(head(prompt_a, 8), {100, 101, 102, 103}));
  kv.add_sequence(2, 12, 1, &b);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{0, 1, 3}));
  EXPECT_EQ(b.prepopulated_prompt_len(), 8);
  EXPECT_EQ(b.context_current_position(), 8);
  EXPECT_EQ(b.context_chunk_size(), 4);
  EXPECT_TRUE(b.is_first_context_chunk());

  KvCacheStats const stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.reused_blocks, 2);
  EXPECT_EQ(stats.missed_blocks, 4);
  EXPECT_EQ(stats.alloc_total_blocks, 6);
  EXPECT_EQ(stats.alloc_new_blocks, 4);
  EXPECT_DOUBLE_EQ(stats.cache_hit_rate, 2.0 / 6.0);
  EXPECT_EQ(stats.free_num_blocks, 12);
  EXPECT_EQ(stats.used_num_blocks, 4);
  kv.check_integrity();

  // Shared blocks survive the removal of either holder.
  kv.remove_sequence(1, &a);
  EXPECT_EQ(kv.num_free_blocks(), 13);
  kv.check_integrity();
}

TEST(KVCacheManager, LastPromptTokenIsNeverReused) {
  KVCacheManager kv(8, 4, 64, true);
  Tokens const prompt = iota_tokens(8);
  LlmRequest a = make_request(1, prompt);
  kv.add_sequence(1, 8, 1, &a);
  kv.store_context_blocks(a);  // both blocks are full and stored

  // Same 8 tokens: only (8 - 1) / 4 = 1 block is looked up.
  LlmRequest b = make_request(2, prompt);
  kv.add_sequence(2, 8, 1, &b);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{0, 2}));
  EXPECT_EQ(b.prepopulated_prompt_len(), 4);

  // One more token: both blocks hit.
  LlmRequest c = make_request(3, join(prompt, {50}));
  kv.add_sequence(3, 9, 1, &c);
  EXPECT_EQ(kv.get_block_ids(3), (Ids{0, 1, 3}));
  EXPECT_EQ(c.prepopulated_prompt_len(), 8);
  kv.check_integrity();
}

TEST(KVCacheManager, ShortPromptsLookNothingUp) {
  KVCacheManager kv(8, 4, 64, true);
  LlmRequest a = make_request(1, iota_tokens(4));
  kv.add_sequence(1, 4, 1, &a);
  kv.store_context_blocks(a);
  LlmRequest b = make_request(2, iota_tokens(4));
  kv.add_sequence(2, 4, 1, &b);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{1}));
  EXPECT_EQ(b.prepopulated_prompt_len(), 0);
  KvCacheStats const stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.reused_blocks, 0);
  EXPECT_EQ(stats.missed_blocks, 2);
  kv.check_integrity();
}

TEST(KVCacheManager, FreeCachedBlocksAreHitAndLeaveTheQueue) {
  KVCacheManager kv(6, 4, 64, true);
  Tokens const prompt = iota_tokens(8);
  LlmRequest a = make_request(1, prompt);
  kv.add_sequence(1, 8, 1, &a);
  finish_context(a);
  kv.remove_sequence(1, &a);           // queue 2, 3, 4, 5, 1, 0 (0 and 1 keyed)
  EXPECT_EQ(kv.num_free_blocks(), 6);  // cached blocks count as free
  kv.check_integrity();

  LlmRequest b = make_request(2, join(prompt, iota_tokens(4, 100)));
  kv.add_sequence(2, 12, 1, &b);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{0, 1, 2}));
  EXPECT_EQ(b.prepopulated_prompt_len(), 8);
  EXPECT_EQ(kv.num_free_blocks(), 3);
  kv.check_integrity();
  EXPECT_EQ(drain(kv), (Ids{3, 4, 5}));
}

TEST(KVCacheManager, RemoveWithoutRequestStoresNothing) {
  KVCacheManager kv(6, 4, 64, true);
  Tokens const prompt = iota_tokens(9);
  LlmRequest a = make_request(1, prompt);
  kv.add_sequence(1, 9, 1, &a);
  finish_context(a);
  kv.remove_sequence(1);
  LlmRequest b = make_request(2, prompt);
  kv.add_sequence(2, 9, 1, &b);
  EXPECT_EQ(b.prepopulated_prompt_len(), 0);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{3, 4, 5}));
  kv.check_integrity();
}

TEST(KVCacheManager, RunningContextStoresOnlyComputedBlocks) {
  KVCacheManager kv(8, 4, 64, true);
  Tokens const prompt = iota_tokens(12);
  LlmRequest a = make_request(1, prompt);
  kv.add_sequence(1, 12, 1, &a);
  a.set_context_chunk_size(5);
  a.move_to_next_context_chunk();  // 5 tokens computed, still CONTEXT_INIT
  kv.remove_sequence(1, &a);       // stores floor(5 / 4) = 1 block
  kv.check_integrity();

  LlmRequest b = make_request(2, prompt);
  kv.add_sequence(2, 12, 1, &b);
  EXPECT_EQ(b.prepopulated_prompt_len(), 4);
  EXPECT_EQ(kv.get_block_ids(2).front(), 0);
  kv.check_integrity();
}

TEST(KVCacheManager, RemoveStoresGeneratedTokens) {
  KVCacheManager kv(8, 4, 64, true);
  LlmRequest a = make_request(1, iota_tokens(6));
  kv.add_sequence(1, 6, 1, &a);
  finish_context(a);
  for (TokenIdType t : {60, 61, 62}) {
    a.add_new_token(t);
    kv.add_token(1);
  }
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2}));
  kv.remove_sequence(1, &a);  // 9 tokens: blocks 0 and 1 are full

  LlmRequest b = make_request(2, join(a.tokens(), {70}));
  kv.add_sequence(2, 10, 1, &b);
  EXPECT_EQ(b.prepopulated_prompt_len(), 8);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{0, 1, 3}));
  kv.check_integrity();
}

TEST(KVCacheManager, StoreIsCappedByTheRequestTokens) {
  KVCacheManager kv(8, 4, 64, true);
  Tokens const prompt = iota_tokens(4);
  LlmRequest a = make_request(1, prompt);
  kv.add_sequence(1, 4, 1, &a);
  finish_context(a);
  for (int i = 0; i < 4; ++i) {
    kv.add_token(1);  // the KV holds 8 tokens, the request only 4
  }
  kv.remove_sequence(1, &a);
  kv.check_integrity();

  LlmRequest b = make_request(2, join(prompt, {7, 7, 7, 7, 7}));
  kv.add_sequence(2, 9, 1, &b);
  EXPECT_EQ(b.prepopulated_prompt_len(), 4);
  kv.check_integrity();
}

TEST(KVCacheManager, StoringIsIdempotentAndDuplicatesStayUnkeyed) {
  KVCacheManager kv(8, 4, 64, true);
  Tokens const prompt = iota_tokens(9);
  LlmRequest a = make_request(1, prompt);
  LlmRequest b = make_request(2, prompt);
  kv.add_sequence(1, 9, 1, &a);
  kv.add_sequence(2, 9, 1, &b);  // nothing stored yet: no hit
  EXPECT_EQ(kv.get_block_ids(2), (Ids{3, 4, 5}));
  kv.store_context_blocks(a);
  kv.store_context_blocks(a);
  kv.store_context_blocks(b);  // same contents: walks through a's blocks, keys nothing
  kv.check_integrity();
  kv.remove_sequence(2, nullptr);
  kv.remove_sequence(1, nullptr);
  kv.check_integrity();
  // Free queue: 6, 7, 5, 4, 3 (unkeyed), 2, 1, 0 (a's 0 and 1 keyed).
  LlmRequest c = make_request(3, prompt);
  kv.add_sequence(3, 9, 1, &c);
  EXPECT_EQ(kv.get_block_ids(3), (Ids{0, 1, 6}));
  EXPECT_EQ(drain(kv), (Ids{7, 5, 4, 3, 2}));
}

TEST(KVCacheManager, EvictionDropsTheKey) {
  KVCacheManager kv(3, 4, 64, true);
  Tokens const prompt = iota_tokens(8);
  LlmRequest a = make_request(1, prompt);
  kv.add_sequence(1, 8, 1, &a);
  finish_context(a);
  kv.remove_sequence(1, &a);  // keys 0 -> 1; queue 2, 1, 0
  kv.add_sequence(2, 8, 1);   // takes 2, then 1 (its key is dropped)
  EXPECT_EQ(kv.get_block_ids(2), (Ids{2, 1}));
  kv.check_integrity();
  kv.remove_sequence(2);  // queue 0, 1, 2

  LlmRequest b = make_request(3, join(prompt, iota_tokens(4, 100)));
  kv.add_sequence(3, 12, 1, &b);
  EXPECT_EQ(b.prepopulated_prompt_len(), 4);  // block 0 still cached, block 1 not
  EXPECT_EQ(kv.get_block_ids(3), (Ids{0, 1, 2}));
  KvCacheStats const stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.reused_blocks, 1);
  EXPECT_EQ(stats.missed_blocks, 2 + 2 + 2);
  kv.check_integrity();
}

TEST(KVCacheManager, EvictionDropsTheKeysChainedBelow) {
  KVCacheManager kv(6, 4, 64, true);
  Tokens const prompt = iota_tokens(12);
  Tokens const prompt_b = join(head(prompt, 8), {50, 51, 52, 53});
  LlmRequest a = make_request(1, prompt);
  LlmRequest b = make_request(2, prompt_b);
  kv.add_sequence(1, 12, 1, &a);
  kv.add_sequence(2, 12, 1, &b);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{3, 4, 5}));
  kv.store_context_blocks(a);  // 0 -> 1 -> 2
  kv.remove_sequence(1);       // queue 2, 1, 0; keys kept
  kv.store_context_blocks(b);  // walks 0 -> 1, keys 5 under 1
  kv.check_integrity();

  LlmRequest d = make_request(4, join(prompt_b, {9}));  // looks up 3 blocks: 0, 1, 5
  LlmRequest e = make_request(5, join(head(prompt, 8), {99}));
  EXPECT_EQ(kv.find_new_context_block(d), std::nullopt);

  kv.add_sequence(3, 4, 1);  // takes 2 (a's leaf)
  EXPECT_EQ(kv.get_block_ids(3), (Ids{2}));
  EXPECT_EQ(kv.find_new_context_block(d), std::nullopt);
  kv.add_sequence(6, 4, 1);  // takes 1: drops 1 and the key of 5 below it (5 is in use by b)
  EXPECT_EQ(kv.get_block_ids(6), (Ids{1}));
  kv.check_integrity();
  std::optional<std::uint64_t> const missing = kv.find_new_context_block(d);
  ASSERT_TRUE(missing.has_value());
  EXPECT_EQ(*missing, reference_key(prompt_b, 2, 4));
  EXPECT_EQ(kv.find_new_context_block(e), missing);

  // b stores again when it leaves: 0 matches, 4 and 5 get keyed below it.
  finish_context(b);
  kv.remove_sequence(2, &b);  // queue 0, 5, 4, 3
  kv.check_integrity();
  kv.add_sequence(4, 13, 1, &d);
  EXPECT_EQ(kv.get_block_ids(4), (Ids{0, 4, 5, 3}));
  EXPECT_EQ(d.prepopulated_prompt_len(), 12);
  kv.check_integrity();
}

// ----------------------------------------------------------------------------------------------
// Retention priorities.

TEST(KVCacheManager, LowPriorityBlocksAreEvictedFirst) {
  KVCacheManager kv(3, 4, 64);
  LlmRequest low = make_request(1, iota_tokens(4), 10);
  kv.add_sequence(1, 4, 1, &low);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0}));
  kv.remove_sequence(1, &low);  // 0 goes to the back, but of the priority-10 list
  kv.add_sequence(2, 4, 1);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{0}));
  kv.remove_sequence(2);  // now priority 35 (allocated without a request): behind 1, 2
  kv.check_integrity();
  EXPECT_EQ(drain(kv), (Ids{1, 2, 0}));
}

TEST(KVCacheManager, AddTokenBlocksGetTheSequencePriority) {
  KVCacheManager kv(3, 4, 64);
  LlmRequest low = make_request(1, iota_tokens(4), 10);
  kv.add_sequence(1, 4, 1, &low);
  kv.add_token(1);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1}));
  kv.remove_sequence(1);
  kv.check_integrity();
  EXPECT_EQ(drain(kv), (Ids{1, 0, 2}));
}

TEST(KVCacheManager, HighPriorityCachedBlocksOutliveLowerOnes) {
  KVCacheManager kv(5, 4, 64, true);
  Tokens const prompt_a = iota_tokens(8);
  LlmRequest a = make_request(1, prompt_a, 80);
  LlmRequest b = make_request(2, iota_tokens(8, 100));
  kv.add_sequence(1, 8, 1, &a);
  kv.add_sequence(2, 8, 1, &b);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1}));
  EXPECT_EQ(kv.get_block_ids(2), (Ids{2, 3}));
  finish_context(a);
  finish_context(b);
  kv.remove_sequence(1, &a);  // priority 80: 1, 0
  kv.remove_sequence(2, &b);  // priority 35: 4, 3, 2
  kv.check_integrity();

  LlmRequest probe = make_request(9, join(prompt_a, {1}));  // looks up both of a's blocks
  for (RequestIdType id = 10; id < 13; ++id) {
    kv.add_sequence(id, 4, 1);
  }
  EXPECT_EQ(kv.get_block_ids(10), (Ids{4}));
  EXPECT_EQ(kv.get_block_ids(11), (Ids{3}));
  EXPECT_EQ(kv.get_block_ids(12), (Ids{2}));
  EXPECT_EQ(kv.find_new_context_block(probe), std::nullopt);  // a's blocks released earlier, kept
  kv.add_sequence(13, 4, 1);
  EXPECT_EQ(kv.get_block_ids(13), (Ids{1}));
  EXPECT_EQ(kv.find_new_context_block(probe), reference_key(prompt_a, 2, 4));
  kv.check_integrity();
}

TEST(KVCacheManager, StoringSetsTheStoringRequestsPriority) {
  KVCacheManager kv(4, 4, 64, true);
  Tokens const prompt = iota_tokens(8);
  LlmRequest a = make_request(1, prompt);
  kv.add_sequence(1, 8, 1, &a);
  kv.store_context_blocks(a);
  LlmRequest b = make_request(2, join(prompt, iota_tokens(4, 100)), 90);
  kv.add_sequence(2, 12, 1, &b);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{0, 1, 2}));
  finish_context(a);
  finish_context(b);
  kv.remove_sequence(1, &a);  // 0 and 1 still held by b
  kv.remove_sequence(2, &b);  // b stores 0, 1, 2 at priority 90
  kv.check_integrity();
  EXPECT_EQ(drain(kv), (Ids{3, 2, 1, 0}));
}

// ----------------------------------------------------------------------------------------------
// Stats.

TEST(KVCacheManager, StatsWithoutReuseCountMisses) {
  KVCacheManager kv(8, 4, 64);
  LlmRequest a = make_request(1, iota_tokens(9));
  kv.add_sequence(1, 9, 1, &a);
  kv.add_sequence(2, 4, 1);
  kv.add_token(2);
  KvCacheStats const stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.max_num_blocks, 8);
  EXPECT_EQ(stats.free_num_blocks, 3);
  EXPECT_EQ(stats.used_num_blocks, 5);
  EXPECT_EQ(stats.tokens_per_block, 4);
  EXPECT_EQ(stats.alloc_total_blocks, 5);
  EXPECT_EQ(stats.alloc_new_blocks, 5);
  EXPECT_EQ(stats.reused_blocks, 0);
  EXPECT_EQ(stats.missed_blocks, 4);
  EXPECT_EQ(stats.cache_hit_rate, 0.0);
}

// ----------------------------------------------------------------------------------------------
// Scheduling helpers.

TEST(KVCacheManager, NeededBlocksOneStepForContexts) {
  KVCacheManager kv(16, 4, 64, true);
  LlmRequest r = make_request(1, iota_tokens(9));
  EXPECT_EQ(kv.get_needed_blocks_one_step(r, false), 3);
  EXPECT_EQ(kv.get_needed_blocks_one_step(r, true), 3);
  r.set_draft_tokens({1, 2, 3});
  EXPECT_EQ(kv.get_needed_blocks_one_step(r, false), 3);  // 12 tokens
  r.set_draft_tokens({1, 2, 3, 4});
  EXPECT_EQ(kv.get_needed_blocks_one_step(r, false), 4);  // 13 tokens
  r.set_draft_tokens({});
  r.set_context_chunk_size(4);
  r.move_to_next_context_chunk();
  EXPECT_EQ(kv.get_needed_blocks_one_step(r, false), 0);  // later chunk: allocated already

  // A prefix hit does not reduce the count, and the first chunk after it is still "first".
  LlmRequest a = make_request(2, iota_tokens(9));
  kv.add_sequence(2, 9, 1, &a);
  kv.store_context_blocks(a);
  LlmRequest b = make_request(3, iota_tokens(9));
  kv.add_sequence(3, 9, 1, &b);
  EXPECT_EQ(b.prepopulated_prompt_len(), 8);
  EXPECT_TRUE(b.is_first_context_chunk());
  EXPECT_EQ(kv.get_needed_blocks_one_step(b, false), 3);
}

TEST(KVCacheManager, NeededBlocksOneStepForGeneration) {
  KVCacheManager kv(16, 4, 12);
  LlmRequest r = make_request(1, iota_tokens(8));
  r.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  // t = 7: the next token (8th) fits in block 2; two steps reach a 3rd block.
  EXPECT_EQ(kv.get_needed_blocks_one_step(r, false), 0);
  EXPECT_EQ(kv.get_needed_blocks_one_step(r, true), 1);
  r.add_new_token(1);  // t = 8
  EXPECT_EQ(kv.get_needed_blocks_one_step(r, false), 1);
  EXPECT_EQ(kv.get_needed_blocks_one_step(r, true), 1);
  r.set_state(LlmRequestState::kGENERATION_TO_COMPLETE);
  EXPECT_EQ(kv.get_needed_blocks_one_step(r, false), 1);

  LlmRequest wide = make_request(2, iota_tokens(8), kDefaultRetentionPriority, 8, 2);
  wide.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  wide.add_new_token(1);
  EXPECT_EQ(kv.get_needed_blocks_one_step(wide, false), 2);

  // max_seq_len 12 cap: t = 12 would need a 4th block for token 13, which cannot exist.
  LlmRequest at_cap = make_request(3, iota_tokens(12));
  at_cap.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  at_cap.add_new_token(1);
  EXPECT_EQ(kv.get_needed_blocks_one_step(at_cap, false), 0);
  // t = 10: one step (11) fits, two steps (12) fit too; t = 11: two steps (13) would pass the cap.
  LlmRequest near_cap = make_request(4, iota_tokens(10));
  near_cap.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  near_cap.add_new_token(1);
  EXPECT_EQ(kv.get_needed_blocks_one_step(near_cap, false), 0);
  EXPECT_EQ(kv.get_needed_blocks_one_step(near_cap, true), 0);
  LlmRequest crossing = make_request(5, iota_tokens(7));
  crossing.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  crossing.add_new_token(1);
  crossing.add_new_token(1);
  crossing.add_new_token(1);
  crossing.add_new_token(1);                                     // t = 10
  EXPECT_EQ(kv.get_needed_blocks_one_step(crossing, false), 0);  // ceil(11/4) - ceil(10/4)
  crossing.add_new_token(1);                                     // t = 11
  EXPECT_EQ(kv.get_needed_blocks_one_step(crossing, false), 0);  // 12 fits in block 3
  EXPECT_EQ(kv.get_needed_blocks_one_step(crossing, true), 0);   // 13 > max_seq_len
  LlmRequest step = make_request(6, iota_tokens(9));
  step.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  step.add_new_token(1);  // t = 9: 10 and 11 both in block 3 (ceil(10/4)=3 vs ceil(9/4)=3)
  EXPECT_EQ(kv.get_needed_blocks_one_step(step, true), 0);
  LlmRequest two = make_request(7, iota_tokens(7));
  two.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  two.add_new_token(1);                                     // t = 7
  EXPECT_EQ(kv.get_needed_blocks_one_step(two, false), 0);  // token 8 in block 2
  EXPECT_EQ(kv.get_needed_blocks_one_step(two, true), 1);   // token 9 starts block 3

  LlmRequest done = make_request(8, iota_tokens(8));
  done.set_state(LlmRequestState::kGENERATION_COMPLETE);
  EXPECT_EQ(kv.get_needed_blocks_one_step(done, true), 0);
  done.set_state(LlmRequestState::kENCODER_INIT);
  EXPECT_EQ(kv.get_needed_blocks_one_step(done, true), 0);
}

TEST(KVCacheManager, RemainingBlocksToCompletion) {
  KVCacheManager kv(32, 4, 64);
  // c = 2, T = ceil(17 / 4) = 5.
  LlmRequest r = make_request(1, iota_tokens(10), kDefaultRetentionPriority, 7);
  EXPECT_EQ(kv.get_remaining_blocks_to_completion(r), 5);  // h = 0: 2 - 0 + 3
  LlmRequest wide = make_request(2, iota_tokens(10), kDefaultRetentionPriority, 7, 2);
  EXPECT_EQ(kv.get_remaining_blocks_to_completion(wide), 8);  // 2 + 3 * 2

  kv.add_sequence(1, 10, 1, &r);  // h = 3 >= c
  EXPECT_EQ(kv.get_remaining_blocks_to_completion(r), 2);
  kv.add_sequence(2, 10, 1);
  // (5 - 3) * 2, + 1: the partial prompt block is copied for the second beam on the first decode step.
  EXPECT_EQ(kv.get_remaining_blocks_to_completion(wide), 5);
  wide.add_new_token(7);  // the context step's token: the first decode step (and its copy) is still ahead
  EXPECT_EQ(kv.get_remaining_blocks_to_completion(wide), 5);
  wide.add_new_token(8);  // past the first decode step: the beams hold their own copies
  EXPECT_EQ(kv.get_remaining_blocks_to_completion(wide), 4);
  LlmRequest wide_full = make_request(6, iota_tokens(8), kDefaultRetentionPriority, 8, 3);
  kv.add_sequence(6, 8, 1);  // a prompt of whole blocks: nothing to copy, T = 4, h = 2
  EXPECT_EQ(kv.get_remaining_blocks_to_completion(wide_full), 6);  // (4 - 2) * 3

  LlmRequest partial = make_request(3, iota_tokens(10), kDefaultRetentionPriority, 7);
  kv.add_sequence(3, 4, 1);                                      // h = 1 < c
  EXPECT_EQ(kv.get_remaining_blocks_to_completion(partial), 4);  // 2 - 1 + 3

  LlmRequest exact = make_request(4, iota_tokens(8), kDefaultRetentionPriority, 0);
  kv.add_sequence(4, 8, 1);
  EXPECT_EQ(kv.get_remaining_blocks_to_completion(exact), 0);

  // prompt_len + max_new_tokens passes INT32_MAX: c = 2, T = 536870913.
  LlmRequest huge = make_request(5, iota_tokens(10), kDefaultRetentionPriority, 2147483642);
  EXPECT_EQ(kv.get_remaining_blocks_to_completion(huge), 536870913);
}

TEST(KVCacheManager, SchedulingSimulationChangesNoRealState) {
  KVCacheManager kv(16, 4, 64, true);
  Tokens const prompt = iota_tokens(10);
  LlmRequest a = make_request(1, prompt);
  kv.add_sequence(1, 10, 1, &a);  // 0, 1, 2
  kv.store_context_blocks(a);
  LlmRequest b = make_request(2, join(head(prompt, 8), {7, 7, 7, 7}));
  kv.add_sequence(2, 12, 1, &b);                   // 0, 1 shared; 3
  EXPECT_EQ(kv.scheduling_num_free_blocks(), 16);  // not started yet: the initial count
  kv.start_scheduling();
  EXPECT_EQ(kv.scheduling_num_free_blocks(), 12);
  kv.scheduling_remove_sequence(2);
  EXPECT_EQ(kv.scheduling_num_free_blocks(), 13);  // only block 3 is b's alone
  kv.scheduling_remove_sequence(1);
  EXPECT_EQ(kv.scheduling_num_free_blocks(), 14);  // block 2
  kv.scheduling_remove_sequence(77);
  EXPECT_EQ(kv.scheduling_num_free_blocks(), 14);
  EXPECT_EQ(kv.num_free_blocks(), 12);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{0, 1, 3}));
  kv.check_integrity();
  kv.start_scheduling();
  EXPECT_EQ(kv.scheduling_num_free_blocks(), 12);
}

TEST(KVCacheManager, FindNewContextBlock) {
  Tokens const prompt = iota_tokens(13, 5);
  LlmRequest a = make_request(1, prompt);
  LlmRequest twin = make_request(2, prompt);
  LlmRequest other = make_request(3, iota_tokens(13, 6));

  KVCacheManager plain(8, 4, 64);
  EXPECT_EQ(plain.find_new_context_block(a), std::nullopt);

  KVCacheManager kv(8, 4, 64, true);
  LlmRequest tiny = make_request(4, iota_tokens(4));
  EXPECT_EQ(kv.find_new_context_block(tiny), std::nullopt);  // no full block before the last token
  EXPECT_EQ(kv.find_new_context_block(a), reference_key(prompt, 1, 4));
  EXPECT_EQ(kv.find_new_context_block(twin), kv.find_new_context_block(a));
  EXPECT_NE(kv.find_new_context_block(other), kv.find_new_context_block(a));

  kv.add_sequence(1, 13, 1, &a);
  EXPECT_EQ(kv.find_new_context_block(twin), reference_key(prompt, 1, 4));  // not stored yet
  kv.store_context_blocks(a);                                               // 3 full blocks
  EXPECT_EQ(kv.find_new_context_block(twin), std::nullopt);
  LlmRequest shorter = make_request(5, head(prompt, 9));
  EXPECT_EQ(kv.find_new_context_block(shorter), std::nullopt);
  LlmRequest longer = make_request(6, join(prompt, {1, 2, 3, 4}));
  EXPECT_EQ(kv.find_new_context_block(longer), reference_key(longer.tokens(), 4, 4));

  // A block size that is not a multiple of the hash's four lanes.
  KVCacheManager odd(8, 5, 64, true);
  LlmRequest c = make_request(7, iota_tokens(11, 40));
  EXPECT_EQ(odd.find_new_context_block(c), reference_key(c.tokens(), 1, 5));
  odd.add_sequence(7, 11, 1, &c);
  odd.store_context_blocks(c);
  LlmRequest d = make_request(8, join(c.tokens(), iota_tokens(5)));
  EXPECT_EQ(odd.find_new_context_block(d), reference_key(d.tokens(), 3, 5));
  odd.check_integrity();
}

// ----------------------------------------------------------------------------------------------
// Block tables.

TEST(KVCacheManager, CopyBlockTablesWritesRowsAndPadsWithZero) {
  KVCacheManager kv(10, 4, 20);
  kv.add_sequence(1, 9, 1);   // 0, 1, 2
  kv.add_sequence(2, 1, 1);   // 3
  kv.add_sequence(3, 20, 1);  // 4..8
  std::vector<BlockIdType> out(4 * 5, -7);
  kv.copy_block_tables({2, 3, 1}, out.data(), 4, 5);
  EXPECT_EQ(out, (std::vector<BlockIdType>{3,  0,  0,  0,  0,  //
                                           4,  5,  6,  7,  8,  //
                                           0,  1,  2,  0,  0,  //
                                           -7, -7, -7, -7, -7}));
  kv.copy_block_tables({}, nullptr, 0, 5);
}

TEST(KVCacheManager, CopyBlockTablesRejectsBadShapes) {
  KVCacheManager kv(10, 4, 20);
  kv.add_sequence(1, 9, 1);
  std::vector<BlockIdType> out(8, 0);
  expect_error<std::invalid_argument>([&] { kv.copy_block_tables({1, 1, 1}, out.data(), 2, 4); },
                                      "num_rows must be >= request_ids.size() 3, got 2");
  expect_error<std::invalid_argument>([&] { kv.copy_block_tables({1}, out.data(), 4, 2); },
                                      "request_id 1 holds 3 blocks, more than row_stride 2");
  expect_error<std::invalid_argument>([&] { kv.copy_block_tables({5}, out.data(), 2, 4); },
                                      "copy_block_tables: request_id 5 is not in the KV cache manager");
  expect_error<std::invalid_argument>([&] { kv.copy_block_tables({1}, nullptr, 2, 4); }, "out must not be null");
  expect_error<std::invalid_argument>([&] { kv.copy_block_tables({1}, out.data(), 2, -1); },
                                      "row_stride must be >= 0, got -1");
}

// ----------------------------------------------------------------------------------------------
// Sliding window (attention_window W): blocks no query can see any more are released; their
// entries stay as -1 (docs/batch-manager.md §3.11).

constexpr SizeType32 kOffloadMin = kDefaultSecondaryOffloadMinPriority;  // (no secondary level here)

TEST(KVCacheManagerWindow, ConstructionAndErrors) {
  KVCacheManager kv(8, 2, 32, true, 0, kOffloadMin, 3);
  EXPECT_EQ(kv.attention_window(), 3);
  EXPECT_EQ(KVCacheManager(8, 2, 32).attention_window(), 0);
  expect_error<std::invalid_argument>([] { KVCacheManager bad(4, 2, 16, false, 0, kOffloadMin, -1); },
                                      "attention_window must be >= 0 (0: no window), got -1");
  expect_error<std::invalid_argument>(
      [] { KVCacheManager bad(4, 2, 16, false, 2, kOffloadMin, 4); },
      "attention_window 4 with num_secondary_blocks 2: a sliding-window manager has no secondary level");
  kv.add_sequence(1, 9, 1);
  expect_error<std::invalid_argument>(
      [&] { kv.slide_window(1, 10); },
      "slide_window: first_query_pos must be in [0, 9] (the tokens of request_id 1), got 10");
  expect_error<std::invalid_argument>([&] { kv.slide_window(1, -1); }, "got -1");
  expect_error<std::invalid_argument>([&] { kv.slide_window(7, 0); },
                                      "slide_window: request_id 7 is not in the KV cache manager");
  LlmRequest other = make_request(2, iota_tokens(9));
  expect_error<std::invalid_argument>([&] { kv.slide_window(1, 9, &other); },
                                      "slide_window: request->request_id() 2 does not match request_id 1");
  expect_error<std::invalid_argument>(
      [&] { kv.suspend_sequence(1); },
      "suspend_sequence: a sliding-window manager (attention_window 3) has no secondary level");
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2, 3, 4}));  // nothing changed
  kv.check_integrity();
}

TEST(KVCacheManagerWindow, SlidesReleaseTheOldestBlocksAndKeepTheirEntries) {
  KVCacheManager kv(8, 4, 64, false, 0, kOffloadMin, 6);
  kv.add_sequence(1, 10, 1);  // blocks 0, 1, 2; no hit: the first query (0) sees everything
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2}));
  kv.slide_window(1, 9);  // the query at 9 sees tokens 4..9: block 0 (tokens 0..3) is dead
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, 1, 2}));
  EXPECT_EQ(kv.get_num_held_blocks(1), 2);
  EXPECT_EQ(kv.num_free_blocks(), 6);
  kv.slide_window(1, 8);   // never back
  kv.slide_window(1, 10);  // (10 - 5) / 4 = 1: no change
  kv.add_token(1);         // slides at 10 first (no change); token 11 lands in block 2
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, 1, 2}));
  kv.add_tokens(1, 2);  // slides at 11 (no change), tokens 12..13: block 3
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, 1, 2, 3}));
  kv.add_token(1);  // slides at 13: (13 - 5) / 4 = 2, block 1 (tokens 4..7) released
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, -1, 2, 3}));
  EXPECT_EQ(kv.get_num_tokens(1), 14);
  EXPECT_EQ(kv.get_num_held_blocks(1), 2);
  EXPECT_EQ(kv.num_free_blocks(), 6);
  std::array<BlockIdType, 6> row{};
  row.fill(9);
  kv.copy_block_tables({1}, row.data(), 1, 6);
  EXPECT_EQ(row, (std::array<BlockIdType, 6>{0, 0, 2, 3, 0, 0}));  // released entries read as 0
  KvCacheStats const stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.used_num_blocks, 2);
  EXPECT_EQ(stats.alloc_total_blocks, 4);  // releasing allocates nothing
  kv.check_integrity();
  // Released in token order: the free queue is 4..7, then 0, then 1.
  kv.add_sequence(2, 8, 1);
  kv.add_sequence(3, 12, 1);
  kv.add_sequence(4, 1, 1);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{4, 5}));
  EXPECT_EQ(kv.get_block_ids(3), (Ids{6, 7, 0}));
  EXPECT_EQ(kv.get_block_ids(4), (Ids{1}));
  kv.remove_sequence(1);  // frees the two blocks it holds
  EXPECT_EQ(kv.num_free_blocks(), 2);
  kv.check_integrity();
}

TEST(KVCacheManagerWindow, AddTokenSlidesBeforeAllocatingSoASequenceOutrunsThePool) {
  KVCacheManager kv(2, 2, 64, false, 0, kOffloadMin, 2);
  kv.add_sequence(1, 4, 1);  // both blocks
  EXPECT_EQ(kv.num_free_blocks(), 0);
  kv.add_token(1);  // slides at 4: (4 - 1) / 2 = 1 (block 0 freed), then token 5 takes it
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, 1, 0}));
  kv.add_token(1);  // slides at 5: block 1 released; token 6 fits block 0
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, -1, 0}));
  kv.add_token(1);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, -1, 0, 1}));
  while (kv.get_num_tokens(1) < 64) {
    kv.add_token(1);
    kv.check_integrity();
  }
  Ids const ids = kv.get_block_ids(1);
  ASSERT_EQ(ids.size(), 32U);  // more entries than the pool has blocks
  EXPECT_EQ(std::count(ids.begin(), ids.end(), -1), 31);
  EXPECT_EQ(ids.back(), 1);
  EXPECT_EQ(kv.get_num_held_blocks(1), 1);
  EXPECT_EQ(kv.get_kv_cache_stats().alloc_total_blocks, 32);
  // The window bounds a rewind: 64 - (31 * 2 + 2 - 1) = 1 token at most.
  kv.rewind(1, 1);
  EXPECT_EQ(kv.get_block_ids(1).size(), 32U);
  expect_error<std::invalid_argument>([&] { kv.rewind(1, 1); }, "n must be in [0, 0]");
  kv.check_integrity();
}

TEST(KVCacheManagerWindow, APrefixLongerThanTheWindowIsReusedFromTheSlides) {
  KVCacheManager kv(12, 2, 64, true, 0, kOffloadMin, 3);
  LlmRequest a = make_request(1, iota_tokens(10));
  kv.add_sequence(1, 10, 1, &a);  // blocks 0..4
  finish_context(a);
  kv.slide_window(1, 10, &a);  // (10 - 2) / 2 = 4 dead: tokens 0..7 stored, then released
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, -1, -1, -1, 4}));
  EXPECT_EQ(kv.get_kv_cache_stats().reusable_num_blocks, 4);
  EXPECT_EQ(kv.num_free_blocks(), 11);

  // The same 10 tokens and two more: 5 blocks looked up, the 4 stored by the slide hit (block 4
  // was never stored: its tokens 8, 9 were still visible).
  LlmRequest b = make_request(2, join(iota_tokens(10), {100, 101}));
  EXPECT_EQ(kv.count_reusable_blocks(b), 4);
  kv.add_sequence(2, 12, 1, &b);  // hits 0..3, new 5 and 6; then slides at 8: 0..2 released again
  EXPECT_EQ(kv.get_block_ids(2), (Ids{-1, -1, -1, 3, 5, 6}));
  EXPECT_EQ(b.prepopulated_prompt_len(), 8);
  EXPECT_EQ(kv.get_num_held_blocks(2), 3);
  KvCacheStats stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.reused_blocks, 4);
  EXPECT_EQ(stats.missed_blocks, 7);
  EXPECT_EQ(stats.reusable_num_blocks, 3);
  EXPECT_EQ(kv.num_free_blocks(), 8);
  finish_context(b);

  // Capped at 2 hits (another manager holds only those): the query at 4 cannot see block 0.
  LlmRequest c = make_request(3, join(iota_tokens(10), {100, 101}));
  EXPECT_EQ(kv.count_reusable_blocks(c), 4);
  kv.add_sequence(3, 12, 1, &c, 2);
  EXPECT_EQ(kv.get_block_ids(3), (Ids{-1, 1, 7, 8, 9, 10}));
  EXPECT_EQ(c.prepopulated_prompt_len(), 4);
  kv.check_integrity();

  // Storing walks through the released entries whose prefix is cached: a's block 4 (tokens 8, 9)
  // is keyed under block 3, then b's block 6 (100, 101) under it; c's blocks duplicate them.
  kv.remove_sequence(1, &a);
  EXPECT_EQ(kv.get_kv_cache_stats().reusable_num_blocks, 3);  // 0, 2, 4
  kv.remove_sequence(2, &b);
  kv.remove_sequence(3, &c);  // still in context: stores up to its position 4 (cached already)
  EXPECT_EQ(kv.num_free_blocks(), 12);
  EXPECT_EQ(kv.get_kv_cache_stats().reusable_num_blocks, 6);
  LlmRequest d = make_request(4, join(iota_tokens(10), {100, 101, 7}));
  EXPECT_EQ(kv.count_reusable_blocks(d), 6);
  kv.add_sequence(4, 13, 1, &d);  // 6 hits; the query at 12 sees tokens 10..12
  EXPECT_EQ(kv.get_block_ids(4), (Ids{-1, -1, -1, -1, -1, 6, 11}));
  EXPECT_EQ(d.prepopulated_prompt_len(), 12);
  kv.check_integrity();
}

TEST(KVCacheManagerWindow, StoringStopsAtAReleasedBlockWhosePrefixIsNotCached) {
  KVCacheManager kv(8, 2, 64, true, 0, kOffloadMin, 1);
  LlmRequest a = make_request(1, iota_tokens(6));
  kv.add_sequence(1, 6, 1, &a);
  finish_context(a);
  kv.slide_window(1, 6);  // without a request: blocks 0..2 released unstored
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, -1, -1}));
  EXPECT_EQ(kv.get_num_held_blocks(1), 0);
  a.add_new_token(6);
  kv.add_tokens(1, 2);  // block 3 for tokens 6, 7
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, -1, -1, 3}));
  a.add_new_token(7);
  kv.remove_sequence(1, &a);  // the prefix of block 3 is gone: nothing can be keyed
  EXPECT_EQ(kv.get_kv_cache_stats().reusable_num_blocks, 0);
  EXPECT_EQ(kv.num_free_blocks(), 8);
  kv.check_integrity();
}

TEST(KVCacheManagerWindow, ForkSharesOnlyTheHeldBlocksAndCopiesOnWrite) {
  KVCacheManager kv(8, 2, 64, false, 0, kOffloadMin, 3);
  kv.add_sequence(1, 5, 1);  // blocks 0, 1, 2
  kv.slide_window(1, 5);     // (5 - 2) / 2 = 1
  kv.fork_sequence(1, 2);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{-1, 1, 2}));
  EXPECT_EQ(kv.num_free_blocks(), 6);
  kv.add_token(2);  // lands in block 2, shared: copied into block 3
  EXPECT_EQ(kv.get_block_ids(2), (Ids{-1, 1, 3}));
  using Copies = std::vector<std::pair<BlockIdType, BlockIdType>>;
  EXPECT_EQ(kv.take_block_copies(), (Copies{{2, 3}}));
  kv.add_token(2);  // slides at 6: 2's reference to block 1 goes (1 still holds it); block 4
  EXPECT_EQ(kv.get_block_ids(2), (Ids{-1, -1, 3, 4}));
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, 1, 2}));
  EXPECT_EQ(kv.num_free_blocks(), 4);
  kv.check_integrity();
  kv.start_scheduling();
  kv.scheduling_remove_sequence(1);  // blocks 1 and 2 are 1's alone now
  EXPECT_EQ(kv.scheduling_num_free_blocks(), 6);
  kv.remove_sequence(1);
  EXPECT_EQ(kv.num_free_blocks(), 6);
  EXPECT_EQ(kv.get_num_held_blocks(2), 2);
  kv.check_integrity();
}

TEST(KVCacheManagerWindow, RewindCannotMoveTheWindowBackOverReleasedBlocks) {
  KVCacheManager kv(8, 2, 64, false, 0, kOffloadMin, 3);
  kv.add_sequence(1, 9, 1);  // blocks 0..4
  kv.slide_window(1, 9);     // (9 - 2) / 2 = 3 released
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, -1, -1, 3, 4}));
  // The query at the new end must still see W tokens: 9 - (3 * 2 + 3 - 1) = 1 at most.
  expect_error<std::invalid_argument>(
      [&] { kv.rewind(1, 2); }, "rewind: n must be in [0, 1] (request_id 1 released 3 blocks to its window 3), got 2");
  kv.rewind(1, 1);  // 8 tokens: block 4 released
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, -1, -1, 3}));
  EXPECT_EQ(kv.num_free_blocks(), 7);
  expect_error<std::invalid_argument>([&] { kv.rewind(1, 1); }, "n must be in [0, 0]");
  kv.rewind(1, 0);
  kv.add_tokens(1, 3);  // a step with two drafts: blocks 5, 6
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, -1, -1, 3, 5, 6}));
  kv.rewind(1, 3);  // the drafts rejected
  EXPECT_EQ(kv.get_block_ids(1), (Ids{-1, -1, -1, 3}));
  EXPECT_EQ(kv.get_num_tokens(1), 8);
  EXPECT_EQ(kv.num_free_blocks(), 7);
  kv.check_integrity();
}

// ----------------------------------------------------------------------------------------------
// Randomized traces.

// Reference model of the free queue without reuse: one FIFO per priority, allocation from the
// lowest non-empty one. Asserts the exact block ids of every allocation.
TEST(KVCacheManagerStress, RandomTraceMatchesFreeQueueModel) {
  constexpr SizeType32 kNumBlocks = 17;
  constexpr SizeType32 kTpb = 3;
  constexpr SizeType32 kMaxSeqLen = 25;
  KVCacheManager kv(kNumBlocks, kTpb, kMaxSeqLen);
  std::mt19937 rng(20241130);
  std::array<std::deque<BlockIdType>, kMaxRetentionPriority + 1> lists;
  std::vector<SizeType32> block_priority(kNumBlocks, kDefaultRetentionPriority);
  for (BlockIdType b = 0; b < kNumBlocks; ++b) {
    lists[kDefaultRetentionPriority].push_back(b);
  }
  struct ModelSeq {
    Ids blocks;
    SizeType32 num_tokens;
    SizeType32 priority;
  };
  std::map<RequestIdType, ModelSeq> model;
  auto model_free = [&] {
    std::size_t n = 0;
    for (auto const& list : lists) {
      n += list.size();
    }
    return static_cast<SizeType32>(n);
  };
  auto model_allocate = [&](SizeType32 priority) {
    for (auto& list : lists) {
      if (!list.empty()) {
        BlockIdType const b = list.front();
        list.pop_front();
        block_priority[static_cast<std::size_t>(b)] = priority;
        return b;
      }
    }
    throw std::logic_error("model out of blocks");
  };
  std::array<SizeType32, 5> const priorities = {0, 10, 35, 80, 100};
  RequestIdType next_id = 1;
  for (int op = 0; op < 2000; ++op) {
    int const choice = static_cast<int>(rng() % 100);
    if (choice < 35 || model.empty()) {
      RequestIdType const id = next_id++;
      SizeType32 const len = 1 + static_cast<SizeType32>(rng() % kMaxSeqLen);
      bool const with_request = rng() % 4 != 0;
      SizeType32 const priority = with_request ? priorities[rng() % priorities.size()] : kDefaultRetentionPriority;
      LlmRequest request = make_request(id, Tokens(static_cast<std::size_t>(len), 1), priority);
      SizeType32 const needed = (len + kTpb - 1) / kTpb;
      if (needed > model_free()) {
        expect_error<std::runtime_error>([&] { kv.add_sequence(id, len, 1, with_request ? &request : nullptr); },
                                         "need " + std::to_string(needed));
      } else {
        kv.add_sequence(id, len, 1, with_request ? &request : nullptr);
        ModelSeq seq{{}, len, priority};
        for (SizeType32 i = 0; i < needed; ++i) {
          seq.blocks.push_back(model_allocate(priority));
        }
        model.emplace(id, seq);
      }
    } else if (choice < 75) {
      auto it = std::next(model.begin(), static_cast<std::ptrdiff_t>(rng() % model.size()));
      ModelSeq& seq = it->second;
      if (seq.num_tokens == kMaxSeqLen) {
        expect_error<std::invalid_argument>([&] { kv.add_token(it->first); }, "max_seq_len is 25");
      } else if (seq.num_tokens % kTpb == 0 && model_free() == 0) {
        expect_error<std::runtime_error>([&] { kv.add_token(it->first); }, "free 0");
      } else {
        kv.add_token(it->first);
        if (seq.num_tokens % kTpb == 0) {
          seq.blocks.push_back(model_allocate(seq.priority));
        }
        ++seq.num_tokens;
      }
    } else {
      auto it = std::next(model.begin(), static_cast<std::ptrdiff_t>(rng() % model.size()));
      kv.remove_sequence(it->first);
      for (auto b = it->second.blocks.rbegin(); b != it->second.blocks.rend(); ++b) {
        lists[static_cast<std::size_t>(block_priority[static_cast<std::size_t>(*b)])].push_back(*b);
      }
      model.erase(it);
    }
    kv.check_integrity();
    ASSERT_EQ(kv.num_free_blocks(), model_free()) << "op " << op;
    ASSERT_EQ(kv.num_sequences(), static_cast<SizeType32>(model.size()));
    for (auto const& [id, seq] : model) {
      ASSERT_EQ(kv.get_block_ids(id), seq.blocks) << "op " << op << " request_id " << id;
      ASSERT_EQ(kv.get_num_tokens(id), seq.num_tokens);
    }
  }
}

// With reuse: every operation keeps the invariants, the free count matches an independent count,
// and every prefix hit returns blocks whose recorded contents equal the request's prefix.
TEST(KVCacheManagerStress, RandomTraceWithReuseKeepsInvariants) {
  constexpr SizeType32 kNumBlocks = 23;
  constexpr SizeType32 kTpb = 3;
  constexpr SizeType32 kMaxSeqLen = 40;
  KVCacheManager kv(kNumBlocks, kTpb, kMaxSeqLen, true);
  std::mt19937 rng(7);
  std::vector<Tokens> bases(3);
  for (Tokens& base : bases) {
    for (int i = 0; i < kMaxSeqLen; ++i) {
      base.push_back(static_cast<TokenIdType>(rng() % 4));
    }
  }
  // Who wrote each block: (request, block index); nullopt when written without a request.
  struct Origin {
    RequestIdType owner;
    std::size_t index;
  };
  std::vector<std::optional<Origin>> origin(kNumBlocks);
  std::map<RequestIdType, std::unique_ptr<LlmRequest>> requests;  // every request ever, kept for origins
  std::vector<RequestIdType> live;
  std::array<SizeType32, 3> const priorities = {10, 35, 80};
  RequestIdType next_id = 1;
  int hits = 0;

  auto holders = [&] {
    std::vector<int> count(kNumBlocks, 0);
    for (RequestIdType id : live) {
      for (BlockIdType b : kv.get_block_ids(id)) {
        ++count[static_cast<std::size_t>(b)];
      }
    }
    return count;
  };
  auto request_of = [&](RequestIdType id) -> LlmRequest* {
    auto it = requests.find(id);
    return it == requests.end() ? nullptr : it->second.get();
  };

  for (int op = 0; op < 2000; ++op) {
    int const choice = static_cast<int>(rng() % 100);
    if (choice < 30 || live.empty()) {
      RequestIdType const id = next_id++;
      SizeType32 const len = 1 + static_cast<SizeType32>(rng() % 30);
      Tokens tokens = head(bases[rng() % bases.size()], len);
      if (rng() % 3 == 0) {
        tokens[rng() % tokens.size()] = static_cast<TokenIdType>(rng() % 4);
      }
      bool const with_request = rng() % 5 != 0;
      auto request = std::make_unique<LlmRequest>(id, 8, tokens, 0.5F, 1, priorities[rng() % priorities.size()]);
      KvCacheStats const before = kv.get_kv_cache_stats();
      try {
        kv.add_sequence(id, len, 1, with_request ? request.get() : nullptr);
      } catch (std::runtime_error const&) {
        EXPECT_FALSE(kv.has_sequence(id));
        EXPECT_EQ(request->prepopulated_prompt_len(), 0);
        expect_same_stats(kv.get_kv_cache_stats(), before);
        kv.check_integrity();
        continue;
      }
      Ids const& ids = kv.get_block_ids(id);
      ASSERT_EQ(ids.size(), static_cast<std::size_t>((len + kTpb - 1) / kTpb));
      auto const k = static_cast<std::size_t>(request->prepopulated_prompt_len() / kTpb);
      ASSERT_EQ(request->prepopulated_prompt_len() % kTpb, 0);
      ASSERT_LT(request->prepopulated_prompt_len(), len);
      hits += static_cast<int>(k);
      for (std::size_t i = 0; i < ids.size(); ++i) {
        std::optional<Origin>& o = origin[static_cast<std::size_t>(ids[i])];
        if (i < k) {
          ASSERT_TRUE(o.has_value()) << "op " << op << ": hit on block " << ids[i] << " written without a request";
          ASSERT_EQ(o->index, i);
          Tokens const& written = requests.at(o->owner)->tokens();
          auto const end = static_cast<std::ptrdiff_t>((i + 1) * kTpb);
          ASSERT_TRUE(std::equal(written.begin(), written.begin() + end, tokens.begin()))
              << "op " << op << ": block " << ids[i] << " hit with different contents";
        } else {
          o = with_request ? std::optional<Origin>(Origin{id, i}) : std::nullopt;
        }
      }
      live.push_back(id);
      if (with_request) {
        requests.emplace(id, std::move(request));
      }
    } else if (choice < 60) {
      RequestIdType const id = live[rng() % live.size()];
      LlmRequest* request = request_of(id);
      if (request != nullptr && request->is_context_init_state()) {
        request->set_context_chunk_size(1 + static_cast<SizeType32>(rng() % 8));
        request->move_to_next_context_chunk();
        if (request->context_remaining_length() == 0) {
          request->set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
          if (rng() % 2 == 0) {
            kv.store_context_blocks(*request);
          }
        }
      } else {
        SizeType32 const num_tokens = kv.get_num_tokens(id);
        std::size_t const num_blocks = kv.get_block_ids(id).size();
        if (request != nullptr) {
          request->add_new_token(static_cast<TokenIdType>(rng() % 4));
        }
        try {
          kv.add_token(id);
          if (kv.get_block_ids(id).size() > num_blocks) {
            origin[static_cast<std::size_t>(kv.get_block_ids(id).back())] =
                request != nullptr ? std::optional<Origin>(Origin{id, num_blocks}) : std::nullopt;
          }
        } catch (std::exception const&) {
          if (request != nullptr) {
            request->remove_last_tokens(1);
          }
          ASSERT_EQ(kv.get_num_tokens(id), num_tokens);
          ASSERT_EQ(kv.get_block_ids(id).size(), num_blocks);
        }
      }
    } else if (choice < 80) {
      std::size_t const index = rng() % live.size();
      RequestIdType const id = live[index];
      bool const with_request = rng() % 5 != 0;
      kv.remove_sequence(id, with_request ? request_of(id) : nullptr);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(index));
    } else if (choice < 92) {
      kv.start_scheduling();
      ASSERT_EQ(kv.scheduling_num_free_blocks(), kv.num_free_blocks());
      std::vector<int> const count = holders();
      SizeType32 expected = kv.num_free_blocks();
      for (RequestIdType id : live) {
        if (rng() % 3 == 0) {
          kv.scheduling_remove_sequence(id);
          for (BlockIdType b : kv.get_block_ids(id)) {
            expected += count[static_cast<std::size_t>(b)] == 1 ? 1 : 0;
          }
        }
        if (LlmRequest const* request = request_of(id)) {
          ASSERT_GE(kv.get_needed_blocks_one_step(*request, rng() % 2 == 0), 0);
          ASSERT_GE(kv.get_remaining_blocks_to_completion(*request), 0);
          (void)kv.find_new_context_block(*request);
        }
      }
      ASSERT_EQ(kv.scheduling_num_free_blocks(), expected);
    } else {
      auto const stride = static_cast<std::int64_t>(kv.max_blocks_per_seq());
      std::vector<BlockIdType> table(live.size() * static_cast<std::size_t>(stride), -1);
      std::vector<RequestIdType> const ids(live.begin(), live.end());
      kv.copy_block_tables(ids, table.data(), static_cast<std::int64_t>(ids.size()), stride);
      for (std::size_t row = 0; row < ids.size(); ++row) {
        Ids const& blocks = kv.get_block_ids(ids[row]);
        for (std::size_t col = 0; col < static_cast<std::size_t>(stride); ++col) {
          BlockIdType const want = col < blocks.size() ? blocks[col] : 0;
          ASSERT_EQ(table[row * static_cast<std::size_t>(stride) + col], want);
        }
      }
    }
    kv.check_integrity();
    std::vector<int> const count = holders();
    auto const held = static_cast<SizeType32>(std::count_if(count.begin(), count.end(), [](int c) { return c > 0; }));
    ASSERT_EQ(kv.num_free_blocks(), kNumBlocks - held) << "op " << op;
    KvCacheStats const stats = kv.get_kv_cache_stats();
    ASSERT_EQ(stats.free_num_blocks, kNumBlocks - held);
    ASSERT_EQ(stats.used_num_blocks, held);
  }
  // The trace must actually exercise reuse.
  EXPECT_GT(hits, 50);
  EXPECT_GT(kv.get_kv_cache_stats().reused_blocks, 50);
}

}  // namespace
}  // namespace inflight::batch_manager
