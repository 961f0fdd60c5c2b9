// LlmRequest: the per-request state the batch manager reads and advances.
//
// Invariants:
//   0 <= prepopulated_prompt_len <= context_current_position <= prompt_len
//   0 <= context_chunk_size <= prompt_len - context_current_position
//   tokens = prompt (prompt_len tokens) followed by the generated tokens
//   orig_prompt_len never changes; tokens[orig_prompt_len:] is everything generated since arrival,
//   also across pause() (which folds generated tokens into the prompt).
// Sampling parameters and anything else the executor needs live in Python (py_ attributes of a
// subclass); C++ only holds what scheduling and KV accounting use.
#pragma once

#include <optional>
#include <vector>

#include "inflight/batch_manager/common.h"

namespace inflight::batch_manager {

class LlmRequest {
 public:
  // Throws std::invalid_argument naming the argument for: empty input_tokens, max_new_tokens < 0,
  // priority outside [0, 1], beam_width < 1, kv_retention_priority outside [0, 100].
  LlmRequest(RequestIdType request_id, SizeType32 max_new_tokens, std::vector<TokenIdType> input_tokens,
             float priority = 0.5F, SizeType32 beam_width = 1,
             SizeType32 kv_retention_priority = kDefaultRetentionPriority);
  virtual ~LlmRequest() = default;

  RequestIdType request_id() const { return request_id_; }
  SizeType32 prompt_len() const { return prompt_len_; }
  SizeType32 orig_prompt_len() const { return orig_prompt_len_; }
  SizeType32 max_new_tokens() const { return max_new_tokens_; }
  float priority() const { return priority_; }
  SizeType32 beam_width() const { return beam_width_; }
  SizeType32 kv_retention_priority() const { return kv_retention_priority_; }

  LlmRequestState state() const { return state_; }
  void set_state(LlmRequestState state) { state_ = state; }
  // state >= s (the scheduling windows are half-open ranges of states).
  bool has_reached_state(LlmRequestState s) const {
    return static_cast<std::int32_t>(state_) >= static_cast<std::int32_t>(s);
  }
  bool is_context_init_state() const { return state_ == LlmRequestState::kCONTEXT_INIT; }
  // GENERATION_IN_PROGRESS or GENERATION_TO_COMPLETE (as TRT-LLM's isGenerationInProgressState).
  bool is_generation_in_progress_state() const {
    return state_ == LlmRequestState::kGENERATION_IN_PROGRESS || state_ == LlmRequestState::kGENERATION_TO_COMPLETE;
  }
  bool is_finished() const { return state_ == LlmRequestState::kGENERATION_COMPLETE; }

  FinishReason finish_reason() const { return finish_reason_; }
  void set_finish_reason(FinishReason reason) { finish_reason_ = reason; }

  // Tokens.
  std::vector<TokenIdType> const& tokens() const { return tokens_; }
  SizeType32 num_tokens() const { return static_cast<SizeType32>(tokens_.size()); }
  SizeType32 num_generated_tokens() const { return num_tokens() - prompt_len_; }
  void add_new_token(TokenIdType token) { tokens_.push_back(token); }
  // Last `n` tokens back off (e.g. a token sampled for a request that had already stopped).
  void remove_last_tokens(SizeType32 n);

  // Context chunking.
  SizeType32 context_current_position() const { return context_current_position_; }
  SizeType32 context_chunk_size() const { return context_chunk_size_; }
  SizeType32 prepopulated_prompt_len() const { return prepopulated_prompt_len_; }
  SizeType32 context_remaining_length() const { return prompt_len_ - context_current_position_; }
  // Clamps to [0, context_remaining_length()]; negative values throw.
  void set_context_chunk_size(SizeType32 size);
  bool is_first_context_chunk() const { return context_current_position_ == prepopulated_prompt_len_; }
  bool is_last_context_chunk() const { return context_current_position_ + context_chunk_size_ == prompt_len_; }
  void move_to_next_context_chunk();
  // A prefix-cache hit of `len` tokens: prepopulated = position = len, chunk clamped to what remains.
  // Throws unless 0 <= len < prompt_len.
  void set_prepopulated_prompt_len(SizeType32 len);

  // Speculative decoding: draft tokens appended to this step's input.
  std::vector<TokenIdType> const& draft_tokens() const { return draft_tokens_; }
  void set_draft_tokens(std::vector<TokenIdType> draft_tokens) { draft_tokens_ = std::move(draft_tokens); }
  SizeType32 num_draft_tokens() const { return static_cast<SizeType32>(draft_tokens_.size()); }
  bool has_draft_tokens() const { return !draft_tokens_.empty(); }
  // Keeps the first `n` draft tokens (fit_draft_tokens drops the tail).
  void truncate_draft_tokens(SizeType32 n);

  std::optional<SizeType32> seq_slot() const { return seq_slot_; }
  void set_seq_slot(std::optional<SizeType32> slot) { seq_slot_ = slot; }

  // Preemption: generated tokens fold into the prompt (capped at max_input_len), max_new_tokens
  // shrinks by what was folded, state back to CONTEXT_INIT, positions reset, chunk = whole prompt,
  // slot cleared. Recomputing from here gives the output it would have had unpaused.
  void pause(SizeType32 max_input_len);

 private:
  RequestIdType request_id_;
  SizeType32 prompt_len_;
  SizeType32 orig_prompt_len_;
  SizeType32 max_new_tokens_;
  float priority_;
  SizeType32 beam_width_;
  SizeType32 kv_retention_priority_;
  LlmRequestState state_ = LlmRequestState::kCONTEXT_INIT;
  FinishReason finish_reason_ = FinishReason::kNOT_FINISHED;
  std::vector<TokenIdType> tokens_;
  SizeType32 context_current_position_ = 0;
  SizeType32 context_chunk_size_;
  SizeType32 prepopulated_prompt_len_ = 0;
  std::vector<TokenIdType> draft_tokens_;
  std::optional<SizeType32> seq_slot_;
};

// Requests are owned by the caller (Python objects or test fixtures); the batch manager only
// borrows them for the duration of a call.
using RequestVector = std::vector<LlmRequest*>;

}  // namespace inflight::batch_manager
