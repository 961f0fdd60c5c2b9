// Shared by the GEMM bindings (ops_gemm.cpp) and the fused decoder-layer binding (ops_llama.cpp):
// dtype/shape checks with messages naming the argument, and the weight objects validated and
// imported once (W4A16Weight, W8A16Weight).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dense_gemm.h"
#include "gemm.h"

namespace inflight::bindings::gemm {

namespace nb = nanobind;
namespace kc = inflight::kernels::cpu;
namespace ik = inflight::kernels;

using Array = nb::ndarray<nb::device::cpu, nb::c_contig>;

inline std::string dtype_str(nb::dlpack::dtype d) {
  char const* code = "?";
  switch (static_cast<nb::dlpack::dtype_code>(d.code)) {
    case nb::dlpack::dtype_code::Int:
      code = "int";
      break;
    case nb::dlpack::dtype_code::UInt:
      code = "uint";
      break;
    case nb::dlpack::dtype_code::Float:
      code = "float";
      break;
    case nb::dlpack::dtype_code::Bfloat:
      code = "bfloat";
      break;
    default:
      break;
  }
  return std::string(code) + std::to_string(d.bits);
}

// Any nanobind ndarray (contiguous or strided): only its dtype is read.
template <class A>
inline ik::ScalarType float_type(A const& a, char const* name) {
  nb::dlpack::dtype const d = a.dtype();
  if (d.lanes == 1 && d.bits == 32 && d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float)) {
    return ik::ScalarType::kFloat32;
  }
  if (d.lanes == 1 && d.bits == 16 && d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat)) {
    return ik::ScalarType::kBFloat16;
  }
  if (d.lanes == 1 && d.bits == 16 && d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float)) {
    return ik::ScalarType::kFloat16;
  }
  throw std::invalid_argument(std::string(name) + " must be float32, bfloat16 or float16, got " + dtype_str(d));
}

inline void check_int_type(Array const& a, char const* name, nb::dlpack::dtype_code code) {
  nb::dlpack::dtype const d = a.dtype();
  if (d.lanes != 1 || d.bits != 8 || d.code != static_cast<std::uint8_t>(code)) {
    throw std::invalid_argument(std::string(name) + " must be " +
                                (code == nb::dlpack::dtype_code::UInt ? "uint8" : "int8") + ", got " + dtype_str(d));
  }
}

inline std::string shape_str(std::vector<std::int64_t> const& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

inline void check_shape(Array const& a, char const* name, std::vector<std::int64_t> const& want) {
  std::vector<std::int64_t> got(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) got[i] = static_cast<std::int64_t>(a.shape(i));
  if (got != want) {
    throw std::invalid_argument(std::string(name) + " must have shape " + shape_str(want) + ", got " + shape_str(got));
  }
}

inline void check_ndim(Array const& a, char const* name, std::size_t ndim) {
  if (a.ndim() != ndim) {
    throw std::invalid_argument(std::string(name) + " must be " + std::to_string(ndim) + "-D, got " +
                                std::to_string(a.ndim()) + "-D");
  }
}

// Shapes that depend on group_size; a group_size the launcher will reject is left to its message.
inline bool groups_known(std::int64_t k, int group_size) { return group_size > 0 && k % group_size == 0; }

// Checks x [m, k] and out [m, n] (one dtype; the bias, if any, must share it); sets m and x_type.
inline void bind_x_out(Array const& x, Array const& out, std::int64_t k, std::int64_t n, bool has_bias,
                       ik::ScalarType bias_type, std::int64_t& m, ik::ScalarType& x_type) {
  check_ndim(x, "x", 2);
  x_type = float_type(x, "x");
  m = static_cast<std::int64_t>(x.shape(0));
  if (static_cast<std::int64_t>(x.shape(1)) != k) {
    throw std::invalid_argument("x must have shape [m, " + std::to_string(k) + "], got [" + std::to_string(m) + ", " +
                                std::to_string(x.shape(1)) + "]");
  }
  if (float_type(out, "out") != x_type) {
    throw std::invalid_argument("out must have the dtype of x (" + std::string(ik::scalar_type_name(x_type)) + ")");
  }
  check_shape(out, "out", {m, n});
  if (has_bias && bias_type != x_type) {
    throw std::invalid_argument("bias must have the dtype of x (" + std::string(ik::scalar_type_name(x_type)) + ")");
  }
}

// Weights validated and imported once (DLPack costs ~2 us per tensor per call from torch); each call
// then passes only x and out. Holding the arrays keeps the tensors' memory alive; in-place writes to
// them are seen, replacing them (e.g. moving the module) needs a new object.
class W4A16Weight {
 public:
  W4A16Weight(Array qweight, Array scales, std::optional<Array> offsets, int group_size, std::optional<Array> bias)
      : qweight_(std::move(qweight)), scales_(std::move(scales)), offsets_(std::move(offsets)), bias_(std::move(bias)) {
    check_ndim(qweight_, "qweight", 2);
    check_int_type(qweight_, "qweight", nb::dlpack::dtype_code::UInt);
    p_.n = static_cast<std::int64_t>(qweight_.shape(0));
    p_.k = static_cast<std::int64_t>(qweight_.shape(1)) * 2;
    p_.group_size = group_size;
    p_.scale_type = float_type(scales_, "scales");
    if (groups_known(p_.k, group_size)) check_shape(scales_, "scales", {p_.n, p_.k / group_size});
    if (offsets_) {
      if (float_type(*offsets_, "offsets") != p_.scale_type) {
        throw std::invalid_argument("offsets must have the dtype of scales (" +
                                    std::string(ik::scalar_type_name(p_.scale_type)) + ")");
      }
      if (groups_known(p_.k, group_size)) check_shape(*offsets_, "offsets", {p_.n, p_.k / group_size});
      p_.offsets = offsets_->data();
    }
    if (bias_) {
      bias_type_ = float_type(*bias_, "bias");
      check_shape(*bias_, "bias", {p_.n});
      p_.bias = bias_->data();
    }
    p_.qweight = static_cast<std::uint8_t const*>(qweight_.data());
    p_.scales = scales_.data();
    // Validate the rest (group_size, k) now, with a placeholder call shape.
    kc::W4A16GemmParams probe = p_;
    probe.m = 0;
    kc::launch_w4a16_gemm(probe, kc::ThreadPool::global());
  }

  void gemm(Array x, Array out, int num_threads) const {
    kc::W4A16GemmParams p = p_;
    p.num_threads = num_threads;
    bind_x_out(x, out, p.k, p.n, bias_.has_value(), bias_type_, p.m, p.dtype);
    p.x = x.data();
    p.out = out.data();
    nb::gil_scoped_release release;
    kc::launch_w4a16_gemm(p, kc::ThreadPool::global());
  }

  std::int64_t n() const { return p_.n; }
  std::int64_t k() const { return p_.k; }
  int group_size() const { return p_.group_size; }
  // The validated params (x, out, m, x_type and num_threads are the caller's to fill).
  kc::W4A16GemmParams const& params() const { return p_; }
  bool has_bias() const { return bias_.has_value(); }
  ik::ScalarType bias_type() const { return bias_type_; }

 private:
  Array qweight_, scales_;
  std::optional<Array> offsets_, bias_;
  ik::ScalarType bias_type_ = ik::ScalarType::kFloat32;
  kc::W4A16GemmParams p_;
};

class W8A16Weight {
 public:
  W8A16Weight(Array qweight, Array scales, int group_size, std::optional<Array> bias)
      : qweight_(std::move(qweight)), scales_(std::move(scales)), bias_(std::move(bias)) {
    check_ndim(qweight_, "qweight", 2);
    check_int_type(qweight_, "qweight", nb::dlpack::dtype_code::Int);
    p_.n = static_cast<std::int64_t>(qweight_.shape(0));
    p_.k = static_cast<std::int64_t>(qweight_.shape(1));
    p_.group_size = group_size;
    p_.scale_type = float_type(scales_, "scales");
    if (groups_known(p_.k, group_size)) check_shape(scales_, "scales", {p_.n, p_.k / group_size});
    if (bias_) {
      bias_type_ = float_type(*bias_, "bias");
      check_shape(*bias_, "bias", {p_.n});
      p_.bias = bias_->data();
    }
    p_.qweight = static_cast<std::int8_t const*>(qweight_.data());
    p_.scales = scales_.data();
    kc::W8A16GemmParams probe = p_;
    probe.m = 0;
    kc::launch_w8a16_gemm(probe, kc::ThreadPool::global());
  }

  void gemm(Array x, Array out, int num_threads) const {
    kc::W8A16GemmParams p = p_;
    p.num_threads = num_threads;
    bind_x_out(x, out, p.k, p.n, bias_.has_value(), bias_type_, p.m, p.dtype);
    p.x = x.data();
    p.out = out.data();
    nb::gil_scoped_release release;
    kc::launch_w8a16_gemm(p, kc::ThreadPool::global());
  }

  std::int64_t n() const { return p_.n; }
  std::int64_t k() const { return p_.k; }
  int group_size() const { return p_.group_size; }
  kc::W8A16GemmParams const& params() const { return p_; }
  bool has_bias() const { return bias_.has_value(); }
  ik::ScalarType bias_type() const { return bias_type_; }

 private:
  Array qweight_, scales_;
  std::optional<Array> bias_;
  ik::ScalarType bias_type_ = ik::ScalarType::kFloat32;
  kc::W8A16GemmParams p_;
};

// A dense weight [n, k] (and bias [n]) in one float dtype, validated and imported once, for the fused
// layer stack (the dense_gemm binding takes tensors per call).
class DenseWeight {
 public:
  DenseWeight(Array weight, std::optional<Array> bias) : weight_(std::move(weight)), bias_(std::move(bias)) {
    check_ndim(weight_, "weight", 2);
    p_.dtype = float_type(weight_, "weight");
    p_.n = static_cast<std::int64_t>(weight_.shape(0));
    p_.k = static_cast<std::int64_t>(weight_.shape(1));
    if (p_.n < 1 || p_.k < 1)
      throw std::invalid_argument("weight must not be empty, got shape " + shape_str({p_.n, p_.k}));
    if (bias_) {
      if (float_type(*bias_, "bias") != p_.dtype)
        throw std::invalid_argument("bias must have the dtype of weight (" +
                                    std::string(ik::scalar_type_name(p_.dtype)) + ")");
      check_shape(*bias_, "bias", {p_.n});
      p_.bias = bias_->data();
    }
    p_.weight = weight_.data();
  }

  std::int64_t n() const { return p_.n; }
  std::int64_t k() const { return p_.k; }
  kc::DenseGemmParams const& params() const { return p_; }
  ik::ScalarType type() const { return p_.dtype; }

 private:
  Array weight_;
  std::optional<Array> bias_;
  kc::DenseGemmParams p_;
};

}  // namespace inflight::bindings::gemm
