// CapacityScheduler: table-driven simulations (TRT-LLM capacitySchedulerTest style) plus direct
// checks of validation and the state window. Every expected table is derived by hand from the
// rules in docs/batch-manager.md; the comments show the arithmetic (tpb = 10 throughout).
#include "inflight/batch_manager/capacity_scheduler.h"

#include <gtest/gtest.h>

#include <memory>
#include <numeric>
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
constexpr SizeType32 kMaxSeqLen = 400;

// Runs the simulation, compares it with the table (printing the actual run on mismatch) and checks
// that every request ended with its unpaused output.
void run_and_check(CapacityScheduler capacity, MicroBatchScheduler micro_batch, KVCacheManager* kv,
                   SimulationConfig config, std::vector<RequestSpec> specs, std::vector<ExpectedSteps> const& table) {
  SchedulerSimulation simulation(std::move(capacity), std::move(micro_batch), kv, std::move(config), std::move(specs));
  auto const records = simulation.run();
  testing::expect_steps(records, table);
  if (::testing::Test::HasFailure()) {
    ADD_FAILURE() << "actual run:\n" << testing::format_records(records);
  }
  simulation.expect_outputs_complete();
}

std::vector<TokenIdType> prompt_with_prefix(SizeType32 shared_len, SizeType32 tail_len, TokenIdType tail_seed) {
  std::vector<TokenIdType> tokens(static_cast<std::size_t>(shared_len));
  std::iota(tokens.begin(), tokens.end(), 1);
  for (SizeType32 i = 0; i < tail_len; ++i) {
    tokens.push_back(tail_seed + i);
  }
  return tokens;
}

// --- GUARANTEED_NO_EVICT -------------------------------------------------------------------------

// 20 blocks; each request needs c + (T - c) = 4 + (9 - 4) = 9 blocks to completion (prompt 40,
// 40 + 50 = 90 tokens). R0 and R1 fit (9 + 9 = 18), R2 does not (2 left). While they generate,
// available = free - reserved stays 20 - h0 - h1 - (9 - h0) - (9 - h1) = 2, so R2 waits until both
// finish (their 50th token comes at iteration 49). R3 needs only 0 + (1 - 0) = 1 block, which would
// fit, but it does not overtake R2.
TEST(CapacitySchedulerTest, NoEvictBlocksAdmissionUntilBlocksFree) {
  KVCacheManager kv(20, kTokensPerBlock, kMaxSeqLen);
  run_and_check(CapacityScheduler(10, CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT), MicroBatchScheduler(), &kv, {},
                {{.id = 0, .prompt_len = 40, .max_new_tokens = 50},
                 {.id = 1, .prompt_len = 40, .max_new_tokens = 50},
                 {.id = 2, .prompt_len = 40, .max_new_tokens = 50},
                 {.id = 3, .prompt_len = 5, .max_new_tokens = 5}},
                {
                    {0, 0, {0, 1}, {}},
                    {1, 49, {}, {0, 1}},
                    {50, 50, {2, 3}, {}},
                    {51, 54, {}, {2, 3}},
                    {55, 99, {}, {2}},
                });
}

// Priorities reorder the active list: R3 (0.9) arriving with R2 (0.5) goes first. R0/R1 need
// 3 + 2 = 5 blocks each (prompt 30, 50 tokens) and fill the 10-block pool's reservation; R2/R3
// need 3 + 3 = 6 each, so only one of them fits at a time, and R3 is admitted first. No
// overtaking: while R3 runs, R2 (6) never fits the 4 left.
TEST(CapacitySchedulerTest, NoEvictAdmitsByPriority) {
  KVCacheManager kv(10, kTokensPerBlock, kMaxSeqLen);
  run_and_check(CapacityScheduler(10), MicroBatchScheduler(), &kv, {},
                {{.id = 0, .prompt_len = 30, .max_new_tokens = 20},
                 {.id = 1, .prompt_len = 30, .max_new_tokens = 20},
                 {.id = 2, .prompt_len = 30, .max_new_tokens = 30, .arrival = 1},
                 {.id = 3, .prompt_len = 30, .max_new_tokens = 30, .arrival = 1, .priority = 0.9F}},
                {
                    {0, 0, {0, 1}, {}},
                    {1, 19, {}, {0, 1}},
                    {20, 20, {3}, {}},
                    {21, 49, {}, {3}},
                    {50, 50, {2}, {}},
                    {51, 79, {}, {2}},
                });
}

// max_num_requests = 2 counts generating requests too; the same table without a KV cache manager
// (TRT-LLM's MaxRequestsScheduler) since the pool is never the limit here.
TEST(CapacitySchedulerTest, MaxNumRequests) {
  std::vector<RequestSpec> const specs = {{.id = 0, .prompt_len = 10, .max_new_tokens = 3},
                                          {.id = 1, .prompt_len = 10, .max_new_tokens = 3},
                                          {.id = 2, .prompt_len = 10, .max_new_tokens = 3}};
  std::vector<ExpectedSteps> const table = {
      {0, 0, {0, 1}, {}},
      {1, 2, {}, {0, 1}},
      {3, 3, {2}, {}},
      {4, 5, {}, {2}},
  };
  for (auto policy : {CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT, CapacitySchedulerPolicy::kMAX_UTILIZATION,
                      CapacitySchedulerPolicy::kSTATIC_BATCH}) {
    SCOPED_TRACE(to_string(policy));
    KVCacheManager kv(100, kTokensPerBlock, kMaxSeqLen);
    run_and_check(CapacityScheduler(2, policy), MicroBatchScheduler(), &kv, {}, specs, table);
  }
  SCOPED_TRACE("no kv cache manager");
  run_and_check(CapacityScheduler(2), MicroBatchScheduler(), nullptr, {}, specs, table);
}

// --- STATIC_BATCH --------------------------------------------------------------------------------

// R2 arrives while R0/R1 generate: a new context waits until the batch drains (R0's 5th token at
// iteration 4). Under GUARANTEED_NO_EVICT it would start at iteration 1.
TEST(CapacitySchedulerTest, StaticBatchWaitsForBatchToDrain) {
  std::vector<RequestSpec> const specs = {{.id = 0, .prompt_len = 10, .max_new_tokens = 5},
                                          {.id = 1, .prompt_len = 10, .max_new_tokens = 3},
                                          {.id = 2, .prompt_len = 10, .max_new_tokens = 2, .arrival = 1}};
  {
    KVCacheManager kv(100, kTokensPerBlock, kMaxSeqLen);
    run_and_check(CapacityScheduler(4, CapacitySchedulerPolicy::kSTATIC_BATCH), MicroBatchScheduler(), &kv, {}, specs,
                  {
                      {0, 0, {0, 1}, {}},
                      {1, 2, {}, {0, 1}},
                      {3, 4, {}, {0}},
                      {5, 5, {2}, {}},
                      {6, 6, {}, {2}},
                  });
  }
  KVCacheManager kv(100, kTokensPerBlock, kMaxSeqLen);
  run_and_check(CapacityScheduler(4, CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT), MicroBatchScheduler(), &kv, {},
                specs,
                {
                    {0, 0, {0, 1}, {}},
                    {1, 1, {2}, {0, 1}},
                    {2, 2, {}, {0, 1, 2}},
                    {3, 4, {}, {0}},
                });
}

// Only a context on its first chunk is held back: R1, already past its first chunk, keeps being
// admitted while R0 generates. Budget 20, FCFS, unit 10: it 0 chunks 10 + min(10, 30) = 10;
// it 1 R0 costs 1, R1 gets 19 rounded to 10; it 2 R1's last 10 fit.
TEST(CapacitySchedulerTest, StaticBatchKeepsChunkedContextRunning) {
  KVCacheManager kv(100, kTokensPerBlock, kMaxSeqLen);
  run_and_check(CapacityScheduler(4, CapacitySchedulerPolicy::kSTATIC_BATCH),
                MicroBatchScheduler(ContextChunkingConfig(ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED, 10)), &kv,
                {.max_num_tokens = 20},
                {{.id = 0, .prompt_len = 10, .max_new_tokens = 3}, {.id = 1, .prompt_len = 30, .max_new_tokens = 2}},
                {
                    {0, 0, {0, 1}, {}, {{0, 10}, {0, 10}}},
                    {1, 1, {1}, {0}, {{10, 10}}},
                    {2, 2, {1}, {0}, {{20, 10}}},
                    {3, 3, {}, {1}},
                });
}

// --- MAX_UTILIZATION -----------------------------------------------------------------------------

// 12 blocks, two requests with prompt 40 and 50 new tokens. A generating request needs a block when
// its KV length t = 39 + it is a multiple of 10, i.e. at iterations 1, 11, 21, ...
//   it 0: 4 + 4 blocks for the prompts (free 4); it 1: +1 each (free 2); it 11: +1 each (free 0);
//   it 21: R0 needs 1, none free -> the last started request, R1, is paused (its 6 blocks count as
//   free), R0 is retried and fits. R1 folds its 21 tokens: prompt 61, 29 new tokens left.
//   it 22..49: R1 needs ceil(61/10) = 7 > free (5, then 4, then 3); it is not started, so there is
//   no victim. R0 finishes at it 49; R1 recomputes at it 50 and generates 28 more (it 51..78).
TEST(CapacitySchedulerTest, MaxUtilizationPausesAndResumes) {
  KVCacheManager kv(12, kTokensPerBlock, kMaxSeqLen);
  SchedulerSimulation simulation(
      CapacityScheduler(10, CapacitySchedulerPolicy::kMAX_UTILIZATION), MicroBatchScheduler(), &kv, {},
      {{.id = 0, .prompt_len = 40, .max_new_tokens = 50}, {.id = 1, .prompt_len = 40, .max_new_tokens = 50}});
  auto const records = simulation.run();
  testing::expect_steps(records, {
                                     {0, 0, {0, 1}, {}},
                                     {1, 20, {}, {0, 1}},
                                     {21, 21, {}, {0}, {}, {1}},
                                     {22, 49, {}, {0}},
                                     {50, 50, {1}, {}, {{0, 61}}},
                                     {51, 78, {}, {1}},
                                 });
  simulation.expect_outputs_complete();
  // Recomputed, not lost: 21 tokens folded into the prompt, 29 generated after the resume.
  LlmRequest const& resumed = simulation.request(1);
  EXPECT_EQ(resumed.prompt_len(), 61);
  EXPECT_EQ(resumed.max_new_tokens(), 29);
  EXPECT_EQ(resumed.num_generated_tokens(), 29);
  EXPECT_EQ(resumed.num_tokens() - resumed.orig_prompt_len(), 50);
}

// Same run with max_input_len = 50: the pause folds only 10 of R1's 21 tokens (prompt 50, 40 new
// tokens left; the other 11 are generated again). Now R1's prompt fits the 5 free blocks at once
// (it 22), but its next token needs a 6th block (t = 50) with none free, and R1 -- the last
// started request, here the one being tried -- is paused again (it 23). This repeats every other
// iteration until R0 needs its own block at it 31 and pauses R1 once more; then R1 (5 blocks) no
// longer fits the 4 left and waits for R0 to finish. It recomputes at it 50 and runs to it 89.
TEST(CapacitySchedulerTest, MaxUtilizationPauseCappedByMaxInputLen) {
  KVCacheManager kv(12, kTokensPerBlock, kMaxSeqLen);
  SchedulerSimulation simulation(
      CapacityScheduler(10, CapacitySchedulerPolicy::kMAX_UTILIZATION), MicroBatchScheduler(), &kv,
      {.max_input_len = 50},
      {{.id = 0, .prompt_len = 40, .max_new_tokens = 50}, {.id = 1, .prompt_len = 40, .max_new_tokens = 50}});
  auto const records = simulation.run();
  testing::expect_steps(records, {
                                     {0, 0, {0, 1}, {}},
                                     {1, 20, {}, {0, 1}},
                                     {21, 21, {}, {0}, {}, {1}},
                                     {22, 22, {1}, {0}, {{0, 50}}},
                                     {23, 23, {}, {0}, {}, {1}},
                                     {24, 24, {1}, {0}},
                                     {25, 25, {}, {0}, {}, {1}},
                                     {26, 26, {1}, {0}},
                                     {27, 27, {}, {0}, {}, {1}},
                                     {28, 28, {1}, {0}},
                                     {29, 29, {}, {0}, {}, {1}},
                                     {30, 30, {1}, {0}},
                                     {31, 31, {}, {0}, {}, {1}},
                                     {32, 49, {}, {0}},
                                     {50, 50, {1}, {}, {{0, 50}}},
                                     {51, 89, {}, {1}},
                                 });
  simulation.expect_outputs_complete();
  EXPECT_EQ(simulation.request(1).prompt_len(), 50);
  EXPECT_EQ(simulation.request(1).max_new_tokens(), 40);
}

// The victim is searched from the back, so it can sit behind the request that does not fit, and
// everyone behind the victim drops out of the pass. 3 blocks: R0 (prompt 10) and R1 (prompt 15,
// 2 blocks) fill the pool at it 0. At it 1, R0's next token needs a block (t = 10): R2 (new) is not
// started, R1 is -> R1 paused (2 blocks back), R0 retried and fits, and R2 -- which would fit the
// block left -- is not tried this pass. R1 folds 1 token (prompt 16 -> 2 blocks, 9 new tokens left).
// it 2..4: R1 (2) > free (1), not started -> stop (R2 waits behind it). R0 finishes at it 4.
// it 5: R1 (2) + R2 (1) = 3 fit. R1 needs its 3rd block at t = 20 (it 9), after R2 freed one.
TEST(CapacitySchedulerTest, MaxUtilizationVictimBehindAndDropOut) {
  KVCacheManager kv(3, kTokensPerBlock, kMaxSeqLen);
  run_and_check(CapacityScheduler(10, CapacitySchedulerPolicy::kMAX_UTILIZATION), MicroBatchScheduler(), &kv, {},
                {{.id = 0, .prompt_len = 10, .max_new_tokens = 5},
                 {.id = 1, .prompt_len = 15, .max_new_tokens = 10},
                 {.id = 2, .prompt_len = 5, .max_new_tokens = 2, .arrival = 1}},
                {
                    {0, 0, {0, 1}, {}},
                    {1, 1, {}, {0}, {}, {1}},
                    {2, 4, {}, {0}},
                    {5, 5, {1, 2}, {}, {{0, 16}, {0, 5}}},
                    {6, 6, {}, {1, 2}},
                    {7, 13, {}, {1}},
                });
}

// A context past its first chunk is "started" and can be the victim. 8 blocks, FCFS unit 10,
// budget 20. it 0: R0 (19) takes 19 of 20 tokens, R1's chunk rounds to 0 (not run, no blocks).
// it 1: R1's first chunk (10) runs and its 6 blocks are allocated (free 0). it 2: R0's next token
// needs a block (t = 20) -> R1 paused mid-context (it had generated nothing: prompt unchanged).
// R1 (6 blocks) waits until R0 finishes at it 9, then runs in chunks of 20 from position 0.
TEST(CapacitySchedulerTest, MaxUtilizationPausesChunkedContext) {
  KVCacheManager kv(8, kTokensPerBlock, kMaxSeqLen);
  run_and_check(CapacityScheduler(10, CapacitySchedulerPolicy::kMAX_UTILIZATION),
                MicroBatchScheduler(ContextChunkingConfig(ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED, 10)), &kv,
                {.max_num_tokens = 20},
                {{.id = 0, .prompt_len = 19, .max_new_tokens = 10}, {.id = 1, .prompt_len = 60, .max_new_tokens = 2}},
                {
                    {0, 0, {0}, {}, {{0, 19}}},
                    {1, 1, {1}, {0}, {{0, 10}}},
                    {2, 2, {}, {0}, {}, {1}},
                    {3, 9, {}, {0}},
                    {10, 10, {1}, {}, {{0, 20}}},
                    {11, 11, {1}, {}, {{20, 20}}},
                    {12, 12, {1}, {}, {{40, 20}}},
                    {13, 13, {}, {1}},
                });
}

// Two-step lookahead counts the blocks of the next two tokens: with 2 blocks and prompt 9, R0's
// generation at t = 9 needs ceil(11/10) - ceil(9/10) = 1 block one step ahead, so R1's context
// (1 block) no longer fits beside it and waits; with one-step lookahead (needs 0) both run at it 1.
TEST(CapacitySchedulerTest, MaxUtilizationTwoStepsLookahead) {
  std::vector<RequestSpec> const specs = {{.id = 0, .prompt_len = 9, .max_new_tokens = 3},
                                          {.id = 1, .prompt_len = 5, .max_new_tokens = 1, .arrival = 1}};
  {
    KVCacheManager kv(2, kTokensPerBlock, kMaxSeqLen);
    run_and_check(CapacityScheduler(10, CapacitySchedulerPolicy::kMAX_UTILIZATION, LlmRequestState::kCONTEXT_INIT,
                                    LlmRequestState::kGENERATION_COMPLETE, true),
                  MicroBatchScheduler(), &kv, {}, specs,
                  {
                      {0, 0, {0}, {}},
                      {1, 2, {}, {0}},
                      {3, 3, {1}, {}},
                  });
  }
  KVCacheManager kv(2, kTokensPerBlock, kMaxSeqLen);
  run_and_check(CapacityScheduler(10, CapacitySchedulerPolicy::kMAX_UTILIZATION), MicroBatchScheduler(), &kv, {}, specs,
                {
                    {0, 0, {0}, {}},
                    {1, 1, {1}, {0}},
                    {2, 2, {}, {0}},
                });
}

// --- Duplicate-prefill delay (block reuse on) ----------------------------------------------------

// R0 and R1 share a 20-token prefix (2 full blocks), R2 is unrelated. R0 claims the prefix's first
// block; R1 finds it claimed and is skipped (not paused, and R2 behind it is still admitted).
// R0's context stores its blocks, so at it 1 R1 hits both: prepopulated 20, chunk 5.
// STATIC_BATCH does not delay: all three compute their prompts at it 0.
TEST(CapacitySchedulerTest, DuplicatePrefillIsDelayed) {
  std::vector<RequestSpec> const specs = {
      {.id = 0, .prompt_len = 25, .max_new_tokens = 2, .prompt = prompt_with_prefix(20, 5, 500)},
      {.id = 1, .prompt_len = 25, .max_new_tokens = 2, .prompt = prompt_with_prefix(20, 5, 600)},
      {.id = 2, .prompt_len = 15, .max_new_tokens = 2}};
  for (auto policy : {CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT, CapacitySchedulerPolicy::kMAX_UTILIZATION}) {
    SCOPED_TRACE(to_string(policy));
    KVCacheManager kv(50, kTokensPerBlock, kMaxSeqLen, /*enable_block_reuse=*/true);
    run_and_check(CapacityScheduler(10, policy), MicroBatchScheduler(), &kv, {}, specs,
                  {
                      {0, 0, {0, 2}, {}, {{0, 25}, {0, 15}}},
                      {1, 1, {1}, {0, 2}, {{20, 5}}},
                      {2, 2, {}, {1}},
                  });
  }
  KVCacheManager kv(50, kTokensPerBlock, kMaxSeqLen, /*enable_block_reuse=*/true);
  run_and_check(CapacityScheduler(10, CapacitySchedulerPolicy::kSTATIC_BATCH), MicroBatchScheduler(), &kv, {}, specs,
                {
                    {0, 0, {0, 1, 2}, {}, {{0, 25}, {0, 25}, {0, 15}}},
                    {1, 1, {}, {0, 1, 2}},
                });
}

// A context already past its first chunk marks the block it is producing before the walk: R1
// (same 40-token prefix as R0, arriving at it 1) waits while R0's chunks run (budget 20, FCFS,
// unit 10), and at it 3 hits all 4 blocks R0 stored. Its chunk, set to 10 by the scheduler before
// the hit (budget 19 after R0's generation token), is clamped to the 5 left.
TEST(CapacitySchedulerTest, DuplicatePrefillWaitsForChunkedContext) {
  for (auto policy : {CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT, CapacitySchedulerPolicy::kMAX_UTILIZATION}) {
    SCOPED_TRACE(to_string(policy));
    KVCacheManager kv(50, kTokensPerBlock, kMaxSeqLen, /*enable_block_reuse=*/true);
    run_and_check(
        CapacityScheduler(10, policy),
        MicroBatchScheduler(ContextChunkingConfig(ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED, 10)), &kv,
        {.max_num_tokens = 20},
        {{.id = 0, .prompt_len = 45, .max_new_tokens = 2, .prompt = prompt_with_prefix(40, 5, 500)},
         {.id = 1, .prompt_len = 45, .max_new_tokens = 2, .arrival = 1, .prompt = prompt_with_prefix(40, 5, 600)}},
        {
            {0, 0, {0}, {}, {{0, 20}}},
            {1, 1, {0}, {}, {{20, 20}}},
            {2, 2, {0}, {}, {{40, 5}}},
            {3, 3, {1}, {0}, {{40, 5}}},
            {4, 4, {}, {1}},
        });
  }
}

// A request retried after pausing a victim is not skipped because of the block it claimed itself.
// 4 blocks, reuse on. V (id 0, prompt 30) holds 3; R (id 1, priority 0.9, prompt 21) arrives and
// needs 3 with 1 free: V, behind R and started, is paused; R is retried and runs. V folds 1 token
// (prompt 31, 4 blocks); R's allocation took the free queue's front (3, then V's released 2 and 1),
// so V's first block (block 0) is still cached and V resumes at it 3 with prepopulated 10.
TEST(CapacitySchedulerTest, MaxUtilizationRetryAfterPauseIgnoresOwnClaim) {
  KVCacheManager kv(4, kTokensPerBlock, kMaxSeqLen, /*enable_block_reuse=*/true);
  run_and_check(CapacityScheduler(10, CapacitySchedulerPolicy::kMAX_UTILIZATION), MicroBatchScheduler(), &kv, {},
                {{.id = 0, .prompt_len = 30, .max_new_tokens = 5},
                 {.id = 1, .prompt_len = 21, .max_new_tokens = 2, .arrival = 1, .priority = 0.9F}},
                {
                    {0, 0, {0}, {}},
                    {1, 1, {1}, {}, {{0, 21}}, {0}},
                    {2, 2, {}, {1}},
                    {3, 3, {0}, {}, {{10, 21}}},
                    {4, 6, {}, {0}},
                });
}

// --- Direct checks -------------------------------------------------------------------------------

TEST(CapacitySchedulerTest, Validation) {
  EXPECT_THROW(CapacityScheduler(0), std::invalid_argument);
  try {
    CapacityScheduler(-3);
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (std::invalid_argument const& error) {
    EXPECT_NE(std::string(error.what()).find("max_num_requests"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("-3"), std::string::npos) << error.what();
  }
  EXPECT_THROW(CapacityScheduler(4, CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT,
                                 LlmRequestState::kGENERATION_COMPLETE, LlmRequestState::kCONTEXT_INIT),
               std::invalid_argument);
  EXPECT_THROW(CapacityScheduler(4, CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT, LlmRequestState::kCONTEXT_INIT,
                                 LlmRequestState::kCONTEXT_INIT),
               std::invalid_argument);
  CapacityScheduler const scheduler(4, CapacitySchedulerPolicy::kSTATIC_BATCH);
  EXPECT_EQ(scheduler.max_num_requests(), 4);
  EXPECT_EQ(scheduler.policy(), CapacitySchedulerPolicy::kSTATIC_BATCH);
  EXPECT_EQ(scheduler.no_schedule_until_state(), LlmRequestState::kCONTEXT_INIT);
  EXPECT_EQ(scheduler.no_schedule_after_state(), LlmRequestState::kGENERATION_COMPLETE);
  EXPECT_FALSE(scheduler.two_steps_lookahead());
}

// Requests outside [until, after) are neither scheduled nor counted; outputs are the same pointers.
TEST(CapacitySchedulerTest, StateWindowAndIdentity) {
  LlmRequest context(0, 4, std::vector<TokenIdType>(10, 1));
  LlmRequest generating(1, 4, std::vector<TokenIdType>(10, 1));
  generating.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  generating.add_new_token(3);
  LlmRequest to_complete(2, 4, std::vector<TokenIdType>(10, 1));
  to_complete.set_state(LlmRequestState::kGENERATION_TO_COMPLETE);
  to_complete.add_new_token(3);
  LlmRequest done(3, 4, std::vector<TokenIdType>(10, 1));
  done.set_state(LlmRequestState::kGENERATION_COMPLETE);
  LlmRequest encoder(4, 4, std::vector<TokenIdType>(10, 1));
  encoder.set_state(LlmRequestState::kENCODER_INIT);
  RequestVector const active = {&done, &encoder, &context, &generating, &to_complete};

  for (auto policy : {CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT, CapacitySchedulerPolicy::kMAX_UTILIZATION}) {
    KVCacheManager kv(100, kTokensPerBlock, kMaxSeqLen);
    kv.add_sequence(1, 10, 1);
    kv.add_token(1);
    kv.add_sequence(2, 10, 1);
    kv.add_token(2);
    auto const out = CapacityScheduler(8, policy).schedule(active, &kv);
    // No-evict lists generating requests first, then admitted contexts.
    RequestVector const expected = policy == CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT
                                       ? RequestVector{&generating, &to_complete, &context}
                                       : RequestVector{&context, &generating, &to_complete};
    EXPECT_EQ(out.fitting_requests, expected) << to_string(policy);
    EXPECT_TRUE(out.paused_requests.empty());
  }
  auto const generation_only =
      CapacityScheduler(8, CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT, LlmRequestState::kGENERATION_IN_PROGRESS,
                        LlmRequestState::kGENERATION_TO_COMPLETE)
          .schedule(active, nullptr);
  EXPECT_EQ(generation_only.fitting_requests, RequestVector{&generating});
  auto const with_encoder =
      CapacityScheduler(2, CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT, LlmRequestState::kENCODER_INIT)
          .schedule(active, nullptr);
  EXPECT_EQ(with_encoder.fitting_requests, (RequestVector{&encoder, &context}));
}

// A context past its first chunk is a pending request under GUARANTEED_NO_EVICT, not a generating
// one: it is admitted only while its remaining blocks fit, after every generating request.
TEST(CapacitySchedulerTest, NoEvictChunkedContextIsPending) {
  KVCacheManager kv(10, kTokensPerBlock, kMaxSeqLen);
  LlmRequest generating(0, 20, std::vector<TokenIdType>(30, 1));  // 3 + 2 blocks to completion
  kv.add_sequence(0, 30, 1);
  generating.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  generating.add_new_token(5);
  LlmRequest chunked(1, 30, std::vector<TokenIdType>(40, 2));  // holds 4 of c + (T - c) = 7
  kv.add_sequence(1, 40, 1);
  chunked.set_context_chunk_size(20);
  chunked.move_to_next_context_chunk();
  // free = 10 - 3 - 4 = 3; reserved by the generating request: 5 - 3 = 2; available 1.
  // The chunked context needs (7 - 4) = 3 more -> not admitted.
  auto out = CapacityScheduler(8).schedule({&chunked, &generating}, &kv);
  EXPECT_EQ(out.fitting_requests, RequestVector{&generating});
  // Without the generating request reserving blocks it fits (3 <= 3 free).
  out = CapacityScheduler(8).schedule({&chunked}, &kv);
  EXPECT_EQ(out.fitting_requests, RequestVector{&chunked});
}

// --- window managers (several KV pools) ----------------------------------------------------------

// A request fits only where it fits in every pool. Window manager W = 20: a request without a
// sequence needs max(ceil(prompt / tpb), min(T, ceil(W / tpb) + 1)) = max(ceil(prompt / 10), 3)
// window blocks. A (prompt 30) needs 8 main blocks (3 + 5) and 3 window blocks, B (prompt 40) 9 and
// 4. The main pool (100) holds both; a window pool of 6 holds A, then 6 - 3 = 3 < 4 stops B; one of
// 3 blocks stops B even as the first request.
TEST(CapacitySchedulerTest, NoEvictChecksEveryWindowPool) {
  LlmRequest a(0, 50, std::vector<TokenIdType>(30, 1));
  LlmRequest b(1, 50, std::vector<TokenIdType>(40, 2));
  for (auto policy : {CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT, CapacitySchedulerPolicy::kSTATIC_BATCH}) {
    SCOPED_TRACE(to_string(policy));
    KVCacheManager kv(100, kTokensPerBlock, kMaxSeqLen);
    KVCacheManager window(6, kTokensPerBlock, kMaxSeqLen, false, 0, kDefaultSecondaryOffloadMinPriority, 20);
    KVCacheManager small_window(3, kTokensPerBlock, kMaxSeqLen, false, 0, kDefaultSecondaryOffloadMinPriority, 20);
    EXPECT_EQ(kv.get_remaining_blocks_to_completion(b), 9);
    EXPECT_EQ(window.get_remaining_blocks_to_completion(a), 3);
    EXPECT_EQ(window.get_remaining_blocks_to_completion(b), 4);
    CapacityScheduler const scheduler(8, policy);
    EXPECT_EQ(scheduler.schedule({&a, &b}, &kv).fitting_requests, (RequestVector{&a, &b}));
    EXPECT_EQ(scheduler.schedule({&a, &b}, &kv, {&window}).fitting_requests, RequestVector{&a});
    EXPECT_EQ(scheduler.schedule({&b, &a}, &kv, {&window}).fitting_requests, RequestVector{&b});
    EXPECT_TRUE(scheduler.schedule({&b, &a}, &kv, {&window, &small_window}).fitting_requests.empty());
  }
  KVCacheManager kv(100, kTokensPerBlock, kMaxSeqLen);
  EXPECT_THROW(CapacityScheduler(8).schedule({&a}, &kv, {nullptr}), std::invalid_argument);
}

// MAX_UTILIZATION pauses to make room in a window pool. G0 and G1 (prompt 20, one token generated:
// t = 20) hold 2 blocks in each pool; their next step starts a third block in both (ceil(21 / 10) -
// ceil(20 / 10) = 1; the window W = 20 releases nothing yet: (20 - 20 + 1) / 10 = 0). The main pool
// has room for both, the window pool (4 blocks, all held) for neither: G1, the last started, is
// paused (its 2 window blocks count as free), then G0 fits. G2 (prompt 30, t = 30) needs a block in
// the main pool but none in the window one: its step first releases block 0 ((30 - 20 + 1) / 10 = 1).
TEST(CapacitySchedulerTest, MaxUtilizationPausesForAWindowPool) {
  std::vector<std::unique_ptr<LlmRequest>> requests;
  KVCacheManager kv(100, kTokensPerBlock, kMaxSeqLen);
  KVCacheManager window(4, kTokensPerBlock, kMaxSeqLen, false, 0, kDefaultSecondaryOffloadMinPriority, 20);
  KVCacheManager wide_window(7, kTokensPerBlock, kMaxSeqLen, false, 0, kDefaultSecondaryOffloadMinPriority, 20);
  for (RequestIdType id = 0; id < 2; ++id) {
    requests.push_back(std::make_unique<LlmRequest>(id, 10, std::vector<TokenIdType>(20, 1)));
    requests.back()->set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
    requests.back()->add_new_token(3);
    kv.add_sequence(id, 20, 1);
    window.add_sequence(id, 20, 1);
  }
  LlmRequest& g0 = *requests[0];
  LlmRequest& g1 = *requests[1];
  EXPECT_EQ(window.get_needed_blocks_one_step(g0, false), 1);
  EXPECT_EQ(window.num_free_blocks(), 0);

  CapacityScheduler const scheduler(8, CapacitySchedulerPolicy::kMAX_UTILIZATION);
  auto out = scheduler.schedule({&g0, &g1}, &kv);
  EXPECT_EQ(out.fitting_requests, (RequestVector{&g0, &g1}));
  EXPECT_TRUE(out.paused_requests.empty());
  out = scheduler.schedule({&g0, &g1}, &kv, {&window});
  EXPECT_EQ(out.fitting_requests, RequestVector{&g0});
  EXPECT_EQ(out.paused_requests, RequestVector{&g1});
  EXPECT_EQ(kv.scheduling_num_free_blocks(), 96 + 2);  // the victim was removed from every manager
  EXPECT_EQ(window.scheduling_num_free_blocks(), 2);

  LlmRequest g2(2, 10, std::vector<TokenIdType>(30, 1));
  g2.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  g2.add_new_token(3);
  wide_window.add_sequence(2, 30, 1);  // 4 of 7 blocks free
  EXPECT_EQ(kv.get_needed_blocks_one_step(g2, false), 1);
  EXPECT_EQ(wide_window.get_needed_blocks_one_step(g2, false), 0);
  // Two steps (t + 2 = 32 tokens): still one new block, less the released one.
  EXPECT_EQ(wide_window.get_needed_blocks_one_step(g2, true), 0);
  out = scheduler.schedule({&g2}, &kv, {&wide_window});
  EXPECT_EQ(out.fitting_requests, RequestVector{&g2});
}

}  // namespace
}  // namespace inflight::batch_manager
