#include <cuda_fp8.h>

#include <cstdint>

#include "device_utils.cuh"
#include "static_switch.h"
#include "store_kv.h"

namespace inflight::kernels::cuda {
namespace {

// A launch's row geometry in units of Vec.
struct Rows {
  std::int64_t vecs_per_row, k_stride, v_stride;
};

// Vec: the unit of copy (uint4 = 16 bytes down to ushort = 2 bytes), the widest that divides the row,
// the token strides and every base pointer.
template <typename Vec>
__global__ void store_kv_kernel(StoreKvParams p, Rows rows) {
  Vec const* k = static_cast<Vec const*>(p.k);
  Vec const* v = static_cast<Vec const*>(p.v);
  Vec* k_cache = static_cast<Vec*>(p.kv_cache);
  Vec* v_cache = k_cache + p.num_slots * rows.vecs_per_row;
  for (std::int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    std::int64_t const slot = p.slot_mapping[t];
    if (slot < 0 || slot >= p.num_slots) continue;
    for (std::int64_t i = threadIdx.x; i < rows.vecs_per_row; i += blockDim.x) {
      k_cache[slot * rows.vecs_per_row + i] = k[t * rows.k_stride + i];
      v_cache[slot * rows.vecs_per_row + i] = v[t * rows.v_stride + i];
    }
  }
}

bool divides(int width, StoreKvParams const& p, std::int64_t row_bytes, std::int64_t elem_bytes) {
  auto aligned = [width](void const* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % width == 0; };
  return row_bytes % width == 0 && (p.k_token_stride * elem_bytes) % width == 0 &&
         (p.v_token_stride * elem_bytes) % width == 0 && aligned(p.k) && aligned(p.v) && aligned(p.kv_cache);
}

template <typename Vec>
cudaError_t launch(StoreKvParams const& p, std::int64_t row_bytes, std::int64_t elem_bytes, cudaStream_t stream) {
  constexpr auto kVec = static_cast<std::int64_t>(sizeof(Vec));
  Rows const rows{row_bytes / kVec, p.k_token_stride * elem_bytes / kVec, p.v_token_stride * elem_bytes / kVec};
  // One block per token (grid-stride past 65535 tokens); threads cover the row, at most 256 of them.
  int threads = 32;
  while (threads < 256 && threads < rows.vecs_per_row) threads *= 2;
  std::int64_t blocks = p.num_tokens < 65535 ? p.num_tokens : 65535;
  store_kv_kernel<Vec><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p, rows);
  return cudaGetLastError();
}

// int8 cache: one warp per (token, K or V, KV head) row; the lanes stride over head_dim, a warp max
// gives the row's scale. T: the element type of k and v (float, half, __nv_bfloat16).
template <typename T>
__global__ void store_kv_int8_kernel(StoreKvParams p) {
  int const warp = threadIdx.x / 32;
  int const lane = threadIdx.x % 32;
  int const warps = blockDim.x / 32;
  std::int64_t const rows_per_half = p.num_slots * p.num_kv_heads;
  auto* const codes = static_cast<std::int8_t*>(p.kv_cache);
  for (std::int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    std::int64_t const slot = p.slot_mapping[t];
    if (slot < 0 || slot >= p.num_slots) continue;
    for (int r = warp; r < 2 * p.num_kv_heads; r += warps) {  // uniform per warp: the shuffles see every lane
      int const half = r / p.num_kv_heads;                    // 0 = K, 1 = V
      int const head = r % p.num_kv_heads;
      T const* src = half == 0 ? static_cast<T const*>(p.k) + t * p.k_token_stride
                               : static_cast<T const*>(p.v) + t * p.v_token_stride;
      src += static_cast<std::int64_t>(head) * p.head_dim;
      float amax = 0.f;
      for (int d = lane; d < p.head_dim; d += 32) amax = fmaxf(amax, fabsf(to_float(src[d])));
      amax = warp_max(amax);
      float const scale = amax / 127.f;
      std::int64_t const row = half * rows_per_half + slot * p.num_kv_heads + head;
      std::int8_t* dst = codes + row * p.head_dim;
      for (int d = lane; d < p.head_dim; d += 32) {
        float c = scale > 0.f ? rintf(__fdiv_rn(to_float(src[d]), scale)) : 0.f;
        c = isnan(c) ? 0.f : fminf(fmaxf(c, -127.f), 127.f);  // a NaN code is 0, as on the CPU
        dst[d] = static_cast<std::int8_t>(c);
      }
      if (lane == 0) p.kv_scales[row] = scale;
    }
  }
}

cudaError_t launch_store_kv_int8(StoreKvParams const& p, cudaStream_t stream) {
  if (p.kv_scales == nullptr) return cudaErrorInvalidValue;
  // A warp per row, up to 8 warps per token (K and V of 4 KV heads at once).
  int const warps = 2 * p.num_kv_heads < 8 ? 2 * p.num_kv_heads : 8;
  std::int64_t const blocks = p.num_tokens < 65535 ? p.num_tokens : 65535;
  return SCALAR_TYPE_SWITCH(p.dtype, T, [&] {
    store_kv_int8_kernel<T><<<static_cast<unsigned>(blocks), warps * 32, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

// fp8 cache: one thread per element of a token's K and V rows (grid-stride over tokens); x / scale
// (IEEE division, as the CPU's) converted with saturation to +-448, nearest even; a NaN is stored as 0,
// as on the CPU. T: the element type of k and v.
template <typename T>
__global__ void store_kv_fp8_kernel(StoreKvParams p) {
  std::int64_t const row = static_cast<std::int64_t>(p.num_kv_heads) * p.head_dim;  // one token's elements
  auto* const k_cache = static_cast<__nv_fp8_storage_t*>(p.kv_cache);
  __nv_fp8_storage_t* const v_cache = k_cache + p.num_slots * row;
  for (std::int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    std::int64_t const slot = p.slot_mapping[t];
    if (slot < 0 || slot >= p.num_slots) continue;
    T const* k = static_cast<T const*>(p.k) + t * p.k_token_stride;
    T const* v = static_cast<T const*>(p.v) + t * p.v_token_stride;
    for (std::int64_t i = threadIdx.x; i < row; i += blockDim.x) {
      float const kx = __fdiv_rn(to_float(k[i]), p.k_scale);
      float const vx = __fdiv_rn(to_float(v[i]), p.v_scale);
      k_cache[slot * row + i] =
          isnan(kx) ? __nv_fp8_storage_t(0) : __nv_cvt_float_to_fp8(kx, __NV_SATFINITE, __NV_E4M3);
      v_cache[slot * row + i] =
          isnan(vx) ? __nv_fp8_storage_t(0) : __nv_cvt_float_to_fp8(vx, __NV_SATFINITE, __NV_E4M3);
    }
  }
}

cudaError_t launch_store_kv_fp8(StoreKvParams const& p, cudaStream_t stream) {
  std::int64_t const row = static_cast<std::int64_t>(p.num_kv_heads) * p.head_dim;
  int threads = 32;
  while (threads < 256 && threads < row) threads *= 2;
  std::int64_t const blocks = p.num_tokens < 65535 ? p.num_tokens : 65535;
  return SCALAR_TYPE_SWITCH(p.dtype, T, [&] {
    store_kv_fp8_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t launch_store_kv(StoreKvParams const& params, cudaStream_t stream) {
  if (!is_float_type(params.dtype)) return cudaErrorInvalidValue;
  if (params.kv_dtype == ScalarType::kInt8) {
    if (params.num_tokens == 0 || params.num_kv_heads == 0 || params.head_dim == 0) return cudaSuccess;
    return launch_store_kv_int8(params, stream);
  }
  if (params.kv_dtype == ScalarType::kFloat8E4M3) {
    if (params.num_tokens == 0 || params.num_kv_heads == 0 || params.head_dim == 0) return cudaSuccess;
    return launch_store_kv_fp8(params, stream);
  }
  if (params.kv_dtype != params.dtype) return cudaErrorInvalidValue;
  std::int64_t const elem_bytes = static_cast<std::int64_t>(scalar_type_size(params.dtype));
  std::int64_t const row_bytes = static_cast<std::int64_t>(params.num_kv_heads) * params.head_dim * elem_bytes;
  if (params.num_tokens == 0 || row_bytes == 0) return cudaSuccess;
  if (divides(16, params, row_bytes, elem_bytes)) return launch<uint4>(params, row_bytes, elem_bytes, stream);
  if (divides(8, params, row_bytes, elem_bytes)) return launch<uint2>(params, row_bytes, elem_bytes, stream);
  if (divides(4, params, row_bytes, elem_bytes)) return launch<std::uint32_t>(params, row_bytes, elem_bytes, stream);
  return launch<std::uint16_t>(params, row_bytes, elem_bytes, stream);
}

}  // namespace inflight::kernels::cuda
