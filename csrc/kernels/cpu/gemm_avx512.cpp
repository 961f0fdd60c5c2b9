// AVX-512 (F/BW/VL/DQ + BF16) paths of the W4A16 and W8A16 GEMMs: which strategy runs (gemm_avx512.h
// lists them), and the two that are gemm_impl.h's algorithms over 16-lane vectors. Compiled with
// AVX-512 flags; called only when selected_isa() is kAvx512.
//
// Register tiles: MR rows of x by kNR weight rows, one 16-lane fp32 accumulator per (m, n) pair, summed
// across lanes once at the end; loaded x vectors are reused by the kNR weight rows and dequantised
// weight vectors by the MR x rows.
//
//  - int4: decode (fp32 x: one row) and bf16 x through W4Dot (bf16-exact nibbles, VDPBF16PS); batched fp32 /
//    fp16 x through the tiled FMA kernels (VPERMPS lookup), from 12 rows through FmaPanel (the same bits); batched bf16
//    x through bf16 panels and the dense kernel. Rows too long for W4Dot's buffer (k beyond ~16K): W4Fma (fp32 / fp16
//    x) and W4Bf16Dot (bf16 x).
//  - int8: batched bf16 x through panels, other batches tiled, decode through W8Fma (one x row scales
//    each group's sum once, several rows dequantise each weight vector once).
//  - batch invariant (the default, cpu_features.h): the decode kernels' arithmetic at every m, so that
//    no result depends on m: int4 through W4Dot, from 16 rows (bf16 x: 64) as W4DotPanel (the same
//    operations per element, the nibbles dequantised once per panel; W4Bf16Dot / W4Fma for rows too
//    long for them), int8 through W8Fma, from 16 rows as FmaPanel (gemm_fma_panel_impl.h: the same operations
//    per element, each weight dequantised once per panel), no bf16 panels and no tiles.
#include "gemm_avx512.h"

namespace inflight::kernels::cpu {

using gemm_avx512::Vec512;

void w4a16_gemm_avx512(W4A16GemmParams const& p, ThreadPool& pool) {
  if (batch_invariant()) {
    // One arithmetic per x dtype and shape of the weights, whatever m: W4Dot's (its tiles of 1 to 3
    // rows sum each element alike; W4DotPanel, for many rows, sums them as W4Dot does), the decode
    // kernel, so one row costs what it did; rows too long for its buffer take W4Bf16Dot (bf16 x) or
    // W4Fma at every m. The fp32 FMA family (W4Fma, W4Tiled, FmaPanel) is m-invariant too (a row's bits
    // equal at m = 1..300) and 1.24-1.29x W4DotPanel's speed from 16 rows, but one row through it
    // (W4Tiled) took 1.5-1.7x W4Dot's time over SmolLM2's 30 layers (Zen 4, 2 threads): the decode
    // would pay for the batches, so W4Dot's arithmetic stays the invariant one.
    if (gemm_avx512::w4a16_dot_panels(p, pool) || gemm_avx512::w4a16_dot(p, pool)) return;
    if (p.dtype == ScalarType::kBFloat16) {
      gemm_avx512::w4a16_bf16_dot(p, pool);
      return;
    }
  } else {
    // fp32 / fp16 x from 12 rows: W4Fma's products dequantised once per panel (FmaPanel, gemm_fma_panel_impl.h),
    // the bits of the tiles below it and 1.07-1.34x their speed.
    bool const fma_panel = p.dtype != ScalarType::kBFloat16 && gemm_avx512::w4a16_fma_panels<Vec512>(p, pool);
    if (fma_panel || gemm_avx512::w4a16_panels(p, pool) || gemm_avx512::w4a16_tiled(p, pool) ||
        gemm_avx512::w4a16_dot(p, pool)) {
      return;
    }
    // Rows too long for the scratch buffers: the in-register kernels, no reordering.
    if (p.dtype == ScalarType::kBFloat16) {
      gemm_avx512::w4a16_bf16_dot(p, pool);
      return;
    }
  }
  // bf16 x never gets here (the caller checked); the discarded branch leaves st and asym unused.
  gemm_detail::dispatch_w4(p, [&](auto xt, [[maybe_unused]] auto st, [[maybe_unused]] auto asym) {
    if constexpr (!std::is_same_v<decltype(xt), BFloat16>) {
      gemm_detail::run_tiles(gemm_avx512::W4Fma<Vec512, decltype(xt), decltype(st), asym>{p}, p.m, p.n, p.k / 2,
                             p.num_threads, pool);
    }
  });
}

void w8a16_gemm_avx512(W8A16GemmParams const& p, ThreadPool& pool) {
  // Batch invariance: W8Fma dequantising each weight vector at every m, 4 rows per tile (no bf16
  // panels, which round the weights to bf16, and no tiles, which round otherwise).
  bool const invariant = batch_invariant();
  if (!invariant && (gemm_avx512::w8a16_panels(p, pool) || gemm_avx512::w8a16_tiled(p, pool))) return;
  if (invariant && gemm_avx512::w8a16_fma_panels<Vec512>(p, pool)) return;  // W8Fma's bits, m >= 16 (16-bit x: 24)
  // Decode, and bf16 x below the panels' rows (widened to fp32 exactly).
  gemm_detail::dispatch_w8(p, [&](auto xt, auto st, auto fp8) {
    gemm_detail::run_tiles(gemm_avx512::W8Fma<Vec512, decltype(xt), decltype(st), fp8>{p, invariant}, p.m, p.n, p.k,
                           p.num_threads, pool);
  });
}

}  // namespace inflight::kernels::cpu
