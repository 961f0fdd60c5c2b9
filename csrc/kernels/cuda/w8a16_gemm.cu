#include "w8a16_gemm.h"
#include "weight_only_gemm.cuh"

namespace inflight::kernels::cuda {

cudaError_t launch_w8a16_gemm(W8A16GemmParams const& params, cudaStream_t stream) {
  if (params.fp8_e4m3) return launch_weight_only_op<Fp8Format, false>(params, stream);
  return launch_weight_only_op<Int8Format, false>(params, stream);
}

}  // namespace inflight::kernels::cuda
