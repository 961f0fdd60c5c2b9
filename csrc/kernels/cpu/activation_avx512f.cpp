// SiLU and tanh-approximate GELU over fp32 rows with AVX-512F (activation.h).
#include <immintrin.h>

#include <cmath>

#include "activation.h"

// GCC 12's AVX-512 intrinsics start from an "undefined" vector and trip -Wmaybe-uninitialized inside
// the compiler's own header: a false positive (as in gemm_avx512.h).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace inflight::kernels::cpu {

namespace {

// e^x for 16 lanes. x is clamped to [-104, 89] (the reduction needs a bounded x): VSCALEFPS then
// gives 0 below e^-103.9 and +inf above e^88.7, as expf does (SiLU's x / (1 + inf) is -0, as torch's).
[[gnu::always_inline]] inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
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

// One activation of 16 lanes.
template <bool kGelu>
[[gnu::always_inline]] inline __m512 act16(__m512 x) {
  if constexpr (kGelu) {
    // 0.5 x (1 + tanh(z)) = x / (1 + e^(-2z)), z = sqrt(2 / pi) (x + 0.044715 x^3): one exp, and no
    // cancellation where 1 + tanh(z) -> 0 (x below ~ -2), which the tanh form suffers in any precision.
    __m512 const cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    __m512 const z = _mm512_mul_ps(_mm512_set1_ps(float(M_SQRT2 * M_2_SQRTPI * 0.5)),
                                   _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), cube, x));
    __m512 const e = exp16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), z));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
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
