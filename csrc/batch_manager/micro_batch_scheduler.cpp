// MicroBatchScheduler: TRT-LLM's MicroBatchScheduler (token budget, batch size, context chunking,
// draft-token fitting). Semantics: docs/batch-manager.md.
#include "inflight/batch_manager/micro_batch_scheduler.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace inflight::batch_manager {

ContextChunkingConfig::ContextChunkingConfig(ContextChunkingPolicy policy, SizeType32 chunk_unit_size)
    : chunking_policy(policy), chunk_unit_size(chunk_unit_size) {
  if (chunk_unit_size < 1) {
    throw std::invalid_argument("chunk_unit_size must be >= 1, got " + std::to_string(chunk_unit_size));
  }
  if (policy != ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED && policy != ContextChunkingPolicy::kEQUAL_PROGRESS) {
    throw std::invalid_argument("chunking_policy must be FIRST_COME_FIRST_SERVED or EQUAL_PROGRESS, got " +
                                std::to_string(static_cast<std::int32_t>(policy)));
  }
}

MicroBatchScheduler::MicroBatchScheduler(std::optional<ContextChunkingConfig> ctx_chunk_config,
                                         std::optional<SizeType32> max_context_length,
                                         LlmRequestState no_schedule_until_state,
                                         LlmRequestState no_schedule_after_state)
    : ctx_chunk_config_(ctx_chunk_config),
      max_context_length_(max_context_length),
      no_schedule_until_state_(no_schedule_until_state),
      no_schedule_after_state_(no_schedule_after_state) {
  if (max_context_length && *max_context_length < 1) {
    throw std::invalid_argument("max_context_length must be >= 1, got " + std::to_string(*max_context_length));
  }
  if (static_cast<std::int32_t>(no_schedule_until_state) >= static_cast<std::int32_t>(no_schedule_after_state)) {
    throw std::invalid_argument("no_schedule_until_state (" + to_string(no_schedule_until_state) +
                                ") must be before no_schedule_after_state (" + to_string(no_schedule_after_state) +
                                "): the state window is empty");
  }
}

void MicroBatchScheduler::fit_draft_tokens(RequestVector const& contexts_to_be_chunked,
                                           std::optional<SizeType32> ctx_tokens_capacity, SizeType32 chunk_unit_size,
                                           std::optional<SizeType32> max_context_length) {
  if (chunk_unit_size < 1) {
    throw std::invalid_argument("chunk_unit_size must be >= 1, got " + std::to_string(chunk_unit_size));
  }
  std::int64_t used = 0;
  for (LlmRequest const* request : contexts_to_be_chunked) {
    used += request->context_chunk_size();
  }
  for (LlmRequest* request : contexts_to_be_chunked) {
    if (!request->is_last_context_chunk() || !request->has_draft_tokens()) {
      continue;
    }
    SizeType32 const chunk = request->context_chunk_size();
    // Drafts may only fill the unit the chunk already occupies: each new unit costs a KV block.
    std::int64_t room = (chunk_unit_size - chunk % chunk_unit_size) % chunk_unit_size;
    if (max_context_length) {
      room = std::min<std::int64_t>(room, *max_context_length - chunk);
    }
    if (ctx_tokens_capacity) {
      room = std::min<std::int64_t>(room, *ctx_tokens_capacity - used);
    }
    room = std::max<std::int64_t>(room, 0);
    SizeType32 const num_draft = request->num_draft_tokens();
    used += std::min<std::int64_t>(room, num_draft);
    if (room < num_draft) {
      request->truncate_draft_tokens(static_cast<SizeType32>(room));
    }
  }
}

void MicroBatchScheduler::set_ctx_requests_chunk_size(RequestVector const& contexts_to_be_chunked,
                                                      ContextChunkingPolicy policy,
                                                      std::optional<SizeType32> ctx_tokens_capacity,
                                                      SizeType32 chunk_unit_size,
                                                      std::optional<SizeType32> max_context_length) {
  if (chunk_unit_size < 1) {
    throw std::invalid_argument("chunk_unit_size must be >= 1, got " + std::to_string(chunk_unit_size));
  }
  for (LlmRequest* request : contexts_to_be_chunked) {
    request->set_context_chunk_size(0);
  }
  switch (policy) {
    case ContextChunkingPolicy::kEQUAL_PROGRESS: {
      std::int64_t num_ctx_tokens = 0;
      std::int64_t grew = 1;
      while ((!ctx_tokens_capacity || num_ctx_tokens < *ctx_tokens_capacity) && grew > 0) {
        grew = 0;
        for (LlmRequest* request : contexts_to_be_chunked) {
          SizeType32 const past = request->context_chunk_size();
          // Clamped by set_context_chunk_size, so a context near its end grows by less than a unit.
          request->set_context_chunk_size(past + chunk_unit_size);
          SizeType32 const increment = request->context_chunk_size() - past;
          if ((ctx_tokens_capacity && num_ctx_tokens + increment > *ctx_tokens_capacity) ||
              (max_context_length && request->context_chunk_size() > *max_context_length)) {
            request->set_context_chunk_size(past);
            continue;
          }
          num_ctx_tokens += increment;
          grew += increment;
        }
      }
      break;
    }
    case ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED: {
      std::optional<SizeType32> capacity = ctx_tokens_capacity;
      for (LlmRequest* request : contexts_to_be_chunked) {
        SizeType32 const suggested = request->context_remaining_length();
        SizeType32 actual = suggested;
        if (capacity) {
          actual = std::min(*capacity, actual);
        }
        if (max_context_length) {
          actual = std::min(*max_context_length, actual);
        }
        // A capped chunk ends on a unit boundary so the next chunk starts on a fresh KV block.
        if (actual != suggested) {
          actual = actual / chunk_unit_size * chunk_unit_size;
        }
        request->set_context_chunk_size(actual);
        if (capacity) {
          *capacity -= actual;
        }
      }
      break;
    }
    default:
      throw std::invalid_argument("policy must be FIRST_COME_FIRST_SERVED or EQUAL_PROGRESS, got " +
                                  std::to_string(static_cast<std::int32_t>(policy)));
  }
}

MicroBatchSchedulerOutput MicroBatchScheduler::schedule(RequestVector const& active_requests,
                                                        std::unordered_set<RequestIdType> const& inflight_request_ids,
                                                        SizeType32 max_batch_size,
                                                        std::optional<SizeType32> max_num_tokens) const {
  if (max_batch_size < 1) {
    throw std::invalid_argument("max_batch_size must be >= 1, got " + std::to_string(max_batch_size));
  }
  if (max_num_tokens && *max_num_tokens < 1) {
    throw std::invalid_argument("max_num_tokens must be >= 1, got " + std::to_string(*max_num_tokens));
  }

  MicroBatchSchedulerOutput output;
  RequestVector& contexts = output.context_requests;
  RequestVector& generations = output.generation_requests;
  std::size_t const max_outputs = std::min(active_requests.size(), static_cast<std::size_t>(max_batch_size));
  contexts.reserve(max_outputs);
  generations.reserve(max_outputs);

  // With a chunking config every context goes through the chunking path, so the contexts to be
  // chunked are collected straight into the output (same order) and filtered at the end.
  bool const chunking = ctx_chunk_config_.has_value();
  std::int64_t batch_num_tokens = 0;
  std::int64_t num_chunked_tokens = 0;
  SizeType32 scheduled_req_size = 0;
  bool all_context_requests_fit = true;

  for (LlmRequest* request : active_requests) {
    if (!request->has_reached_state(no_schedule_until_state_) || request->has_reached_state(no_schedule_after_state_)) {
      continue;
    }
    if (!inflight_request_ids.empty() && inflight_request_ids.count(request->request_id()) != 0) {
      continue;
    }

    if (request->is_context_init_state()) {
      if (!chunking) {
        std::int64_t const num_tokens =
            static_cast<std::int64_t>(request->context_remaining_length()) + request->num_draft_tokens();
        if (max_context_length_ && num_tokens > *max_context_length_) {
          throw std::invalid_argument("context of request " + std::to_string(request->request_id()) + " has " +
                                      std::to_string(num_tokens) + " tokens, more than max_context_length " +
                                      std::to_string(*max_context_length_) + " (enable context chunking)");
        }
        if (max_num_tokens && batch_num_tokens + num_tokens > *max_num_tokens) {
          break;
        }
        batch_num_tokens += num_tokens;
        request->set_context_chunk_size(request->context_remaining_length());
        contexts.push_back(request);
      } else {
        request->set_context_chunk_size(request->context_remaining_length());
        SizeType32 const drafts =
            (request->is_last_context_chunk() && request->has_draft_tokens()) ? request->num_draft_tokens() : 0;
        std::int64_t const num_tokens = static_cast<std::int64_t>(request->context_chunk_size()) + drafts;
        if (max_context_length_ && num_tokens > *max_context_length_) {
          all_context_requests_fit = false;
        }
        contexts.push_back(request);
        num_chunked_tokens += num_tokens;
      }
    } else {
      std::int64_t const num_tokens = static_cast<std::int64_t>(request->beam_width()) + request->num_draft_tokens();
      if (max_num_tokens && batch_num_tokens + num_tokens > *max_num_tokens) {
        break;
      }
      batch_num_tokens += num_tokens;
      generations.push_back(request);
    }

    if (++scheduled_req_size >= max_batch_size) {
      break;
    }
  }

  if (chunking) {
    std::optional<SizeType32> capacity;
    if (max_num_tokens) {
      capacity = static_cast<SizeType32>(*max_num_tokens - batch_num_tokens);
      if (num_chunked_tokens > *capacity) {
        all_context_requests_fit = false;
      }
    }
    SizeType32 const unit = ctx_chunk_config_->chunk_unit_size;
    if (!all_context_requests_fit) {
      set_ctx_requests_chunk_size(contexts, ctx_chunk_config_->chunking_policy, capacity, unit, max_context_length_);
    }
    fit_draft_tokens(contexts, capacity, unit, max_context_length_);
    std::erase_if(contexts, [](LlmRequest const* request) { return request->context_chunk_size() == 0; });
  }
  return output;
}

}  // namespace inflight::batch_manager
