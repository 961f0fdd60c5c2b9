// context_attention: causal attention for context (prefill) chunks over the paged KV cache.
//   Sequence i owns query tokens cu_seqlens[i] .. cu_seqlens[i+1]-1 (q_len of them) and kv_lens[i] keys
//   (its history plus this chunk, already stored). Query r of sequence i sits at position
//   kv_len - q_len + r and attends to keys 0 .. that position.
//
// Work split: one CTA per (64-query tile of one sequence, query head), FlashAttention-2 style: four warps
// of 16 query rows each, online softmax over 64-key tiles read straight from the cache blocks into
// shared memory (cp.async, two stages), QK^T and PV on tensor cores (mma.m16n8k16, fp32 accumulators).
// The host does not know the per-sequence lengths (they are on the device), so the grid covers the
// upper bound ceil(T / 64) + batch_size of tiles and each CTA finds its (sequence, tile) by a prefix
// sum over cu_seqlens; CTAs past the last tile exit at once.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "inflight/kernels/scalar_type.h"

namespace inflight::kernels::cuda {

struct ContextAttentionParams {
  void const* q;                // [num_tokens, num_heads, head_dim], token rows q_token_stride apart
  std::int64_t q_token_stride;  // elements
  void const* kv_cache;         // [2, num_blocks, tokens_per_block, num_kv_heads, head_dim]
  std::int64_t num_blocks;
  int tokens_per_block;
  int const* block_tables;  // [batch_size, max_blocks_per_seq], rows block_table_stride apart
  std::int64_t block_table_stride;
  int max_blocks_per_seq;  // kv_lens are clamped to max_blocks_per_seq * tokens_per_block
  int const* cu_seqlens;   // [batch_size + 1], non-decreasing; null: token i is sequence i's only
                           // query (the decode layout, used by the CUDA-core kernel)
  int const* kv_lens;      // [batch_size]
  void* out;               // [num_tokens, num_heads, head_dim], contiguous; rows of tokens that
                           // no sequence owns are left untouched
  std::int64_t num_tokens;
  int batch_size;
  int num_heads;
  int num_kv_heads;
  int head_dim;  // 64 or 128
  float scale;
};

// Tensor cores for float16/bfloat16, the CUDA-core kernel for float32.
cudaError_t launch_context_attention(ContextAttentionParams const& params, ScalarType dtype, cudaStream_t stream);

// The CUDA-core kernel (attention_simt.h) for every dtype: a slow, simple twin for tests and fallback.
cudaError_t launch_context_attention_simt(ContextAttentionParams const& params, ScalarType dtype, cudaStream_t stream);

}  // namespace inflight::kernels::cuda
