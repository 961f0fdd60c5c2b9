// RequestList: an opaque, ordered list of LlmRequest objects owned by Python.
//
// The executor keeps its active requests in one of these, so a scheduling call hands C++ a ready
// vector of pointers instead of converting 1000+ Python objects at every step; results come back
// as RequestLists holding the same Python objects (identity preserved, subclasses included).
// Invariant: ptrs_[i] is the LlmRequest inside objs_[i]; objs_ holds a strong reference to each.
#pragma once

#include <nanobind/nanobind.h>

#include <vector>

#include "inflight/batch_manager/llm_request.h"

namespace inflight::bindings {

class RequestList {
 public:
  RequestList() = default;

  batch_manager::RequestVector const& ptrs() const { return ptrs_; }
  std::vector<nanobind::object> const& objs() const { return objs_; }
  std::size_t size() const { return ptrs_.size(); }

  void reserve(std::size_t n) {
    ptrs_.reserve(n);
    objs_.reserve(n);
  }
  void push_back(batch_manager::LlmRequest* ptr, nanobind::object obj) {
    ptrs_.push_back(ptr);
    objs_.push_back(std::move(obj));
  }
  void insert(std::size_t index, batch_manager::LlmRequest* ptr, nanobind::object obj) {
    ptrs_.insert(ptrs_.begin() + static_cast<std::ptrdiff_t>(index), ptr);
    objs_.insert(objs_.begin() + static_cast<std::ptrdiff_t>(index), std::move(obj));
  }
  void erase(std::size_t index) {
    ptrs_.erase(ptrs_.begin() + static_cast<std::ptrdiff_t>(index));
    objs_.erase(objs_.begin() + static_cast<std::ptrdiff_t>(index));
  }
  void clear() {
    ptrs_.clear();
    objs_.clear();
  }

 private:
  batch_manager::RequestVector ptrs_;
  std::vector<nanobind::object> objs_;
};

// Defined in batch_manager.cpp, shared by the scheduler bindings (batch_manager_schedulers.cpp).
// A RequestList passes through as is; any other iterable of LlmRequest is converted once into storage.
RequestList const& as_request_list(nanobind::handle requests, RequestList& storage);
// Maps scheduler results (pointers) back to the Python objects of `source`.
RequestList to_request_list(batch_manager::RequestVector const& result, RequestList const& source);
// The CapacityScheduler, ContextChunkingConfig and MicroBatchScheduler classes (after the enums).
void bind_schedulers(nanobind::module_& m);

}  // namespace inflight::bindings
