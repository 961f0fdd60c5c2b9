// SiLU and tanh-GELU over fp32 rows with AVX-512F (activation.h).
#include <immintrin.h>

#include <cmath>

#include "activation.h"

namespace inflight::kernels::cpu {

namespace {

// e^x for 16 lanes (x clamped to [-87.3, 88.7]: below, e^x is ~0 next to the 1 it is added to).
[[gnu::always_inline]] inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  __m512 const n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 = 0.693359375 - 2.12194440e-4
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 const e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(e, n);
}

[[gnu::always_inline]] inline __m512 tanh16(__m512 x) {
  __m512 const sign = _mm512_and_ps(x, _mm512_castsi512_ps(_mm512_set1_epi32(0x80000000u)));
  __m512 const a = _mm512_andnot_ps(_mm512_castsi512_ps(_mm512_set1_epi32(0x80000000u)), x);
  // |x| < 0.625: x + x^3 P(x^2).
  __m512 const z = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
  __m512 const small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
  // Otherwise 1 - 2 / (e^(2|x|) + 1), with x's sign (e^(2|x|) saturates at e^88.7: tanh = 1).
  __m512 const e = exp16(_mm512_add_ps(a, a));
  __m512 const t = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                                 _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  __m512 const large = _mm512_or_ps(t, sign);
  __mmask16 const is_small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(is_small, large, small);
}

// One activation of 16 lanes.
template <bool kGelu>
[[gnu::always_inline]] inline __m512 act16(__m512 x) {
  if constexpr (kGelu) {
    // torch's formula: inner = beta * (x + kappa * x^3) (the add fused); 0.5 * x * (1 + tanh(inner)).
    __m512 const cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    __m512 const inner = _mm512_mul_ps(_mm512_set1_ps(float(M_SQRT2 * M_2_SQRTPI * 0.5)),
                                       _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), cube, x));
    __m512 const half_x = _mm512_mul_ps(_mm512_set1_ps(0.5f), x);
    return _mm512_mul_ps(half_x, _mm512_add_ps(_mm512_set1_ps(1.0f), tanh16(inner)));
  } else {
    __m512 const e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  }
}

template <bool kGelu>
void row(float const* x, float* out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, act16<kGelu>(_mm512_loadu_ps(x + i)));
  if (i < n) {
    __mmask16 const m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, m, act16<kGelu>(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

}  // namespace

void gated_activation_avx512f(float const* x, float* out, std::int64_t n, bool gelu) {
  if (gelu) {
    row<true>(x, out, n);
  } else {
    row<false>(x, out, n);
  }
}

}  // namespace inflight::kernels::cpu
