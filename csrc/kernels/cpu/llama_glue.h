// The elementwise glue of the fused layer stack (llama_layers.cpp) and of the MoE experts: RMSNorm in
// torch's summation order, QK-norm + RoPE, dtype conversions, residual adds and the gated activations.
// Plain C++ that the compiler vectorises for the ISA of the file that includes it: llama_layers.cpp
// (baseline) and llama_glue_avx512f.cpp (AVX-512: a bf16 RMSNorm of a 576-wide row in 0.30 us against
// the baseline copy's 0.67 on a Zen 4 EPYC). Both must compute the same bits: the norms match
// torch's only without FMA contraction, so a file built with FMA available compiles this with
// -ffp-contract=off (CMakeLists.txt), and every function here has internal linkage (the linker must
// not merge an AVX-512 copy into the baseline file's calls; see scalar_type.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "activation.h"
#include "attention.h"
#include "cpu_features.h"
#include "hadamard.h"
#include "inflight/kernels/scalar_type.h"
#include "thread_pool.h"

namespace inflight::kernels::cpu {

// The step's threads: at most `num` of the pool's. Outside llama_glue, so that argument-dependent
// lookup of the glue's calls in llama_ops (llama_layers_ops.h) does not also find llama_glue's.
struct Threads {
  ThreadPool& pool;
  int num;
};

}  // namespace inflight::kernels::cpu

namespace inflight::kernels::cpu::llama_glue {
namespace {

// Rounds an fp32 value to the storage type and back: the value torch would hold after an op.
template <class T>
inline float rnd(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return to_float(from_float<T>(v));
  }
}

// Tokens per thread below which the elementwise glue stays on one thread.
constexpr int kMinTokensPerThread = 16;

template <class F>
void for_tokens(int num_tokens, Threads t, F&& f) {
  int const threads = std::max(1, std::min(t.num, num_tokens / kMinTokensPerThread));
  pool_detail::parallel_for(t.pool, num_tokens, threads, false, [&](std::int64_t i, int) { f(int(i)); });
}

// sum(x * x) over a row of d values in fp32, in the order torch sums a contiguous row
// (aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum), so that
// the normalisation agrees bit for bit with F.rms_norm (on the CPU x * rsqrt(mean(x.pow(2)) + eps)):
// vectors of 8 floats (torch runs its AVX2 sum kernel on AVX-512 machines too), 4 accumulators over
// interleaved vectors, cascaded in levels of 16 (or more) steps for long rows; then the vectors past the
// last whole step into the first accumulator, the accumulators in order, and the row's scalar tail
// followed by the 8 lanes in order. No FMA (no contraction in either copy, see above): each square
// is rounded before it is added, as x.pow(2) is.
template <class T>
inline float sum_squares(T const* row, int d) {
  constexpr int kW = 8, kIlp = 4, kLevels = 4;
  int const nvec = d / kW;
  int const steps = nvec / kIlp;
  int ceil_log2 = 0;
  while ((1 << ceil_log2) < steps) ++ceil_log2;
  int const level_power = std::max(4, ceil_log2 / kLevels);
  int const level_step = 1 << level_power;
  int const level_mask = level_step - 1;
  float acc[kLevels][kIlp][kW] = {};
  auto add_vec = [&](float* dst, int v) {
    for (int l = 0; l < kW; ++l) {
      float const x = to_float(row[v * kW + l]);
      dst[l] += x * x;
    }
  };
  // One step: the kIlp vectors of step i into the kIlp accumulators, as one loop over their kIlp * kW
  // contiguous lanes (each lane's sum in the same order; the compiler vectorises this form).
  auto add_step = [&](int i) {
    float* dst = &acc[0][0][0];
    T const* src = row + std::int64_t(i) * kIlp * kW;
    for (int l = 0; l < kIlp * kW; ++l) {
      float const x = to_float(src[l]);
      dst[l] += x * x;
    }
  };
  int i = 0;
  while (i + level_step <= steps) {
    for (int j = 0; j < level_step; ++j, ++i) add_step(i);
    for (int lv = 1; lv < kLevels; ++lv) {
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < kW; ++l) {
          acc[lv][k][l] += acc[lv - 1][k][l];
          acc[lv - 1][k][l] = 0.0f;
        }
      if ((i & (level_mask << (lv * level_power))) != 0) break;
    }
  }
  for (; i < steps; ++i) add_step(i);
  for (int lv = 1; lv < kLevels; ++lv)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < kW; ++l) acc[0][k][l] += acc[lv][k][l];
  for (int v = steps * kIlp; v < nvec; ++v) add_vec(acc[0][0], v);
  for (int k = 1; k < kIlp; ++k)
    for (int l = 0; l < kW; ++l) acc[0][0][l] += acc[0][k][l];
  float sum = 0.0f;
  for (int j = nvec * kW; j < d; ++j) {
    float const x = to_float(row[j]);
    sum += x * x;
  }
  for (int l = 0; l < kW; ++l) sum += acc[0][0][l];
  return sum;
}

// 1 / rms(x) of a row of d values in fp32: rsqrt(mean(x^2) + eps), the mean a division by d.
template <class T>
inline float inv_rms(T const* row, int d, float eps) {
  return 1.0f / std::sqrt(sum_squares(row, d) / float(d) + eps);
}

// One normalised element, x * r the fp32 normalisation. Llama's (inflight.layers.norm.rms_norm):
// rounded to T, then scaled by the weight (one more rounding). Gemma's (GemmaRMSNorm): scaled by
// 1 + weight in fp32, then rounded once.
template <class T, bool kGemma>
inline T norm_elem(float x, float r, T w) {
  if constexpr (kGemma) {
    float const normed = x * r;
    return from_float<T>(normed * (1.0f + to_float(w)));
  } else {
    return from_float<T>(to_float(w) * rnd<T>(x * r));
  }
}

// One row of rms_norm: dst = norm(row) (kAdd: dst += norm(row)), r its 1 / rms.
template <class T, bool kGemma, bool kAdd>
void norm_row(T const* row, T const* weight, T* dst, int d, float r) {
  for (int i = 0; i < d; ++i) {
    if constexpr (kAdd) {
      dst[i] = from_float<T>(to_float(dst[i]) + to_float(norm_elem<T, kGemma>(to_float(row[i]), r, weight[i])));
    } else {  // not a ternary: a struct-valued one is a copy through memory, which GCC does not vectorise
      dst[i] = norm_elem<T, kGemma>(to_float(row[i]), r, weight[i]);
    }
  }
}

// out = norm(x) (kAdd: out += norm(x), the residual add of a normed branch, one more rounding). rows:
// out's row t is the norm of x's row rows[t] (a gather); null: of row t.
template <class T, bool kGemma, bool kAdd = false>
void rms_norm(T const* x, T const* weight, T* out, int num_tokens, int d, float eps, Threads threads,
              std::int64_t const* rows = nullptr) {
  for_tokens(num_tokens, threads, [&](int t) {
    T const* row = x + (rows != nullptr ? rows[t] : std::int64_t(t)) * d;
    norm_row<T, kGemma, kAdd>(row, weight, out + std::int64_t(t) * d, d, inv_rms(row, d, eps));
  });
}

// RoPE (rotate-half) on the q and k heads of each qkv row, in place: x*cos + roll(x, hd/2)*signed_sin,
// each product and the sum rounded to T (three torch ops in the Python layer). With q_norm / k_norm
// (QK-norm) each head is first normalised (its rounding points kept: RoPE reads the rounded values).
// key_rotation > 0 (an INT8 cache): each rotated head is then turned by the Walsh-Hadamard block
// (hadamard.h) and scaled, q by 2^-a and k by 2^-b, before one rounding to T. positions: token t
// reads cos_sin's row positions[t] (a whole table); null: row t.
template <class T, bool kGemma>
void qk_norm_rope(T* qkv, std::int64_t row_stride, T const* cos_sin, std::int64_t const* positions, int num_tokens,
                  int num_heads, int num_kv_heads, int head_dim, T const* q_norm, T const* k_norm, float eps,
                  int key_rotation, Threads threads) {
  int const half = head_dim / 2;
  float q_rot_scale = 1.0f, k_rot_scale = 1.0f;
  if (key_rotation > 0) key_rotation_scales(key_rotation, &q_rot_scale, &k_rot_scale);
  for_tokens(num_tokens, threads, [&](int t) {
    T const* cs = cos_sin + (positions != nullptr ? positions[t] : std::int64_t(t)) * 2 * head_dim;
    float cosv[kMaxHeadDim], sinv[kMaxHeadDim], x[kMaxHeadDim];
    for (int i = 0; i < head_dim; ++i) {
      cosv[i] = to_float(cs[i]);
      sinv[i] = to_float(cs[head_dim + i]);
    }
    T* row = qkv + std::int64_t(t) * row_stride;
    for (int h = 0; h < num_heads + num_kv_heads; ++h) {
      T* head = row + std::int64_t(h) * head_dim;
      if (q_norm != nullptr) {
        T const* w = h < num_heads ? q_norm : k_norm;
        float const r = inv_rms(head, head_dim, eps);
        for (int i = 0; i < head_dim; ++i) x[i] = to_float(norm_elem<T, kGemma>(to_float(head[i]), r, w[i]));
      } else {
        for (int i = 0; i < head_dim; ++i) x[i] = to_float(head[i]);
      }
      if (key_rotation == 0) {
        for (int i = 0; i < head_dim; ++i) {
          int const src = i < half ? i + half : i - half;
          head[i] = from_float<T>(rnd<T>(x[i] * cosv[i]) + rnd<T>(x[src] * sinv[i]));
        }
      } else {  // an INT8 cache: rotate the RoPE'd head (rounded to T, as the Python layer)
        float y[kMaxHeadDim];
        for (int i = 0; i < head_dim; ++i) {
          int const src = i < half ? i + half : i - half;
          y[i] = to_float(from_float<T>(rnd<T>(x[i] * cosv[i]) + rnd<T>(x[src] * sinv[i])));
        }
        hadamard_blocks(y, head_dim, key_rotation);
        float const sc = h < num_heads ? q_rot_scale : k_rot_scale;
        for (int i = 0; i < head_dim; ++i) head[i] = from_float<T>(y[i] * sc);
      }
    }
  });
}

// dst = src for rows x width values, each rounded to To as torch's .to() rounds (nearest even).
template <class From, class To>
void convert_n(From const* src, To* dst, int rows, int width, Threads threads) {
  for_tokens(rows, threads, [&](int t) {
    From const* a = src + std::int64_t(t) * width;
    To* b = dst + std::int64_t(t) * width;
    for (int i = 0; i < width; ++i) b[i] = from_float<To>(to_float(a[i]));
  });
}

// A float cache of another dtype than the model's: rows of T into that dtype, and back.
template <class T>
void convert_rows(T const* src, void* dst, ScalarType dst_dtype, int rows, int width, Threads threads) {
  dispatch_float_type(dst_dtype, [&](auto d) {
    using D = decltype(d);
    convert_n<T, D>(src, static_cast<D*>(dst), rows, width, threads);
  });
}

template <class T>
void convert_rows_back(void const* src, ScalarType src_dtype, T* dst, int rows, int width, Threads threads) {
  dispatch_float_type(src_dtype, [&](auto d) {
    using D = decltype(d);
    convert_n<D, T>(static_cast<D const*>(src), dst, rows, width, threads);
  });
}

template <class T>
void add_into(T* hidden, T const* y, int num_tokens, int d, Threads threads) {
  for_tokens(num_tokens, threads, [&](int t) {
    T* h = hidden + std::int64_t(t) * d;
    T const* src = y + std::int64_t(t) * d;
    for (int i = 0; i < d; ++i) h[i] = from_float<T>(to_float(h[i]) + to_float(src[i]));
  });
}

// F.gelu(x, approximate="tanh") in fp32, in torch's CPU kernel's order of operations.
inline float gelu_tanh(float x) {
  constexpr float kBeta = float(M_SQRT2 * M_2_SQRTPI * 0.5);
  constexpr float kKappa = 0.044715f;
  float const cube = x * x * x;
  float const inner = kBeta * (x + kKappa * cube);
  return 0.5f * x * (1.0f + std::tanh(inner));
}

// inter = act(gate) * up, gate and up the two halves of each gate_up row (F.silu or F.gelu, then a
// multiply: two roundings to T). kGelu: GeGLU (Gemma), else SwiGLU.
// On AVX-512 the activations are vectorised (activation.h: within an ulp or two, as libm's), in
// pieces of kActChunk elements.
template <class T, bool kGelu>
void act_mul(T const* gate_up, T* inter, int num_tokens, int n, Threads threads) {
  constexpr int kActChunk = 256;
  bool const vector = selected_isa() >= Isa::kAvx512F;
  for_tokens(num_tokens, threads, [&](int t) {
    T const* g = gate_up + std::int64_t(t) * 2 * n;
    T const* u = g + n;
    T* out = inter + std::int64_t(t) * n;
    if (!vector) {
      for (int i = 0; i < n; ++i) {
        float const gv = to_float(g[i]);
        float const a = kGelu ? gelu_tanh(gv) : gv / (1.0f + std::exp(-gv));
        out[i] = from_float<T>(rnd<T>(a) * to_float(u[i]));
      }
      return;
    }
    float a[kActChunk];
    for (int i0 = 0; i0 < n; i0 += kActChunk) {
      int const len = std::min(kActChunk, n - i0);
      for (int i = 0; i < len; ++i) a[i] = to_float(g[i0 + i]);
      gated_activation_avx512f(a, a, len, kGelu);
      for (int i = 0; i < len; ++i) out[i0 + i] = from_float<T>(rnd<T>(a[i]) * to_float(u[i0 + i]));
    }
  });
}

}  // namespace
}  // namespace inflight::kernels::cpu::llama_glue
