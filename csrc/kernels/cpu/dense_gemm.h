// Dense (unquantised) GEMM on the CPU: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), W in torch Linear
// layout (row-major [N, K]).
//
// Tuned for decode (M = 1..16), where the cost is reading W once per call: threads split N into
// contiguous runs, each tile of a few W rows streams K once while MR rows of x (tiny, cache-resident)
// are multiplied against it in registers. Both operands are row-major over K, so every product is a
// dot product along K: vectors over K, one fp32 accumulator per (x row, W row) pair, summed across
// lanes once at the end. For M beyond one register tile, the M tiles of an L2-sized chunk of W rows
// re-read that chunk from L2, not from memory (gemm_detail::run_tiles).
//
// x, weight, bias and out share one dtype (fp32, bf16 or fp16). Products and sums are fp32 (bf16 pairs
// through VDPBF16PS on AVX-512); out is rounded once, to nearest even. x is contiguous (row stride k);
// out's row stride is out_row_stride (default n).
//
// Follows gemm.h's pattern: params struct, a launcher launch_dense_gemm(params, pool) that validates
// once and picks the ISA (cpu_features.h), per-ISA files instantiating an explicit set of
// {dtype} x {M tile} micro-kernels.
#pragma once

#include <cstdint>

#include "gemm.h"

namespace inflight::kernels::cpu {

struct DenseGemmParams {
  void const* x = nullptr;          // [m, k], dtype, row-major contiguous
  void const* weight = nullptr;     // [n, k], dtype, row-major contiguous (torch Linear layout)
  void const* bias = nullptr;       // [n], dtype; nullptr: none
  void* out = nullptr;              // [m, n], dtype, rows out_row_stride apart; fully overwritten
  std::int64_t out_row_stride = 0;  // elements (0: n; else >= n): out may be a column block of a wider one
  std::int64_t m = 0, n = 0, k = 0;
  ScalarType dtype = ScalarType::kFloat32;  // of x, weight, bias and out: float32, bfloat16 or float16
  int num_threads = 1;                      // at most this many of the pool's threads
};

// Launcher: validates the params (std::invalid_argument naming the field, value and allowed range),
// then runs the path of selected_isa(). Nothing is allocated. Threads split N on `pool` (through
// gemm_detail::run_tiles): one thread when the weights are too small to be worth waking others, and
// inline when called from inside a pool task.
void launch_dense_gemm(DenseGemmParams const& p, ThreadPool& pool);

// Per-ISA paths (gemm_portable.cpp, gemm_avx2.cpp, gemm_avx512f.cpp, dense_gemm_avx512.cpp); only the
// launcher calls them.
void dense_gemm_portable(DenseGemmParams const& p, ThreadPool& pool);
void dense_gemm_avx2(DenseGemmParams const& p, ThreadPool& pool);
void dense_gemm_avx512(DenseGemmParams const& p, ThreadPool& pool);
void dense_gemm_avx512f(DenseGemmParams const& p, ThreadPool& pool);

}  // namespace inflight::kernels::cpu
