#include "w4a16_gemm.h"
#include "weight_only_gemm.cuh"

namespace inflight::kernels::cuda {

cudaError_t launch_w4a16_gemm(W4A16GemmParams const& params, cudaStream_t stream) {
  return launch_weight_only_op<Int4Format, true>(params, stream);
}

}  // namespace inflight::kernels::cuda
