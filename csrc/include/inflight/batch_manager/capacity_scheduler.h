// CapacityScheduler: which active requests may hold KV memory this step (and which are paused).
#pragma once

#include <optional>

#include "inflight/batch_manager/kv_cache_manager.h"
#include "inflight/batch_manager/llm_request.h"

namespace inflight::batch_manager {

struct CapacitySchedulerOutput {
  RequestVector fitting_requests;
  RequestVector paused_requests;
};

class CapacityScheduler {
 public:
  // Considers requests whose state is in [no_schedule_until_state, no_schedule_after_state).
  // Throws std::invalid_argument for max_num_requests < 1 or an empty state window.
  CapacityScheduler(SizeType32 max_num_requests,
                    CapacitySchedulerPolicy policy = CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT,
                    LlmRequestState no_schedule_until_state = LlmRequestState::kCONTEXT_INIT,
                    LlmRequestState no_schedule_after_state = LlmRequestState::kGENERATION_COMPLETE,
                    bool two_steps_lookahead = false);

  // `active_requests` in priority order (descending, FIFO within equal). Without a KV cache manager
  // (nullptr) only max_num_requests limits (TRT-LLM's MaxRequestsScheduler). MAX_UTILIZATION calls
  // kv_cache_manager->start_scheduling() and scheduling_remove_sequence() for the paused.
  CapacitySchedulerOutput schedule(RequestVector const& active_requests, KVCacheManager* kv_cache_manager) const;

  SizeType32 max_num_requests() const { return max_num_requests_; }
  CapacitySchedulerPolicy policy() const { return policy_; }
  LlmRequestState no_schedule_until_state() const { return no_schedule_until_state_; }
  LlmRequestState no_schedule_after_state() const { return no_schedule_after_state_; }
  bool two_steps_lookahead() const { return two_steps_lookahead_; }

 private:
  CapacitySchedulerOutput schedule_max_requests(RequestVector const& active_requests) const;
  CapacitySchedulerOutput schedule_no_evict(RequestVector const& active_requests, KVCacheManager& kv,
                                            bool static_batch) const;
  CapacitySchedulerOutput schedule_max_utilization(RequestVector const& active_requests, KVCacheManager& kv) const;
  bool in_window(LlmRequest const& request) const;

  SizeType32 max_num_requests_;
  CapacitySchedulerPolicy policy_;
  LlmRequestState no_schedule_until_state_;
  LlmRequestState no_schedule_after_state_;
  bool two_steps_lookahead_;
};

}  // namespace inflight::batch_manager
