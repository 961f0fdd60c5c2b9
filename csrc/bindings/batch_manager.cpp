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
#include "inflight/batch_manager/kv_cache_manager.h"
#include "inflight/batch_manager/llm_request.h"
#include "inflight/batch_manager/micro_batch_scheduler.h"
#include "inflight/batch_manager/sequence_slot_manager.h"
#include "request_list.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace inflight::bindings {
namespace bm = inflight::batch_manager;

namespace {

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

using BlockTableArray = nb::ndarray<std::int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Int32Vector = nb::ndarray<std::int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// A NumPy array that owns `values` (shape [values.size() / cols, cols], or 1-D when cols == 0).
template <typename T>
nb::ndarray<nb::numpy, T> owned_array(std::vector<T> values, std::size_t cols = 0) {
  auto* heap = new std::vector<T>(std::move(values));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  std::size_t const shape[2] = {cols == 0 ? heap->size() : heap->size() / cols, cols};
  return nb::ndarray<nb::numpy, T>(heap->data(), cols == 0 ? 1 : 2, shape, owner);
}

std::vector<std::int32_t> to_vector(Int32Vector const& a) { return {a.data(), a.data() + a.shape(0)}; }

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
  nb::class_<bm::KvCacheStats>(m, "KvCacheStats")
      .def(nb::init<>())
      .def_rw("max_num_blocks", &bm::KvCacheStats::max_num_blocks)
      .def_rw("free_num_blocks", &bm::KvCacheStats::free_num_blocks)
      .def_rw("used_num_blocks", &bm::KvCacheStats::used_num_blocks)
      .def_rw("tokens_per_block", &bm::KvCacheStats::tokens_per_block)
      .def_rw("alloc_total_blocks", &bm::KvCacheStats::alloc_total_blocks)
      .def_rw("alloc_new_blocks", &bm::KvCacheStats::alloc_new_blocks)
      .def_rw("reused_blocks", &bm::KvCacheStats::reused_blocks)
      .def_rw("missed_blocks", &bm::KvCacheStats::missed_blocks)
      .def_rw("cache_hit_rate", &bm::KvCacheStats::cache_hit_rate)
      .def_rw("reusable_num_blocks", &bm::KvCacheStats::reusable_num_blocks)
      .def_rw("max_num_secondary_blocks", &bm::KvCacheStats::max_num_secondary_blocks)
      .def_rw("free_num_secondary_blocks", &bm::KvCacheStats::free_num_secondary_blocks)
      .def_rw("used_num_secondary_blocks", &bm::KvCacheStats::used_num_secondary_blocks)
      .def_rw("reusable_num_secondary_blocks", &bm::KvCacheStats::reusable_num_secondary_blocks)
      .def_rw("offloaded_blocks", &bm::KvCacheStats::offloaded_blocks)
      .def_rw("onboarded_blocks", &bm::KvCacheStats::onboarded_blocks)
      .def_rw("secondary_reused_blocks", &bm::KvCacheStats::secondary_reused_blocks)
      .def_rw("secondary_hit_rate", &bm::KvCacheStats::secondary_hit_rate)
      .def("to_dict",
           [](bm::KvCacheStats const& s) {
             nb::dict d;
             d["max_num_blocks"] = s.max_num_blocks;
             d["free_num_blocks"] = s.free_num_blocks;
             d["used_num_blocks"] = s.used_num_blocks;
             d["tokens_per_block"] = s.tokens_per_block;
             d["alloc_total_blocks"] = s.alloc_total_blocks;
             d["alloc_new_blocks"] = s.alloc_new_blocks;
             d["reused_blocks"] = s.reused_blocks;
             d["missed_blocks"] = s.missed_blocks;
             d["cache_hit_rate"] = s.cache_hit_rate;
             d["reusable_num_blocks"] = s.reusable_num_blocks;
             d["max_num_secondary_blocks"] = s.max_num_secondary_blocks;
             d["free_num_secondary_blocks"] = s.free_num_secondary_blocks;
             d["used_num_secondary_blocks"] = s.used_num_secondary_blocks;
             d["reusable_num_secondary_blocks"] = s.reusable_num_secondary_blocks;
             d["offloaded_blocks"] = s.offloaded_blocks;
             d["onboarded_blocks"] = s.onboarded_blocks;
             d["secondary_reused_blocks"] = s.secondary_reused_blocks;
             d["secondary_hit_rate"] = s.secondary_hit_rate;
             return d;
           })
      .def("__repr__", [](bm::KvCacheStats const& s) {
        std::ostringstream os;
        os << "KvCacheStats(max_num_blocks=" << s.max_num_blocks << ", free_num_blocks=" << s.free_num_blocks
           << ", used_num_blocks=" << s.used_num_blocks << ", tokens_per_block=" << s.tokens_per_block
           << ", alloc_total_blocks=" << s.alloc_total_blocks << ", alloc_new_blocks=" << s.alloc_new_blocks
           << ", reused_blocks=" << s.reused_blocks << ", missed_blocks=" << s.missed_blocks
           << ", cache_hit_rate=" << s.cache_hit_rate << ", reusable_num_blocks=" << s.reusable_num_blocks
           << ", max_num_secondary_blocks=" << s.max_num_secondary_blocks
           << ", free_num_secondary_blocks=" << s.free_num_secondary_blocks
           << ", used_num_secondary_blocks=" << s.used_num_secondary_blocks
           << ", reusable_num_secondary_blocks=" << s.reusable_num_secondary_blocks
           << ", offloaded_blocks=" << s.offloaded_blocks << ", onboarded_blocks=" << s.onboarded_blocks
           << ", secondary_reused_blocks=" << s.secondary_reused_blocks
           << ", secondary_hit_rate=" << s.secondary_hit_rate << ")";
        return os.str();
      });

  nb::class_<bm::KVCacheManager>(m, "KVCacheManager",
                                 "Accounting of a paged KV pool: block ids, prefix reuse, eviction. The "
                                 "memory itself is a tensor owned by the caller.")
      .def(nb::init<bm::SizeType32, bm::SizeType32, bm::SizeType32, bool, bm::SizeType32, bm::SizeType32>(),
           "num_blocks"_a, "tokens_per_block"_a, "max_seq_len"_a, "enable_block_reuse"_a = false,
           "num_secondary_blocks"_a = 0, "secondary_offload_min_priority"_a = bm::kDefaultSecondaryOffloadMinPriority)
      .def_prop_ro("max_num_blocks", &bm::KVCacheManager::max_num_blocks)
      .def_prop_ro("tokens_per_block", &bm::KVCacheManager::tokens_per_block)
      .def_prop_ro("max_seq_len", &bm::KVCacheManager::max_seq_len)
      .def_prop_ro("max_blocks_per_seq", &bm::KVCacheManager::max_blocks_per_seq)
      .def_prop_ro("enable_block_reuse", &bm::KVCacheManager::enable_block_reuse)
      .def_prop_ro("num_free_blocks", &bm::KVCacheManager::num_free_blocks)
      .def_prop_ro("num_used_blocks", &bm::KVCacheManager::num_used_blocks)
      .def_prop_ro("num_sequences", &bm::KVCacheManager::num_sequences)
      .def_prop_ro("scheduling_num_free_blocks", &bm::KVCacheManager::scheduling_num_free_blocks)
      .def_prop_ro("num_secondary_blocks", &bm::KVCacheManager::num_secondary_blocks)
      .def_prop_ro("num_free_secondary_blocks", &bm::KVCacheManager::num_free_secondary_blocks)
      .def_prop_ro("num_used_secondary_blocks", &bm::KVCacheManager::num_used_secondary_blocks)
      .def_prop_ro("secondary_offload_min_priority", &bm::KVCacheManager::secondary_offload_min_priority)
      .def_prop_ro("num_suspended_sequences", &bm::KVCacheManager::num_suspended_sequences)
      .def("has_sequence", &bm::KVCacheManager::has_sequence, "request_id"_a)
      .def("is_suspended", &bm::KVCacheManager::is_suspended, "request_id"_a,
           "Whether the sequence is swapped out (False for an unknown id).")
      .def("get_block_level", &bm::KVCacheManager::get_block_level, "block_id"_a,
           "PRIMARY_LEVEL (ids below max_num_blocks) or SECONDARY_LEVEL.")
      .def("add_sequence", &bm::KVCacheManager::add_sequence, "request_id"_a, "input_length"_a, "beam_width"_a = 1,
           nb::arg("request").none() = nb::none())
      .def("add_token", &bm::KVCacheManager::add_token, "request_id"_a)
      .def("add_tokens", &bm::KVCacheManager::add_tokens, "request_id"_a, "n"_a,
           "n more tokens at once (a speculative step's 1 + k), all or nothing.")
      .def("rewind", &bm::KVCacheManager::rewind, "request_id"_a, "n"_a,
           "Pops the last n tokens; blocks left empty are released, last first.")
      .def("fork_sequence", &bm::KVCacheManager::fork_sequence, "src_id"_a, "dst_id"_a,
           "Beam search: dst_id holds src_id's blocks (shared, ref-counted) and token count.")
      .def("take_block_copies", &bm::KVCacheManager::take_block_copies,
           "The (src_block, dst_block) copy-on-writes since the last call, to execute before the forward.")
      .def(
          "take_transfers",
          [](bm::KVCacheManager& kv) {
            std::vector<std::tuple<bm::KvTransferKind, bm::BlockIdType, bm::BlockIdType>> out;
            for (bm::KvBlockTransfer const& t : kv.take_transfers()) out.emplace_back(t.kind, t.src_block, t.dst_block);
            return out;
          },
          "The (kind, src_block, dst_block) moves between levels since the last call, to execute in order "
          "before the next forward (and before take_block_copies' copies).")
      .def("suspend_sequence", &bm::KVCacheManager::suspend_sequence, "request_id"_a,
           "Swap-out: the sequence's private blocks move to secondary blocks (offload transfers).")
      .def("resume_sequence", &bm::KVCacheManager::resume_sequence, "request_id"_a,
           "Swap-in: the suspended sequence's secondary blocks move to fresh primary blocks (onboard transfers).")
      .def("get_needed_blocks_to_resume", &bm::KVCacheManager::get_needed_blocks_to_resume, "request_id"_a)
      .def("get_needed_secondary_blocks_to_suspend", &bm::KVCacheManager::get_needed_secondary_blocks_to_suspend,
           "request_id"_a)
      .def("remove_sequence", &bm::KVCacheManager::remove_sequence, "request_id"_a,
           nb::arg("request").none() = nb::none())
      .def("store_context_blocks", &bm::KVCacheManager::store_context_blocks, "request"_a)
      .def("get_block_ids", &bm::KVCacheManager::get_block_ids, "request_id"_a,
           "The sequence's block ids, in token order (a copy).")
      .def("get_num_tokens", &bm::KVCacheManager::get_num_tokens, "request_id"_a)
      .def(
          "copy_block_tables",
          [](bm::KVCacheManager const& kv, RequestList const& requests, BlockTableArray out) {
            std::vector<bm::RequestIdType> request_ids;
            request_ids.reserve(requests.size());
            for (auto* p : requests.ptrs()) request_ids.push_back(p->request_id());
            nb::gil_scoped_release release;
            kv.copy_block_tables(request_ids, out.data(), static_cast<std::int64_t>(out.shape(0)),
                                 static_cast<std::int64_t>(out.shape(1)));
          },
          "requests"_a, nb::arg("out").noconvert(),
          "Writes the block ids of each request's sequence into row i of `out` (int32, C-contiguous, "
          "[rows, cols]); the rest of each written row is set to 0.")
      .def(
          "copy_block_tables",
          [](bm::KVCacheManager const& kv, std::vector<bm::RequestIdType> const& request_ids, BlockTableArray out) {
            nb::gil_scoped_release release;
            kv.copy_block_tables(request_ids, out.data(), static_cast<std::int64_t>(out.shape(0)),
                                 static_cast<std::int64_t>(out.shape(1)));
          },
          "request_ids"_a, nb::arg("out").noconvert(),
          "Writes the block ids of each sequence into row i of `out` (int32, C-contiguous, [rows, cols]); the "
          "rest of each written row is set to 0.")
      .def("get_kv_cache_stats", &bm::KVCacheManager::get_kv_cache_stats)
      .def("start_scheduling", &bm::KVCacheManager::start_scheduling)
      .def("scheduling_remove_sequence", &bm::KVCacheManager::scheduling_remove_sequence, "request_id"_a)
      .def("get_needed_blocks_one_step", &bm::KVCacheManager::get_needed_blocks_one_step, "request"_a,
           "two_steps_lookahead"_a = false)
      .def("get_remaining_blocks_to_completion", &bm::KVCacheManager::get_remaining_blocks_to_completion, "request"_a)
      .def("find_new_context_block", &bm::KVCacheManager::find_new_context_block, "request"_a)
      .def(
          "export_secondary_blocks",
          [](bm::KVCacheManager const& kv) {
            bm::KvSecondaryBlocks b = kv.export_secondary_blocks();
            return nb::make_tuple(owned_array(std::move(b.block_ids)), owned_array(std::move(b.parents)),
                                  owned_array(std::move(b.priorities)),
                                  owned_array(std::move(b.tokens), static_cast<std::size_t>(kv.tokens_per_block())));
          },
          "The secondary level's reusable prefixes as int32 arrays (block_ids [n], parents [n] (-1: a first block), "
          "priorities [n], tokens [n, tokens_per_block]), in free-queue order (docs/batch-manager.md 3.10).")
      .def(
          "import_secondary_blocks",
          [](bm::KVCacheManager& kv, Int32Vector block_ids, Int32Vector parents, Int32Vector priorities,
             BlockTableArray tokens) {
            if (tokens.shape(1) != static_cast<std::size_t>(kv.tokens_per_block())) {
              throw std::invalid_argument("import_secondary_blocks: tokens must have tokens_per_block " +
                                          std::to_string(kv.tokens_per_block()) + " columns, got " +
                                          std::to_string(tokens.shape(1)));
            }
            kv.import_secondary_blocks({to_vector(block_ids),
                                        to_vector(parents),
                                        to_vector(priorities),
                                        {tokens.data(), tokens.data() + tokens.shape(0) * tokens.shape(1)}});
          },
          "block_ids"_a, "parents"_a, "priorities"_a, "tokens"_a,
          "Adopts an export_secondary_blocks() list into this fresh manager; ValueError (state unchanged) naming "
          "the entry of a malformed list.")
      .def("offload_reusable_blocks", &bm::KVCacheManager::offload_reusable_blocks,
           "Moves the free cached primary blocks into free uncached secondary blocks (before a shutdown).")
      .def("check_integrity", &bm::KVCacheManager::check_integrity);

  // ------------------------------------------------------------------ slots
  nb::class_<bm::SequenceSlotManager>(m, "SequenceSlotManager")
      .def(nb::init<bm::SizeType32, double>(), "max_num_slots"_a, "max_idle_seconds"_a = 180.0)
      .def("get_sequence_slot", &bm::SequenceSlotManager::get_sequence_slot, "start"_a, "request_id"_a)
      .def("free_sequence_slot", &bm::SequenceSlotManager::free_sequence_slot, "request_id"_a)
      .def("free_idle_sequence_slots", &bm::SequenceSlotManager::free_idle_sequence_slots)
      .def_prop_ro("max_num_slots", &bm::SequenceSlotManager::max_num_slots)
      .def_prop_ro("num_free_slots", &bm::SequenceSlotManager::num_free_slots)
      .def_prop_ro("num_used_slots", &bm::SequenceSlotManager::num_used_slots);

  // ------------------------------------------------------------------ schedulers
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
          [](bm::CapacityScheduler const& self, nb::handle active_requests, bm::KVCacheManager* kv) {
            RequestList storage;
            RequestList const& active = as_request_list(active_requests, storage);
            bm::CapacitySchedulerOutput result;
            {
              nb::gil_scoped_release release;
              result = self.schedule(active.ptrs(), kv);
            }
            return std::make_tuple(to_request_list(result.fitting_requests, active),
                                   to_request_list(result.paused_requests, active));
          },
          "active_requests"_a, nb::arg("kv_cache_manager").none(),
          "Returns (fitting_requests, paused_requests) as RequestLists of the given request objects.");

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
