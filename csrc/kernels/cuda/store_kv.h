// store_kv: writes this step's keys and values into the paged KV cache at their slots.
//   kv_cache[0, slot // tpb, slot % tpb] = k[t];  kv_cache[1, ...] = v[t]   for slot = slot_mapping[t] >= 0
// The cache is [2, num_blocks, tokens_per_block, num_kv_heads, head_dim], so slot s is row s of the
// flattened [num_blocks * tokens_per_block] axis. Negative slots are padding and are skipped; a slot past
// the cache is skipped too (the kernel cannot report it without a device sync; the caller's block
// accounting guarantees it never happens).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace inflight::kernels::cuda {

struct StoreKvParams {
  void const* k;                   // [num_tokens, num_kv_heads, head_dim], rows k_token_stride apart
  void const* v;                   // same shape as k, rows v_token_stride apart
  void* kv_cache;                  // [2, num_slots, row_elems] in effect
  std::int64_t const* slot_mapping;  // [num_tokens]
  std::int64_t num_tokens;
  std::int64_t k_token_stride;     // elements between consecutive tokens of k
  std::int64_t v_token_stride;
  std::int64_t row_elems;          // num_kv_heads * head_dim (contiguous in k, v and the cache)
  std::int64_t num_slots;          // num_blocks * tokens_per_block
  int elem_bytes;                  // 2 or 4: the copy is dtype-agnostic
};

cudaError_t launch_store_kv(StoreKvParams const& params, cudaStream_t stream);

}  // namespace inflight::kernels::cuda
