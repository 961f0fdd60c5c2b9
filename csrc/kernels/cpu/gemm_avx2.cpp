// AVX2 + FMA + F16C W4A16 and W8A16 paths (CPUs without AVX-512). Compiled with AVX2 flags; called
// only when selected_isa() is kAvx2. The same register tiles as the AVX-512 fp32 path with 8 lanes;
// AVX2 has 16 vector registers, hence the smaller tiles. bf16 activations are widened to fp32 on load.
#include <immintrin.h>

#include "gemm.h"

namespace inflight::kernels::cpu {
namespace {

using namespace gemm_detail;

inline __m256 bcast(float const* p) { return _mm256_set1_ps(*p); }
inline __m256 bcast(BFloat16 const* p) { return _mm256_set1_ps(bf16_to_float(p->bits)); }
inline __m256 bcast(Float16 const* p) { return _mm256_set1_ps(_cvtsh_ss(p->bits)); }

inline __m256 load8(float const* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(Float16 const* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p))); }
inline __m256 load8(BFloat16 const* p) {
  __m256i const w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

inline __m128i load_bytes8(void const* p) { return _mm_loadl_epi64(static_cast<__m128i const*>(p)); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int kNR>
inline void clamp_rows(std::int64_t n0, std::int64_t n, std::int64_t (&rows)[kNR]) {
  for (int r = 0; r < kNR; ++r) rows[r] = std::min(n0 + r, n - 1);
}

template <int MR, int kNR, class XT>
inline void store_tile(__m256 const (&acc)[MR][kNR], void* out_v, void const* bias_v, std::int64_t m0, std::int64_t n0,
                       std::int64_t n) {
  XT* out = static_cast<XT*>(out_v);
  XT const* bias = static_cast<XT const*>(bias_v);
  for (int i = 0; i < MR; ++i) {
    for (int r = 0; r < kNR; ++r) {
      if (n0 + r < n) store_out(out + (m0 + i) * n, bias, n0 + r, hsum(acc[i][r]));
    }
  }
}

// XT: x/out storage type; ST: scale/offset storage type; kAsym: offsets given.
template <class XT, class ST, bool kAsym>
struct W4Fma {
  static constexpr int kNR = 3;     // weight rows per tile
  static constexpr int kMaxMR = 2;  // x rows per tile (6 accumulators + 4 split x vectors of 16)
  W4A16GemmParams const& p;

  void tile(int mr, std::int64_t m0, std::int64_t n0) const { dispatch_mr<kMaxMR>(*this, mr, m0, n0); }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n0) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    std::int64_t rows[kNR];
    clamp_rows<kNR>(n0, p.n, rows);
    std::uint8_t const* w[kNR];
    ST const* s[kNR];
    ST const* o[kNR];
    for (int r = 0; r < kNR; ++r) {
      w[r] = p.qweight + rows[r] * (k_dim / 2);
      s[r] = static_cast<ST const*>(p.scales) + rows[r] * groups;
      o[r] = kAsym ? static_cast<ST const*>(p.offsets) + rows[r] * groups : nullptr;
    }
    XT const* x = static_cast<XT const*>(p.x) + m0 * k_dim;
    __m256 acc[MR][kNR];
    for (auto& row : acc)
      for (auto& a : row) a = _mm256_setzero_ps();
    __m256i const low4 = _mm256_set1_epi32(0xf);
    __m256 const minus8 = _mm256_set1_ps(-8.0f);
    for (std::int64_t g = 0; g < groups; ++g) {
      for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += 16) {
        // Bytes j = 0..7 hold k = 2j (low nibble) and 2j+1 (high): split x into even and odd k.
        __m256 xe[MR], xo[MR];
        for (int i = 0; i < MR; ++i) {
          __m256 const a = load8(x + i * k_dim + kb);
          __m256 const b = load8(x + i * k_dim + kb + 8);
          // shuffle_ps works per 128-bit lane: [a0 a2 b0 b2 | a4 a6 b4 b6]; then 64-bit chunks 0, 2, 1, 3.
          xe[i] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
          xo[i] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8));
        }
        for (int r = 0; r < kNR; ++r) {
          __m256 const sc = bcast(s[r] + g);
          __m256 const of = kAsym ? bcast(o[r] + g) : _mm256_mul_ps(sc, minus8);
          __m256i const d = _mm256_cvtepu8_epi32(load_bytes8(w[r] + kb / 2));
          __m256 const wl = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(d, low4)), sc, of);
          __m256 const wh = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4)), sc, of);
          for (int i = 0; i < MR; ++i) {
            acc[i][r] = _mm256_fmadd_ps(wl, xe[i], acc[i][r]);
            acc[i][r] = _mm256_fmadd_ps(wh, xo[i], acc[i][r]);
          }
        }
      }
    }
    store_tile<MR, kNR, XT>(acc, p.out, p.bias, m0, n0, p.n);
  }
};

template <class XT, class ST>
struct W8Fma {
  static constexpr int kNR = 4;     // weight rows per tile
  static constexpr int kMaxMR = 2;  // x rows per tile
  W8A16GemmParams const& p;

  void tile(int mr, std::int64_t m0, std::int64_t n0) const { dispatch_mr<kMaxMR>(*this, mr, m0, n0); }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n0) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    std::int64_t rows[kNR];
    clamp_rows<kNR>(n0, p.n, rows);
    std::int8_t const* w[kNR];
    ST const* s[kNR];
    for (int r = 0; r < kNR; ++r) {
      w[r] = p.qweight + rows[r] * k_dim;
      s[r] = static_cast<ST const*>(p.scales) + rows[r] * groups;
    }
    XT const* x = static_cast<XT const*>(p.x) + m0 * k_dim;
    __m256 acc[MR][kNR];
    for (auto& row : acc)
      for (auto& a : row) a = _mm256_setzero_ps();
    for (std::int64_t g = 0; g < groups; ++g) {
      __m256 sc[kNR];
      for (int r = 0; r < kNR; ++r) sc[r] = bcast(s[r] + g);
      for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += 8) {
        __m256 xv[MR];
        for (int i = 0; i < MR; ++i) xv[i] = load8(x + i * k_dim + kb);
        for (int r = 0; r < kNR; ++r) {
          __m256 const wv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_bytes8(w[r] + kb))), sc[r]);
          for (int i = 0; i < MR; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
        }
      }
    }
    store_tile<MR, kNR, XT>(acc, p.out, p.bias, m0, n0, p.n);
  }
};

}  // namespace

void w4a16_gemm_avx2(W4A16GemmParams const& p, ThreadPool& pool) {
  dispatch_float_type(p.dtype, [&](auto xt) {
    dispatch_float_type(p.scale_type, [&](auto st) {
      using XT = decltype(xt);
      using ST = decltype(st);
      if (p.offsets != nullptr) {
        run_tiles(W4Fma<XT, ST, true>{p}, p.m, p.n, p.k / 2, p.num_threads, pool);
      } else {
        run_tiles(W4Fma<XT, ST, false>{p}, p.m, p.n, p.k / 2, p.num_threads, pool);
      }
    });
  });
}

void w8a16_gemm_avx2(W8A16GemmParams const& p, ThreadPool& pool) {
  dispatch_float_type(p.dtype, [&](auto xt) {
    dispatch_float_type(p.scale_type, [&](auto st) {
      run_tiles(W8Fma<decltype(xt), decltype(st)>{p}, p.m, p.n, p.k, p.num_threads, pool);
    });
  });
}

}  // namespace inflight::kernels::cpu
