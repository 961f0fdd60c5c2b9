// Dense GEMM binding: map DLPack arrays onto DenseGemmParams (dtype, shapes, contiguity, each error
// naming the argument), release the GIL, call the launcher. The typed wrapper lives in
// inflight/ops/gemm.py (dense_gemm).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dense_gemm.h"
#include "gemm_weights.h"
#include "registry.h"

namespace nb = nanobind;
namespace kc = inflight::kernels::cpu;
namespace ik = inflight::kernels;
using namespace nb::literals;

namespace {

// Strides are checked here rather than by nb::c_contig, so that a strided tensor gets an error that
// names it instead of nanobind's generic "incompatible function arguments".
using Array = nb::ndarray<nb::device::cpu>;
using inflight::bindings::gemm::dtype_str;
using inflight::bindings::gemm::float_type;

std::string list_str(std::vector<std::int64_t> const& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::vector<std::int64_t> shape_of(Array const& a) {
  std::vector<std::int64_t> s(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) s[i] = static_cast<std::int64_t>(a.shape(i));
  return s;
}

// Checks ndim, dtype (== type), shape, and row-major contiguity (size-1 dimensions may have any stride,
// as in torch).
void check_array(Array const& a, char const* name, ik::ScalarType type, std::vector<std::int64_t> const& shape,
                 char const* shape_names) {
  if (a.ndim() != shape.size()) {
    throw std::invalid_argument(std::string(name) + " must be " + std::to_string(shape.size()) + "-D " + shape_names +
                                ", got " + std::to_string(a.ndim()) + "-D");
  }
  if (float_type(a, name) != type) {
    throw std::invalid_argument(std::string(name) + " must have the dtype of x (" + ik::scalar_type_name(type) +
                                "), got " + dtype_str(a.dtype()));
  }
  if (shape_of(a) != shape) {
    throw std::invalid_argument(std::string(name) + " must have shape " + shape_names + " = " + list_str(shape) +
                                ", got " + list_str(shape_of(a)));
  }
  std::int64_t expected = 1;
  for (std::size_t i = a.ndim(); i-- > 0;) {
    if (shape[i] != 1 && static_cast<std::int64_t>(a.stride(i)) != expected) {
      std::vector<std::int64_t> strides(a.ndim());
      for (std::size_t j = 0; j < a.ndim(); ++j) strides[j] = static_cast<std::int64_t>(a.stride(j));
      throw std::invalid_argument(std::string(name) + " must be contiguous (row-major), got strides " +
                                  list_str(strides) + " for shape " + list_str(shape));
    }
    expected *= shape[i];
  }
}

void dense_gemm(Array x, Array weight, std::optional<Array> bias, Array out, int num_threads) {
  if (x.ndim() != 2) {
    throw std::invalid_argument("x must be 2-D [m, k], got " + std::to_string(x.ndim()) + "-D");
  }
  kc::DenseGemmParams p;
  p.dtype = float_type(x, "x");
  p.m = static_cast<std::int64_t>(x.shape(0));
  p.k = static_cast<std::int64_t>(x.shape(1));
  if (weight.ndim() != 2) {
    throw std::invalid_argument("weight must be 2-D [n, k], got " + std::to_string(weight.ndim()) + "-D");
  }
  p.n = static_cast<std::int64_t>(weight.shape(0));
  p.num_threads = num_threads;
  check_array(x, "x", p.dtype, {p.m, p.k}, "[m, k]");
  check_array(weight, "weight", p.dtype, {p.n, p.k}, "[n, k]");
  check_array(out, "out", p.dtype, {p.m, p.n}, "[m, n]");
  if (bias) {
    check_array(*bias, "bias", p.dtype, {p.n}, "[n]");
    p.bias = bias->data();
  }
  p.x = x.data();
  p.weight = weight.data();
  p.out = out.data();
  nb::gil_scoped_release release;
  kc::launch_dense_gemm(p, kc::ThreadPool::global());
}

}  // namespace

INFLIGHT_REGISTER_OPS(dense_gemm) {
  m.def("dense_gemm", &dense_gemm, "x"_a, "weight"_a, "bias"_a.none(), "out"_a.noconvert(), "num_threads"_a,
        "out[m, n] = x[m, k] @ weight[n, k]^T (+ bias[n]), torch Linear layout. x, weight, bias and out share "
        "one dtype (float32, bfloat16 or float16) and are contiguous; fp32 sums, out rounded once.");
}
