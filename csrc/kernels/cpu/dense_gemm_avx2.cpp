// AVX2 + FMA + F16C dense GEMM path (CPUs without AVX-512). Compiled with AVX2 flags; called only when
// selected_isa() is kAvx2. The register tiles of the AVX-512 path with 8 lanes and, for the 16 vector
// registers, fewer x rows per tile; bf16 and fp16 values are widened to fp32 on load (bf16: a shift).
#include <immintrin.h>

#include "dense_gemm.h"

namespace inflight::kernels::cpu {
namespace {

using namespace gemm_detail;

constexpr int kStep = 8;  // values of a row per vector

inline __m256 load8(float const* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(Float16 const* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p))); }
inline __m256 load8(BFloat16 const* p) {
  __m256i const w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// The last left (< kStep) values of a row, zero-padded: through a stack copy, never reading past k.
template <class T>
inline __m256 load8_tail(T const* p, std::int64_t left) {
  T buf[kStep] = {};
  for (std::int64_t j = 0; j < left; ++j) buf[j] = p[j];
  return load8(buf);
}

// Lane j of the result: the sum of all 8 lanes of v_j.
inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 const abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Software prefetch distance, in N tiles, into L2: as in the AVX-512 path (see there).
constexpr int kPrefetchTiles = 2;

// T: storage type of x, weight, bias and out.
template <class T>
struct DenseTile {
  static constexpr int kNR = 4;     // weight rows per tile
  static constexpr int kMaxMR = 2;  // x rows per tile: 8 accumulators + 2 x vectors + 1 weight vector
  DenseGemmParams const& p;

  void tile(int mr, std::int64_t m0, std::int64_t n0) const { dispatch_mr<kMaxMR>(*this, mr, m0, n0); }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n0) const {
    std::int64_t const k_dim = p.k;
    T const* w[kNR];
    for (int r = 0; r < kNR; ++r) {
      // Rows past n are clamped to the last row: computed, never stored.
      w[r] = static_cast<T const*>(p.weight) + std::min(n0 + r, p.n - 1) * k_dim;
    }
    T const* x = static_cast<T const*>(p.x) + m0 * k_dim;
    __m256 acc[MR][kNR];
    for (auto& row : acc)
      for (auto& a : row) a = _mm256_setzero_ps();
    std::int64_t const k_main = k_dim - k_dim % kStep;
    std::int64_t const ahead = kPrefetchTiles * kNR * k_dim;
    // One prefetch per 64-byte line of each row.
    constexpr std::int64_t kLine = 64 / sizeof(T);
    for (std::int64_t kk = 0; kk < k_main; kk += kStep) {
      __m256 xv[MR];
      for (int i = 0; i < MR; ++i) xv[i] = load8(x + i * k_dim + kk);
      for (int r = 0; r < kNR; ++r) {
        if (kk % kLine == 0) _mm_prefetch(reinterpret_cast<char const*>(w[r] + ahead + kk), _MM_HINT_T1);
        __m256 const wv = load8(w[r] + kk);
        for (int i = 0; i < MR; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
      }
    }
    if (k_main < k_dim) {
      std::int64_t const left = k_dim - k_main;
      __m256 xv[MR];
      for (int i = 0; i < MR; ++i) xv[i] = load8_tail(x + i * k_dim + k_main, left);
      for (int r = 0; r < kNR; ++r) {
        __m256 const wv = load8_tail(w[r] + k_main, left);
        for (int i = 0; i < MR; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
      }
    }
    T* out = static_cast<T*>(p.out);
    T const* bias = static_cast<T const*>(p.bias);
    for (int i = 0; i < MR; ++i) {
      alignas(16) float sums[4];
      _mm_store_ps(sums, reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
      for (int r = 0; r < kNR; ++r) {
        if (n0 + r < p.n)
          store_out(out + (m0 + i) * (p.out_row_stride > 0 ? p.out_row_stride : p.n), bias, n0 + r, sums[r]);
      }
    }
  }
};

}  // namespace

void dense_gemm_avx2(DenseGemmParams const& p, ThreadPool& pool) {
  dispatch_float_type(p.dtype, [&](auto t) {
    using T = decltype(t);
    run_tiles(DenseTile<T>{p}, p.m, p.n, p.k * static_cast<std::int64_t>(sizeof(T)), p.num_threads, pool);
  });
}

}  // namespace inflight::kernels::cpu
