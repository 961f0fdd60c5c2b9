// paged_attention: decode attention, one query token per sequence, over the paged KV cache.
//   out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b, keys 0 .. kv_lens[b]-1 of sequence b, read from
//   kv_cache[0/1, block_tables[b, j // tpb], j % tpb, h // (num_heads / num_kv_heads)] (an int8 cache:
//   times its kv_scales entry, dequantised to q's dtype as a tile is loaded). Under a window
//   (params.window > 0) only keys kv_lens[b] - window .. kv_lens[b] - 1 (those >= 0) are read.
//
// Work split: one CTA per (partition, KV head, 16-head chunk of its query group, sequence). The query
// heads that share a KV head are the 16 rows of one tensor-core tile, so each K/V row is read from
// memory once per KV head. Long contexts are split over `num_partitions` CTAs (flash-decoding): CTA p
// takes key tiles p, p + P, p + 2P, ... (counted from the window's first tile), writes its normalised
// partial output and log-sum-exp to the workspace, and a second kernel merges the partitions. The
// partition count is chosen by the launcher from the grid size, the block-table width (or the window)
// and the workspace it is given; no workspace means no split.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "inflight/kernels/attention_params.h"

namespace inflight::kernels::cuda {

// The fields shared with context attention and with the CPU op are AttentionParams'; a token's heads
// are contiguous here (the CPU also takes a head stride and a thread count).
struct PagedAttentionParams : AttentionParams {
  void* workspace;  // may be null; see paged_attention_workspace_size
  std::int64_t workspace_bytes;
};

// Keys per partition below which splitting stops paying, and the most partitions ever used.
constexpr int kPagedAttentionMinPartitionKeys = 256;
constexpr int kPagedAttentionMaxPartitions = 64;

// Bytes of workspace that let the launcher split a batch whose longest context is max_kv_len as far
// as it may want to (0: it never splits such a batch).
std::int64_t paged_attention_workspace_size(int batch_size, int num_heads, int max_kv_len, int head_dim);

// Tensor cores for float16/bfloat16, the CUDA-core kernel (attention_simt) for float32.
cudaError_t launch_paged_attention(PagedAttentionParams const& params, cudaStream_t stream);

// The CUDA-core kernel for every dtype (no split, workspace unused): a slow, simple twin kept for
// tests and as a fallback.
cudaError_t launch_paged_attention_simt(PagedAttentionParams const& params, cudaStream_t stream);

}  // namespace inflight::kernels::cuda
