// LlmRequest: state machine, chunk bookkeeping, prepopulated prompt, pause folding, validation.
#include "inflight/batch_manager/llm_request.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace inflight::batch_manager {
namespace {

std::vector<TokenIdType> iota_tokens(SizeType32 n, TokenIdType first = 100) {
  std::vector<TokenIdType> tokens(static_cast<std::size_t>(n));
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

// Runs `fn` and checks it throws std::invalid_argument whose message contains every fragment.
template <typename Fn>
void expect_invalid_argument(Fn&& fn, std::vector<std::string> const& fragments) {
  try {
    fn();
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (std::invalid_argument const& error) {
    std::string const message = error.what();
    for (auto const& fragment : fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos) << "'" << fragment << "' not in: " << message;
    }
  }
}

TEST(LlmRequestTest, NewRequestState) {
  LlmRequest request(7, 5, iota_tokens(17), 0.25F, 1, 80);
  EXPECT_EQ(request.request_id(), 7U);
  EXPECT_EQ(request.prompt_len(), 17);
  EXPECT_EQ(request.orig_prompt_len(), 17);
  EXPECT_EQ(request.max_new_tokens(), 5);
  EXPECT_FLOAT_EQ(request.priority(), 0.25F);
  EXPECT_EQ(request.beam_width(), 1);
  EXPECT_EQ(request.kv_retention_priority(), 80);
  EXPECT_EQ(request.state(), LlmRequestState::kCONTEXT_INIT);
  EXPECT_TRUE(request.is_context_init_state());
  EXPECT_FALSE(request.is_generation_in_progress_state());
  EXPECT_FALSE(request.is_finished());
  EXPECT_EQ(request.finish_reason(), FinishReason::kNOT_FINISHED);
  EXPECT_EQ(request.context_current_position(), 0);
  EXPECT_EQ(request.prepopulated_prompt_len(), 0);
  EXPECT_EQ(request.context_chunk_size(), 17);
  EXPECT_EQ(request.context_remaining_length(), 17);
  EXPECT_TRUE(request.is_first_context_chunk());
  EXPECT_TRUE(request.is_last_context_chunk());
  EXPECT_EQ(request.num_tokens(), 17);
  EXPECT_EQ(request.num_generated_tokens(), 0);
  EXPECT_FALSE(request.has_draft_tokens());
  EXPECT_FALSE(request.seq_slot().has_value());
}

TEST(LlmRequestTest, Defaults) {
  LlmRequest request(1, 3, {5});
  EXPECT_FLOAT_EQ(request.priority(), 0.5F);
  EXPECT_EQ(request.beam_width(), 1);
  EXPECT_EQ(request.kv_retention_priority(), kDefaultRetentionPriority);
  EXPECT_EQ(request.prompt_len(), 1);
  EXPECT_EQ(request.context_chunk_size(), 1);
}

TEST(LlmRequestTest, StateWindowsCompareOrderedIntegers) {
  LlmRequest request(1, 3, iota_tokens(4));
  EXPECT_TRUE(request.has_reached_state(LlmRequestState::kENCODER_INIT));
  EXPECT_TRUE(request.has_reached_state(LlmRequestState::kCONTEXT_INIT));
  EXPECT_FALSE(request.has_reached_state(LlmRequestState::kGENERATION_IN_PROGRESS));

  request.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  EXPECT_TRUE(request.is_generation_in_progress_state());
  EXPECT_TRUE(request.has_reached_state(LlmRequestState::kGENERATION_IN_PROGRESS));
  EXPECT_FALSE(request.has_reached_state(LlmRequestState::kGENERATION_TO_COMPLETE));

  request.set_state(LlmRequestState::kGENERATION_TO_COMPLETE);
  EXPECT_TRUE(request.is_generation_in_progress_state());
  EXPECT_FALSE(request.is_context_init_state());
  EXPECT_FALSE(request.has_reached_state(LlmRequestState::kGENERATION_COMPLETE));

  request.set_state(LlmRequestState::kGENERATION_COMPLETE);
  EXPECT_TRUE(request.is_finished());
  EXPECT_FALSE(request.is_generation_in_progress_state());
  EXPECT_TRUE(request.has_reached_state(LlmRequestState::kGENERATION_COMPLETE));

  request.set_finish_reason(FinishReason::kLENGTH);
  EXPECT_EQ(request.finish_reason(), FinishReason::kLENGTH);
}

TEST(LlmRequestTest, ChunkBookkeeping) {
  LlmRequest request(1, 4, iota_tokens(25));
  request.set_context_chunk_size(10);
  EXPECT_EQ(request.context_chunk_size(), 10);
  EXPECT_TRUE(request.is_first_context_chunk());
  EXPECT_FALSE(request.is_last_context_chunk());

  request.move_to_next_context_chunk();
  EXPECT_EQ(request.context_current_position(), 10);
  EXPECT_EQ(request.context_chunk_size(), 0);
  EXPECT_EQ(request.context_remaining_length(), 15);
  EXPECT_FALSE(request.is_first_context_chunk());
  EXPECT_FALSE(request.is_last_context_chunk());

  // Clamped to what remains (15), so a unit-sized growth never overshoots the prompt.
  request.set_context_chunk_size(64);
  EXPECT_EQ(request.context_chunk_size(), 15);
  EXPECT_TRUE(request.is_last_context_chunk());

  request.set_context_chunk_size(0);
  EXPECT_EQ(request.context_chunk_size(), 0);
  EXPECT_FALSE(request.is_last_context_chunk());

  request.set_context_chunk_size(15);
  request.move_to_next_context_chunk();
  EXPECT_EQ(request.context_current_position(), 25);
  EXPECT_EQ(request.context_remaining_length(), 0);
  EXPECT_EQ(request.context_chunk_size(), 0);
  // Nothing left: any chunk clamps to 0.
  request.set_context_chunk_size(5);
  EXPECT_EQ(request.context_chunk_size(), 0);
}

TEST(LlmRequestTest, NegativeChunkThrows) {
  LlmRequest request(1, 4, iota_tokens(8));
  expect_invalid_argument([&] { request.set_context_chunk_size(-1); }, {"context_chunk_size", "-1"});
  EXPECT_EQ(request.context_chunk_size(), 8);
}

TEST(LlmRequestTest, PrepopulatedPromptLen) {
  LlmRequest request(1, 4, iota_tokens(25));
  request.set_prepopulated_prompt_len(20);
  EXPECT_EQ(request.prepopulated_prompt_len(), 20);
  EXPECT_EQ(request.context_current_position(), 20);
  EXPECT_EQ(request.context_chunk_size(), 5);  // clamped from 25
  EXPECT_TRUE(request.is_first_context_chunk());
  EXPECT_TRUE(request.is_last_context_chunk());

  LlmRequest chunked(2, 4, iota_tokens(25));
  chunked.set_context_chunk_size(8);
  chunked.set_prepopulated_prompt_len(10);
  EXPECT_EQ(chunked.context_chunk_size(), 8);  // already fits in the 15 left
  EXPECT_TRUE(chunked.is_first_context_chunk());
  chunked.move_to_next_context_chunk();
  EXPECT_EQ(chunked.context_current_position(), 18);
  EXPECT_FALSE(chunked.is_first_context_chunk());

  LlmRequest zero(3, 4, iota_tokens(5));
  zero.set_prepopulated_prompt_len(0);
  EXPECT_EQ(zero.context_current_position(), 0);
  EXPECT_EQ(zero.context_chunk_size(), 5);
}

TEST(LlmRequestTest, PrepopulatedPromptLenRange) {
  LlmRequest request(1, 4, iota_tokens(20));
  // The last prompt token is always recomputed, so a hit of the whole prompt is invalid.
  expect_invalid_argument([&] { request.set_prepopulated_prompt_len(20); }, {"prepopulated_prompt_len", "20"});
  expect_invalid_argument([&] { request.set_prepopulated_prompt_len(-1); }, {"prepopulated_prompt_len", "-1"});
  EXPECT_EQ(request.prepopulated_prompt_len(), 0);
  EXPECT_EQ(request.context_current_position(), 0);
  request.set_prepopulated_prompt_len(19);
  EXPECT_EQ(request.context_chunk_size(), 1);
}

TEST(LlmRequestTest, TokensAndRemoveLastTokens) {
  LlmRequest request(1, 8, iota_tokens(4));
  request.add_new_token(7);
  request.add_new_token(8);
  request.add_new_token(9);
  EXPECT_EQ(request.num_tokens(), 7);
  EXPECT_EQ(request.num_generated_tokens(), 3);
  request.remove_last_tokens(2);
  EXPECT_EQ(request.num_generated_tokens(), 1);
  EXPECT_EQ(request.tokens().back(), 7);
  request.remove_last_tokens(0);
  EXPECT_EQ(request.num_generated_tokens(), 1);
  expect_invalid_argument([&] { request.remove_last_tokens(2); }, {"2"});
  expect_invalid_argument([&] { request.remove_last_tokens(-1); }, {"-1"});
  request.remove_last_tokens(1);
  EXPECT_EQ(request.tokens(), iota_tokens(4));
}

TEST(LlmRequestTest, DraftTokens) {
  LlmRequest request(1, 8, iota_tokens(4));
  request.set_draft_tokens({1, 2, 3, 4, 5});
  EXPECT_TRUE(request.has_draft_tokens());
  EXPECT_EQ(request.num_draft_tokens(), 5);
  request.truncate_draft_tokens(7);  // keeping more than there are keeps all
  EXPECT_EQ(request.num_draft_tokens(), 5);
  request.truncate_draft_tokens(2);
  EXPECT_EQ(request.draft_tokens(), (std::vector<TokenIdType>{1, 2}));
  request.truncate_draft_tokens(0);
  EXPECT_FALSE(request.has_draft_tokens());
}

TEST(LlmRequestTest, PauseFoldsGeneratedTokens) {
  LlmRequest request(1, 10, iota_tokens(6));
  request.set_context_chunk_size(4);
  request.move_to_next_context_chunk();
  request.set_context_chunk_size(2);
  request.move_to_next_context_chunk();
  request.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  for (TokenIdType t = 0; t < 3; ++t) {
    request.add_new_token(500 + t);
  }
  request.set_seq_slot(3);
  request.set_draft_tokens({1, 2});
  std::vector<TokenIdType> const before = request.tokens();

  request.pause(100);
  EXPECT_EQ(request.state(), LlmRequestState::kCONTEXT_INIT);
  EXPECT_EQ(request.prompt_len(), 9);
  EXPECT_EQ(request.orig_prompt_len(), 6);
  EXPECT_EQ(request.max_new_tokens(), 7);
  EXPECT_EQ(request.tokens(), before);
  EXPECT_EQ(request.num_generated_tokens(), 0);
  EXPECT_EQ(request.context_current_position(), 0);
  EXPECT_EQ(request.prepopulated_prompt_len(), 0);
  EXPECT_EQ(request.context_chunk_size(), 9);
  EXPECT_TRUE(request.is_first_context_chunk());
  EXPECT_TRUE(request.is_last_context_chunk());
  EXPECT_FALSE(request.seq_slot().has_value());
  EXPECT_FALSE(request.has_draft_tokens());
}

TEST(LlmRequestTest, PauseCappedByMaxInputLen) {
  LlmRequest request(1, 10, iota_tokens(6));
  request.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  for (TokenIdType t = 0; t < 4; ++t) {
    request.add_new_token(500 + t);
  }
  // Only 2 of the 4 generated tokens fit under the cap; the other 2 will be generated again, so
  // max_new_tokens shrinks by 2 only.
  request.pause(8);
  EXPECT_EQ(request.prompt_len(), 8);
  EXPECT_EQ(request.max_new_tokens(), 8);
  EXPECT_EQ(request.num_tokens(), 8);
  EXPECT_EQ(request.tokens()[7], 501);
  EXPECT_EQ(request.context_chunk_size(), 8);
  // Still orig_prompt_len + max_new_tokens tokens in total at completion.
  EXPECT_EQ(request.prompt_len() + request.max_new_tokens(), request.orig_prompt_len() + 10);
}

TEST(LlmRequestTest, PauseDuringChunkedContextAndAfterReuse) {
  LlmRequest request(1, 5, iota_tokens(30));
  request.set_prepopulated_prompt_len(10);
  request.set_context_chunk_size(10);
  request.move_to_next_context_chunk();
  request.pause(1000);
  EXPECT_EQ(request.prompt_len(), 30);
  EXPECT_EQ(request.max_new_tokens(), 5);
  EXPECT_EQ(request.prepopulated_prompt_len(), 0);
  EXPECT_EQ(request.context_current_position(), 0);
  EXPECT_EQ(request.context_chunk_size(), 30);
}

TEST(LlmRequestTest, PauseTwiceKeepsTotal) {
  LlmRequest request(1, 6, iota_tokens(3));
  request.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  request.add_new_token(1);
  request.add_new_token(2);
  request.pause(64);
  EXPECT_EQ(request.prompt_len(), 5);
  EXPECT_EQ(request.max_new_tokens(), 4);
  request.set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
  request.add_new_token(3);
  request.pause(64);
  EXPECT_EQ(request.prompt_len(), 6);
  EXPECT_EQ(request.max_new_tokens(), 3);
  EXPECT_EQ(request.tokens(), (std::vector<TokenIdType>{100, 101, 102, 1, 2, 3}));
}

TEST(LlmRequestTest, PauseRejectsMaxInputLenBelowOne) {
  LlmRequest request(1, 6, iota_tokens(3));
  expect_invalid_argument([&] { request.pause(0); }, {"max_input_len", "0"});
  EXPECT_EQ(request.prompt_len(), 3);
}

TEST(LlmRequestTest, ConstructorValidation) {
  expect_invalid_argument([] { LlmRequest(1, 5, {}); }, {"input_tokens"});
  expect_invalid_argument([] { LlmRequest(1, -1, {1}); }, {"max_new_tokens", "-1"});
  expect_invalid_argument([] { LlmRequest(1, 5, {1}, 1.5F); }, {"priority must be in [0, 1], got 1.5"});
  expect_invalid_argument([] { LlmRequest(1, 5, {1}, -0.25F); }, {"priority", "-0.25"});
  expect_invalid_argument([] { LlmRequest(1, 5, {1}, std::numeric_limits<float>::quiet_NaN()); }, {"priority"});
  expect_invalid_argument([] { LlmRequest(1, 5, {1}, 0.5F, 0); }, {"beam_width", "0"});
  expect_invalid_argument([] { LlmRequest(1, 5, {1}, 0.5F, 1, 101); }, {"kv_retention_priority", "101"});
  expect_invalid_argument([] { LlmRequest(1, 5, {1}, 0.5F, 1, -1); }, {"kv_retention_priority", "-1"});
  // Boundaries are accepted.
  EXPECT_NO_THROW(LlmRequest(1, 0, {1}, 0.0F, 1, 0));
  EXPECT_NO_THROW(LlmRequest(1, 0, {1}, 1.0F, 4, 100));
}

}  // namespace
}  // namespace inflight::batch_manager
