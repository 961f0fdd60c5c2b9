// Device-side addressing of the paged KV cache, shared by the attention kernels.
//   kv_cache: [2, num_blocks, tokens_per_block, num_kv_heads, head_dim]; key j of a sequence lives in
//   block block_table[j / tokens_per_block], row j % tokens_per_block.
//   int8 cache (attention_params.h): the same layout of int8 codes, and kv_scales [2, num_blocks,
//   tokens_per_block, num_kv_heads] float32, one scale per (key, KV head): row offset / head_dim.
//   fp8 cache: the same layout of E4M3 bytes and the per-tensor p.k_scale, p.v_scale.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "device_utils.cuh"
#include "inflight/kernels/scalar_type.h"

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

// Eight int8 codes (one 8-byte load, code i in byte i) times their row's scale, as eight T in the 16
// bytes a 16-bit cache's cp.async would have copied (element 2i in the low half of word i): the int8
// kernels dequantise on the way into shared memory, and everything after is the 16-bit kernels'.
// Each value is code * scale rounded once to T. T: half or __nv_bfloat16.
template <typename T>
__device__ __forceinline__ uint4 dequant_int8x8(uint2 codes, float scale) {
  std::uint32_t const words[2] = {codes.x, codes.y};
  std::uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    std::uint32_t const w = words[i / 2];
    int const shift = (i % 2) * 16;
    // Shift the byte to the top, then arithmetically back: the sign-extended code.
    float const lo = static_cast<float>(static_cast<int>(w << (24 - shift)) >> 24) * scale;
    float const hi = static_cast<float>(static_cast<int>(w << (16 - shift)) >> 24) * scale;
    out[i] = pack2<T>(lo, hi);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// What the cache of an attention op holds: q's dtype, int8 codes (with kv_scales) or E4M3 bytes.
enum class KvKind { kSame, kInt8, kFp8 };

// The kind for (q's dtype, the cache's); false for a combination the kernels do not take (an int8
// cache without kv_scales included).
inline bool kv_kind_of(ScalarType dtype, ScalarType kv_dtype, float const* kv_scales, KvKind& kind) {
  if (kv_dtype == ScalarType::kInt8) {
    kind = KvKind::kInt8;
    return kv_scales != nullptr;
  }
  if (kv_dtype == ScalarType::kFloat8E4M3) {
    kind = KvKind::kFp8;
    return true;
  }
  kind = KvKind::kSame;
  return kv_dtype == dtype;
}

// Calls the body with CONST_NAME a constexpr KvKind equal to KIND.
#define KV_KIND_SWITCH(KIND, CONST_NAME, ...)                                   \
  [&]() -> cudaError_t {                                                        \
    switch (KIND) {                                                             \
      case ::inflight::kernels::cuda::KvKind::kInt8: {                          \
        constexpr ::inflight::kernels::cuda::KvKind CONST_NAME = KvKind::kInt8; \
        return __VA_ARGS__();                                                   \
      }                                                                         \
      case ::inflight::kernels::cuda::KvKind::kFp8: {                           \
        constexpr ::inflight::kernels::cuda::KvKind CONST_NAME = KvKind::kFp8;  \
        return __VA_ARGS__();                                                   \
      }                                                                         \
      default: {                                                                \
        constexpr ::inflight::kernels::cuda::KvKind CONST_NAME = KvKind::kSame; \
        return __VA_ARGS__();                                                   \
      }                                                                         \
    }                                                                           \
  }()

// Eight E4M3 bytes (one 8-byte load, byte i = element i) times the tensor's scale, as eight T in the
// layout of dequant_int8x8. The E4M3 -> float conversion is exact; each value is rounded once to T.
template <typename T>
__device__ __forceinline__ uint4 dequant_fp8x8(uint2 bytes, float scale) {
  std::uint32_t const words[2] = {bytes.x, bytes.y};
  std::uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    std::uint32_t const w = words[i / 2];
    int const shift = (i % 2) * 16;
    __nv_fp8_e4m3 lo, hi;
    lo.__x = static_cast<__nv_fp8_storage_t>((w >> shift) & 0xffu);
    hi.__x = static_cast<__nv_fp8_storage_t>((w >> (shift + 8)) & 0xffu);
    out[i] = pack2<T>(static_cast<float>(lo) * scale, static_cast<float>(hi) * scale);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

}  // namespace inflight::kernels::cuda
