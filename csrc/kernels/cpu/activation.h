// The gated MLP's activations over a row of fp32 values, vectorised: SiLU (x / (1 + exp(-x))) and
// tanh-approximate GELU (0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))). The fused layer stack
// (llama_layers.cpp) calls them on AVX-512 CPUs; elsewhere it keeps libm's exp / tanh, one element at
// a time (~4 / ~17 ns each on Zen 4: a Gemma 3 prefill spent a fifth of its time in tanhf).
//
// exp: Cody-Waite reduction by ln 2 (two constants, FMA), Cephes' degree-6 polynomial, VSCALEFPS
// (within 1 ulp); GELU through 0.5 (1 + tanh(z)) = 1 / (1 + e^(-2z)): one exp, and none of the tanh
// form's cancellation below x ~ -2. Both within 4 ulp of float64 given the fp32 argument
// (tests/cpp/test_cpu_kernels.cpp), about as libm's forms, which the portable path runs: the layer
// stack's results differ from the Python layers' (torch: SLEEF) by an ulp now and then either way.
// Elementwise, so batch-invariant.
#pragma once

#include <cstdint>

namespace inflight::kernels::cpu {

// out[i] = silu(x[i]) or gelu_tanh(x[i]) (gelu) for i < n; out may alias x. AVX-512F (activation_avx512f.cpp).
void gated_activation_avx512f(float const* x, float* out, std::int64_t n, bool gelu);

}  // namespace inflight::kernels::cpu
