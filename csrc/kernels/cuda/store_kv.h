// store_kv: writes this step's keys and values into the paged KV cache at their slots.
//   kv_cache[0, slot // tpb, slot % tpb] = k[t];  kv_cache[1, ...] = v[t]   for slot = slot_mapping[t] >= 0
// The cache is [2, num_blocks, tokens_per_block, num_kv_heads, head_dim], so slot s is row s of the
// flattened [num_blocks * tokens_per_block] axis. Negative slots are padding and are skipped; a slot past
// the cache is skipped too (the kernel cannot report it without a device sync; the caller's block
// accounting guarantees it never happens).
//
// The params have the fields and names of the CPU op's (kernels/cpu/attention.h), which also takes
// per-head strides; here a token's heads are contiguous (one row of num_kv_heads * head_dim elements,
// copied in the widest unit that divides it).
//
// An int8 cache (kv_dtype = kInt8, attention_params.h): each (token, KV head) row is quantised as the
// CPU op does it (kernels/cpu/attention.h, quantize_kv_row): scale = max|x| / 127 into kv_scales, codes
// round(x / scale) to nearest even (IEEE division and rintf, so the codes are the CPU's, bit for bit).
//
// An fp8 cache (kv_dtype = kFloat8E4M3): each element x / k_scale (x / v_scale), IEEE division, converted
// to E4M3 by cuda_fp8.h's saturating conversion (nearest even, +-448 at most): the CPU's bytes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "inflight/kernels/scalar_type.h"

namespace inflight::kernels::cuda {

struct StoreKvParams {
  void const* k;  // [num_tokens, num_kv_heads, head_dim], rows k_token_stride elements apart
  void const* v;  // like k, rows v_token_stride elements apart
  std::int64_t k_token_stride;
  std::int64_t v_token_stride;
  void* kv_cache;                    // [2, num_slots, num_kv_heads, head_dim] in effect
  std::int64_t const* slot_mapping;  // [num_tokens]
  std::int64_t num_slots;            // num_blocks * tokens_per_block
  std::int64_t num_tokens;
  int num_kv_heads;
  int head_dim;
  ScalarType dtype;     // of k and v: float32, bfloat16 or float16 (a copy needs its size only)
  ScalarType kv_dtype;  // of the cache: dtype, kInt8 or kFloat8E4M3
  float* kv_scales;     // with kv_dtype = kInt8: [2, num_slots, num_kv_heads], written
  float k_scale;        // with kv_dtype = kFloat8E4M3: stored value = e4m3(x / k_scale)
  float v_scale;        // likewise for V
};

cudaError_t launch_store_kv(StoreKvParams const& params, cudaStream_t stream);

}  // namespace inflight::kernels::cuda
