// AVX-512 (F/BW/VL/DQ + BF16) W4A16 and W8A16 paths. Compiled with AVX-512 flags; called only when
// selected_isa() is kAvx512.
//
// Register tiles: MR rows of x by kNR weight rows, one 16-lane fp32 accumulator per (m, n) pair,
// summed across lanes once at the end; loaded x vectors are reused by the kNR weight rows and
// dequantised weight vectors by the MR x rows.
//
//  - int4, the main path (W4Dot): 64-byte chunks become exact bf16 integers (128 + q) with shifts and
//    logic only, VDPBF16PS does the products exactly; x is reordered to match, per M tile, into a
//    per-thread scratch buffer (see the comment above W4Dot). Decode (m < 4) and bf16 x.
//  - batched fp32 / fp16 x, m >= 4 (W4Tiled, and W8Tiled for every x type): products bound the time,
//    so fp32 FMA on exactly dequantised weights, 8 x rows by 3 weight rows per tile; int4 through a
//    per-group lookup table (see the comment above W4Tiled).
//  - int4 rows too long for that buffer (k beyond ~16K): W4Fma (fp32/fp16 x: nibbles -> fp32 in
//    registers, w = q * scale + offset by FMA, x split into even/odd k) and W4Bf16Dot (bf16 x: VPERMW
//    table lookup -> bf16 q, VDPBF16PS, scale per group).
//  - int8 (W8Fma): sign-extend 16 bytes, convert, FMA; one x row scales each group's sum once, several
//    rows dequantise each weight vector once.
#include <immintrin.h>

#include <bit>
#include <type_traits>

// GCC 12's AVX-512 conversion intrinsics (_mm512_cvtph_ps, _mm512_cvtepu16_epi32, ...) start from an
// "undefined" vector and trip -W(maybe-)uninitialized inside the compiler's own header: a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "avx512_common.h"
#include "dense_gemm.h"
#include "gemm.h"

namespace inflight::kernels::cpu {
namespace {

using namespace gemm_detail;
using namespace avx512_common;

inline __m512 bcast(float const* p) { return _mm512_set1_ps(*p); }
inline __m512 bcast(BFloat16 const* p) { return _mm512_set1_ps(bf16_to_float(p->bits)); }
inline __m512 bcast(Float16 const* p) { return _mm512_set1_ps(_cvtsh_ss(p->bits)); }

inline __m512 load16(float const* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(Float16 const* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
}
inline __m512 load16(BFloat16 const* p) {
  __m512i const w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

inline __m128i load_bytes16(void const* p) { return _mm_loadu_si128(static_cast<__m128i const*>(p)); }

// bf16 bit patterns of small integers (exact), for the nibble -> bf16 table.
constexpr std::uint16_t bf16_of_int(int v) {
  return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(static_cast<float>(v)) >> 16);
}
template <int kBias>
struct NibbleTable {
  alignas(64) std::uint16_t v[32];
  constexpr NibbleTable() : v{} {
    for (int i = 0; i < 32; ++i) v[i] = bf16_of_int(i < 16 ? i - kBias : 0);
  }
};
constexpr NibbleTable<0> kTableAsym{};  // q
constexpr NibbleTable<8> kTableSym{};   // q - 8

// Row pointers of one N tile; rows past n are clamped to the last row (computed, never stored).
template <int kNR>
inline void clamp_rows(std::int64_t n0, std::int64_t n, std::int64_t (&rows)[kNR]) {
  for (int r = 0; r < kNR; ++r) rows[r] = std::min(n0 + r, n - 1);
}

// Register tiles live in arrays indexed by constants only after full unrolling; without it GCC keeps
// them in memory (a load and store per FMA), hence the unroll pragmas and always_inline.
template <int MR, int kNR, class XT>
[[gnu::always_inline]] inline void store_tile(__m512 const (&acc)[MR][kNR], void* out_v, void const* bias_v,
                                              std::int64_t m0, std::int64_t n0, std::int64_t n) {
  XT* out = static_cast<XT*>(out_v);
  XT const* bias = static_cast<XT const*>(bias_v);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    if constexpr (kNR == 4) {
      // The four lane sums together: ~13 instructions instead of ~4 x 8.
      alignas(16) float v[4];
      _mm_store_ps(v, reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
      for (int r = 0; r < kNR; ++r) {
        if (n0 + r < n) store_out(out + (m0 + i) * n, bias, n0 + r, v[r]);
      }
    } else {
#pragma GCC unroll 8
      for (int r = 0; r < kNR; ++r) {
        if (n0 + r < n) store_out(out + (m0 + i) * n, bias, n0 + r, _mm512_reduce_add_ps(acc[i][r]));
      }
    }
  }
}

// ---- W4Dot: the main int4 path -------------------------------------------------------------------
//
// A chunk is 128 weights of a row = 64 bytes = one zmm load, read as 32 16-bit words: word j holds the
// nibbles of weights 4j, 4j+1, 4j+2, 4j+3 (bits 0-3, 4-7, 8-11, 12-15). Isolating one nibble per word
// and OR-ing in 0x4300 makes the bf16 number 128 + q, exactly (bf16 has 7 mantissa bits and 128 is
// 2^7): four vectors of 32 bf16 weights from 7 shift/logic instructions and no shuffle. VDPBF16PS
// multiplies them with bf16 x, exactly, accumulating in fp32; the 128 * sum(x) that the bias adds is
// removed per group together with the offset: w = s*q + o = s*(128 + q) + (o - 128 s), and
// symmetric w = s*(q - 8) = s*(128 + q) - 136 s.
//
// Dword t of vector v holds weights (8t + v, 8t + v + 4), so x is reordered the same way once per
// M tile into a per-thread scratch buffer (prepare) shared by every weight row; fp32/fp16 x is split
// there into bf16 hi + lo parts (x - hi - lo is ~2^-16 of x): two dot products instead of one. The
// 128-bit lane L of every vector holds weights 32L..32L+31 of the chunk, so a group (32, 64 or 128
// weights) is a set of whole lanes and the per-chunk dot products are scaled by one vector holding
// each lane's group scale. The per-group x sums (for the offset term) are kept in the scratch too.
constexpr int kChunk = 128;
constexpr std::size_t kDotScratchBytes = 64 * 1024;
// Software prefetch distance, in N tiles.
constexpr int kPrefetchTiles = 2;

// Source word (within the 32 natural-order x of lane L) of output vector v, word position pos.
struct XPermutation {
  alignas(64) std::uint16_t idx[4][32];
  constexpr XPermutation() : idx{} {
    for (int v = 0; v < 4; ++v) {
      for (int pos = 0; pos < 32; ++pos) {
        int const t = (pos / 2) % 4, e = pos % 2;  // dword t of the lane, element e of the pair
        idx[v][pos] = static_cast<std::uint16_t>(8 * t + v + 4 * e);
      }
    }
  }
};
constexpr XPermutation kXPermutation{};

// Up to 4 scales (masked) as fp32 in an xmm.
inline __m128 load_scales4(float const* p, __mmask8 m) { return _mm_maskz_loadu_ps(m, p); }
inline __m128 load_scales4(Float16 const* p, __mmask8 m) { return _mm_cvtph_ps(_mm_maskz_loadu_epi16(m, p)); }
inline __m128 load_scales4(BFloat16 const* p, __mmask8 m) {
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_maskz_loadu_epi16(m, p)), 16));
}
// Up to 16 values (masked) as fp32.
inline __m512 load16_masked(float const* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16_masked(Float16 const* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
inline __m512 load16_masked(BFloat16 const* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m512 bf16_lo_to_ps(__m512i v) {  // words 0..15 -> fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
}
inline __m512 bf16_hi_to_ps(__m512i v) {  // words 16..31 -> fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
}

// XT: x/out storage type; ST: scale/offset storage type; kAsym: offsets given.
template <class XT, class ST, bool kAsym>
struct W4Dot {
  static constexpr int kParts = std::is_same_v<XT, BFloat16> ? 1 : 2;  // bf16 x, or hi + lo
  static constexpr int kNR = 4;                                        // weight rows per tile
  // x rows per tile: MR x kNR accumulators + MR x 4 x kParts x vectors (reused by the kNR rows) + 4
  // weight vectors must fit the 32 registers.
  static constexpr int kMaxMR = kParts == 1 ? 3 : 2;
  static constexpr std::size_t kScratchBytes = kDotScratchBytes;
  W4A16GemmParams const& p;
  std::int64_t kpad;       // k rounded up to a whole chunk
  std::int64_t groups;     // k / group_size
  std::int64_t xs_pad;     // groups rounded up to 16
  std::int64_t row_elems;  // uint16 elements of one x row in scratch: parts, then the fp32 group sums

  explicit W4Dot(W4A16GemmParams const& params)
      : p(params),
        kpad((params.k + kChunk - 1) / kChunk * kChunk),
        groups(params.k / params.group_size),
        xs_pad((groups + 15) / 16 * 16),
        row_elems(kParts * kpad + 2 * xs_pad) {}

  // Whether one x row fits the scratch buffer (otherwise the caller uses W4Fma / W4Bf16Dot).
  bool fits() const { return static_cast<std::size_t>(row_elems) * 2 <= kScratchBytes; }
  int max_mr() const { return static_cast<int>(std::min<std::int64_t>(kMaxMR, kScratchBytes / 2 / row_elems)); }

  void prepare(int mr, std::int64_t m0, void* scratch) const {
    for (int i = 0; i < mr; ++i) {
      std::uint16_t* row = static_cast<std::uint16_t*>(scratch) + i * row_elems;
      prepare_row(static_cast<XT const*>(p.x) + (m0 + i) * p.k, row);
    }
  }

  // One x row: bf16 (hi, and lo for fp32/fp16 x) reordered chunk by chunk, zero-padded to kpad; then
  // the fp32 sums of each group of the values the dot products see (hi + lo).
  void prepare_row(XT const* x, std::uint16_t* row) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    float* xs = reinterpret_cast<float*>(row + kParts * kpad);
    __m512i idx[4];
    for (int v = 0; v < 4; ++v) idx[v] = _mm512_load_si512(kXPermutation.idx[v]);
    __m512 gsum = _mm512_setzero_ps();
    for (std::int64_t c = 0; c < kpad; c += kChunk) {
      __m512i src[kParts][4];  // natural-order bf16, 32 per vector
      for (int b = 0; b < 4; ++b) {
        std::int64_t const k0 = c + 32 * b;
        __m512 const f0 = load16_masked(x + k0, mask16(k_dim - k0));
        __m512 const f1 = load16_masked(x + k0 + 16, mask16(k_dim - k0 - 16));
        __m512i const hi = (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
        src[0][b] = hi;
        __m512 h0 = bf16_lo_to_ps(hi), h1 = bf16_hi_to_ps(hi);
        if constexpr (kParts == 2) {
          __m512i const lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(f1, h1), _mm512_sub_ps(f0, h0));
          src[1][b] = lo;
          h0 = _mm512_add_ps(h0, bf16_lo_to_ps(lo));
          h1 = _mm512_add_ps(h1, bf16_hi_to_ps(lo));
        }
        // Group sums (32-weight blocks; 64/128-weight groups add 2 or 4 of them).
        if (k0 < k_dim) {
          gsum = _mm512_add_ps(gsum, _mm512_add_ps(h0, h1));
          if ((k0 + 32) % g_size == 0) {
            xs[k0 / g_size] = _mm512_reduce_add_ps(gsum);
            gsum = _mm512_setzero_ps();
          }
        }
      }
      for (int part = 0; part < kParts; ++part) {
        std::uint16_t* dst = row + part * kpad + c;
        for (int v = 0; v < 4; ++v) {
          // Lane L of output vector v takes words from source vector L only.
          __m512i o = _mm512_maskz_permutexvar_epi16(0x000000ffu, idx[v], src[part][0]);
          o = _mm512_mask_permutexvar_epi16(o, 0x0000ff00u, idx[v], src[part][1]);
          o = _mm512_mask_permutexvar_epi16(o, 0x00ff0000u, idx[v], src[part][2]);
          o = _mm512_mask_permutexvar_epi16(o, 0xff000000u, idx[v], src[part][3]);
          _mm512_store_si512(dst + 32 * v, o);
        }
      }
    }
    for (std::int64_t g = groups; g < xs_pad; ++g) xs[g] = 0.0f;
  }

  void tile(int mr, std::int64_t m0, std::int64_t n0, void const* scratch) const {
    dispatch_mr<kMaxMR>(*this, mr, m0, n0, scratch);
  }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n0, void const* scratch) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t rows[kNR];
    clamp_rows<kNR>(n0, p.n, rows);
    std::uint8_t const* w[kNR];
    ST const* s[kNR];
    for (int r = 0; r < kNR; ++r) {
      w[r] = p.qweight + rows[r] * (k_dim / 2);
      s[r] = static_cast<ST const*>(p.scales) + rows[r] * groups;
    }
    std::uint16_t const* xw = static_cast<std::uint16_t const*>(scratch);
    __m512 acc[MR][kNR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int r = 0; r < kNR; ++r) acc[i][r] = _mm512_setzero_ps();
    __m512i const nib = _mm512_set1_epi16(0x000f);
    __m512i const bias = _mm512_set1_epi16(0x4300);  // bf16 128.0
    // Dword lane l (128-bit lane l / 4) -> its group within the chunk.
    unsigned const lanes_shift = g_size == 32 ? 2u : (g_size == 64 ? 3u : 4u);
    __m512i const sidx =
        _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), lanes_shift);
    int const groups_per_chunk = kChunk / g_size;
    std::int64_t g0 = 0;  // first group of the chunk
    for (std::int64_t c = 0; c < kpad; c += kChunk, g0 += groups_per_chunk) {
      std::int64_t const left = k_dim - c;  // weights of this chunk that exist (< 128 only in the last)
      __mmask64 const bmask = left >= kChunk ? ~__mmask64(0) : (__mmask64(1) << (left / 2)) - 1;
      __mmask8 const smask = static_cast<__mmask8>((1u << std::min<std::int64_t>(groups_per_chunk, groups - g0)) - 1u);
#pragma GCC unroll 4
      for (int r = 0; r < kNR; ++r) {
        __m512i const b = _mm512_maskz_loadu_epi8(bmask, w[r] + c / 2);
        // The next tiles' rows follow these in memory: fetch them ahead (the hardware prefetcher alone
        // leaves a single thread well below the memory bandwidth).
        _mm_prefetch(reinterpret_cast<char const*>(w[r] + kPrefetchTiles * kNR * (k_dim / 2) + c / 2), _MM_HINT_T0);
        // 0xEA: (A & B) | C.
        __m512bh const q0 = (__m512bh)_mm512_ternarylogic_epi32(b, nib, bias, 0xea);
        __m512bh const q1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), nib, bias, 0xea);
        __m512bh const q2 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 8), nib, bias, 0xea);
        __m512bh const q3 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(b, 12), bias);
        __m512 const sv = _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(load_scales4(s[r] + g0, smask)));
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          std::uint16_t const* xp = xw + i * row_elems + c;
          __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_load_si512(xp));
          d = _mm512_dpbf16_ps(d, q1, (__m512bh)_mm512_load_si512(xp + 32));
          d = _mm512_dpbf16_ps(d, q2, (__m512bh)_mm512_load_si512(xp + 64));
          d = _mm512_dpbf16_ps(d, q3, (__m512bh)_mm512_load_si512(xp + 96));
          if constexpr (kParts == 2) {
            std::uint16_t const* xl = xp + kpad;
            __m512 e = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_load_si512(xl));
            e = _mm512_dpbf16_ps(e, q1, (__m512bh)_mm512_load_si512(xl + 32));
            e = _mm512_dpbf16_ps(e, q2, (__m512bh)_mm512_load_si512(xl + 64));
            e = _mm512_dpbf16_ps(e, q3, (__m512bh)_mm512_load_si512(xl + 96));
            d = _mm512_add_ps(d, e);
          }
          acc[i][r] = _mm512_fmadd_ps(d, sv, acc[i][r]);
        }
      }
    }
    // Per group: + (offset - 128 scale) * sum(x), or - 136 scale * sum(x) when symmetric.
    __m512 const minus128 = _mm512_set1_ps(-128.0f);
    __m512 const minus136 = _mm512_set1_ps(-136.0f);
#pragma GCC unroll 4
    for (int r = 0; r < kNR; ++r) {
      ST const* o = kAsym ? static_cast<ST const*>(p.offsets) + rows[r] * groups : nullptr;
      for (std::int64_t g = 0; g < groups; g += 16) {
        __mmask16 const gm = mask16(groups - g);
        __m512 const sv = load16_masked(s[r] + g, gm);
        __m512 const cv = kAsym ? _mm512_fmadd_ps(sv, minus128, load16_masked(o + g, gm)) : _mm512_mul_ps(sv, minus136);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          float const* xs = reinterpret_cast<float const*>(xw + i * row_elems + kParts * kpad);
          acc[i][r] = _mm512_fmadd_ps(cv, _mm512_load_ps(xs + g), acc[i][r]);
        }
      }
    }
    store_tile<MR, kNR, XT>(acc, p.out, p.bias, m0, n0, p.n);
  }
};

// XT: x/out storage type (float or Float16 here); ST: scale/offset storage type; kAsym: offsets given.
template <class XT, class ST, bool kAsym>
struct W4Fma {
  static constexpr int kNR = 4;     // weight rows per tile
  static constexpr int kMaxMR = 4;  // x rows per tile (4 x 4 accumulators + 8 split x vectors)
  W4A16GemmParams const& p;

  void tile(int mr, std::int64_t m0, std::int64_t n0) const { dispatch_mr<kMaxMR>(*this, mr, m0, n0); }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n0) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    std::int64_t rows[kNR];
    clamp_rows<kNR>(n0, p.n, rows);
    std::uint8_t const* w[kNR];
    ST const* s[kNR];
    ST const* o[kNR];
    for (int r = 0; r < kNR; ++r) {
      w[r] = p.qweight + rows[r] * (k_dim / 2);
      s[r] = static_cast<ST const*>(p.scales) + rows[r] * groups;
      o[r] = kAsym ? static_cast<ST const*>(p.offsets) + rows[r] * groups : nullptr;
    }
    XT const* x = static_cast<XT const*>(p.x) + m0 * k_dim;
    __m512 acc[MR][kNR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int r = 0; r < kNR; ++r) acc[i][r] = _mm512_setzero_ps();
    __m512i const even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    __m512i const odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    __m512i const low4 = _mm512_set1_epi32(0xf);
    __m512 const minus8 = _mm512_set1_ps(-8.0f);
    for (std::int64_t g = 0; g < groups; ++g) {
      for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += 32) {
        __m512 xe[MR], xo[MR];
        for (int i = 0; i < MR; ++i) {
          __m512 const a = load16(x + i * k_dim + kb);
          __m512 const b = load16(x + i * k_dim + kb + 16);
          xe[i] = _mm512_permutex2var_ps(a, even, b);
          xo[i] = _mm512_permutex2var_ps(a, odd, b);
        }
        for (int r = 0; r < kNR; ++r) {
          __m512 const sc = bcast(s[r] + g);
          // Symmetric: q * s - 8 * s rounds the exact s * (q - 8) once, like the reference.
          __m512 const of = kAsym ? bcast(o[r] + g) : _mm512_mul_ps(sc, minus8);
          __m512i const d = _mm512_cvtepu8_epi32(load_bytes16(w[r] + kb / 2));
          __m512 const wl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(d, low4)), sc, of);
          __m512 const wh = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4)), sc, of);
          for (int i = 0; i < MR; ++i) {
            acc[i][r] = _mm512_fmadd_ps(wl, xe[i], acc[i][r]);
            acc[i][r] = _mm512_fmadd_ps(wh, xo[i], acc[i][r]);
          }
        }
      }
    }
    store_tile<MR, kNR, XT>(acc, p.out, p.bias, m0, n0, p.n);
  }
};

// ---- Batched fp32 paths (W4Tiled, W8Tiled): fp32 / fp16 x and m >= kTiledMinM ----------------------
//
// With several x rows the products, not the weight bytes, bound the time, and fp32 FMA is as fast as
// W4Dot's two bf16 dot products per x value (hi + lo) while being exact fp32 math. Each weight vector
// is dequantised once per tile and used by up to kMaxMR x rows: 8 x rows by 3 weight rows is 24
// accumulators, 3 weight vectors, 3 int4 lookup tables and one x vector in registers. x is converted to
// fp32 once per M tile into the scratch buffer (int4: split into even / odd k per 32, to match the low /
// high nibbles of 16 weight bytes). A tile first widens its rows' scales (and offsets) to fp32 on the
// stack, so a group's scale is a broadcast load.
//
// int4 dequantisation is a table lookup: per row and group, the 16 possible weights q * scale + offset
// (one FMA, the same rounding as the reference) sit in a register, and VPERMPS picks 16 of them by the
// nibbles: no convert and no FMA per weight vector. int8: convert, multiply by the scale.
constexpr std::int64_t kTiledMinM = 4;
constexpr std::size_t kTiledScratchBytes = 96 * 1024;
constexpr std::int64_t kTiledMaxGroups = 512;  // >= 96 KiB / (4 bytes * 2 rows) / 32

// Keeps v in a register: without it GCC folds the x load into each of the kNR FMAs that use it (kNR
// loads instead of one), and loads, not FMAs, then bound the loop.
inline void pin(__m512& v) { __asm__("" : "+v"(v)); }

// Widens count 16-bit or fp32 values to fp32 (count <= kTiledMaxGroups).
template <class ST>
inline void widen(ST const* src, std::int64_t count, float* dst) {
  for (std::int64_t i = 0; i < count; i += 16) _mm512_storeu_ps(dst + i, load16_masked(src + i, mask16(count - i)));
}

// The 16 values a nibble stands for: q (asymmetric) or q - 8 (symmetric).
template <bool kAsym>
inline __m512 nibble_values() {
  return kAsym ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
               : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
}

// A group's 16 possible weights: q * scale + offset in one FMA, or scale * (q - 8) (symmetric; offset
// unused), each rounded once like the reference.
template <bool kAsym>
inline __m512 group_table(__m512 values, __m512 scale, __m512 offset) {
  return kAsym ? _mm512_fmadd_ps(values, scale, offset) : _mm512_mul_ps(values, scale);
}

// Derived: the kernel (run<MR>(m0, n0, scratch)); tile() dispatches to it.
template <class Params, class Derived>
struct TiledBase {
  static constexpr int kNR = 3;
  static constexpr int kMaxMR = 8;
  static constexpr std::size_t kScratchBytes = kTiledScratchBytes;
  Params const& p;

  void tile(int mr, std::int64_t m0, std::int64_t n0, void const* scratch) const {
    dispatch_mr<kMaxMR>(static_cast<Derived const&>(*this), mr, m0, n0, scratch);
  }

  // acc[i][r] += wv[r] * x row i (16 fp32 at x + i * k): each x vector loaded once, used kNR times.
  template <int MR>
  [[gnu::always_inline]] static void madd_rows(__m512 (&acc)[MR][kNR], __m512 const (&wv)[kNR], float const* x,
                                               std::int64_t k) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      __m512 xv = _mm512_load_ps(x + i * k);
      pin(xv);
#pragma GCC unroll 4
      for (int r = 0; r < kNR; ++r) acc[i][r] = _mm512_fmadd_ps(wv[r], xv, acc[i][r]);
    }
  }
  // The whole fp32 M tile must fit; below 2 rows per tile the untiled kernels do as well.
  int max_mr() const { return static_cast<int>(std::min<std::int64_t>(kMaxMR, kScratchBytes / (4 * p.k))); }
  bool fits() const { return max_mr() >= 2 && p.k / p.group_size <= kTiledMaxGroups; }

  // Rows m0 .. m0 + MR - 1, columns n0 .. n0 + 2 (those < n).
  template <int MR, class XT>
  [[gnu::always_inline]] void store(__m512 const (&acc)[MR][kNR], std::int64_t m0, std::int64_t n0) const {
    XT* out = static_cast<XT*>(p.out);
    XT const* bias = static_cast<XT const*>(p.bias);
    __m512 const zero = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      alignas(16) float v[4];
      _mm_store_ps(v, reduce4(acc[i][0], acc[i][1], acc[i][2], zero));
      for (int r = 0; r < kNR; ++r) {
        if (n0 + r < p.n) store_out(out + (m0 + i) * p.n, bias, n0 + r, v[r]);
      }
    }
  }
};

// XT: x/out storage type (float or Float16); ST: scale/offset storage type; kAsym: offsets given.
template <class XT, class ST, bool kAsym>
struct W4Tiled : TiledBase<W4A16GemmParams, W4Tiled<XT, ST, kAsym>> {
  using Base = TiledBase<W4A16GemmParams, W4Tiled>;
  using Base::kNR, Base::p;
  explicit W4Tiled(W4A16GemmParams const& params) : Base{params} {}

  void prepare(int mr, std::int64_t m0, void* scratch) const {
    __m512i const even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    __m512i const odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int i = 0; i < mr; ++i) {
      XT const* x = static_cast<XT const*>(p.x) + (m0 + i) * p.k;
      float* dst = static_cast<float*>(scratch) + i * p.k;
      for (std::int64_t kb = 0; kb < p.k; kb += 32) {  // k is a multiple of the group size (>= 32)
        __m512 const a = load16(x + kb), b = load16(x + kb + 16);
        _mm512_store_ps(dst + kb, _mm512_permutex2var_ps(a, even, b));
        _mm512_store_ps(dst + kb + 16, _mm512_permutex2var_ps(a, odd, b));
      }
    }
  }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n0, void const* scratch) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    std::int64_t rows[kNR];
    clamp_rows<kNR>(n0, p.n, rows);
    std::uint8_t const* w[kNR];
    alignas(64) float sc[kNR][kTiledMaxGroups];
    alignas(64) float of[kNR][kTiledMaxGroups];
    for (int r = 0; r < kNR; ++r) {
      w[r] = p.qweight + rows[r] * (k_dim / 2);
      widen(static_cast<ST const*>(p.scales) + rows[r] * groups, groups, sc[r]);
      if constexpr (kAsym) widen(static_cast<ST const*>(p.offsets) + rows[r] * groups, groups, of[r]);
    }
    float const* x = static_cast<float const*>(scratch);
    __m512 acc[MR][kNR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int r = 0; r < kNR; ++r) acc[i][r] = _mm512_setzero_ps();
    __m512 const iota = nibble_values<kAsym>();
    for (std::int64_t g = 0; g < groups; ++g) {
      __m512 table[kNR];
#pragma GCC unroll 4
      for (int r = 0; r < kNR; ++r) {
        table[r] = group_table<kAsym>(iota, _mm512_set1_ps(sc[r][g]), kAsym ? _mm512_set1_ps(of[r][g]) : iota);
      }
      for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += 32) {
        // Low nibbles (even k), then high nibbles (odd k).
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          __m512 wv[kNR];
#pragma GCC unroll 4
          for (int r = 0; r < kNR; ++r) {
            __m512i const d = _mm512_cvtepu8_epi32(load_bytes16(w[r] + kb / 2));
            // VPERMPS reads only the low 4 bits of each index: the high nibble needs the shift only.
            __m512i const q = half == 0 ? d : _mm512_srli_epi32(d, 4);
            wv[r] = _mm512_permutexvar_ps(q, table[r]);
          }
          this->madd_rows(acc, wv, x + kb + 16 * half, k_dim);
        }
      }
    }
    this->template store<MR, XT>(acc, m0, n0);
  }
};

// int8 weights, any x type (x widened to fp32 once per M tile).
template <class XT, class ST>
struct W8Tiled : TiledBase<W8A16GemmParams, W8Tiled<XT, ST>> {
  using Base = TiledBase<W8A16GemmParams, W8Tiled>;
  using Base::kNR, Base::p;
  explicit W8Tiled(W8A16GemmParams const& params) : Base{params} {}

  void prepare(int mr, std::int64_t m0, void* scratch) const {
    for (int i = 0; i < mr; ++i) {
      XT const* x = static_cast<XT const*>(p.x) + (m0 + i) * p.k;
      float* dst = static_cast<float*>(scratch) + i * p.k;
      for (std::int64_t kb = 0; kb < p.k; kb += 16) _mm512_store_ps(dst + kb, load16(x + kb));
    }
  }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n0, void const* scratch) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    std::int64_t rows[kNR];
    clamp_rows<kNR>(n0, p.n, rows);
    std::int8_t const* w[kNR];
    alignas(64) float sc[kNR][kTiledMaxGroups];
    for (int r = 0; r < kNR; ++r) {
      w[r] = p.qweight + rows[r] * k_dim;
      widen(static_cast<ST const*>(p.scales) + rows[r] * groups, groups, sc[r]);
    }
    float const* x = static_cast<float const*>(scratch);
    __m512 acc[MR][kNR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int r = 0; r < kNR; ++r) acc[i][r] = _mm512_setzero_ps();
    for (std::int64_t g = 0; g < groups; ++g) {
      for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += 16) {
        __m512 wv[kNR];
#pragma GCC unroll 4
        for (int r = 0; r < kNR; ++r) {
          wv[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes16(w[r] + kb))),
                                _mm512_set1_ps(sc[r][g]));
        }
        this->madd_rows(acc, wv, x + kb, k_dim);
      }
    }
    this->template store<MR, XT>(acc, m0, n0);
  }
};

// ---- Batched bf16 x, m >= kPanelMinM: W4Bf16Panel, W8Bf16Panel ----------------------------------------------------
//
// Each thread dequantises a panel of weight rows (at most kPanelBytes, so it stays in L2) into bf16 in
// natural k order, then runs the dense bf16 kernel (VDPBF16PS, dense_gemm_avx512) of all m rows against
// it, writing that column block of out. The weights are rounded to bf16 once more (s * q + o in fp32,
// then to nearest even): the numerics of the model dequantised to bf16. The dequantisation (7
// instructions per 32 weights) is shared by all m rows, where W4Dot repeats it per 3-row tile and
// multiplies in 128-weight chunks with a scale FMA each; from ~12 rows on the panel is faster (1 thread,
// SmolLM2 shapes: ~1.1x at 16 rows, ~1.5x at 64, ~1.6-1.8x at 256).
constexpr std::int64_t kPanelMinM = 12;
constexpr std::int64_t kPanelBytes = 96 * 1024;

// Runs a panel dequantiser D (D::dequantise(n0, rows, bf16 panel), D::p with the GEMM's m, n, k, x,
// bias, out and num_threads) over all of N: panels of near-equal size, a multiple of the thread count.
template <class D>
void run_panels(D const& deq, ThreadPool& pool) {
  auto const& p = deq.p;
  std::int64_t const cap = kPanelBytes / (2 * p.k) / 4 * 4;
  int const threads = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(p.num_threads, (p.n + 7) / 8)));
  std::int64_t panels = (p.n + cap - 1) / cap;
  panels = (panels + threads - 1) / threads * threads;
  std::int64_t const rows = std::min(cap, ((p.n + panels - 1) / panels + 3) / 4 * 4);
  std::int64_t const count = (p.n + rows - 1) / rows;
  auto task = [&](int i, int nt) {
    alignas(64) std::uint16_t panel[kPanelBytes / 2];
    for (std::int64_t c = count * i / nt; c < count * (i + 1) / nt; ++c) {
      std::int64_t const n0 = c * rows;
      std::int64_t const nr = std::min(rows, p.n - n0);
      deq.dequantise(n0, nr, panel);
      DenseGemmParams d;
      d.x = p.x;
      d.weight = panel;
      d.bias = p.bias != nullptr ? static_cast<BFloat16 const*>(p.bias) + n0 : nullptr;
      d.out = static_cast<BFloat16*>(p.out) + n0;
      d.m = p.m;
      d.n = nr;
      d.k = p.k;
      d.out_row_stride = p.n;
      d.dtype = ScalarType::kBFloat16;
      d.num_threads = 1;
      dense_gemm_avx512(d, pool);
    }
  };
  int const used = static_cast<int>(std::min<std::int64_t>(threads, count));
  if (used <= 1) {
    task(0, 1);
  } else {
    pool.run(used, TaskRef(task));
  }
}

// Whether a panel of at least 8 rows fits kPanelBytes.
inline bool panel_fits(std::int64_t k) { return kPanelBytes / (2 * k) >= 8; }

template <class ST, bool kAsym>
struct W4Bf16Panel {
  W4A16GemmParams const& p;

  // Rows [n0, n0 + rows) of the weight as bf16, row stride k. Per row and group, the 16 possible weights
  // (q * scale + offset in fp32, rounded to bf16) form a word table; VPERMW looks 32 weights up at once
  // by their nibbles, already in natural k order.
  void dequantise(std::int64_t n0, std::int64_t rows, std::uint16_t* panel) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    __m512 const iota = nibble_values<kAsym>();
    __m512i const nibbles = _mm512_set1_epi32(0x000f000f);
    for (std::int64_t r = 0; r < rows; ++r) {
      std::uint8_t const* w = p.qweight + (n0 + r) * (k_dim / 2);
      ST const* s = static_cast<ST const*>(p.scales) + (n0 + r) * groups;
      ST const* o = kAsym ? static_cast<ST const*>(p.offsets) + (n0 + r) * groups : nullptr;
      std::uint16_t* dst = panel + r * k_dim;
      for (std::int64_t g = 0; g < groups; ++g) {
        __m512 const sc = bcast(s + g);
        __m512 const t32 = group_table<kAsym>(iota, sc, kAsym ? bcast(o + g) : iota);
        __m512i const table = (__m512i)_mm512_cvtne2ps_pbh(t32, t32);  // words 0..15 (and again 16..31)
        for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += 32) {
          __m512i const d = _mm512_cvtepu8_epi32(load_bytes16(w + kb / 2));
          // (d | d << 12) & 0x000f000f: byte j's low nibble in word 2j (k = kb + 2j), its high in word 2j + 1.
          __m512i const idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), nibbles, 0xa8);
          _mm512_store_si512(dst + kb, _mm512_permutexvar_epi16(idx, table));
        }
      }
    }
  }
};

// int8 weights: w = q * scale in fp32, rounded to bf16.
template <class ST>
struct W8Bf16Panel {
  W8A16GemmParams const& p;

  void dequantise(std::int64_t n0, std::int64_t rows, std::uint16_t* panel) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    for (std::int64_t r = 0; r < rows; ++r) {
      std::int8_t const* w = p.qweight + (n0 + r) * k_dim;
      ST const* s = static_cast<ST const*>(p.scales) + (n0 + r) * groups;
      std::uint16_t* dst = panel + r * k_dim;
      for (std::int64_t g = 0; g < groups; ++g) {
        __m512 const sc = bcast(s + g);
        for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += 32) {
          __m512 const a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes16(w + kb))), sc);
          __m512 const b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes16(w + kb + 16))), sc);
          _mm512_store_si512(dst + kb, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
      }
    }
  }
};

// bf16 activations through VDPBF16PS. ST: scale/offset storage type; kAsym: offsets given.
template <class ST, bool kAsym>
struct W4Bf16Dot {
  static constexpr int kNR = 4;     // weight rows per tile
  static constexpr int kMaxMR = 2;  // x rows per tile (per-group and running accumulators: 2 x MR x kNR)
  W4A16GemmParams const& p;

  void tile(int mr, std::int64_t m0, std::int64_t n0) const { dispatch_mr<kMaxMR>(*this, mr, m0, n0); }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n0) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    std::int64_t rows[kNR];
    clamp_rows<kNR>(n0, p.n, rows);
    std::uint8_t const* w[kNR];
    ST const* s[kNR];
    ST const* o[kNR];
    for (int r = 0; r < kNR; ++r) {
      w[r] = p.qweight + rows[r] * (k_dim / 2);
      s[r] = static_cast<ST const*>(p.scales) + rows[r] * groups;
      o[r] = kAsym ? static_cast<ST const*>(p.offsets) + rows[r] * groups : nullptr;
    }
    BFloat16 const* x = static_cast<BFloat16 const*>(p.x) + m0 * k_dim;
    __m512 acc[MR][kNR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int r = 0; r < kNR; ++r) acc[i][r] = _mm512_setzero_ps();
    __m512i const table = _mm512_load_si512(kAsym ? kTableAsym.v : kTableSym.v);
    __m512i const nibbles = _mm512_set1_epi32(0x000f000f);
    __m512bh const ones = (__m512bh)_mm512_set1_epi16(static_cast<short>(0x3f80));  // bf16 1.0
    for (std::int64_t g = 0; g < groups; ++g) {
      __m512 gacc[MR][kNR];
      __m512 xsum[MR];
      for (int i = 0; i < MR; ++i) {
        xsum[i] = _mm512_setzero_ps();
        for (int r = 0; r < kNR; ++r) gacc[i][r] = _mm512_setzero_ps();
      }
      for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += 32) {
        __m512bh xb[MR];
        for (int i = 0; i < MR; ++i) {
          xb[i] = (__m512bh)_mm512_loadu_si512(x + i * k_dim + kb);
          if constexpr (kAsym) xsum[i] = _mm512_dpbf16_ps(xsum[i], xb[i], ones);
        }
        for (int r = 0; r < kNR; ++r) {
          __m512i const d = _mm512_cvtepu8_epi32(load_bytes16(w[r] + kb / 2));
          // (d | d << 12) & 0x000f000f: byte j's low nibble in word 2j, its high nibble in word 2j+1.
          __m512i const idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), nibbles, 0xa8);
          __m512bh const q = (__m512bh)_mm512_permutexvar_epi16(idx, table);
          for (int i = 0; i < MR; ++i) gacc[i][r] = _mm512_dpbf16_ps(gacc[i][r], q, xb[i]);
        }
      }
      for (int r = 0; r < kNR; ++r) {
        __m512 const sc = bcast(s[r] + g);
        for (int i = 0; i < MR; ++i) acc[i][r] = _mm512_fmadd_ps(gacc[i][r], sc, acc[i][r]);
        if constexpr (kAsym) {
          __m512 const of = bcast(o[r] + g);
          for (int i = 0; i < MR; ++i) acc[i][r] = _mm512_fmadd_ps(xsum[i], of, acc[i][r]);
        }
      }
    }
    store_tile<MR, kNR, BFloat16>(acc, p.out, p.bias, m0, n0, p.n);
  }
};

template <class XT, class ST>
struct W8Fma {
  static constexpr int kNR = 4;     // weight rows per tile
  static constexpr int kMaxMR = 4;  // x rows per tile
  W8A16GemmParams const& p;

  void tile(int mr, std::int64_t m0, std::int64_t n0) const { dispatch_mr<kMaxMR>(*this, mr, m0, n0); }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n0) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    std::int64_t rows[kNR];
    clamp_rows<kNR>(n0, p.n, rows);
    std::int8_t const* w[kNR];
    ST const* s[kNR];
    for (int r = 0; r < kNR; ++r) {
      w[r] = p.qweight + rows[r] * k_dim;
      s[r] = static_cast<ST const*>(p.scales) + rows[r] * groups;
    }
    XT const* x = static_cast<XT const*>(p.x) + m0 * k_dim;
    __m512 acc[MR][kNR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int r = 0; r < kNR; ++r) acc[i][r] = _mm512_setzero_ps();
    for (std::int64_t g = 0; g < groups; ++g) {
      if constexpr (MR == 1) {
        // One x row: sum q * x over the group, then scale once (saves a multiply per weight vector).
        __m512 gacc[kNR];
#pragma GCC unroll 4
        for (int r = 0; r < kNR; ++r) {
          gacc[r] = _mm512_setzero_ps();
          // The next tile's rows follow these in memory: fetch them a tile ahead.
          _mm_prefetch(reinterpret_cast<char const*>(w[r] + kPrefetchTiles * kNR * k_dim + g * g_size), _MM_HINT_T0);
        }
        for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += 16) {
          __m512 const xv = load16(x + kb);
#pragma GCC unroll 4
          for (int r = 0; r < kNR; ++r) {
            __m512 const q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes16(w[r] + kb)));
            gacc[r] = _mm512_fmadd_ps(q, xv, gacc[r]);
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < kNR; ++r) acc[0][r] = _mm512_fmadd_ps(gacc[r], bcast(s[r] + g), acc[0][r]);
      } else {
        // Several x rows: dequantise each weight vector once, reuse it MR times.
        __m512 sc[kNR];
#pragma GCC unroll 4
        for (int r = 0; r < kNR; ++r) sc[r] = bcast(s[r] + g);
        for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += 16) {
          __m512 xv[MR];
#pragma GCC unroll 4
          for (int i = 0; i < MR; ++i) xv[i] = load16(x + i * k_dim + kb);
#pragma GCC unroll 4
          for (int r = 0; r < kNR; ++r) {
            __m512 const wv = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes16(w[r] + kb))), sc[r]);
#pragma GCC unroll 4
            for (int i = 0; i < MR; ++i) acc[i][r] = _mm512_fmadd_ps(wv, xv[i], acc[i][r]);
          }
        }
      }
    }
    store_tile<MR, kNR, XT>(acc, p.out, p.bias, m0, n0, p.n);
  }
};

}  // namespace

void w4a16_gemm_avx512(W4A16GemmParams const& p, ThreadPool& pool) {
  dispatch_float_type(p.dtype, [&](auto xt) {
    dispatch_float_type(p.scale_type, [&](auto st) {
      using XT = decltype(xt);
      using ST = decltype(st);
      bool const asym = p.offsets != nullptr;
      // Runs a scratch-buffer kernel when one x row (or M tile) fits its scratch.
      auto run_if_fits = [&](auto const& kernel) {
        if (!kernel.fits()) return false;
        run_tiles(kernel, p.m, p.n, p.k / 2, p.num_threads, pool);
        return true;
      };
      if constexpr (std::is_same_v<XT, BFloat16>) {
        if (p.m >= kPanelMinM && panel_fits(p.k)) {
          if (asym) {
            run_panels(W4Bf16Panel<ST, true>{p}, pool);
          } else {
            run_panels(W4Bf16Panel<ST, false>{p}, pool);
          }
          return;
        }
      } else if (p.m >= kTiledMinM) {
        if (asym ? run_if_fits(W4Tiled<XT, ST, true>(p)) : run_if_fits(W4Tiled<XT, ST, false>(p))) return;
      }
      if (asym ? run_if_fits(W4Dot<XT, ST, true>(p)) : run_if_fits(W4Dot<XT, ST, false>(p))) return;
      // Rows too long for the scratch buffer (k beyond ~16K): the in-register kernels, no reordering.
      if constexpr (std::is_same_v<XT, BFloat16>) {
        if (asym) {
          run_tiles(W4Bf16Dot<ST, true>{p}, p.m, p.n, p.k / 2, p.num_threads, pool);
        } else {
          run_tiles(W4Bf16Dot<ST, false>{p}, p.m, p.n, p.k / 2, p.num_threads, pool);
        }
      } else if (asym) {
        run_tiles(W4Fma<XT, ST, true>{p}, p.m, p.n, p.k / 2, p.num_threads, pool);
      } else {
        run_tiles(W4Fma<XT, ST, false>{p}, p.m, p.n, p.k / 2, p.num_threads, pool);
      }
    });
  });
}

void w8a16_gemm_avx512(W8A16GemmParams const& p, ThreadPool& pool) {
  dispatch_float_type(p.dtype, [&](auto xt) {
    dispatch_float_type(p.scale_type, [&](auto st) {
      using XT = decltype(xt);
      using ST = decltype(st);
      if constexpr (std::is_same_v<XT, BFloat16>) {
        if (p.m >= kPanelMinM && panel_fits(p.k)) {
          run_panels(W8Bf16Panel<ST>{p}, pool);
          return;
        }
      }
      // fp32 / fp16 x, and bf16 x below kPanelMinM rows (widened to fp32 exactly; W8Fma's bf16 path is slower).
      W8Tiled<XT, ST> const tiled(p);
      if (p.m >= kTiledMinM && tiled.fits()) {
        run_tiles(tiled, p.m, p.n, p.k, p.num_threads, pool);
        return;
      }
      run_tiles(W8Fma<XT, ST>{p}, p.m, p.n, p.k, p.num_threads, pool);
    });
  });
}

}  // namespace inflight::kernels::cpu
