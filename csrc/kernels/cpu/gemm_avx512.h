// The AVX-512 (F/BW/VL/DQ + BF16) side of the CPU GEMMs: the vector traits of gemm_impl.h's algorithms
// (Vec512), the helpers the AVX-512-only strategies share, and those strategies' entry points. Include
// only from *_avx512.cpp files (compiled with the AVX-512 flags): everything here lives in the per-ISA
// namespace gemm_avx512, so no AVX-512 code can be merged by the linker into a TU that runs without it.
//
// The strategies, one file each (gemm_avx512.cpp picks among them, in this order):
//   gemm_panel_avx512.cpp  batched bf16 x: dequantise an L2-sized panel into bf16, run the dense kernel
//   gemm_tiled_avx512.cpp  batched fp32 / fp16 x (int8: any x): 8 x 3 register tiles of fp32 FMA, int4
//                          dequantised by VPERMPS table lookup
//   gemm_dot_avx512.cpp    int4 decode: bf16-exact nibbles and VDPBF16PS (W4Dot); its batched form with
//                          the nibbles dequantised once per panel (W4DotPanel, the same bits); bf16 x with
//                          rows too long for W4Dot's buffer: VPERMW lookup and VDPBF16PS (W4Bf16Dot)
//   gemm_fma_panel_impl.h  FmaPanel: W8Fma's / W4Fma's bits with each weight dequantised once per panel
//   gemm_impl.h            the rest: W4Fma (fp32 / fp16 x, long rows) and W8Fma (int8 decode)
// Under batch invariance (cpu_features.h, the default) the result may not depend on m: int4 runs W4Dot,
// from 16 rows (bf16 x: 64) as W4DotPanel, which sums every element as W4Dot does (W4Bf16Dot / W4Fma
// for long rows) and int8 W8Fma dequantising each weight vector at every m (from 16 rows as FmaPanel,
// the same bits); the bf16 panels and the tiles serve only LLM(batch_invariant=False).
//
// gemm_avx512f.cpp includes it too, with INFLIGHT_AVX512F_ONLY defined (AVX-512 without BF16): the
// namespace is then gemm_avx512f and the BF16 parts (Bf16Step; the strategies of the panel and dot files,
// declared here but defined only in the BF16 build) are left out.
#pragma once

#if defined(INFLIGHT_AVX512F_ONLY)
#define INFLIGHT_GEMM_ISA gemm_avx512f
#elif defined(__AVX512BF16__)
#define INFLIGHT_GEMM_ISA gemm_avx512
#else
#error "gemm_avx512.h is for the *_avx512.cpp files (AVX-512 + BF16 flags) or gemm_avx512f.cpp"
#endif

// GCC 12's AVX-512 conversion intrinsics (_mm512_cvtph_ps, _mm512_cvtepu16_epi32, ...) start from an
// "undefined" vector and trip -W(maybe-)uninitialized inside the compiler's own header: a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <immintrin.h>

#include <cstdint>

#include "gemm_fma_panel_impl.h"
#include "gemm_impl.h"

namespace inflight::kernels::cpu::INFLIGHT_GEMM_ISA {

// Lanes [0, count) set, clamped to [0, 16] / [0, 32].
inline __mmask16 mask16(std::int64_t count) {
  if (count <= 0) return 0;
  return count >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << count) - 1u);
}
inline __mmask32 mask32(std::int64_t count) {
  if (count <= 0) return 0;
  return count >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << count) - 1u);
}

// Up to 16 values (masked) as fp32.
inline __m512 load16_masked(float const* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16_masked(Float16 const* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
inline __m512 load16_masked(BFloat16 const* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m128i load_bytes16(void const* p) { return _mm_loadu_si128(static_cast<__m128i const*>(p)); }

struct Vec512 {
  using Reg = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kRegs = 32;
  // Register tiles: W4Fma 4 weight rows x 4 x rows (16 accumulators + 8 split x vectors), W8Fma 4 x 4.
  static constexpr int kW4Rows = 4, kW4MaxMR = 4;
  static constexpr int kW8Rows = 4, kW8MaxMR = 4;
  static constexpr bool kW8GroupSums = true;

  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float v) { return _mm512_set1_ps(v); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }

  static Reg load(float const* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static Reg load(Float16 const* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p))); }
  static Reg load(BFloat16 const* p) {
    __m512i const w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  template <class T>
  static Reg load_tail(T const* p, std::int64_t left) {
    return load16_masked(p, mask16(left));
  }
  static Reg bcast(float const* p) { return _mm512_set1_ps(*p); }
  static Reg bcast(BFloat16 const* p) { return _mm512_set1_ps(bf16_to_float(p->bits)); }
  static Reg bcast(Float16 const* p) { return _mm512_set1_ps(_cvtsh_ss(p->bits)); }

  static Reg int8(std::int8_t const* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes16(p))); }
  // 16 E4M3 bytes as fp32, exactly: (sign, exponent, mantissa) moved into fp16's fields give the value
  // times 2^-8 (subnormals included: the fp16 conversion takes them), then one exact multiply.
  static Reg fp8(std::int8_t const* p) {
    __m256i const b = _mm256_cvtepu8_epi16(load_bytes16(p));
    __m256i const mag = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
    __m256i const sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(mag, sign)), _mm512_set1_ps(256.0f));
  }
  template <bool kFp8>
  static Reg w8(std::int8_t const* p) {
    return kFp8 ? fp8(p) : int8(p);
  }
  static void nibbles(std::uint8_t const* p, Reg& lo, Reg& hi) {
    __m512i const d = _mm512_cvtepu8_epi32(load_bytes16(p));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(d, _mm512_set1_epi32(0xf)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
  }
  // W4Fma's lookup: a 16-lane table holds the row's group's 16 dequantised weights (q * scale + offset
  // for q = 0..15, the FMA nibbles() + fmadd would do per weight); VPERMPS indexes it with each lane's
  // byte, reading only the index's low 4 bits, so the low nibble needs no mask and the high one a shift.
  static constexpr bool kW4Lookup = true;
  static Reg w4_table(Reg scale, Reg offset) {
    return _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), scale, offset);
  }
  static void w4_lookup(std::uint8_t const* p, Reg table, Reg& lo, Reg& hi) {
    __m512i const d = _mm512_cvtepu8_epi32(load_bytes16(p));
    lo = _mm512_permutexvar_ps(d, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table);
  }
  static void deinterleave(Reg a, Reg b, Reg& even, Reg& odd) {
    even = _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), b);
    odd = _mm512_permutex2var_ps(a, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), b);
  }

  // Lane j of the result: the sum of all 16 lanes of the j-th argument. Transposes while adding (12
  // shuffles and adds for four sums, instead of four separate reductions).
  [[gnu::always_inline]] static __m128 reduce4(Reg a, Reg b, Reg c, Reg d) {
    // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d.
    __m512 const ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 const cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    // Per 128-bit lane: [sum a, sum b, sum c, sum d] of that lane's four elements.
    __m512d const abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    __m512 const abcd =
        _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)), _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
    __m256 const h = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  }
  [[gnu::always_inline]] static __m128 reduce4_dense(Reg a, Reg b, Reg c, Reg d) { return reduce4(a, b, c, d); }

  // The first n <= 4 values (masked: the others are neither read nor written). Rounding matches the
  // scalar from_float (to nearest even; bf16 in integer arithmetic, so subnormal sums round rather than
  // flush).
  static __mmask8 mask4(int n) { return static_cast<__mmask8>((1u << n) - 1u); }
  static __m128 load4(float const* p, int n) { return _mm_maskz_loadu_ps(mask4(n), p); }
  static __m128 load4(BFloat16 const* p, int n) {
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_maskz_loadu_epi16(mask4(n), p)), 16));
  }
  static __m128 load4(Float16 const* p, int n) { return _mm_cvtph_ps(_mm_maskz_loadu_epi16(mask4(n), p)); }
  static void store4(float* p, int n, __m128 v) { _mm_mask_storeu_ps(p, mask4(n), v); }
  static void store4(BFloat16* p, int n, __m128 v) {
    __m128i const u = _mm_castps_si128(v);
    __m128i const odd = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    __m128i const rounded = _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(odd, _mm_set1_epi32(0x7fff))), 16);
    // NaN: keep the sign and top payload bits, set the quiet bit (rounding could carry into infinity).
    __mmask8 const nan = _mm_cmpgt_epi32_mask(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
    __m128i const quiet = _mm_or_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(0x40));
    _mm_mask_storeu_epi16(p, mask4(n), _mm_cvtepi32_epi16(_mm_mask_blend_epi32(nan, rounded, quiet)));
  }
  static void store4(Float16* p, int n, __m128 v) {
    _mm_mask_storeu_epi16(p, mask4(n), _mm_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

#ifdef __AVX512BF16__
  // bf16 x bf16 steps 32 values at a time with VDPBF16PS, which multiplies bf16 pairs exactly and
  // accumulates them in fp32, so neither operand is ever converted.
  struct Bf16Step {
    using Vec = __m512bh;
    static constexpr int kStep = 32;
    static Vec load(BFloat16 const* p) { return (__m512bh)_mm512_loadu_si512(p); }
    static Vec load_tail(BFloat16 const* p, std::int64_t left) {
      return (__m512bh)_mm512_maskz_loadu_epi16(mask32(left), p);
    }
    static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_dpbf16_ps(acc, w, x); }
  };
  template <class T>
  using DenseStep = std::conditional_t<std::is_same_v<T, BFloat16>, Bf16Step, FmaStep<Vec512, T>>;
#else
  // Without BF16 every storage type is widened to fp32 on load and multiplied by FMA.
  template <class T>
  using DenseStep = FmaStep<Vec512, T>;
#endif
};

// Up to 4 scales (masked) as fp32 in an xmm.
inline __m128 load_scales4(float const* p, __mmask8 m) { return _mm_maskz_loadu_ps(m, p); }
inline __m128 load_scales4(Float16 const* p, __mmask8 m) { return _mm_cvtph_ps(_mm_maskz_loadu_epi16(m, p)); }
inline __m128 load_scales4(BFloat16 const* p, __mmask8 m) {
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_maskz_loadu_epi16(m, p)), 16));
}

// The 16 values a nibble stands for: q (asymmetric) or q - 8 (symmetric).
template <bool kAsym>
inline __m512 nibble_values() {
  return kAsym ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
               : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
}

// A group's 16 possible weights: q * scale + offset in one FMA, or scale * (q - 8) (symmetric; offset
// unused), each rounded once like the reference.
template <bool kAsym>
inline __m512 group_table(__m512 values, __m512 scale, __m512 offset) {
  return kAsym ? _mm512_fmadd_ps(values, scale, offset) : _mm512_mul_ps(values, scale);
}

// The strategies' entry points (see the top of this file). Each runs the whole GEMM and returns true, or
// returns false at once where it does not apply (x dtype, m, or a row too long for its buffers).
bool w4a16_panels(W4A16GemmParams const& p, ThreadPool& pool);
bool w8a16_panels(W8A16GemmParams const& p, ThreadPool& pool);
bool w4a16_tiled(W4A16GemmParams const& p, ThreadPool& pool);
bool w8a16_tiled(W8A16GemmParams const& p, ThreadPool& pool);
bool w4a16_dot(W4A16GemmParams const& p, ThreadPool& pool);
bool w4a16_dot_panels(W4A16GemmParams const& p, ThreadPool& pool);  // W4Dot's bits, m >= 16 (bf16 x: 64)
void w4a16_bf16_dot(W4A16GemmParams const& p, ThreadPool& pool);    // bf16 x, any k

}  // namespace inflight::kernels::cpu::INFLIGHT_GEMM_ISA
