// The fused layer stack's (llama_layers.cpp) and the MoE experts' steps between the kernels: the
// elementwise glue (llama_glue.h: norms, QK-norm + RoPE, residual adds, gated activations, dtype
// conversions), run through its AVX-512 copy where the CPU has it, the token embedding, and one
// projection through its kernel's launcher. Internal to the CPU kernels; include it only from files
// built for the baseline ISA (llama_layers.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "a8_gemm.h"
#include "dense_gemm.h"
#include "gemm.h"
#include "llama_glue.h"
#include "llama_glue_isa.h"
#include "llama_layers.h"
#include "thread_pool.h"
#include "w8a8_gemm.h"

namespace inflight::kernels::cpu::llama_ops {

using llama_glue::for_tokens;
using llama_glue::rnd;

// The glue's ISA: AVX-512 (llama_glue_avx512f.cpp, the same bits) where the selected ISA has it.
inline bool avx512_glue() { return selected_isa() >= Isa::kAvx512F; }

// The glue of llama_glue.h, through the AVX-512 copy where the CPU has it.
template <class T, bool kGemma, bool kAdd = false>
void rms_norm(T const* x, T const* weight, T* out, int num_tokens, int d, float eps, Threads threads,
              std::int64_t const* rows = nullptr) {
  if (avx512_glue()) {
    glue_avx512f::rms_norm(glue_avx512f::dtype_of<T>(), kGemma, kAdd, x, weight, out, num_tokens, d, eps, threads.pool,
                           threads.num, rows);
  } else {
    llama_glue::rms_norm<T, kGemma, kAdd>(x, weight, out, num_tokens, d, eps, threads, rows);
  }
}

template <class T, bool kGemma>
void qk_norm_rope(T* qkv, std::int64_t row_stride, T const* cos_sin, std::int64_t const* positions, int num_tokens,
                  int num_heads, int num_kv_heads, int head_dim, T const* q_norm, T const* k_norm, float eps,
                  int key_rotation, Threads threads) {
  if (avx512_glue()) {
    glue_avx512f::qk_norm_rope(glue_avx512f::dtype_of<T>(), kGemma, qkv, row_stride, cos_sin, positions, num_tokens,
                               num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps, key_rotation, threads.pool,
                               threads.num);
  } else {
    llama_glue::qk_norm_rope<T, kGemma>(qkv, row_stride, cos_sin, positions, num_tokens, num_heads, num_kv_heads,
                                        head_dim, q_norm, k_norm, eps, key_rotation, threads);
  }
}

template <class T>
void add_into(T* hidden, T const* y, int num_tokens, int d, Threads threads) {
  if (avx512_glue()) {
    glue_avx512f::add_into(glue_avx512f::dtype_of<T>(), hidden, y, num_tokens, d, threads.pool, threads.num);
  } else {
    llama_glue::add_into<T>(hidden, y, num_tokens, d, threads);
  }
}

template <class T, bool kGelu>
void act_mul(T const* gate_up, T* inter, int num_tokens, int n, Threads threads) {
  if (avx512_glue()) {
    glue_avx512f::act_mul(glue_avx512f::dtype_of<T>(), kGelu, gate_up, inter, num_tokens, n, threads.pool, threads.num);
  } else {
    llama_glue::act_mul<T, kGelu>(gate_up, inter, num_tokens, n, threads);
  }
}

using llama_glue::convert_rows;
using llama_glue::convert_rows_back;

// scratch: the step's shared scratch (the paged-attention partials' region, not in use during a
// projection), large enough for a W8A8 or A8 projection of the step's tokens.
inline void linear(LinearOp const& op, void const* x, void* out, std::int64_t m, ScalarType dtype, Threads threads,
                   void* scratch) {
  switch (op.kind) {
    case LinearOp::Kind::kW8A8: {
      W8A8GemmParams p = op.w8a8;
      p.x = x;
      p.out = out;
      p.m = m;
      p.dtype = dtype;
      p.workspace = scratch;
      p.num_threads = threads.num;
      launch_w8a8_gemm(p, threads.pool);
      return;
    }
    case LinearOp::Kind::kA8: {
      A8GemmParams p = op.a8;
      p.x = x;
      p.out = out;
      p.m = m;
      p.dtype = dtype;
      p.workspace = scratch;
      p.num_threads = threads.num;
      launch_a8_gemm(p, threads.pool);
      return;
    }
    case LinearOp::Kind::kW4A16: {
      W4A16GemmParams p = op.w4;
      p.x = x;
      p.out = out;
      p.m = m;
      p.dtype = dtype;
      p.num_threads = threads.num;
      launch_w4a16_gemm(p, threads.pool);
      return;
    }
    case LinearOp::Kind::kW8A16: {
      W8A16GemmParams p = op.w8;
      p.x = x;
      p.out = out;
      p.m = m;
      p.dtype = dtype;
      p.num_threads = threads.num;
      launch_w8a16_gemm(p, threads.pool);
      return;
    }
    case LinearOp::Kind::kDense: {
      DenseGemmParams p = op.dense;
      p.x = x;
      p.out = out;
      p.m = m;
      p.num_threads = threads.num;
      launch_dense_gemm(p, threads.pool);
      return;
    }
  }
}

// hidden's rows = the embeddings of input_ids (LlamaEmbed).
template <class T>
void embed_tokens(LlamaEmbed const& e, std::int64_t const* ids, T* hidden, int num_tokens, int d, Threads threads) {
  float const scale = e.scale;
  for_tokens(num_tokens, threads, [&](int t) {
    T* dst = hidden + std::int64_t(t) * d;
    std::int64_t const id = ids[t];
    if (e.kind == LlamaEmbed::Kind::kDense) {
      std::memcpy(dst, static_cast<T const*>(e.table) + id * d, std::size_t(d) * sizeof(T));
    } else if (e.kind == LlamaEmbed::Kind::kA8Packed) {
      thread_local std::vector<float> row;
      row.resize(std::size_t(d));
      a8_int8_row(*e.packed, id, row.data());
      for (int i = 0; i < d; ++i) dst[i] = from_float<T>(row[i]);
    } else {
      auto const* q = static_cast<std::int8_t const*>(e.table) + id * d;
      auto const* sc = static_cast<Float16 const*>(e.scales) + id * (d / e.group);
      for (int i = 0; i < d; ++i) dst[i] = from_float<T>(float(q[i]) * to_float(sc[i / e.group]));
    }
    if (scale != 0.0f) {
      for (int i = 0; i < d; ++i) dst[i] = from_float<T>(to_float(dst[i]) * scale);
    }
  });
}

}  // namespace inflight::kernels::cpu::llama_ops
