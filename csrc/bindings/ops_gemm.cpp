// W4A16 / W8A16 GEMM bindings: the one-shot ops check their arguments as the CUDA ops do (op_checks.h),
// then run through the weight objects of gemm_weights.h, which the Python layers import once. The typed
// wrappers with defaults live in inflight/ops/gemm.py.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <optional>
#include <utility>

#include "gemm_weights.h"
#include "registry.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace inflight::bindings;
using namespace inflight::bindings::gemm;

namespace {

template <int kBits>
void weight_only_gemm(Tensor x, Tensor qweight, Tensor scales, std::optional<Tensor> offsets, int group_size,
                      Tensor out, std::optional<Tensor> bias, int num_threads) {
  require_at_least(num_threads, 1, "num_threads");
  check_weight_only_gemm_args(x, {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}, qweight, scales,
                              offsets ? &*offsets : nullptr, group_size, kBits,
                              kBits == 8 ? kCpuInt8GroupSizes : kCpuGroupSizes, out, bias ? &*bias : nullptr);
  QuantizedWeight<kBits>(std::move(qweight), std::move(scales), std::move(offsets), group_size, std::move(bias))
      .gemm(std::move(x), std::move(out), num_threads);
}

void w4a16_gemm(Tensor x, Tensor qweight, Tensor scales, std::optional<Tensor> offsets, int group_size, Tensor out,
                std::optional<Tensor> bias, int num_threads) {
  weight_only_gemm<4>(std::move(x), std::move(qweight), std::move(scales), std::move(offsets), group_size,
                      std::move(out), std::move(bias), num_threads);
}

void w8a16_gemm(Tensor x, Tensor qweight, Tensor scales, int group_size, Tensor out, std::optional<Tensor> bias,
                int num_threads, bool fp8_e4m3) {
  require_at_least(num_threads, 1, "num_threads");
  check_weight_only_gemm_args(x, {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}, qweight, scales,
                              nullptr, group_size, 8, kCpuInt8GroupSizes, out, bias ? &*bias : nullptr);
  W8A16Weight(std::move(qweight), std::move(scales), group_size, std::move(bias), fp8_e4m3)
      .gemm(std::move(x), std::move(out), num_threads);
}

}  // namespace

INFLIGHT_REGISTER_OPS(gemm) {
  m.def("w4a16_gemm", &w4a16_gemm, "x"_a, "qweight"_a, "scales"_a, "offsets"_a.none(), "group_size"_a,
        "out"_a.noconvert(), "bias"_a.none(), "num_threads"_a,
        "out[m, n] = x[m, k] @ dequant(qweight)[n, k]^T (+ bias). int4 weights, qweight [n, k/2] uint8 "
        "(byte j: k = 2j low nibble, 2j+1 high), scales/offsets [n, k/group_size]; w = scale*q + offset, or "
        "scale*(q - 8) when offsets is None. x, out, bias: one of float32/bfloat16/float16.");
  m.def("w8a16_gemm", &w8a16_gemm, "x"_a, "qweight"_a, "scales"_a, "group_size"_a, "out"_a.noconvert(), "bias"_a.none(),
        "num_threads"_a, "fp8_e4m3"_a = false,
        "out[m, n] = x[m, k] @ dequant(qweight)[n, k]^T (+ bias). int8 weights [n, k], scales "
        "[n, k/group_size]; w = scale * q. fp8_e4m3: qweight's bytes are E4M3 values (w = scale * fp8(q)).");
  nb::class_<W4A16Weight>(m, "W4A16Weight",
                          "int4 weights (the w4a16_gemm layout) validated and imported once; gemm(x, out, "
                          "num_threads) then passes only x and out. Keeps the tensors alive.")
      .def(nb::init<Tensor, Tensor, std::optional<Tensor>, int, std::optional<Tensor>>(), "qweight"_a, "scales"_a,
           "offsets"_a.none(), "group_size"_a, "bias"_a.none())
      .def("gemm", &W4A16Weight::gemm, "x"_a, "out"_a.noconvert(), "num_threads"_a)
      .def_prop_ro("n", &W4A16Weight::n)
      .def_prop_ro("k", &W4A16Weight::k)
      .def_prop_ro("group_size", &W4A16Weight::group_size);
  nb::class_<W8A16Weight>(m, "W8A16Weight",
                          "int8 weights (the w8a16_gemm layout) validated and imported once; gemm(x, out, "
                          "num_threads) then passes only x and out. Keeps the tensors alive.")
      .def(nb::init<Tensor, Tensor, int, std::optional<Tensor>, bool>(), "qweight"_a, "scales"_a, "group_size"_a,
           "bias"_a.none(), "fp8_e4m3"_a = false)
      .def_prop_ro("fp8_e4m3", &W8A16Weight::fp8_e4m3)
      .def("gemm", &W8A16Weight::gemm, "x"_a, "out"_a.noconvert(), "num_threads"_a)
      .def_prop_ro("n", &W8A16Weight::n)
      .def_prop_ro("k", &W8A16Weight::k)
      .def_prop_ro("group_size", &W8A16Weight::group_size);
}
