// w4a16_gemm: out[M, N] = x[M, K] @ W^T (+ bias[N]) with W [N, K] stored as 4-bit integers, dequantised in
// registers (never in memory).
//   qweight [N, K/2] uint8: byte j of row n holds k = 2j in its low nibble, k = 2j + 1 in its high nibble.
//   scales [N, K/group_size] and offsets (same shape, optional), any float dtype:
//     asymmetric (offsets given): w = scale * q + offset;  symmetric: w = scale * (q - 8).
//
// Tensor cores with the weights as the A operand (16 weight rows per MMA) and x as B (8 batch rows per
// MMA), so batches of 1..8 waste nothing on padding. The dot product is invariant under any permutation
// of k applied to both operands, so instead of re-packing the weights offline each lane dequantises the
// 32 consecutive k of one 16-byte load and x is gathered in the matching order (prmt). The warps of a
// CTA share its weight rows and split K between them (every 4th or 8th 128-k slice), then reduce in
// shared memory; see WogShape in weight_only_gemm.cuh for the two CTA shapes. Batches above 16 take one
// grid row per 16 batch rows (correct, not tuned: the weights are then read once per 16 rows).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "inflight/kernels/scalar_type.h"

namespace inflight::kernels::cuda {

// The fields and names of the CPU op's params (kernels/cpu/gemm.h); here x and out may be row-strided,
// the CPU has a thread count instead.
struct W4A16GemmParams {
  void const* x;  // [m, k], rows x_row_stride elements apart, 16-byte aligned rows
  std::int64_t x_row_stride;
  std::uint8_t const* qweight;  // [n, k / 2], contiguous
  void const* scales;           // [n, k / group_size], contiguous, of scale_type
  void const* offsets;          // like scales, or null (symmetric)
  ScalarType scale_type;        // float16, bfloat16 or float32 (rounded to dtype when loaded)
  void const* bias;             // [n] of dtype, or null
  void* out;                    // [m, n], rows out_row_stride elements apart
  std::int64_t out_row_stride;
  std::int64_t m, n, k;  // each below 2^31; k a multiple of group_size
  int group_size;        // a multiple of 32 (32, 64, 128, ...)
  ScalarType dtype;      // of x, bias and out: float16 or bfloat16
};

cudaError_t launch_w4a16_gemm(W4A16GemmParams const& params, cudaStream_t stream);

}  // namespace inflight::kernels::cuda
