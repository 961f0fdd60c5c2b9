// The fused layer stack's glue (llama_glue.h) built for AVX-512 (llama_glue_avx512f.cpp): the same
// functions over type-erased rows (dtype: the model's float type), the same bits as the baseline
// copy. Call them only where selected_isa() >= Isa::kAvx512F (llama_layers_ops.h does).
#pragma once

#include <cstdint>
#include <type_traits>

#include "inflight/kernels/scalar_type.h"
#include "thread_pool.h"

namespace inflight::kernels::cpu::glue_avx512f {

namespace {
// The dtype argument for the storage type T (float, BFloat16 or Float16).
template <class T>
constexpr ScalarType dtype_of() {
  if constexpr (std::is_same_v<T, float>) {
    return ScalarType::kFloat32;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return ScalarType::kBFloat16;
  } else {
    return ScalarType::kFloat16;
  }
}
}  // namespace

void rms_norm(ScalarType dtype, bool gemma, bool add, void const* x, void const* weight, void* out, int num_tokens,
              int d, float eps, ThreadPool& pool, int num_threads, std::int64_t const* rows);

void qk_norm_rope(ScalarType dtype, bool gemma, void* qkv, std::int64_t row_stride, void const* cos_sin,
                  std::int64_t const* positions, int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                  void const* q_norm, void const* k_norm, float eps, int key_rotation, ThreadPool& pool,
                  int num_threads);

void add_into(ScalarType dtype, void* hidden, void const* y, int num_tokens, int d, ThreadPool& pool, int num_threads);

void act_mul(ScalarType dtype, bool gelu, void const* gate_up, void* inter, int num_tokens, int n, ThreadPool& pool,
             int num_threads);

}  // namespace inflight::kernels::cpu::glue_avx512f
