// AVX-512 (F/BW/VL/DQ + BF16) dense GEMM path: gemm_impl.h's DenseTile over 16-lane vectors. Compiled
// with AVX-512 flags; called only when selected_isa() is kAvx512. fp32 and fp16 step 16 values at a
// time with FMA (fp16 widened on load); bf16 steps 32 at a time with VDPBF16PS (Vec512::Bf16Step).
#include "gemm_avx512.h"

namespace inflight::kernels::cpu {

void dense_gemm_avx512(DenseGemmParams const& p, ThreadPool& pool) {
  using gemm_avx512::Vec512;
  // One x row is bound by memory alone: 8 weight rows streamed at a time keep more loads in flight
  // (up to ~10% faster from DRAM than 4, one thread). More rows are also bound by the multiply-adds
  // and by the re-reads of each L2 chunk per M tile: 6 x rows per tile make the fewest passes.
  if (p.m == 1) {
    gemm_avx512::run_dense<Vec512, 8, 1>(p, pool);
  } else {
    gemm_avx512::run_dense<Vec512, 4, 6>(p, pool);
  }
}

}  // namespace inflight::kernels::cpu
