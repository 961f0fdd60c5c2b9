// MoeExperts: a mixture-of-experts layer's experts run by one C++ call per layer and step
// (csrc/kernels/cpu/llama_layers.h, launch_moe_experts): built once from each expert's gate_up and down
// weight objects (gemm_weights.h), then run() on the layer's rows grouped by expert.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "gemm_weights.h"
#include "llama_layers.h"
#include "registry.h"

namespace nb = nanobind;
namespace kc = inflight::kernels::cpu;
using namespace nb::literals;
using namespace inflight::bindings;
using namespace inflight::bindings::gemm;

namespace {

class MoeExperts {
 public:
  MoeExperts(std::vector<nb::object> const& gate_up, std::vector<nb::object> const& down, int hidden, int intermediate,
             std::string const& dtype, bool gelu)
      : weights_(gate_up) {
    if (gate_up.empty() || gate_up.size() != down.size()) {
      throw_value_error("gate_up and down must list the same number (>= 1) of experts, got " +
                        std::to_string(gate_up.size()) + " and " + std::to_string(down.size()));
    }
    if (hidden < 1 || intermediate < 1) {
      throw_value_error("hidden and intermediate must be >= 1, got " + std::to_string(hidden) + " and " +
                        std::to_string(intermediate));
    }
    weights_.insert(weights_.end(), down.begin(), down.end());
    p_.dtype = model_dtype_of(dtype);
    p_.hidden = hidden;
    p_.intermediate = intermediate;
    p_.gelu = gelu;
    for (std::size_t e = 0; e < gate_up.size(); ++e) {
      std::string const where = "expert " + std::to_string(e) + "'s ";
      gate_up_.push_back(linear_op(gate_up[e], where + "gate_up", hidden, 2 * std::int64_t(intermediate), p_.dtype));
      down_.push_back(linear_op(down[e], where + "down", intermediate, hidden, p_.dtype));
      for (kc::LinearOp const* op : {&gate_up_.back(), &down_.back()}) {
        if (op->kind == kc::LinearOp::Kind::kW8A8 || op->kind == kc::LinearOp::Kind::kA8) {
          throw_type_error(where + "projections must not be W8A8Weight or A8Weight");
        }
      }
    }
    p_.num_experts = int(gate_up.size());
  }

  void run(Tensor x, Tensor counts, Tensor out, int num_threads) {
    require_cpu_contiguous({{&x, "x"}, {&counts, "counts"}, {&out, "out"}});
    require_dtype(x, "x", p_.dtype);
    require_dtype(out, "out", p_.dtype);
    require_dtype(counts, "counts", ScalarType::kInt64);
    require_ndim(x, "x", 2, "[rows, hidden]");
    std::int64_t const rows = std::int64_t(x.shape(0));
    require_shape(x, "x", {rows, p_.hidden}, "[rows, hidden]");
    require_shape(out, "out", {rows, p_.hidden}, "[rows, hidden]");
    require_shape(counts, "counts", {p_.num_experts}, "[num_experts]");
    auto const* c = static_cast<std::int64_t const*>(counts.data());
    std::int64_t sum = 0;
    for (int e = 0; e < p_.num_experts; ++e) {
      if (c[e] < 0)
        throw_value_error("counts must be >= 0, got " + std::to_string(c[e]) + " for expert " + std::to_string(e));
      sum += c[e];
    }
    if (sum != rows) {
      throw_value_error("counts must sum to x's rows (" + std::to_string(rows) + "), got " + std::to_string(sum));
    }
    kc::MoeExpertsParams p = p_;
    p.gate_up = gate_up_.data();
    p.down = down_.data();
    p.counts = c;
    p.rows = rows;
    p.x = x.data();
    p.out = out.data();
    p.num_threads = std::max(1, num_threads);
    std::size_t const need = std::size_t(kc::moe_experts_workspace_size(p));
    if (need > workspace_bytes_) {
      workspace_.reset(static_cast<unsigned char*>(std::aligned_alloc(64, (need + 63) / 64 * 64)));
      if (!workspace_) throw std::bad_alloc();
      workspace_bytes_ = need;
    }
    p.workspace = workspace_.get();
    p.workspace_bytes = std::int64_t(workspace_bytes_);
    nb::gil_scoped_release release;
    kc::launch_moe_experts(p, kc::ThreadPool::global());
  }

  int num_experts() const { return p_.num_experts; }

 private:
  struct FreeDeleter {
    void operator()(unsigned char* q) const { std::free(q); }
  };
  std::vector<nb::object> weights_;  // kept alive with the op
  std::vector<kc::LinearOp> gate_up_, down_;
  kc::MoeExpertsParams p_;
  std::unique_ptr<unsigned char, FreeDeleter> workspace_;
  std::size_t workspace_bytes_ = 0;
};

}  // namespace

INFLIGHT_REGISTER_OPS(moe) {
  nb::class_<MoeExperts>(m, "MoeExperts",
                         "A mixture-of-experts layer's experts on the CPU, one call per step: each expert's "
                         "gate_up (hidden -> 2 * intermediate) and down (intermediate -> hidden) weight objects "
                         "(W4A16Weight, W8A16Weight or DenseWeight), held alive.")
      .def(nb::init<std::vector<nb::object> const&, std::vector<nb::object> const&, int, int, std::string const&,
                    bool>(),
           "gate_up"_a, "down"_a, "hidden_size"_a, "intermediate_size"_a, "dtype"_a, "gelu"_a = false)
      .def("run", &MoeExperts::run, "x"_a, "counts"_a, "out"_a.noconvert(), "num_threads"_a,
           "out[rows of expert e] = down_e(silu(gate) * up) of x's rows, grouped by expert in order "
           "(counts [num_experts] int64: rows per expert, summing to x's rows).")
      .def_prop_ro("num_experts", &MoeExperts::num_experts);
}
