// Shared scalar types and enums of the batch manager.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace inflight::batch_manager {

using RequestIdType = std::uint64_t;
using TokenIdType = std::int32_t;
using SizeType32 = std::int32_t;
using BlockIdType = std::int32_t;

// Ordered integers: scheduling windows compare with >= (TRT-LLM's values).
enum class LlmRequestState : std::int32_t {
  kUNKNOWN = 0,
  kENCODER_INIT = 1,
  kCONTEXT_INIT = 10,
  kGENERATION_IN_PROGRESS = 13,
  kGENERATION_TO_COMPLETE = 14,
  kGENERATION_COMPLETE = 20,
};

enum class FinishReason : std::int32_t {
  kNOT_FINISHED = 0,
  kEND_ID = 1,
  kSTOP_WORDS = 2,
  kLENGTH = 3,
  kTIMED_OUT = 4,
  kCANCELLED = 5,
};

enum class CapacitySchedulerPolicy : std::int32_t {
  kMAX_UTILIZATION = 0,
  kGUARANTEED_NO_EVICT = 1,
  kSTATIC_BATCH = 2,
};

enum class ContextChunkingPolicy : std::int32_t {
  kFIRST_COME_FIRST_SERVED = 0,
  kEQUAL_PROGRESS = 1,
};

// Retention priorities of KV blocks (higher is kept longer).
inline constexpr SizeType32 kMinRetentionPriority = 0;
inline constexpr SizeType32 kMaxRetentionPriority = 100;
inline constexpr SizeType32 kDefaultRetentionPriority = 35;

std::string to_string(LlmRequestState state);
std::string to_string(CapacitySchedulerPolicy policy);
std::string to_string(ContextChunkingPolicy policy);

}  // namespace inflight::batch_manager
