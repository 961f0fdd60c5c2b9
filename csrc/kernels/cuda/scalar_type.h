// ScalarType: the element types the CUDA launchers dispatch on. Host-only header (no CUDA types), so
// the bindings can name a dtype without including cuda_fp16.h.
#pragma once

namespace inflight::kernels::cuda {

enum class ScalarType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

inline char const* scalar_type_name(ScalarType t) {
  switch (t) {
    case ScalarType::kFloat16: return "float16";
    case ScalarType::kBFloat16: return "bfloat16";
    case ScalarType::kFloat32: return "float32";
  }
  return "unknown";
}

}  // namespace inflight::kernels::cuda
