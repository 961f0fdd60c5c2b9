// A8 GEMM with AVX512-VNNI (a8_gemm.h): the activation quantisation in vectors and the VPDPBUSD tiles.
// Both compute exactly the operations of the portable code in a8_gemm.cpp, in its order, so the bits
// are the same (max and integer sums do not depend on their order; every float operation is the
// same single IEEE operation). No BF16 instructions: this file also runs on AVX-512 CPUs without them.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "a8_gemm.h"

// GCC 12's AVX-512 intrinsics (conversions, shuffles, reductions) start from an "undefined" vector and
// trip -Wmaybe-uninitialized inside the compiler's own header: a false positive (as in gemm_avx512.h).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace inflight::kernels::cpu::a8_detail {

namespace {

// 16 consecutive elements of x as fp32 (exact for every input type).
template <class T>
[[gnu::always_inline]] inline __m512 load16(T const* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(x);
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    __m512i const h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(x)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(x)));
  }
}

// The value of v, hidden from the optimiser: GCC contracts a multiply feeding an add into one FMA
// (-ffp-contract=fast, its default), which rounds once where the portable code rounds twice (x * inv
// exactly 116.5, then the tie to even, became 117 once in ~1e5 groups).
[[gnu::always_inline]] inline __m512 opaque(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

template <class T, int kE, int kLimbs>
void quantize_t(T const* x, std::int64_t m, std::int64_t k, std::int8_t* q, float* d, std::int32_t* sq, float* ds) {
  constexpr int kV = kE / 16;
  constexpr float kMax = kLimbs == 2 ? kA16Max : 127.0f;
  std::int64_t const groups = k / kE;
  __m512 const magic = _mm512_set1_ps(12582912.0f), lo = _mm512_set1_ps(-kMax), hi = _mm512_set1_ps(kMax);
  __m512i const half = _mm512_set1_epi32(128);
  __m512 const abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (std::int64_t r = 0; r < m; ++r) {
    for (std::int64_t g = 0; g < groups; ++g) {
      T const* xs = x + r * k + g * kE;
      __m512 v[kV];
      __m512 amax_v = _mm512_setzero_ps();
      for (int j = 0; j < kV; ++j) {
        v[j] = load16(xs + 16 * j);
        amax_v = _mm512_max_ps(amax_v, _mm512_and_ps(v[j], abs_mask));
      }
      float const amax = _mm512_reduce_max_ps(amax_v);  // a max and an integer sum: any order
      // A group so small that kMax / amax overflows (amax below ~1e-35) counts as all zero.
      bool const tiny = amax > 0.0f && std::isinf(kMax / amax);
      float const inv = amax > 0.0f && !tiny ? kMax / amax : 0.0f;
      __m512 const inv_v = _mm512_set1_ps(inv);
      __m512i sum = _mm512_setzero_si512();
      for (int j = 0; j < kV; ++j) {
        __m512 const s = opaque(_mm512_mul_ps(v[j], inv_v));
        __m512 const rv = _mm512_sub_ps(_mm512_add_ps(s, magic), magic);
        __m512i const qi = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(rv, lo), hi));
        std::int8_t* const qs = q + r * kLimbs * k + g * kE + 16 * j;
        if constexpr (kLimbs == 2) {  // q = 256 h + l: h = (q + 128) >> 8 (arithmetic), l = q - 256 h
          __m512i const h = _mm512_srai_epi32(_mm512_add_epi32(qi, half), 8);
          __m512i const l = _mm512_sub_epi32(qi, _mm512_slli_epi32(h, 8));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qs), _mm512_cvtepi32_epi8(h));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + k), _mm512_cvtepi32_epi8(l));
        } else {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qs), _mm512_cvtepi32_epi8(qi));
        }
        sum = _mm512_add_epi32(sum, qi);
      }
      std::int32_t const total = _mm512_reduce_add_epi32(sum);
      float const dg = tiny ? 0.0f : amax / kMax;
      d[r * groups + g] = dg;
      sq[r * groups + g] = total;
      ds[r * groups + g] = dg * static_cast<float>(total);
    }
  }
}

// Scales (or offsets) of 16 channels as fp32. ST: std::uint16_t (fp16 bits) or float.
template <class ST>
[[gnu::always_inline]] inline __m512 load_scales(std::uint8_t const* base) {
  if constexpr (std::is_same_v<ST, float>) {
    return _mm512_loadu_ps(reinterpret_cast<float const*>(base));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(base)));
  }
}

// kR rows (m0 ..) x kB blocks of 16 channels (blocks b0 .. of panel p): the int32 sums of each group,
// then its fp32 epilogue; then the bias and the store. kBits: 4 or 8; kE: the epilogue group (16 or
// 32); ST: the scales' storage (std::uint16_t fp16 bits, or float); kAsym: int4 with offsets; kLimbs:
// 1 (A8) or 2 (A16: the high limbs' sums, shifted left by 8, then the low limbs' added on).
template <int kR, int kB, int kBits, int kE, class ST, bool kAsym, int kLimbs>
void tile(A8PackedWeight const& w, Activations const& a, std::int64_t m0, std::int64_t p, int b0, void* out,
          ScalarType dtype) {
  constexpr int kVecs = kBits == 4 ? kE / 8 : kE / 4;  // weight vectors per block and group
  constexpr std::int64_t kCodeBytes = std::int64_t(kVecs) * 4 * 64;
  constexpr int kSB = sizeof(ST);
  // A record: the codes, the 64 scales, (kAsym) the 64 offsets.
  constexpr std::int64_t kRecordBytes = kCodeBytes + (kAsym ? 2 : 1) * kA8Panel * kSB;
  // Decode streams the weights from memory: fetch the record this many groups ahead (measured on Zen 4).
  constexpr int kAhead = 2;
  std::int64_t const groups = a.groups, k = a.k;
  std::uint8_t const* data = w.data.data() + p * groups * kRecordBytes;
  std::int64_t const row = kLimbs * k;  // a row's codes: its limbs back to back
  std::int8_t const* q = a.q + m0 * row;
  __m512i const nibble = _mm512_set1_epi8(0x0F);
  __m512 f[kR][kB];
  for (int r = 0; r < kR; ++r) {
    for (int b = 0; b < kB; ++b) f[r][b] = _mm512_setzero_ps();
  }
  for (std::int64_t g = 0; g < groups; ++g) {
    std::uint8_t const* rec = data + g * kRecordBytes;
    if constexpr (kR <= 2) {
      for (std::int64_t l = 0; l < kRecordBytes; l += 64) {
        _mm_prefetch(reinterpret_cast<char const*>(rec + kAhead * kRecordBytes + l), _MM_HINT_T0);
      }
    }
    std::uint8_t const* gd = rec + b0 * 64;
    __m512i acc[kR][kB];
    for (int r = 0; r < kR; ++r) {
      for (int b = 0; b < kB; ++b) acc[r][b] = _mm512_setzero_si512();
    }
    for (int limb = 0; limb < kLimbs; ++limb) {
      if (limb == kLimbs - 1) {
        for (int r = 0; r < kR; ++r) {
          // The zero point's share, -z * sum q, joins the last limb's sum (exact; 0 for asymmetric int4).
          __m512i const init = _mm512_set1_epi32(-w.zero_point * a.sq[(m0 + r) * groups + g]);
          for (int b = 0; b < kB; ++b) {
            acc[r][b] = _mm512_add_epi32(kLimbs == 2 ? _mm512_slli_epi32(acc[r][b], 8) : acc[r][b], init);
          }
        }
      }
      std::int8_t const* qg = q + limb * k + g * kE;
      for (int v = 0; v < kVecs; ++v) {
        if constexpr (kBits == 4) {
          __m512i lo[kB], hi[kB];
          for (int b = 0; b < kB; ++b) {
            __m512i const x = _mm512_loadu_si512(gd + (v * 4 + b) * 64);
            lo[b] = _mm512_and_si512(x, nibble);
            hi[b] = _mm512_and_si512(_mm512_srli_epi16(x, 4), nibble);
          }
          for (int r = 0; r < kR; ++r) {
            std::int32_t a0, a1;
            std::memcpy(&a0, qg + r * row + v * 8, 4);
            std::memcpy(&a1, qg + r * row + v * 8 + 4, 4);
            __m512i const x0 = _mm512_set1_epi32(a0), x1 = _mm512_set1_epi32(a1);
            for (int b = 0; b < kB; ++b) {
              acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], lo[b], x0);
              acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], hi[b], x1);
            }
          }
        } else {
          __m512i wv[kB];
          for (int b = 0; b < kB; ++b) wv[b] = _mm512_loadu_si512(gd + (v * 4 + b) * 64);
          for (int r = 0; r < kR; ++r) {
            std::int32_t a0;
            std::memcpy(&a0, qg + r * row + v * 4, 4);
            __m512i const x0 = _mm512_set1_epi32(a0);
            for (int b = 0; b < kB; ++b) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], wv[b], x0);
          }
        }
      }
    }
    std::uint8_t const* gs = rec + kCodeBytes + b0 * 16 * kSB;
    for (int b = 0; b < kB; ++b) {
      __m512 const s = load_scales<ST>(gs + b * 16 * kSB);
      for (int r = 0; r < kR; ++r) {
        __m512 const sd = _mm512_mul_ps(s, _mm512_set1_ps(a.d[(m0 + r) * groups + g]));
        f[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][b]), sd, f[r][b]);
      }
      if constexpr (kAsym) {
        __m512 const o = load_scales<ST>(gs + (kA8Panel + b * 16) * kSB);
        for (int r = 0; r < kR; ++r) f[r][b] = _mm512_fmadd_ps(o, _mm512_set1_ps(a.ds[(m0 + r) * groups + g]), f[r][b]);
      }
    }
  }
  // Bias, then the store: fp32 whole blocks directly, the rest (16-bit outputs, a partial last block)
  // element by element through the scalar rounding every path shares.
  for (int b = 0; b < kB; ++b) {
    std::int64_t const c0 = p * kA8Panel + (b0 + b) * 16;
    if (c0 >= w.n) break;
    int const cols = static_cast<int>(std::min<std::int64_t>(16, w.n - c0));
    __m512 const bias = w.bias.empty() ? _mm512_setzero_ps() : _mm512_loadu_ps(w.bias.data() + c0);
    for (int r = 0; r < kR; ++r) {
      __m512 const v = w.bias.empty() ? f[r][b] : _mm512_add_ps(f[r][b], bias);
      std::int64_t const at = (m0 + r) * w.n + c0;
      if (dtype == ScalarType::kFloat32 && cols == 16) {
        _mm512_storeu_ps(static_cast<float*>(out) + at, v);
        continue;
      }
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, v);
      dispatch_float_type(dtype, [&](auto t) {
        using T = decltype(t);
        T* o = static_cast<T*>(out) + at;
        for (int c = 0; c < cols; ++c) o[c] = from_float<T>(tmp[c]);
      });
    }
  }
}

// Rows [m_lo, m_hi) x panels [p_lo, p_hi): panels in chunks that stay in L2 while every tile of 4 rows
// walks over them. 4 and 3 rows: two half panels (kB = 2: 16 accumulators and 8 sums in registers);
// 1 and 2 rows: whole panels.
template <int kBits, int kE, class ST, bool kAsym, int kLimbs>
void gemm_t(A8PackedWeight const& w, Activations const& a, std::int64_t m_lo, std::int64_t m_hi, std::int64_t p_lo,
            std::int64_t p_hi, void* out, ScalarType dtype) {
  constexpr std::int64_t kChunkBytes = 256 * 1024;
  std::int64_t const chunk = std::max<std::int64_t>(1, kChunkBytes / std::max<std::int64_t>(1, w.panel_bytes()));
  for (std::int64_t c0 = p_lo; c0 < p_hi; c0 += chunk) {
    std::int64_t const c1 = std::min(p_hi, c0 + chunk);
    for (std::int64_t m0 = m_lo; m0 < m_hi; m0 += 4) {
      int const mr = static_cast<int>(std::min<std::int64_t>(4, m_hi - m0));
      for (std::int64_t p = c0; p < c1; ++p) {
        switch (mr) {
          case 4:
            tile<4, 2, kBits, kE, ST, kAsym, kLimbs>(w, a, m0, p, 0, out, dtype);
            tile<4, 2, kBits, kE, ST, kAsym, kLimbs>(w, a, m0, p, 2, out, dtype);
            break;
          case 3:
            tile<3, 2, kBits, kE, ST, kAsym, kLimbs>(w, a, m0, p, 0, out, dtype);
            tile<3, 2, kBits, kE, ST, kAsym, kLimbs>(w, a, m0, p, 2, out, dtype);
            break;
          case 2:
            tile<2, 4, kBits, kE, ST, kAsym, kLimbs>(w, a, m0, p, 0, out, dtype);
            break;
          default:
            tile<1, 4, kBits, kE, ST, kAsym, kLimbs>(w, a, m0, p, 0, out, dtype);
            break;
        }
      }
    }
  }
}

template <int kBits, int kE, bool kAsym, int kLimbs>
void gemm_scales(A8PackedWeight const& w, Activations const& a, std::int64_t m_lo, std::int64_t m_hi, std::int64_t p_lo,
                 std::int64_t p_hi, void* out, ScalarType dtype) {
  if (w.f16_scales) {
    gemm_t<kBits, kE, std::uint16_t, kAsym, kLimbs>(w, a, m_lo, m_hi, p_lo, p_hi, out, dtype);
  } else {
    gemm_t<kBits, kE, float, kAsym, kLimbs>(w, a, m_lo, m_hi, p_lo, p_hi, out, dtype);
  }
}

template <int kLimbs>
void gemm_limbs(A8PackedWeight const& w, Activations const& a, std::int64_t m_lo, std::int64_t m_hi, std::int64_t p_lo,
                std::int64_t p_hi, void* out, ScalarType dtype) {
  if (w.bits == 4) {
    if (w.asym) {
      gemm_scales<4, 32, true, kLimbs>(w, a, m_lo, m_hi, p_lo, p_hi, out, dtype);
    } else {
      gemm_scales<4, 32, false, kLimbs>(w, a, m_lo, m_hi, p_lo, p_hi, out, dtype);
    }
  } else if (w.group == 16) {
    gemm_scales<8, 16, false, kLimbs>(w, a, m_lo, m_hi, p_lo, p_hi, out, dtype);
  } else {
    gemm_scales<8, 32, false, kLimbs>(w, a, m_lo, m_hi, p_lo, p_hi, out, dtype);
  }
}

}  // namespace

void gemm_avx512vnni(A8PackedWeight const& w, Activations const& a, std::int64_t m_lo, std::int64_t m_hi,
                     std::int64_t p_lo, std::int64_t p_hi, void* out, ScalarType dtype) {
  if (a.limbs == 2) {
    gemm_limbs<2>(w, a, m_lo, m_hi, p_lo, p_hi, out, dtype);
  } else {
    gemm_limbs<1>(w, a, m_lo, m_hi, p_lo, p_hi, out, dtype);
  }
}

void quantize_avx512(void const* x, ScalarType dtype, std::int64_t m, std::int64_t k, int group, std::int8_t* q,
                     float* d, std::int32_t* sq, float* ds, int limbs) {
  dispatch_float_type(dtype, [&](auto t) {
    using T = decltype(t);
    if (group == 16) {
      if (limbs == 2) {
        quantize_t<T, 16, 2>(static_cast<T const*>(x), m, k, q, d, sq, ds);
      } else {
        quantize_t<T, 16, 1>(static_cast<T const*>(x), m, k, q, d, sq, ds);
      }
    } else if (limbs == 2) {
      quantize_t<T, 32, 2>(static_cast<T const*>(x), m, k, q, d, sq, ds);
    } else {
      quantize_t<T, 32, 1>(static_cast<T const*>(x), m, k, q, d, sq, ds);
    }
  });
}

}  // namespace inflight::kernels::cpu::a8_detail
