// LlmRequest: validation at construction and the chunk / pause bookkeeping (TRT-LLM semantics).
#include "inflight/batch_manager/llm_request.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace inflight::batch_manager {

namespace {

// Messages name the argument, the allowed range and the offending value, so a Python caller sees
// which of its inputs was wrong without reading C++.
template <typename T>
[[noreturn]] void throw_invalid(char const* name, char const* allowed, T const& value) {
  std::ostringstream message;
  message << name << " must be " << allowed << ", got " << value;
  throw std::invalid_argument(message.str());
}

}  // namespace

LlmRequest::LlmRequest(RequestIdType request_id, SizeType32 max_new_tokens, std::vector<TokenIdType> input_tokens,
                       float priority, SizeType32 beam_width, SizeType32 kv_retention_priority)
    : request_id_(request_id),
      prompt_len_(static_cast<SizeType32>(input_tokens.size())),
      orig_prompt_len_(prompt_len_),
      max_new_tokens_(max_new_tokens),
      priority_(priority),
      beam_width_(beam_width),
      kv_retention_priority_(kv_retention_priority),
      tokens_(std::move(input_tokens)),
      context_chunk_size_(prompt_len_) {
  if (tokens_.empty()) {
    throw std::invalid_argument("input_tokens must not be empty, got 0 tokens");
  }
  if (max_new_tokens < 0) {
    throw_invalid("max_new_tokens", ">= 0", max_new_tokens);
  }
  // Written as a negated range test so that NaN is rejected too.
  if (!(priority >= 0.0F && priority <= 1.0F)) {
    throw_invalid("priority", "in [0, 1]", priority);
  }
  if (beam_width < 1) {
    throw_invalid("beam_width", ">= 1", beam_width);
  }
  if (kv_retention_priority < kMinRetentionPriority || kv_retention_priority > kMaxRetentionPriority) {
    throw_invalid("kv_retention_priority", "in [0, 100]", kv_retention_priority);
  }
}

void LlmRequest::remove_last_tokens(SizeType32 n) {
  // Only generated tokens may be backed off: the prompt is what the KV cache was built from.
  if (n < 0 || n > num_generated_tokens()) {
    std::ostringstream message;
    message << "n must be in [0, " << num_generated_tokens() << "] (generated tokens), got " << n;
    throw std::invalid_argument(message.str());
  }
  tokens_.resize(tokens_.size() - static_cast<std::size_t>(n));
}

void LlmRequest::set_context_chunk_size(SizeType32 size) {
  if (size < 0) {
    throw_invalid("context_chunk_size", ">= 0", size);
  }
  // Clamping (rather than throwing) is what lets the chunking policies grow chunks by whole units
  // without knowing how much each context has left.
  context_chunk_size_ = std::min(size, context_remaining_length());
}

void LlmRequest::move_to_next_context_chunk() {
  context_current_position_ += context_chunk_size_;
  context_chunk_size_ = 0;
}

void LlmRequest::set_prepopulated_prompt_len(SizeType32 len) {
  // The last prompt token is never reused (its logits are needed), hence len < prompt_len.
  if (len < 0 || len >= prompt_len_) {
    std::ostringstream message;
    message << "prepopulated_prompt_len must be in [0, " << prompt_len_ << "), got " << len;
    throw std::invalid_argument(message.str());
  }
  prepopulated_prompt_len_ = len;
  context_current_position_ = len;
  context_chunk_size_ = std::min(context_chunk_size_, context_remaining_length());
}

void LlmRequest::truncate_draft_tokens(SizeType32 n) {
  if (n < 0) {
    throw_invalid("n", ">= 0", n);
  }
  if (static_cast<std::size_t>(n) < draft_tokens_.size()) {
    draft_tokens_.resize(static_cast<std::size_t>(n));
  }
}

void LlmRequest::pause(SizeType32 max_input_len) {
  if (max_input_len < 1) {
    throw_invalid("max_input_len", ">= 1", max_input_len);
  }
  // Folding the generated tokens into the prompt makes the recomputation a plain prefill; whatever
  // the cap cuts off is generated again, so max_new_tokens only shrinks by what was folded.
  SizeType32 const new_prompt_len = std::min(max_input_len, num_tokens());
  tokens_.resize(static_cast<std::size_t>(new_prompt_len));
  max_new_tokens_ -= new_prompt_len - prompt_len_;
  prompt_len_ = new_prompt_len;
  state_ = LlmRequestState::kCONTEXT_INIT;
  context_current_position_ = 0;
  prepopulated_prompt_len_ = 0;
  context_chunk_size_ = prompt_len_;
  seq_slot_.reset();
  // Drafts were proposed for the old position; they are stale after a recompute.
  draft_tokens_.clear();
}

}  // namespace inflight::batch_manager
