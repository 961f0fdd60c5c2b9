// The tensor checks of the op bindings (see tensor_checks.h).
#include "tensor_checks.h"

#include <utility>
#include <vector>

namespace inflight::bindings {
namespace {

using inflight::kernels::scalar_type_name;
using Code = nb::dlpack::dtype_code;

std::string join(std::vector<std::int64_t> const& values) {
  std::string s = "[";
  for (std::size_t i = 0; i < values.size(); ++i) s += (i ? ", " : "") + std::to_string(values[i]);
  return s + "]";
}

std::vector<std::int64_t> shape_of(Tensor const& a) {
  std::vector<std::int64_t> s(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) s[i] = static_cast<std::int64_t>(a.shape(i));
  return s;
}

// "float32, bfloat16 or float16".
std::string one_of(std::initializer_list<ScalarType> types) {
  std::string s;
  std::size_t i = 0;
  for (ScalarType t : types) {
    if (i > 0) s += i + 1 == types.size() ? " or " : ", ";
    s += scalar_type_name(t);
    ++i;
  }
  return s;
}

std::string strides_and_shape(Tensor const& a) {
  return "got strides " + strides_str(a) + " for shape " + shape_str(a);
}

}  // namespace

std::string shape_str(Tensor const& a) { return join(shape_of(a)); }

std::string strides_str(Tensor const& a) {
  std::vector<std::int64_t> s(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) s[i] = static_cast<std::int64_t>(a.stride(i));
  return join(s);
}

std::string dtype_str(Tensor const& a) {
  nb::dlpack::dtype const d = a.dtype();
  auto const code = static_cast<Code>(d.code);
  if (code == Code::Bool) return "bool";
  static constexpr std::pair<Code, char const*> kKinds[] = {{Code::Int, "int"},
                                                            {Code::UInt, "uint"},
                                                            {Code::Float, "float"},
                                                            {Code::Bfloat, "bfloat"},
                                                            {Code::Complex, "complex"}};
  for (auto const& [c, kind] : kKinds) {
    if (c == code) return kind + std::to_string(d.bits) + (d.lanes != 1 ? "x" + std::to_string(d.lanes) : "");
  }
  return "dtype(code=" + std::to_string(d.code) + ", bits=" + std::to_string(d.bits) + ")";
}

std::string device_str(Tensor const& a) {
  if (a.device_type() == nb::device::cpu::value) return "cpu";
  if (a.device_type() == nb::device::cuda::value) return "cuda:" + std::to_string(a.device_id());
  return "device type " + std::to_string(a.device_type());
}

void throw_type_error(std::string const& message) { throw nb::type_error(message.c_str()); }

void throw_value_error(std::string const& message) { throw nb::value_error(message.c_str()); }

bool scalar_type_of(Tensor const& a, ScalarType* type) {
  nb::dlpack::dtype const d = a.dtype();
  if (d.lanes != 1) return false;
  auto const code = static_cast<Code>(d.code);
  struct Entry {
    Code code;
    int bits;
    ScalarType type;
  };
  static constexpr Entry kTypes[] = {
      {Code::Float, 32, ScalarType::kFloat32}, {Code::Bfloat, 16, ScalarType::kBFloat16},
      {Code::Float, 16, ScalarType::kFloat16}, {Code::Int, 8, ScalarType::kInt8},
      {Code::UInt, 8, ScalarType::kUInt8},     {Code::Int, 32, ScalarType::kInt32},
      {Code::Int, 64, ScalarType::kInt64},     {Code::UInt, 64, ScalarType::kUInt64},
  };
  for (Entry const& e : kTypes) {
    if (e.code == code && e.bits == d.bits) {
      *type = e.type;
      return true;
    }
  }
  return false;
}

ScalarType float_type(Tensor const& a, char const* name, std::initializer_list<ScalarType> allowed) {
  return require_dtype_in(a, name, allowed);
}

ScalarType require_dtype_in(Tensor const& a, char const* name, std::initializer_list<ScalarType> allowed) {
  ScalarType t;
  if (scalar_type_of(a, &t)) {
    for (ScalarType ok : allowed) {
      if (t == ok) return t;
    }
  }
  throw_type_error(std::string(name) + " must be " + one_of(allowed) + ", got " + dtype_str(a));
}

void require_dtype(Tensor const& a, char const* name, ScalarType expected) {
  ScalarType t;
  if (!scalar_type_of(a, &t) || t != expected) {
    throw_type_error(std::string(name) + " must be " + scalar_type_name(expected) + ", got " + dtype_str(a));
  }
}

void require_dtype_of(Tensor const& a, char const* name, ScalarType expected, char const* whose) {
  ScalarType t;
  if (!scalar_type_of(a, &t) || t != expected) {
    throw_type_error(std::string(name) + " must have " + whose + " (" + scalar_type_name(expected) + "), got " +
                     dtype_str(a));
  }
}

void require_same_dtype(Tensor const& a, char const* name, Tensor const& ref, char const* ref_name) {
  if (a.dtype() != ref.dtype()) {
    throw_type_error(std::string(name) + " must have the dtype of " + ref_name + " (" + dtype_str(ref) + "), got " +
                     dtype_str(a));
  }
}

void require_ndim(Tensor const& a, char const* name, std::size_t ndim, char const* layout) {
  if (a.ndim() != ndim) {
    throw_value_error(std::string(name) + " must be " + std::to_string(ndim) + "-D " + layout + ", got shape " +
                      shape_str(a));
  }
}

void require_shape(Tensor const& a, char const* name, std::initializer_list<std::int64_t> shape, char const* layout) {
  std::vector<std::int64_t> const want(shape);
  if (shape_of(a) != want) {
    throw_value_error(std::string(name) + " must have shape " + layout + " = " + join(want) + ", got " + shape_str(a));
  }
}

void require_dim(Tensor const& a, char const* name, std::size_t dim, std::int64_t expected, char const* what) {
  if (static_cast<std::int64_t>(a.shape(dim)) != expected) {
    throw_value_error(std::string(name) + ".shape[" + std::to_string(dim) + "] must be " + what + " = " +
                      std::to_string(expected) + ", got shape " + shape_str(a));
  }
}

void require_vector(Tensor const& a, char const* name, ScalarType dtype, std::int64_t length, char const* layout) {
  require_dtype(a, name, dtype);
  require_shape(a, name, {length}, layout);
  require_contiguous(a, name);
}

void require_contiguous(Tensor const& a, char const* name, std::size_t first_dim) {
  if (a.size() == 0) return;
  std::int64_t expected = 1;
  for (std::size_t i = a.ndim(); i-- > first_dim;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) {
      std::string const where =
          first_dim == 0 ? "" : " in dimensions " + std::to_string(first_dim) + " .. " + std::to_string(a.ndim() - 1);
      throw_value_error(std::string(name) + " must be contiguous (row-major)" + where + ", " + strides_and_shape(a));
    }
    expected *= static_cast<std::int64_t>(a.shape(i));
  }
  for (std::size_t i = 0; i < first_dim && i < a.ndim(); ++i) {
    if (a.shape(i) > 1 && a.stride(i) < 0) {
      throw_value_error(std::string(name) + " must not have a negative stride, " + strides_and_shape(a));
    }
  }
}

std::int64_t row_stride(Tensor const& a) {
  if (a.ndim() == 0) return 0;
  if (a.shape(0) > 1) return a.stride(0);
  std::int64_t n = 1;  // a single row: its stride is irrelevant, report the packed one
  for (std::size_t i = 1; i < a.ndim(); ++i) n *= static_cast<std::int64_t>(a.shape(i));
  return n;
}

void require_aligned(Tensor const& a, char const* name, std::size_t bytes) {
  if (reinterpret_cast<std::uintptr_t>(a.data()) % bytes != 0) {
    throw_value_error(std::string(name) + " must start at a " + std::to_string(bytes) +
                      "-byte aligned address (a fresh tensor or an aligned slice)");
  }
}

void require_at_least(std::int64_t value, std::int64_t minimum, char const* name) {
  if (value < minimum) {
    throw_value_error(std::string(name) + " must be >= " + std::to_string(minimum) + ", got " + std::to_string(value));
  }
}

void require_cpu(std::span<NamedTensor const> tensors) {
  for (auto const& [t, name] : tensors) {
    if (t != nullptr && t->device_type() != nb::device::cpu::value) {
      throw_value_error(std::string(name) + " must be a CPU tensor, got " + device_str(*t) +
                        " (the CUDA ops are in inflight._C_cuda)");
    }
  }
}

void require_cpu_contiguous(std::initializer_list<NamedTensor> tensors) {
  for (auto const& [t, name] : tensors) {
    if (t != nullptr) require_contiguous(*t, name);
  }
  require_cpu(tensors);
}

int require_one_cuda_device(std::span<NamedTensor const> tensors) {
  int device = -1;
  char const* first = nullptr;
  for (auto const& [t, name] : tensors) {
    if (t == nullptr) continue;
    if (t->device_type() != nb::device::cuda::value) {
      throw_value_error(std::string(name) + " must be a CUDA tensor, got " + device_str(*t));
    }
    if (device < 0) {
      device = t->device_id();
      first = name;
    } else if (t->device_id() != device) {
      throw_value_error(std::string(name) + " is on " + device_str(*t) + " but " + first +
                        " is on cuda:" + std::to_string(device));
    }
  }
  return device;
}

}  // namespace inflight::bindings
