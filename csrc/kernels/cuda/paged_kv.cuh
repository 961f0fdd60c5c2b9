// Device-side addressing of the paged KV cache, shared by the attention kernels.
//   kv_cache: [2, num_blocks, tokens_per_block, num_kv_heads, head_dim]; key j of a sequence lives in
//   block block_table[j / tokens_per_block], row j % tokens_per_block.
#pragma once

#include <cstdint>

namespace inflight::kernels::cuda {

// Element offset of (key, kv_head, channel 0) inside the K half of the cache, or -1 when the block id
// in the table is out of range. A corrupt table must not turn into an out-of-bounds read: the
// tensor-core kernels read such keys as zero rows, the CUDA-core kernel skips them. (The result is then
// wrong, but no memory outside the cache is touched.)
__device__ __forceinline__ std::int64_t paged_kv_offset(int const* block_table_row, int key, int tokens_per_block,
                                                        std::int64_t num_blocks, int num_kv_heads, int head_dim,
                                                        int kv_head) {
  int const block = block_table_row[key / tokens_per_block];
  if (block < 0 || block >= num_blocks) return -1;
  std::int64_t const slot = static_cast<std::int64_t>(block) * tokens_per_block + key % tokens_per_block;
  return (slot * num_kv_heads + kv_head) * head_dim;
}

// kv_len clamped to what the block table can address.
__device__ __forceinline__ int clamp_kv_len(int kv_len, int max_blocks_per_seq, int tokens_per_block) {
  std::int64_t const cap = static_cast<std::int64_t>(max_blocks_per_seq) * tokens_per_block;
  if (kv_len < 0) return 0;
  return kv_len > cap ? static_cast<int>(cap) : kv_len;
}

}  // namespace inflight::kernels::cuda
