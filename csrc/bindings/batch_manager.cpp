// Bindings of the batch manager. Mechanical: same snake_case names as C++, read-only properties for
// getters, the GIL released around anything that loops over requests.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unordered_set.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

#include "inflight/batch_manager/capacity_scheduler.h"
#include "inflight/batch_manager/llm_request.h"
#include "inflight/batch_manager/micro_batch_scheduler.h"
#include "inflight/batch_manager/sequence_slot_manager.h"
#include "request_list.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace inflight::bindings {
namespace bm = inflight::batch_manager;

void bind_kv_cache_manager(nb::module_& m);  // kv_cache_manager.cpp

// A RequestList passes through as is; any other iterable of LlmRequest is converted once.
RequestList const& as_request_list(nb::handle requests, RequestList& storage) {
  if (nb::isinstance<RequestList>(requests)) return *nb::inst_ptr<RequestList>(requests);
  if (nb::hasattr(requests, "__len__")) storage.reserve(nb::len(requests));
  for (nb::handle item : requests) {
    bm::LlmRequest* ptr = nullptr;
    if (!nb::try_cast<bm::LlmRequest*>(item, ptr) || ptr == nullptr) {
      throw nb::type_error(
          ("expected LlmRequest objects, got " + std::string(nb::type_name(item.type()).c_str())).c_str());
    }
    storage.push_back(ptr, nb::borrow(item));
  }
  return storage;
}

// Maps scheduler results (pointers) back to the Python objects of `source`. Results are almost
// always subsequences of the input, so a merge walk finds them in O(n); anything else falls back to
// nanobind's instance lookup.
RequestList to_request_list(bm::RequestVector const& result, RequestList const& source) {
  RequestList out;
  out.reserve(result.size());
  auto const& ptrs = source.ptrs();
  auto const& objs = source.objs();
  std::size_t j = 0;
  for (bm::LlmRequest* ptr : result) {
    std::size_t k = j;
    while (k < ptrs.size() && ptrs[k] != ptr) ++k;
    if (k < ptrs.size()) {
      out.push_back(ptr, objs[k]);
      j = k + 1;
    } else {
      nb::object obj = nb::find(ptr);
      if (!obj.is_valid() || obj.is_none()) throw std::logic_error("scheduler returned a request it was not given");
      out.push_back(ptr, std::move(obj));
    }
  }
  return out;
}

namespace {

bm::LlmRequest* request_ptr(nb::handle obj) {
  bm::LlmRequest* ptr = nullptr;
  if (!nb::try_cast<bm::LlmRequest*>(obj, ptr) || ptr == nullptr) {
    throw nb::type_error(("expected an LlmRequest, got " + std::string(nb::type_name(obj.type()).c_str())).c_str());
  }
  return ptr;
}

std::size_t normalize_index(RequestList const& list, std::int64_t index) {
  auto const n = static_cast<std::int64_t>(list.size());
  if (index < 0) index += n;
  if (index < 0 || index >= n) throw nb::index_error("RequestList index out of range");
  return static_cast<std::size_t>(index);
}

template <typename T>
std::string join(std::vector<T> const& v) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << ']';
  return os.str();
}

// RequestList holds strong references, so it takes part in garbage collection (a request subclass
// may refer back to a list that holds it).
int request_list_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  for (auto const& obj : nb::inst_ptr<RequestList>(self)->objs()) Py_VISIT(obj.ptr());
  return 0;
}

int request_list_clear(PyObject* self) {
  nb::inst_ptr<RequestList>(self)->clear();
  return 0;
}

PyType_Slot request_list_slots[] = {{Py_tp_traverse, reinterpret_cast<void*>(request_list_traverse)},
                                    {Py_tp_clear, reinterpret_cast<void*>(request_list_clear)},
                                    {0, nullptr}};

}  // namespace

void bind_batch_manager(nb::module_& m) {
  // ------------------------------------------------------------------ enums
  nb::enum_<bm::LlmRequestState>(m, "LlmRequestState", nb::is_arithmetic(),
                                 "Request states; ordered, so scheduling windows compare with >=.")
      .value("UNKNOWN", bm::LlmRequestState::kUNKNOWN)
      .value("ENCODER_INIT", bm::LlmRequestState::kENCODER_INIT)
      .value("CONTEXT_INIT", bm::LlmRequestState::kCONTEXT_INIT)
      .value("GENERATION_IN_PROGRESS", bm::LlmRequestState::kGENERATION_IN_PROGRESS)
      .value("GENERATION_TO_COMPLETE", bm::LlmRequestState::kGENERATION_TO_COMPLETE)
      .value("GENERATION_COMPLETE", bm::LlmRequestState::kGENERATION_COMPLETE);
  nb::enum_<bm::FinishReason>(m, "FinishReason")
      .value("NOT_FINISHED", bm::FinishReason::kNOT_FINISHED)
      .value("END_ID", bm::FinishReason::kEND_ID)
      .value("STOP_WORDS", bm::FinishReason::kSTOP_WORDS)
      .value("LENGTH", bm::FinishReason::kLENGTH)
      .value("TIMED_OUT", bm::FinishReason::kTIMED_OUT)
      .value("CANCELLED", bm::FinishReason::kCANCELLED);
  nb::enum_<bm::CapacitySchedulerPolicy>(m, "CapacitySchedulerPolicy")
      .value("MAX_UTILIZATION", bm::CapacitySchedulerPolicy::kMAX_UTILIZATION)
      .value("GUARANTEED_NO_EVICT", bm::CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT)
      .value("STATIC_BATCH", bm::CapacitySchedulerPolicy::kSTATIC_BATCH);
  nb::enum_<bm::ContextChunkingPolicy>(m, "ContextChunkingPolicy")
      .value("FIRST_COME_FIRST_SERVED", bm::ContextChunkingPolicy::kFIRST_COME_FIRST_SERVED)
      .value("EQUAL_PROGRESS", bm::ContextChunkingPolicy::kEQUAL_PROGRESS);

  nb::enum_<bm::KvTransferKind>(m, "KvTransferKind", "A pending move of one block's KV between the KV cache levels.")
      .value("OFFLOAD", bm::KvTransferKind::kOFFLOAD)
      .value("ONBOARD", bm::KvTransferKind::kONBOARD);

  m.attr("DEFAULT_RETENTION_PRIORITY") = bm::kDefaultRetentionPriority;
  m.attr("DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY") = bm::kDefaultSecondaryOffloadMinPriority;
  m.attr("PRIMARY_LEVEL") = bm::kPrimaryLevel;
  m.attr("SECONDARY_LEVEL") = bm::kSecondaryLevel;

  // ------------------------------------------------------------------ LlmRequest
  nb::class_<bm::LlmRequest>(m, "LlmRequest",
                             "Per-request state read and advanced by the batch manager. Subclass it in "
                             "Python to attach py_ attributes; instances go straight into the schedulers.")
      .def(nb::init<bm::RequestIdType, bm::SizeType32, std::vector<bm::TokenIdType>, float, bm::SizeType32,
                    bm::SizeType32>(),
           "request_id"_a, "max_new_tokens"_a, "input_tokens"_a, "priority"_a = 0.5F, "beam_width"_a = 1,
           "kv_retention_priority"_a = bm::kDefaultRetentionPriority)
      .def_prop_ro("request_id", &bm::LlmRequest::request_id)
      .def_prop_ro("prompt_len", &bm::LlmRequest::prompt_len)
      .def_prop_ro("orig_prompt_len", &bm::LlmRequest::orig_prompt_len)
      .def_prop_ro("max_new_tokens", &bm::LlmRequest::max_new_tokens)
      .def_prop_ro("priority", &bm::LlmRequest::priority)
      .def_prop_ro("beam_width", &bm::LlmRequest::beam_width)
      .def_prop_ro("kv_retention_priority", &bm::LlmRequest::kv_retention_priority)
      .def_prop_rw("state", &bm::LlmRequest::state, &bm::LlmRequest::set_state)
      .def_prop_rw("finish_reason", &bm::LlmRequest::finish_reason, &bm::LlmRequest::set_finish_reason)
      .def("has_reached_state", &bm::LlmRequest::has_reached_state, "state"_a)
      .def_prop_ro("is_context_init_state", &bm::LlmRequest::is_context_init_state)
      .def_prop_ro("is_generation_in_progress_state", &bm::LlmRequest::is_generation_in_progress_state)
      .def_prop_ro("is_finished", &bm::LlmRequest::is_finished)
      .def(
          "get_tokens",
          [](bm::LlmRequest const& r, bm::SizeType32 start, std::optional<bm::SizeType32> end) {
            auto const& t = r.tokens();
            auto const n = static_cast<bm::SizeType32>(t.size());
            bm::SizeType32 e = end ? std::clamp(*end, 0, n) : n;
            bm::SizeType32 b = std::clamp(start, 0, e);
            return std::vector<bm::TokenIdType>(t.begin() + b, t.begin() + e);
          },
          "start"_a = 0, nb::arg("end").none() = nb::none(),
          "Tokens [start, end): the prompt followed by the generated ones.")
      .def_prop_ro("last_token", [](bm::LlmRequest const& r) { return r.tokens().back(); })
      .def_prop_ro("num_tokens", &bm::LlmRequest::num_tokens)
      .def_prop_ro("num_generated_tokens", &bm::LlmRequest::num_generated_tokens)
      .def("add_new_token", &bm::LlmRequest::add_new_token, "token"_a)
      .def("remove_last_tokens", &bm::LlmRequest::remove_last_tokens, "num_tokens"_a)
      .def_prop_ro("context_current_position", &bm::LlmRequest::context_current_position)
      .def_prop_ro("context_chunk_size", &bm::LlmRequest::context_chunk_size)
      .def_prop_ro("prepopulated_prompt_len", &bm::LlmRequest::prepopulated_prompt_len)
      .def_prop_ro("context_remaining_length", &bm::LlmRequest::context_remaining_length)
      .def("set_context_chunk_size", &bm::LlmRequest::set_context_chunk_size, "size"_a)
      .def_prop_ro("is_first_context_chunk", &bm::LlmRequest::is_first_context_chunk)
      .def_prop_ro("is_last_context_chunk", &bm::LlmRequest::is_last_context_chunk)
      .def("move_to_next_context_chunk", &bm::LlmRequest::move_to_next_context_chunk)
      .def("set_prepopulated_prompt_len", &bm::LlmRequest::set_prepopulated_prompt_len, "prepopulated_prompt_len"_a)
      .def_prop_rw("draft_tokens", &bm::LlmRequest::draft_tokens, &bm::LlmRequest::set_draft_tokens)
      .def_prop_ro("num_draft_tokens", &bm::LlmRequest::num_draft_tokens)
      .def_prop_ro("has_draft_tokens", &bm::LlmRequest::has_draft_tokens)
      .def("truncate_draft_tokens", &bm::LlmRequest::truncate_draft_tokens, "num_tokens"_a)
      .def_prop_rw("seq_slot", &bm::LlmRequest::seq_slot, &bm::LlmRequest::set_seq_slot, nb::arg("slot").none())
      .def("pause", &bm::LlmRequest::pause, "max_input_len"_a)
      .def("__repr__", [](nb::handle self) {
        auto const& r = nb::cast<bm::LlmRequest const&>(self);
        std::ostringstream os;
        os << nb::type_name(self.type()).c_str() << "(request_id=" << r.request_id()
           << ", state=" << bm::to_string(r.state()) << ", prompt_len=" << r.prompt_len()
           << ", num_generated_tokens=" << r.num_generated_tokens()
           << ", context_current_position=" << r.context_current_position() << ")";
        return os.str();
      });

  // ------------------------------------------------------------------ RequestList
  nb::class_<RequestList>(m, "RequestList", nb::type_slots(request_list_slots),
                          "Ordered list of LlmRequest objects that C++ reads without conversion. The "
                          "schedulers accept it (or any iterable of requests) and return RequestLists of "
                          "the same objects.")
      .def(nb::init<>())
      .def(
          "__init__",
          [](RequestList* self, nb::iterable requests) {
            new (self) RequestList();
            for (nb::handle item : requests) self->push_back(request_ptr(item), nb::borrow(item));
          },
          "requests"_a)
      .def("__len__", &RequestList::size)
      .def("__bool__", [](RequestList const& l) { return l.size() != 0; })
      .def("__getitem__", [](RequestList const& l, std::int64_t i) { return l.objs()[normalize_index(l, i)]; })
      .def("__iter__",
           [](nb::handle self) {
             // A list snapshot: cheap (refcount bumps), and safe if the list is mutated while iterating.
             auto const& l = nb::cast<RequestList const&>(self);
             nb::list items;
             for (auto const& obj : l.objs()) items.append(obj);
             return nb::iter(items);
           })
      .def("__contains__",
           [](RequestList const& l, nb::handle obj) {
             for (auto const& o : l.objs())
               if (o.is(obj)) return true;
             return false;
           })
      .def(
          "append", [](RequestList& l, nb::handle obj) { l.push_back(request_ptr(obj), nb::borrow(obj)); }, "request"_a)
      .def(
          "extend",
          [](RequestList& l, nb::iterable requests) {
            for (nb::handle item : requests) l.push_back(request_ptr(item), nb::borrow(item));
          },
          "requests"_a)
      .def(
          "insert",
          [](RequestList& l, std::int64_t index, nb::handle obj) {
            auto const n = static_cast<std::int64_t>(l.size());
            if (index < 0) index += n;
            index = std::clamp<std::int64_t>(index, 0, n);
            l.insert(static_cast<std::size_t>(index), request_ptr(obj), nb::borrow(obj));
          },
          "index"_a, "request"_a)
      .def(
          "insert_by_priority",
          [](RequestList& l, nb::handle obj) {
            // Descending priority, FIFO within equal priority: after the last request whose priority
            // is >= the new one's.
            bm::LlmRequest* ptr = request_ptr(obj);
            std::size_t pos = l.size();
            while (pos > 0 && l.ptrs()[pos - 1]->priority() < ptr->priority()) --pos;
            l.insert(pos, ptr, nb::borrow(obj));
          },
          "request"_a, "Inserts keeping descending priority, FIFO within equal priority.")
      .def(
          "remove",
          [](RequestList& l, nb::handle obj) {
            for (std::size_t i = 0; i < l.size(); ++i) {
              if (l.objs()[i].is(obj)) {
                l.erase(i);
                return;
              }
            }
            throw nb::value_error("RequestList.remove(x): x not in list");
          },
          "request"_a)
      .def(
          "remove_ids",
          [](RequestList& l, std::unordered_set<bm::RequestIdType> const& ids) {
            RequestList kept;
            kept.reserve(l.size());
            for (std::size_t i = 0; i < l.size(); ++i) {
              if (ids.count(l.ptrs()[i]->request_id()) == 0) kept.push_back(l.ptrs()[i], l.objs()[i]);
            }
            l = std::move(kept);
          },
          "request_ids"_a, "Removes every request whose id is in request_ids (one pass).")
      .def(
          "pop",
          [](RequestList& l, std::int64_t i) {
            std::size_t idx = normalize_index(l, i);
            nb::object obj = l.objs()[idx];
            l.erase(idx);
            return obj;
          },
          "index"_a = -1)
      .def("clear", &RequestList::clear)
      .def(
          "__add__",
          [](RequestList const& a, RequestList const& b) {
            RequestList out;
            out.reserve(a.size() + b.size());
            for (std::size_t i = 0; i < a.size(); ++i) out.push_back(a.ptrs()[i], a.objs()[i]);
            for (std::size_t i = 0; i < b.size(); ++i) out.push_back(b.ptrs()[i], b.objs()[i]);
            return out;
          },
          "other"_a, "Concatenation (e.g. context + generation requests of one batch).")
      .def(
          "request_ids",
          [](RequestList const& l) {
            std::vector<bm::RequestIdType> ids;
            ids.reserve(l.size());
            for (auto* p : l.ptrs()) ids.push_back(p->request_id());
            return ids;
          },
          "The request ids, in order.")
      .def("__repr__", [](RequestList const& l) {
        std::vector<bm::RequestIdType> ids;
        for (auto* p : l.ptrs()) ids.push_back(p->request_id());
        return "RequestList(request_ids=" + join(ids) + ")";
      });

  // ------------------------------------------------------------------ KV cache
  bind_kv_cache_manager(m);

  // ------------------------------------------------------------------ slots
  nb::class_<bm::SequenceSlotManager>(m, "SequenceSlotManager")
      .def(nb::init<bm::SizeType32, double>(), "max_num_slots"_a, "max_idle_seconds"_a = 180.0)
      .def("get_sequence_slot", &bm::SequenceSlotManager::get_sequence_slot, "start"_a, "request_id"_a)
      .def("free_sequence_slot", &bm::SequenceSlotManager::free_sequence_slot, "request_id"_a)
      .def("free_idle_sequence_slots", &bm::SequenceSlotManager::free_idle_sequence_slots)
      .def_prop_ro("max_num_slots", &bm::SequenceSlotManager::max_num_slots)
      .def_prop_ro("num_free_slots", &bm::SequenceSlotManager::num_free_slots)
      .def_prop_ro("num_used_slots", &bm::SequenceSlotManager::num_used_slots);

  bind_schedulers(m);  // batch_manager_schedulers.cpp
}

}  // namespace inflight::bindings
