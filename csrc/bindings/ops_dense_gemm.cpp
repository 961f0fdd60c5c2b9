// Dense GEMM binding: map DLPack tensors onto DenseGemmParams (dtypes and shapes as the weight-only
// GEMMs check x, out and bias, op_checks.h; contiguity; each error naming the argument), release the
// GIL, call the launcher. The typed wrapper lives in inflight/ops/gemm.py (dense_gemm).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>

#include "dense_gemm.h"
#include "gemm_weights.h"
#include "registry.h"

namespace nb = nanobind;
namespace kc = inflight::kernels::cpu;
using namespace nb::literals;
using namespace inflight::bindings;

namespace {

void dense_gemm(Tensor x, Tensor weight, std::optional<Tensor> bias, Tensor out, int num_threads) {
  require_at_least(num_threads, 1, "num_threads");
  kc::DenseGemmParams p;
  p.dtype = float_type(x, "x");
  require_ndim(x, "x", 2, "[m, k]");
  p.m = static_cast<std::int64_t>(x.shape(0));
  p.k = static_cast<std::int64_t>(x.shape(1));
  require_same_dtype(weight, "weight", x, "x");
  require_ndim(weight, "weight", 2, "[n, k]");
  p.n = static_cast<std::int64_t>(weight.shape(0));
  require_shape(weight, "weight", {p.n, p.k}, "[n, k]");
  check_gemm_out(out, x, p.m, p.n);
  Tensor const* b = bias ? &*bias : nullptr;
  if (b != nullptr) check_gemm_bias(*b, x, p.n);
  require_cpu_contiguous({{&x, "x"}, {&weight, "weight"}, {b, "bias"}, {&out, "out"}});
  p.x = x.data();
  p.weight = weight.data();
  p.bias = b != nullptr ? b->data() : nullptr;
  p.out = out.data();
  p.num_threads = num_threads;
  nb::gil_scoped_release release;
  kc::launch_dense_gemm(p, kc::ThreadPool::global());
}

}  // namespace

INFLIGHT_REGISTER_OPS(dense_gemm) {
  m.def("dense_gemm", &dense_gemm, "x"_a, "weight"_a, "bias"_a.none(), "out"_a.noconvert(), "num_threads"_a,
        "out[m, n] = x[m, k] @ weight[n, k]^T (+ bias[n]), torch Linear layout. x, weight, bias and out share "
        "one dtype (float32, bfloat16 or float16) and are contiguous; fp32 sums, out rounded once.");
}
