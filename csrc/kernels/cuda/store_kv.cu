#include <cstdint>

#include "store_kv.h"

namespace inflight::kernels::cuda {
namespace {

// Vec: the unit of copy (uint4 = 16 bytes down to ushort = 2 bytes), the widest that divides the row,
// the token strides and every base pointer.
template <typename Vec>
__global__ void store_kv_kernel(StoreKvParams p) {
  std::int64_t const vecs_per_row = p.row_elems * p.elem_bytes / static_cast<std::int64_t>(sizeof(Vec));
  std::int64_t const k_stride = p.k_token_stride * p.elem_bytes / static_cast<std::int64_t>(sizeof(Vec));
  std::int64_t const v_stride = p.v_token_stride * p.elem_bytes / static_cast<std::int64_t>(sizeof(Vec));
  Vec const* k = static_cast<Vec const*>(p.k);
  Vec const* v = static_cast<Vec const*>(p.v);
  Vec* k_cache = static_cast<Vec*>(p.kv_cache);
  Vec* v_cache = k_cache + p.num_slots * vecs_per_row;
  for (std::int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    std::int64_t const slot = p.slot_mapping[t];
    if (slot < 0 || slot >= p.num_slots) continue;
    for (std::int64_t i = threadIdx.x; i < vecs_per_row; i += blockDim.x) {
      k_cache[slot * vecs_per_row + i] = k[t * k_stride + i];
      v_cache[slot * vecs_per_row + i] = v[t * v_stride + i];
    }
  }
}

bool divides(int width, StoreKvParams const& p) {
  auto aligned = [width](void const* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % width == 0; };
  return (p.row_elems * p.elem_bytes) % width == 0 && (p.k_token_stride * p.elem_bytes) % width == 0 &&
         (p.v_token_stride * p.elem_bytes) % width == 0 && aligned(p.k) && aligned(p.v) && aligned(p.kv_cache);
}

template <typename Vec>
cudaError_t launch(StoreKvParams const& p, cudaStream_t stream) {
  std::int64_t const vecs_per_row = p.row_elems * p.elem_bytes / static_cast<std::int64_t>(sizeof(Vec));
  // One block per token (grid-stride past 65535 tokens); threads cover the row, at most 256 of them.
  int threads = 32;
  while (threads < 256 && threads < vecs_per_row) threads *= 2;
  std::int64_t blocks = p.num_tokens < 65535 ? p.num_tokens : 65535;
  store_kv_kernel<Vec><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_store_kv(StoreKvParams const& params, cudaStream_t stream) {
  if (params.elem_bytes != 2 && params.elem_bytes != 4) return cudaErrorInvalidValue;
  if (params.num_tokens == 0 || params.row_elems == 0) return cudaSuccess;
  if (divides(16, params)) return launch<uint4>(params, stream);
  if (divides(8, params)) return launch<uint2>(params, stream);
  if (divides(4, params)) return launch<std::uint32_t>(params, stream);
  return launch<std::uint16_t>(params, stream);
}

}  // namespace inflight::kernels::cuda
