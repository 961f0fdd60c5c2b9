// The AVX-512 int4 strategies built on VDPBF16PS (bf16 pairs multiplied exactly, summed in fp32):
// W4Dot, the main int4 path (decode, and bf16 x below the panels' rows), and W4Bf16Dot, bf16 x with
// rows too long for W4Dot's scratch buffer. gemm_avx512.h lists the other strategies.
#include <bit>
#include <type_traits>

#include "gemm_avx512.h"

namespace inflight::kernels::cpu::gemm_avx512 {
namespace {

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

// W4Dot's weight side: a chunk's nibbles as bf16 128 + q, its lane scales, and the per-group offset
// terms. W4Dot decodes with it per tile and W4DotPanel once per panel: their bits agree because both
// decode here.
struct W4DotDecode {
  __m512i nib = _mm512_set1_epi16(0x000f);
  __m512i bias = _mm512_set1_epi16(0x4300);  // bf16 128.0
  __m512i sidx;                              // dword lane l (128-bit lane l / 4) -> its group in the chunk
  int groups_per_chunk;
  std::int64_t k_dim, groups;

  W4DotDecode(std::int64_t k, int g_size)
      : sidx(_mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                               g_size == 32 ? 2u : (g_size == 64 ? 3u : 4u))),
        groups_per_chunk(kChunk / g_size),
        k_dim(k),
        groups(k / g_size) {}

  // The bytes of chunk c (at k = c) that exist: all 64 but in the last chunk.
  [[gnu::always_inline]] __mmask64 byte_mask(std::int64_t c) const {
    std::int64_t const left = k_dim - c;
    return left >= kChunk ? ~__mmask64(0) : (__mmask64(1) << (left / 2)) - 1;
  }
  // The chunk's 64 weight bytes as four vectors of 32 bf16 (128 + q). 0xEA: (A & B) | C.
  [[gnu::always_inline]] void nibbles(__m512i b, __m512bh (&q)[4]) const {
    q[0] = (__m512bh)_mm512_ternarylogic_epi32(b, nib, bias, 0xea);
    q[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), nib, bias, 0xea);
    q[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 8), nib, bias, 0xea);
    q[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(b, 12), bias);
  }
  // The groups of the chunk whose first group is g0 that exist.
  [[gnu::always_inline]] __mmask8 scale_mask(std::int64_t g0) const {
    return static_cast<__mmask8>((1u << std::min<std::int64_t>(groups_per_chunk, groups - g0)) - 1u);
  }
  // Each lane's group scale for that chunk (s: the row's scales; smask: scale_mask(g0)).
  template <class ST>
  [[gnu::always_inline]] __m512 lane_scales(ST const* s, std::int64_t g0, __mmask8 smask) const {
    return _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(load_scales4(s + g0, smask)));
  }
  // Groups g .. g + 15 (masked past the last): + (offset - 128 scale) * sum(x), or - 136 scale * sum(x)
  // when symmetric (o unused).
  template <bool kAsym, class ST>
  [[gnu::always_inline]] __m512 offset_terms(ST const* s, ST const* o, std::int64_t g) const {
    __mmask16 const gm = mask16(groups - g);
    __m512 const sv = load16_masked(s + g, gm);
    if constexpr (kAsym) return _mm512_fmadd_ps(sv, _mm512_set1_ps(-128.0f), load16_masked(o + g, gm));
    return _mm512_mul_ps(sv, _mm512_set1_ps(-136.0f));
  }
};

// XT: x/out storage type; ST: scale/offset storage type; kAsym: offsets given.
template <class XT, class ST, bool kAsym>
struct W4Dot {
  static constexpr int kParts = std::is_same_v<XT, BFloat16> ? 1 : 2;  // bf16 x, or hi + lo
  static constexpr int kNR = 4;                                        // weight rows per tile
  // x rows per tile. fp32 / fp16 x: 2 (MR x kNR accumulators + MR x 4 x 2 x vectors reused by the kNR
  // rows + 4 weight vectors fill the 32 registers). bf16 x: 4, its x vectors read from the scratch (L1)
  // by each dot product: fewer tiles decode each weight row (16 rows: 4 instead of 3+3+3+3+3+1), measured
  // on Zen 4 (2 threads, SmolLM2's shapes, alternating builds) 1.2-1.5x at 4-8 rows and 1.04-1.06x at 16
  // against 3-row tiles, the same at 1-3 and 32-64 rows; 5- and 6-row tiles lost from 8 rows on.
  static constexpr int kMaxMR = kParts == 1 ? 4 : 2;
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
    QuantTile<kNR, ST, kAsym, W4A16GemmParams> const t(p, n0);
    std::uint16_t const* xw = static_cast<std::uint16_t const*>(scratch);
    __m512 acc[MR][kNR];
    zero_tile<Vec512>(acc);
    W4DotDecode const dec(k_dim, g_size);
    std::int64_t g0 = 0;  // first group of the chunk
    for (std::int64_t c = 0; c < kpad; c += kChunk, g0 += dec.groups_per_chunk) {
      __mmask64 const bmask = dec.byte_mask(c);
      __mmask8 const smask = dec.scale_mask(g0);
#pragma GCC unroll 4
      for (int r = 0; r < kNR; ++r) {
        __m512i const b = _mm512_maskz_loadu_epi8(bmask, t.w[r] + c / 2);
        // The next tiles' rows follow these in memory: fetch them ahead (the hardware prefetcher alone
        // leaves a single thread well below the memory bandwidth).
        _mm_prefetch(reinterpret_cast<char const*>(t.w[r] + kPrefetchTiles * kNR * (k_dim / 2) + c / 2), _MM_HINT_T0);
        __m512bh q[4];
        dec.nibbles(b, q);
        __m512 const sv = dec.lane_scales(t.s[r], g0, smask);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          std::uint16_t const* xp = xw + i * row_elems + c;
          __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_load_si512(xp));
          d = _mm512_dpbf16_ps(d, q[1], (__m512bh)_mm512_load_si512(xp + 32));
          d = _mm512_dpbf16_ps(d, q[2], (__m512bh)_mm512_load_si512(xp + 64));
          d = _mm512_dpbf16_ps(d, q[3], (__m512bh)_mm512_load_si512(xp + 96));
          if constexpr (kParts == 2) {
            std::uint16_t const* xl = xp + kpad;
            __m512 e = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_load_si512(xl));
            e = _mm512_dpbf16_ps(e, q[1], (__m512bh)_mm512_load_si512(xl + 32));
            e = _mm512_dpbf16_ps(e, q[2], (__m512bh)_mm512_load_si512(xl + 64));
            e = _mm512_dpbf16_ps(e, q[3], (__m512bh)_mm512_load_si512(xl + 96));
            d = _mm512_add_ps(d, e);
          }
          acc[i][r] = _mm512_fmadd_ps(d, sv, acc[i][r]);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kNR; ++r) {
      for (std::int64_t g = 0; g < groups; g += 16) {
        __m512 const cv = dec.offset_terms<kAsym>(t.s[r], t.o[r], g);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          float const* xs = reinterpret_cast<float const*>(xw + i * row_elems + kParts * kpad);
          acc[i][r] = _mm512_fmadd_ps(cv, _mm512_load_ps(xs + g), acc[i][r]);
        }
      }
    }
    store_quant_tile<Vec512, XT>(acc, p, m0, n0);
  }
};

// ---- W4DotPanel: W4Dot's arithmetic with the dequantisation shared by every x row -----------------
//
// W4Dot rebuilds the bf16 nibble vectors of a weight row for every M tile of 2 (bf16 x: 4) x rows; those
// shifts and masks run on the same Zen 4 vector pipes as VDPBF16PS, so at m >= kDotPanelMinM a panel of
// weight rows is dequantised once (each row: per chunk the four q vectors, then per chunk the lane
// scales, then the per-group offset terms), and every M tile multiplies against it. The operations on
// each output element are W4Dot's, in W4Dot's order (chunk dot products from zero, hi + lo, the scale
// FMA, the offset FMAs, the same lane reduction), so the results are bit-identical to W4Dot at any m:
// batch-invariant, and the decode rows (W4Dot) read the same as a prefill's.
//
// Where it wins (2 Zen 4 threads, SmolLM2 shapes, interleaved calls): fp32 x 1.03-1.06x W4Dot at 16
// rows and 1.07-1.25x at 64-256 (below 16 the panel's stores cost what they save); bf16 x, whose
// dot products are half as many, 1.0-1.14x from 64 rows and up to 0.84x below (against 3-row W4Dot
// tiles; the 4-row ones are the same as the panel at 32-64 rows). GCC reloads the q vectors per x
// row rather than keep them in registers; forcing them into registers measured slower.
// Per chunk a 2 x 4 fp32 tile issues 64 VDPBF16PS, 8 adds and 8 FMAs (the compiled loop: those, its
// loads, no vector spills). Summing hi and lo in one chain (no add) with 3-row tiles measured no
// faster at 16-256 rows and one row slower (3.48 against 3.09 ms over 30 SmolLM2 layers, one run;
// W4Dot's single chain then waits on VDPBF16PS latency): not taken.
constexpr std::int64_t kDotPanelMinM = 16;
constexpr std::int64_t kDotPanelMinMBf16 = 64;
constexpr std::size_t kDotPanelXBytes = 256 * 1024;  // prepared x rows of one M block (L2)
constexpr std::size_t kDotPanelBytes = 24 * 1024;    // dequantised weight rows of one panel (L1)

template <class XT, class ST, bool kAsym>
struct W4DotPanel {
  using Dot = W4Dot<XT, ST, kAsym>;
  static constexpr int kParts = Dot::kParts;
  static constexpr int kNR = 4;
  // Per tile: MR x kNR accumulators and as many running dot products per part, kNR q vectors, x.
  static constexpr int kMaxMR = kParts == 1 ? 3 : 2;
  Dot const& dot;
  std::int64_t chunks;  // kpad / kChunk
  std::int64_t stride;  // bytes of one dequantised row: q vectors, lane scales, offset terms

  explicit W4DotPanel(Dot const& d) : dot(d), chunks(d.kpad / kChunk), stride(chunks * 320 + d.xs_pad * 4) {}

  // Rows n0 .. n0 + rows - 1 (past n: the last row, computed and never stored) into panel.
  void dequantise(std::int64_t n0, std::int64_t rows, unsigned char* panel) const {
    W4A16GemmParams const& p = dot.p;
    std::int64_t const k_dim = p.k, groups = dot.groups;
    W4DotDecode const dec(k_dim, p.group_size);
    for (std::int64_t r = 0; r < rows; ++r) {
      std::int64_t const row = std::min(n0 + r, p.n - 1);
      std::uint8_t const* w = p.qweight + row * (k_dim / 2);
      ST const* s = static_cast<ST const*>(p.scales) + row * groups;
      ST const* o = kAsym ? static_cast<ST const*>(p.offsets) + row * groups : nullptr;
      unsigned char* dst = panel + r * stride;
      std::int64_t g0 = 0;
      for (std::int64_t c = 0; c < dot.kpad; c += kChunk, g0 += dec.groups_per_chunk) {
        __m512i const b = _mm512_maskz_loadu_epi8(dec.byte_mask(c), w + c / 2);
        _mm_prefetch(reinterpret_cast<char const*>(w + rows * (k_dim / 2) + c / 2), _MM_HINT_T0);
        __m512bh q[4];
        dec.nibbles(b, q);
        unsigned char* qd = dst + (c / kChunk) * 256;
        for (int v = 0; v < 4; ++v) _mm512_store_si512(qd + 64 * v, (__m512i)q[v]);
        _mm512_store_ps(dst + chunks * 256 + (c / kChunk) * 64, dec.lane_scales(s, g0, dec.scale_mask(g0)));
      }
      float* cv = reinterpret_cast<float*>(dst + chunks * 320);
      for (std::int64_t g = 0; g < groups; g += 16) _mm512_store_ps(cv + g, dec.offset_terms<kAsym>(s, o, g));
    }
  }

  // One tile: MR prepared x rows (xw, W4Dot's scratch layout) by the kNR dequantised rows at tile.
  template <int MR>
  void run(unsigned char const* tile, std::uint16_t const* xw, std::int64_t m0, std::int64_t n0) const {
    std::int64_t const row_elems = dot.row_elems, kpad = dot.kpad;
    __m512 acc[MR][kNR];
    zero_tile<Vec512>(acc);
    for (std::int64_t c = 0; c < chunks; ++c) {
      __m512 d[MR][kNR];
      __m512 e[MR][kNR];
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        __m512bh q[kNR];
#pragma GCC unroll 4
        for (int r = 0; r < kNR; ++r) q[r] = (__m512bh)_mm512_load_si512(tile + r * stride + c * 256 + v * 64);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          std::uint16_t const* xp = xw + i * row_elems + c * kChunk + 32 * v;
          __m512bh const xh = (__m512bh)_mm512_load_si512(xp);
#pragma GCC unroll 4
          for (int r = 0; r < kNR; ++r) d[i][r] = _mm512_dpbf16_ps(v == 0 ? _mm512_setzero_ps() : d[i][r], q[r], xh);
          if constexpr (kParts == 2) {
            __m512bh const xl = (__m512bh)_mm512_load_si512(xp + kpad);
#pragma GCC unroll 4
            for (int r = 0; r < kNR; ++r) e[i][r] = _mm512_dpbf16_ps(v == 0 ? _mm512_setzero_ps() : e[i][r], q[r], xl);
          }
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < kNR; ++r) {
        __m512 const sv = _mm512_load_ps(tile + r * stride + chunks * 256 + c * 64);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          __m512 const dd = kParts == 2 ? _mm512_add_ps(d[i][r], e[i][r]) : d[i][r];
          acc[i][r] = _mm512_fmadd_ps(dd, sv, acc[i][r]);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kNR; ++r) {
      float const* cv = reinterpret_cast<float const*>(tile + r * stride + chunks * 320);
      for (std::int64_t g = 0; g < dot.groups; g += 16) {
        __m512 const cvv = _mm512_load_ps(cv + g);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          float const* xs = reinterpret_cast<float const*>(xw + i * row_elems + kParts * kpad);
          acc[i][r] = _mm512_fmadd_ps(cvv, _mm512_load_ps(xs + g), acc[i][r]);
        }
      }
    }
    store_quant_tile<Vec512, XT>(acc, dot.p, m0, n0);
  }

  void tile(int mr, unsigned char const* t, std::uint16_t const* xw, std::int64_t m0, std::int64_t n0) const {
    dispatch_mr<kMaxMR>(*this, mr, t, xw, m0, n0);
  }

  // Rows of x per M block (prepared once, in L2), weight tiles per panel (dequantised once, in L1).
  std::int64_t block() const {
    return std::max<std::int64_t>(kMaxMR, std::min<std::int64_t>(dot.p.m, kDotPanelXBytes / (dot.row_elems * 2)));
  }
  std::int64_t panel_tiles() const { return std::max<std::int64_t>(1, kDotPanelBytes / (kNR * stride)); }
  std::size_t x_bytes() const { return static_cast<std::size_t>(block() * dot.row_elems * 2); }
  std::size_t scratch_bytes() const { return x_bytes() + static_cast<std::size_t>(panel_tiles() * kNR * stride); }

  // One thread's share: N tiles [t0, t1). Per M block its x rows are prepared once; per panel the
  // weight rows are dequantised once and every M tile of the block walks them.
  void run_range(std::int64_t t0, std::int64_t t1, unsigned char* buf) const {
    W4A16GemmParams const& p = dot.p;
    std::int64_t const block = this->block(), panel_tiles = this->panel_tiles();
    std::size_t const x_bytes = this->x_bytes();
    auto* xw = reinterpret_cast<std::uint16_t*>(buf);
    unsigned char* panel = buf + x_bytes;
    XT const* x = static_cast<XT const*>(p.x);
    for (std::int64_t mb = 0; mb < p.m; mb += block) {
      std::int64_t const rows = std::min(block, p.m - mb);
      for (std::int64_t j = 0; j < rows; ++j) dot.prepare_row(x + (mb + j) * p.k, xw + j * dot.row_elems);
      for (std::int64_t pt = t0; pt < t1; pt += panel_tiles) {
        std::int64_t const pt1 = std::min(t1, pt + panel_tiles);
        dequantise(pt * kNR, (pt1 - pt) * kNR, panel);
        for (std::int64_t m0 = 0; m0 < rows; m0 += kMaxMR) {
          int const mr = static_cast<int>(std::min<std::int64_t>(kMaxMR, rows - m0));
          for (std::int64_t t = pt; t < pt1; ++t) {
            tile(mr, panel + (t - pt) * kNR * stride, xw + m0 * dot.row_elems, mb + m0, t * kNR);
          }
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
    QuantTile<kNR, ST, kAsym, W4A16GemmParams> const t(p, n0);
    BFloat16 const* x = static_cast<BFloat16 const*>(p.x) + m0 * k_dim;
    __m512 acc[MR][kNR];
    zero_tile<Vec512>(acc);
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
          __m512i const d = _mm512_cvtepu8_epi32(load_bytes16(t.w[r] + kb / 2));
          // (d | d << 12) & 0x000f000f: byte j's low nibble in word 2j, its high nibble in word 2j+1.
          __m512i const idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), nibbles, 0xa8);
          __m512bh const q = (__m512bh)_mm512_permutexvar_epi16(idx, table);
          for (int i = 0; i < MR; ++i) gacc[i][r] = _mm512_dpbf16_ps(gacc[i][r], q, xb[i]);
        }
      }
      for (int r = 0; r < kNR; ++r) {
        __m512 const sc = Vec512::bcast(t.s[r] + g);
        for (int i = 0; i < MR; ++i) acc[i][r] = _mm512_fmadd_ps(gacc[i][r], sc, acc[i][r]);
        if constexpr (kAsym) {
          __m512 const of = Vec512::bcast(t.o[r] + g);
          for (int i = 0; i < MR; ++i) acc[i][r] = _mm512_fmadd_ps(xsum[i], of, acc[i][r]);
        }
      }
    }
    store_quant_tile<Vec512, BFloat16>(acc, p, m0, n0);
  }
};

}  // namespace

bool w4a16_dot(W4A16GemmParams const& p, ThreadPool& pool) {
  bool done = false;
  gemm_detail::dispatch_w4(p, [&](auto xt, auto st, auto asym) {
    W4Dot<decltype(xt), decltype(st), asym> const kernel(p);
    if (!kernel.fits()) return;
    gemm_detail::run_tiles(kernel, p.m, p.n, p.k / 2, p.num_threads, pool);
    done = true;
  });
  return done;
}

bool w4a16_dot_panels(W4A16GemmParams const& p, ThreadPool& pool) {
  if (p.m < (p.dtype == ScalarType::kBFloat16 ? kDotPanelMinMBf16 : kDotPanelMinM)) return false;
  bool done = false;
  gemm_detail::dispatch_w4(p, [&](auto xt, auto st, auto asym) {
    using Dot = W4Dot<decltype(xt), decltype(st), asym>;
    Dot const dot(p);
    if (!dot.fits()) return;
    W4DotPanel<decltype(xt), decltype(st), asym> const kernel(dot);
    gemm_detail::run_thread_ranges(kernel, p.n, gemm_detail::row_bytes(p), p.num_threads, pool);
    done = true;
  });
  return done;
}

void w4a16_bf16_dot(W4A16GemmParams const& p, ThreadPool& pool) {
  dispatch_float_type(p.scale_type, [&](auto st) {
    using ST = decltype(st);
    if (p.offsets != nullptr) {
      gemm_detail::run_tiles(W4Bf16Dot<ST, true>{p}, p.m, p.n, p.k / 2, p.num_threads, pool);
    } else {
      gemm_detail::run_tiles(W4Bf16Dot<ST, false>{p}, p.m, p.n, p.k / 2, p.num_threads, pool);
    }
  });
}

}  // namespace inflight::kernels::cpu::gemm_avx512
