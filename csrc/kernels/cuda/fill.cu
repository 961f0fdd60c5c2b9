#include "fill.h"

namespace inflight::kernels::cuda {
namespace {

// T: element type written (int32 or float).
template <typename T>
__global__ void fill_kernel(T* __restrict__ out, std::int64_t num_elements, T value) {
  // Grid-stride loop: one launch configuration serves every size.
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < num_elements;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = value;
  }
}

template <typename T>
cudaError_t launch(FillParams const& p, cudaStream_t stream) {
  if (p.num_elements == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  std::int64_t blocks = (p.num_elements + kThreads - 1) / kThreads;
  // Enough blocks to fill any current GPU; the stride loop covers the rest.
  if (blocks > 65535) blocks = 65535;
  fill_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<T*>(p.out), p.num_elements,
                                                                         static_cast<T>(p.value));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_fill(FillParams const& params, cudaStream_t stream) {
  switch (params.dtype) {
    case ScalarType::kInt32:
      return launch<std::int32_t>(params, stream);
    case ScalarType::kFloat32:
      return launch<float>(params, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace inflight::kernels::cuda
