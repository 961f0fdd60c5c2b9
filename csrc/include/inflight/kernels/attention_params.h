// AttentionParams: what paged attention (decode) and context attention (prefill) share, on the CPU
// (kernels/cpu/attention.h) and on CUDA (kernels/cuda/paged_attention.h, context_attention.h). Each
// op's params derive from it and add their own fields (and the device-specific ones), so the same
// thing has the same name on both devices.
//
// The paged KV cache of one layer is [2, num_blocks, tokens_per_block, num_kv_heads, head_dim] (0 = K,
// 1 = V); key j of sequence i lives in block block_tables[i, j / tokens_per_block], row
// j % tokens_per_block. Free of CUDA headers and C++17, like scalar_type.h.
//
// INT8 KV cache (kv_dtype = kInt8): the cache holds int8 codes and kv_scales one fp32 scale per token
// per KV head, [2, num_blocks, tokens_per_block, num_kv_heads] (0 = K, 1 = V): element d of head h of
// the token in slot s stands for cache[.., s, h, d] * kv_scales[.., s, h]. Symmetric, scale =
// max |x| / 127 over that token's head_dim values, set by store_kv when the token is written (no
// calibration); the attention kernels dequantise as they read.
//
// FP8 KV cache (kv_dtype = kFloat8E4M3): the cache holds OCP FP8 E4M3 (e4m3fn) bytes, no per-token
// scales; one scale per tensor, k_scale for K and v_scale for V: element x is stored as
// e4m3(x / scale), rounded to nearest even and saturated to +-448, and read as e4m3 * scale.
#pragma once

#include <cstdint>

#include "inflight/kernels/scalar_type.h"

namespace inflight::kernels {

struct AttentionParams {
  void const* q = nullptr;          // [tokens, num_heads, head_dim], token rows q_token_stride elements apart
  std::int64_t q_token_stride = 0;  // CUDA: a multiple of 16 bytes
  void const* kv_cache = nullptr;
  std::int64_t num_blocks = 0;
  int tokens_per_block = 0;
  std::int32_t const* block_tables = nullptr;  // [batch_size, max_blocks_per_seq], rows block_table_stride apart
  std::int64_t block_table_stride = 0;         // elements
  int max_blocks_per_seq = 0;
  // [batch_size]: keys per sequence. The CPU kernels need 1 .. max_blocks_per_seq * tokens_per_block (the
  // bindings check it); the CUDA kernels clamp to that and give a zero output row for 0.
  std::int32_t const* kv_lens = nullptr;
  void* out = nullptr;  // [tokens, num_heads, head_dim], contiguous
  int batch_size = 0;
  int num_heads = 0;
  int num_kv_heads = 0;                        // divides num_heads
  int head_dim = 0;                            // CUDA: 64 or 128
  float scale = 1.0f;                          // of q . k, before the softmax
  ScalarType dtype = ScalarType::kFloat32;     // of q and out: a float type
  ScalarType kv_dtype = ScalarType::kFloat32;  // of the cache: dtype, kInt8 (with kv_scales) or kFloat8E4M3
  float const* kv_scales = nullptr;            // with kv_dtype = kInt8: [2, num_blocks, tokens_per_block, num_kv_heads]
  float k_scale = 1.0f, v_scale = 1.0f;        // with kv_dtype = kFloat8E4M3: the per-tensor scales of K and V
  // Sliding-window (local) attention: a query at position p sees the keys j with p - window < j <= p
  // (the last `window` tokens, itself included), as transformers' sliding_window. 0: no window (full
  // causal attention). Decode's query sits at kv_lens[i] - 1; keys before the window are not read.
  int window = 0;
};

}  // namespace inflight::kernels
