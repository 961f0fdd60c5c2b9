// W8A8 GEMM binding (w8a8_gemm.h): W8A8Weight packs int8 weights once (blocks for VPDPBUSD, column
// sums); gemm(x, out, num_threads) quantises x per token and multiplies. The Python wrapper is
// inflight.ops.gemm.W8A8Weight.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "op_checks.h"
#include "registry.h"
#include "w8a8_gemm.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace inflight::bindings;
namespace kc = inflight::kernels::cpu;

namespace {

std::vector<float> float_vector(Tensor const& t, char const* name, std::int64_t n, char const* layout) {
  require_dtype(t, name, ScalarType::kFloat32);
  require_shape(t, name, {n}, layout);
  require_cpu_contiguous({{&t, name}});
  auto const* p = static_cast<float const*>(t.data());
  return std::vector<float>(p, p + n);
}

class W8A8Weight {
 public:
  W8A8Weight(Tensor qweight, Tensor scales, std::optional<Tensor> smooth, std::optional<Tensor> bias) {
    require_dtype(qweight, "qweight", ScalarType::kInt8);
    require_ndim(qweight, "qweight", 2, "[n, k]");
    require_cpu_contiguous({{&qweight, "qweight"}});
    std::int64_t const n = static_cast<std::int64_t>(qweight.shape(0)), k = static_cast<std::int64_t>(qweight.shape(1));
    if (n < 1 || k < 1) throw_value_error("qweight must not be empty, got shape " + shape_str(qweight));
    std::vector<float> const s = float_vector(scales, "scales", n, "[n] (one per output channel)");
    w_ = kc::pack_w8a8_weight(static_cast<std::int8_t const*>(qweight.data()), s.data(), n, k);
    if (smooth) smooth_ = float_vector(*smooth, "smooth", k, "[k] (one per input channel)");
    if (bias) bias_ = float_vector(*bias, "bias", n, "[n]");
  }

  void gemm(Tensor x, Tensor out, int num_threads) const {
    require_at_least(num_threads, 1, "num_threads");
    kc::W8A8GemmParams p;
    p.m = check_gemm_x(x, {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}, w_.k,
                       "k (qweight.shape[1])");
    check_gemm_out(out, x, p.m, w_.n);
    require_cpu_contiguous({{&x, "x"}, {&out, "out"}});
    scalar_type_of(x, &p.dtype);
    if (p.m == 0) return;
    p.x = x.data();
    p.out = out.data();
    p.weight = &w_;
    p.smooth = smooth_.empty() ? nullptr : smooth_.data();
    p.bias = bias_.empty() ? nullptr : bias_.data();
    p.num_threads = num_threads;
    nb::gil_scoped_release release;
    // One workspace per calling thread, grown as needed (64-byte aligned).
    thread_local std::vector<std::int64_t> workspace;
    std::size_t const need = (kc::w8a8_workspace_bytes(p.m, w_) + 63) / 64 * 8 + 8;
    if (workspace.size() < need) workspace.resize(need);
    auto addr = reinterpret_cast<std::uintptr_t>(workspace.data());
    p.workspace = reinterpret_cast<void*>((addr + 63) / 64 * 64);
    kc::launch_w8a8_gemm(p, kc::ThreadPool::global());
  }

  std::int64_t n() const { return w_.n; }
  std::int64_t k() const { return w_.k; }

 private:
  kc::W8A8PackedWeight w_;
  std::vector<float> smooth_, bias_;
};

}  // namespace

INFLIGHT_REGISTER_OPS(w8a8) {
  nb::class_<W8A8Weight>(m, "W8A8Weight",
                         "W8A8 (SmoothQuant) weights: int8 qweight [n, k] with fp32 scales [n] per output channel, "
                         "optional fp32 smooth [k] (multipliers of x before its per-token int8 quantisation) and fp32 "
                         "bias [n], packed once (copied: the tensors are not kept). gemm(x, out, num_threads): "
                         "out = x @ W^T (+ bias) with int8 activations and int32 sums, bit-identical on every ISA.")
      .def(nb::init<Tensor, Tensor, std::optional<Tensor>, std::optional<Tensor>>(), "qweight"_a, "scales"_a,
           "smooth"_a.none(), "bias"_a.none())
      .def("gemm", &W8A8Weight::gemm, "x"_a, "out"_a.noconvert(), "num_threads"_a)
      .def_prop_ro("n", &W8A8Weight::n)
      .def_prop_ro("k", &W8A8Weight::k);
}
