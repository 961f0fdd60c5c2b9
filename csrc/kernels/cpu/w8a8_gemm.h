// W8A8 GEMM on the CPU (TensorRT-LLM's SmoothQuant mode): out[M, N] = x[M, K] @ W[N, K]^T (+ bias)
// with int8 weights (one fp32 scale per output channel) and int8 activations quantised per token on
// the fly; the products are summed exactly in int32 (AVX512-VNNI VPDPBUSD, or a portable loop).
//
// Per row m of x (fp32, bf16 or fp16):
//   xs[k]  = x[m, k] * smooth[k]              (smooth: SmoothQuant's 1 / s per input channel, or none)
//   a[m]   = max_k |xs[k]| / 127               (the row's scale; 0 for an all-zero row)
//   q[k]   = round_half_even(xs[k] * (127 / max_k |xs[k]|)) in [-127, 127]
//   out    = float(sum_k q[k] * W[n, k]) * (a[m] * w_scale[n]) (+ bias[n]), rounded once to x's dtype
// Every ISA computes exactly these operations in this order, so the portable and the VNNI paths give
// bit-identical results, and a row's result never depends on the other rows of the call (per-token
// scales, one fixed summation order): the kernel is batch-invariant.
//
// VPDPBUSD multiplies unsigned by signed bytes, so activations are stored as q + 128 (uint8) and the
// excess, 128 * sum_k W[n, k], is subtracted from each column (its column sum is packed with it).
//
// Weights are packed once (W8A8PackedWeight): blocks of 16 output channels, each [K4][16][4] int8
// (K4 = ceil(K / 4), k padded with zeros), so that one 64-byte load feeds one VPDPBUSD of 16 columns
// by 4 k. The caller passes a workspace (w8a8_workspace_bytes); nothing is allocated inside.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpu_features.h"
#include "inflight/kernels/scalar_type.h"
#include "thread_pool.h"

namespace inflight::kernels::cpu {

inline constexpr int kW8A8Block = 16;  // output channels per packed block

struct W8A8PackedWeight {
  std::int64_t n = 0, k = 0;
  std::int64_t k4 = 0;             // ceil(k / 4): packed k-quads per block
  std::vector<std::int8_t> data;   // [ceil(n / 16)][k4][16][4]
  std::vector<std::int32_t> wsum;  // [ceil(n / 16) * 16]: 128 * sum_k W[n, k], the excess (0 for padding)
  std::vector<float> scales;       // [ceil(n / 16) * 16]: per output channel (0 for padding)
  std::int64_t num_blocks() const { return (n + kW8A8Block - 1) / kW8A8Block; }
  std::int64_t n_padded() const { return num_blocks() * kW8A8Block; }
};

// qweight [n, k] int8 row-major, scales [n] fp32.
W8A8PackedWeight pack_w8a8_weight(std::int8_t const* qweight, float const* scales, std::int64_t n, std::int64_t k);

// The inverse of pack_w8a8_weight: qweight [n, k] int8 and scales [n] fp32, exactly as packed.
void unpack_w8a8_weight(W8A8PackedWeight const& w, std::int8_t* qweight, float* scales);

struct W8A8GemmParams {
  void const* x = nullptr;                   // [m, k], dtype, row-major contiguous
  W8A8PackedWeight const* weight = nullptr;  // packed once
  float const* smooth = nullptr;             // [k] multipliers of x (SmoothQuant's 1 / s); nullptr: none
  float const* bias = nullptr;               // [n] fp32; nullptr: none
  void* out = nullptr;                       // [m, n], dtype, row-major contiguous
  void* workspace = nullptr;                 // w8a8_workspace_bytes(m, weight) bytes, 64-byte aligned
  std::int64_t m = 0;
  ScalarType dtype = ScalarType::kFloat32;  // of x and out
  int num_threads = 1;
};

std::size_t w8a8_workspace_bytes(std::int64_t m, W8A8PackedWeight const& w);

void launch_w8a8_gemm(W8A8GemmParams const& p, ThreadPool& pool);

// The per-row activation quantisation above (exposed for tests and for the reference): q as uint8
// (q + 128) into a [m, ceil(k / 4) * 4] buffer (padding 128, i.e. q = 0) and the row scales a[m].
void quantize_w8a8_activations(void const* x, ScalarType dtype, float const* smooth, std::int64_t m, std::int64_t k,
                               std::uint8_t* qa, float* row_scales);

namespace w8a8_detail {
// The int32 products of one ISA: c[m][n_padded] = sum_k qa * W - wsum, for the column blocks
// [block_lo, block_hi). qa: [m][k4 * 4] uint8.
void int_gemm_portable(std::uint8_t const* qa, std::int64_t m, W8A8PackedWeight const& w, std::int64_t block_lo,
                       std::int64_t block_hi, std::int32_t* c);
void int_gemm_avx512(std::uint8_t const* qa, std::int64_t m, W8A8PackedWeight const& w, std::int64_t block_lo,
                     std::int64_t block_hi, std::int32_t* c);
}  // namespace w8a8_detail

}  // namespace inflight::kernels::cpu
