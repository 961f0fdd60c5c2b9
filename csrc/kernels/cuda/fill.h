// fill: out[i] = value for i in [0, num_elements). The first CUDA op, kept deliberately simple: it
// exercises the build (nvcc, static cudart, the lazily imported module) until the real kernels land.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "inflight/kernels/scalar_type.h"

namespace inflight::kernels::cuda {

struct FillParams {
  void* out;  // device pointer, num_elements elements of dtype
  std::int64_t num_elements;
  double value;      // converted to dtype
  ScalarType dtype;  // int32 or float32
};

// Launches on `stream`; allocates nothing. Returns the launch status (cudaErrorInvalidValue for a
// dtype other than int32 or float32).
cudaError_t launch_fill(FillParams const& params, cudaStream_t stream);

}  // namespace inflight::kernels::cuda
