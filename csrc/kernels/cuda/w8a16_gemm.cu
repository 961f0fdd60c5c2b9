#include "static_switch.h"
#include "w8a16_gemm.h"
#include "weight_only_gemm.cuh"

namespace inflight::kernels::cuda {

cudaError_t launch_w8a16_gemm(W8A16GemmParams const& p, ScalarType dtype, cudaStream_t stream) {
  if (p.group_size <= 0 || p.group_size % Int8Format::kMinGroup != 0 || p.k % p.group_size != 0) {
    return cudaErrorInvalidValue;
  }
  WeightOnlyGemmArgs a{};
  a.x = p.x;
  a.x_row_stride = p.x_row_stride;
  a.qweight = reinterpret_cast<std::uint8_t const*>(p.qweight);
  a.qweight_row_bytes = p.k;
  a.scales = p.scales;
  a.offsets = nullptr;
  a.scale_type = p.scale_type;
  a.bias = p.bias;
  a.out = p.out;
  a.out_row_stride = p.out_row_stride;
  a.m = p.m;
  a.n = p.n;
  a.k = p.k;
  a.group_size = p.group_size;
  return HALF_TYPE_SWITCH(dtype, T, [&] { return launch_weight_only_gemm<T, Int8Format, false>(a, stream); });
}

}  // namespace inflight::kernels::cuda
