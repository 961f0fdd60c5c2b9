// KVCacheManager with a secondary level: block ids and levels, offload on eviction and onboard on a
// prefix hit (exact ids and transfers), the secondary pool's eviction order (retention priority,
// then oldest), suspend / resume (swap), statistics, errors, and a randomized trace that replays the
// transfers on a model of the block contents and checks every live block holds what it should.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "inflight/batch_manager/kv_cache_manager.h"

namespace inflight::batch_manager {
namespace {

using Ids = std::vector<BlockIdType>;
using Tokens = std::vector<TokenIdType>;
using Transfers = std::vector<KvBlockTransfer>;

constexpr KvTransferKind kOff = KvTransferKind::kOFFLOAD;
constexpr KvTransferKind kOn = KvTransferKind::kONBOARD;

LlmRequest make_request(RequestIdType id, Tokens tokens, SizeType32 kv_retention_priority = kDefaultRetentionPriority) {
  return LlmRequest(id, 8, std::move(tokens), 0.5F, 1, kv_retention_priority);
}

void finish_context(LlmRequest& request) {
  request.set_context_chunk_size(request.context_remaining_length());
  request.move_to_next_context_chunk();
  request.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
}

// Adds the request's sequence, runs its context and stores its prompt blocks.
void add_and_store(KVCacheManager& kv, LlmRequest& request) {
  kv.add_sequence(request.request_id(), request.prompt_len(), 1, &request);
  finish_context(request);
  kv.store_context_blocks(request);
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

bool cached(KVCacheManager const& kv, Tokens tokens) {
  tokens.push_back(99);  // the last prompt token is never looked up
  LlmRequest const probe = make_request(999, tokens);
  return !kv.find_new_context_block(probe).has_value();
}

// ----------------------------------------------------------------------------------------------

TEST(KVCacheSecondary, LevelsAndConstruction) {
  KVCacheManager kv(4, 2, 16, true, 3);
  EXPECT_EQ(kv.max_num_blocks(), 4);
  EXPECT_EQ(kv.num_free_blocks(), 4);
  EXPECT_EQ(kv.num_secondary_blocks(), 3);
  EXPECT_EQ(kv.num_free_secondary_blocks(), 3);
  EXPECT_EQ(kv.num_used_secondary_blocks(), 0);
  EXPECT_EQ(kv.secondary_offload_min_priority(), kDefaultSecondaryOffloadMinPriority);
  EXPECT_EQ(kv.get_block_level(0), kPrimaryLevel);
  EXPECT_EQ(kv.get_block_level(3), kPrimaryLevel);
  EXPECT_EQ(kv.get_block_level(4), kSecondaryLevel);
  EXPECT_EQ(kv.get_block_level(6), kSecondaryLevel);
  expect_error<std::invalid_argument>([&] { (void)kv.get_block_level(7); }, "block_id must be in [0, 6]");
  expect_error<std::invalid_argument>([&] { (void)kv.get_block_level(-1); }, "got -1");
  KvCacheStats const stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.max_num_blocks, 4);
  EXPECT_EQ(stats.free_num_blocks, 4);
  EXPECT_EQ(stats.max_num_secondary_blocks, 3);
  EXPECT_EQ(stats.free_num_secondary_blocks, 3);
  EXPECT_EQ(stats.used_num_secondary_blocks, 0);
  EXPECT_EQ(stats.offloaded_blocks, 0);
  EXPECT_EQ(stats.secondary_hit_rate, 0.0);
  kv.check_integrity();

  expect_error<std::invalid_argument>([] { KVCacheManager bad(4, 2, 16, true, -1); },
                                      "num_secondary_blocks must be in [0, ");
  expect_error<std::invalid_argument>([] { KVCacheManager bad(4, 2, 16, true, 2, 101); },
                                      "secondary_offload_min_priority must be in [0, 100], got 101");
  expect_error<std::invalid_argument>([] { KVCacheManager bad(4, 2, 16, true, 2, -1); }, "got -1");
}

TEST(KVCacheSecondary, WithoutASecondaryLevelEvictionDropsKeysAndQueuesNothing) {
  KVCacheManager kv(3, 2, 16, true);
  LlmRequest a = make_request(1, {1, 2, 3, 4, 5});
  add_and_store(kv, a);
  kv.remove_sequence(1, &a);
  kv.add_sequence(2, 6, 1);  // takes all three blocks, both keys dropped
  EXPECT_TRUE(kv.take_transfers().empty());
  EXPECT_FALSE(cached(kv, {1, 2}));
  EXPECT_EQ(kv.get_kv_cache_stats().offloaded_blocks, 0);
  kv.check_integrity();
}

TEST(KVCacheSecondary, EvictedCachedBlocksAreOffloadedAndHitsOnboardThem) {
  // Primary 0..3, secondary 4..5, tpb 2.
  KVCacheManager kv(4, 2, 16, true, 2);
  LlmRequest a = make_request(1, {1, 2, 3, 4, 5});  // keys [1,2] -> 0, [1..4] -> 1
  add_and_store(kv, a);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2}));
  kv.remove_sequence(1, &a);  // primary queue: 3 2 1 0
  EXPECT_EQ(kv.get_kv_cache_stats().reusable_num_blocks, 2);

  // B takes 3, 2 (plain), then 1 ([1..4]) and 0 ([1,2]): both offloaded, child first.
  kv.add_sequence(2, 7, 1);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{3, 2, 1, 0}));
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOff, 1, 4}, {kOff, 0, 5}}));
  EXPECT_TRUE(kv.take_transfers().empty());  // taken once
  KvCacheStats stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.offloaded_blocks, 2);
  EXPECT_EQ(stats.reusable_num_blocks, 0);
  EXPECT_EQ(stats.reusable_num_secondary_blocks, 2);
  EXPECT_EQ(stats.free_num_secondary_blocks, 2);  // cached in secondary, still free
  EXPECT_EQ(stats.used_num_secondary_blocks, 0);
  EXPECT_TRUE(cached(kv, {1, 2, 3, 4}));
  kv.check_integrity();
  kv.remove_sequence(2);  // primary queue: 0 1 2 3

  // C hits both secondary blocks: each onboarded into a fresh primary block (0, then 1).
  LlmRequest c = make_request(3, {1, 2, 3, 4, 7});
  kv.add_sequence(3, 5, 1, &c);
  EXPECT_EQ(kv.get_block_ids(3), (Ids{0, 1, 2}));
  EXPECT_EQ(c.prepopulated_prompt_len(), 4);
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOn, 5, 0}, {kOn, 4, 1}}));
  stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.onboarded_blocks, 2);
  EXPECT_EQ(stats.reused_blocks, 2);
  EXPECT_EQ(stats.secondary_reused_blocks, 2);
  // A: 3 missed, B: 4 missed, C: 2 reused + 1 missed.
  EXPECT_EQ(stats.missed_blocks, 8);
  EXPECT_DOUBLE_EQ(stats.cache_hit_rate, 0.2);
  EXPECT_DOUBLE_EQ(stats.secondary_hit_rate, 0.2);
  EXPECT_EQ(stats.alloc_total_blocks, 10);
  EXPECT_EQ(stats.alloc_new_blocks, 8);
  EXPECT_EQ(stats.reusable_num_secondary_blocks, 0);  // the keys moved back to primary
  EXPECT_TRUE(cached(kv, {1, 2, 3, 4}));
  kv.check_integrity();

  // The onboarded secondary blocks hold nothing: they are the first taken (5, then 4) by the next
  // offloads. C's stored blocks 1 then 0 are evicted by D's allocation after C is removed.
  kv.remove_sequence(3, &c);  // primary queue: 3 2 1 0
  kv.add_sequence(4, 8, 1);
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOff, 1, 5}, {kOff, 0, 4}}));
  kv.check_integrity();
}

TEST(KVCacheSecondary, OffloadNeedsTheMinimumRetentionPriority) {
  for (SizeType32 const min_priority : {30, 0}) {
    KVCacheManager kv(2, 2, 16, true, 2, min_priority);
    LlmRequest a = make_request(1, {1, 2, 3}, 10);  // stored at priority 10
    add_and_store(kv, a);
    kv.remove_sequence(1, &a);
    kv.add_sequence(2, 4, 1);
    Transfers const transfers = kv.take_transfers();
    if (min_priority == 30) {
      EXPECT_TRUE(transfers.empty());
      EXPECT_FALSE(cached(kv, {1, 2}));
    } else {
      EXPECT_EQ(transfers, (Transfers{{kOff, 0, 2}}));
      EXPECT_TRUE(cached(kv, {1, 2}));
    }
    kv.check_integrity();
  }
}

TEST(KVCacheSecondary, SecondaryPoolEvictsTheOldestOffloadFirst) {
  // Two primary blocks, two secondary (2, 3), tpb 2: each request caches one block.
  KVCacheManager kv(2, 2, 16, true, 2);
  for (TokenIdType t = 1; t <= 4; ++t) {
    LlmRequest r = make_request(t, {t, t, 0});
    add_and_store(kv, r);
    kv.remove_sequence(t, &r);
  }
  // Offloads: [1,1] -> 2 (by request 2), [2,2] -> 3 (by 3), [3,3] -> 2 (by 4, evicting [1,1]).
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOff, 0, 2}, {kOff, 1, 3}, {kOff, 0, 2}}));
  EXPECT_FALSE(cached(kv, {1, 1}));
  EXPECT_TRUE(cached(kv, {2, 2}));
  EXPECT_TRUE(cached(kv, {3, 3}));
  EXPECT_TRUE(cached(kv, {4, 4}));
  kv.check_integrity();
}

TEST(KVCacheSecondary, SecondaryPoolEvictsTheLowestRetentionPriorityFirst) {
  KVCacheManager kv(2, 2, 16, true, 2);
  // [1,1] at priority 80, [2,2] at 35, [3,3] at 50, [4,4] at 35.
  std::vector<SizeType32> const priorities = {80, 35, 50, 35};
  for (TokenIdType t = 1; t <= 4; ++t) {
    LlmRequest r = make_request(t, {t, t, 0}, priorities[static_cast<std::size_t>(t - 1)]);
    add_and_store(kv, r);
    kv.remove_sequence(t, &r);
  }
  // After request 3: secondary holds [1,1] (80) in 2 and [2,2] (35) in 3. Request 4 offloads
  // [3,3] (50): the victim is [2,2], the lowest priority, although [1,1] is older.
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOff, 0, 2}, {kOff, 1, 3}, {kOff, 0, 3}}));
  EXPECT_TRUE(cached(kv, {1, 1}));
  EXPECT_FALSE(cached(kv, {2, 2}));
  EXPECT_TRUE(cached(kv, {3, 3}));
  kv.check_integrity();
}

TEST(KVCacheSecondary, AnAncestorInSecondaryIsNotEvictedForItsOwnChild) {
  KVCacheManager kv(3, 2, 16, true, 1);             // secondary block 3
  LlmRequest a = make_request(1, {1, 2, 3, 4, 5});  // [1,2] -> 0, [1..4] -> 1
  add_and_store(kv, a);
  kv.remove_sequence(1, &a);  // queue: 2 1 0 (priority 35)
  // E hits [1,2] and stores it at priority 31; its new block 2 gets 31 too: list 31 = 2 0, list 35 = 1.
  LlmRequest e = make_request(2, {1, 2, 7}, 31);
  add_and_store(kv, e);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{0, 2}));
  kv.remove_sequence(2, &e);
  kv.add_sequence(3, 4, 1);  // takes 2, then 0 ([1,2]): offloaded to 3
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOff, 0, 3}}));
  // Taking 1 ([1..4]) would need secondary block 3, which holds its parent [1,2]: the child's key
  // is dropped instead, the parent stays cached.
  kv.add_sequence(4, 2, 1);
  EXPECT_EQ(kv.get_block_ids(4), (Ids{1}));
  EXPECT_TRUE(kv.take_transfers().empty());
  EXPECT_TRUE(cached(kv, {1, 2}));
  EXPECT_FALSE(cached(kv, {1, 2, 3, 4}));
  kv.check_integrity();
}

TEST(KVCacheSecondary, SuspendAndResumeMoveEveryPrivateBlock) {
  KVCacheManager kv(6, 2, 16, false, 4);  // secondary 6..9
  kv.add_sequence(1, 5, 1);
  kv.add_token(1);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2}));
  EXPECT_EQ(kv.get_needed_secondary_blocks_to_suspend(1), 3);
  EXPECT_EQ(kv.get_needed_blocks_to_resume(1), 0);

  kv.suspend_sequence(1);
  EXPECT_TRUE(kv.is_suspended(1));
  EXPECT_FALSE(kv.is_suspended(77));
  EXPECT_EQ(kv.num_suspended_sequences(), 1);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{6, 7, 8}));
  EXPECT_EQ(kv.get_num_tokens(1), 6);
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOff, 0, 6}, {kOff, 1, 7}, {kOff, 2, 8}}));
  EXPECT_EQ(kv.num_free_blocks(), 6);
  EXPECT_EQ(kv.num_free_secondary_blocks(), 1);
  EXPECT_EQ(kv.num_used_secondary_blocks(), 3);
  EXPECT_EQ(kv.get_needed_blocks_to_resume(1), 3);
  EXPECT_EQ(kv.get_needed_secondary_blocks_to_suspend(1), 0);
  kv.check_integrity();

  // A suspended sequence is frozen.
  expect_error<std::invalid_argument>([&] { kv.add_token(1); }, "add_token: request_id 1 is suspended");
  expect_error<std::invalid_argument>([&] { kv.add_tokens(1, 2); }, "add_tokens: request_id 1 is suspended");
  expect_error<std::invalid_argument>([&] { kv.rewind(1, 1); }, "rewind: request_id 1 is suspended");
  expect_error<std::invalid_argument>([&] { kv.fork_sequence(1, 5); }, "fork_sequence: request_id 1 is suspended");
  expect_error<std::invalid_argument>([&] { kv.suspend_sequence(1); }, "suspend_sequence: request_id 1 is suspended");
  expect_error<std::invalid_argument>([&] { kv.resume_sequence(2); }, "resume_sequence: request_id 2 is not in");
  std::vector<BlockIdType> table(4, -1);
  expect_error<std::invalid_argument>([&] { kv.copy_block_tables({1}, table.data(), 1, 4); },
                                      "copy_block_tables: request_id 1 is suspended");

  // The freed primary blocks went to the back, last first: 3 4 5 2 1 0.
  kv.add_sequence(2, 4, 1);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{3, 4}));
  kv.resume_sequence(1);
  EXPECT_FALSE(kv.is_suspended(1));
  EXPECT_EQ(kv.get_block_ids(1), (Ids{5, 2, 1}));
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOn, 6, 5}, {kOn, 7, 2}, {kOn, 8, 1}}));
  expect_error<std::invalid_argument>([&] { kv.resume_sequence(1); }, "resume_sequence: request_id 1 is not suspended");
  KvCacheStats const stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.offloaded_blocks, 3);
  EXPECT_EQ(stats.onboarded_blocks, 3);
  EXPECT_EQ(stats.secondary_reused_blocks, 0);
  EXPECT_EQ(stats.used_num_secondary_blocks, 0);
  kv.add_token(1);  // active again
  kv.check_integrity();

  // Released secondary blocks hold nothing: they come first (6 7 8), before the untouched 9.
  kv.suspend_sequence(1);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{6, 7, 8, 9}));
  kv.check_integrity();
}

TEST(KVCacheSecondary, SuspendAndResumeAreAllOrNothing) {
  KVCacheManager kv(4, 2, 16, false, 2);
  kv.add_sequence(1, 5, 1);  // 3 blocks, 2 secondary
  expect_error<std::runtime_error>(
      [&] { kv.suspend_sequence(1); },
      "suspend_sequence: not enough free secondary KV blocks for request_id 1: need 3, free 2");
  EXPECT_FALSE(kv.is_suspended(1));
  EXPECT_EQ(kv.get_block_ids(1), (Ids{0, 1, 2}));
  EXPECT_TRUE(kv.take_transfers().empty());
  kv.check_integrity();
  kv.remove_sequence(1);

  kv.add_sequence(2, 4, 1);  // [3, 2]
  kv.suspend_sequence(2);
  kv.add_sequence(3, 5, 1);  // takes 3 of the 4 free primary blocks
  kv.take_transfers();
  expect_error<std::runtime_error>([&] { kv.resume_sequence(2); },
                                   "resume_sequence: not enough free KV blocks for request_id 2: need 2, free 1");
  EXPECT_TRUE(kv.is_suspended(2));
  EXPECT_EQ(kv.get_block_ids(2), (Ids{4, 5}));
  EXPECT_TRUE(kv.take_transfers().empty());
  kv.check_integrity();
  // Removing a suspended sequence frees its secondary blocks.
  kv.remove_sequence(2);
  EXPECT_EQ(kv.num_free_secondary_blocks(), 2);
  EXPECT_EQ(kv.num_suspended_sequences(), 0);
  kv.check_integrity();
}

TEST(KVCacheSecondary, SharedBlocksStayInPrimaryAndKeysTravel) {
  KVCacheManager kv(8, 2, 16, true, 6);             // secondary 8..13
  LlmRequest a = make_request(1, {1, 2, 3, 4, 5});  // [1,2] -> 0, [1..4] -> 1
  add_and_store(kv, a);
  LlmRequest b = make_request(2, {1, 2, 3, 4, 6});
  kv.add_sequence(2, 5, 1, &b);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{0, 1, 3}));

  // Only B's private block moves; the prefix shared with A stays held in primary.
  EXPECT_EQ(kv.get_needed_secondary_blocks_to_suspend(2), 1);
  kv.suspend_sequence(2);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{0, 1, 8}));
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOff, 3, 8}}));
  EXPECT_EQ(kv.get_needed_blocks_to_resume(2), 1);
  kv.check_integrity();
  // A leaves: B (suspended) alone holds 0 and 1; scheduling counts them as freeable.
  kv.remove_sequence(1, &a);
  kv.start_scheduling();
  kv.scheduling_remove_sequence(2);
  EXPECT_EQ(kv.scheduling_num_free_blocks(), kv.num_free_blocks() + 2);
  // Primary queue: 4 5 6 7 3 2 (B's block 3 freed by the suspend, A's block 2 by its removal).
  kv.resume_sequence(2);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{0, 1, 4}));
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOn, 8, 4}}));

  // Suspended again, B's blocks are all private: the keys move with them to secondary (8, freed
  // by the resume and holding nothing, first; then 9 and 10).
  kv.suspend_sequence(2);
  EXPECT_EQ(kv.get_block_ids(2), (Ids{8, 9, 10}));
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOff, 0, 8}, {kOff, 1, 9}, {kOff, 4, 10}}));
  EXPECT_TRUE(cached(kv, {1, 2, 3, 4}));
  kv.check_integrity();

  // C hits the keys held by suspended B: the contents are copied to fresh primary blocks (queue:
  // 5 6 7 3 2 4 1 0), the keys move there, and B keeps its copies.
  LlmRequest c = make_request(3, {1, 2, 3, 4, 9});
  kv.add_sequence(3, 5, 1, &c);
  EXPECT_EQ(kv.get_block_ids(3), (Ids{5, 6, 7}));
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOn, 8, 5}, {kOn, 9, 6}}));
  EXPECT_EQ(kv.get_block_ids(2), (Ids{8, 9, 10}));
  EXPECT_EQ(kv.get_kv_cache_stats().secondary_reused_blocks, 2);
  kv.check_integrity();

  // Removing suspended B frees its secondary blocks (unkeyed: to the front of the queue).
  kv.remove_sequence(2);
  EXPECT_EQ(kv.num_free_secondary_blocks(), 6);
  EXPECT_EQ(kv.num_used_secondary_blocks(), 0);
  kv.check_integrity();
}

TEST(KVCacheSecondary, RemovingASuspendedSequenceStoresItsComputedBlocks) {
  KVCacheManager kv(4, 2, 16, true, 4);  // secondary 4..7
  LlmRequest a = make_request(1, {1, 2, 3, 4, 5});
  kv.add_sequence(1, 5, 1, &a);
  finish_context(a);  // computed, but not stored yet
  kv.suspend_sequence(1);
  EXPECT_EQ(kv.get_block_ids(1), (Ids{4, 5, 6}));
  kv.remove_sequence(1, &a);  // stores [1,2] -> 4, [1..4] -> 5, in secondary
  KvCacheStats const stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.reusable_num_secondary_blocks, 2);
  EXPECT_EQ(stats.free_num_secondary_blocks, 4);
  kv.take_transfers();
  LlmRequest b = make_request(2, {1, 2, 3, 4, 6});
  kv.add_sequence(2, 5, 1, &b);
  EXPECT_EQ(b.prepopulated_prompt_len(), 4);
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOn, 4, 3}, {kOn, 5, 2}}));
  kv.check_integrity();
}

// ----------------------------------------------------------------------------------------------
// Random trace: offload, onboard, suspend and resume against a model of the block contents. The
// engine's contract is replayed: after each call, the transfers are executed in order, then the
// copies; then blocks newly allocated for new contents are written. Every block a live sequence
// holds must then carry a prefix equal to that sequence's tokens.

TEST(KVCacheSecondaryStress, RandomTraceKeepsInvariantsAndContents) {
  constexpr SizeType32 kNumBlocks = 19;
  constexpr SizeType32 kNumSecondary = 11;
  constexpr SizeType32 kTpb = 3;
  constexpr SizeType32 kMaxSeqLen = 40;
  KVCacheManager kv(kNumBlocks, kTpb, kMaxSeqLen, true, kNumSecondary);
  std::mt19937 rng(11);
  std::vector<Tokens> bases(3);
  for (Tokens& base : bases) {
    for (int i = 0; i < kMaxSeqLen; ++i) base.push_back(static_cast<TokenIdType>(rng() % 4));
  }
  struct Origin {  // who wrote a block's contents: (request, block index); nullopt without a request
    RequestIdType owner;
    std::size_t index;
  };
  std::vector<std::optional<Origin>> memory(kNumBlocks + kNumSecondary);
  std::map<RequestIdType, std::unique_ptr<LlmRequest>> requests;
  std::vector<RequestIdType> live;
  std::array<SizeType32, 4> const priorities = {10, 35, 50, 80};
  RequestIdType next_id = 1;
  std::map<std::string, int> counts;

  auto request_of = [&](RequestIdType id) -> LlmRequest* {
    auto it = requests.find(id);
    return it == requests.end() ? nullptr : it->second.get();
  };
  auto execute = [&] {
    for (KvBlockTransfer const& t : kv.take_transfers()) {
      EXPECT_EQ(kv.get_block_level(t.src_block), t.kind == kOff ? kPrimaryLevel : kSecondaryLevel);
      EXPECT_EQ(kv.get_block_level(t.dst_block), t.kind == kOff ? kSecondaryLevel : kPrimaryLevel);
      memory[static_cast<std::size_t>(t.dst_block)] = memory[static_cast<std::size_t>(t.src_block)];
      ++counts[t.kind == kOff ? "offload" : "onboard"];
    }
    EXPECT_TRUE(kv.take_block_copies().empty());  // no forks in this trace
  };
  auto check_contents = [&](int op) {
    for (RequestIdType id : live) {
      LlmRequest const* request = request_of(id);
      if (request == nullptr) continue;
      Ids const& ids = kv.get_block_ids(id);
      SizeType32 const held = std::min(kv.get_num_tokens(id), request->num_tokens());
      for (std::size_t i = 0; i < ids.size(); ++i) {
        std::optional<Origin> const& o = memory[static_cast<std::size_t>(ids[i])];
        ASSERT_TRUE(o.has_value()) << "op " << op << ": block " << ids[i] << " of " << id << " has no contents";
        ASSERT_EQ(o->index, i) << "op " << op;
        auto const end = std::min<std::size_t>((i + 1) * kTpb, static_cast<std::size_t>(held));
        Tokens const& written = requests.at(o->owner)->tokens();
        ASSERT_LE(end, written.size());
        ASSERT_TRUE(
            std::equal(written.begin(), written.begin() + static_cast<std::ptrdiff_t>(end), request->tokens().begin()))
            << "op " << op << ": block " << ids[i] << " of request " << id << " holds other contents";
      }
    }
  };

  for (int op = 0; op < 3000; ++op) {
    int const choice = static_cast<int>(rng() % 100);
    if (choice < 28 || live.empty()) {
      RequestIdType const id = next_id++;
      SizeType32 const len = 1 + static_cast<SizeType32>(rng() % 30);
      Tokens const& base = bases[rng() % bases.size()];
      Tokens tokens(base.begin(), base.begin() + len);
      if (rng() % 3 == 0) tokens[rng() % tokens.size()] = static_cast<TokenIdType>(rng() % 4);
      auto request = std::make_unique<LlmRequest>(id, 8, tokens, 0.5F, 1, priorities[rng() % priorities.size()]);
      try {
        kv.add_sequence(id, len, 1, request.get());
      } catch (std::runtime_error const&) {
        EXPECT_TRUE(kv.take_transfers().empty());
        ++counts["add_failed"];
        kv.check_integrity();
        continue;
      }
      execute();
      auto const k = static_cast<std::size_t>(request->prepopulated_prompt_len() / kTpb);
      Ids const& ids = kv.get_block_ids(id);
      for (std::size_t i = k; i < ids.size(); ++i) memory[static_cast<std::size_t>(ids[i])] = Origin{id, i};
      requests.emplace(id, std::move(request));
      live.push_back(id);
    } else if (choice < 55) {
      RequestIdType const id = live[rng() % live.size()];
      LlmRequest* request = request_of(id);
      if (kv.is_suspended(id)) {
        try {
          kv.resume_sequence(id);
          ++counts["resume"];
        } catch (std::runtime_error const&) {
          ++counts["resume_failed"];
        }
        execute();
      } else if (request->is_context_init_state()) {
        request->set_context_chunk_size(1 + static_cast<SizeType32>(rng() % 8));
        request->move_to_next_context_chunk();
        if (request->context_remaining_length() == 0) {
          request->set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
          if (rng() % 2 == 0) kv.store_context_blocks(*request);
        }
      } else if (kv.get_num_tokens(id) < kMaxSeqLen) {
        std::size_t const num_blocks = kv.get_block_ids(id).size();
        request->add_new_token(static_cast<TokenIdType>(rng() % 4));
        try {
          kv.add_token(id);
          execute();
          if (kv.get_block_ids(id).size() > num_blocks) {
            memory[static_cast<std::size_t>(kv.get_block_ids(id).back())] = Origin{id, num_blocks};
          }
        } catch (std::runtime_error const&) {
          request->remove_last_tokens(1);
        }
      }
    } else if (choice < 70) {
      RequestIdType const id = live[rng() % live.size()];
      if (!kv.is_suspended(id)) {
        try {
          kv.suspend_sequence(id);
          ++counts["suspend"];
        } catch (std::runtime_error const&) {
          ++counts["suspend_failed"];
        }
        execute();
      }
    } else if (choice < 85) {
      std::size_t const index = rng() % live.size();
      RequestIdType const id = live[index];
      kv.remove_sequence(id, rng() % 5 != 0 ? request_of(id) : nullptr);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(index));
    } else {
      kv.start_scheduling();
      SizeType32 expected = kv.num_free_blocks();
      for (RequestIdType id : live) {
        if (rng() % 3 != 0) continue;
        kv.scheduling_remove_sequence(id);
        for (BlockIdType b : kv.get_block_ids(id)) {
          expected += kv.get_block_level(b) == kPrimaryLevel &&
                              std::count_if(live.begin(), live.end(),
                                            [&](RequestIdType other) {
                                              Ids const& o = kv.get_block_ids(other);
                                              return std::find(o.begin(), o.end(), b) != o.end();
                                            }) == 1
                          ? 1
                          : 0;
        }
      }
      ASSERT_EQ(kv.scheduling_num_free_blocks(), expected);
    }
    kv.check_integrity();
    ASSERT_NO_FATAL_FAILURE(check_contents(op));
    KvCacheStats const stats = kv.get_kv_cache_stats();
    ASSERT_EQ(stats.free_num_secondary_blocks + stats.used_num_secondary_blocks, kNumSecondary);
    SizeType32 suspended_secondary = 0;
    for (RequestIdType id : live) {
      for (BlockIdType b : kv.get_block_ids(id)) suspended_secondary += kv.get_block_level(b) == kSecondaryLevel;
    }
    ASSERT_EQ(stats.used_num_secondary_blocks, suspended_secondary) << "op " << op;
  }
  KvCacheStats const stats = kv.get_kv_cache_stats();
  // The trace must exercise every path.
  EXPECT_GT(stats.secondary_reused_blocks, 20);
  EXPECT_GT(counts["offload"], 100);
  EXPECT_GT(counts["onboard"], 100);
  EXPECT_GT(counts["suspend"], 50);
  EXPECT_GT(counts["resume"], 30);
  EXPECT_GT(counts["suspend_failed"] + counts["resume_failed"], 0);
  EXPECT_EQ(stats.offloaded_blocks, counts["offload"]);
  EXPECT_EQ(stats.onboarded_blocks, counts["onboard"]);
}

}  // namespace
}  // namespace inflight::batch_manager
