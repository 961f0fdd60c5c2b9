// The CPU GEMM weights, validated and imported once (W4A16Weight, W8A16Weight, DenseWeight), for the
// GEMM bindings (ops_gemm.cpp) and the fused decoder-layer binding (ops_llama.cpp). Their checks are
// op_checks.h's, as for the CUDA ops; the CPU kernels read every tensor contiguous.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <string>

#include "a8_gemm.h"
#include "dense_gemm.h"
#include "gemm.h"
#include "llama_layers.h"
#include "op_checks.h"
#include "w8a8_gemm.h"

namespace inflight::bindings::gemm {

namespace kc = inflight::kernels::cpu;

inline bool cpu_group_size_ok(int group_size) { return group_size == 32 || group_size == 64 || group_size == 128; }
inline constexpr GroupSizeRule kCpuGroupSizes{cpu_group_size_ok, "32, 64 or 128"};
// int8 also takes groups of 16 (GGUF Q6_K's sub-blocks).
inline bool cpu_int8_group_size_ok(int group_size) { return group_size == 16 || cpu_group_size_ok(group_size); }
inline constexpr GroupSizeRule kCpuInt8GroupSizes{cpu_int8_group_size_ok, "16, 32, 64 or 128"};

// The checks and fields of one call of weights imported once: x [m, k] and out [m, n] of one float
// dtype, the bias's if there is one. P: kc::W4A16GemmParams or kc::W8A16GemmParams.
template <class P>
P call_params(P p, Tensor const& x, Tensor const& out, std::optional<Tensor> const& bias, char const* k_what,
              int num_threads) {
  p.m = check_gemm_x(x, {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}, p.k, k_what);
  check_gemm_out(out, x, p.m, p.n);
  if (bias) require_same_dtype(*bias, "bias", x, "x");
  require_cpu_contiguous({{&x, "x"}, {&out, "out"}});
  scalar_type_of(x, &p.dtype);
  p.x = x.data();
  p.out = out.data();
  p.num_threads = num_threads;
  return p;
}

// Weights validated and imported once (DLPack costs ~2 us per tensor per call from torch); each call
// then passes only x and out. Holding the tensors keeps their memory alive; in-place writes to them are
// seen, replacing them (e.g. moving the module) needs a new object. Bits: 4 (uint8 [n, k / 2], optional
// offsets) or 8 (int8 [n, k]).
template <int kBits>
class QuantizedWeight {
 public:
  using Params = std::conditional_t<kBits == 4, kc::W4A16GemmParams, kc::W8A16GemmParams>;

  QuantizedWeight(Tensor qweight, Tensor scales, std::optional<Tensor> offsets, int group_size,
                  std::optional<Tensor> bias)
      : qweight_(std::move(qweight)), scales_(std::move(scales)), offsets_(std::move(offsets)), bias_(std::move(bias)) {
    Tensor const* off = offsets_ ? &*offsets_ : nullptr;
    Tensor const* b = bias_ ? &*bias_ : nullptr;
    QuantizedWeightArgs const w = check_quantized_weight(qweight_, scales_, off, group_size, kBits,
                                                         kBits == 8 ? kCpuInt8GroupSizes : kCpuGroupSizes);
    if (b != nullptr) {
      bias_type_ = float_type(*b, "bias");
      require_shape(*b, "bias", {w.n}, "[n]");
    }
    require_cpu_contiguous({{&qweight_, "qweight"}, {&scales_, "scales"}, {off, "offsets"}, {b, "bias"}});
    p_.n = w.n;
    p_.k = w.k;
    p_.group_size = group_size;
    p_.scale_type = w.scale_type;
    p_.qweight = static_cast<decltype(p_.qweight)>(qweight_.data());
    p_.scales = scales_.data();
    if constexpr (kBits == 4) p_.offsets = off != nullptr ? off->data() : nullptr;
    p_.bias = b != nullptr ? b->data() : nullptr;
    // Let the launcher validate the rest (what its kernels accept) now, with an empty call.
    Params probe = p_;
    probe.m = 0;
    launch(probe);
  }

  // int8 weights have no offsets. fp8_e4m3: the int8 tensor holds E4M3 bytes (a float8_e4m3fn tensor
  // viewed as int8).
  QuantizedWeight(Tensor qweight, Tensor scales, int group_size, std::optional<Tensor> bias, bool fp8_e4m3 = false)
    requires(kBits == 8)
      : QuantizedWeight(std::move(qweight), std::move(scales), std::nullopt, group_size, std::move(bias)) {
    p_.fp8_e4m3 = fp8_e4m3;
  }
  bool fp8_e4m3() const {
    if constexpr (kBits == 8) {
      return p_.fp8_e4m3;
    } else {
      return false;
    }
  }

  void gemm(Tensor x, Tensor out, int num_threads) const {
    Params const p =
        call_params(p_, x, out, bias_, kBits == 4 ? "k (2 * qweight.shape[1])" : "k (qweight.shape[1])", num_threads);
    nb::gil_scoped_release release;
    launch(p);
  }

  std::int64_t n() const { return p_.n; }
  std::int64_t k() const { return p_.k; }
  int group_size() const { return p_.group_size; }
  // The validated params (x, out, m, dtype and num_threads are the caller's to fill).
  Params const& params() const { return p_; }
  bool has_bias() const { return bias_.has_value(); }
  ScalarType bias_type() const { return bias_type_; }

 private:
  static void launch(Params const& p) {
    if constexpr (kBits == 4) {
      kc::launch_w4a16_gemm(p, kc::ThreadPool::global());
    } else {
      kc::launch_w8a16_gemm(p, kc::ThreadPool::global());
    }
  }

  Tensor qweight_, scales_;
  std::optional<Tensor> offsets_, bias_;
  ScalarType bias_type_ = ScalarType::kFloat32;
  Params p_;
};

using W4A16Weight = QuantizedWeight<4>;
using W8A16Weight = QuantizedWeight<8>;

// A dense weight [n, k] (and bias [n]) in one float dtype, validated and imported once, for the fused
// layer stack (the dense_gemm binding takes tensors per call).
class DenseWeight {
 public:
  DenseWeight(Tensor weight, std::optional<Tensor> bias) : weight_(std::move(weight)), bias_(std::move(bias)) {
    p_.dtype = float_type(weight_, "weight");
    require_ndim(weight_, "weight", 2, "[n, k]");
    p_.n = static_cast<std::int64_t>(weight_.shape(0));
    p_.k = static_cast<std::int64_t>(weight_.shape(1));
    if (p_.n < 1 || p_.k < 1) throw_value_error("weight must not be empty, got shape " + shape_str(weight_));
    Tensor const* b = bias_ ? &*bias_ : nullptr;
    if (b != nullptr) {
      require_same_dtype(*b, "bias", weight_, "weight");
      require_shape(*b, "bias", {p_.n}, "[n]");
      p_.bias = b->data();
    }
    require_cpu_contiguous({{&weight_, "weight"}, {b, "bias"}});
    p_.weight = weight_.data();
  }

  std::int64_t n() const { return p_.n; }
  std::int64_t k() const { return p_.k; }
  kc::DenseGemmParams const& params() const { return p_; }
  ScalarType dtype() const { return p_.dtype; }

 private:
  Tensor weight_;
  std::optional<Tensor> bias_;
  kc::DenseGemmParams p_;
};

// A 64-byte-aligned workspace of at least `bytes` for the calling thread, grown as needed (one per
// thread: calls from several threads never share it).
inline void* thread_workspace(std::size_t bytes) {
  thread_local std::vector<std::int64_t> workspace;
  std::size_t const need = (bytes + 63) / 64 * 8 + 8;
  if (workspace.size() < need) workspace.resize(need);
  auto addr = reinterpret_cast<std::uintptr_t>(workspace.data());
  return reinterpret_cast<void*>((addr + 63) / 64 * 64);
}

// W8A8 (SmoothQuant) weights packed once (w8a8_gemm.h); the tensors are copied, not kept.
inline std::vector<float> float_vector(Tensor const& t, char const* name, std::int64_t n, char const* layout) {
  require_dtype(t, name, ScalarType::kFloat32);
  require_shape(t, name, {n}, layout);
  require_cpu_contiguous({{&t, name}});
  auto const* p = static_cast<float const*>(t.data());
  return std::vector<float>(p, p + n);
}

class W8A8Weight {
 public:
  W8A8Weight(Tensor qweight, Tensor scales, std::optional<Tensor> smooth, std::optional<Tensor> bias) {
    require_dtype(qweight, "qweight", ScalarType::kInt8);
    require_ndim(qweight, "qweight", 2, "[n, k]");
    require_cpu_contiguous({{&qweight, "qweight"}});
    std::int64_t const n = static_cast<std::int64_t>(qweight.shape(0)), k = static_cast<std::int64_t>(qweight.shape(1));
    if (n < 1 || k < 1) throw_value_error("qweight must not be empty, got shape " + shape_str(qweight));
    std::vector<float> const s = float_vector(scales, "scales", n, "[n] (one per output channel)");
    w_ = kc::pack_w8a8_weight(static_cast<std::int8_t const*>(qweight.data()), s.data(), n, k);
    if (smooth) smooth_ = float_vector(*smooth, "smooth", k, "[k] (one per input channel)");
    if (bias) bias_ = float_vector(*bias, "bias", n, "[n]");
  }

  void gemm(Tensor x, Tensor out, int num_threads) const {
    require_at_least(num_threads, 1, "num_threads");
    kc::W8A8GemmParams p;
    p.m = check_gemm_x(x, {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}, w_.k,
                       "k (qweight.shape[1])");
    check_gemm_out(out, x, p.m, w_.n);
    require_cpu_contiguous({{&x, "x"}, {&out, "out"}});
    scalar_type_of(x, &p.dtype);
    if (p.m == 0) return;
    p.x = x.data();
    p.out = out.data();
    p.weight = &w_;
    p.smooth = smooth_.empty() ? nullptr : smooth_.data();
    p.bias = bias_.empty() ? nullptr : bias_.data();
    p.num_threads = num_threads;
    nb::gil_scoped_release release;
    p.workspace = thread_workspace(kc::w8a8_workspace_bytes(p.m, w_));
    kc::launch_w8a8_gemm(p, kc::ThreadPool::global());
  }

  // Writes the tensors it was packed from (exact): qweight [n, k] int8 and scales [n] fp32.
  void unpack(Tensor qweight, Tensor scales) const {
    require_dtype(qweight, "qweight", ScalarType::kInt8);
    require_shape(qweight, "qweight", {w_.n, w_.k}, "[n, k]");
    require_vector(scales, "scales", ScalarType::kFloat32, w_.n, "[n]");
    require_cpu_contiguous({{&qweight, "qweight"}, {&scales, "scales"}});
    nb::gil_scoped_release release;
    kc::unpack_w8a8_weight(w_, static_cast<std::int8_t*>(qweight.data()), static_cast<float*>(scales.data()));
  }

  std::int64_t n() const { return w_.n; }
  std::int64_t k() const { return w_.k; }
  // Bytes of the packed weight (codes, column sums, scales).
  std::int64_t nbytes() const {
    return static_cast<std::int64_t>(w_.data.size() + 4 * (w_.wsum.size() + w_.scales.size()));
  }
  // The weight-side params for the fused layer stack (x, out, m, dtype, workspace, threads per call).
  kc::W8A8GemmParams params() const {
    kc::W8A8GemmParams p;
    p.weight = &w_;
    p.smooth = smooth_.empty() ? nullptr : smooth_.data();
    p.bias = bias_.empty() ? nullptr : bias_.data();
    return p;
  }

 private:
  kc::W8A8PackedWeight w_;
  std::vector<float> smooth_, bias_;
};

// The values of a float tensor (fp32, bf16 or fp16; contiguous, on the CPU) as fp32 (exact).
inline std::vector<float> to_float_vector(Tensor const& t, char const* name) {
  ScalarType const type = float_type(t, name);
  require_cpu_contiguous({{&t, name}});
  std::size_t const count = t.size();
  std::vector<float> v(count);
  inflight::kernels::dispatch_float_type(type, [&](auto x) {
    using T = decltype(x);
    auto const* p = static_cast<T const*>(t.data());
    for (std::size_t i = 0; i < count; ++i) v[i] = inflight::kernels::to_float(p[i]);
  });
  return v;
}

// Weight-only-quantised weights (gemm.h's int4 or int8 formats) packed once for the A8 GEMM
// (a8_gemm.h: activations quantised to int8 per group of 32 on the fly); the tensors are copied into the
// packed layout, not kept. The checks are the W4A16Weight / W8A16Weight ones.
class A8Weight {
 public:
  A8Weight(int bits, Tensor qweight, Tensor scales, std::optional<Tensor> offsets, int group_size,
           std::optional<Tensor> bias, int act_bits) {
    if (bits != 4 && bits != 8) throw_value_error("bits must be 4 or 8, got " + std::to_string(bits));
    if (act_bits != 8 && act_bits != 16) throw_value_error("act_bits must be 8 or 16, got " + std::to_string(act_bits));
    act_bits_ = act_bits;
    Tensor const* off = offsets ? &*offsets : nullptr;
    if (bits == 8 && off != nullptr) throw_value_error("offsets must be None for int8 weights (bits=8)");
    QuantizedWeightArgs const w =
        check_quantized_weight(qweight, scales, off, group_size, bits, bits == 8 ? kCpuInt8GroupSizes : kCpuGroupSizes);
    require_cpu_contiguous({{&qweight, "qweight"}, {&scales, "scales"}, {off, "offsets"}});
    std::vector<float> const s = to_float_vector(scales, "scales");
    std::vector<float> o;
    if (off != nullptr) o = to_float_vector(*off, "offsets");
    std::vector<float> b;
    if (bias) {
      bias_type_ = float_type(*bias, "bias");
      require_shape(*bias, "bias", {w.n}, "[n]");
      b = to_float_vector(*bias, "bias");
      has_bias_ = true;
    }
    w_ = kc::pack_a8_weight(bits, qweight.data(), s.data(), off != nullptr ? o.data() : nullptr,
                            has_bias_ ? b.data() : nullptr, w.n, w.k, group_size);
    group_size_ = group_size;
  }

  void gemm(Tensor x, Tensor out, int num_threads) const {
    require_at_least(num_threads, 1, "num_threads");
    kc::A8GemmParams p = params();
    p.m = check_gemm_x(x, {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}, w_.k, "k");
    check_gemm_out(out, x, p.m, w_.n);
    require_cpu_contiguous({{&x, "x"}, {&out, "out"}});
    scalar_type_of(x, &p.dtype);
    if (has_bias_ && bias_type_ != p.dtype) {
      throw_type_error(std::string("bias must have x's dtype (") + inflight::kernels::scalar_type_name(p.dtype) +
                       "), got " + inflight::kernels::scalar_type_name(bias_type_));
    }
    if (p.m == 0) return;
    p.x = x.data();
    p.out = out.data();
    p.num_threads = num_threads;
    nb::gil_scoped_release release;
    p.workspace = thread_workspace(kc::a8_workspace_bytes(p.m, w_, act_bits_));
    kc::launch_a8_gemm(p, kc::ThreadPool::global());
  }

  // Writes the tensors it was packed from (exact): qweight ([n, k / 2] uint8 or [n, k] int8), scales and,
  // asymmetric int4, offsets ([n, k / group_size] fp32).
  void unpack(Tensor qweight, Tensor scales, std::optional<Tensor> offsets) const {
    bool const int4 = w_.bits == 4;
    require_dtype(qweight, "qweight", int4 ? ScalarType::kUInt8 : ScalarType::kInt8);
    require_shape(qweight, "qweight", {w_.n, int4 ? w_.k / 2 : w_.k}, int4 ? "[n, k / 2]" : "[n, k]");
    require_dtype(scales, "scales", ScalarType::kFloat32);
    require_shape(scales, "scales", {w_.n, w_.k / group_size_}, "[n, k / group_size]");
    Tensor const* off = offsets ? &*offsets : nullptr;
    if ((off != nullptr) != w_.asym) {
      throw_value_error(w_.asym ? "offsets must be given: the weight is asymmetric int4"
                                : "offsets must be None: the weight has no offsets");
    }
    if (off != nullptr) {
      require_dtype(*off, "offsets", ScalarType::kFloat32);
      require_shape(*off, "offsets", {w_.n, w_.k / group_size_}, "[n, k / group_size]");
    }
    require_cpu_contiguous({{&qweight, "qweight"}, {&scales, "scales"}, {off, "offsets"}});
    nb::gil_scoped_release release;
    kc::unpack_a8_weight(w_, group_size_, qweight.data(), static_cast<float*>(scales.data()),
                         off != nullptr ? static_cast<float*>(off->data()) : nullptr);
  }

  // out[i] = row ids[i] of an int8 weight, dequantised (code x scale in fp32, rounded to out's dtype): the
  // embedding lookup of a tied int8 embedding whose head holds only this packed copy.
  void embed(Tensor ids, Tensor out) const {
    if (w_.bits != 8) throw_value_error("embed needs int8 weights (bits=8), got bits=" + std::to_string(w_.bits));
    require_ndim(ids, "ids", 1, "[m]");
    std::int64_t const m = std::int64_t(ids.shape(0));
    require_vector(ids, "ids", ScalarType::kInt64, m, "[m]");
    require_shape(out, "out", {m, w_.k}, "[m, k]");
    ScalarType const t = float_type(out, "out");
    require_cpu_contiguous({{&ids, "ids"}, {&out, "out"}});
    auto const* v = static_cast<std::int64_t const*>(ids.data());
    for (std::int64_t i = 0; i < m; ++i) {
      if (v[i] < 0 || v[i] >= w_.n) {
        throw_value_error("ids[" + std::to_string(i) + "] = " + std::to_string(v[i]) + " is outside 0 .. " +
                          std::to_string(w_.n - 1));
      }
    }
    nb::gil_scoped_release release;
    std::vector<float> row(static_cast<std::size_t>(w_.k));
    inflight::kernels::dispatch_float_type(t, [&](auto zero) {
      using T = decltype(zero);
      T* o = static_cast<T*>(out.data());
      for (std::int64_t i = 0; i < m; ++i) {
        kc::a8_int8_row(w_, v[i], row.data());
        for (std::int64_t j = 0; j < w_.k; ++j) o[i * w_.k + j] = inflight::kernels::from_float<T>(row[j]);
      }
    });
  }

  kc::A8PackedWeight const& packed() const { return w_; }
  std::int64_t n() const { return w_.n; }
  std::int64_t k() const { return w_.k; }
  int bits() const { return w_.bits; }
  int group_size() const { return group_size_; }
  int act_bits() const { return act_bits_; }
  bool has_bias() const { return has_bias_; }
  ScalarType bias_type() const { return bias_type_; }
  // Bytes of the packed weight (codes, scales, offsets): what a decode step reads.
  std::int64_t nbytes() const { return static_cast<std::int64_t>(w_.data.size()); }
  // The weight-side params for the fused ops (x, out, m, dtype, workspace and threads per call).
  kc::A8GemmParams params() const {
    kc::A8GemmParams p;
    p.weight = &w_;
    p.act_bits = act_bits_;
    return p;
  }

 private:
  kc::A8PackedWeight w_;
  int act_bits_ = 8;
  int group_size_ = 0;
  bool has_bias_ = false;
  ScalarType bias_type_ = ScalarType::kFloat32;
};

// A fused op's model dtype, by name.
inline ScalarType model_dtype_of(std::string const& dtype) {
  if (dtype == "float32") return ScalarType::kFloat32;
  if (dtype == "bfloat16") return ScalarType::kBFloat16;
  if (dtype == "float16") return ScalarType::kFloat16;
  throw_value_error("dtype must be 'float32', 'bfloat16' or 'float16', got '" + dtype + "'");
}

// One projection of a fused op (the layer stack, the expert group): the weight object's kernel params,
// checked to map k -> n features with a bias (if any) of the model dtype t.
inline kc::LinearOp linear_op(nanobind::object const& obj, std::string const& name, std::int64_t k, std::int64_t n,
                              ScalarType t) {
  kc::LinearOp op;
  auto check = [&](std::int64_t wk, std::int64_t wn, bool has_bias, ScalarType bias_type) {
    if (wk != k || wn != n) {
      throw_value_error(name + " must map " + std::to_string(k) + " -> " + std::to_string(n) + " features, got " +
                        std::to_string(wk) + " -> " + std::to_string(wn));
    }
    if (has_bias && bias_type != t) {
      throw_type_error(name + "'s bias must have the model dtype (" + inflight::kernels::scalar_type_name(t) +
                       "), got " + inflight::kernels::scalar_type_name(bias_type));
    }
  };
  if (nanobind::isinstance<W4A16Weight>(obj)) {
    W4A16Weight const& w = nanobind::cast<W4A16Weight const&>(obj);
    check(w.k(), w.n(), w.has_bias(), w.bias_type());
    op.kind = kc::LinearOp::Kind::kW4A16;
    op.w4 = w.params();
  } else if (nanobind::isinstance<W8A16Weight>(obj)) {
    W8A16Weight const& w = nanobind::cast<W8A16Weight const&>(obj);
    check(w.k(), w.n(), w.has_bias(), w.bias_type());
    op.kind = kc::LinearOp::Kind::kW8A16;
    op.w8 = w.params();
  } else if (nanobind::isinstance<W8A8Weight>(obj)) {
    W8A8Weight const& w = nanobind::cast<W8A8Weight const&>(obj);
    check(w.k(), w.n(), false, t);  // its bias is fp32, inside the packed weight
    op.kind = kc::LinearOp::Kind::kW8A8;
    op.w8a8 = w.params();
  } else if (nanobind::isinstance<A8Weight>(obj)) {
    A8Weight const& w = nanobind::cast<A8Weight const&>(obj);
    check(w.k(), w.n(), w.has_bias(), w.bias_type());
    op.kind = kc::LinearOp::Kind::kA8;
    op.a8 = w.params();
  } else if (nanobind::isinstance<DenseWeight>(obj)) {
    DenseWeight const& w = nanobind::cast<DenseWeight const&>(obj);
    if (w.dtype() != t) {
      throw_type_error(name + "'s weight must have the model dtype (" + inflight::kernels::scalar_type_name(t) +
                       "), got " + inflight::kernels::scalar_type_name(w.dtype()));
    }
    check(w.k(), w.n(), false, t);
    op.kind = kc::LinearOp::Kind::kDense;
    op.dense = w.params();
  } else {
    throw_type_error(name + " must be a W4A16Weight, W8A16Weight, W8A8Weight, A8Weight or DenseWeight, got " +
                     nanobind::cast<std::string>(nanobind::str(nanobind::handle(obj.type()).attr("__name__"))));
  }
  op.n = n;
  op.k = k;
  return op;
}

}  // namespace inflight::bindings::gemm
