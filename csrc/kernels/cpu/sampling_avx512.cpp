// AVX-512 block kernels of the fused sampler (see sampling.h). Compiled with the AVX-512 flags and
// only called when cpu_features() reports them.
// GCC 12 reports the _mm512_undefined_* placeholders inside its own intrinsics as uninitialized
// (a known false positive, GCC PR 105593); the warnings point into the header, silenced there.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>
#include <limits>

#include "sampling.h"

namespace inflight::kernels::cpu::detail {
namespace {

// Template parameters of the block kernels: T, the logits' storage type (float, BFloat16,
// Float16); M, what block_stats accumulates (StatsMode). Each is instantiated for all of them.

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr std::int64_t kLanes = 16;

inline __mmask16 lanes(std::int64_t i, std::int64_t n) {
  std::int64_t const left = n - i;
  return left >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
}

// 16 logits as floats; lanes outside `m` read as -inf (so they add no mass and pass no threshold).
template <typename T>
__m512 load(T const* p, __mmask16 m);

template <>
__m512 load<float>(float const* p, __mmask16 m) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(-kInf), m, p);
}

template <>
__m512 load<BFloat16>(BFloat16 const* p, __mmask16 m) {
  __m256i const h = _mm256_maskz_loadu_epi16(m, p);
  __m512 const v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_mask_blend_ps(m, _mm512_set1_ps(-kInf), v);
}

template <>
__m512 load<Float16>(Float16 const* p, __mmask16 m) {
  __m256i const h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_mask_blend_ps(m, _mm512_set1_ps(-kInf), _mm512_cvtph_ps(h));
}

// e^x for x <= 0 (Cephes expf: x = n ln2 + r, e^r = 1 + r + r^2 P(r) with P of degree 5, 2^n by scalef);
// e^0 is exactly 1. x < -87 (e^x < 2^-125) and NaN give 0, so masked (-inf) tokens weigh nothing.
inline __m512 exp_ps(__m512 x) {
  __mmask16 const live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  __m512 const n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 const y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(live, y, n);
}

// Lane sum in double (the block sums feed an inverse CDF; float would lose ~1e-6 of it).
inline double hsum(__m512 v) {
  __m512d const lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  __m512d const hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}

template <typename T>
void block_max(void const* src, std::int64_t n, float* max, std::int64_t* argmax) {
  T const* l = static_cast<T const*>(src);
  __m512 acc[4];
  for (int u = 0; u < 4; ++u) acc[u] = _mm512_set1_ps(-kInf);
  std::int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) acc[u] = _mm512_max_ps(load(l + i + u * kLanes, 0xffff), acc[u]);  // NaN: keeps acc
  }
  for (; i < n; i += kLanes) acc[0] = _mm512_max_ps(load(l + i, lanes(i, n)), acc[0]);
  float const best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(acc[0], acc[1]), _mm512_max_ps(acc[2], acc[3])));
  __m512 const b = _mm512_set1_ps(best);
  *max = best;
  *argmax = 0;
  for (i = 0; i < n; i += kLanes) {
    __mmask16 const m = lanes(i, n);
    __mmask16 const hit = _mm512_mask_cmp_ps_mask(m, load(l + i, m), b, _CMP_EQ_OQ);
    if (hit != 0) {
      *argmax = i + __builtin_ctz(hit);
      return;
    }
  }
}

template <typename T, StatsMode M>
void block_stats(void const* src, std::int64_t n, StatsArgs const& a, BlockStats* out) {
  T const* l = static_cast<T const*>(src);
  __m512 const inv_t = _mm512_set1_ps(a.inv_t), shift = _mm512_set1_ps(a.m), min_p = _mm512_set1_ps(a.min_p);
  // Four vectors per iteration: four independent exp chains keep the FMA ports busy.
  __m512 sum[4], kept[4];
  for (int u = 0; u < 4; ++u) sum[u] = kept[u] = _mm512_setzero_ps();
  for (std::int64_t i = 0; i < n; i += 4 * kLanes) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      std::int64_t const at = i + u * kLanes;
      if (at >= n) break;
      // Multiply then subtract, two roundings: the max token gets exactly e^0 = 1.
      __m512 const e = exp_ps(_mm512_sub_ps(_mm512_mul_ps(load(l + at, lanes(at, n)), inv_t), shift));
      sum[u] = _mm512_add_ps(sum[u], e);
      if constexpr (M == StatsMode::kMinP) {
        kept[u] = _mm512_mask_add_ps(kept[u], _mm512_cmp_ps_mask(e, min_p, _CMP_GE_OQ), kept[u], e);
      }
    }
  }
  out->sum = hsum(_mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3])));
  out->sum_kept = hsum(_mm512_add_ps(_mm512_add_ps(kept[0], kept[1]), _mm512_add_ps(kept[2], kept[3])));
}

template <typename T>
void block_exp(void const* src, std::int64_t n, float inv_t, float m, float* e) {
  T const* l = static_cast<T const*>(src);
  __m512 const it = _mm512_set1_ps(inv_t), shift = _mm512_set1_ps(m);
  for (std::int64_t i = 0; i < n; i += kLanes) {
    __mmask16 const k = lanes(i, n);
    _mm512_mask_storeu_ps(e + i, k, exp_ps(_mm512_sub_ps(_mm512_mul_ps(load(l + i, k), it), shift)));
  }
}

template <typename T>
std::int64_t block_collect(void const* src, std::int64_t n, float threshold, std::int32_t base, float* l_out,
                           std::int32_t* idx_out) {
  T const* l = static_cast<T const*>(src);
  __m512 const thr = _mm512_set1_ps(threshold);
  __m512i const iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  std::int64_t c = 0;
  auto emit = [&](std::int64_t at, __m512 v, __mmask16 hit) {
    // Compress in registers, then a whole-vector store (memory-destination compress is slow).
    __m512i const idx = _mm512_add_epi32(_mm512_set1_epi32(base + static_cast<std::int32_t>(at)), iota);
    _mm512_storeu_ps(l_out + c, _mm512_maskz_compress_ps(hit, v));
    _mm512_storeu_si512(idx_out + c, _mm512_maskz_compress_epi32(hit, idx));
    c += __builtin_popcount(hit);
  };
  std::int64_t i = 0;
  // Candidates are rare: test four vectors with one branch.
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    __m512 v[4];
    __mmask16 hit[4];
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      v[u] = load(l + i + u * kLanes, 0xffff);
      hit[u] = _mm512_cmp_ps_mask(v[u], thr, _CMP_GE_OQ);
    }
    if ((hit[0] | hit[1] | hit[2] | hit[3]) == 0) continue;
    for (int u = 0; u < 4; ++u) {
      if (hit[u] != 0) emit(i + u * kLanes, v[u], hit[u]);
    }
  }
  for (; i < n; i += kLanes) {
    __mmask16 const m = lanes(i, n);
    __m512 const v = load(l + i, m);
    __mmask16 const hit = _mm512_mask_cmp_ps_mask(m, v, thr, _CMP_GE_OQ);
    if (hit != 0) emit(i, v, hit);
  }
  return c;
}

void divide_exp(float* x, std::int64_t n, float t, float m, float* e) {
  __m512 const tv = _mm512_set1_ps(t), shift = _mm512_set1_ps(m);
  for (std::int64_t i = 0; i < n; i += kLanes) {
    __mmask16 const k = lanes(i, n);
    __m512 const v = _mm512_div_ps(load(x + i, k), tv);
    _mm512_mask_storeu_ps(x + i, k, v);
    _mm512_mask_storeu_ps(e + i, k, exp_ps(_mm512_sub_ps(v, shift)));
  }
}

template <typename T>
SamplingBlockKernels make_kernels() {
  return {&block_max<T>,
          {&block_stats<T, StatsMode::kSum>, &block_stats<T, StatsMode::kMinP>},
          &block_exp<T>,
          &block_collect<T>,
          &divide_exp};
}

}  // namespace

SamplingBlockKernels const& sampling_kernels_avx512(ScalarType dtype) {
  static SamplingBlockKernels const table[3] = {make_kernels<float>(), make_kernels<BFloat16>(),
                                                make_kernels<Float16>()};
  return table[static_cast<int>(dtype)];
}

}  // namespace inflight::kernels::cpu::detail
