// w8a16_gemm: out[M, N] = x[M, K] @ W^T (+ bias[N]) with W [N, K] stored as int8, w = scale * q (symmetric), one
// scale per group_size consecutive k of a row. Same kernel structure as w4a16_gemm (see there): tensor
// cores, weights as the A operand, each lane dequantising the 16 k of one 16-byte load.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "inflight/kernels/scalar_type.h"

namespace inflight::kernels::cuda {

// The fields and names of the CPU op's params (kernels/cpu/gemm.h); here x and out may be row-strided,
// the CPU has a thread count instead.
struct W8A16GemmParams {
  void const* x;  // [m, k], rows x_row_stride elements apart, 16-byte aligned rows
  std::int64_t x_row_stride;
  std::int8_t const* qweight;  // [n, k], contiguous: int8, or E4M3 bytes when fp8_e4m3
  void const* scales;          // [n, k / group_size], contiguous, of scale_type
  ScalarType scale_type;       // float16, bfloat16 or float32 (rounded to dtype when loaded)
  void const* bias;            // [n] of dtype, or null
  void* out;                   // [m, n], rows out_row_stride elements apart
  std::int64_t out_row_stride;
  std::int64_t m, n, k;   // each below 2^31; k a multiple of group_size
  int group_size;         // a multiple of 16
  ScalarType dtype;       // of x, bias and out: float16 or bfloat16
  bool fp8_e4m3 = false;  // qweight holds OCP FP8 E4M3 values (an FP8 checkpoint)
};

cudaError_t launch_w8a16_gemm(W8A16GemmParams const& params, cudaStream_t stream);

}  // namespace inflight::kernels::cuda
