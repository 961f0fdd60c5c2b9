// AVX2 (+FMA, F16C) block kernels of the fused sampler (see sampling.h): sampling_impl.h over 8-lane
// ymm vectors. Compiled with those flags and only called when cpu_features() reports them.
#include <immintrin.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#define INFLIGHT_SAMPLING_ISA avx2
#include "sampling_impl.h"

namespace inflight::kernels::cpu::avx2 {
namespace {

struct Vec256 {
  using Reg = __m256;
  using Mask = __m256;  // a compare result: all-ones lanes
  using Acc = __m256;   // float lanes, summed into a double once per block (acc_total)
  static constexpr int kWidth = 8;
  static constexpr int kUnroll = 4;
  static constexpr float kInf = std::numeric_limits<float>::infinity();

  static Reg set1(float x) { return _mm256_set1_ps(x); }
  static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm256_div_ps(a, b); }
  static Reg max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
  static float hmax(Reg v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  // One rounding: what GCC (whose default -ffp-contract=fast fuses the multiply and the subtract)
  // has always made of this path's mul-then-sub.
  static Reg scale_shift(Reg x, Reg s, Reg m) { return _mm256_fmsub_ps(x, s, m); }

  // The exp's pieces (exp_cephes).
  static Reg exp(Reg x) { return exp_cephes<Vec256>(x); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg fnmadd(Reg a, Reg b, Reg c) { return _mm256_fnmadd_ps(a, b, c); }
  static Reg round(Reg v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^n built in the exponent field (n >= -126, so it is a normal float); dead lanes cleared.
  static Reg pow2_live(Reg y, Reg n, Mask live) {
    __m256i const pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(live, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2)));
  }

  static Reg load(float const* p) { return _mm256_loadu_ps(p); }
  static Reg load(BFloat16 const* p) {
    __m128i const h = _mm_loadu_si128(reinterpret_cast<__m128i const*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static Reg load(Float16 const* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p))); }

  // The scalar loads of a partial vector (fp16 through F16C, as the vector loads).
  static float load_scalar(float v) { return v; }
  static float load_scalar(BFloat16 v) { return bf16_to_float(v.bits); }
  static float load_scalar(Float16 v) { return _cvtsh_ss(v.bits); }

  // The lanes < left (left < kWidth), as a VMASKMOV mask.
  static __m256i lane_mask(std::int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  // AVX2 masks 32-bit loads (VMASKMOVPS: the masked lanes read 0, and never fault), not 16-bit
  // ones: a partial bf16 / fp16 vector goes through the stack. T: float, BFloat16 or Float16.
  template <class T>
  static Reg load_part(T const* p, std::int64_t left) {
    if (left >= kWidth) return load(p);
    if constexpr (std::is_same_v<T, float>) {
      __m256i const m = lane_mask(left);
      return _mm256_blendv_ps(_mm256_set1_ps(-kInf), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
    } else {
      alignas(32) float tmp[kWidth];
      for (std::int64_t j = 0; j < kWidth; ++j) tmp[j] = j < left ? load_scalar(p[j]) : -kInf;
      return _mm256_load_ps(tmp);
    }
  }
  static void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static void store_part(float* p, Reg v, std::int64_t left) {
    if (left >= kWidth) return store(p, v);
    _mm256_maskstore_ps(p, lane_mask(left), v);
  }

  static Mask cmp_ge(Reg a, Reg b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
  static Mask cmp_eq(Reg a, Reg b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
  static Mask mask_or(Mask a, Mask b) { return _mm256_or_ps(a, b); }
  static unsigned bits(Mask m) { return static_cast<unsigned>(_mm256_movemask_ps(m)); }
  static unsigned valid_bits(std::int64_t left) { return left >= kWidth ? 0xffu : (1u << left) - 1u; }

  static Acc acc_zero() { return _mm256_setzero_ps(); }
  static Acc acc_add(Acc a, Reg e) { return _mm256_add_ps(a, e); }
  static Acc acc_add_if(Acc a, Mask m, Reg e) { return _mm256_add_ps(a, _mm256_and_ps(m, e)); }
  static Acc acc_merge(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  // The lanes in double (the block sums feed an inverse CDF; float would lose ~1e-6 of it).
  static double acc_total(Acc v) {
    __m256d const s =
        _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    __m128d const h = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
  }

  // No compress instruction on AVX2: the set lanes one by one, from a copy on the stack.
  static std::int64_t compress(float* l_out, std::int32_t* idx_out, Reg v, unsigned hit, std::int32_t first) {
    alignas(32) float tmp[kWidth];
    _mm256_store_ps(tmp, v);
    std::int64_t c = 0;
    while (hit != 0) {
      int const j = __builtin_ctz(hit);
      hit &= hit - 1;
      l_out[c] = tmp[j];
      idx_out[c] = first + j;
      ++c;
    }
    return c;
  }
};

}  // namespace
}  // namespace inflight::kernels::cpu::avx2

namespace inflight::kernels::cpu::detail {

SamplingBlockKernels const& sampling_kernels_avx2(ScalarType dtype) {
  return avx2::SamplingBlocks<avx2::Vec256>::table(dtype);
}

}  // namespace inflight::kernels::cpu::detail
