// Attention kernels, AVX2 path (compiled with -mavx2 -mfma -mf16c; chosen at run time).
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#define INFLIGHT_ATTENTION_ISA avx2
#include "attention_dispatch.h"

namespace inflight::kernels::cpu::avx2 {
namespace {

struct Vec256 {
  using Reg = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kKeyTile = 32;
  // Register blocking (16 ymm): Q.K^T 2 rows x 4 vectors of keys = 8 accumulators + 4 key vectors;
  // P.V 2 rows x 4 vectors = 8 accumulators + 4 value vectors.
  static constexpr int kQkRows = 2;
  static constexpr int kPvRows = 2;
  static constexpr int kPvChunk = 4;

  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float x) { return _mm256_set1_ps(x); }
  static Reg load(float const* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
  static float hsum(Reg v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float hmax(Reg v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  // 2^x as in the AVX-512 path; 2^n is built in the exponent field, and clamping x at -127 makes
  // that field 0 for masked scores (-inf), so they come out as exactly 0.
  static Reg exp2(Reg x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
    Reg n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    Reg f = _mm256_sub_ps(x, n);
    Reg p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }

  // Lane i of the result = sum of v[i]'s 8 lanes.
  static Reg reduce_lanes(Reg const* v) {
    Reg t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    Reg t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    Reg u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: rows 0-3 / 4-7
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }

  // s[i] = sq * float(qi . krows[i]) for i < n (a whole vector of s is written per 8 keys): int16
  // query codes times int8 key codes, 16 at a time by VPMADDWD, exact int32 sums (hd: a multiple of 32).
  template <int kHd>
  static void qk_codes_row(float* s, std::int16_t const* qi, float sq, std::int8_t const* const* krows, int n, int hd) {
    int const nq = kHd ? kHd / 16 : hd / 16;
    auto dot = [&](std::int8_t const* k) {  // two chains
      __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
      for (int c = 0; c < nq; c += 2) {
        __m256i const k0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<__m128i const*>(k + 16 * c)));
        __m256i const k1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<__m128i const*>(k + 16 * c + 16)));
        __m256i const q0 = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(qi + 16 * c));
        __m256i const q1 = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(qi + 16 * c + 16));
        d0 = _mm256_add_epi32(d0, _mm256_madd_epi16(q0, k0));
        d1 = _mm256_add_epi32(d1, _mm256_madd_epi16(q1, k1));
      }
      return _mm256_add_epi32(d0, d1);
    };
    Reg const f = _mm256_set1_ps(sq);
    for (int w0 = 0; w0 < n; w0 += 8) {
      __m256i v[8];
      for (int i = 0; i < 8; ++i) v[i] = w0 + i < n ? dot(krows[w0 + i]) : _mm256_setzero_si256();
      __m256i const t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
      __m256i const t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
      __m256i const u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
      __m256i const r =
          _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
      _mm256_storeu_ps(s + w0, _mm256_mul_ps(_mm256_cvtepi32_ps(r), f));
    }
  }

  // qk_codes_row for rows r < rows: s + r * s_stride, q + r * q_stride, sq[r].
  template <int kHd>
  static void qk_codes(float* s, int s_stride, std::int16_t const* q, int q_stride, float const* sq, int rows,
                       std::int8_t const* const* krows, int n, int hd) {
    for (int r = 0; r < rows; ++r) qk_codes_row<kHd>(s + r * s_stride, q + r * q_stride, sq[r], krows, n, hd);
  }

  // prob_codes and pv_codes_block as the AVX-512 path computes them (the same codes, the same int32 sums):
  // 16 columns at a time, key pairs by VPMADDWD.
  static float prob_codes(std::int16_t* codes, float const* p) {
    static_assert(kKeyTile == 32);
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(p + 8 * i);
    __m256 const m8 = _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float const amax = _mm_cvtss_f32(m4);
    __m256 const f = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    for (int i = 0; i < 4; i += 2) {
      __m256i const a = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], f)), b = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], f));
      // packs saturates (a no-op here: |code| <= 32767) and interleaves the 128-bit lanes; undo that.
      __m256i const packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 8 * i), packed);
    }
    return amax / 32767.0f;
  }

  template <int R>
  static void pv_codes_block(float* o, int o_stride, std::int16_t const (*pc)[kKeyTile], float const* ps,
                             std::int8_t const* const* vrows, int n, int hd) {
    int const nc = hd / 16;
    auto codes = [](std::int8_t const* v) {
      return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<__m128i const*>(v)));
    };
    for (int c = 0; c < nc; ++c) {
      __m256i lo[R], hi[R];
      for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
      auto add_pair = [&](int i, __m256i a, __m256i b) {
        __m256i const il = _mm256_unpacklo_epi16(a, b), ih = _mm256_unpackhi_epi16(a, b);
        for (int r = 0; r < R; ++r) {
          std::int32_t pair;
          std::memcpy(&pair, pc[r] + i, sizeof(pair));
          __m256i const pp = _mm256_set1_epi32(pair);
          lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(pp, il));
          hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(pp, ih));
        }
      };
      int i = 0;
      for (; i + 1 < n; i += 2) add_pair(i, codes(vrows[i] + 16 * c), codes(vrows[i + 1] + 16 * c));
      if (i < n) add_pair(i, codes(vrows[i] + 16 * c), _mm256_setzero_si256());  // an odd last key
      for (int r = 0; r < R; ++r) {
        float* dst = o + r * o_stride + 16 * c;
        __m256 const f = _mm256_set1_ps(ps[r]);
        __m256i const first = _mm256_permute2x128_si256(lo[r], hi[r], 0x20);
        __m256i const second = _mm256_permute2x128_si256(lo[r], hi[r], 0x31);
        _mm256_storeu_ps(dst, _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), f, _mm256_loadu_ps(dst)));
        _mm256_storeu_ps(dst + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(second), f, _mm256_loadu_ps(dst + 8)));
      }
    }
  }

  static void transpose(Reg* r) {
    Reg t[8], u[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int k = 0; k < 2; ++k) {
      u[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
      u[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
      u[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
      u[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
    }
    // u[4k + c], 128-bit half L, holds input column 4L + c of rows 4k .. 4k+3.
    for (int c = 0; c < 4; ++c) {
      r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
      r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
  }

  static Reg load_cvt(float const* p) { return _mm256_loadu_ps(p); }
  static Reg load_cvt(BFloat16 const* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static Reg load_cvt(Float16 const* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
  }
  // int8 KV codes: 8 bytes sign-extended to int32, then converted (exact).
  static Reg load_cvt(std::int8_t const* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(p))));
  }
  // FP8 E4M3 KV bytes as e4m3 * 2^-8 (exact): 8 bytes widened to 16 bits, their fields moved into fp16's
  // (scalar_type.h, e4m3_to_f16_bits), then F16C.
  static Reg load_cvt(Float8E4M3 const* p) {
    __m128i const b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(p)));
    __m128i const h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
    return _mm256_cvtph_ps(h);
  }

  static void store_cvt(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  // Round to nearest even on the bit pattern; a NaN keeps its sign and top payload bits and is made
  // quiet (the rule of scalar_type.h and of the AVX-512 converter).
  static void store_cvt(BFloat16* p, Reg v) {
    __m256i b = _mm256_castps_si256(v);
    __m256i hi = _mm256_srli_epi32(b, 16);
    __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x0040)), nan);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void store_cvt(Float16* p, Reg v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

// The explicit head-dim instantiations; others that are multiples of 8 run with a run-time head_dim.
using Kernels = Dispatch<Vec256, 64, 128, 32, 256>;

}  // namespace
}  // namespace inflight::kernels::cpu::avx2

namespace inflight::kernels::cpu {

bool paged_attention_avx2(PagedAttentionParams const& params, PagedAttentionPlan const& plan, ThreadPool& pool) {
  return avx2::Kernels::paged_attention(params, plan, pool);
}

bool context_attention_avx2(ContextAttentionParams const& params, ThreadPool& pool) {
  return avx2::Kernels::context_attention(params, pool);
}

}  // namespace inflight::kernels::cpu
