// W4A16 / W8A16 GEMM bindings: map DLPack arrays onto the params structs (dtypes, shapes), release the
// GIL, call the launcher. The typed wrappers with defaults live in inflight/ops/gemm.py.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gemm.h"
#include "registry.h"

namespace nb = nanobind;
namespace kc = inflight::kernels::cpu;
using namespace nb::literals;

namespace {

using Array = nb::ndarray<nb::device::cpu, nb::c_contig>;

std::string dtype_str(nb::dlpack::dtype d) {
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

kc::ScalarType float_type(Array const& a, char const* name) {
  nb::dlpack::dtype const d = a.dtype();
  if (d.lanes == 1 && d.bits == 32 && d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float)) {
    return kc::ScalarType::kFloat32;
  }
  if (d.lanes == 1 && d.bits == 16 && d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat)) {
    return kc::ScalarType::kBFloat16;
  }
  if (d.lanes == 1 && d.bits == 16 && d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float)) {
    return kc::ScalarType::kFloat16;
  }
  throw std::invalid_argument(std::string(name) + " must be float32, bfloat16 or float16, got " + dtype_str(d));
}

void check_int_type(Array const& a, char const* name, nb::dlpack::dtype_code code) {
  nb::dlpack::dtype const d = a.dtype();
  if (d.lanes != 1 || d.bits != 8 || d.code != static_cast<std::uint8_t>(code)) {
    throw std::invalid_argument(std::string(name) + " must be " +
                                (code == nb::dlpack::dtype_code::UInt ? "uint8" : "int8") + ", got " +
                                dtype_str(d));
  }
}

std::string shape_str(std::vector<std::int64_t> const& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

void check_shape(Array const& a, char const* name, std::vector<std::int64_t> const& want) {
  std::vector<std::int64_t> got(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) got[i] = static_cast<std::int64_t>(a.shape(i));
  if (got != want) {
    throw std::invalid_argument(std::string(name) + " must have shape " + shape_str(want) + ", got " +
                                shape_str(got));
  }
}

void check_ndim(Array const& a, char const* name, std::size_t ndim) {
  if (a.ndim() != ndim) {
    throw std::invalid_argument(std::string(name) + " must be " + std::to_string(ndim) + "-D, got " +
                                std::to_string(a.ndim()) + "-D");
  }
}

// Shapes that depend on group_size; a group_size the launcher will reject is left to its message.
bool groups_known(std::int64_t k, int group_size) { return group_size > 0 && k % group_size == 0; }

// Checks x [m, k] and out [m, n] (one dtype; the bias, if any, must share it); sets m and x_type.
void bind_x_out(Array const& x, Array const& out, std::int64_t k, std::int64_t n, bool has_bias,
                kc::ScalarType bias_type, std::int64_t& m, kc::ScalarType& x_type) {
  check_ndim(x, "x", 2);
  x_type = float_type(x, "x");
  m = static_cast<std::int64_t>(x.shape(0));
  if (static_cast<std::int64_t>(x.shape(1)) != k) {
    throw std::invalid_argument("x must have shape [m, " + std::to_string(k) + "], got [" + std::to_string(m) +
                                ", " + std::to_string(x.shape(1)) + "]");
  }
  if (float_type(out, "out") != x_type) {
    throw std::invalid_argument("out must have the dtype of x (" + std::string(kc::scalar_type_name(x_type)) + ")");
  }
  check_shape(out, "out", {m, n});
  if (has_bias && bias_type != x_type) {
    throw std::invalid_argument("bias must have the dtype of x (" + std::string(kc::scalar_type_name(x_type)) + ")");
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
                                    std::string(kc::scalar_type_name(p_.scale_type)) + ")");
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
    kc::w4a16_gemm(probe);
  }

  void gemm(Array x, Array out, int num_threads) const {
    kc::W4A16GemmParams p = p_;
    p.num_threads = num_threads;
    bind_x_out(x, out, p.k, p.n, bias_.has_value(), bias_type_, p.m, p.x_type);
    p.x = x.data();
    p.out = out.data();
    nb::gil_scoped_release release;
    kc::w4a16_gemm(p);
  }

  std::int64_t n() const { return p_.n; }
  std::int64_t k() const { return p_.k; }
  int group_size() const { return p_.group_size; }

 private:
  Array qweight_, scales_;
  std::optional<Array> offsets_, bias_;
  kc::ScalarType bias_type_ = kc::ScalarType::kFloat32;
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
    kc::w8a16_gemm(probe);
  }

  void gemm(Array x, Array out, int num_threads) const {
    kc::W8A16GemmParams p = p_;
    p.num_threads = num_threads;
    bind_x_out(x, out, p.k, p.n, bias_.has_value(), bias_type_, p.m, p.x_type);
    p.x = x.data();
    p.out = out.data();
    nb::gil_scoped_release release;
    kc::w8a16_gemm(p);
  }

  std::int64_t n() const { return p_.n; }
  std::int64_t k() const { return p_.k; }
  int group_size() const { return p_.group_size; }

 private:
  Array qweight_, scales_;
  std::optional<Array> bias_;
  kc::ScalarType bias_type_ = kc::ScalarType::kFloat32;
  kc::W8A16GemmParams p_;
};

void w4a16_gemm(Array x, Array qweight, Array scales, std::optional<Array> offsets, int group_size, Array out,
                std::optional<Array> bias, int num_threads) {
  check_ndim(x, "x", 2);
  check_ndim(qweight, "qweight", 2);
  check_int_type(qweight, "qweight", nb::dlpack::dtype_code::UInt);
  kc::W4A16GemmParams p;
  p.m = static_cast<std::int64_t>(x.shape(0));
  p.k = static_cast<std::int64_t>(x.shape(1));
  p.n = static_cast<std::int64_t>(qweight.shape(0));
  p.group_size = group_size;
  p.num_threads = num_threads;
  p.x_type = float_type(x, "x");
  if (p.k % 2 != 0) throw std::invalid_argument("x.shape[1] (k) must be even, got " + std::to_string(p.k));
  check_shape(qweight, "qweight", {p.n, p.k / 2});
  p.scale_type = float_type(scales, "scales");
  if (groups_known(p.k, group_size)) check_shape(scales, "scales", {p.n, p.k / group_size});
  if (offsets) {
    if (float_type(*offsets, "offsets") != p.scale_type) {
      throw std::invalid_argument("offsets must have the dtype of scales (" +
                                  std::string(kc::scalar_type_name(p.scale_type)) + ")");
    }
    if (groups_known(p.k, group_size)) check_shape(*offsets, "offsets", {p.n, p.k / group_size});
    p.offsets = offsets->data();
  }
  if (float_type(out, "out") != p.x_type) {
    throw std::invalid_argument("out must have the dtype of x (" + std::string(kc::scalar_type_name(p.x_type)) +
                                ")");
  }
  check_shape(out, "out", {p.m, p.n});
  if (bias) {
    if (float_type(*bias, "bias") != p.x_type) {
      throw std::invalid_argument("bias must have the dtype of x (" +
                                  std::string(kc::scalar_type_name(p.x_type)) + ")");
    }
    check_shape(*bias, "bias", {p.n});
    p.bias = bias->data();
  }
  p.x = x.data();
  p.qweight = static_cast<std::uint8_t const*>(qweight.data());
  p.scales = scales.data();
  p.out = out.data();
  nb::gil_scoped_release release;
  kc::w4a16_gemm(p);
}

void w8a16_gemm(Array x, Array qweight, Array scales, int group_size, Array out, std::optional<Array> bias,
                int num_threads) {
  check_ndim(x, "x", 2);
  check_ndim(qweight, "qweight", 2);
  check_int_type(qweight, "qweight", nb::dlpack::dtype_code::Int);
  kc::W8A16GemmParams p;
  p.m = static_cast<std::int64_t>(x.shape(0));
  p.k = static_cast<std::int64_t>(x.shape(1));
  p.n = static_cast<std::int64_t>(qweight.shape(0));
  p.group_size = group_size;
  p.num_threads = num_threads;
  p.x_type = float_type(x, "x");
  check_shape(qweight, "qweight", {p.n, p.k});
  p.scale_type = float_type(scales, "scales");
  if (groups_known(p.k, group_size)) check_shape(scales, "scales", {p.n, p.k / group_size});
  if (float_type(out, "out") != p.x_type) {
    throw std::invalid_argument("out must have the dtype of x (" + std::string(kc::scalar_type_name(p.x_type)) +
                                ")");
  }
  check_shape(out, "out", {p.m, p.n});
  if (bias) {
    if (float_type(*bias, "bias") != p.x_type) {
      throw std::invalid_argument("bias must have the dtype of x (" +
                                  std::string(kc::scalar_type_name(p.x_type)) + ")");
    }
    check_shape(*bias, "bias", {p.n});
    p.bias = bias->data();
  }
  p.x = x.data();
  p.qweight = static_cast<std::int8_t const*>(qweight.data());
  p.scales = scales.data();
  p.out = out.data();
  nb::gil_scoped_release release;
  kc::w8a16_gemm(p);
}

}  // namespace

INFLIGHT_REGISTER_OPS(gemm) {
  m.def("w4a16_gemm", &w4a16_gemm, "x"_a, "qweight"_a, "scales"_a, "offsets"_a.none(), "group_size"_a,
        "out"_a.noconvert(), "bias"_a.none(), "num_threads"_a,
        "out[m, n] = x[m, k] @ dequant(qweight)[n, k]^T (+ bias). int4 weights, qweight [n, k/2] uint8 "
        "(byte j: k = 2j low nibble, 2j+1 high), scales/offsets [n, k/group_size]; w = scale*q + offset, or "
        "scale*(q - 8) when offsets is None. x, out, bias: one of float32/bfloat16/float16.");
  m.def("w8a16_gemm", &w8a16_gemm, "x"_a, "qweight"_a, "scales"_a, "group_size"_a, "out"_a.noconvert(),
        "bias"_a.none(), "num_threads"_a,
        "out[m, n] = x[m, k] @ dequant(qweight)[n, k]^T (+ bias). int8 weights [n, k], scales "
        "[n, k/group_size]; w = scale * q.");
  nb::class_<W4A16Weight>(m, "W4A16Weight",
                          "int4 weights (the w4a16_gemm layout) validated and imported once; gemm(x, out, "
                          "num_threads) then passes only x and out. Keeps the tensors alive.")
      .def(nb::init<Array, Array, std::optional<Array>, int, std::optional<Array>>(), "qweight"_a, "scales"_a,
           "offsets"_a.none(), "group_size"_a, "bias"_a.none())
      .def("gemm", &W4A16Weight::gemm, "x"_a, "out"_a.noconvert(), "num_threads"_a)
      .def_prop_ro("n", &W4A16Weight::n)
      .def_prop_ro("k", &W4A16Weight::k)
      .def_prop_ro("group_size", &W4A16Weight::group_size);
  nb::class_<W8A16Weight>(m, "W8A16Weight",
                          "int8 weights (the w8a16_gemm layout) validated and imported once; gemm(x, out, "
                          "num_threads) then passes only x and out. Keeps the tensors alive.")
      .def(nb::init<Array, Array, int, std::optional<Array>>(), "qweight"_a, "scales"_a, "group_size"_a,
           "bias"_a.none())
      .def("gemm", &W8A16Weight::gemm, "x"_a, "out"_a.noconvert(), "num_threads"_a)
      .def_prop_ro("n", &W8A16Weight::n)
      .def_prop_ro("k", &W8A16Weight::k)
      .def_prop_ro("group_size", &W8A16Weight::group_size);
}
