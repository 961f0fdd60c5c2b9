// MicroBatchScheduler: table-driven simulations (TRT-LLM microBatchSchedulerTest style) and direct
// checks of the chunking policies, draft fitting and validation. Expected tables are derived by
// hand from docs/batch-manager.md; the comments show the arithmetic. The KV pool is large,
// so the capacity scheduler (GUARANTEED_NO_EVICT) admits everything and only the micro batch limits.
#include "inflight/batch_manager/micro_batch_scheduler.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "scheduler_simulation.h"

namespace inflight::batch_manager {
namespace {

using testing::ContextChunk;
using testing::ExpectedSteps;
using testing::RequestSpec;
using testing::SchedulerSimulation;
using testing::SimulationConfig;

constexpr SizeType32 kTokensPerBlock = 10;

void run_and_check(MicroBatchScheduler micro_batch, SimulationConfig config, std::vector<RequestSpec> specs,
                   std::vector<ExpectedSteps> const& table) {
  KVCacheManager kv(1000, kTokensPerBlock, 1000);
  SchedulerSimulation simulation(CapacityScheduler(64), std::move(micro_batch), &kv, std::move(config),
                                 std::move(specs));
  auto const records = simulation.run();
  testing::expect_steps(records, table);
  if (::testing::Test::HasFailure()) {
    ADD_FAILURE() << "actual run:\n" << testing::format_records(records);
  }
  simulation.expect_outputs_complete();
}

MicroBatchScheduler chunked(ContextChunkingPolicy policy, SizeType32 unit,
                            std::optional<SizeType32> max_context_length = std::nullopt) {
  return MicroBatchScheduler(ContextChunkingConfig(policy, unit), max_context_length);
}

std::vector<std::unique_ptr<LlmRequest>> make_contexts(std::vector<SizeType32> const& prompt_lens) {
  std::vector<std::unique_ptr<LlmRequest>> requests;
  RequestIdType id = 0;
  for (SizeType32 len : prompt_lens) {
    auto tokens = std::vector<TokenIdType>(static_cast<std::size_t>(len), 1);
    requests.push_back(std::make_unique<LlmRequest>(id++, 4, std::move(tokens)));
  }
  return requests;
}

RequestVector pointers(std::vector<std::unique_ptr<LlmRequest>> const& requests) {
  RequestVector out;
  for (auto const& r : requests) {
    out.push_back(r.get());
  }
  return out;
}

std::vector<SizeType32> chunk_sizes(std::vector<std::unique_ptr<LlmRequest>> const& requests) {
  std::vector<SizeType32> out;
  for (auto const& r : requests) {
    out.push_back(r->context_chunk_size());
  }
  return out;
}

// --- Simulations ---------------------------------------------------------------------------------

// Budget 50, no chunking. it 0: R0 (30) fits, R1 (30) would make 60 -> stop (R2 is not tried).
// it 1: R0's token (1) + R1 (30) + R2 (10) = 41.
TEST(MicroBatchSchedulerTest, TokenBudgetWithoutChunking) {
  run_and_check(MicroBatchScheduler(), {.max_num_tokens = 50},
                {{.id = 0, .prompt_len = 30, .max_new_tokens = 3},
                 {.id = 1, .prompt_len = 30, .max_new_tokens = 3},
                 {.id = 2, .prompt_len = 10, .max_new_tokens = 3}},
                {
                    {0, 0, {0}, {}, {{0, 30}}},
                    {1, 1, {1, 2}, {0}, {{0, 30}, {0, 10}}},
                    {2, 2, {}, {0, 1, 2}},
                    {3, 3, {}, {1, 2}},
                });
}

// max_batch_size = 2 counts contexts and generation requests alike.
TEST(MicroBatchSchedulerTest, MaxBatchSize) {
  run_and_check(MicroBatchScheduler(), {.max_batch_size = 2},
                {{.id = 0, .prompt_len = 5, .max_new_tokens = 3},
                 {.id = 1, .prompt_len = 5, .max_new_tokens = 3},
                 {.id = 2, .prompt_len = 5, .max_new_tokens = 3}},
                {
                    {0, 0, {0, 1}, {}},
                    {1, 2, {}, {0, 1}},
                    {3, 3, {2}, {}},
                    {4, 5, {}, {2}},
                });
}

// R0 is still in flight with the model at iterations 1 and 2 (pipeline parallelism): skipped.
TEST(MicroBatchSchedulerTest, InflightRequestsAreSkipped) {
  run_and_check(MicroBatchScheduler(),
                {.inflight_ids =
                     [](int it) {
                       return (it == 1 || it == 2) ? std::unordered_set<RequestIdType>{0}
                                                   : std::unordered_set<RequestIdType>{};
                     }},
                {{.id = 0, .prompt_len = 5, .max_new_tokens = 3}, {.id = 1, .prompt_len = 5, .max_new_tokens = 3}},
                {
                    {0, 0, {0, 1}, {}},
                    {1, 2, {}, {1}},
                    {3, 4, {}, {0}},
                });
}

// EQUAL_PROGRESS, unit 10, budget 35, prompts 45 and 25.
//   it 0: rounds: (10, 10) = 20; (20, 10 -> 20 would make 40 > 35, undone) = 30; nothing grows -> (20, 10).
//   it 1: left 25 and 15, 40 > 35: (10, 10) = 20; (20, 15 clamped, +5) = 35 = budget -> stop.
//   it 2: R1's token (1) + R0's last 5 fit without the policy.
TEST(MicroBatchSchedulerTest, EqualProgressChunking) {
  run_and_check(chunked(ContextChunkingPolicy::kEQUAL_PROGRESS, 10), {.max_num_tokens = 35},
                {{.id = 0, .prompt_len = 45, .max_new_tokens = 2}, {.id = 1, .prompt_len = 25, .max_new_tokens = 2}},
                {
                    {0, 0, {0, 1}, {}, {{0, 20}, {0, 10}}},
                    {1, 1, {0, 1}, {}, {{20, 20}, {10, 15}}},
                    {2, 2, {0}, {1}, {{40, 5}}},
                    {3, 3, {}, {0}},
                });
}

// EQUAL_PROGRESS with max_context_length 15 and no budget. it 0: R0's 25 > 15 -> policy: R0 grows
// to 10, then 20 > 15 is undone; R1 grows to 10, then 12 (clamped). it 1: R0's last 15 fit as is.
TEST(MicroBatchSchedulerTest, EqualProgressMaxContextLength) {
  run_and_check(chunked(ContextChunkingPolicy::kEQUAL_PROGRESS, 10, 15), {},
                {{.id = 0, .prompt_len = 25, .max_new_tokens = 1}, {.id = 1, .prompt_len = 12, .max_new_tokens = 1}},
                {
                    {0, 0, {0, 1}, {}, {{0, 10}, {0, 12}}},
                    {1, 1, {0}, {}, {{10, 15}}},
                });
}

// FIRST_COME_FIRST_SERVED, unit 8, budget 30, max_context_length 20, prompts 50 and 12.
//   it 0: R0's 50 > 20 -> policy: R0 min(30, 50, 20) = 20, capped -> 16 (multiple of 8); R1 gets
//         min(14, 12) = 12 uncapped.
//   it 1: R1's token (1); R0's 34 left > 20 -> min(29, 34, 20) = 20 -> 16.
//   it 2: R0's 18 left fit both limits: 18, no rounding.
TEST(MicroBatchSchedulerTest, FirstComeFirstServedChunking) {
  run_and_check(chunked(ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED, 8, 20), {.max_num_tokens = 30},
                {{.id = 0, .prompt_len = 50, .max_new_tokens = 2}, {.id = 1, .prompt_len = 12, .max_new_tokens = 2}},
                {
                    {0, 0, {0, 1}, {}, {{0, 16}, {0, 12}}},
                    {1, 1, {0}, {1}, {{16, 16}}},
                    {2, 2, {0}, {}, {{32, 18}}},
                    {3, 3, {}, {0}},
                });
}

// A context whose chunk ends at 0 is not scheduled but still counts toward max_batch_size (2):
// it 0 collects R0 and R1 (R2 not reached); FCFS budget 45: R0 40, R1 min(5, 40) -> 0.
TEST(MicroBatchSchedulerTest, ZeroChunkCountsTowardBatchSize) {
  run_and_check(chunked(ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED, 10),
                {.max_batch_size = 2, .max_num_tokens = 45},
                {{.id = 0, .prompt_len = 40, .max_new_tokens = 2},
                 {.id = 1, .prompt_len = 40, .max_new_tokens = 2},
                 {.id = 2, .prompt_len = 5, .max_new_tokens = 2}},
                {
                    {0, 0, {0}, {}, {{0, 40}}},
                    {1, 1, {1}, {0}, {{0, 40}}},
                    {2, 2, {2}, {1}, {{0, 5}}},
                    {3, 3, {}, {2}},
                });
}

// fit_draft_tokens runs even when everything fits (unit 16, budget 100; 25 + 35 + 20 = 80 <= 100):
// used = 20 + 32 + 10 = 62. R0: room (16 - 4) % 16 = 12 >= 5 drafts, kept (used 67). R1: chunk 32
// ends on a unit boundary, room 0, all 3 dropped. R2: room 6 < 10, keeps 6 (used 73).
TEST(MicroBatchSchedulerTest, FitDraftTokensUnitRoom) {
  run_and_check(chunked(ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED, 16), {.max_num_tokens = 100},
                {{.id = 0, .prompt_len = 20, .max_new_tokens = 1, .num_draft_tokens = 5},
                 {.id = 1, .prompt_len = 32, .max_new_tokens = 1, .num_draft_tokens = 3},
                 {.id = 2, .prompt_len = 10, .max_new_tokens = 1, .num_draft_tokens = 10}},
                {
                    {0, 0, {0, 1, 2}, {}, {{0, 20, 5}, {0, 32, 0}, {0, 10, 6}}},
                });
}

// Budget 40: 28 + 14 = 42 > 40, FCFS keeps both chunks (20, 10; used 30). R0: room min(12, 40 - 30)
// = 10 >= 8, used 38. R1: room min(6, 40 - 38) = 2 < 4 drafts -> keeps 2.
TEST(MicroBatchSchedulerTest, FitDraftTokensBudgetRoom) {
  run_and_check(chunked(ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED, 16), {.max_num_tokens = 40},
                {{.id = 0, .prompt_len = 20, .max_new_tokens = 1, .num_draft_tokens = 8},
                 {.id = 1, .prompt_len = 10, .max_new_tokens = 1, .num_draft_tokens = 4}},
                {
                    {0, 0, {0, 1}, {}, {{0, 20, 8}, {0, 10, 2}}},
                });
}

// max_context_length 22: 20 + 5 drafts > 22, the policy keeps chunk 20; room min(12, 22 - 20) = 2.
TEST(MicroBatchSchedulerTest, FitDraftTokensMaxContextLengthRoom) {
  run_and_check(chunked(ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED, 16, 22), {},
                {{.id = 0, .prompt_len = 20, .max_new_tokens = 1, .num_draft_tokens = 5}},
                {
                    {0, 0, {0}, {}, {{0, 20, 2}}},
                });
}

// Drafts only count on the last chunk. Budget 20, unit 16, prompt 40 + 4 drafts:
//   it 0: 44 > 20 -> min(20, 40) = 20 -> 16, not last: drafts untouched.
//   it 1: 24 + 4 > 20 -> 16 again. it 2: 8 + 4 = 12 fits; room (16 - 8) % 16 = 8 >= 4, kept.
TEST(MicroBatchSchedulerTest, DraftTokensOnlyOnLastChunk) {
  run_and_check(chunked(ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED, 16), {.max_num_tokens = 20},
                {{.id = 0, .prompt_len = 40, .max_new_tokens = 1, .num_draft_tokens = 4}},
                {
                    {0, 0, {0}, {}, {{0, 16, 4}}},
                    {1, 1, {0}, {}, {{16, 16, 4}}},
                    {2, 2, {0}, {}, {{32, 8, 4}}},
                });
}

// Without a chunking config drafts are never dropped and count toward the budget (20 + 5 = 25).
TEST(MicroBatchSchedulerTest, DraftTokensWithoutChunking) {
  run_and_check(MicroBatchScheduler(), {.max_num_tokens = 25},
                {{.id = 0, .prompt_len = 20, .max_new_tokens = 1, .num_draft_tokens = 5},
                 {.id = 1, .prompt_len = 1, .max_new_tokens = 1}},
                {
                    {0, 0, {0}, {}, {{0, 20, 5}}},
                    {1, 1, {1}, {}, {{0, 1, 0}}},
                });
}

// --- Direct checks -------------------------------------------------------------------------------

TEST(MicroBatchSchedulerTest, EqualProgressPolicyDirect) {
  auto requests = make_contexts({50, 50, 7});
  // Rounds of 10: (10, 10, 7) = 27; (20, 20, 7) = 47; (30, 30, 7) = 67; 40 > max 30 undone -> stop.
  MicroBatchScheduler::set_ctx_requests_chunk_size(pointers(requests), ContextChunkingPolicy::kEQUAL_PROGRESS, 100, 10,
                                                   30);
  EXPECT_EQ(chunk_sizes(requests), (std::vector<SizeType32>{30, 30, 7}));
  // Capacity 25: R0 10, R1 10, R2 +7 would make 27 > 25 (undone); next round every growth would
  // pass 25 -> stop at (10, 10, 0).
  MicroBatchScheduler::set_ctx_requests_chunk_size(pointers(requests), ContextChunkingPolicy::kEQUAL_PROGRESS, 25, 10,
                                                   std::nullopt);
  EXPECT_EQ(chunk_sizes(requests), (std::vector<SizeType32>{10, 10, 0}));
  // No limits: everything.
  MicroBatchScheduler::set_ctx_requests_chunk_size(pointers(requests), ContextChunkingPolicy::kEQUAL_PROGRESS,
                                                   std::nullopt, 10, std::nullopt);
  EXPECT_EQ(chunk_sizes(requests), (std::vector<SizeType32>{50, 50, 7}));
}

TEST(MicroBatchSchedulerTest, FirstComeFirstServedPolicyDirect) {
  auto requests = make_contexts({50, 30, 7});
  // Capacity 64, unit 16: R0 50 (uncapped, 14 left); R1 min(14, 30) = 14, capped -> rounded to 0;
  // R2 min(14, 7) = 7 (uncapped, not rounded).
  MicroBatchScheduler::set_ctx_requests_chunk_size(pointers(requests), ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED,
                                                   64, 16, std::nullopt);
  EXPECT_EQ(chunk_sizes(requests), (std::vector<SizeType32>{50, 0, 7}));
  // max_context_length 40: 40 -> 32; 30 uncapped; 7 uncapped (no capacity).
  MicroBatchScheduler::set_ctx_requests_chunk_size(pointers(requests), ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED,
                                                   std::nullopt, 16, 40);
  EXPECT_EQ(chunk_sizes(requests), (std::vector<SizeType32>{32, 30, 7}));
}

TEST(MicroBatchSchedulerTest, FitDraftTokensDirect) {
  auto requests = make_contexts({20, 16, 5});
  for (auto& r : requests) {
    r->set_draft_tokens({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  }
  requests[1]->set_context_chunk_size(8);  // not its last chunk: drafts untouched
  // used = 20 + 8 + 5 = 33. R0: room (16 - 4) % 16 = 12, min(12, 50 - 33 = 17) -> keeps 12 (used 45).
  // R2: room 11, min(11, 50 - 45 = 5) = 5 -> keeps 5.
  MicroBatchScheduler::fit_draft_tokens(pointers(requests), 50, 16, std::nullopt);
  EXPECT_EQ(requests[0]->num_draft_tokens(), 12);
  EXPECT_EQ(requests[1]->num_draft_tokens(), 12);
  EXPECT_EQ(requests[2]->num_draft_tokens(), 5);
  // Over capacity already: room clamps to 0.
  MicroBatchScheduler::fit_draft_tokens(pointers(requests), 10, 16, std::nullopt);
  EXPECT_EQ(requests[0]->num_draft_tokens(), 0);
  EXPECT_EQ(requests[2]->num_draft_tokens(), 0);
}

TEST(MicroBatchSchedulerTest, ReturnsSamePointersAndSkipsOutsideWindow) {
  auto requests = make_contexts({10, 10, 10, 10});
  requests[1]->set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  requests[1]->add_new_token(3);
  requests[2]->set_state(LlmRequestState::kGENERATION_TO_COMPLETE);  // outside the default window
  requests[3]->set_state(LlmRequestState::kGENERATION_COMPLETE);
  auto const out = MicroBatchScheduler().schedule(pointers(requests), {}, 8, std::nullopt);
  EXPECT_EQ(out.context_requests, RequestVector{requests[0].get()});
  EXPECT_EQ(out.generation_requests, RequestVector{requests[1].get()});
  EXPECT_EQ(requests[0]->context_chunk_size(), 10);
}

TEST(MicroBatchSchedulerTest, Validation) {
  auto requests = make_contexts({11});
  auto const expect_message = [](auto&& fn, std::vector<std::string> const& fragments) {
    try {
      fn();
      ADD_FAILURE() << "expected std::invalid_argument";
    } catch (std::invalid_argument const& error) {
      for (auto const& fragment : fragments) {
        EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
      }
    }
  };
  MicroBatchScheduler const plain;
  expect_message([&] { plain.schedule(pointers(requests), {}, 0, std::nullopt); }, {"max_batch_size", "0"});
  expect_message([&] { plain.schedule(pointers(requests), {}, 4, 0); }, {"max_num_tokens", "0"});
  // Without chunking, a context longer than max_context_length cannot run at all.
  MicroBatchScheduler const limited(std::nullopt, 10);
  expect_message([&] { limited.schedule(pointers(requests), {}, 4, std::nullopt); },
                 {"max_context_length", "10", "11", "request 0"});
  expect_message([] { ContextChunkingConfig(ContextChunkingPolicy::kEQUAL_PROGRESS, 0); }, {"chunk_unit_size", "0"});
  expect_message([] { MicroBatchScheduler(std::nullopt, 0); }, {"max_context_length", "0"});
  expect_message([&] { MicroBatchScheduler::fit_draft_tokens(pointers(requests), 10, 0, std::nullopt); },
                 {"chunk_unit_size", "0"});
  expect_message(
      [] {
        MicroBatchScheduler(std::nullopt, std::nullopt, LlmRequestState::kGENERATION_IN_PROGRESS,
                            LlmRequestState::kCONTEXT_INIT);
      },
      {"no_schedule_until_state"});
  // With chunking the same context is simply chunked.
  MicroBatchScheduler const chunking(ContextChunkingConfig(ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED, 4), 10);
  auto const out = chunking.schedule(pointers(requests), {}, 4, std::nullopt);
  ASSERT_EQ(out.context_requests.size(), 1U);
  EXPECT_EQ(requests[0]->context_chunk_size(), 8);
}

}  // namespace
}  // namespace inflight::batch_manager
