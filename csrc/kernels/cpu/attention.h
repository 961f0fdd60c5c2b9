// Attention over the paged KV cache on the CPU: store_kv, paged_attention (decode) and
// context_attention (prefill / chunked prefill).
//
// KV cache layout (one tensor per layer, C-contiguous): [2, num_blocks, tokens_per_block,
// num_kv_heads, head_dim], index 0 = K, 1 = V. Token p of sequence i lives at slot
// block_tables[i, p / tokens_per_block] * tokens_per_block + p % tokens_per_block.
//
// Each op is a params struct and a launcher. The launcher picks the ISA path at run time
// (selected_isa(): AVX-512, AVX2 or portable) and, inside it, a compile-time instantiation over
// (element type, head_dim); head dims outside the explicit list run a vectorised path with a run-time
// head_dim (any multiple of the vector width, <= kMaxHeadDim) or, failing that, the portable one.
// Kernels allocate nothing: outputs and the decode workspace come in. Arithmetic is fp32 throughout
// (online softmax, accumulators); only the final output is rounded to the element type.
//
// Callers validate (the bindings do, naming the argument); the kernels trust their params.
#pragma once

#include <cstddef>
#include <cstdint>

#include "inflight/kernels/scalar_type.h"

namespace inflight::kernels::cpu {

// Bounds the per-thread stack buffers (the kernels keep their tiles on the stack).
inline constexpr int kMaxHeadDim = 256;
// num_heads / num_kv_heads (query heads sharing one KV head).
inline constexpr int kMaxGroupSize = 64;

struct StoreKvParams {
  void const* k = nullptr;                        // [num_tokens, num_kv_heads, head_dim], last dim contiguous
  void const* v = nullptr;                        // same shape as k
  int64_t k_stride_token = 0, k_stride_head = 0;  // in elements
  int64_t v_stride_token = 0, v_stride_head = 0;
  void* kv_cache = nullptr;               // [2, num_blocks, tokens_per_block, num_kv_heads, head_dim]
  int64_t const* slot_mapping = nullptr;  // [num_tokens]; a negative slot skips the token (padding)
  int64_t num_slots = 0;                  // num_blocks * tokens_per_block
  int num_tokens = 0, num_kv_heads = 0, head_dim = 0;
  ScalarType dtype = ScalarType::kFloat32;  // of q, k, v, out and the cache: a float type
  int num_threads = 1;
};

struct PagedAttentionParams {
  void const* q = nullptr;                        // [batch, num_heads, head_dim], last dim contiguous
  int64_t q_stride_token = 0, q_stride_head = 0;  // in elements
  void const* kv_cache = nullptr;
  int32_t const* block_tables = nullptr;  // [batch, max_blocks_per_seq]
  int32_t const* kv_lens = nullptr;       // [batch], each in 1 .. max_blocks_per_seq * tokens_per_block
  void* out = nullptr;                    // [batch, num_heads, head_dim], contiguous
  // paged_attention_workspace_floats(params) floats; may be null when that is 0.
  float* workspace = nullptr;
  int batch = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int num_blocks = 0, tokens_per_block = 0, max_blocks_per_seq = 0;
  float scale = 1.0f;
  ScalarType dtype = ScalarType::kFloat32;  // of q, k, v, out and the cache: a float type
  int num_threads = 1;
};

struct ContextAttentionParams {
  void const* q = nullptr;  // [num_tokens, num_heads, head_dim], last dim contiguous
  int64_t q_stride_token = 0, q_stride_head = 0;
  void const* kv_cache = nullptr;
  int32_t const* block_tables = nullptr;  // [batch, max_blocks_per_seq]
  // [batch + 1]: sequence i's queries are tokens cu_seqlens[i] .. cu_seqlens[i+1]-1, at positions
  // kv_lens[i] - q_len_i + r (so q_len_i <= kv_lens[i]); causal over the sequence's cache.
  int32_t const* cu_seqlens = nullptr;
  int32_t const* kv_lens = nullptr;  // [batch]
  void* out = nullptr;               // [num_tokens, num_heads, head_dim], contiguous
  int batch = 0, num_tokens = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int num_blocks = 0, tokens_per_block = 0, max_blocks_per_seq = 0;
  float scale = 1.0f;
  ScalarType dtype = ScalarType::kFloat32;  // of q, k, v, out and the cache: a float type
  int num_threads = 1;
};

// How a decode batch is split: each sequence's keys in partitions of `partition_size` tokens, so a
// small batch with long contexts still gives every thread work; partitions are merged by
// log-sum-exp. Depends only on the shapes, kv_lens and num_threads.
struct PagedAttentionPlan {
  int partition_size = 0;
  int max_partitions = 1;  // over the batch
  int num_threads = 1;     // <= params.num_threads: a tiny batch is not worth waking threads for
};

// Multiply-adds below which one more thread costs more (wake-up, join) than it saves: ~10 us of work.
inline constexpr int64_t kMinMacsPerThread = int64_t(1) << 18;

PagedAttentionPlan plan_paged_attention(PagedAttentionParams const& params);

// A decode work item's KV heads x head_dim (floats per token it packs): bounds its tile buffers.
inline constexpr int kMaxDecodeRowFloats = 512;

// Internal linkage: the per-ISA files include this header with their own -m flags (see scalar_type.h).
namespace {

// KV heads one decode work item covers: as many as its tile buffers and kMaxGroupSize query heads
// allow (all of SmolLM2's 3 x 64). A token's rows for all KV heads are adjacent in the cache, so an
// item covering several reads them as one stream instead of one stride per head.
inline int decode_kv_heads_per_item(int num_heads, int num_kv_heads, int head_dim) {
  int const group = num_heads / num_kv_heads;
  int per_item = kMaxGroupSize / group;
  if (per_item > kMaxDecodeRowFloats / head_dim) per_item = kMaxDecodeRowFloats / head_dim;
  return per_item < 1 ? 1 : (per_item < num_kv_heads ? per_item : num_kv_heads);
}

}  // namespace

// Floats of workspace paged_attention needs (0 when no sequence is split).
size_t paged_attention_workspace_floats(PagedAttentionParams const& params, PagedAttentionPlan const& plan);

void store_kv(StoreKvParams const& params);
void paged_attention(PagedAttentionParams const& params, PagedAttentionPlan const& plan);
void context_attention(ContextAttentionParams const& params);

// Per-ISA entry points (attention_avx512.cpp, attention_avx2.cpp, attention.cpp). The vectorised
// ones return false when head_dim is not a multiple of their vector width.
bool paged_attention_avx512(PagedAttentionParams const& params, PagedAttentionPlan const& plan);
bool context_attention_avx512(ContextAttentionParams const& params);
bool paged_attention_avx2(PagedAttentionParams const& params, PagedAttentionPlan const& plan);
bool context_attention_avx2(ContextAttentionParams const& params);
void paged_attention_portable(PagedAttentionParams const& params, PagedAttentionPlan const& plan);
void context_attention_portable(ContextAttentionParams const& params);

}  // namespace inflight::kernels::cpu
