// LlamaLayerStack: the decoder layers of a Llama-family model run by one C++ call per step
// (csrc/kernels/cpu/llama_layers.h). Built once from the model's tensors (the weight objects of
// gemm_weights.h and the norm weights), given the KV caches once, then forward() per step passes only
// the step's hidden states and metadata. Everything is validated here with messages naming the
// argument; the kernels trust their params.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gemm_weights.h"
#include "llama_layers.h"
#include "registry.h"

namespace nb = nanobind;
namespace kc = inflight::kernels::cpu;
namespace ik = inflight::kernels;
using namespace nb::literals;

namespace {

using namespace inflight::bindings::gemm;

[[noreturn]] void fail(std::string const& msg) { throw std::invalid_argument(msg); }

ik::ScalarType element_type_of(std::string const& dtype) {
  if (dtype == "float32") return ik::ScalarType::kFloat32;
  if (dtype == "bfloat16") return ik::ScalarType::kBFloat16;
  if (dtype == "float16") return ik::ScalarType::kFloat16;
  fail("dtype must be 'float32', 'bfloat16' or 'float16', got '" + dtype + "'");
}

void check_vector(Array const& a, char const* name, std::int64_t n, ik::ScalarType t) {
  check_ndim(a, name, 1);
  if (float_type(a, name) != t)
    fail(std::string(name) + " must have the model dtype (" + ik::scalar_type_name(t) + ")");
  check_shape(a, name, {n});
}

void check_int_array(Array const& a, char const* name, int bits, std::size_t ndim) {
  nb::dlpack::dtype const d = a.dtype();
  if (d.lanes != 1 || d.bits != bits || d.code != static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int))
    fail(std::string(name) + " must be int" + std::to_string(bits) + ", got " + dtype_str(d));
  check_ndim(a, name, ndim);
}

class LlamaLayerStack {
 public:
  LlamaLayerStack(int hidden, int num_heads, int num_kv_heads, int head_dim, int intermediate, float eps, float scale,
                  std::string const& dtype) {
    if (hidden < 1 || num_heads < 1 || num_kv_heads < 1 || head_dim < 2 || intermediate < 1)
      fail("shape must be positive: hidden=" + std::to_string(hidden) + ", num_heads=" + std::to_string(num_heads) +
           ", num_kv_heads=" + std::to_string(num_kv_heads) + ", head_dim=" + std::to_string(head_dim) +
           ", intermediate=" + std::to_string(intermediate));
    if (num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > kc::kMaxGroupSize)
      fail("num_heads (" + std::to_string(num_heads) + ") must be a multiple of num_kv_heads (" +
           std::to_string(num_kv_heads) + ") with a ratio <= " + std::to_string(kc::kMaxGroupSize));
    if (head_dim % 2 != 0 || head_dim > kc::kMaxHeadDim)
      fail("head_dim must be even and <= " + std::to_string(kc::kMaxHeadDim) + ", got " + std::to_string(head_dim));
    shape_.hidden = hidden;
    shape_.num_heads = num_heads;
    shape_.num_kv_heads = num_kv_heads;
    shape_.head_dim = head_dim;
    shape_.intermediate = intermediate;
    shape_.eps = eps;
    shape_.scale = scale;
    shape_.dtype = element_type_of(dtype);
  }

  void add_layer(Array input_norm, Array post_norm, nb::object qkv, nb::object o, nb::object gate_up, nb::object down) {
    ik::ScalarType const t = model_type();
    std::string const where = "layer " + std::to_string(layers_.size()) + ": ";
    check_vector(input_norm, "input_norm", shape_.hidden, t);
    check_vector(post_norm, "post_norm", shape_.hidden, t);
    kc::LlamaLayerWeights w;
    w.input_norm = input_norm.data();
    w.post_norm = post_norm.data();
    int const qkv_n = shape_.q_size() + 2 * shape_.kv_size();
    w.qkv = linear_op(qkv, where + "qkv", shape_.hidden, qkv_n);
    w.o = linear_op(o, where + "o", shape_.q_size(), shape_.hidden);
    w.gate_up = linear_op(gate_up, where + "gate_up", shape_.hidden, 2 * shape_.intermediate);
    w.down = linear_op(down, where + "down", shape_.intermediate, shape_.hidden);
    layers_.push_back(w);
    norms_.push_back(std::move(input_norm));
    norms_.push_back(std::move(post_norm));
    for (nb::object* obj : {&qkv, &o, &gate_up, &down}) weights_.push_back(std::move(*obj));
    caches_set_ = false;
  }

  // One cache per layer: [2, num_blocks, tokens_per_block, num_kv_heads, head_dim] in the model dtype.
  void set_kv_caches(std::vector<Array> caches) {
    if (caches.size() != layers_.size())
      fail("kv_caches must hold one tensor per layer (" + std::to_string(layers_.size()) + "), got " +
           std::to_string(caches.size()));
    for (std::size_t i = 0; i < caches.size(); ++i) {
      Array const& c = caches[i];
      std::string const name = "kv_caches[" + std::to_string(i) + "]";
      check_ndim(c, name.c_str(), 5);
      if (float_type(c, name.c_str()) != model_type())
        fail(name + " must have the model dtype (" + ik::scalar_type_name(model_type()) + ")");
      int const nb = int(c.shape(1)), tpb = int(c.shape(2));
      check_shape(c, name.c_str(), {2, nb, tpb, shape_.num_kv_heads, shape_.head_dim});
      if (nb < 1 || tpb < 1) fail(name + " has an empty dimension");
      if (i == 0) {
        shape_.num_blocks = nb;
        shape_.tokens_per_block = tpb;
      } else if (nb != shape_.num_blocks || tpb != shape_.tokens_per_block) {
        fail(name + " must have the shape of kv_caches[0]");
      }
      layers_[i].kv_cache = c.data();
    }
    caches_ = std::move(caches);
    caches_set_ = true;
  }

  void forward(Array hidden, Array cos_sin, Array slot_mapping, int num_ctx_tokens,
               std::optional<Array> ctx_block_tables, std::optional<Array> ctx_cu_seqlens,
               std::optional<Array> ctx_kv_lens, std::optional<Array> dec_block_tables,
               std::optional<Array> dec_kv_lens, int num_threads) {
    if (!caches_set_) fail("set_kv_caches() must be called after the last add_layer() and before forward()");
    if (num_threads < 1) fail("num_threads must be >= 1, got " + std::to_string(num_threads));
    ik::ScalarType const t = model_type();
    check_ndim(hidden, "hidden", 2);
    if (float_type(hidden, "hidden") != t)
      fail(std::string("hidden must have the model dtype (") + ik::scalar_type_name(t) + ")");
    std::int64_t const nt = std::int64_t(hidden.shape(0));
    check_shape(hidden, "hidden", {nt, shape_.hidden});
    check_ndim(cos_sin, "cos_sin", 3);
    if (float_type(cos_sin, "cos_sin") != t)
      fail(std::string("cos_sin must have the model dtype (") + ik::scalar_type_name(t) + ")");
    check_shape(cos_sin, "cos_sin", {nt, 2, shape_.head_dim});
    check_int_array(slot_mapping, "slot_mapping", 64, 1);
    check_shape(slot_mapping, "slot_mapping", {nt});
    if (num_ctx_tokens < 0 || num_ctx_tokens > nt)
      fail("num_ctx_tokens must be in 0 .. " + std::to_string(nt) + ", got " + std::to_string(num_ctx_tokens));

    kc::LlamaStep step;
    step.hidden = hidden.data();
    step.num_tokens = int(nt);
    step.cos_sin = cos_sin.data();
    step.slot_mapping = static_cast<std::int64_t const*>(slot_mapping.data());
    step.num_ctx_tokens = num_ctx_tokens;
    std::int64_t const num_slots = std::int64_t(shape_.num_blocks) * shape_.tokens_per_block;
    for (std::int64_t i = 0; i < nt; ++i)
      if (step.slot_mapping[i] >= num_slots)
        fail("slot_mapping[" + std::to_string(i) + "] = " + std::to_string(step.slot_mapping[i]) +
             " is outside the cache's " + std::to_string(num_slots) + " slots");

    if (num_ctx_tokens > 0) {
      if (!ctx_block_tables || !ctx_cu_seqlens || !ctx_kv_lens)
        fail("num_ctx_tokens > 0 needs ctx_block_tables, ctx_cu_seqlens and ctx_kv_lens");
      check_int_array(*ctx_cu_seqlens, "ctx_cu_seqlens", 32, 1);
      int const batch = int(ctx_cu_seqlens->shape(0)) - 1;
      if (batch < 1) fail("ctx_cu_seqlens must have batch + 1 >= 2 entries");
      auto const* cu = static_cast<std::int32_t const*>(ctx_cu_seqlens->data());
      step.ctx_max_blocks = check_tables(*ctx_block_tables, *ctx_kv_lens, batch, "ctx_");
      auto const* lens = static_cast<std::int32_t const*>(ctx_kv_lens->data());
      if (cu[0] != 0 || cu[batch] != num_ctx_tokens)
        fail("ctx_cu_seqlens must run from 0 to num_ctx_tokens (" + std::to_string(num_ctx_tokens) + "), got " +
             std::to_string(cu[0]) + " .. " + std::to_string(cu[batch]));
      for (int b = 0; b < batch; ++b) {
        int const q_len = cu[b + 1] - cu[b];
        if (q_len < 0 || q_len > lens[b])
          fail("context sequence " + std::to_string(b) + ": need 0 <= q_len (" + std::to_string(q_len) +
               ") <= ctx_kv_lens[i] (" + std::to_string(lens[b]) + ")");
      }
      step.ctx_batch = batch;
      step.ctx_block_tables = static_cast<std::int32_t const*>(ctx_block_tables->data());
      step.ctx_cu_seqlens = cu;
      step.ctx_kv_lens = lens;
    }
    if (num_ctx_tokens < nt) {
      if (!dec_block_tables || !dec_kv_lens) fail("decode tokens need dec_block_tables and dec_kv_lens");
      int const batch = int(nt - num_ctx_tokens);
      step.dec_max_blocks = check_tables(*dec_block_tables, *dec_kv_lens, batch, "dec_");
      step.dec_batch = batch;
      step.dec_block_tables = static_cast<std::int32_t const*>(dec_block_tables->data());
      step.dec_kv_lens = static_cast<std::int32_t const*>(dec_kv_lens->data());
    }

    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mutex_);
    kc::LlamaLayersParams p;
    p.shape = shape_;
    p.layers = layers_.data();
    p.num_layers = int(layers_.size());
    p.step = step;
    p.num_threads = num_threads;
    std::size_t const need = std::size_t(kc::llama_layers_workspace_size(p));
    if (need > workspace_bytes_) {
      workspace_.reset(static_cast<unsigned char*>(std::aligned_alloc(64, (need + 63) / 64 * 64)));
      if (!workspace_) throw std::bad_alloc();
      workspace_bytes_ = need;
    }
    p.workspace = workspace_.get();
    p.workspace_bytes = std::int64_t(workspace_bytes_);
    kc::launch_llama_layers(p, kc::ThreadPool::global());
  }

  int num_layers() const { return int(layers_.size()); }

 private:
  struct FreeDeleter {
    void operator()(unsigned char* p) const { std::free(p); }
  };

  ik::ScalarType model_type() const { return shape_.dtype; }

  kc::LinearOp linear_op(nb::object const& obj, std::string const& name, std::int64_t k, std::int64_t n) const {
    kc::LinearOp op;
    ik::ScalarType const t = model_type();
    auto check = [&](std::int64_t wk, std::int64_t wn, bool has_bias, ik::ScalarType bias_type) {
      if (wk != k || wn != n)
        fail(name + " must map " + std::to_string(k) + " -> " + std::to_string(n) + " features, got " +
             std::to_string(wk) + " -> " + std::to_string(wn));
      if (has_bias && bias_type != t)
        fail(name + "'s bias must have the model dtype (" + ik::scalar_type_name(t) + ")");
    };
    if (nb::isinstance<W4A16Weight>(obj)) {
      W4A16Weight const& w = nb::cast<W4A16Weight const&>(obj);
      check(w.k(), w.n(), w.has_bias(), w.bias_type());
      op.kind = kc::LinearOp::Kind::kW4A16;
      op.w4 = w.params();
    } else if (nb::isinstance<W8A16Weight>(obj)) {
      W8A16Weight const& w = nb::cast<W8A16Weight const&>(obj);
      check(w.k(), w.n(), w.has_bias(), w.bias_type());
      op.kind = kc::LinearOp::Kind::kW8A16;
      op.w8 = w.params();
    } else if (nb::isinstance<DenseWeight>(obj)) {
      DenseWeight const& w = nb::cast<DenseWeight const&>(obj);
      if (w.type() != t) fail(name + "'s weight must have the model dtype (" + ik::scalar_type_name(t) + ")");
      check(w.k(), w.n(), false, t);
      op.kind = kc::LinearOp::Kind::kDense;
      op.dense = w.params();
    } else {
      fail(name + " must be a W4A16Weight, W8A16Weight or DenseWeight, got " +
           nb::cast<std::string>(nb::str(nb::handle(obj.type()).attr("__name__"))));
    }
    op.n = n;
    op.k = k;
    return op;
  }

  // block_tables [batch, max_blocks] int32, kv_lens [batch] int32, every used block id in range.
  int check_tables(Array const& tables, Array const& kv_lens, int batch, std::string const& prefix) const {
    std::string const tn = prefix + "block_tables", ln = prefix + "kv_lens";
    check_int_array(tables, tn.c_str(), 32, 2);
    check_int_array(kv_lens, ln.c_str(), 32, 1);
    int const max_blocks = int(tables.shape(1));
    check_shape(tables, tn.c_str(), {batch, max_blocks});
    check_shape(kv_lens, ln.c_str(), {batch});
    auto const* ids = static_cast<std::int32_t const*>(tables.data());
    auto const* lens = static_cast<std::int32_t const*>(kv_lens.data());
    std::int64_t const cap = std::int64_t(max_blocks) * shape_.tokens_per_block;
    for (int b = 0; b < batch; ++b) {
      if (lens[b] < 1 || lens[b] > cap)
        fail(ln + "[" + std::to_string(b) + "] = " + std::to_string(lens[b]) + " must be in 1 .. " +
             std::to_string(cap));
      int const used = (lens[b] + shape_.tokens_per_block - 1) / shape_.tokens_per_block;
      for (int j = 0; j < used; ++j) {
        std::int32_t const id = ids[std::int64_t(b) * max_blocks + j];
        if (id < 0 || id >= shape_.num_blocks)
          fail(tn + "[" + std::to_string(b) + ", " + std::to_string(j) + "] = " + std::to_string(id) +
               " is outside the cache's 0 .. " + std::to_string(shape_.num_blocks - 1));
      }
    }
    return max_blocks;
  }

  kc::LlamaShape shape_;
  std::vector<kc::LlamaLayerWeights> layers_;
  std::vector<Array> norms_;         // kept alive with the stack
  std::vector<nb::object> weights_;  // the W4A16Weight / W8A16Weight objects, kept alive
  std::vector<Array> caches_;
  bool caches_set_ = false;
  std::mutex mutex_;  // one forward at a time (the workspace is shared)
  std::unique_ptr<unsigned char, FreeDeleter> workspace_;
  std::size_t workspace_bytes_ = 0;
};

}  // namespace

INFLIGHT_REGISTER_OPS(llama_layers) {
  nb::class_<DenseWeight>(m, "DenseWeight",
                          "A dense weight [n, k] (+ bias [n]) validated and imported once, for LlamaLayerStack. "
                          "Keeps the tensors alive.")
      .def(nb::init<Array, std::optional<Array>>(), "weight"_a, "bias"_a.none())
      .def_prop_ro("n", &DenseWeight::n)
      .def_prop_ro("k", &DenseWeight::k);
  nb::class_<LlamaLayerStack>(m, "LlamaLayerStack",
                              "The decoder layers of a Llama-family model, run by one call per step on the CPU "
                              "(RMSNorm, q/k/v, RoPE, store_kv, attention, o_proj, MLP, residuals). Holds its "
                              "weights and KV caches alive.")
      .def(nb::init<int, int, int, int, int, float, float, std::string const&>(), "hidden_size"_a, "num_heads"_a,
           "num_kv_heads"_a, "head_dim"_a, "intermediate_size"_a, "eps"_a, "scale"_a, "dtype"_a)
      .def("add_layer", &LlamaLayerStack::add_layer, "input_norm"_a, "post_norm"_a, "qkv"_a, "o"_a, "gate_up"_a,
           "down"_a)
      .def("set_kv_caches", &LlamaLayerStack::set_kv_caches, "kv_caches"_a)
      .def("forward", &LlamaLayerStack::forward, "hidden"_a.noconvert(), "cos_sin"_a, "slot_mapping"_a,
           "num_ctx_tokens"_a, "ctx_block_tables"_a.none(), "ctx_cu_seqlens"_a.none(), "ctx_kv_lens"_a.none(),
           "dec_block_tables"_a.none(), "dec_kv_lens"_a.none(), "num_threads"_a,
           "Runs every layer over the step's flattened batch, in place on hidden [num_tokens, hidden_size]. "
           "Tokens 0 .. num_ctx_tokens-1 are context chunks (ctx_*), the rest single-token decodes (dec_*).")
      .def_prop_ro("num_layers", &LlamaLayerStack::num_layers);
}
