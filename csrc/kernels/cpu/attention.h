// Attention over the paged KV cache on the CPU: store_kv, paged_attention (decode) and
// context_attention (prefill / chunked prefill).
//
// KV cache layout (one tensor per layer, C-contiguous): [2, num_blocks, tokens_per_block,
// num_kv_heads, head_dim], index 0 = K, 1 = V. Token p of sequence i lives at slot
// block_tables[i, p / tokens_per_block] * tokens_per_block + p % tokens_per_block.
//
// Each op is a params struct and a launcher, launch_<op>(params, pool), with the fields and names of
// the CUDA op (kernels/cuda/store_kv.h, paged_attention.h, context_attention.h; the two attention ops
// share inflight/kernels/attention_params.h); the fields only the CPU has are marked. The launcher picks the ISA path
// at run time (selected_isa(): AVX-512, AVX2 or portable) and, inside it, a compile-time instantiation over (dtype,
// head_dim); head dims outside the explicit list run a vectorised path with a run-time head_dim (any multiple of the
// vector width,
// <= kMaxHeadDim) or, failing that, the portable one. Kernels allocate nothing: outputs and the
// decode workspace come in; threads come from the pool passed in. Arithmetic is fp32 throughout
// (online softmax, accumulators); only the final output is rounded to the dtype.
//
// Callers validate (the bindings do, naming the argument); the kernels trust their params: unlike the
// CUDA kernels they neither clamp kv_lens nor skip out-of-range block ids.
//
// INT8 KV cache (kv_dtype = kInt8, attention_params.h): store_kv quantises each token's head row
// (quantize_kv_row: scale = max|x| / 127, codes round(x / scale) to nearest even, in -127 .. 127; an
// all-zero row has scale 0), and both attention kernels widen the int8 codes of a key tile to fp32
// times their scale as they pack it, where a bf16 / fp16 cache is widened, so the rest of the
// arithmetic is the float cache's. It reads half the bytes of a bf16 cache (plus 4 per token and head).
//
// FP8 KV cache (kv_dtype = kFloat8E4M3, attention_params.h): store_kv encodes x / k_scale (x / v_scale)
// to E4M3 (float_to_e4m3: nearest even, saturating at +-448), and the kernels widen the bytes exactly
// to e4m3 * 2^-8 through fp16 (e4m3_to_f16_bits, then the ISA's fp16 conversion) where a 16-bit cache is
// widened; 256 * k_scale is folded into q's scale and 256 * v_scale into the output's normalisation,
// so the rest of the arithmetic is the float cache's. Half the bytes of a bf16 cache, no scales.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "inflight/kernels/attention_params.h"
#include "inflight/kernels/scalar_type.h"
#include "thread_pool.h"

namespace inflight::kernels::cpu {

// Bounds the per-thread stack buffers (the kernels keep their tiles on the stack).
inline constexpr int kMaxHeadDim = 256;
// num_heads / num_kv_heads (query heads sharing one KV head).
inline constexpr int kMaxGroupSize = 64;

struct StoreKvParams {
  void const* k = nullptr;                              // [num_tokens, num_kv_heads, head_dim], head_dim contiguous
  void const* v = nullptr;                              // like k
  std::int64_t k_token_stride = 0, v_token_stride = 0;  // elements between consecutive tokens
  // CPU only: elements between consecutive heads of a token (the CUDA copy needs head_dim).
  std::int64_t k_head_stride = 0, v_head_stride = 0;
  void* kv_cache = nullptr;                    // [2, num_slots, num_kv_heads, head_dim] in effect
  std::int64_t const* slot_mapping = nullptr;  // [num_tokens]; a negative slot skips the token (padding)
  std::int64_t num_slots = 0;                  // num_blocks * tokens_per_block
  std::int64_t num_tokens = 0;
  int num_kv_heads = 0, head_dim = 0;
  ScalarType dtype = ScalarType::kFloat32;     // of k and v: a float type
  ScalarType kv_dtype = ScalarType::kFloat32;  // of the cache: dtype, kInt8 or kFloat8E4M3 (quantised as written)
  float* kv_scales = nullptr;                  // with kv_dtype = kInt8: [2, num_slots, num_kv_heads], written
  float k_scale = 1.0f, v_scale = 1.0f;        // with kv_dtype = kFloat8E4M3: stored value = x / scale
  int num_threads = 1;                         // CPU only: at most this many of the pool's threads
};

// The fields shared with context attention and with the CUDA op are AttentionParams'.
struct PagedAttentionParams : AttentionParams {
  std::int64_t q_head_stride = 0;  // CPU only: elements between heads of q (CUDA: head_dim)
  // paged_attention_workspace_size(params) bytes, 4-byte aligned, or fewer (null): sequences are then
  // not split, as on CUDA without a workspace.
  void* workspace = nullptr;
  std::int64_t workspace_bytes = 0;
  int num_threads = 1;  // CPU only: at most this many of the pool's threads
};

struct ContextAttentionParams : AttentionParams {
  std::int64_t q_head_stride = 0;  // CPU only: elements between heads of q (CUDA: head_dim)
  // [batch_size + 1]: sequence i's queries are tokens cu_seqlens[i] .. cu_seqlens[i+1]-1, at positions
  // kv_lens[i] - q_len_i + r (so q_len_i <= kv_lens[i]); causal over the sequence's cache (and within
  // `window`: key tiles wholly before a query tile's window are skipped).
  std::int32_t const* cu_seqlens = nullptr;
  std::int64_t num_tokens = 0;  // rows of q and out
  int num_threads = 1;          // CPU only: at most this many of the pool's threads
};

// How a decode batch is split: each sequence's keys (those in its window: decode_key_begin ..
// kv_len - 1) in partitions of `partition_size` tokens, so a small batch with long contexts still
// gives every thread work; partitions are merged by log-sum-exp. Depends only on the shapes, kv_lens,
// the window and num_threads (not on the workspace).
// Under batch invariance (cpu_features.h) no sequence is split: a merge rounds differently from one
// pass, and the split would depend on the rest of the batch. A small batch is spread over the threads
// by KV heads instead (kv_heads_per_item: each head's arithmetic is the same whichever item has it).
struct PagedAttentionPlan {
  int partition_size = 0;
  int max_partitions = 1;     // over the batch
  int num_threads = 1;        // <= params.num_threads: a tiny batch is not worth waking threads for
  int kv_heads_per_item = 1;  // KV heads one work item covers (decode_kv_heads_per_item, or fewer)
};

// Multiply-adds below which one more thread costs more (wake-up, join) than it saves: ~10 us of work.
inline constexpr int64_t kMinMacsPerThread = int64_t(1) << 18;

// Decode is bound by reading its keys and values, which come from DRAM (between two layers' attention
// the weights streamed through the caches): below this many bytes of K/V one more thread costs more than
// it saves (~2 us of one thread's reads). SmolLM2's single-stream decode attention (3 KV heads, fp32
// cache, 60-320 keys) ran on one thread under the multiply-add rule above: 1.4x slower than on two.
inline constexpr int64_t kMinDecodeBytesPerThread = int64_t(32) << 10;

PagedAttentionPlan plan_paged_attention(PagedAttentionParams const& params);

// A decode work item's KV heads x head_dim (floats per token it packs): bounds its tile buffers.
inline constexpr int kMaxDecodeRowFloats = 512;

// Internal linkage: the per-ISA files include this header with their own -m flags (see scalar_type.h).
namespace {

// Symmetric int8 quantisation of one head row of n values (the KV store's; ops/reference/attention.py's
// quantize_kv is its twin, bit for bit): scale = max|x| / 127, code = round(x / scale), ties to even
// (adding and subtracting 1.5 * 2^23 rounds a float below 2^22 in magnitude to an integer in the
// current rounding mode, nearest even, and vectorises where nearbyint would not). x / scale, not x *
// (127 / max), so that the code of the largest element is exactly +-127. A NaN code is stored as 0.
template <class T>
inline float quantize_kv_row(T const* x, int n, std::int8_t* codes) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) {
    float const a = std::fabs(to_float(x[i]));
    amax = a > amax ? a : amax;
  }
  float const scale = amax / 127.0f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  for (int i = 0; i < n; ++i) {
    float r = scale > 0.0f ? (to_float(x[i]) / scale + kRound) - kRound : 0.0f;
    r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
    codes[i] = static_cast<std::int8_t>(r == r ? r : 0.0f);
  }
  return scale;
}

// KV heads one decode work item covers: as many as its tile buffers and kMaxGroupSize query heads
// allow (all of SmolLM2's 3 x 64). A token's rows for all KV heads are adjacent in the cache, so an
// item covering several reads them as one stream instead of one stride per head.
inline int decode_kv_heads_per_item(int num_heads, int num_kv_heads, int head_dim) {
  int const group = num_heads / num_kv_heads;
  int per_item = kMaxGroupSize / group;
  if (per_item > kMaxDecodeRowFloats / head_dim) per_item = kMaxDecodeRowFloats / head_dim;
  return per_item < 1 ? 1 : (per_item < num_kv_heads ? per_item : num_kv_heads);
}

// The first key a query at position `pos` sees: pos - window + 1 under a window, else 0.
inline int window_key_begin(int window, int pos) { return window > 0 && pos >= window ? pos - window + 1 : 0; }

// Where a row's key tiles start: `first` (the first key it sees) or, under batch invariance, `first`
// rounded down to a multiple of `tile`, so that a query's tiles are the same absolute key ranges in a
// decode and in any prefill chunk (the keys before `first` in that tile are masked).
inline int key_tile_begin(int first, int tile, bool invariant) { return invariant ? first - first % tile : first; }

// The first key decode reads for a sequence of kv_len keys (its query sits at kv_len - 1).
inline int decode_key_begin(int window, int kv_len) { return window_key_begin(window, kv_len - 1); }

}  // namespace

// Bytes of workspace that let launch_paged_attention split the batch as plan_paged_attention does
// (0 when no sequence is split).
std::int64_t paged_attention_workspace_size(PagedAttentionParams const& params);

void launch_store_kv(StoreKvParams const& params, ThreadPool& pool);
void launch_paged_attention(PagedAttentionParams const& params, ThreadPool& pool);
void launch_context_attention(ContextAttentionParams const& params, ThreadPool& pool);

// Per-ISA entry points (attention_avx512.cpp, attention_avx2.cpp, attention.cpp). The vectorised
// ones return false when head_dim is not a multiple of their vector width.
bool paged_attention_avx512(PagedAttentionParams const& params, PagedAttentionPlan const& plan, ThreadPool& pool);
bool context_attention_avx512(ContextAttentionParams const& params, ThreadPool& pool);
bool paged_attention_avx2(PagedAttentionParams const& params, PagedAttentionPlan const& plan, ThreadPool& pool);
bool context_attention_avx2(ContextAttentionParams const& params, ThreadPool& pool);
void paged_attention_portable(PagedAttentionParams const& params, PagedAttentionPlan const& plan, ThreadPool& pool);
void context_attention_portable(ContextAttentionParams const& params, ThreadPool& pool);

}  // namespace inflight::kernels::cpu
