// The tensor checks of every op binding, CPU (ops_*.cpp) and CUDA (cuda_ops_*.cpp), compiled into both
// modules. Tensors arrive as untyped nb::ndarray (DLPack or the buffer protocol: zero-copy and never
// converted, since a silent copy of an output would lose the result), and each property is checked
// here with one rule for both devices:
//   - a wrong dtype raises TypeError;
//   - a wrong shape, layout, device or value raises ValueError;
//   - the message names the argument, what it got and what is allowed, e.g.
//     "x must be float32, bfloat16 or float16, got float64",
//     "out must have shape [m, n] = [2, 8], got [2, 9]".
// The same mistake therefore gets the same exception and message on both devices (op_checks.h holds
// the checks an op's two bindings share).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "inflight/kernels/scalar_type.h"

namespace inflight::bindings {

namespace nb = nanobind;
using inflight::kernels::ScalarType;

// Any dtype, shape and device; writable (nanobind refuses read-only buffers for it).
using Tensor = nb::ndarray<>;
// An input that may be read-only (a numpy view); convert with Tensor(t) to check it.
using ReadOnlyTensor = nb::ndarray<nb::ro>;

// ------------------------------------------------------------------------------- strings

std::string shape_str(Tensor const& a);    // [2, 64]
std::string strides_str(Tensor const& a);  // [64, 1], in elements
std::string dtype_str(Tensor const& a);    // float32, bfloat16, int64, bool, ...
std::string device_str(Tensor const& a);   // cpu, cuda:0, ...

// ------------------------------------------------------------------------------- errors

[[noreturn]] void throw_type_error(std::string const& message);
[[noreturn]] void throw_value_error(std::string const& message);

// ------------------------------------------------------------------------------- dtypes (TypeError)

// The tensor's ScalarType; false when it has none (float64, bool, vector lanes, ...).
bool scalar_type_of(Tensor const& a, ScalarType* type);

// The tensor's dtype, one of `allowed` (listed in the message in that order): "{name} must be uint64
// or int64, got float32".
ScalarType require_dtype_in(Tensor const& a, char const* name, std::initializer_list<ScalarType> allowed);
// require_dtype_in over float types, all three by default: the float-type lookup of every op.
ScalarType float_type(Tensor const& a, char const* name,
                      std::initializer_list<ScalarType> allowed = {ScalarType::kFloat32, ScalarType::kBFloat16,
                                                                   ScalarType::kFloat16});

// "{name} must be int32, got int64".
void require_dtype(Tensor const& a, char const* name, ScalarType expected);
// "{name} must have {whose} (float32), got bfloat16", e.g. whose = "the model dtype".
void require_dtype_of(Tensor const& a, char const* name, ScalarType expected, char const* whose);
// "{name} must have the dtype of {ref_name} (float16), got float32".
void require_same_dtype(Tensor const& a, char const* name, Tensor const& ref, char const* ref_name);

// ------------------------------------------------------------------------------- shapes (ValueError)

// "{name} must be 3-D {layout}, got shape [2, 4]".
void require_ndim(Tensor const& a, char const* name, std::size_t ndim, char const* layout);
// "{name} must have shape {layout} = [8, 4], got [8, 2]" (also for a wrong number of dimensions).
void require_shape(Tensor const& a, char const* name, std::initializer_list<std::int64_t> shape, char const* layout);
// "{name}.shape[2] must be {what} = 64, got shape [2, 4, 96]".
void require_dim(Tensor const& a, char const* name, std::size_t dim, std::int64_t expected, char const* what);
// A column: dtype, shape [length] ({layout} names it, e.g. "[N]"), contiguous.
void require_vector(Tensor const& a, char const* name, ScalarType dtype, std::int64_t length, char const* layout);

// ------------------------------------------------------------------------------- layout (ValueError)

// Row-major contiguous from dimension `first_dim` on (size-1 dimensions may have any stride, as torch
// makes them), and no negative stride before it. Empty tensors pass.
void require_contiguous(Tensor const& a, char const* name, std::size_t first_dim = 0);
// Elements between rows (dimension 0); the packed row size when there is at most one row.
std::int64_t row_stride(Tensor const& a);
// The data pointer is a multiple of `bytes`.
void require_aligned(Tensor const& a, char const* name, std::size_t bytes);

// ------------------------------------------------------------------------------- values (ValueError)

// "{name} must be >= {minimum}, got {value}".
void require_at_least(std::int64_t value, std::int64_t minimum, char const* name);

// ------------------------------------------------------------------------------- devices (ValueError)

// A tensor argument and its name; a null tensor (an absent optional) is skipped.
struct NamedTensor {
  Tensor const* tensor;
  char const* name;
};

// "{name} must be a CPU tensor, got cuda:0".
void require_cpu(std::span<NamedTensor const> tensors);
inline void require_cpu(std::initializer_list<NamedTensor> tensors) { require_cpu({tensors.begin(), tensors.size()}); }
// The layout the CPU kernels read: each tensor contiguous (require_contiguous), then all on the CPU.
void require_cpu_contiguous(std::initializer_list<NamedTensor> tensors);
// All on one CUDA device ("{name} must be a CUDA tensor, got cpu", "{name} is on cuda:1 but {first} is
// on cuda:0"); returns its id.
int require_one_cuda_device(std::span<NamedTensor const> tensors);
inline int require_one_cuda_device(std::initializer_list<NamedTensor> tensors) {
  return require_one_cuda_device({tensors.begin(), tensors.size()});
}

}  // namespace inflight::bindings
