// W4A16 / W8A16 GEMM bindings: map DLPack arrays onto the params structs (dtypes, shapes), release the
// GIL, call the launcher. The typed wrappers with defaults live in inflight/ops/gemm.py.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gemm.h"
#include "gemm_weights.h"
#include "registry.h"

namespace nb = nanobind;
namespace kc = inflight::kernels::cpu;
namespace ik = inflight::kernels;
using namespace nb::literals;

namespace {

using namespace inflight::bindings::gemm;

void w4a16_gemm(Array x, Array qweight, Array scales, std::optional<Array> offsets, int group_size, Array out,
                std::optional<Array> bias, int num_threads) {
  check_ndim(x, "x", 2);
  check_ndim(qweight, "qweight", 2);
  check_int_type(qweight, "qweight", nb::dlpack::dtype_code::UInt);
  kc::W4A16GemmParams p;
  p.m = static_cast<std::int64_t>(x.shape(0));
  p.k = static_cast<std::int64_t>(x.shape(1));
  p.n = static_cast<std::int64_t>(qweight.shape(0));
  p.group_size = group_size;
  p.num_threads = num_threads;
  p.dtype = float_type(x, "x");
  if (p.k % 2 != 0) throw std::invalid_argument("x.shape[1] (k) must be even, got " + std::to_string(p.k));
  check_shape(qweight, "qweight", {p.n, p.k / 2});
  p.scale_type = float_type(scales, "scales");
  if (groups_known(p.k, group_size)) check_shape(scales, "scales", {p.n, p.k / group_size});
  if (offsets) {
    if (float_type(*offsets, "offsets") != p.scale_type) {
      throw std::invalid_argument("offsets must have the dtype of scales (" +
                                  std::string(ik::scalar_type_name(p.scale_type)) + ")");
    }
    if (groups_known(p.k, group_size)) check_shape(*offsets, "offsets", {p.n, p.k / group_size});
    p.offsets = offsets->data();
  }
  if (float_type(out, "out") != p.dtype) {
    throw std::invalid_argument("out must have the dtype of x (" + std::string(ik::scalar_type_name(p.dtype)) + ")");
  }
  check_shape(out, "out", {p.m, p.n});
  if (bias) {
    if (float_type(*bias, "bias") != p.dtype) {
      throw std::invalid_argument("bias must have the dtype of x (" + std::string(ik::scalar_type_name(p.dtype)) + ")");
    }
    check_shape(*bias, "bias", {p.n});
    p.bias = bias->data();
  }
  p.x = x.data();
  p.qweight = static_cast<std::uint8_t const*>(qweight.data());
  p.scales = scales.data();
  p.out = out.data();
  nb::gil_scoped_release release;
  kc::launch_w4a16_gemm(p, kc::ThreadPool::global());
}

void w8a16_gemm(Array x, Array qweight, Array scales, int group_size, Array out, std::optional<Array> bias,
                int num_threads) {
  check_ndim(x, "x", 2);
  check_ndim(qweight, "qweight", 2);
  check_int_type(qweight, "qweight", nb::dlpack::dtype_code::Int);
  kc::W8A16GemmParams p;
  p.m = static_cast<std::int64_t>(x.shape(0));
  p.k = static_cast<std::int64_t>(x.shape(1));
  p.n = static_cast<std::int64_t>(qweight.shape(0));
  p.group_size = group_size;
  p.num_threads = num_threads;
  p.dtype = float_type(x, "x");
  check_shape(qweight, "qweight", {p.n, p.k});
  p.scale_type = float_type(scales, "scales");
  if (groups_known(p.k, group_size)) check_shape(scales, "scales", {p.n, p.k / group_size});
  if (float_type(out, "out") != p.dtype) {
    throw std::invalid_argument("out must have the dtype of x (" + std::string(ik::scalar_type_name(p.dtype)) + ")");
  }
  check_shape(out, "out", {p.m, p.n});
  if (bias) {
    if (float_type(*bias, "bias") != p.dtype) {
      throw std::invalid_argument("bias must have the dtype of x (" + std::string(ik::scalar_type_name(p.dtype)) + ")");
    }
    check_shape(*bias, "bias", {p.n});
    p.bias = bias->data();
  }
  p.x = x.data();
  p.qweight = static_cast<std::int8_t const*>(qweight.data());
  p.scales = scales.data();
  p.out = out.data();
  nb::gil_scoped_release release;
  kc::launch_w8a16_gemm(p, kc::ThreadPool::global());
}

}  // namespace

INFLIGHT_REGISTER_OPS(gemm) {
  m.def("w4a16_gemm", &w4a16_gemm, "x"_a, "qweight"_a, "scales"_a, "offsets"_a.none(), "group_size"_a,
        "out"_a.noconvert(), "bias"_a.none(), "num_threads"_a,
        "out[m, n] = x[m, k] @ dequant(qweight)[n, k]^T (+ bias). int4 weights, qweight [n, k/2] uint8 "
        "(byte j: k = 2j low nibble, 2j+1 high), scales/offsets [n, k/group_size]; w = scale*q + offset, or "
        "scale*(q - 8) when offsets is None. x, out, bias: one of float32/bfloat16/float16.");
  m.def("w8a16_gemm", &w8a16_gemm, "x"_a, "qweight"_a, "scales"_a, "group_size"_a, "out"_a.noconvert(), "bias"_a.none(),
        "num_threads"_a,
        "out[m, n] = x[m, k] @ dequant(qweight)[n, k]^T (+ bias). int8 weights [n, k], scales "
        "[n, k/group_size]; w = scale * q.");
  nb::class_<W4A16Weight>(m, "W4A16Weight",
                          "int4 weights (the w4a16_gemm layout) validated and imported once; gemm(x, out, "
                          "num_threads) then passes only x and out. Keeps the tensors alive.")
      .def(nb::init<Array, Array, std::optional<Array>, int, std::optional<Array>>(), "qweight"_a, "scales"_a,
           "offsets"_a.none(), "group_size"_a, "bias"_a.none())
      .def("gemm", &W4A16Weight::gemm, "x"_a, "out"_a.noconvert(), "num_threads"_a)
      .def_prop_ro("n", &W4A16Weight::n)
      .def_prop_ro("k", &W4A16Weight::k)
      .def_prop_ro("group_size", &W4A16Weight::group_size);
  nb::class_<W8A16Weight>(m, "W8A16Weight",
                          "int8 weights (the w8a16_gemm layout) validated and imported once; gemm(x, out, "
                          "num_threads) then passes only x and out. Keeps the tensors alive.")
      .def(nb::init<Array, Array, int, std::optional<Array>>(), "qweight"_a, "scales"_a, "group_size"_a,
           "bias"_a.none())
      .def("gemm", &W8A16Weight::gemm, "x"_a, "out"_a.noconvert(), "num_threads"_a)
      .def_prop_ro("n", &W8A16Weight::n)
      .def_prop_ro("k", &W8A16Weight::k)
      .def_prop_ro("group_size", &W8A16Weight::group_size);
}
