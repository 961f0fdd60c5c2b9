// CapacityScheduler: which active requests may hold KV memory this step (and which are paused).
#pragma once

#include <optional>
#include <vector>

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
  //
  // window_managers: the KV managers of the sliding-window layers (VSWA), each with its own pool (not
  // nullptr; ignored without kv_cache_manager). A request fits only where it fits in every pool: the
  // no-evict policies reserve and check per manager, MAX_UTILIZATION plans each manager's step
  // against its own scheduling_num_free_blocks() and removes a paused request from all of them. The
  // duplicate-prefill marks and reuse checks are kv_cache_manager's alone. Throws
  // std::invalid_argument for a nullptr window manager.
  CapacitySchedulerOutput schedule(RequestVector const& active_requests, KVCacheManager* kv_cache_manager,
                                   std::vector<KVCacheManager*> const& window_managers = {}) const;

  SizeType32 max_num_requests() const { return max_num_requests_; }
  CapacitySchedulerPolicy policy() const { return policy_; }
  LlmRequestState no_schedule_until_state() const { return no_schedule_until_state_; }
  LlmRequestState no_schedule_after_state() const { return no_schedule_after_state_; }
  bool two_steps_lookahead() const { return two_steps_lookahead_; }

 private:
  CapacitySchedulerOutput schedule_max_requests(RequestVector const& active_requests) const;
  // managers: kv_cache_manager first, then the window managers (none null).
  CapacitySchedulerOutput schedule_no_evict(RequestVector const& active_requests,
                                            std::vector<KVCacheManager*> const& managers, bool static_batch) const;
  CapacitySchedulerOutput schedule_max_utilization(RequestVector const& active_requests,
                                                   std::vector<KVCacheManager*> const& managers) const;
  bool in_window(LlmRequest const& request) const;

  SizeType32 max_num_requests_;
  CapacitySchedulerPolicy policy_;
  LlmRequestState no_schedule_until_state_;
  LlmRequestState no_schedule_after_state_;
  bool two_steps_lookahead_;
};

}  // namespace inflight::batch_manager
