// Launcher of the dense GEMM: validate once, then run the selected ISA's path (the portable one is in
// gemm_portable.cpp, the vectorised ones in gemm_avx2.cpp, gemm_avx512f.cpp and dense_gemm_avx512.cpp).
#include "dense_gemm.h"

#include <stdexcept>
#include <string>

namespace inflight::kernels::cpu {
namespace {

void check(DenseGemmParams const& p) {
  std::string const where = "dense_gemm: ";
  if (!is_float_type(p.dtype)) {
    throw std::invalid_argument(where + "dtype must be float32, bfloat16 or float16, got " + scalar_type_name(p.dtype));
  }
  if (p.m < 0) throw std::invalid_argument(where + "m must be >= 0, got " + std::to_string(p.m));
  if (p.n < 1) throw std::invalid_argument(where + "n must be >= 1, got " + std::to_string(p.n));
  if (p.k < 1) throw std::invalid_argument(where + "k must be >= 1, got " + std::to_string(p.k));
  if (p.out_row_stride != 0 && p.out_row_stride < p.n) {
    throw std::invalid_argument(where + "out_row_stride must be 0 or >= n = " + std::to_string(p.n) + ", got " +
                                std::to_string(p.out_row_stride));
  }
  if (p.num_threads < 1) {
    throw std::invalid_argument(where + "num_threads must be >= 1, got " + std::to_string(p.num_threads));
  }
  if (p.m > 0 && (p.x == nullptr || p.weight == nullptr || p.out == nullptr)) {
    throw std::invalid_argument(where + "x, weight and out must not be null (bias may be)");
  }
}

}  // namespace

void launch_dense_gemm(DenseGemmParams const& p, ThreadPool& pool) {
  check(p);
  if (p.m == 0) return;
  gemm_detail::run_selected_isa(p, pool, dense_gemm_portable, dense_gemm_avx2, dense_gemm_avx512f, dense_gemm_avx512);
}

}  // namespace inflight::kernels::cpu
