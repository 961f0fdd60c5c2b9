// The Walsh-Hadamard transform that rotates queries and keys over an INT8 KV cache (the fused layer
// stack's side of inflight.layers.attention.key_rotation_matrices; llama_layers.cpp: qk_norm_rope).
#pragma once

#include <cmath>

namespace inflight::kernels::cpu {
// Internal linkage: llama_glue_avx512f.cpp includes this with its own -m flags (see scalar_type.h).
namespace {

// The unnormalised Walsh-Hadamard transform (Sylvester order: x -> H x, H H^T = n I) of each block of n
// values of x[0 .. len), in place, in float: stage h adds and subtracts the values h apart. Blocks of 8 or
// more run the first three stages as one 8-point butterfly (the same sums in the same order) and the rest
// as loops over contiguous runs, which the compiler vectorises.
inline void hadamard_blocks(float* x, int len, int n) {
  for (int base = 0; base < len; base += n) {
    float* b = x + base;
    int h = 1;
    if (n >= 8) {
      for (int i = 0; i < n; i += 8) {
        float* p = b + i;
        float const a0 = p[0] + p[1], a1 = p[0] - p[1], a2 = p[2] + p[3], a3 = p[2] - p[3];
        float const a4 = p[4] + p[5], a5 = p[4] - p[5], a6 = p[6] + p[7], a7 = p[6] - p[7];
        float const c0 = a0 + a2, c1 = a1 + a3, c2 = a0 - a2, c3 = a1 - a3;
        float const c4 = a4 + a6, c5 = a5 + a7, c6 = a4 - a6, c7 = a5 - a7;
        p[0] = c0 + c4, p[1] = c1 + c5, p[2] = c2 + c6, p[3] = c3 + c7;
        p[4] = c0 - c4, p[5] = c1 - c5, p[6] = c2 - c6, p[7] = c3 - c7;
      }
      h = 8;
    }
    for (; h < n; h <<= 1) {
      for (int i = 0; i < n; i += 2 * h) {
        float* lo = b + i;
        float* hi = lo + h;
        for (int j = 0; j < h; ++j) {
          float const u = lo[j], v = hi[j];
          lo[j] = u + v;
          hi[j] = u - v;
        }
      }
    }
  }
}

// The scalings after hadamard_blocks of a block of n (a power of two): 2^-a on q, 2^-b on k, a + b = log2 n
// (as inflight.layers.attention.key_rotation_shifts), so q . k is unchanged.
inline void key_rotation_scales(int n, float* q_scale, float* k_scale) {
  int log = 0;
  while ((1 << log) < n) ++log;
  *q_scale = std::ldexp(1.0f, -((log + 1) / 2));
  *k_scale = std::ldexp(1.0f, -(log / 2));
}

}  // namespace
}  // namespace inflight::kernels::cpu
