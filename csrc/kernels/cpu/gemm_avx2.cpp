// AVX2 + FMA + F16C paths of the W4A16, W8A16 and dense GEMMs (CPUs without AVX-512): the algorithms
// of gemm_impl.h over 8-lane vectors. Compiled with AVX2 flags; called only when selected_isa() is
// kAvx2. AVX2 has 16 vector registers, hence smaller register tiles than AVX-512's; bf16 and fp16
// values are widened to fp32 on load (bf16: a shift).
#include <immintrin.h>

#define INFLIGHT_GEMM_ISA gemm_avx2
#include "gemm_impl.h"

namespace inflight::kernels::cpu::gemm_avx2 {
namespace {

struct Vec256 {
  using Reg = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kRegs = 16;
  // Register tiles: W4Fma 3 weight rows x 2 x rows (6 accumulators + 4 split x vectors), W8Fma 4 x 2.
  static constexpr int kW4Rows = 3, kW4MaxMR = 2;
  static constexpr int kW8Rows = 4, kW8MaxMR = 2;
  static constexpr bool kW8GroupSums = false;

  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float v) { return _mm256_set1_ps(v); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }

  static Reg load(float const* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static Reg load(Float16 const* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p))); }
  static Reg load(BFloat16 const* p) {
    __m256i const w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  // Through a stack copy: AVX2 has no masked 16-bit loads.
  template <class T>
  static Reg load_tail(T const* p, std::int64_t left) {
    T buf[kWidth] = {};
    for (std::int64_t j = 0; j < left; ++j) buf[j] = p[j];
    return load(buf);
  }
  static Reg bcast(float const* p) { return _mm256_set1_ps(*p); }
  static Reg bcast(BFloat16 const* p) { return _mm256_set1_ps(bf16_to_float(p->bits)); }
  static Reg bcast(Float16 const* p) { return _mm256_set1_ps(_cvtsh_ss(p->bits)); }

  static __m256i bytes(void const* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(static_cast<__m128i const*>(p))); }
  static Reg int8(std::int8_t const* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(p))));
  }
  // 8 E4M3 bytes as fp32, exactly (see Vec512::fp8).
  static Reg fp8(std::int8_t const* p) {
    __m128i const b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(p)));
    __m128i const mag = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7);
    __m128i const sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(mag, sign)), _mm256_set1_ps(256.0f));
  }
  template <bool kFp8>
  static Reg w8(std::int8_t const* p) {
    return kFp8 ? fp8(p) : int8(p);
  }
  static void nibbles(std::uint8_t const* p, Reg& lo, Reg& hi) {
    __m256i const d = bytes(p);
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(0xf)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4));
  }
  static void deinterleave(Reg a, Reg b, Reg& even, Reg& odd) {
    // shuffle_ps works per 128-bit lane: [a0 a2 b0 b2 | a4 a6 b4 b6]; then 64-bit chunks 0, 2, 1, 3.
    even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
    odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8));
  }

  // Lane j: the sum of v_j's 8 lanes as ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)), the order of
  // the one-register reduction the W4 / W8 kernels used, so their results stay as they were.
  static __m128 reduce4(Reg a, Reg b, Reg c, Reg d) {
    auto const halves = [](Reg v) { return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); };
    __m128 const ha = halves(a), hb = halves(b), hc = halves(c), hd = halves(d);
    __m128 const ab = _mm_add_ps(_mm_unpacklo_ps(ha, hb), _mm_unpackhi_ps(ha, hb));  // [a02 b02 a13 b13]
    __m128 const cd = _mm_add_ps(_mm_unpacklo_ps(hc, hd), _mm_unpackhi_ps(hc, hd));
    return _mm_add_ps(_mm_movelh_ps(ab, cd), _mm_movehl_ps(cd, ab));
  }
  // The dense kernel's order: ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), by horizontal adds.
  static __m128 reduce4_dense(Reg a, Reg b, Reg c, Reg d) {
    __m256 const abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
  }

  template <class T>
  static __m128 load4(T const* p, int n) {
    alignas(16) float v[4] = {-0.0f, -0.0f, -0.0f, -0.0f};
    for (int j = 0; j < n; ++j) v[j] = to_float(p[j]);
    return _mm_load_ps(v);
  }
  template <class T>
  static void store4(T* p, int n, __m128 s) {
    alignas(16) float v[4];
    _mm_store_ps(v, s);
    for (int j = 0; j < n; ++j) p[j] = from_float<T>(v[j]);
  }

  template <class T>
  using DenseStep = FmaStep<Vec256, T>;
};

}  // namespace
}  // namespace inflight::kernels::cpu::gemm_avx2

namespace inflight::kernels::cpu {

using gemm_avx2::Vec256;

void w4a16_gemm_avx2(W4A16GemmParams const& p, ThreadPool& pool) {
  gemm_detail::dispatch_w4(p, [&](auto xt, auto st, auto asym) {
    gemm_detail::run_tiles(gemm_avx2::W4Fma<Vec256, decltype(xt), decltype(st), asym>{p}, p.m, p.n, p.k / 2,
                           p.num_threads, pool);
  });
}

void w8a16_gemm_avx2(W8A16GemmParams const& p, ThreadPool& pool) {
  gemm_detail::dispatch_w8(p, [&](auto xt, auto st, auto fp8) {
    gemm_detail::run_tiles(gemm_avx2::W8Fma<Vec256, decltype(xt), decltype(st), fp8>{p}, p.m, p.n, p.k, p.num_threads,
                           pool);
  });
}

// 4 weight rows x 2 x rows: 8 accumulators + 2 x vectors + 1 weight vector of the 16 registers.
void dense_gemm_avx2(DenseGemmParams const& p, ThreadPool& pool) { gemm_avx2::run_dense<Vec256, 4, 2>(p, pool); }

}  // namespace inflight::kernels::cpu
