// Attention kernels, AVX-512 path (compiled with -mavx512f/bw/vl/dq/bf16; chosen at run time).
// GCC 12's AVX-512 headers trip -W(maybe-)uninitialized on their own _mm512_undefined_* (GCC bug
// 105593); the warnings say nothing about this file.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <bit>
#include <cstring>

#define INFLIGHT_ATTENTION_ISA avx512
#include "attention_dispatch.h"

namespace inflight::kernels::cpu::avx512 {
namespace {

struct Vec512 {
  using Reg = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kKeyTile = 32;
  // Register blocking (32 zmm): Q.K^T tile 8 rows x 2 vectors of keys = 16 accumulators; P.V 4 rows
  // x 4 vectors (64 head dims) = 16 accumulators.
  static constexpr int kQkRows = 8;
  static constexpr int kPvRows = 4;
  static constexpr int kPvChunk = 4;

  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float x) { return _mm512_set1_ps(x); }
  static Reg load(float const* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
  static float hsum(Reg v) { return _mm512_reduce_add_ps(v); }
  static float hmax(Reg v) { return _mm512_reduce_max_ps(v); }

  // 2^x: x = n + f with |f| <= 0.5, 2^f by Cephes' exp2f polynomial (rel. error ~2e-7), then
  // scalef by 2^n, which also flushes x <= -150 (masked scores, -inf) to exactly 0.
  static Reg exp2(Reg x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-150.0f)), _mm512_set1_ps(128.0f));
    Reg n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    Reg f = _mm512_sub_ps(x, n);
    Reg p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
  }

  // Lane i of the result = sum of v[i]'s 16 lanes: a transpose-and-add tree (45 ops for 16 sums).
  static Reg reduce_lanes(Reg const* v) {
    Reg a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: pairs of rows interleaved, 4 -> 2 partial sums each
      a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // per 128-bit lane: rows 4i..4i+3, one partial sum each
      __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
      __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
      b[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    for (int i = 0; i < 2; ++i)  // fold the four 128-bit lanes pairwise
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  }

  // The same tree over int32 lanes (exact: the int8 KV cache's query . key codes).
  static __m512i reduce_lanes_epi32(__m512i const* v) {
    __m512i a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)
      a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                              _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
      b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]),
                              _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
      c[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], 0x88),
                              _mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], 0x88), _mm512_shuffle_i32x4(c[0], c[1], 0xDD));
  }

  // s[r * s_stride + i] = sq[r] * float(q[r * q_stride] . krows[i]) for r < rows, i < n (a whole vector
  // of s is written per 16 keys): int16 query codes times int8 key codes, 32 at a time by VPDPWSSD,
  // exact int32 sums (hd: a multiple of 32 up to kMaxHeadDim; kHd = hd when known at compile time, else
  // 0). Each block of 16 keys is widened to int16 once for all the rows (a GQA group's query heads).
  template <int kHd>
  static void qk_codes(float* s, int s_stride, std::int16_t const* q, int q_stride, float const* sq, int rows,
                       std::int8_t const* const* krows, int n, int hd) {
    constexpr int kMaxQ = kHd ? kHd / 32 : kMaxHeadDim / 32;
    int const nq = kHd ? kHd / 32 : hd / 32;
    alignas(64) std::int16_t kw[16][kMaxQ * 32];
    for (int w0 = 0; w0 < n; w0 += 16) {
      int const m = std::min(16, n - w0);
      for (int i = 0; i < m; ++i)
        for (int c = 0; c < nq; ++c)
          _mm512_store_si512(
              kw[i] + 32 * c,
              _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(krows[w0 + i] + 32 * c))));
      for (int r = 0; r < rows; ++r) {
        __m512i qr[kMaxQ];
        for (int c = 0; c < nq; ++c) qr[c] = _mm512_loadu_si512(q + r * q_stride + 32 * c);
        auto dot = [&](std::int16_t const* k) {  // two chains
          __m512i d0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), qr[0], _mm512_load_si512(k));
          __m512i d1 = _mm512_setzero_si512();
          for (int c = 1; c < nq; c += 2) {
            d1 = _mm512_dpwssd_epi32(d1, qr[c], _mm512_load_si512(k + 32 * c));
            if (c + 1 < nq) d0 = _mm512_dpwssd_epi32(d0, qr[c + 1], _mm512_load_si512(k + 32 * (c + 1)));
          }
          return _mm512_add_epi32(d0, d1);
        };
        __m512i parts[16];
        for (int i = 0; i < 16; ++i) parts[i] = i < m ? dot(kw[i]) : _mm512_setzero_si512();
        _mm512_storeu_ps(s + r * s_stride + w0,
                         _mm512_mul_ps(_mm512_cvtepi32_ps(reduce_lanes_epi32(parts)), _mm512_set1_ps(sq[r])));
      }
    }
  }

  // A row of kKeyTile probabilities (times their keys' V scales, all >= 0) as int16 codes
  // round(p * (32767 / max p)) (ties to even, the rounding mode's default); returns max p / 32767.
  static float prob_codes(std::int16_t* codes, float const* p) {
    static_assert(kKeyTile == 32);
    __m512 const a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
    float const amax = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
    __m512 const f = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes),
                        _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, f))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 16),
                        _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, f))));
    return amax / 32767.0f;
  }

  // o[r] += ps[r] * float(sum_i pc[r][i] * vrows[i]) for R rows (hd: a multiple of 32), 32 columns at a time: two keys'
  // int16 V codes interleaved per column (VPUNPCK{L,H}WD), so one VPDPWSSD adds a key pair's products for 16 columns;
  // the unpacks' column order is undone once per tile (VPERMT2D).
  template <int R>
  static void pv_codes_block(float* o, int o_stride, std::int16_t const (*pc)[kKeyTile], float const* ps,
                             std::int8_t const* const* vrows, int n, int hd) {
    int const nc = hd / 32;
    __m512i const idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    __m512i const idx1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    auto codes = [](std::int8_t const* v) {
      return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(v)));
    };
    for (int c = 0; c < nc; ++c) {
      __m512i lo[R], hi[R];
      for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
      auto add_pair = [&](int i, __m512i a, __m512i b) {
        __m512i const il = _mm512_unpacklo_epi16(a, b), ih = _mm512_unpackhi_epi16(a, b);
        for (int r = 0; r < R; ++r) {
          std::int32_t pair;
          std::memcpy(&pair, pc[r] + i, sizeof(pair));
          __m512i const pp = _mm512_set1_epi32(pair);
          lo[r] = _mm512_dpwssd_epi32(lo[r], pp, il);
          hi[r] = _mm512_dpwssd_epi32(hi[r], pp, ih);
        }
      };
      int i = 0;
      for (; i + 1 < n; i += 2) add_pair(i, codes(vrows[i] + 32 * c), codes(vrows[i + 1] + 32 * c));
      if (i < n) add_pair(i, codes(vrows[i] + 32 * c), _mm512_setzero_si512());  // an odd last key (code 0 after it)
      for (int r = 0; r < R; ++r) {
        float* dst = o + r * o_stride + 32 * c;
        __m512 const f = _mm512_set1_ps(ps[r]);
        _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo[r], idx0, hi[r])), f,
                                              _mm512_loadu_ps(dst)));
        _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo[r], idx1, hi[r])), f,
                                                   _mm512_loadu_ps(dst + 16)));
      }
    }
  }

  static void transpose(Reg* r) {
    Reg t[16], u[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int k = 0; k < 4; ++k) {
      __m512d t0 = _mm512_castps_pd(t[4 * k]), t1 = _mm512_castps_pd(t[4 * k + 1]);
      __m512d t2 = _mm512_castps_pd(t[4 * k + 2]), t3 = _mm512_castps_pd(t[4 * k + 3]);
      u[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
      u[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
      u[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
      u[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
    // u[4k + c], 128-bit lane L, holds input column 4L + c of rows 4k .. 4k+3.
    for (int c = 0; c < 4; ++c) {
      Reg x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
      Reg y0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE), y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
      r[c] = _mm512_shuffle_f32x4(x0, x1, 0x88);
      r[4 + c] = _mm512_shuffle_f32x4(x0, x1, 0xDD);
      r[8 + c] = _mm512_shuffle_f32x4(y0, y1, 0x88);
      r[12 + c] = _mm512_shuffle_f32x4(y0, y1, 0xDD);
    }
  }

  static Reg load_cvt(float const* p) { return _mm512_loadu_ps(p); }
  static Reg load_cvt(BFloat16 const* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static Reg load_cvt(Float16 const* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
  }
  // int8 KV codes: 16 bytes sign-extended to int32, then converted (exact).
  static Reg load_cvt(std::int8_t const* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p))));
  }
  // FP8 E4M3 KV bytes as e4m3 * 2^-8 (exact): 16 bytes widened to 16 bits (VPMOVZXBW), their fields
  // moved into fp16's (scalar_type.h, e4m3_to_f16_bits), then VCVTPH2PS.
  static Reg load_cvt(Float8E4M3 const* p) {
    __m256i const b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
    __m256i const h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_cvtph_ps(h);
  }

  static void store_cvt(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static void store_cvt(BFloat16* p, Reg v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), std::bit_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
  static void store_cvt(Float16* p, Reg v) {
    // maskz form: the plain one trips GCC 12's bogus -Wmaybe-uninitialized even with the pragma.
    __m256i h = _mm512_maskz_cvtps_ph(0xFFFF, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
};

// The explicit head-dim instantiations; others that are multiples of 16 run with a run-time head_dim.
using Kernels = Dispatch<Vec512, 64, 128, 32, 256>;

}  // namespace
}  // namespace inflight::kernels::cpu::avx512

namespace inflight::kernels::cpu {

bool paged_attention_avx512(PagedAttentionParams const& params, PagedAttentionPlan const& plan, ThreadPool& pool) {
  return avx512::Kernels::paged_attention(params, plan, pool);
}

bool context_attention_avx512(ContextAttentionParams const& params, ThreadPool& pool) {
  return avx512::Kernels::context_attention(params, pool);
}

}  // namespace inflight::kernels::cpu
