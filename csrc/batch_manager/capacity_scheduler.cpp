// CapacityScheduler: TRT-LLM's MaxRequests / GuaranteedNoEvict / StaticBatch / MaxUtilization
// schedulers behind one class. Semantics: docs/batch-manager.md.
#include "inflight/batch_manager/capacity_scheduler.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace inflight::batch_manager {

namespace {

// Set of 64-bit block keys with open addressing in one flat array: a std::unordered_set would
// allocate a node per inserted key, i.e. per context request in the scheduling loop.
class FlatKeySet {
 public:
  // Room for `max_keys` keys at load factor <= 1/2; one allocation (none for 0 keys, in which
  // case insert() must not be called).
  explicit FlatKeySet(std::size_t max_keys) {
    if (max_keys == 0) {
      return;
    }
    std::size_t capacity = 16;
    while (capacity < 2 * max_keys) {
      capacity *= 2;
    }
    slots_.assign(capacity, kEmpty);
    mask_ = capacity - 1;
  }

  // True when the key was not present.
  bool insert(std::uint64_t key) {
    // kEmpty marks free slots, so that one key value is tracked by a flag instead.
    if (key == kEmpty) {
      bool const inserted = !has_empty_key_;
      has_empty_key_ = true;
      return inserted;
    }
    // Keys are already hashes, but mix anyway so that structured keys do not cluster.
    for (std::size_t i = mix(key) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i] == key) {
        return false;
      }
      if (slots_[i] == kEmpty) {
        slots_[i] = key;
        return true;
      }
    }
  }

 private:
  static constexpr std::uint64_t kEmpty = 0;
  static std::size_t mix(std::uint64_t key) {
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    return static_cast<std::size_t>(key);
  }
  std::vector<std::uint64_t> slots_;
  std::size_t mask_ = 0;
  bool has_empty_key_ = false;
};

// Delays prefills whose first uncached block another context is already producing: waiting one
// step lets them hit that block instead of computing (and allocating) it a second time.
class DuplicatePrefillFilter {
 public:
  DuplicatePrefillFilter(KVCacheManager const& kv, bool enabled, std::size_t num_requests)
      : kv_(kv), enabled_(enabled), produced_(enabled ? num_requests : 0) {}

  // Contexts already past their first chunk cannot be delayed; what they produce is claimed first.
  template <typename InWindow>
  void mark_executing_contexts(RequestVector const& active_requests, InWindow const& in_window) {
    if (!enabled_) {
      return;
    }
    for (LlmRequest const* request : active_requests) {
      if (in_window(*request) && request->is_context_init_state() && !request->is_first_context_chunk()) {
        if (auto const key = kv_.find_new_context_block(*request)) {
          produced_.insert(*key);
        }
      }
    }
  }

  // True when `request` should wait this step; otherwise claims its first new block.
  bool should_skip(LlmRequest const& request) {
    if (!enabled_ || !request.is_context_init_state() || !request.is_first_context_chunk()) {
      return false;
    }
    auto const key = kv_.find_new_context_block(request);
    return key.has_value() && !produced_.insert(*key);
  }

 private:
  KVCacheManager const& kv_;
  bool enabled_;
  // Each request inserts at most one key.
  FlatKeySet produced_;
};

std::size_t output_capacity(RequestVector const& active_requests, SizeType32 max_num_requests) {
  return std::min(active_requests.size(), static_cast<std::size_t>(max_num_requests));
}

}  // namespace

CapacityScheduler::CapacityScheduler(SizeType32 max_num_requests, CapacitySchedulerPolicy policy,
                                     LlmRequestState no_schedule_until_state, LlmRequestState no_schedule_after_state,
                                     bool two_steps_lookahead)
    : max_num_requests_(max_num_requests),
      policy_(policy),
      no_schedule_until_state_(no_schedule_until_state),
      no_schedule_after_state_(no_schedule_after_state),
      two_steps_lookahead_(two_steps_lookahead) {
  if (max_num_requests < 1) {
    throw std::invalid_argument("max_num_requests must be >= 1, got " + std::to_string(max_num_requests));
  }
  if (static_cast<std::int32_t>(no_schedule_until_state) >= static_cast<std::int32_t>(no_schedule_after_state)) {
    throw std::invalid_argument("no_schedule_until_state (" + to_string(no_schedule_until_state) +
                                ") must be before no_schedule_after_state (" + to_string(no_schedule_after_state) +
                                "): the state window is empty");
  }
  switch (policy) {
    case CapacitySchedulerPolicy::kMAX_UTILIZATION:
    case CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT:
    case CapacitySchedulerPolicy::kSTATIC_BATCH:
      break;
    default:
      throw std::invalid_argument("policy must be MAX_UTILIZATION, GUARANTEED_NO_EVICT or STATIC_BATCH, got " +
                                  std::to_string(static_cast<std::int32_t>(policy)));
  }
}

bool CapacityScheduler::in_window(LlmRequest const& request) const {
  return request.has_reached_state(no_schedule_until_state_) && !request.has_reached_state(no_schedule_after_state_);
}

CapacitySchedulerOutput CapacityScheduler::schedule(RequestVector const& active_requests,
                                                    KVCacheManager* kv_cache_manager,
                                                    std::vector<KVCacheManager*> const& window_managers) const {
  if (kv_cache_manager == nullptr) {
    return schedule_max_requests(active_requests);
  }
  std::vector<KVCacheManager*> managers;
  managers.reserve(1 + window_managers.size());
  managers.push_back(kv_cache_manager);
  for (std::size_t j = 0; j < window_managers.size(); ++j) {
    if (window_managers[j] == nullptr) {
      throw std::invalid_argument("window_managers[" + std::to_string(j) + "] must be a KV cache manager, got null");
    }
    managers.push_back(window_managers[j]);
  }
  switch (policy_) {
    case CapacitySchedulerPolicy::kMAX_UTILIZATION:
      return schedule_max_utilization(active_requests, managers);
    case CapacitySchedulerPolicy::kSTATIC_BATCH:
      return schedule_no_evict(active_requests, managers, /*static_batch=*/true);
    case CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT:
    default:
      return schedule_no_evict(active_requests, managers, /*static_batch=*/false);
  }
}

CapacitySchedulerOutput CapacityScheduler::schedule_max_requests(RequestVector const& active_requests) const {
  CapacitySchedulerOutput output;
  output.fitting_requests.reserve(output_capacity(active_requests, max_num_requests_));
  auto const max_requests = static_cast<std::size_t>(max_num_requests_);
  for (LlmRequest* request : active_requests) {
    if (!in_window(*request)) {
      continue;
    }
    if (output.fitting_requests.size() >= max_requests) {
      break;
    }
    output.fitting_requests.push_back(request);
  }
  return output;
}

CapacitySchedulerOutput CapacityScheduler::schedule_no_evict(RequestVector const& active_requests,
                                                             std::vector<KVCacheManager*> const& managers,
                                                             bool static_batch) const {
  KVCacheManager const& kv = *managers.front();
  std::size_t const num_managers = managers.size();
  CapacitySchedulerOutput output;
  RequestVector& fitting = output.fitting_requests;
  fitting.reserve(output_capacity(active_requests, max_num_requests_));
  auto const max_requests = static_cast<std::size_t>(max_num_requests_);
  auto const in_window_fn = [this](LlmRequest const& request) { return in_window(request); };

  DuplicatePrefillFilter duplicates(kv, !static_batch && kv.enable_block_reuse(), active_requests.size());
  duplicates.mark_executing_contexts(active_requests, in_window_fn);

  // Generating requests were admitted with enough blocks to finish; they keep them. The others
  // form the pending list, which is active_requests filtered again in the second walk (same
  // order, no copy). Per manager: each pool reserves what the request needs there.
  std::vector<std::int64_t> available_blocks(num_managers, 0);
  for (LlmRequest* request : active_requests) {
    if (!in_window(*request)) {
      continue;
    }
    if (fitting.size() >= max_requests) {
      break;
    }
    if (request->is_generation_in_progress_state()) {
      fitting.push_back(request);
      for (std::size_t j = 0; j < num_managers; ++j) {
        available_blocks[j] -= managers[j]->get_remaining_blocks_to_completion(*request);
      }
    }
  }
  bool const any_generating = !fitting.empty();

  for (std::size_t j = 0; j < num_managers; ++j) {
    available_blocks[j] += managers[j]->num_free_blocks();
  }
  std::vector<std::int64_t> needed_blocks(num_managers, 0);
  for (LlmRequest* request : active_requests) {
    if (fitting.size() >= max_requests) {
      break;
    }
    if (!in_window(*request) || request->is_generation_in_progress_state()) {
      continue;
    }
    bool const starts_new_context = request->is_context_init_state() && request->is_first_context_chunk();
    // A static batch only starts when the previous one has drained.
    if (static_batch && any_generating && starts_new_context) {
      break;
    }
    if (duplicates.should_skip(*request)) {
      continue;
    }
    bool fits = true;
    for (std::size_t j = 0; j < num_managers; ++j) {
      needed_blocks[j] = managers[j]->get_remaining_blocks_to_completion(*request);
      fits = fits && needed_blocks[j] <= available_blocks[j];
    }
    if (!fits) {
      // No overtaking: a smaller request behind would otherwise starve this one indefinitely.
      break;
    }
    fitting.push_back(request);
    for (std::size_t j = 0; j < num_managers; ++j) {
      available_blocks[j] -= needed_blocks[j];
    }
  }
  return output;
}

CapacitySchedulerOutput CapacityScheduler::schedule_max_utilization(
    RequestVector const& active_requests, std::vector<KVCacheManager*> const& managers) const {
  KVCacheManager const& kv = *managers.front();
  std::size_t const num_managers = managers.size();
  CapacitySchedulerOutput output;
  RequestVector& fitting = output.fitting_requests;
  RequestVector& paused = output.paused_requests;
  fitting.reserve(output_capacity(active_requests, max_num_requests_));
  auto const max_requests = static_cast<std::size_t>(max_num_requests_);
  auto const in_window_fn = [this](LlmRequest const& request) { return in_window(request); };

  for (KVCacheManager* m : managers) {
    m->start_scheduling();
  }
  DuplicatePrefillFilter duplicates(kv, kv.enable_block_reuse(), active_requests.size());
  duplicates.mark_executing_contexts(active_requests, in_window_fn);

  // Pausing frees blocks only for requests that hold some: generating ones and contexts that
  // already ran a chunk (a context on its first chunk holds nothing yet).
  auto const started = [this](LlmRequest const& request) {
    return in_window(request) && ((request.is_context_init_state() && !request.is_first_context_chunk()) ||
                                  request.is_generation_in_progress_state());
  };

  // Per manager: the blocks this pass has planned for the scheduled requests' step.
  std::vector<std::int64_t> num_scheduled_blocks(num_managers, 0);
  std::vector<std::int64_t> needed_blocks(num_managers, 0);
  std::size_t end = active_requests.size();
  std::size_t i = 0;
  // The duplicate-prefill check runs once per request: retrying after a pause must not find the
  // block the request itself just claimed.
  std::size_t dup_checked = active_requests.size();
  while (i < end) {
    LlmRequest* request = active_requests[i];
    if (!in_window(*request)) {
      ++i;
      continue;
    }
    if (dup_checked != i) {
      dup_checked = i;
      if (duplicates.should_skip(*request)) {
        ++i;
        continue;
      }
    }
    if (fitting.size() < max_requests) {
      bool fits = true;
      for (std::size_t j = 0; j < num_managers; ++j) {
        needed_blocks[j] = managers[j]->get_needed_blocks_one_step(*request, two_steps_lookahead_);
        fits = fits && num_scheduled_blocks[j] + needed_blocks[j] <= managers[j]->scheduling_num_free_blocks();
      }
      if (fits) {
        fitting.push_back(request);
        for (std::size_t j = 0; j < num_managers; ++j) {
          num_scheduled_blocks[j] += needed_blocks[j];
        }
        ++i;
        continue;
      }
    }
    // Victim: the last started request among this one and those behind it. Requests before i are
    // already scheduled in this pass and never victims.
    std::size_t victim = end;
    for (std::size_t j = end; j-- > i;) {
      if (started(*active_requests[j])) {
        victim = j;
        break;
      }
    }
    if (victim == end) {
      break;
    }
    for (KVCacheManager* m : managers) {
      m->scheduling_remove_sequence(active_requests[victim]->request_id());
    }
    paused.push_back(active_requests[victim]);
    // The victim and everyone behind it drop out of this pass; if it was this request, the pass ends.
    end = victim;
  }
  return output;
}

}  // namespace inflight::batch_manager
