// The AVX-512 tiled strategy: batched fp32 / fp16 x (int8 weights: any x), m >= kTiledMinM. Products,
// not weight bytes, bound the time here; gemm_avx512.h lists the other strategies.
//
// Written once, included by gemm_tiled_avx512.cpp (the AVX-512 + BF16 build) and gemm_avx512f.cpp
// (AVX-512 without BF16: only AVX-512 F/BW/VL/DQ instructions are used here), after gemm_avx512.h.
#pragma once

namespace inflight::kernels::cpu::INFLIGHT_GEMM_ISA {
namespace {

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
// From 2 rows on (a speculative step's 1 + k, a small batch) the tiled kernels are ahead: fp32 x costs
// W4Dot two dot products per value and its tiles hold at most 2 rows (3 rows took it 2.2x the time of
// one; the tiled kernel 1.1x), and W8Tiled edges out W8Fma (SmolLM2's Q8_0 head, Xeon, 2 threads).
constexpr std::int64_t kTiledMinM = 2;
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
        __m512 const a = Vec512::load(x + kb), b = Vec512::load(x + kb + 16);
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
    QuantTile<kNR, ST, kAsym, W4A16GemmParams> const t(p, n0);
    alignas(64) float sc[kNR][kTiledMaxGroups];
    alignas(64) float of[kNR][kTiledMaxGroups];
    for (int r = 0; r < kNR; ++r) {
      widen(t.s[r], groups, sc[r]);
      if constexpr (kAsym) widen(t.o[r], groups, of[r]);
    }
    float const* x = static_cast<float const*>(scratch);
    __m512 acc[MR][kNR];
    zero_tile<Vec512>(acc);
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
            __m512i const d = _mm512_cvtepu8_epi32(load_bytes16(t.w[r] + kb / 2));
            // VPERMPS reads only the low 4 bits of each index: the high nibble needs the shift only.
            __m512i const q = half == 0 ? d : _mm512_srli_epi32(d, 4);
            wv[r] = _mm512_permutexvar_ps(q, table[r]);
          }
          this->madd_rows(acc, wv, x + kb + 16 * half, k_dim);
        }
      }
    }
    store_quant_tile<Vec512, XT>(acc, p, m0, n0);
  }
};

// int8 weights, any x type (x widened to fp32 once per M tile).
template <class XT, class ST, bool kFp8>
struct W8Tiled : TiledBase<W8A16GemmParams, W8Tiled<XT, ST, kFp8>> {
  using Base = TiledBase<W8A16GemmParams, W8Tiled>;
  using Base::kNR, Base::p;
  explicit W8Tiled(W8A16GemmParams const& params) : Base{params} {}

  void prepare(int mr, std::int64_t m0, void* scratch) const {
    for (int i = 0; i < mr; ++i) {
      XT const* x = static_cast<XT const*>(p.x) + (m0 + i) * p.k;
      float* dst = static_cast<float*>(scratch) + i * p.k;
      for (std::int64_t kb = 0; kb < p.k; kb += 16) _mm512_store_ps(dst + kb, Vec512::load(x + kb));
    }
  }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n0, void const* scratch) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    QuantTile<kNR, ST, false, W8A16GemmParams> const t(p, n0);
    alignas(64) float sc[kNR][kTiledMaxGroups];
    for (int r = 0; r < kNR; ++r) widen(t.s[r], groups, sc[r]);
    float const* x = static_cast<float const*>(scratch);
    __m512 acc[MR][kNR];
    zero_tile<Vec512>(acc);
    for (std::int64_t g = 0; g < groups; ++g) {
      for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += 16) {
        __m512 wv[kNR];
#pragma GCC unroll 4
        for (int r = 0; r < kNR; ++r) {
          wv[r] = _mm512_mul_ps(Vec512::w8<kFp8>(t.w[r] + kb), _mm512_set1_ps(sc[r][g]));
        }
        this->madd_rows(acc, wv, x + kb, k_dim);
      }
    }
    store_quant_tile<Vec512, XT>(acc, p, m0, n0);
  }
};

}  // namespace

bool w4a16_tiled(W4A16GemmParams const& p, ThreadPool& pool) {
  if (p.dtype == ScalarType::kBFloat16 || p.m < kTiledMinM) return false;
  bool done = false;
  // bf16 x never gets here (the caller checked); the discarded branch leaves st and asym unused.
  gemm_detail::dispatch_w4(p, [&](auto xt, [[maybe_unused]] auto st, [[maybe_unused]] auto asym) {
    if constexpr (!std::is_same_v<decltype(xt), BFloat16>) {
      W4Tiled<decltype(xt), decltype(st), asym> const kernel(p);
      if (!kernel.fits()) return;
      gemm_detail::run_tiles(kernel, p.m, p.n, p.k / 2, p.num_threads, pool);
      done = true;
    }
  });
  return done;
}

bool w8a16_tiled(W8A16GemmParams const& p, ThreadPool& pool) {
  if (p.m < kTiledMinM) return false;
  bool done = false;
  gemm_detail::dispatch_w8(p, [&](auto xt, auto st, auto fp8) {
    W8Tiled<decltype(xt), decltype(st), fp8> const kernel(p);
    if (!kernel.fits()) return;
    gemm_detail::run_tiles(kernel, p.m, p.n, p.k, p.num_threads, pool);
    done = true;
  });
  return done;
}

}  // namespace inflight::kernels::cpu::INFLIGHT_GEMM_ISA
