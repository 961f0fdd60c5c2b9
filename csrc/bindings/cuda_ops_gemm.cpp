// CUDA weight-only GEMMs: w4a16_gemm and w8a16_gemm. Same argument order as the CPU ops, with the stream
// (an integer cudaStream_t) last.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "cuda_ops_util.h"
#include "registry.h"
#include "w4a16_gemm.h"
#include "w8a16_gemm.h"

namespace nb = nanobind;
namespace ck = inflight::kernels::cuda;
using namespace inflight::bindings::cuda_ops;

namespace {

struct GemmShape {
  int m, n, k;
};

// x [m, k] (rows may be strided, 16-byte aligned) and out [m, n] (rows may be strided) of one 16-bit
// float dtype; qweight [n, k / k_per_byte]; scales [n, k / group_size] of any float dtype; bias [n] of
// x's dtype or None.
GemmShape check_common(Tensor const& x, Tensor const& qweight, Tensor const& scales, int group_size, Tensor const& out,
                       std::optional<Tensor> const& bias, int k_per_byte, int group_multiple) {
  if (is_dtype(x, nb::dlpack::dtype_code::Float, 32)) {
    throw nb::type_error("x must be float16 or bfloat16 on CUDA (the tensor-core kernel), got float32");
  }
  float_type(x, "x", /*allow_float32=*/false);
  require_ndim(x, "x", 2, "[m, k]");
  require_rows_contiguous(x, "x");
  require_aligned(x, "x", 16);
  GemmShape s{static_cast<int>(x.shape(0)), static_cast<int>(qweight.ndim() == 2 ? qweight.shape(0) : 0),
              static_cast<int>(x.shape(1))};
  if (x.shape(0) > 0x7fffffffULL || x.shape(1) > 0x7fffffffULL) throw std::invalid_argument("x is too large");
  if ((row_stride(x) * 2) % 16 != 0) {
    throw std::invalid_argument("x's row stride (" + std::to_string(row_stride(x)) +
                                " elements) must be a multiple of 8; call .contiguous()");
  }
  if (group_size <= 0 || group_size % group_multiple != 0) {
    throw std::invalid_argument("group_size must be a positive multiple of " + std::to_string(group_multiple) +
                                " (e.g. 32, 64 or 128), got " + std::to_string(group_size));
  }
  if (s.k % group_size != 0) {
    throw std::invalid_argument("k (x.shape[1] = " + std::to_string(s.k) + ") must be a multiple of group_size (" +
                                std::to_string(group_size) + ")");
  }
  require_ndim(qweight, "qweight", 2, k_per_byte == 2 ? "[n, k // 2]" : "[n, k]");
  require_dim(qweight, "qweight", 1, s.k / k_per_byte, k_per_byte == 2 ? "k // 2" : "k");
  require_contiguous(qweight, "qweight");
  require_aligned(qweight, "qweight", 16);
  require_ndim(scales, "scales", 2, "[n, k // group_size]");
  require_dim(scales, "scales", 0, s.n, "qweight.shape[0] (n)");
  require_dim(scales, "scales", 1, s.k / group_size, "k // group_size");
  float_type(scales, "scales", /*allow_float32=*/true);
  require_contiguous(scales, "scales");
  require_ndim(out, "out", 2, "[m, n]");
  require_dim(out, "out", 0, s.m, "x.shape[0] (m)");
  require_dim(out, "out", 1, s.n, "qweight.shape[0] (n)");
  require_same_dtype(out, "out", x, "x");
  require_rows_contiguous(out, "out");
  if (bias) {
    require_ndim(*bias, "bias", 1, "[n]");
    require_dim(*bias, "bias", 0, s.n, "qweight.shape[0] (n)");
    require_same_dtype(*bias, "bias", x, "x");
    require_contiguous(*bias, "bias");
  }
  if (s.m > 65535 * 16) throw std::invalid_argument("m (x.shape[0]) must be <= 1048560, got " + std::to_string(s.m));
  return s;
}

int gemm_device(Tensor const& x, Tensor const& qweight, Tensor const& scales, std::optional<Tensor> const& offsets,
                Tensor const& out, std::optional<Tensor> const& bias) {
  // Absent optionals are checked as x again (harmless) to keep one call.
  return common_cuda_device({{&x, "x"},
                             {&qweight, "qweight"},
                             {&scales, "scales"},
                             {offsets ? &*offsets : &x, "offsets"},
                             {&out, "out"},
                             {bias ? &*bias : &x, "bias"}});
}

void w4a16_gemm(Tensor const& x, Tensor const& qweight, Tensor const& scales, std::optional<Tensor> const& offsets,
                int group_size, Tensor const& out, std::optional<Tensor> const& bias, std::uintptr_t stream) {
  require_dtype(qweight, "qweight", nb::dlpack::dtype_code::UInt, 8, "uint8 (two 4-bit weights per byte)");
  GemmShape const s = check_common(x, qweight, scales, group_size, out, bias, 2, 32);
  if (offsets) {
    require_ndim(*offsets, "offsets", 2, "[n, k // group_size] (like scales)");
    for (std::size_t i = 0; i < 2; ++i) {
      require_dim(*offsets, "offsets", i, static_cast<std::int64_t>(scales.shape(i)), "scales'");
    }
    require_same_dtype(*offsets, "offsets", scales, "scales");
    require_contiguous(*offsets, "offsets");
  }
  int const device = gemm_device(x, qweight, scales, offsets, out, bias);
  ScalarType const dtype = float_type(x, "x", false);
  ck::W4A16GemmParams p{};
  p.x = x.data();
  p.x_row_stride = row_stride(x);
  p.qweight = static_cast<std::uint8_t const*>(qweight.data());
  p.scales = scales.data();
  p.offsets = offsets ? offsets->data() : nullptr;
  p.scale_type = float_type(scales, "scales", true);
  p.bias = bias ? bias->data() : nullptr;
  p.out = out.data();
  p.out_row_stride = row_stride(out);
  p.m = s.m;
  p.n = s.n;
  p.k = s.k;
  p.group_size = group_size;
  p.dtype = dtype;
  nb::gil_scoped_release release;
  DeviceGuard guard(device);
  check_cuda(ck::launch_w4a16_gemm(p, as_stream(stream)), "w4a16_gemm");
}

void w8a16_gemm(Tensor const& x, Tensor const& qweight, Tensor const& scales, int group_size, Tensor const& out,
                std::optional<Tensor> const& bias, std::uintptr_t stream) {
  require_dtype(qweight, "qweight", nb::dlpack::dtype_code::Int, 8, "int8");
  GemmShape const s = check_common(x, qweight, scales, group_size, out, bias, 1, 16);
  int const device = gemm_device(x, qweight, scales, std::nullopt, out, bias);
  ScalarType const dtype = float_type(x, "x", false);
  ck::W8A16GemmParams p{};
  p.x = x.data();
  p.x_row_stride = row_stride(x);
  p.qweight = static_cast<std::int8_t const*>(qweight.data());
  p.scales = scales.data();
  p.scale_type = float_type(scales, "scales", true);
  p.bias = bias ? bias->data() : nullptr;
  p.out = out.data();
  p.out_row_stride = row_stride(out);
  p.m = s.m;
  p.n = s.n;
  p.k = s.k;
  p.group_size = group_size;
  p.dtype = dtype;
  nb::gil_scoped_release release;
  DeviceGuard guard(device);
  check_cuda(ck::launch_w8a16_gemm(p, as_stream(stream)), "w8a16_gemm");
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
}
