// MicroBatchScheduler: which of the fitting requests run in this forward pass, and with which
// context chunk sizes (token budget, batch size, chunked context, draft-token fitting).
#pragma once

#include <optional>
#include <unordered_set>

#include "inflight/batch_manager/llm_request.h"

namespace inflight::batch_manager {

struct ContextChunkingConfig {
  // Throws std::invalid_argument for chunk_unit_size < 1.
  ContextChunkingConfig(ContextChunkingPolicy policy = ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED,
                        SizeType32 chunk_unit_size = 64);
  ContextChunkingPolicy chunking_policy;
  SizeType32 chunk_unit_size;
};

struct MicroBatchSchedulerOutput {
  RequestVector context_requests;
  RequestVector generation_requests;
};

class MicroBatchScheduler {
 public:
  // No chunking config: contexts run whole. Throws std::invalid_argument for
  // max_context_length < 1 or an empty state window.
  MicroBatchScheduler(std::optional<ContextChunkingConfig> ctx_chunk_config = std::nullopt,
                      std::optional<SizeType32> max_context_length = std::nullopt,
                      LlmRequestState no_schedule_until_state = LlmRequestState::kCONTEXT_INIT,
                      LlmRequestState no_schedule_after_state = LlmRequestState::kGENERATION_TO_COMPLETE);

  // Sets context_chunk_size (and may shorten draft tokens) on the contexts it returns. Throws
  // std::invalid_argument for max_batch_size < 1 or max_num_tokens < 1, and, without chunking, for
  // a context longer than max_context_length.
  MicroBatchSchedulerOutput schedule(RequestVector const& active_requests,
                                     std::unordered_set<RequestIdType> const& inflight_request_ids,
                                     SizeType32 max_batch_size, std::optional<SizeType32> max_num_tokens) const;

  std::optional<ContextChunkingConfig> const& ctx_chunk_config() const { return ctx_chunk_config_; }
  std::optional<SizeType32> max_context_length() const { return max_context_length_; }

  // The chunking policies and draft fitting, public for tests (contexts_to_be_chunked in order).
  static void set_ctx_requests_chunk_size(RequestVector const& contexts_to_be_chunked, ContextChunkingPolicy policy,
                                          std::optional<SizeType32> ctx_tokens_capacity, SizeType32 chunk_unit_size,
                                          std::optional<SizeType32> max_context_length);
  static void fit_draft_tokens(RequestVector const& contexts_to_be_chunked,
                               std::optional<SizeType32> ctx_tokens_capacity, SizeType32 chunk_unit_size,
                               std::optional<SizeType32> max_context_length);

 private:
  std::optional<ContextChunkingConfig> ctx_chunk_config_;
  std::optional<SizeType32> max_context_length_;
  LlmRequestState no_schedule_until_state_;
  LlmRequestState no_schedule_after_state_;
};

}  // namespace inflight::batch_manager
