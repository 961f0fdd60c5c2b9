#include "static_switch.h"
#include "w4a16_gemm.h"
#include "weight_only_gemm.cuh"

namespace inflight::kernels::cuda {

cudaError_t launch_w4a16_gemm(W4A16GemmParams const& p, ScalarType dtype, cudaStream_t stream) {
  if (p.group_size <= 0 || p.group_size % Int4Format::kMinGroup != 0 || p.k % p.group_size != 0) {
    return cudaErrorInvalidValue;
  }
  WeightOnlyGemmArgs a{};
  a.x = p.x;
  a.x_row_stride = p.x_row_stride;
  a.qweight = p.qweight;
  a.qweight_row_bytes = p.k / 2;
  a.scales = p.scales;
  a.offsets = p.offsets;
  a.scale_type = p.scale_type;
  a.bias = p.bias;
  a.out = p.out;
  a.out_row_stride = p.out_row_stride;
  a.m = p.m;
  a.n = p.n;
  a.k = p.k;
  a.group_size = p.group_size;
  return HALF_TYPE_SWITCH(dtype, T, [&] {
    return BOOL_SWITCH(p.offsets != nullptr, kAsym,
                       [&] { return launch_weight_only_gemm<T, Int4Format, kAsym>(a, stream); });
  });
}

}  // namespace inflight::kernels::cuda
