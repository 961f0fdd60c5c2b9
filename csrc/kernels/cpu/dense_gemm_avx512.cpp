// AVX-512 (F/BW/VL/DQ + BF16) dense GEMM path. Compiled with AVX-512 flags; called only when
// selected_isa() is kAvx512.
//
// Register tiles: MR rows of x by kNR weight rows, one 16-lane fp32 accumulator per (x row, weight
// row) pair; each step along K loads MR x vectors (reused by the kNR weight rows) and kNR weight
// vectors (reused by the MR x rows). fp32 and fp16 step 16 values at a time with FMA (fp16 widened on
// load); bf16 steps 32 at a time with VDPBF16PS, which multiplies bf16 pairs of x and W exactly and
// accumulates them in fp32, so neither operand is ever converted. The K tail is a masked step (zeros
// past k add nothing). The accumulators are summed across lanes four at a time at the end.
#include <immintrin.h>

#include <type_traits>

// GCC 12's AVX-512 intrinsics (_mm512_cvtph_ps, _mm512_unpacklo_ps, ...) start from an "undefined"
// vector and trip -W(maybe-)uninitialized inside the compiler's own header: a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "avx512_common.h"
#include "dense_gemm.h"

namespace inflight::kernels::cpu {
namespace {

using namespace gemm_detail;
using namespace avx512_common;

// One step along K for each storage type: kStep values of a row as one vector, and the multiply-add
// of a weight vector and an x vector into a 16-lane fp32 accumulator.
struct F32Step {
  using Vec = __m512;
  static constexpr int kStep = 16;
  static Vec load(float const* p) { return _mm512_loadu_ps(p); }
  static Vec load_tail(float const* p, std::int64_t left) { return _mm512_maskz_loadu_ps(mask16(left), p); }
  static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_fmadd_ps(w, x, acc); }
};

struct F16Step {
  using Vec = __m512;
  static constexpr int kStep = 16;
  static Vec load(Float16 const* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p))); }
  static Vec load_tail(Float16 const* p, std::int64_t left) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask16(left), p));
  }
  static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_fmadd_ps(w, x, acc); }
};

struct Bf16Step {
  using Vec = __m512bh;
  static constexpr int kStep = 32;
  static Vec load(BFloat16 const* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Vec load_tail(BFloat16 const* p, std::int64_t left) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask32(left), p);
  }
  static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_dpbf16_ps(acc, w, x); }
};

template <class T>
using StepOf = std::conditional_t<std::is_same_v<T, float>, F32Step,
                                  std::conditional_t<std::is_same_v<T, BFloat16>, Bf16Step, F16Step>>;

// Four consecutive values of a row (the lanes set in mask m; the others read as zero and are never
// written) as fp32, and back: the epilogue's bias load and output store. Rounding matches gemm_detail's scalar
// from_float (to nearest even; bf16 in integer arithmetic, so subnormal sums round rather than flush).
inline __m128 load4(float const* p, __mmask8 m) { return _mm_maskz_loadu_ps(m, p); }
inline __m128 load4(BFloat16 const* p, __mmask8 m) {
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_maskz_loadu_epi16(m, p)), 16));
}
inline __m128 load4(Float16 const* p, __mmask8 m) { return _mm_cvtph_ps(_mm_maskz_loadu_epi16(m, p)); }

inline void store4(float* p, __mmask8 m, __m128 v) { _mm_mask_storeu_ps(p, m, v); }
inline void store4(BFloat16* p, __mmask8 m, __m128 v) {
  __m128i const u = _mm_castps_si128(v);
  __m128i const odd = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
  __m128i const rounded = _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(odd, _mm_set1_epi32(0x7fff))), 16);
  // NaN: keep the sign and top payload bits, set the quiet bit (rounding could carry into infinity).
  __mmask8 const nan = _mm_cmpgt_epi32_mask(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
  __m128i const quiet = _mm_or_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(0x40));
  _mm_mask_storeu_epi16(p, m, _mm_cvtepi32_epi16(_mm_mask_blend_epi32(nan, rounded, quiet)));
}
inline void store4(Float16* p, __mmask8 m, __m128 v) {
  _mm_mask_storeu_epi16(p, m, _mm_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Software prefetch distance, in N tiles: the next tiles' rows follow this tile's in memory, and the
// hardware prefetcher alone leaves a single thread well below the memory bandwidth. The prefetches go
// to L2 (T1), not L1: an L1 prefetch holds one of the core's few L1 miss buffers until the line
// arrives, which caps the loads in flight; L2 tracks many more (Zen 4, one thread, m = 1 from DRAM:
// ~1.7x the bandwidth of T0 prefetches; the loads then hit L2).
constexpr int kPrefetchTiles = 2;

// T: storage type of x, weight, bias and out; kNR_: weight rows per tile; kMaxMR_: x rows per tile.
// kMaxMR_ x kNR_ accumulators + kMaxMR_ x vectors + one weight vector must fit the 32 registers.
template <class T, int kNR_, int kMaxMR_>
struct DenseTile {
  using Step = StepOf<T>;
  using Vec = typename Step::Vec;
  static constexpr int kNR = kNR_;
  static constexpr int kMaxMR = kMaxMR_;
  static_assert(kMaxMR * kNR + kMaxMR + 1 <= 32, "register tile does not fit the 32 zmm registers");
  static_assert(kNR % 4 == 0, "the epilogue sums and stores four weight rows at a time");
  DenseGemmParams const& p;

  // Rows of x per M tile: m split into as few tiles as kMaxMR allows, of near-equal sizes (m = 8 as
  // 4 + 4, not 6 + 2: a thin tile loads as many weight vectors for fewer multiply-adds).
  int max_mr() const {
    std::int64_t const tiles = (p.m + kMaxMR - 1) / kMaxMR;
    return static_cast<int>(std::max<std::int64_t>(1, (p.m + tiles - 1) / tiles));
  }

  void tile(int mr, std::int64_t m0, std::int64_t n0) const { dispatch_mr<kMaxMR>(*this, mr, m0, n0); }

  // Register tiles live in arrays indexed by constants only after full unrolling; without it GCC keeps
  // them in memory (a load and store per FMA), hence the unroll pragmas and always_inline.
  template <int MR>
  void run(std::int64_t m0, std::int64_t n0) const {
    std::int64_t const k_dim = p.k;
    T const* w[kNR];
#pragma GCC unroll 8
    for (int r = 0; r < kNR; ++r) {
      // Rows past n are clamped to the last row: computed, never stored.
      w[r] = static_cast<T const*>(p.weight) + std::min(n0 + r, p.n - 1) * k_dim;
    }
    T const* x = static_cast<T const*>(p.x) + m0 * k_dim;
    __m512 acc[MR][kNR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int r = 0; r < kNR; ++r) acc[i][r] = _mm512_setzero_ps();
    std::int64_t const k_main = k_dim - k_dim % Step::kStep;
    std::int64_t const ahead = kPrefetchTiles * kNR * k_dim;
    // One prefetch per 64-byte line of each row (a step is a whole line, except fp16's half line).
    constexpr std::int64_t kLine = 64 / sizeof(T);
    for (std::int64_t kk = 0; kk < k_main; kk += Step::kStep) {
      Vec xv[MR];
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) xv[i] = Step::load(x + i * k_dim + kk);
#pragma GCC unroll 8
      for (int r = 0; r < kNR; ++r) {
        if (kk % kLine == 0) _mm_prefetch(reinterpret_cast<char const*>(w[r] + ahead + kk), _MM_HINT_T1);
        Vec const wv = Step::load(w[r] + kk);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) acc[i][r] = Step::madd(acc[i][r], wv, xv[i]);
      }
    }
    if (k_main < k_dim) {
      std::int64_t const left = k_dim - k_main;
      Vec xv[MR];
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) xv[i] = Step::load_tail(x + i * k_dim + k_main, left);
#pragma GCC unroll 8
      for (int r = 0; r < kNR; ++r) {
        Vec const wv = Step::load_tail(w[r] + k_main, left);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) acc[i][r] = Step::madd(acc[i][r], wv, xv[i]);
      }
    }
    store(acc, m0, n0);
  }

  template <int MR>
  [[gnu::always_inline]] inline void store(__m512 const (&acc)[MR][kNR], std::int64_t m0, std::int64_t n0) const {
    std::int64_t const ldo = p.out_row_stride > 0 ? p.out_row_stride : p.n;
    T* out = static_cast<T*>(p.out) + m0 * ldo + n0;
    T const* bias = static_cast<T const*>(p.bias);
#pragma GCC unroll 4
    for (int r = 0; r < kNR; r += 4) {
      std::int64_t const valid = std::min<std::int64_t>(4, p.n - n0 - r);  // rows of these four below n
      if (valid <= 0) break;
      __mmask8 const m = static_cast<__mmask8>((1u << valid) - 1u);
      // -0 is the additive identity (+0 would turn a -0 sum into +0).
      __m128 const b = bias != nullptr ? load4(bias + n0 + r, m) : _mm_set1_ps(-0.0f);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        __m128 const sums = reduce4(acc[i][r], acc[i][r + 1], acc[i][r + 2], acc[i][r + 3]);
        store4(out + i * ldo + r, m, _mm_add_ps(sums, b));
      }
    }
  }
};

}  // namespace

void dense_gemm_avx512(DenseGemmParams const& p, ThreadPool& pool) {
  dispatch_float_type(p.dtype, [&](auto t) {
    using T = decltype(t);
    std::int64_t const row_bytes = p.k * static_cast<std::int64_t>(sizeof(T));
    // One x row is bound by memory alone: 8 weight rows streamed at a time keep more loads in flight
    // (up to ~10% faster from DRAM than 4, one thread). More rows are also bound by the multiply-adds
    // and by the re-reads of each L2 chunk per M tile: 6 x rows per tile make the fewest passes.
    if (p.m == 1) {
      run_tiles(DenseTile<T, 8, 1>{p}, p.m, p.n, row_bytes, p.num_threads, pool);
    } else {
      run_tiles(DenseTile<T, 4, 6>{p}, p.m, p.n, row_bytes, p.num_threads, pool);
    }
  });
}

}  // namespace inflight::kernels::cpu
