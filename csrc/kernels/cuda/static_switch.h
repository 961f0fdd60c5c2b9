// Compile-time dispatch in the style of FlashAttention-2's static_switch.h: each macro turns one
// run-time value into a constexpr name visible inside the lambda body, over an explicit, small list of
// instantiations. A value outside the list makes the launcher return cudaErrorInvalidValue; the
// bindings validate first, so that only happens on a programming error.
//
//   SCALAR_TYPE_SWITCH(dtype, T, [&] { return launch<T>(params, stream); });
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "inflight/kernels/scalar_type.h"

// T: half or __nv_bfloat16 (the tensor-core paths); float32 is rejected.
#define HALF_TYPE_SWITCH(DTYPE, T, ...)                  \
  [&]() -> cudaError_t {                                 \
    switch (DTYPE) {                                     \
      case ::inflight::kernels::ScalarType::kFloat16: {  \
        using T = half;                                  \
        return __VA_ARGS__();                            \
      }                                                  \
      case ::inflight::kernels::ScalarType::kBFloat16: { \
        using T = __nv_bfloat16;                         \
        return __VA_ARGS__();                            \
      }                                                  \
      default:                                           \
        return cudaErrorInvalidValue;                    \
    }                                                    \
  }()

// T: half, __nv_bfloat16 or float.
#define SCALAR_TYPE_SWITCH(DTYPE, T, ...)                       \
  [&]() -> cudaError_t {                                        \
    if ((DTYPE) == ::inflight::kernels::ScalarType::kFloat32) { \
      using T = float;                                          \
      return __VA_ARGS__();                                     \
    }                                                           \
    return HALF_TYPE_SWITCH(DTYPE, T, __VA_ARGS__);             \
  }()

// kHeadDim: 64 or 128, the head sizes the attention kernels are instantiated for.
#define HEAD_DIM_SWITCH(HEAD_DIM, kHeadDim, ...) \
  [&]() -> cudaError_t {                         \
    if ((HEAD_DIM) == 64) {                      \
      constexpr int kHeadDim = 64;               \
      return __VA_ARGS__();                      \
    }                                            \
    if ((HEAD_DIM) == 128) {                     \
      constexpr int kHeadDim = 128;              \
      return __VA_ARGS__();                      \
    }                                            \
    return cudaErrorInvalidValue;                \
  }()

#define BOOL_SWITCH(COND, CONST_NAME, ...) \
  [&]() -> cudaError_t {                   \
    if (COND) {                            \
      constexpr bool CONST_NAME = true;    \
      return __VA_ARGS__();                \
    }                                      \
    constexpr bool CONST_NAME = false;     \
    return __VA_ARGS__();                  \
  }()
