// CUDA weight-only GEMMs: w4a16_gemm and w8a16_gemm. The arguments and their checks are the CPU ops'
// (op_checks.h), with the stream (an integer cudaStream_t) last instead of num_threads; x, out and bias
// are float16 or bfloat16 here (the tensor-core kernel), and x and out may be row-strided.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "cuda_launch.h"
#include "op_checks.h"
#include "registry.h"
#include "w4a16_gemm.h"
#include "w8a16_gemm.h"

namespace nb = nanobind;
namespace ck = inflight::kernels::cuda;
using namespace inflight::bindings;

namespace {

bool int4_group_ok(int g) { return g > 0 && g % 32 == 0; }
bool int8_group_ok(int g) { return g > 0 && g % 16 == 0; }
constexpr GroupSizeRule kInt4Groups{int4_group_ok, "a positive multiple of 32 (e.g. 32, 64 or 128)"};
constexpr GroupSizeRule kInt8Groups{int8_group_ok, "a positive multiple of 16 (e.g. 32, 64 or 128)"};

// What the kernel needs beyond the shared checks: x rows 16-byte aligned (rows may be strided), the
// weights contiguous and aligned, out rows contiguous, 32-bit sizes and a grid of at most 65535 x 16
// batch rows. Returns the tensors' device.
int check_cuda_gemm(Tensor const& x, Tensor const& qweight, Tensor const& scales, Tensor const* offsets,
                    Tensor const& out, Tensor const* bias, WeightOnlyGemmArgs const& a) {
  require_contiguous(x, "x", 1);
  require_aligned(x, "x", 16);
  if ((row_stride(x) * 2) % 16 != 0) {
    throw_value_error("x's row stride (" + std::to_string(row_stride(x)) +
                      " elements) must be a multiple of 8; call .contiguous()");
  }
  require_contiguous(qweight, "qweight");
  require_aligned(qweight, "qweight", 16);
  require_contiguous(scales, "scales");
  if (offsets != nullptr) require_contiguous(*offsets, "offsets");
  require_contiguous(out, "out", 1);
  if (bias != nullptr) require_contiguous(*bias, "bias");
  if (a.m > 65535 * 16) throw_value_error("m (x.shape[0]) must be <= 1048560, got " + std::to_string(a.m));
  if (a.n > 0x7fffffffLL || a.k > 0x7fffffffLL) {
    throw_value_error("n and k must be < 2^31, got " + std::to_string(a.n) + " and " + std::to_string(a.k));
  }
  return require_one_cuda_device(
      {{&x, "x"}, {&qweight, "qweight"}, {&scales, "scales"}, {offsets, "offsets"}, {&out, "out"}, {bias, "bias"}});
}

// Both ops: kBits 4 (uint8 qweight, optional offsets) or 8 (int8 qweight).
template <int kBits>
void weight_only_gemm(Tensor const& x, Tensor const& qweight, Tensor const& scales, Tensor const* offsets,
                      int group_size, Tensor const& out, Tensor const* bias, std::uintptr_t stream,
                      bool fp8_e4m3 = false) {
  WeightOnlyGemmArgs const a =
      check_weight_only_gemm_args(x, {ScalarType::kBFloat16, ScalarType::kFloat16}, qweight, scales, offsets,
                                  group_size, kBits, kBits == 4 ? kInt4Groups : kInt8Groups, out, bias);
  int const device = check_cuda_gemm(x, qweight, scales, offsets, out, bias, a);
  std::conditional_t<kBits == 4, ck::W4A16GemmParams, ck::W8A16GemmParams> p{};
  p.x = x.data();
  p.x_row_stride = row_stride(x);
  p.qweight = static_cast<decltype(p.qweight)>(qweight.data());
  p.scales = scales.data();
  if constexpr (kBits == 4) {
    p.offsets = offsets != nullptr ? offsets->data() : nullptr;
  } else {
    p.fp8_e4m3 = fp8_e4m3;
  }
  p.scale_type = a.scale_type;
  p.bias = bias != nullptr ? bias->data() : nullptr;
  p.out = out.data();
  p.out_row_stride = row_stride(out);
  p.m = a.m;
  p.n = a.n;
  p.k = a.k;
  p.group_size = group_size;
  p.dtype = a.dtype;
  nb::gil_scoped_release release;
  DeviceGuard guard(device);
  if constexpr (kBits == 4) {
    check_cuda(ck::launch_w4a16_gemm(p, as_stream(stream)), "w4a16_gemm");
  } else {
    check_cuda(ck::launch_w8a16_gemm(p, as_stream(stream)), "w8a16_gemm");
  }
}

void w4a16_gemm(Tensor const& x, Tensor const& qweight, Tensor const& scales, std::optional<Tensor> const& offsets,
                int group_size, Tensor const& out, std::optional<Tensor> const& bias, std::uintptr_t stream) {
  weight_only_gemm<4>(x, qweight, scales, offsets ? &*offsets : nullptr, group_size, out, bias ? &*bias : nullptr,
                      stream);
}

void w8a16_gemm(Tensor const& x, Tensor const& qweight, Tensor const& scales, int group_size, Tensor const& out,
                std::optional<Tensor> const& bias, std::uintptr_t stream) {
  weight_only_gemm<8>(x, qweight, scales, nullptr, group_size, out, bias ? &*bias : nullptr, stream);
}

void w8a16_fp8_gemm(Tensor const& x, Tensor const& qweight, Tensor const& scales, int group_size, Tensor const& out,
                    std::optional<Tensor> const& bias, std::uintptr_t stream) {
  weight_only_gemm<8>(x, qweight, scales, nullptr, group_size, out, bias ? &*bias : nullptr, stream, true);
}

}  // namespace

INFLIGHT_REGISTER_OPS(cuda_gemm) {
  m.def("w4a16_gemm", &w4a16_gemm, nb::arg("x"), nb::arg("qweight"), nb::arg("scales"), nb::arg("offsets").none(),
        nb::arg("group_size"), nb::arg("out"), nb::arg("bias").none(), nb::arg("stream"),
        "out [m, n] = x [m, k] @ dequant(qweight)^T (+ bias [n]). x, out, bias: float16/bfloat16. qweight [n, k // 2] "
        "uint8 (k = 2j in byte j's low nibble, 2j + 1 in its high nibble); scales [n, k // group_size] and offsets "
        "(same shape and dtype, or None), float16/bfloat16/float32: w = scale * q + offset, or scale * (q - 8) "
        "without offsets. group_size: a multiple of 32 dividing k.");
  m.def("w8a16_gemm", &w8a16_gemm, nb::arg("x"), nb::arg("qweight"), nb::arg("scales"), nb::arg("group_size"),
        nb::arg("out"), nb::arg("bias").none(), nb::arg("stream"),
        "out [m, n] = x [m, k] @ (scales * qweight)^T (+ bias [n]) with qweight [n, k] int8 and scales "
        "[n, k // group_size] (float16/bfloat16/float32). x, out, bias: float16/bfloat16. group_size: a multiple "
        "of 16 dividing k.");
  m.def("w8a16_fp8_gemm", &w8a16_fp8_gemm, nb::arg("x"), nb::arg("qweight"), nb::arg("scales"), nb::arg("group_size"),
        nb::arg("out"), nb::arg("bias").none(), nb::arg("stream"),
        "w8a16_gemm with qweight's int8 bytes holding OCP FP8 E4M3 values (a float8_e4m3fn tensor viewed as "
        "int8): w = scale * fp8(q), converted exactly in registers.");
}
