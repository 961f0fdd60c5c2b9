// The FMA GEMM algorithms, written once over a vector-traits class V and instantiated per ISA: the
// memory-bound decode kernels of int4 (W4Fma) and int8 (W8Fma) weights, the dense register tile
// (DenseTile), and the epilogue every vector kernel shares (store_tile). gemm_avx2.cpp instantiates
// them with V = Vec256, the AVX-512 files (gemm_avx512.h) with V = Vec512; the AVX-512-only strategies
// (VDPBF16PS dot products, VPERMPS / VPERMW lookups, bf16 panels) use the same epilogue and addressing.
//
// Every TU that includes this header defines INFLIGHT_GEMM_ISA (a namespace name) first: all code here
// lives in that per-ISA namespace, so an inline function compiled with -mavx512f in one TU can never be
// picked by the linker for a TU that must run without AVX-512.
//
// V provides (Reg: one fp32 vector of kWidth lanes):
//   Reg, kWidth, kRegs (vector registers)
//   kW4Rows, kW4MaxMR, kW8Rows, kW8MaxMR   register tiles of W4Fma / W8Fma (weight rows x x rows)
//   kW8GroupSums     W8Fma with one x row sums q * x per group and scales once (prefetching ahead)
//   zero, set1, mul, fmadd(a, b, c) = a * b + c
//   load(T const*)          kWidth values of T (float, BFloat16, Float16) widened to fp32
//   store(float*, Reg)      kWidth fp32 values (FmaPanel's buffers, W8Fma's widened x)
//   load_tail(T const*, n)  the first n < kWidth of them, zeros after; reads nothing past them
//   bcast(T const*)         one value of T, widened and broadcast
//   int8(int8_t const*)     kWidth int8 weights as fp32
//   nibbles(uint8_t const*, Reg& lo, Reg& hi)  kWidth bytes: their low and high nibbles as fp32
//   kW4Lookup, w4_table, w4_lookup  (optional) W4Fma's dequantisation as a 16-entry table lookup
//   deinterleave(a, b, Reg& even, Reg& odd)    of the 2 kWidth values a | b: even and odd elements
//   reduce4(a, b, c, d) -> __m128              lane j: the sum of all lanes of the j-th argument
//   reduce4_dense                              the same sums in DenseTile's lane order
//   load4(T const*, int n) / store4(T*, int n, __m128)  the first n <= 4 values, as fp32 / rounded to T
//                                              (nearest even, as from_float); the others untouched
//   DenseStep<T>            DenseTile's step along K for storage type T (FmaStep below, or the ISA's own)
#pragma once

#ifndef INFLIGHT_GEMM_ISA
#error "define INFLIGHT_GEMM_ISA (the per-ISA namespace) before including gemm_impl.h"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "dense_gemm.h"
#include "gemm.h"

namespace inflight::kernels::cpu::INFLIGHT_GEMM_ISA {

using gemm_detail::dispatch_mr;
using gemm_detail::QuantTile;

// Software prefetch distance, in N tiles: the next tiles' rows follow this tile's in memory, and the
// hardware prefetcher alone leaves a single thread well below the memory bandwidth.
constexpr int kPrefetchTiles = 2;

// Register tiles live in arrays indexed by constants only after full unrolling; without it GCC keeps
// them in memory (a load and store per FMA), hence the unroll pragmas and always_inline.
template <class V, int MR, int kNR>
[[gnu::always_inline]] inline void zero_tile(typename V::Reg (&acc)[MR][kNR]) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < kNR; ++r) acc[i][r] = V::zero();
}

// The epilogue: out[i * ldo + r] = sum of acc[i][r]'s lanes + bias[n0 + r], rounded once to T, for the
// rows n0 + r < n; out points at (m0, n0). Four weight rows at a time (a last group of fewer is padded
// with zeros, which the lane sums of the others never see). V: vector traits; MR x kNR: the tile; T:
// storage type of out and bias; kReduce: V::reduce4, or the lane order of another kernel.
template <class V, int MR, int kNR, class T,
          __m128 (*kReduce)(typename V::Reg, typename V::Reg, typename V::Reg, typename V::Reg) = &V::reduce4>
[[gnu::always_inline]] inline void store_tile(typename V::Reg const (&acc)[MR][kNR], T* out, std::int64_t ldo,
                                              T const* bias, std::int64_t n0, std::int64_t n) {
  using Reg = typename V::Reg;
#pragma GCC unroll 4
  for (int r = 0; r < kNR; r += 4) {
    // Rows of these four in the tile and below n (a neighbouring tile, maybe another thread's, owns the rest).
    int const valid = static_cast<int>(std::min<std::int64_t>(std::min(4, kNR - r), n - n0 - r));
    if (valid <= 0) break;
    // -0 is the additive identity (+0 would turn a -0 sum into +0).
    __m128 const b = bias != nullptr ? V::load4(bias + n0 + r, valid) : _mm_set1_ps(-0.0f);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      auto const at = [&](int j) { return r + j < kNR ? acc[i][r + j] : V::zero(); };
      Reg const a = acc[i][r], b1 = at(1), b2 = at(2), b3 = at(3);
      V::store4(out + i * ldo + r, valid, _mm_add_ps(kReduce(a, b1, b2, b3), b));
    }
  }
}

// A quantised kernel's tile (m0, n0) into p.out (row stride n). XT: storage type of out and bias.
template <class V, class XT, int MR, int kNR, class Params>
[[gnu::always_inline]] inline void store_quant_tile(typename V::Reg const (&acc)[MR][kNR], Params const& p,
                                                    std::int64_t m0, std::int64_t n0) {
  store_tile<V>(acc, static_cast<XT*>(p.out) + m0 * p.n + n0, p.n, static_cast<XT const*>(p.bias), n0, p.n);
}

// ---- W4Fma: int4 weights, fp32 FMA -------------------------------------------------------------------
//
// Nibbles -> fp32 in registers, w = q * scale + offset by one FMA (symmetric: q * scale - 8 * scale,
// which rounds the exact scale * (q - 8) once, like the reference); x is split into even and odd k to
// match the low and high nibbles of kWidth weight bytes. Exact fp32 math on exactly dequantised
// weights. V: vector traits; XT: x/out storage type; ST: scale/offset storage type; kAsym: offsets given.
// The rows kPrefetchTiles tiles on are prefetched (the tile reads its kNR rows interleaved, which alone
// left one x row waiting on memory), and with V::kW4Lookup (AVX-512) the FMA runs once per row and
// group on q = 0..15 and each weight is a table lookup (the same values). 2 Zen 4 threads, SmolLM2's
// shapes, alternating builds: on AVX-512 without BF16 (INFLIGHT_CPU_ISA=avx512f) one row 1.3-1.4x
// with fp32 x and 1.2x with bf16 x (the prefetch most of it, the lookup 0-8 %), 2-4 rows 1.0-1.1x; on
// AVX2 (prefetch only) one row 1.3x with fp32 x and 1.2x with bf16 x, 2 rows 1.2x, 4 rows 1.1x.
template <class V, class XT, class ST, bool kAsym>
struct W4Fma {
  using Reg = typename V::Reg;
  static constexpr int W = V::kWidth;
  static constexpr int kNR = V::kW4Rows;      // weight rows per tile
  static constexpr int kMaxMR = V::kW4MaxMR;  // x rows per tile
  // The accumulators, 2 split x vectors per x row, two weight vectors and their scale and offset.
  static_assert(kMaxMR * kNR + 2 * kMaxMR + 4 <= V::kRegs, "register tile does not fit");
  W4A16GemmParams const& p;

  void tile(int mr, std::int64_t m0, std::int64_t n0) const { dispatch_mr<kMaxMR>(*this, mr, m0, n0); }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n0) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    QuantTile<kNR, ST, kAsym, W4A16GemmParams> const t(p, n0);
    XT const* x = static_cast<XT const*>(p.x) + m0 * k_dim;
    Reg acc[MR][kNR];
    zero_tile<V>(acc);
    Reg const minus8 = V::set1(-8.0f);
    std::int64_t const ahead = kPrefetchTiles * kNR * (k_dim / 2);  // bytes to the rows kPrefetchTiles on
    for (std::int64_t g = 0; g < groups; ++g) {
      // 2 W weights of a row are W bytes: byte j holds k = 2j (low nibble) and 2j + 1 (high).
      for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += 2 * W) {
        Reg xe[MR], xo[MR];
        for (int i = 0; i < MR; ++i)
          V::deinterleave(V::load(x + i * k_dim + kb), V::load(x + i * k_dim + kb + W), xe[i], xo[i]);
        for (int r = 0; r < kNR; ++r) {
          Reg const sc = V::bcast(t.s[r] + g);
          Reg const of = kAsym ? V::bcast(t.o[r] + g) : V::mul(sc, minus8);
          Reg wl, wh;
          if (kb % 128 == 0) _mm_prefetch(reinterpret_cast<char const*>(t.w[r] + ahead + kb / 2), _MM_HINT_T0);
          if constexpr (requires { V::kW4Lookup; }) {
            V::w4_lookup(t.w[r] + kb / 2, V::w4_table(sc, of), wl, wh);
          } else {
            Reg ql, qh;
            V::nibbles(t.w[r] + kb / 2, ql, qh);
            wl = V::fmadd(ql, sc, of);
            wh = V::fmadd(qh, sc, of);
          }
          for (int i = 0; i < MR; ++i) {
            acc[i][r] = V::fmadd(wl, xe[i], acc[i][r]);
            acc[i][r] = V::fmadd(wh, xo[i], acc[i][r]);
          }
        }
      }
    }
    store_quant_tile<V, XT>(acc, p, m0, n0);
  }
};

// ---- W8Fma: int8 weights, fp32 FMA -------------------------------------------------------------------
//
// Sign-extend kWidth bytes, convert, multiply by the group's scale: each dequantised weight vector is
// reused by the MR x rows. With V::kW8GroupSums one x row instead sums q * x over the group and scales
// the sum once (a multiply per weight vector saved), prefetching the next tiles' rows ahead. V: vector
// traits; XT: x/out storage type; ST: scale storage type.
template <class V, class XT, class ST, bool kFp8 = false>
struct W8Fma {
  using Reg = typename V::Reg;
  static constexpr int W = V::kWidth;
  static constexpr int kNR = V::kW8Rows;      // weight rows per tile
  static constexpr int kMaxMR = V::kW8MaxMR;  // x rows per tile
  static_assert(kMaxMR * kNR + kMaxMR + kNR + 1 <= V::kRegs, "register tile does not fit");
  W8A16GemmParams const& p;
  // Batch invariance (cpu_features.h): every x row, whatever the tile, dequantises each weight vector
  // (q * scale rounded to fp32, as W8Tiled does) and multiply-adds it with x, so that a row rounds as
  // it does alone. Otherwise a single x row (V::kW8GroupSums) sums q * x over each group and scales
  // the sum once (a multiply per weight vector saved).
  bool invariant = false;

  // bf16 / fp16 x is widened to fp32 once per M tile into the thread's scratch (prepare), because the
  // thin tiles below read each x vector once per weight row: a one-row int8 GEMV with bf16 x spent
  // ~40 % more time than with fp32 x (the 576 x 49152 LM head on 2 Zen 4 threads: 1.34 against 0.95
  // ms). Widened (alternating builds, batch-invariant): 1.2x at 1 row, 1.5x at 2, 1.2x at 4 and 8;
  // the one-row group sums 1.3-1.4x. Widening is exact, so the bits are the same. Rows too long for
  // the scratch read x as it is.
  static constexpr bool kWiden = !std::is_same_v<XT, float>;
  static constexpr std::size_t kScratchBytes = kWiden ? 64 * 1024 : 0;
  bool widens() const { return kWiden && static_cast<std::size_t>(p.k) * sizeof(float) <= kScratchBytes; }

  int max_mr() const {
    if (!widens()) return kMaxMR;
    return static_cast<int>(std::min<std::int64_t>(kMaxMR, kScratchBytes / (sizeof(float) * p.k)));
  }

  void prepare(int mr, std::int64_t m0, void* scratch) const {
    if (!widens()) return;
    std::int64_t const n = mr * p.k;  // k is a multiple of W (whole groups of whole vectors)
    XT const* x = static_cast<XT const*>(p.x) + m0 * p.k;
    float* dst = static_cast<float*>(scratch);
    for (std::int64_t j = 0; j < n; j += W) V::store(dst + j, V::load(x + j));
  }

  void tile(int mr, std::int64_t m0, std::int64_t n0) const {
    dispatch_mr<kMaxMR>(*this, mr, m0, n0, static_cast<XT const*>(p.x) + m0 * p.k);
  }
  void tile(int mr, std::int64_t m0, std::int64_t n0, void const* scratch) const {
    if (widens()) {
      dispatch_mr<kMaxMR>(*this, mr, m0, n0, static_cast<float const*>(scratch));
    } else {
      tile(mr, m0, n0);
    }
  }

  // Thin tiles walk their weight rows one after another, each row whole (one sequential stream the
  // hardware prefetcher follows: ~1.5x the bandwidth of interleaving the kNR rows, measured with one
  // x row on Zen 4), with one prefetch per 64 bytes kPrefetchTiles tiles ahead. Each (x row, weight
  // row) pair sums in the same order as in the interleaved tile, so results do not depend on MR.
  static constexpr int kRowByRowMR = 2;

  // The group-sum tile of one x row: per weight row, sum q * x over each group (kVecs vectors, or
  // g_size / W when 0), then add the sum times the group's scale.
  template <int kVecs, class XL>
  [[gnu::always_inline]] inline void group_sums(QuantTile<kNR, ST, false, W8A16GemmParams> const& t, XL const* x,
                                                Reg (&acc)[1][kNR]) const {
    std::int64_t const k_dim = p.k;
    int const g_size = kVecs > 0 ? kVecs * W : p.group_size;
    std::int64_t const groups = k_dim / g_size;
    std::int64_t const ahead = kPrefetchTiles * kNR * k_dim;
#pragma GCC unroll 1
    for (int r = 0; r < kNR; ++r) {
      std::int8_t const* w = t.w[r];
      ST const* sc = t.s[r];
      Reg a = V::zero();
      for (std::int64_t g = 0; g < groups; ++g) {
        std::int64_t const k0 = g * g_size;
        Reg gacc = V::zero();
        auto const step = [&](std::int64_t kb) [[gnu::always_inline]] {
          if (kb % 64 == 0) _mm_prefetch(reinterpret_cast<char const*>(w + ahead + kb), _MM_HINT_T0);
          gacc = V::fmadd(V::template w8<kFp8>(w + kb), V::load(x + kb), gacc);
        };
        if constexpr (kVecs > 0) {
#pragma GCC unroll 8
          for (int v = 0; v < kVecs; ++v) step(k0 + v * W);
        } else {
          for (std::int64_t kb = k0; kb < k0 + g_size; kb += W) step(kb);
        }
        a = V::fmadd(gacc, V::bcast(sc + g), a);
      }
      acc[0][r] = a;
    }
  }

  // The dequantising tile of MR <= kRowByRowMR x rows, row by row: per weight row, each weight vector
  // times its group's scale, multiply-added with every x row.
  template <int MR, class XL>
  [[gnu::always_inline]] inline void row_by_row(QuantTile<kNR, ST, false, W8A16GemmParams> const& t, XL const* x,
                                                Reg (&acc)[MR][kNR]) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    std::int64_t const ahead = kPrefetchTiles * kNR * k_dim;
#pragma GCC unroll 1
    for (int r = 0; r < kNR; ++r) {
      std::int8_t const* w = t.w[r];
      Reg a[MR];
#pragma GCC unroll 2
      for (int i = 0; i < MR; ++i) a[i] = V::zero();
      for (std::int64_t g = 0; g < groups; ++g) {
        Reg const sc = V::bcast(t.s[r] + g);
        for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += W) {
          if (kb % 64 == 0) _mm_prefetch(reinterpret_cast<char const*>(w + ahead + kb), _MM_HINT_T0);
          Reg const wv = V::mul(V::template w8<kFp8>(w + kb), sc);
#pragma GCC unroll 2
          for (int i = 0; i < MR; ++i) a[i] = V::fmadd(wv, V::load(x + i * k_dim + kb), a[i]);
        }
      }
#pragma GCC unroll 2
      for (int i = 0; i < MR; ++i) acc[i][r] = a[i];
    }
  }

  // x: the tile's MR rows (k apart), as XT or widened to fp32.
  template <int MR, class XL>
  void run(std::int64_t m0, std::int64_t n0, XL const* x) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    QuantTile<kNR, ST, false, W8A16GemmParams> const t(p, n0);
    Reg acc[MR][kNR];
    zero_tile<V>(acc);
    if constexpr (MR == 1 && V::kW8GroupSums) {
      if (!invariant) {
        if (g_size == 2 * W) {
          group_sums<2>(t, x, acc);
        } else if (g_size == 4 * W) {
          group_sums<4>(t, x, acc);
        } else {
          group_sums<0>(t, x, acc);
        }
        store_quant_tile<V, XT>(acc, p, m0, n0);
        return;
      }
    }
    if constexpr (MR <= kRowByRowMR) {
      row_by_row<MR>(t, x, acc);
      store_quant_tile<V, XT>(acc, p, m0, n0);
      return;
    }
    std::int64_t const ahead = kPrefetchTiles * kNR * k_dim;
    for (std::int64_t g = 0; g < groups; ++g) {
      Reg sc[kNR];
#pragma GCC unroll 4
      for (int r = 0; r < kNR; ++r) sc[r] = V::bcast(t.s[r] + g);
      for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += W) {
        if (kb % 64 == 0) {
#pragma GCC unroll 4
          for (int r = 0; r < kNR; ++r) _mm_prefetch(reinterpret_cast<char const*>(t.w[r] + ahead + kb), _MM_HINT_T0);
        }
        Reg xv[MR];
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) xv[i] = V::load(x + i * k_dim + kb);
#pragma GCC unroll 4
        for (int r = 0; r < kNR; ++r) {
          Reg const wv = V::mul(V::template w8<kFp8>(t.w[r] + kb), sc[r]);
#pragma GCC unroll 4
          for (int i = 0; i < MR; ++i) acc[i][r] = V::fmadd(wv, xv[i], acc[i][r]);
        }
      }
    }
    store_quant_tile<V, XT>(acc, p, m0, n0);
  }
};

// ---- DenseTile: unquantised weights ------------------------------------------------------------------
//
// MR rows of x by kNR weight rows, one fp32 accumulator per pair; each step along K loads MR x vectors
// (reused by the kNR weight rows) and kNR weight vectors (reused by the MR x rows). The K tail is one
// step of load_tail (zeros past k add nothing).

// The default step along K: kWidth values widened to fp32, multiplied and added by FMA. V: vector
// traits; T: storage type of x and weight.
template <class V, class T>
struct FmaStep {
  using Vec = typename V::Reg;
  static constexpr int kStep = V::kWidth;
  static Vec load(T const* p) { return V::load(p); }
  static Vec load_tail(T const* p, std::int64_t left) { return V::load_tail(p, left); }
  static typename V::Reg madd(typename V::Reg acc, Vec w, Vec x) { return V::fmadd(w, x, acc); }
};

// V: vector traits; T: storage type of x, weight, bias and out; kNR_: weight rows per tile; kMaxMR_: x
// rows per tile (kMaxMR_ x kNR_ accumulators + kMaxMR_ x vectors + one weight vector in registers).
template <class V, class T, int kNR_, int kMaxMR_>
struct DenseTile {
  using Reg = typename V::Reg;
  using Step = typename V::template DenseStep<T>;
  using Vec = typename Step::Vec;
  static constexpr int kNR = kNR_;
  static constexpr int kMaxMR = kMaxMR_;
  static_assert(kMaxMR * kNR + kMaxMR + 1 <= V::kRegs, "register tile does not fit the vector registers");
  DenseGemmParams const& p;

  // Rows of x per M tile: m split into as few tiles as kMaxMR allows, of near-equal sizes (m = 8 as
  // 4 + 4, not 6 + 2: a thin tile loads as many weight vectors for fewer multiply-adds).
  int max_mr() const {
    std::int64_t const tiles = (p.m + kMaxMR - 1) / kMaxMR;
    return static_cast<int>(std::max<std::int64_t>(1, (p.m + tiles - 1) / tiles));
  }

  void tile(int mr, std::int64_t m0, std::int64_t n0) const { dispatch_mr<kMaxMR>(*this, mr, m0, n0); }

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
    Reg acc[MR][kNR];
    zero_tile<V>(acc);
    std::int64_t const k_main = k_dim - k_dim % Step::kStep;
    std::int64_t const ahead = kPrefetchTiles * kNR * k_dim;
    // One prefetch per 64-byte line of each row. They go to L2 (T1), not L1: an L1 prefetch holds one
    // of the core's few L1 miss buffers until the line arrives, which caps the loads in flight; L2
    // tracks many more (Zen 4, one thread, m = 1 from DRAM: ~1.7x the bandwidth of T0 prefetches).
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
    std::int64_t const ldo = p.out_row_stride > 0 ? p.out_row_stride : p.n;
    store_tile<V, MR, kNR, T, &V::reduce4_dense>(acc, static_cast<T*>(p.out) + m0 * ldo + n0, ldo,
                                                 static_cast<T const*>(p.bias), n0, p.n);
  }
};

// Runs the dense GEMM with the register tile DenseTile<V, T, kNR, kMaxMR> for every dtype.
template <class V, int kNR, int kMaxMR>
void run_dense(DenseGemmParams const& p, ThreadPool& pool) {
  dispatch_float_type(p.dtype, [&](auto t) {
    using T = decltype(t);
    gemm_detail::run_tiles(DenseTile<V, T, kNR, kMaxMR>{p}, p.m, p.n, p.k * static_cast<std::int64_t>(sizeof(T)),
                           p.num_threads, pool);
  });
}

}  // namespace inflight::kernels::cpu::INFLIGHT_GEMM_ISA
