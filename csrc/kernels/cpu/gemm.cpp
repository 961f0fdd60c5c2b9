// Launchers of the weight-only-quantised GEMMs: validate once, then run the selected ISA's path.
#include "gemm.h"

#include <stdexcept>
#include <string>
#include <utility>

namespace inflight::kernels::cpu {
namespace {

void check_common(char const* op, void const* x, void const* qweight, void const* scales, void const* out,
                  std::int64_t m, std::int64_t n, std::int64_t k, int group_size, ScalarType dtype,
                  ScalarType scale_type, int num_threads, bool allow_group16) {
  std::string const where = std::string(op) + ": ";
  for (auto [name, t] : {std::pair{"dtype", dtype}, std::pair{"scale_type", scale_type}}) {
    if (!is_float_type(t)) {
      throw std::invalid_argument(where + name + " must be float32, bfloat16 or float16, got " + scalar_type_name(t));
    }
  }
  if (m < 0) throw std::invalid_argument(where + "m must be >= 0, got " + std::to_string(m));
  if (n < 1) throw std::invalid_argument(where + "n must be >= 1, got " + std::to_string(n));
  if (group_size != 32 && group_size != 64 && group_size != 128 && !(allow_group16 && group_size == 16)) {
    throw std::invalid_argument(where + "group_size must be " + (allow_group16 ? "16, " : "") + "32, 64 or 128, got " +
                                std::to_string(group_size));
  }
  if (k < group_size || k % group_size != 0) {
    throw std::invalid_argument(where + "k must be a positive multiple of group_size (" + std::to_string(group_size) +
                                "), got " + std::to_string(k));
  }
  if (num_threads < 1) {
    throw std::invalid_argument(where + "num_threads must be >= 1, got " + std::to_string(num_threads));
  }
  if (m > 0 && (x == nullptr || qweight == nullptr || scales == nullptr || out == nullptr)) {
    throw std::invalid_argument(where + "x, qweight, scales and out must not be null");
  }
}

}  // namespace

void launch_w4a16_gemm(W4A16GemmParams const& p, ThreadPool& pool) {
  check_common("w4a16_gemm", p.x, p.qweight, p.scales, p.out, p.m, p.n, p.k, p.group_size, p.dtype, p.scale_type,
               p.num_threads, false);
  if (p.m == 0) return;
  gemm_detail::run_selected_isa(p, pool, w4a16_gemm_portable, w4a16_gemm_avx2, w4a16_gemm_avx512f, w4a16_gemm_avx512);
}

void launch_w8a16_gemm(W8A16GemmParams const& p, ThreadPool& pool) {
  check_common("w8a16_gemm", p.x, p.qweight, p.scales, p.out, p.m, p.n, p.k, p.group_size, p.dtype, p.scale_type,
               p.num_threads, true);
  if (p.m == 0) return;
  gemm_detail::run_selected_isa(p, pool, w8a16_gemm_portable, w8a16_gemm_avx2, w8a16_gemm_avx512f, w8a16_gemm_avx512);
}

}  // namespace inflight::kernels::cpu
