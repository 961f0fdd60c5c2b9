// AVX2 (+FMA, F16C) block kernels of the fused sampler (see sampling.h). Compiled with those
// flags and only called when cpu_features() reports them.
#include <immintrin.h>

#include <cstdint>
#include <limits>

#include "sampling.h"

namespace inflight::kernels::cpu::detail {
namespace {

// Template parameters of the block kernels: T, the logits' storage type (float, BFloat16,
// Float16); M, what block_stats accumulates (StatsMode). Each is instantiated for all of them.

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr std::int64_t kLanes = 8;

// The scalar loads of the vector tails (fp16 through F16C, as the vector loads).
inline float load_scalar(float v) { return v; }
inline float load_scalar(BFloat16 v) { return bf16_to_float(v.bits); }
inline float load_scalar(Float16 v) { return _cvtsh_ss(v.bits); }

inline __m256 load_full(float const* p) { return _mm256_loadu_ps(p); }
inline __m256 load_full(BFloat16 const* p) {
  __m128i const h = _mm_loadu_si128(reinterpret_cast<__m128i const*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load_full(Float16 const* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
}

// 8 logits as floats; lanes at or past n read as -inf (no mass, no threshold passed).
template <typename T>
inline __m256 load(T const* p, std::int64_t i, std::int64_t n) {
  if (n - i >= kLanes) return load_full(p + i);
  alignas(32) float tmp[kLanes];
  for (std::int64_t j = 0; j < kLanes; ++j) tmp[j] = i + j < n ? load_scalar(p[i + j]) : -kInf;
  return _mm256_load_ps(tmp);
}

inline int valid_bits(std::int64_t i, std::int64_t n) {
  std::int64_t const left = n - i;
  return left >= kLanes ? 0xff : (1 << left) - 1;
}

// e^x for x <= 0 (Cephes expf, as the AVX-512 path, with 2^n built in the exponent field);
// e^0 is exactly 1; x < -87 and NaN give 0.
inline __m256 exp_ps(__m256 x) {
  __m256 const live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  __m256 const n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  __m256 const y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  // n >= -126 here, so 2^n is a normal float.
  __m256i const pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2)));
}

inline double hsum(__m256 v) {
  __m256d const s =
      _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  __m128d const h = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
  return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

template <typename T>
void block_max(void const* src, std::int64_t n, float* max, std::int64_t* argmax) {
  T const* l = static_cast<T const*>(src);
  __m256 acc[4];
  for (int u = 0; u < 4; ++u) acc[u] = _mm256_set1_ps(-kInf);
  std::int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) acc[u] = _mm256_max_ps(load_full(l + i + u * kLanes), acc[u]);  // NaN: keeps acc
  }
  for (; i < n; i += kLanes) acc[0] = _mm256_max_ps(load(l, i, n), acc[0]);
  float const best = hmax(_mm256_max_ps(_mm256_max_ps(acc[0], acc[1]), _mm256_max_ps(acc[2], acc[3])));
  __m256 const b = _mm256_set1_ps(best);
  *max = best;
  *argmax = 0;
  for (i = 0; i < n; i += kLanes) {
    int const hit = _mm256_movemask_ps(_mm256_cmp_ps(load(l, i, n), b, _CMP_EQ_OQ)) & valid_bits(i, n);
    if (hit != 0) {
      *argmax = i + __builtin_ctz(hit);
      return;
    }
  }
}

template <typename T, StatsMode M>
void block_stats(void const* src, std::int64_t n, StatsArgs const& a, BlockStats* out) {
  T const* l = static_cast<T const*>(src);
  __m256 const inv_t = _mm256_set1_ps(a.inv_t), shift = _mm256_set1_ps(a.m), min_p = _mm256_set1_ps(a.min_p);
  // Four vectors per iteration: four independent exp chains keep the FMA ports busy.
  __m256 sum[4], kept[4];
  for (int u = 0; u < 4; ++u) sum[u] = kept[u] = _mm256_setzero_ps();
  for (std::int64_t i = 0; i < n; i += 4 * kLanes) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      std::int64_t const at = i + u * kLanes;
      if (at >= n) break;
      // Multiply then subtract, two roundings: the max token gets exactly e^0 = 1.
      __m256 const e = exp_ps(_mm256_sub_ps(_mm256_mul_ps(load(l, at, n), inv_t), shift));
      sum[u] = _mm256_add_ps(sum[u], e);
      if constexpr (M == StatsMode::kMinP) {
        kept[u] = _mm256_add_ps(kept[u], _mm256_and_ps(_mm256_cmp_ps(e, min_p, _CMP_GE_OQ), e));
      }
    }
  }
  out->sum = hsum(_mm256_add_ps(_mm256_add_ps(sum[0], sum[1]), _mm256_add_ps(sum[2], sum[3])));
  out->sum_kept = hsum(_mm256_add_ps(_mm256_add_ps(kept[0], kept[1]), _mm256_add_ps(kept[2], kept[3])));
}

template <typename T>
void block_exp(void const* src, std::int64_t n, float inv_t, float m, float* e) {
  T const* l = static_cast<T const*>(src);
  __m256 const it = _mm256_set1_ps(inv_t), shift = _mm256_set1_ps(m);
  for (std::int64_t i = 0; i < n; i += kLanes) {
    __m256 const v = exp_ps(_mm256_sub_ps(_mm256_mul_ps(load(l, i, n), it), shift));
    if (n - i >= kLanes) {
      _mm256_storeu_ps(e + i, v);
    } else {
      alignas(32) float tmp[kLanes];
      _mm256_store_ps(tmp, v);
      for (std::int64_t j = 0; i + j < n; ++j) e[i + j] = tmp[j];
    }
  }
}

template <typename T>
std::int64_t block_collect(void const* src, std::int64_t n, float threshold, std::int32_t base, float* l_out,
                           std::int32_t* idx_out) {
  T const* l = static_cast<T const*>(src);
  __m256 const thr = _mm256_set1_ps(threshold);
  std::int64_t c = 0;
  auto emit = [&](std::int64_t at, __m256 v, int hit) {
    alignas(32) float tmp[kLanes];
    _mm256_store_ps(tmp, v);
    while (hit != 0) {
      int const j = __builtin_ctz(hit);
      hit &= hit - 1;
      l_out[c] = tmp[j];
      idx_out[c] = base + static_cast<std::int32_t>(at + j);
      ++c;
    }
  };
  std::int64_t i = 0;
  // Candidates are rare: test four vectors with one branch.
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    __m256 v[4];
    __m256 any = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      v[u] = load_full(l + i + u * kLanes);
      any = _mm256_or_ps(any, _mm256_cmp_ps(v[u], thr, _CMP_GE_OQ));
    }
    if (_mm256_movemask_ps(any) == 0) continue;
    for (int u = 0; u < 4; ++u) {
      int const hit = _mm256_movemask_ps(_mm256_cmp_ps(v[u], thr, _CMP_GE_OQ));
      if (hit != 0) emit(i + u * kLanes, v[u], hit);
    }
  }
  for (; i < n; i += kLanes) {
    __m256 const v = load(l, i, n);
    int const hit = _mm256_movemask_ps(_mm256_cmp_ps(v, thr, _CMP_GE_OQ)) & valid_bits(i, n);
    if (hit != 0) emit(i, v, hit);
  }
  return c;
}

void divide_exp(float* x, std::int64_t n, float t, float m, float* e) {
  __m256 const tv = _mm256_set1_ps(t), shift = _mm256_set1_ps(m);
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    __m256 const v = _mm256_div_ps(_mm256_loadu_ps(x + i), tv);
    _mm256_storeu_ps(x + i, v);
    _mm256_storeu_ps(e + i, exp_ps(_mm256_sub_ps(v, shift)));
  }
  if (i < n) {
    // The tail through a padded vector, so that it gets bitwise the same division and exp.
    alignas(32) float tmp[kLanes];
    alignas(32) float ex[kLanes];
    for (std::int64_t j = 0; j < kLanes; ++j) tmp[j] = i + j < n ? x[i + j] : -kInf;
    __m256 const v = _mm256_div_ps(_mm256_load_ps(tmp), tv);
    _mm256_store_ps(tmp, v);
    _mm256_store_ps(ex, exp_ps(_mm256_sub_ps(v, shift)));
    for (std::int64_t j = 0; i + j < n; ++j) {
      x[i + j] = tmp[j];
      e[i + j] = ex[j];
    }
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

SamplingBlockKernels const& sampling_kernels_avx2(ScalarType dtype) {
  static SamplingBlockKernels const table[3] = {make_kernels<float>(), make_kernels<BFloat16>(),
                                                make_kernels<Float16>()};
  return table[static_cast<int>(dtype)];
}

}  // namespace inflight::kernels::cpu::detail
