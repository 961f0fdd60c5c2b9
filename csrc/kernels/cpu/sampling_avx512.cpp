// AVX-512 block kernels of the fused sampler (see sampling.h): sampling_impl.h over 16-lane zmm
// vectors with mask registers. Compiled with the AVX-512 flags and only called when cpu_features()
// reports them.
// GCC 12 reports the _mm512_undefined_* placeholders inside its own intrinsics as uninitialized
// (a known false positive, GCC PR 105593); the warnings point into the header, silenced there.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>
#include <limits>

#define INFLIGHT_SAMPLING_ISA avx512
#include "sampling_impl.h"

namespace inflight::kernels::cpu::avx512 {
namespace {

struct Vec512 {
  using Reg = __m512;
  using Mask = __mmask16;
  using Acc = __m512;  // float lanes, summed into a double once per block (acc_total)
  static constexpr int kWidth = 16;
  static constexpr int kUnroll = 4;
  static constexpr float kInf = std::numeric_limits<float>::infinity();

  static Reg set1(float x) { return _mm512_set1_ps(x); }
  static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm512_div_ps(a, b); }
  static Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
  static float hmax(Reg v) { return _mm512_reduce_max_ps(v); }
  // One rounding: what GCC (whose default -ffp-contract=fast fuses the multiply and the subtract)
  // has always made of this path's mul-then-sub.
  static Reg scale_shift(Reg x, Reg s, Reg m) { return _mm512_fmsub_ps(x, s, m); }

  // The exp's pieces (exp_cephes).
  static Reg exp(Reg x) { return exp_cephes<Vec512>(x); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg fnmadd(Reg a, Reg b, Reg c) { return _mm512_fnmadd_ps(a, b, c); }
  static Reg round(Reg v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // VSCALEF, zeroing the dead lanes.
  static Reg pow2_live(Reg y, Reg n, Mask live) { return _mm512_maskz_scalef_ps(live, y, n); }

  static Mask lanes(std::int64_t left) {
    return left >= kWidth ? static_cast<Mask>(0xffff) : static_cast<Mask>((1u << left) - 1u);
  }
  // 16 logits as floats; lanes outside `m` read as -inf (so they add no mass and pass no threshold).
  static Reg load(float const* p, Mask m) { return _mm512_mask_loadu_ps(_mm512_set1_ps(-kInf), m, p); }
  static Reg load(BFloat16 const* p, Mask m) {
    __m256i const h = _mm256_maskz_loadu_epi16(m, p);
    __m512 const v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_mask_blend_ps(m, _mm512_set1_ps(-kInf), v);
  }
  static Reg load(Float16 const* p, Mask m) {
    __m256i const h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_mask_blend_ps(m, _mm512_set1_ps(-kInf), _mm512_cvtph_ps(h));
  }
  static Reg load(float const* p) { return _mm512_loadu_ps(p); }
  static Reg load(BFloat16 const* p) {
    __m256i const h = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static Reg load(Float16 const* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p))); }
  // T: float, BFloat16 or Float16.
  template <class T>
  static Reg load_part(T const* p, std::int64_t left) {
    return load(p, lanes(left));
  }
  static void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static void store_part(float* p, Reg v, std::int64_t left) { _mm512_mask_storeu_ps(p, lanes(left), v); }

  static Mask cmp_ge(Reg a, Reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  static Mask cmp_eq(Reg a, Reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static Mask mask_or(Mask a, Mask b) { return _kor_mask16(a, b); }
  static unsigned bits(Mask m) { return m; }
  static unsigned valid_bits(std::int64_t left) { return lanes(left); }

  static Acc acc_zero() { return _mm512_setzero_ps(); }
  static Acc acc_add(Acc a, Reg e) { return _mm512_add_ps(a, e); }
  static Acc acc_add_if(Acc a, Mask m, Reg e) { return _mm512_mask_add_ps(a, m, a, e); }
  static Acc acc_merge(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  // The lanes in double (the block sums feed an inverse CDF; float would lose ~1e-6 of it).
  static double acc_total(Acc v) {
    __m512d const lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    __m512d const hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
  }

  // VCOMPRESS in registers, then whole-vector stores (the memory-destination compress is slow).
  static std::int64_t compress(float* l_out, std::int32_t* idx_out, Reg v, unsigned hit, std::int32_t first) {
    __m512i const iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i const idx = _mm512_add_epi32(_mm512_set1_epi32(first), iota);
    _mm512_storeu_ps(l_out, _mm512_maskz_compress_ps(static_cast<Mask>(hit), v));
    _mm512_storeu_si512(idx_out, _mm512_maskz_compress_epi32(static_cast<Mask>(hit), idx));
    return __builtin_popcount(hit);
  }
};

}  // namespace
}  // namespace inflight::kernels::cpu::avx512

namespace inflight::kernels::cpu::detail {

SamplingBlockKernels const& sampling_kernels_avx512(ScalarType dtype) {
  return avx512::SamplingBlocks<avx512::Vec512>::table(dtype);
}

}  // namespace inflight::kernels::cpu::detail
