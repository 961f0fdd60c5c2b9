// context_attention: causal attention for context (prefill) chunks over the paged KV cache.
//   Sequence i owns query tokens cu_seqlens[i] .. cu_seqlens[i+1]-1 (q_len of them) and kv_lens[i] keys
//   (its history plus this chunk, already stored). Query r of sequence i sits at position
//   kv_len - q_len + r and attends to keys 0 .. that position (under a window, params.window > 0, only
//   to the last `window` of them: keys position - window + 1 .. position). An int8 cache is read with
//   its kv_scales, each tile dequantised to q's dtype as it is loaded.
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

#include "inflight/kernels/attention_params.h"

namespace inflight::kernels::cuda {

// The fields shared with paged attention and with the CPU op are AttentionParams'; a token's heads
// are contiguous here (the CPU also takes a head stride and a thread count). out's rows of tokens that
// no sequence owns are left untouched.
struct ContextAttentionParams : AttentionParams {
  // [batch_size + 1], non-decreasing; null: token i is sequence i's only query (the decode layout, used
  // by the CUDA-core kernel)
  std::int32_t const* cu_seqlens;
  std::int64_t num_tokens;  // rows of q and out
};

// Tensor cores for float16/bfloat16, the CUDA-core kernel for float32.
cudaError_t launch_context_attention(ContextAttentionParams const& params, cudaStream_t stream);

// The CUDA-core kernel (attention_simt.h) for every dtype: a slow, simple twin for tests and fallback.
cudaError_t launch_context_attention_simt(ContextAttentionParams const& params, cudaStream_t stream);

}  // namespace inflight::kernels::cuda
