// KVCacheManager persistence: export_secondary_blocks lists the secondary level's reusable blocks
// (exact ids, parents, priorities, tokens, order), import_secondary_blocks adopts them into a fresh
// manager (the reuse tree rebuilt, a prefix hit onboards the adopted blocks, the export round-trips,
// the free queue is the exported one), and every malformed import is an error that changes nothing.
#include <gtest/gtest.h>

#include <random>
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

void add_and_store(KVCacheManager& kv, LlmRequest& request) {
  kv.add_sequence(request.request_id(), request.prompt_len(), 1, &request);
  request.set_context_chunk_size(request.context_remaining_length());
  request.move_to_next_context_chunk();
  request.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  kv.store_context_blocks(request);
}

template <typename F>
void expect_invalid(F&& f, std::string const& fragment) {
  try {
    f();
    ADD_FAILURE() << "expected std::invalid_argument mentioning \"" << fragment << "\"";
  } catch (std::invalid_argument const& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)
        << "message \"" << error.what() << "\" lacks \"" << fragment << "\"";
  }
}

// Primary 0..3, secondary 4..9, tpb 2. A's prefix [1..6] is cached (3 keyed blocks), then B evicts it
// into the secondary level: 4 <- [1..6], 5 <- [1..4], 6 <- [1,2] (leaf first).
void fill(KVCacheManager& kv) {
  LlmRequest a = make_request(1, {1, 2, 3, 4, 5, 6, 7});
  add_and_store(kv, a);
  kv.remove_sequence(1, &a);
  kv.add_sequence(2, 8, 1);
  ASSERT_EQ(kv.take_transfers(), (Transfers{{kOff, 2, 4}, {kOff, 1, 5}, {kOff, 0, 6}}));
  kv.remove_sequence(2);
}

TEST(KVCachePersist, ExportListsTheSecondaryPrefixesInFreeQueueOrder) {
  KVCacheManager kv(4, 2, 16, true, 6);
  fill(kv);
  KvSecondaryBlocks const blocks = kv.export_secondary_blocks();
  EXPECT_EQ(blocks.block_ids, (Ids{4, 5, 6}));
  EXPECT_EQ(blocks.parents, (Ids{5, 6, -1}));
  EXPECT_EQ(blocks.priorities, (std::vector<SizeType32>{35, 35, 35}));
  EXPECT_EQ(blocks.tokens, (Tokens{5, 6, 3, 4, 1, 2}));
  kv.check_integrity();

  // Without reuse or a secondary level there is nothing to list.
  EXPECT_EQ(KVCacheManager(4, 2, 16, false, 6).export_secondary_blocks().size(), 0U);
  EXPECT_EQ(KVCacheManager(4, 2, 16, true, 0).export_secondary_blocks().size(), 0U);
}

TEST(KVCachePersist, ABlockBelowAPrimaryAncestorIsLeftOut) {
  // Primary 0..3, secondary 4..5: only A's leaf [1..4] is evicted; its parent [1,2] stays primary.
  KVCacheManager kv(4, 2, 16, true, 2);
  LlmRequest a = make_request(1, {1, 2, 3, 4, 5});
  add_and_store(kv, a);
  kv.remove_sequence(1, &a);  // primary queue: 3 2 1 0
  kv.add_sequence(2, 6, 1);   // takes 3, 2 (plain) and 1 ([1..4], offloaded to 4)
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOff, 1, 4}}));
  EXPECT_EQ(kv.export_secondary_blocks().size(), 0U);
  kv.check_integrity();
}

TEST(KVCachePersist, BlocksOfASuspendedSequenceAreListedLast) {
  KVCacheManager kv(4, 2, 16, true, 6);
  fill(kv);
  LlmRequest c = make_request(3, {9, 8, 7});  // keyed [9, 8] at primary 0
  add_and_store(kv, c);
  kv.take_transfers();
  kv.suspend_sequence(3);
  Transfers const moved = kv.take_transfers();
  ASSERT_EQ(moved.size(), 2U);
  BlockIdType const held_keyed = kv.get_block_ids(3)[0];
  KvSecondaryBlocks const blocks = kv.export_secondary_blocks();
  ASSERT_EQ(blocks.size(), 4U);
  EXPECT_EQ((Ids{blocks.block_ids.begin(), blocks.block_ids.begin() + 3}), (Ids{4, 5, 6}));
  EXPECT_EQ(blocks.block_ids[3], held_keyed);
  EXPECT_EQ(blocks.parents[3], -1);
  EXPECT_EQ((Tokens{blocks.tokens.begin() + 6, blocks.tokens.end()}), (Tokens{9, 8}));
}

TEST(KVCachePersist, ImportRebuildsTheTreeAndAPrefixHitOnboardsTheBlocks) {
  KVCacheManager source(4, 2, 16, true, 6);
  fill(source);
  KvSecondaryBlocks const blocks = source.export_secondary_blocks();

  KVCacheManager kv(4, 2, 16, true, 6);
  kv.import_secondary_blocks(blocks);
  kv.check_integrity();
  EXPECT_EQ(kv.export_secondary_blocks(), blocks);  // round trip: same ids, keys and queue order
  KvCacheStats stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.reusable_num_secondary_blocks, 3);
  EXPECT_EQ(stats.free_num_secondary_blocks, 6);
  EXPECT_TRUE(kv.take_transfers().empty());

  // A prompt starting with [1..6] hits all three adopted blocks, each onboarded (root first).
  LlmRequest d = make_request(4, {1, 2, 3, 4, 5, 6, 11, 12});
  kv.add_sequence(4, 8, 1, &d);
  EXPECT_EQ(d.prepopulated_prompt_len(), 6);
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOn, 6, 0}, {kOn, 5, 1}, {kOn, 4, 2}}));
  stats = kv.get_kv_cache_stats();
  EXPECT_EQ(stats.secondary_reused_blocks, 3);
  EXPECT_EQ(stats.onboarded_blocks, 3);
  kv.check_integrity();

  // The unkeyed secondary blocks are taken before the adopted ones: a swap-out lands in 7.
  KVCacheManager fresh(4, 2, 16, true, 6);
  fresh.import_secondary_blocks(blocks);
  fresh.add_sequence(9, 2, 1);
  fresh.suspend_sequence(9);
  EXPECT_EQ(fresh.take_transfers(), (Transfers{{kOff, 0, 7}}));
  fresh.remove_sequence(9);
  fresh.check_integrity();
  EXPECT_EQ(fresh.export_secondary_blocks(), blocks);
}

TEST(KVCachePersist, ImportKeepsPrioritiesAndTheirEvictionOrder) {
  KVCacheManager source(4, 2, 32, true, 6);
  LlmRequest low = make_request(1, {1, 2, 3}, 40);
  LlmRequest high = make_request(2, {7, 8, 9}, 80);
  add_and_store(source, high);
  source.remove_sequence(2, &high);
  add_and_store(source, low);
  source.remove_sequence(1, &low);
  source.add_sequence(3, 8, 1);  // evicts both keyed blocks
  source.take_transfers();
  source.remove_sequence(3);
  KvSecondaryBlocks const blocks = source.export_secondary_blocks();
  ASSERT_EQ(blocks.size(), 2U);
  EXPECT_EQ(blocks.priorities, (std::vector<SizeType32>{40, 80}));
  EXPECT_EQ(blocks.tokens, (Tokens{1, 2, 7, 8}));

  KVCacheManager kv(4, 2, 32, true, 6);
  kv.import_secondary_blocks(blocks);
  kv.check_integrity();
  EXPECT_EQ(kv.export_secondary_blocks(), blocks);
}

TEST(KVCachePersist, MalformedImportsAreErrorsThatChangeNothing) {
  KVCacheManager source(4, 2, 16, true, 6);
  fill(source);
  KvSecondaryBlocks const good = source.export_secondary_blocks();  // 4 <- 5 <- 6 (root)
  KVCacheManager kv(4, 2, 16, true, 6);

  auto with = [&](auto&& edit) {
    KvSecondaryBlocks b = good;
    edit(b);
    return b;
  };
  expect_invalid([&] { kv.import_secondary_blocks(with([](auto& b) { b.parents.pop_back(); })); },
                 "parents has 2 entries");
  expect_invalid([&] { kv.import_secondary_blocks(with([](auto& b) { b.tokens.pop_back(); })); },
                 "tokens has 5 entries, expected 6");
  expect_invalid([&] { kv.import_secondary_blocks(with([](auto& b) { b.block_ids[1] = 3; })); },
                 "block_ids[1] = 3 is not a secondary block id (must be in [4, 9])");
  expect_invalid([&] { kv.import_secondary_blocks(with([](auto& b) { b.block_ids[1] = 10; })); },
                 "block_ids[1] = 10 is not a secondary block id");
  expect_invalid([&] { kv.import_secondary_blocks(with([](auto& b) { b.block_ids[2] = 4; })); },
                 "block_ids[2] = 4 is listed twice (also block_ids[0])");
  expect_invalid([&] { kv.import_secondary_blocks(with([](auto& b) { b.priorities[0] = 101; })); },
                 "priorities[0] must be in [0, 100], got 101");
  expect_invalid([&] { kv.import_secondary_blocks(with([](auto& b) { b.parents[0] = 8; })); },
                 "parents[0] = 8 is not a listed block");
  expect_invalid([&] { kv.import_secondary_blocks(with([](auto& b) { b.parents[2] = 4; })); },
                 "its chain of parents has a cycle");
  expect_invalid([&] { kv.import_secondary_blocks(with([](auto& b) { b.parents[0] = 4; })); },
                 "its chain of parents has a cycle");
  // Two first blocks [1, 2]: one key for two blocks.
  expect_invalid(
      [&] {
        kv.import_secondary_blocks(with([](auto& b) {
          b.parents[1] = -1;
          b.tokens[2] = 1;
          b.tokens[3] = 2;
        }));
      },
      "block_ids[1] = 5 and block_ids[2] = 6 hold the same key");
  KvSecondaryBlocks too_many;
  for (BlockIdType id = 4; id < 11; ++id) {
    too_many.block_ids.push_back(id);
    too_many.parents.push_back(-1);
    too_many.priorities.push_back(35);
    too_many.tokens.insert(too_many.tokens.end(), {id, id});
  }
  expect_invalid([&] { kv.import_secondary_blocks(too_many); }, "7 blocks listed, more than num_secondary_blocks 6");
  expect_invalid([&] { KVCacheManager(4, 2, 16, false, 6).import_secondary_blocks(good); }, "block reuse is disabled");

  // Nothing changed: the manager is still fresh and takes the good list.
  kv.check_integrity();
  EXPECT_EQ(kv.export_secondary_blocks().size(), 0U);
  EXPECT_EQ(kv.num_free_secondary_blocks(), 6);
  kv.import_secondary_blocks(good);
  kv.check_integrity();
  EXPECT_EQ(kv.export_secondary_blocks(), good);

  // ... and only once: it is not fresh any more.
  expect_invalid([&] { kv.import_secondary_blocks(good); }, "the manager is not fresh (0 sequences, 3 cached blocks");
  KVCacheManager busy(4, 2, 16, true, 6);
  busy.add_sequence(1, 3, 1);
  expect_invalid([&] { busy.import_secondary_blocks(good); }, "the manager is not fresh (1 sequences");
}

TEST(KVCachePersist, OffloadReusableBlocksMovesThePrimaryCacheRootFirst) {
  KVCacheManager kv(4, 2, 16, true, 6);
  LlmRequest a = make_request(1, {1, 2, 3, 4, 5, 6, 7});  // keys at 0 [1,2], 1 [1..4], 2 [1..6]
  add_and_store(kv, a);
  kv.remove_sequence(1, &a);
  LlmRequest low = make_request(2, {9, 9, 9}, 10);  // below secondary_offload_min_priority: stays
  add_and_store(kv, low);                           // takes 3 and 2 ([1..6] offloaded to 4); [9,9] at 3
  EXPECT_EQ(kv.get_block_ids(2), (Ids{3, 2}));
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOff, 2, 4}}));
  kv.remove_sequence(2, &low);
  kv.check_integrity();
  // Cached in primary: 0 [1,2], 1 [1..4] (4 [1..6] below it is secondary), 3 [9,9] at priority 10.
  EXPECT_EQ(kv.offload_reusable_blocks(), 2);
  EXPECT_EQ(kv.take_transfers(), (Transfers{{kOff, 0, 5}, {kOff, 1, 6}}));
  kv.check_integrity();
  KvSecondaryBlocks const blocks = kv.export_secondary_blocks();
  EXPECT_EQ(blocks.block_ids, (Ids{4, 5, 6}));
  EXPECT_EQ(blocks.parents, (Ids{6, -1, 5}));
  EXPECT_EQ(kv.get_kv_cache_stats().reusable_num_blocks, 1);  // [9, 9] stays
  EXPECT_EQ(kv.offload_reusable_blocks(), 0);

  // A tier without a free uncached block takes nothing: the flush evicts nothing.
  KVCacheManager full(4, 2, 16, true, 1);
  LlmRequest b = make_request(1, {1, 2, 3, 4, 5});
  add_and_store(full, b);
  full.remove_sequence(1, &b);
  EXPECT_EQ(full.offload_reusable_blocks(), 1);  // [1,2] into 4
  EXPECT_EQ(full.take_transfers(), (Transfers{{kOff, 0, 4}}));
  EXPECT_EQ(full.offload_reusable_blocks(), 0);  // [1..4] stays: 4 holds a key
  EXPECT_TRUE(full.take_transfers().empty());
  full.check_integrity();
  EXPECT_EQ(KVCacheManager(4, 2, 16, false, 2).offload_reusable_blocks(), 0);
}

TEST(KVCachePersist, RandomTracesRoundTripAndServeTheSamePrefixes) {
  // Random traces over a small alphabet (shared prefixes, evictions, suspends); at the end the export
  // adopted by a fresh manager round-trips, and every exported prefix is found in it again.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    KVCacheManager kv(6, 2, 24, true, 10);
    std::vector<RequestIdType> live;
    RequestIdType next_id = 1;
    for (int step = 0; step < 60; ++step) {
      int const action = static_cast<int>(rng() % 4);
      if (action < 2 || live.empty()) {
        std::size_t const len = 3 + rng() % 6;
        Tokens tokens;
        for (std::size_t i = 0; i < len; ++i) tokens.push_back(static_cast<TokenIdType>(rng() % 3));
        LlmRequest r = make_request(next_id, tokens, static_cast<SizeType32>(20 + rng() % 40));
        try {
          add_and_store(kv, r);
          live.push_back(next_id);
        } catch (std::runtime_error const&) {
        }
        ++next_id;
      } else if (action == 2) {
        std::size_t const k = rng() % live.size();
        kv.remove_sequence(live[k]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      } else {
        RequestIdType const id = live[rng() % live.size()];
        try {
          if (kv.is_suspended(id)) {
            kv.resume_sequence(id);
          } else {
            kv.suspend_sequence(id);
          }
        } catch (std::runtime_error const&) {
        }
      }
      kv.take_transfers();
      kv.check_integrity();
    }
    // As at an engine's shutdown: every request gone (a suspended one's keyed blocks join the free queue).
    for (RequestIdType const id : live) kv.remove_sequence(id);
    kv.offload_reusable_blocks();  // and the primary cache into the tier, as far as it has room
    kv.take_transfers();
    kv.check_integrity();
    KvSecondaryBlocks const blocks = kv.export_secondary_blocks();
    KVCacheManager adopted(6, 2, 24, true, 10);
    adopted.import_secondary_blocks(blocks);
    adopted.check_integrity();
    ASSERT_EQ(adopted.export_secondary_blocks(), blocks) << "trial " << trial;
    // Every exported block's full prefix is matched from the root in the adopted manager.
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      Tokens prefix;
      for (std::int64_t j = static_cast<std::int64_t>(i); j != -1;) {
        prefix.insert(prefix.begin(), blocks.tokens.begin() + j * 2, blocks.tokens.begin() + j * 2 + 2);
        BlockIdType const parent = blocks.parents[static_cast<std::size_t>(j)];
        j = -1;
        for (std::size_t k = 0; k < blocks.size(); ++k) {
          if (blocks.block_ids[k] == parent) j = static_cast<std::int64_t>(k);
        }
      }
      prefix.push_back(99);
      LlmRequest const probe = make_request(999, prefix);
      EXPECT_FALSE(adopted.find_new_context_block(probe).has_value()) << "trial " << trial << " block " << i;
    }
  }
}

}  // namespace
}  // namespace inflight::batch_manager
