#include <cstdint>

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

}  // namespace

cudaError_t launch_store_kv(StoreKvParams const& params, cudaStream_t stream) {
  if (!is_float_type(params.dtype)) return cudaErrorInvalidValue;
  std::int64_t const elem_bytes = static_cast<std::int64_t>(scalar_type_size(params.dtype));
  std::int64_t const row_bytes = static_cast<std::int64_t>(params.num_kv_heads) * params.head_dim * elem_bytes;
  if (params.num_tokens == 0 || row_bytes == 0) return cudaSuccess;
  if (divides(16, params, row_bytes, elem_bytes)) return launch<uint4>(params, row_bytes, elem_bytes, stream);
  if (divides(8, params, row_bytes, elem_bytes)) return launch<uint2>(params, row_bytes, elem_bytes, stream);
  if (divides(4, params, row_bytes, elem_bytes)) return launch<std::uint32_t>(params, row_bytes, elem_bytes, stream);
  return launch<std::uint16_t>(params, row_bytes, elem_bytes, stream);
}

}  // namespace inflight::kernels::cuda
