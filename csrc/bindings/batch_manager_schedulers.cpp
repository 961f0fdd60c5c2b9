// Bindings of the batch manager's schedulers (capacity and micro-batch), called by
// bind_batch_manager (batch_manager.cpp) once the enums and KVCacheManager are bound. Mechanical, as
// there: same snake_case names as C++, the GIL released around the scheduling calls.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unordered_set.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

#include "inflight/batch_manager/capacity_scheduler.h"
#include "inflight/batch_manager/kv_cache_manager.h"
#include "inflight/batch_manager/llm_request.h"
#include "inflight/batch_manager/micro_batch_scheduler.h"
#include "request_list.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace inflight::bindings {
namespace bm = inflight::batch_manager;

void bind_schedulers(nb::module_& m) {
  nb::class_<bm::CapacityScheduler>(m, "CapacityScheduler")
      .def(nb::init<bm::SizeType32, bm::CapacitySchedulerPolicy, bm::LlmRequestState, bm::LlmRequestState, bool>(),
           "max_num_requests"_a, "policy"_a = bm::CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT,
           "no_schedule_until_state"_a = bm::LlmRequestState::kCONTEXT_INIT,
           "no_schedule_after_state"_a = bm::LlmRequestState::kGENERATION_COMPLETE, "two_steps_lookahead"_a = false)
      .def_prop_ro("max_num_requests", &bm::CapacityScheduler::max_num_requests)
      .def_prop_ro("policy", &bm::CapacityScheduler::policy)
      .def_prop_ro("no_schedule_until_state", &bm::CapacityScheduler::no_schedule_until_state)
      .def_prop_ro("no_schedule_after_state", &bm::CapacityScheduler::no_schedule_after_state)
      .def_prop_ro("two_steps_lookahead", &bm::CapacityScheduler::two_steps_lookahead)
      .def(
          "schedule",
          [](bm::CapacityScheduler const& self, nb::handle active_requests, bm::KVCacheManager* kv,
             std::vector<bm::KVCacheManager*> const& window_managers) {
            RequestList storage;
            RequestList const& active = as_request_list(active_requests, storage);
            bm::CapacitySchedulerOutput result;
            {
              nb::gil_scoped_release release;
              result = self.schedule(active.ptrs(), kv, window_managers);
            }
            return std::make_tuple(to_request_list(result.fitting_requests, active),
                                   to_request_list(result.paused_requests, active));
          },
          "active_requests"_a, nb::arg("kv_cache_manager").none(),
          "window_managers"_a = std::vector<bm::KVCacheManager*>{},
          "Returns (fitting_requests, paused_requests) as RequestLists of the given request objects; "
          "window_managers: the KV managers of the sliding-window layers (a request fits where it fits in all).");

  nb::class_<bm::ContextChunkingConfig>(m, "ContextChunkingConfig")
      .def(nb::init<bm::ContextChunkingPolicy, bm::SizeType32>(),
           "chunking_policy"_a = bm::ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED, "chunk_unit_size"_a = 64)
      .def_rw("chunking_policy", &bm::ContextChunkingConfig::chunking_policy)
      .def_rw("chunk_unit_size", &bm::ContextChunkingConfig::chunk_unit_size)
      .def("__repr__", [](bm::ContextChunkingConfig const& c) {
        return "ContextChunkingConfig(chunking_policy=" + bm::to_string(c.chunking_policy) +
               ", chunk_unit_size=" + std::to_string(c.chunk_unit_size) + ")";
      });

  nb::class_<bm::MicroBatchScheduler>(m, "MicroBatchScheduler")
      .def(nb::init<std::optional<bm::ContextChunkingConfig>, std::optional<bm::SizeType32>, bm::LlmRequestState,
                    bm::LlmRequestState>(),
           nb::arg("ctx_chunk_config").none() = nb::none(), nb::arg("max_context_length").none() = nb::none(),
           "no_schedule_until_state"_a = bm::LlmRequestState::kCONTEXT_INIT,
           "no_schedule_after_state"_a = bm::LlmRequestState::kGENERATION_TO_COMPLETE)
      .def_prop_ro("ctx_chunk_config", &bm::MicroBatchScheduler::ctx_chunk_config)
      .def_prop_ro("max_context_length", &bm::MicroBatchScheduler::max_context_length)
      .def(
          "schedule",
          [](bm::MicroBatchScheduler const& self, nb::handle active_requests,
             std::unordered_set<bm::RequestIdType> const& inflight_request_ids, bm::SizeType32 max_batch_size,
             std::optional<bm::SizeType32> max_num_tokens) {
            RequestList storage;
            RequestList const& active = as_request_list(active_requests, storage);
            bm::MicroBatchSchedulerOutput result;
            {
              nb::gil_scoped_release release;
              result = self.schedule(active.ptrs(), inflight_request_ids, max_batch_size, max_num_tokens);
            }
            return std::make_tuple(to_request_list(result.context_requests, active),
                                   to_request_list(result.generation_requests, active));
          },
          "active_requests"_a, "inflight_request_ids"_a, "max_batch_size"_a,
          nb::arg("max_num_tokens").none() = nb::none(),
          "Returns (context_requests, generation_requests) as RequestLists; sets the chunk sizes.");
}

}  // namespace inflight::bindings
