// FmaPanel: the batched form of gemm_impl.h's W8Fma and W4Fma (their bits, each weight dequantised once
// per panel of weight rows), instantiated over Vec512 by the AVX-512 files (gemm_avx512.h includes it
// after gemm_impl.h, inside the same per-ISA namespace).
#pragma once

#ifndef INFLIGHT_GEMM_ISA
#error "define INFLIGHT_GEMM_ISA (the per-ISA namespace) before including gemm_fma_panel_impl.h"
#endif

#include <algorithm>
#include <cstdint>

#include "gemm_impl.h"

namespace inflight::kernels::cpu::INFLIGHT_GEMM_ISA {

// ---- FmaPanel: the FMA kernels' arithmetic with each weight dequantised once -----------------------
//
// W8Fma dequantises every weight vector (q * scale) again for each tile of 4 x rows; W4Fma / W4Tiled
// (AVX-512 without BF16) redo their nibble lookups per M tile. From kFmaPanelMinM rows, each thread
// instead dequantises a panel of weight rows once into fp32 (the same products, in the order the
// kernel's lanes consume them) and converts a block of x rows once (widened; for int4 split into even
// and odd k per 2 W values, as W4Fma splits them), then runs DenseTile's 6 x 4 fp32 tile over both:
// each element gets the kernel's multiply-adds in the kernel's order (along k from 0, vector by
// vector, the same lane reduction), so the bits are W8Fma's / W4Fma's at any m. Against the kernels
// they replace on 2 Zen 4 threads (SmolLM2 / Gemma 3 shapes, interleaved calls): int8 at 16 rows
// 1.04-1.12x with fp32 x and 1.15-1.31x with bf16 x (against W8Fma before it widened x once per tile;
// the 576 x 49152 LM head included, once the next panel is prefetched as W8Fma prefetches its next
// tiles), 1.20-1.41x at 64; 8 rows 0.88-1.19x, 4 rows slower. int4 on AVX-512 without BF16, against
// W4Tiled (fp32 / fp16 x) and W4Fma (bf16 x): fp32 x 1.10x at 12 rows, 1.07-1.25x at 16-32,
// 1.26-1.34x at 64-256 (0.96x at 8); bf16 x 1.23-1.28x at 8 rows, 1.5-1.8x from 16; either way about
// the dense fp32 kernel's time.
// int8 with bf16 / fp16 x: W8Fma widens x once per tile of rows, and then beats the panels at 16 rows
// (the LM head: 1.08-1.10x) and matches them at 20-28 (same EPYC, alternating builds).
constexpr std::int64_t kFmaPanelMinM = 16;           // int8, fp32 x
constexpr std::int64_t kFmaPanelMinM16Bit = 24;      // int8, bf16 / fp16 x
constexpr std::int64_t kFmaPanelMinMInt4 = 12;       // int4, fp32 / fp16 x
constexpr std::int64_t kFmaPanelMinMInt4Bf16 = 8;    // int4, bf16 x
constexpr std::size_t kFmaPanelXBytes = 256 * 1024;  // converted x rows of one M block
constexpr std::size_t kFmaPanelBytes = 64 * 1024;    // dequantised weight rows of one panel (L2)

// int8 / E4M3 weights as W8Fma dequantises them: q * scale, in k order. ST: scale storage type.
template <class V, class ST, bool kFp8>
struct W8PanelFormat {
  using Params = W8A16GemmParams;
  static constexpr bool kSplitEvenOdd = false;
  static void dequantise(Params const& p, std::int64_t n0, std::int64_t rows, float* panel) {
    using Reg = typename V::Reg;
    std::int64_t const k_dim = p.k, groups = k_dim / p.group_size;
    int const g_size = p.group_size;
    for (std::int64_t r = 0; r < rows; ++r) {
      std::int64_t const row = std::min(n0 + r, p.n - 1);
      std::int8_t const* w = p.qweight + row * k_dim;
      ST const* sc = static_cast<ST const*>(p.scales) + row * groups;
      float* dst = panel + r * k_dim;
      for (std::int64_t g = 0; g < groups; ++g) {
        Reg const s = V::bcast(sc + g);
        for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += V::kWidth) {
          // The next panel's rows follow: fetch them ahead (W8Fma does the same for its next tiles).
          if (kb % 64 == 0) _mm_prefetch(reinterpret_cast<char const*>(w + rows * k_dim + kb), _MM_HINT_T0);
          V::store(dst + kb, V::mul(V::template w8<kFp8>(w + kb), s));
        }
      }
    }
  }
};

// int4 weights as W4Fma dequantises them: q * scale + offset (symmetric: q * scale - 8 scale) by one
// FMA, per 2 W weights the W of even k, then the W of odd k. ST: scale/offset storage type.
template <class V, class ST, bool kAsym>
struct W4PanelFormat {
  using Params = W4A16GemmParams;
  static constexpr bool kSplitEvenOdd = true;
  static void dequantise(Params const& p, std::int64_t n0, std::int64_t rows, float* panel) {
    using Reg = typename V::Reg;
    constexpr int W = V::kWidth;
    std::int64_t const k_dim = p.k, groups = k_dim / p.group_size;
    int const g_size = p.group_size;
    Reg const minus8 = V::set1(-8.0f);
    for (std::int64_t r = 0; r < rows; ++r) {
      std::int64_t const row = std::min(n0 + r, p.n - 1);
      std::uint8_t const* w = p.qweight + row * (k_dim / 2);
      ST const* sc = static_cast<ST const*>(p.scales) + row * groups;
      float* dst = panel + r * k_dim;
      for (std::int64_t g = 0; g < groups; ++g) {
        Reg const s = V::bcast(sc + g);
        Reg const of = kAsym ? V::bcast(static_cast<ST const*>(p.offsets) + row * groups + g) : V::mul(s, minus8);
        for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += 2 * W) {
          if (kb % 128 == 0) _mm_prefetch(reinterpret_cast<char const*>(w + rows * (k_dim / 2) + kb / 2), _MM_HINT_T0);
          Reg ql, qh;
          V::nibbles(w + kb / 2, ql, qh);
          V::store(dst + kb, V::fmadd(ql, s, of));
          V::store(dst + kb + W, V::fmadd(qh, s, of));
        }
      }
    }
  }
};

// V: vector traits; XT: x/out storage type; F: the weight format (W8PanelFormat / W4PanelFormat).
template <class V, class XT, class F>
struct FmaPanel {
  using Reg = typename V::Reg;
  static constexpr int W = V::kWidth;
  static constexpr int kNR = 4;
  static constexpr int kMaxMR = 6;
  static_assert(kMaxMR * kNR + kMaxMR + 1 <= V::kRegs, "register tile does not fit the vector registers");
  typename F::Params const& p;

  template <int MR>
  void run(float const* panel, float const* x, std::int64_t m0, std::int64_t n0) const {
    std::int64_t const k_dim = p.k;
    float const* w[kNR];
#pragma GCC unroll 8
    for (int r = 0; r < kNR; ++r) w[r] = panel + r * k_dim;
    Reg acc[MR][kNR];
    zero_tile<V>(acc);
    for (std::int64_t kk = 0; kk < k_dim; kk += W) {
      Reg xv[MR];
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) xv[i] = V::load(x + i * k_dim + kk);
#pragma GCC unroll 8
      for (int r = 0; r < kNR; ++r) {
        Reg const wv = V::load(w[r] + kk);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) acc[i][r] = V::fmadd(wv, xv[i], acc[i][r]);
      }
    }
    store_quant_tile<V, XT>(acc, p, m0, n0);
  }

  // Rows [0, rows) of x from row mb into dst as fp32: widened, and for int4 split per 2 W values
  // into the W of even k, then the W of odd k.
  void convert_x(std::int64_t mb, std::int64_t rows, float* dst) const {
    XT const* x = static_cast<XT const*>(p.x) + mb * p.k;
    std::int64_t const count = rows * p.k;
    if constexpr (F::kSplitEvenOdd) {
      for (std::int64_t j = 0; j < count; j += 2 * W) {
        Reg even, odd;
        V::deinterleave(V::load(x + j), V::load(x + j + W), even, odd);
        V::store(dst + j, even);
        V::store(dst + j + W, odd);
      }
    } else {
      for (std::int64_t j = 0; j < count; j += W) V::store(dst + j, V::load(x + j));
    }
  }

  // Rows of x per M block (converted once; fp32 x without the int4 split is read in place) and weight
  // tiles per panel (dequantised once, in L2).
  static constexpr bool kConvert = F::kSplitEvenOdd || !std::is_same_v<XT, float>;
  std::int64_t row_bytes() const { return p.k * static_cast<std::int64_t>(sizeof(float)); }
  std::int64_t block() const {
    return kConvert ? std::max<std::int64_t>(kMaxMR, std::min<std::int64_t>(p.m, kFmaPanelXBytes / row_bytes())) : p.m;
  }
  std::int64_t panel_tiles() const { return std::max<std::int64_t>(1, kFmaPanelBytes / (kNR * row_bytes())); }
  std::size_t x_bytes() const { return kConvert ? static_cast<std::size_t>(block() * row_bytes()) : 0; }
  std::size_t scratch_bytes() const { return x_bytes() + static_cast<std::size_t>(panel_tiles() * kNR * row_bytes()); }

  // One thread's share: N tiles [t0, t1): per M block its x rows are converted once, per panel the
  // weight rows dequantised once, and every M tile of the block walks the panel.
  void run_range(std::int64_t t0, std::int64_t t1, unsigned char* buf) const {
    std::int64_t const k_dim = p.k;
    std::int64_t const block = this->block(), panel_tiles = this->panel_tiles();
    std::size_t const x_bytes = this->x_bytes();
    float* panel = reinterpret_cast<float*>(buf + x_bytes);
    for (std::int64_t mb = 0; mb < p.m; mb += block) {
      std::int64_t const rows = std::min(block, p.m - mb);
      float const* xf = nullptr;
      if constexpr (kConvert) {
        convert_x(mb, rows, reinterpret_cast<float*>(buf));
        xf = reinterpret_cast<float const*>(buf);
      } else {
        xf = static_cast<float const*>(p.x) + mb * k_dim;
      }
      for (std::int64_t pt = t0; pt < t1; pt += panel_tiles) {
        std::int64_t const pt1 = std::min(t1, pt + panel_tiles);
        F::dequantise(p, pt * kNR, (pt1 - pt) * kNR, panel);
        for (std::int64_t m0 = 0; m0 < rows; m0 += kMaxMR) {
          int const mr = static_cast<int>(std::min<std::int64_t>(kMaxMR, rows - m0));
          for (std::int64_t t = pt; t < pt1; ++t) {
            dispatch_mr<kMaxMR>(*this, mr, panel + (t - pt) * kNR * k_dim, xf + m0 * k_dim, mb + m0, t * kNR);
          }
        }
      }
    }
  }
};

// W8Fma's bits from kFmaPanelMinM rows (16-bit x: kFmaPanelMinM16Bit) as FmaPanel; false (nothing
// run) below.
template <class V>
bool w8a16_fma_panels(W8A16GemmParams const& p, ThreadPool& pool) {
  if (p.m < (p.dtype == ScalarType::kFloat32 ? kFmaPanelMinM : kFmaPanelMinM16Bit)) return false;
  gemm_detail::dispatch_w8(p, [&](auto xt, auto st, auto fp8) {
    using Kernel = FmaPanel<V, decltype(xt), W8PanelFormat<V, decltype(st), fp8>>;
    gemm_detail::run_thread_ranges(Kernel{p}, p.n, gemm_detail::row_bytes(p), p.num_threads, pool);
  });
  return true;
}

// W4Fma's bits from kFmaPanelMinMInt4(Bf16) rows (FmaPanel); false (nothing run) below.
template <class V>
bool w4a16_fma_panels(W4A16GemmParams const& p, ThreadPool& pool) {
  if (p.m < (p.dtype == ScalarType::kBFloat16 ? kFmaPanelMinMInt4Bf16 : kFmaPanelMinMInt4)) return false;
  gemm_detail::dispatch_w4(p, [&](auto xt, auto st, auto asym) {
    using Kernel = FmaPanel<V, decltype(xt), W4PanelFormat<V, decltype(st), asym>>;
    gemm_detail::run_thread_ranges(Kernel{p}, p.n, gemm_detail::row_bytes(p), p.num_threads, pool);
  });
  return true;
}

}  // namespace inflight::kernels::cpu::INFLIGHT_GEMM_ISA
