// W8A8 GEMM, the int32 products with AVX512-VNNI (w8a8_gemm.h): tiles of up to 4 rows x 64 columns
// (four packed blocks), 16 accumulators, one VPDPBUSD per (row, block) and k-quad over the whole K.
#include <immintrin.h>

#include <algorithm>

#include "w8a8_gemm.h"

namespace inflight::kernels::cpu::w8a8_detail {

namespace {

template <int kRows, int kBlocks>
void tile(std::uint8_t const* qa, std::int64_t lda, std::int8_t const* wb, std::int64_t block_stride, std::int64_t k4,
          std::int32_t const* wsum, std::int32_t* c, std::int64_t ldc) {
  __m512i acc[kRows][kBlocks];
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < kBlocks; ++j) acc[r][j] = _mm512_set1_epi32(0);
  }
  for (std::int64_t q = 0; q < k4; ++q) {
    __m512i w[kBlocks];
    for (int j = 0; j < kBlocks; ++j) w[j] = _mm512_loadu_si512(wb + j * block_stride + q * 64);
    for (int r = 0; r < kRows; ++r) {
      std::int32_t a4;
      __builtin_memcpy(&a4, qa + r * lda + q * 4, 4);
      __m512i const a = _mm512_set1_epi32(a4);
      for (int j = 0; j < kBlocks; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], a, w[j]);
    }
  }
  for (int j = 0; j < kBlocks; ++j) {
    __m512i const excess = _mm512_loadu_si512(wsum + j * kW8A8Block);  // 128 * sum_k W
    for (int r = 0; r < kRows; ++r) {
      _mm512_storeu_si512(c + r * ldc + j * kW8A8Block, _mm512_sub_epi32(acc[r][j], excess));
    }
  }
}

template <int kRows>
void row_tile(std::uint8_t const* qa, std::int64_t lda, W8A8PackedWeight const& w, std::int64_t b, int blocks,
              std::int32_t* c, std::int64_t ldc) {
  std::int64_t const stride = w.k4 * kW8A8Block * 4;
  std::int8_t const* wb = w.data.data() + b * stride;
  std::int32_t const* ws = w.wsum.data() + b * kW8A8Block;
  std::int32_t* cb = c + b * kW8A8Block;
  switch (blocks) {
    case 4:
      return tile<kRows, 4>(qa, lda, wb, stride, w.k4, ws, cb, ldc);
    case 3:
      return tile<kRows, 3>(qa, lda, wb, stride, w.k4, ws, cb, ldc);
    case 2:
      return tile<kRows, 2>(qa, lda, wb, stride, w.k4, ws, cb, ldc);
    default:
      return tile<kRows, 1>(qa, lda, wb, stride, w.k4, ws, cb, ldc);
  }
}

}  // namespace

void int_gemm_avx512(std::uint8_t const* qa, std::int64_t m, W8A8PackedWeight const& w, std::int64_t block_lo,
                     std::int64_t block_hi, std::int32_t* c) {
  std::int64_t const lda = w.k4 * 4, ldc = w.n_padded();
  for (std::int64_t b = block_lo; b < block_hi; b += 4) {
    int const blocks = static_cast<int>(std::min<std::int64_t>(4, block_hi - b));
    std::int64_t r = 0;
    for (; r + 4 <= m; r += 4) row_tile<4>(qa + r * lda, lda, w, b, blocks, c + r * ldc, ldc);
    switch (m - r) {
      case 3:
        row_tile<3>(qa + r * lda, lda, w, b, blocks, c + r * ldc, ldc);
        break;
      case 2:
        row_tile<2>(qa + r * lda, lda, w, b, blocks, c + r * ldc, ldc);
        break;
      case 1:
        row_tile<1>(qa + r * lda, lda, w, b, blocks, c + r * ldc, ldc);
        break;
      default:
        break;
    }
  }
}

}  // namespace inflight::kernels::cpu::w8a8_detail
