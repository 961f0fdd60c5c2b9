// Names of the batch-manager enums, as TRT-LLM spells them (without the k prefix), for messages
// and the Python bindings' __repr__.
#include "inflight/batch_manager/common.h"

namespace inflight::batch_manager {

std::string to_string(LlmRequestState state) {
  switch (state) {
    case LlmRequestState::kUNKNOWN:
      return "UNKNOWN";
    case LlmRequestState::kENCODER_INIT:
      return "ENCODER_INIT";
    case LlmRequestState::kCONTEXT_INIT:
      return "CONTEXT_INIT";
    case LlmRequestState::kGENERATION_IN_PROGRESS:
      return "GENERATION_IN_PROGRESS";
    case LlmRequestState::kGENERATION_TO_COMPLETE:
      return "GENERATION_TO_COMPLETE";
    case LlmRequestState::kGENERATION_COMPLETE:
      return "GENERATION_COMPLETE";
  }
  // A value cast from an integer that names no state: show the number rather than guess.
  return "LlmRequestState(" + std::to_string(static_cast<std::int32_t>(state)) + ")";
}

std::string to_string(CapacitySchedulerPolicy policy) {
  switch (policy) {
    case CapacitySchedulerPolicy::kMAX_UTILIZATION:
      return "MAX_UTILIZATION";
    case CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT:
      return "GUARANTEED_NO_EVICT";
    case CapacitySchedulerPolicy::kSTATIC_BATCH:
      return "STATIC_BATCH";
  }
  return "CapacitySchedulerPolicy(" + std::to_string(static_cast<std::int32_t>(policy)) + ")";
}

std::string to_string(ContextChunkingPolicy policy) {
  switch (policy) {
    case ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED:
      return "FIRST_COME_FIRST_SERVED";
    case ContextChunkingPolicy::kEQUAL_PROGRESS:
      return "EQUAL_PROGRESS";
  }
  return "ContextChunkingPolicy(" + std::to_string(static_cast<std::int32_t>(policy)) + ")";
}

}  // namespace inflight::batch_manager
