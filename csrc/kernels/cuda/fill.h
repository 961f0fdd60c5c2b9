// fill: out[i] = value for i in [0, num_elements). The first CUDA op, kept deliberately simple: it
// exercises the build (nvcc, static cudart, the lazily imported module) until the real kernels land.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace inflight::kernels::cuda {

struct FillParams {
  void* out;                  // device pointer, num_elements elements of the dtype below
  std::int64_t num_elements;
  double value;
};

enum class FillDtype : int { kInt32 = 0, kFloat32 = 1 };

// Launches on `stream`; allocates nothing. Returns the launch status.
cudaError_t launch_fill(FillParams const& params, FillDtype dtype, cudaStream_t stream);

}  // namespace inflight::kernels::cuda
