// The argument checks that an op's CPU binding (ops_*.cpp) and its CUDA binding (cuda_ops_*.cpp) share,
// so that the same mistake raises the same exception with the same message on both devices (the
// rules are tensor_checks.h's). Each checks dtypes, shapes and the layout both devices need, in one
// order; the binding then checks what only its device needs (strides and alignment its kernels
// assume, their size limits), the tensors' devices, and on the CPU the values the kernels index with
// (the check_*_values functions: device memory cannot be read here).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "inflight/kernels/attention_params.h"
#include "tensor_checks.h"

namespace inflight::bindings {

// ------------------------------------------------------------------------------- paged KV cache

// kv_cache [2, num_blocks, tokens_per_block, num_kv_heads, head_dim], contiguous, every size >= 1.
struct KvCacheShape {
  std::int64_t num_blocks;
  int tokens_per_block, num_kv_heads, head_dim;
  std::int64_t num_slots() const { return num_blocks * tokens_per_block; }
};

// The cache's element type: q's (k's), int8 with kv_scales [2, num_blocks, tokens_per_block,
// num_kv_heads] float32, contiguous, or uint8 holding FP8 E4M3 bytes (kFloat8E4M3) with the per-tensor
// k_scale, v_scale (finite, > 0; attention_params.h). kv_scales is refused beside a float or fp8 cache,
// a k_scale / v_scale other than 1 beside any but an fp8 cache.
struct KvCacheType {
  ScalarType kv_dtype;
  float* kv_scales;  // null unless kv_dtype is kInt8
  float k_scale = 1.0f, v_scale = 1.0f;
};

// store_kv(k, v, kv_cache, slot_mapping, kv_scales): k, v [num_tokens, num_kv_heads, head_dim] of one
// float dtype, the cache's unless it is int8; slot_mapping [num_tokens] int64. Layout of k and v: the
// binding's.
struct StoreKvArgs {
  KvCacheShape cache;
  ScalarType dtype;
  std::int64_t num_tokens;
  KvCacheType kv;
};
StoreKvArgs check_store_kv_args(Tensor const& k, Tensor const& v, Tensor const& kv_cache, Tensor const& slot_mapping,
                                Tensor const* kv_scales, double k_scale = 1.0, double v_scale = 1.0);

// paged_attention(q [batch_size, num_heads, head_dim], kv_cache, block_tables [batch_size, max_blocks]
// int32, kv_lens [batch_size] int32, out like q) and context_attention(q [num_tokens, ...], ...,
// cu_seqlens [batch_size + 1] int32, kv_lens [batch_size] int32, ...). Block tables may have a row
// stride; kv_lens, cu_seqlens and out are contiguous. Layout of q: the binding's.
struct AttentionArgs {
  KvCacheShape cache;
  KvCacheType kv;
  ScalarType dtype;
  std::int64_t num_tokens;  // q.shape[0]
  int batch_size;
  int num_heads;
  int max_blocks_per_seq;
  std::int64_t block_table_stride;
};
AttentionArgs check_paged_attention_args(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables,
                                         Tensor const& kv_lens, Tensor const& out, Tensor const* kv_scales,
                                         double k_scale = 1.0, double v_scale = 1.0);
AttentionArgs check_context_attention_args(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables,
                                           Tensor const& cu_seqlens, Tensor const& kv_lens, Tensor const& out,
                                           Tensor const* kv_scales, double k_scale = 1.0, double v_scale = 1.0);

// The AttentionParams fields (shared by paged and context attention on both devices) from checked tensors.
void fill_attention_params(kernels::AttentionParams& p, Tensor const& q, Tensor const& kv_cache,
                           Tensor const& block_tables, Tensor const& kv_lens, Tensor const& out, double scale,
                           AttentionArgs const& args);

// block_tables [batch_size, max_blocks_per_seq] int32 (rows may be strided) and kv_lens [batch_size]
// int32; `prefix` names them ("ctx_" for ctx_block_tables, ...).
void check_block_tables(Tensor const& block_tables, Tensor const& kv_lens, std::int64_t batch_size,
                        char const* batch_what, std::string const& prefix = "");

// Host values (CPU tensors). Every kv_len in 1 .. max_blocks_per_seq * tokens_per_block and every block
// id it reaches inside the cache.
void check_block_table_values(Tensor const& block_tables, Tensor const& kv_lens, KvCacheShape const& cache,
                              std::string const& prefix = "");
// cu_seqlens runs from 0 to num_tokens, and each sequence's queries fit its keys.
void check_cu_seqlens_values(Tensor const& cu_seqlens, Tensor const& kv_lens, std::int64_t num_tokens,
                             char const* num_tokens_what, std::string const& prefix = "");
// Every slot below the cache's num_slots (negative: skipped).
void check_slot_mapping_values(Tensor const& slot_mapping, std::int64_t num_slots);

// ------------------------------------------------------------------------------- weight-only GEMM

// The group sizes a device's kernels take, and how the message says it ("32, 64 or 128").
struct GroupSizeRule {
  bool (*ok)(int group_size);
  char const* allowed;
};

// qweight [n, k / 2] uint8 (bits 4) or [n, k] int8 (bits 8); scales [n, k / group_size] of a float
// type; offsets (4 bits, optional) like scales. Layout: the binding's.
struct QuantizedWeightArgs {
  std::int64_t n, k;
  ScalarType scale_type;
};
QuantizedWeightArgs check_quantized_weight(Tensor const& qweight, Tensor const& scales, Tensor const* offsets,
                                           int group_size, int bits, GroupSizeRule const& rule);

// An op call: the weight as above, x [m, k] of one of `x_types`, out [m, n] and bias [n] (optional) of x's
// dtype. Layout: the binding's.
struct WeightOnlyGemmArgs {
  std::int64_t m, n, k;
  ScalarType dtype, scale_type;
};
WeightOnlyGemmArgs check_weight_only_gemm_args(Tensor const& x, std::initializer_list<ScalarType> x_types,
                                               Tensor const& qweight, Tensor const& scales, Tensor const* offsets,
                                               int group_size, int bits, GroupSizeRule const& rule, Tensor const& out,
                                               Tensor const* bias);

// The parts of it, for weights imported once (k from qweight: k_what names it in the message).
// x [m, k] of one of `x_types`; returns m.
std::int64_t check_gemm_x(Tensor const& x, std::initializer_list<ScalarType> x_types, std::int64_t k,
                          char const* k_what);
// out [m, n] and bias [n], both of x's dtype.
void check_gemm_out(Tensor const& out, Tensor const& x, std::int64_t m, std::int64_t n);
void check_gemm_bias(Tensor const& bias, Tensor const& x, std::int64_t n);

// ------------------------------------------------------------------------------- sampling

// logits [N, V] (float, unit stride along V, row stride >= 0), temperature / top_p / min_p [N]
// float32, top_k [N] int32, seeds [N] uint64 or int64 (its bits), steps [N] int64, out [N] int64,
// all columns contiguous.
struct SamplingArgs {
  ScalarType dtype;
  std::int64_t num_rows, vocab_size, row_stride;
  std::array<NamedTensor, 8> tensors;  // every argument, for the binding's device check
};
SamplingArgs check_sampling_args(Tensor const& logits, Tensor const& temperature, Tensor const& top_k,
                                 Tensor const& top_p, Tensor const& min_p, Tensor const& seeds, Tensor const& steps,
                                 Tensor const& out);

// ------------------------------------------------------------------------------- params

// The params fields the CPU and CUDA structs of an op share (the same names on both devices), from
// checked tensors. P: kernels::cpu::StoreKvParams or kernels::cuda::StoreKvParams, and so on.
template <class P>
void fill_store_kv_params(P& p, Tensor const& k, Tensor const& v, Tensor const& kv_cache, Tensor const& slot_mapping,
                          StoreKvArgs const& a) {
  p.k = k.data();
  p.v = v.data();
  p.k_token_stride = row_stride(k);
  p.v_token_stride = row_stride(v);
  p.kv_cache = kv_cache.data();
  p.slot_mapping = static_cast<std::int64_t const*>(slot_mapping.data());
  p.num_slots = a.cache.num_slots();
  p.num_tokens = a.num_tokens;
  p.num_kv_heads = a.cache.num_kv_heads;
  p.head_dim = a.cache.head_dim;
  p.dtype = a.dtype;
  p.kv_dtype = a.kv.kv_dtype;
  p.kv_scales = a.kv.kv_scales;
  p.k_scale = a.kv.k_scale;
  p.v_scale = a.kv.v_scale;
}

template <class P>
void fill_sampling_params(P& p, SamplingArgs const& s) {
  auto data = [&](int i) { return s.tensors[i].tensor->data(); };
  p.logits = data(0);
  p.row_stride = s.row_stride;
  p.num_rows = s.num_rows;
  p.vocab_size = s.vocab_size;
  p.temperature = static_cast<float const*>(data(1));
  p.top_k = static_cast<std::int32_t const*>(data(2));
  p.top_p = static_cast<float const*>(data(3));
  p.min_p = static_cast<float const*>(data(4));
  p.seeds = static_cast<std::uint64_t const*>(data(5));
  p.steps = static_cast<std::int64_t const*>(data(6));
  p.out = static_cast<std::int64_t*>(data(7));
  p.dtype = s.dtype;
}

}  // namespace inflight::bindings
