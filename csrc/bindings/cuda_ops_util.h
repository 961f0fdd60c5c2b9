// Boundary checks shared by the CUDA op bindings (cuda_ops_*.cpp). Tensors arrive as untyped
// nb::ndarray (DLPack, zero-copy, never converted: a silent copy of an output would lose the result),
// and every property is checked here with a message that names the argument, its value and what is
// allowed. Launches then run with the GIL released on the stream the caller passed.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

#include "inflight/kernels/scalar_type.h"

namespace inflight::bindings::cuda_ops {

namespace nb = nanobind;
using Tensor = nb::ndarray<>;
using inflight::kernels::ScalarType;

inline std::string shape_str(Tensor const& a) {
  std::string s = "[";
  for (std::size_t i = 0; i < a.ndim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(a.shape(i));
  }
  return s + "]";
}

inline std::string dtype_str(Tensor const& a) {
  auto const dt = a.dtype();
  switch (static_cast<nb::dlpack::dtype_code>(dt.code)) {
    case nb::dlpack::dtype_code::Int:
      return "int" + std::to_string(dt.bits);
    case nb::dlpack::dtype_code::UInt:
      return "uint" + std::to_string(dt.bits);
    case nb::dlpack::dtype_code::Float:
      return "float" + std::to_string(dt.bits);
    case nb::dlpack::dtype_code::Bfloat:
      return "bfloat" + std::to_string(dt.bits);
    case nb::dlpack::dtype_code::Bool:
      return "bool";
    default:
      return "dtype(code=" + std::to_string(dt.code) + ", bits=" + std::to_string(dt.bits) + ")";
  }
}

inline bool is_dtype(Tensor const& a, nb::dlpack::dtype_code code, int bits) {
  return a.dtype().code == static_cast<std::uint8_t>(code) && a.dtype().bits == bits && a.dtype().lanes == 1;
}

// The tensor's element type among float16 / bfloat16 / float32, or TypeError naming `name`.
inline ScalarType float_type(Tensor const& a, char const* name, bool allow_float32) {
  if (is_dtype(a, nb::dlpack::dtype_code::Float, 16)) return ScalarType::kFloat16;
  if (is_dtype(a, nb::dlpack::dtype_code::Bfloat, 16)) return ScalarType::kBFloat16;
  if (allow_float32 && is_dtype(a, nb::dlpack::dtype_code::Float, 32)) return ScalarType::kFloat32;
  throw nb::type_error((std::string(name) + " must be float16" +
                        (allow_float32 ? ", bfloat16 or float32" : " or bfloat16") + ", got " + dtype_str(a))
                           .c_str());
}

inline void require_dtype(Tensor const& a, char const* name, nb::dlpack::dtype_code code, int bits,
                          char const* expected) {
  if (!is_dtype(a, code, bits)) {
    throw nb::type_error((std::string(name) + " must be " + expected + ", got " + dtype_str(a)).c_str());
  }
}

inline void require_same_dtype(Tensor const& a, char const* name, Tensor const& ref, char const* ref_name) {
  if (a.dtype() != ref.dtype()) {
    throw nb::type_error(
        (std::string(name) + " must have the dtype of " + ref_name + " (" + dtype_str(ref) + "), got " + dtype_str(a))
            .c_str());
  }
}

inline void require_ndim(Tensor const& a, char const* name, std::size_t ndim, char const* layout) {
  if (a.ndim() != ndim) {
    throw std::invalid_argument(std::string(name) + " must be " + std::to_string(ndim) + "-D " + layout +
                                ", got shape " + shape_str(a));
  }
}

inline void require_dim(Tensor const& a, char const* name, std::size_t dim, std::int64_t expected, char const* what) {
  if (static_cast<std::int64_t>(a.shape(dim)) != expected) {
    throw std::invalid_argument(std::string(name) + ".shape[" + std::to_string(dim) + "] must be " + what + " = " +
                                std::to_string(expected) + ", got shape " + shape_str(a));
  }
}

// Dims from `first_dim` on are row-major contiguous (size-1 dims may have any stride, as torch makes them).
inline bool inner_contiguous(Tensor const& a, std::size_t first_dim) {
  std::int64_t expected = 1;
  for (std::size_t i = a.ndim(); i-- > first_dim;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= static_cast<std::int64_t>(a.shape(i));
  }
  return true;
}

inline void require_contiguous(Tensor const& a, char const* name) {
  if (a.size() > 1 && !inner_contiguous(a, 0)) {
    throw std::invalid_argument(std::string(name) + " must be contiguous (call .contiguous()), got shape " +
                                shape_str(a));
  }
}

// Contiguous except for the stride of dim 0 (a slice of a wider buffer, e.g. k out of a fused qkv).
inline void require_rows_contiguous(Tensor const& a, char const* name) {
  if (a.size() > 1 && !inner_contiguous(a, 1)) {
    throw std::invalid_argument(std::string(name) + " must be contiguous in every dimension but the first, got shape " +
                                shape_str(a));
  }
  if (a.ndim() > 0 && a.shape(0) > 1 && a.stride(0) < 0) {
    throw std::invalid_argument(std::string(name) + " must not have a negative stride");
  }
}

inline std::int64_t row_stride(Tensor const& a) {
  if (a.ndim() == 0) return 0;
  if (a.shape(0) > 1) return a.stride(0);
  std::int64_t n = 1;  // a single row: its stride is irrelevant, report the packed one
  for (std::size_t i = 1; i < a.ndim(); ++i) n *= static_cast<std::int64_t>(a.shape(i));
  return n;
}

inline void require_aligned(Tensor const& a, char const* name, std::size_t bytes) {
  if (reinterpret_cast<std::uintptr_t>(a.data()) % bytes != 0) {
    throw std::invalid_argument(std::string(name) + " must start at a " + std::to_string(bytes) +
                                "-byte aligned address (a fresh tensor or an aligned slice)");
  }
}

inline void require_positive(std::int64_t value, char const* name) {
  if (value <= 0) throw std::invalid_argument(std::string(name) + " must be > 0, got " + std::to_string(value));
}

// All tensors on one CUDA device; returns its id.
inline int common_cuda_device(std::initializer_list<std::pair<Tensor const*, char const*>> tensors) {
  int device = -1;
  char const* first = nullptr;
  for (auto const& [t, name] : tensors) {
    if (t->device_type() != nb::device::cuda::value) {
      throw std::invalid_argument(std::string(name) + " must be a CUDA tensor, got device type " +
                                  std::to_string(t->device_type()) + " (1 is CPU)");
    }
    if (device < 0) {
      device = t->device_id();
      first = name;
    } else if (t->device_id() != device) {
      throw std::invalid_argument(std::string(name) + " is on cuda:" + std::to_string(t->device_id()) + " but " +
                                  first + " is on cuda:" + std::to_string(device));
    }
  }
  return device;
}

inline void check_cuda(cudaError_t status, char const* what) {
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so the next call reports its own
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(status) + " (" +
                             cudaGetErrorString(status) + ")");
  }
}

// Makes `device` current for the launch and restores the previous device afterwards. The package's
// static CUDA runtime keeps its own notion of the current device, independent of torch's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(DeviceGuard const&) = delete;
  DeviceGuard& operator=(DeviceGuard const&) = delete;

 private:
  int previous_ = 0;
};

inline cudaStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

}  // namespace inflight::bindings::cuda_ops
