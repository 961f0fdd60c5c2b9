// Small AVX-512 helpers shared by the *_avx512.cpp kernel files. Include only from those files (they are
// compiled with the AVX-512 flags); everything here has internal linkage, so no AVX-512 copy can be
// merged by the linker into code that runs on a CPU without AVX-512.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace inflight::kernels::cpu::avx512_common {
namespace {

// Lanes [0, count) set, clamped to [0, 16] / [0, 32].
inline __mmask16 mask16(std::int64_t count) {
  if (count <= 0) return 0;
  return count >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << count) - 1u);
}
inline __mmask32 mask32(std::int64_t count) {
  if (count <= 0) return 0;
  return count >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << count) - 1u);
}

// Lane j of the result: the sum of all 16 lanes of v_j. Transposes while adding (12 shuffles and adds
// for four sums, instead of four separate reductions).
[[gnu::always_inline]] inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d.
  __m512 const ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 const cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // Per 128-bit lane: [sum a, sum b, sum c, sum d] of that lane's four elements.
  __m512d const abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  __m512 const abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  __m256 const h = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

}  // namespace
}  // namespace inflight::kernels::cpu::avx512_common
