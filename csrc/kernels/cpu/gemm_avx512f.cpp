// AVX-512 without BF16 (Isa::kAvx512F: F/BW/VL/DQ + FMA): the W4A16, W8A16 and dense GEMMs over 16-lane
// fp32 vectors. gemm_avx512.h's Vec512 and the tiled strategy (gemm_tiled_impl.h) need no BF16, so they
// are the same code as the BF16 build's, compiled here in namespace gemm_avx512f; the BF16-only
// strategies (bf16 panels, VDPBF16PS dot products) are replaced by gemm_impl.h's FMA kernels.
// Compiled with AVX-512 F/BW/VL/DQ flags; called only when selected_isa() is kAvx512F.
//
//  - int4, from 12 rows (bf16 x: 8): FmaPanel (gemm_fma_panel_impl.h: W4Fma's products dequantised once per
//    panel of weight rows into fp32, then DenseTile's 6 x 4 tile; W4Fma's bits).
//  - int4 / int8, batched fp32 / fp16 x (int8: any x): the tiled kernels (8 x rows by 3 weight rows);
//    int8 under batch invariance: FmaPanel from 16 rows (W8Fma's bits), W8Fma below.
//  - int4 decode and bf16 x: W4Fma (a 16-entry table lookup per weight, 4 weight rows x 4 x rows).
//  - int8 decode: W8Fma (one x row scales each group's sum once).
//  - dense: DenseTile, bf16 widened to fp32 on load.
#define INFLIGHT_AVX512F_ONLY 1
#include "gemm_avx512.h"
#include "gemm_tiled_impl.h"

#include "dense_gemm.h"

namespace inflight::kernels::cpu {

using gemm_avx512f::Vec512;

void w4a16_gemm_avx512f(W4A16GemmParams const& p, ThreadPool& pool) {
  // W4Fma's bits at every m (batch-invariant in both modes): FmaPanel from 12 rows (bf16 x: 8), the
  // tiles below (fp32 / fp16 x), W4Fma at one row and for bf16 x.
  if (gemm_avx512f::w4a16_fma_panels<Vec512>(p, pool)) return;
  if (gemm_avx512f::w4a16_tiled(p, pool)) return;
  gemm_detail::dispatch_w4(p, [&](auto xt, auto st, auto asym) {
    gemm_detail::run_tiles(gemm_avx512f::W4Fma<Vec512, decltype(xt), decltype(st), asym>{p}, p.m, p.n, p.k / 2,
                           p.num_threads, pool);
  });
}

void w8a16_gemm_avx512f(W8A16GemmParams const& p, ThreadPool& pool) {
  // Batch invariance: W8Fma dequantising each weight vector at every m (the tiles round otherwise).
  bool const invariant = batch_invariant();
  if (!invariant && gemm_avx512f::w8a16_tiled(p, pool)) return;
  if (invariant && gemm_avx512f::w8a16_fma_panels<Vec512>(p, pool)) return;  // W8Fma's bits, m >= 16 (16-bit x: 24)
  gemm_detail::dispatch_w8(p, [&](auto xt, auto st, auto fp8) {
    gemm_detail::run_tiles(gemm_avx512f::W8Fma<Vec512, decltype(xt), decltype(st), fp8>{p, invariant}, p.m, p.n, p.k,
                           p.num_threads, pool);
  });
}

// The tiles of dense_gemm_avx512.cpp (8 weight rows streamed for one x row; 4 x 6 otherwise).
void dense_gemm_avx512f(DenseGemmParams const& p, ThreadPool& pool) {
  if (p.m == 1) {
    gemm_avx512f::run_dense<Vec512, 8, 1>(p, pool);
  } else {
    gemm_avx512f::run_dense<Vec512, 4, 6>(p, pool);
  }
}

}  // namespace inflight::kernels::cpu
