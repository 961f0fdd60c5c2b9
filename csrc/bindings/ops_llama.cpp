// LlamaLayerStack: the decoder layers of a Llama-family model run by one C++ call per step
// (csrc/kernels/cpu/llama_layers.h). Built once from the model's tensors (the weight objects of
// gemm_weights.h and the norm weights), given the KV caches once, then forward() per step passes only
// the step's hidden states and metadata. Everything is validated here, with the tensor checks and the
// attention-metadata checks of the other ops (tensor_checks.h, op_checks.h); the kernels trust their
// params.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gemm_weights.h"
#include "llama_layers.h"
#include "llama_stack_ends.h"
#include "registry.h"
#include "shm_comm.h"

namespace nb = nanobind;
namespace kc = inflight::kernels::cpu;
using namespace nb::literals;
using namespace inflight::bindings;
using namespace inflight::bindings::gemm;
using inflight::kernels::scalar_type_name;

namespace {

// A Python reduction (tensor parallelism) called from inside the C++ layer loop. A Python exception
// is kept as the thread's error indicator and surfaces as that exception once the loop has unwound.
struct ReduceFailed {};

struct PythonReduce {
  nb::callable fn;
  static void call(void* ctx) {
    nb::gil_scoped_acquire gil;
    try {
      static_cast<PythonReduce*>(ctx)->fn();
    } catch (nb::python_error& e) {
      e.restore();
      throw ReduceFailed{};
    }
  }
};

// The same reduction without Python: the ranks' shared-memory all-reduce, called directly.
struct ShmReduce {
  kc::ShmComm* comm = nullptr;
  void* buf = nullptr;
  std::int64_t numel = 0;
  ScalarType dtype = ScalarType::kFloat32;
  double timeout_s = 0;
  static void call(void* ctx) {
    auto* r = static_cast<ShmReduce*>(ctx);
    r->comm->all_reduce(r->buf, r->numel, r->dtype, r->timeout_s);
  }
};

constexpr char const* kModelDtype = "the model dtype";
constexpr char const* kCacheLayout = "[2, num_blocks, tokens_per_block, num_kv_heads, head_dim]";

class LlamaLayerStack {
 public:
  LlamaLayerStack(int hidden, int num_heads, int num_kv_heads, int head_dim, int intermediate, float eps, float scale,
                  std::string const& dtype, bool qk_norm, bool gemma) {
    if (hidden < 1 || num_heads < 1 || num_kv_heads < 1 || head_dim < 2 || intermediate < 1) {
      throw_value_error("shape must be positive: hidden=" + std::to_string(hidden) +
                        ", num_heads=" + std::to_string(num_heads) + ", num_kv_heads=" + std::to_string(num_kv_heads) +
                        ", head_dim=" + std::to_string(head_dim) + ", intermediate=" + std::to_string(intermediate));
    }
    if (num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > kc::kMaxGroupSize) {
      throw_value_error("num_heads (" + std::to_string(num_heads) + ") must be a multiple of num_kv_heads (" +
                        std::to_string(num_kv_heads) + ") with a ratio <= " + std::to_string(kc::kMaxGroupSize));
    }
    if (head_dim % 2 != 0 || head_dim > kc::kMaxHeadDim) {
      throw_value_error("head_dim must be even and <= " + std::to_string(kc::kMaxHeadDim) + ", got " +
                        std::to_string(head_dim));
    }
    shape_.hidden = hidden;
    shape_.num_heads = num_heads;
    shape_.num_kv_heads = num_kv_heads;
    shape_.head_dim = head_dim;
    shape_.intermediate = intermediate;
    shape_.eps = eps;
    shape_.scale = scale;
    shape_.dtype = model_dtype_of(dtype);
    shape_.qk_norm = qk_norm;
    shape_.gemma = gemma;
  }

  void add_layer(Tensor input_norm, Tensor post_norm, nb::object qkv, nb::object o, nb::object gate_up, nb::object down,
                 std::optional<Tensor> q_norm, std::optional<Tensor> k_norm, std::optional<Tensor> pre_ffn_norm,
                 std::optional<Tensor> post_ffn_norm, int window, bool local_rope) {
    std::string const where = "layer " + std::to_string(layers_.size()) + ": ";
    if (q_norm.has_value() != shape_.qk_norm || k_norm.has_value() != shape_.qk_norm) {
      throw_value_error(where + (shape_.qk_norm ? "a qk_norm stack needs q_norm and k_norm"
                                                : "q_norm / k_norm need a stack built with qk_norm=True"));
    }
    if (pre_ffn_norm.has_value() != shape_.gemma || post_ffn_norm.has_value() != shape_.gemma) {
      throw_value_error(where + (shape_.gemma ? "a gemma stack needs pre_ffn_norm and post_ffn_norm"
                                              : "pre_ffn_norm / post_ffn_norm need a stack built with gemma=True"));
    }
    require_at_least(window, 0, "window");
    struct Norm {
      Tensor const* tensor;
      char const* name;
      bool per_head;  // [head_dim], else [hidden_size]
    };
    std::vector<Norm> norms{{&input_norm, "input_norm", false}, {&post_norm, "post_norm", false}};
    if (shape_.gemma) {
      norms.push_back({&*pre_ffn_norm, "pre_ffn_norm", false});
      norms.push_back({&*post_ffn_norm, "post_ffn_norm", false});
    }
    if (shape_.qk_norm) {
      norms.push_back({&*q_norm, "q_norm", true});
      norms.push_back({&*k_norm, "k_norm", true});
    }
    for (Norm const& n : norms) {
      require_dtype_of(*n.tensor, n.name, shape_.dtype, kModelDtype);
      if (n.per_head) {
        require_shape(*n.tensor, n.name, {shape_.head_dim}, "[head_dim]");
      } else {
        require_shape(*n.tensor, n.name, {shape_.hidden}, "[hidden_size]");
      }
      require_cpu_contiguous({{n.tensor, n.name}});
    }
    kc::LlamaLayerWeights w;
    w.input_norm = input_norm.data();
    w.post_norm = post_norm.data();
    w.window = window;
    w.local_rope = local_rope;
    for (auto const& [opt, dst] :
         {std::pair{&q_norm, &w.q_norm}, std::pair{&k_norm, &w.k_norm}, std::pair{&pre_ffn_norm, &w.pre_ffn_norm},
          std::pair{&post_ffn_norm, &w.post_ffn_norm}}) {
      if (opt->has_value()) *dst = (*opt)->data();
    }
    int const qkv_n = shape_.q_size() + 2 * shape_.kv_size();
    w.qkv = linear_op(qkv, where + "qkv", shape_.hidden, qkv_n);
    w.o = linear_op(o, where + "o", shape_.q_size(), shape_.hidden);
    w.gate_up = linear_op(gate_up, where + "gate_up", shape_.hidden, 2 * shape_.intermediate);
    w.down = linear_op(down, where + "down", shape_.intermediate, shape_.hidden);
    for (kc::LinearOp const* op : {&w.qkv, &w.o, &w.gate_up, &w.down}) {
      shape_.w8a8 = shape_.w8a8 || op->kind == kc::LinearOp::Kind::kW8A8;
      shape_.a8 = shape_.a8 || op->kind == kc::LinearOp::Kind::kA8;
    }
    layers_.push_back(w);
    norms_.push_back(std::move(input_norm));
    norms_.push_back(std::move(post_norm));
    for (std::optional<Tensor>* opt : {&q_norm, &k_norm, &pre_ffn_norm, &post_ffn_norm}) {
      if (opt->has_value()) norms_.push_back(std::move(**opt));
    }
    for (nb::object* obj : {&qkv, &o, &gate_up, &down}) weights_.push_back(std::move(*obj));
    caches_set_ = false;
  }

  // The model's end (llama_layers.h, LlamaHead): final_norm [hidden] and the LM head's weight object
  // (hidden -> vocab rows). forward() then also computes the logits of the rows it is given.
  void set_head(Tensor final_norm, nb::object head, std::int64_t vocab) {
    check_final_norm(final_norm, shape_.dtype, shape_.hidden);
    require_at_least(vocab, 1, "vocab");
    kc::LinearOp op = linear_op(head, "head", shape_.hidden, vocab);
    if (op.kind == kc::LinearOp::Kind::kW8A8) {
      throw_value_error("head: a W8A8 LM head does not run in the stack (its scratch would be tokens x vocab)");
    }
    head_.final_norm = final_norm.data();
    head_.op = op;
    shape_.a8 = shape_.a8 || op.kind == kc::LinearOp::Kind::kA8;
    head_norm_ = std::move(final_norm);
    head_weight_ = std::move(head);
    has_head_ = true;
  }

  bool has_head() const { return has_head_; }

  // The model's start (llama_layers.h, LlamaEmbed; the arguments: make_llama_embed). forward() given
  // input_ids then embeds them into hidden first.
  void set_embedding(Tensor table, std::optional<Tensor> scales, int group, float scale) {
    embed_ = make_llama_embed(table, scales ? &*scales : nullptr, group, scale, shape_.hidden, shape_.dtype);
    embed_tensors_ = {std::move(table)};
    if (scales) embed_tensors_.push_back(std::move(*scales));
  }

  // The same start, from a tied int8 embedding held only as its head's A8 packed copy.
  void set_embedding_packed(nb::object head, float scale) {
    if (!nb::isinstance<A8Weight>(head)) throw_type_error("head must be an A8Weight");
    embed_ = make_packed_llama_embed(nb::cast<A8Weight const&>(head).packed(), scale, shape_.hidden);
    embed_tensors_.clear();
    embed_object_ = std::move(head);
  }

  bool has_embedding() const { return embed_.vocab > 0; }  // set by either

  // One cache per layer: [2, num_blocks, tokens_per_block, num_kv_heads, head_dim] in a float dtype (the
  // model's, or another: q, k and v are then converted to it and the attention output back), or
  // int8 with kv_scales, one [2, num_blocks, tokens_per_block, num_kv_heads] float32 tensor per layer, or
  // uint8 holding FP8 E4M3 bytes with fp8_scales (k_scale, v_scale of each layer in turn; all 1 when None).
  // window_pool (VSWA): per layer, whether its cache is in the window pool, whose caches all have one
  // num_blocks of their own (the others kv_caches[first global layer]'s).
  void set_kv_caches(std::vector<Tensor> caches, std::optional<std::vector<Tensor>> kv_scales,
                     std::optional<std::vector<float>> fp8_scales, std::optional<std::vector<bool>> window_pool,
                     int key_rotation) {
    if (key_rotation != 0) {
      if (!kv_scales) throw_value_error("key_rotation is for an int8 cache (with kv_scales)");
      bool const pow2 = key_rotation > 0 && (key_rotation & (key_rotation - 1)) == 0;
      if (!pow2 || shape_.head_dim % key_rotation != 0) {
        throw_value_error("key_rotation must be 0 or a power of two dividing head_dim (" +
                          std::to_string(shape_.head_dim) + "), got " + std::to_string(key_rotation));
      }
    }
    if (window_pool && window_pool->size() != caches.size()) {
      throw_value_error("window_pool must hold one bool per layer (" + std::to_string(caches.size()) + "), got " +
                        std::to_string(window_pool->size()));
    }
    if (caches.size() != layers_.size()) {
      throw_value_error("kv_caches must hold one tensor per layer (" + std::to_string(layers_.size()) + "), got " +
                        std::to_string(caches.size()));
    }
    if (kv_scales && kv_scales->size() != caches.size()) {
      throw_value_error("kv_scales must hold one tensor per layer (" + std::to_string(layers_.size()) + "), got " +
                        std::to_string(kv_scales->size()));
    }
    ScalarType first = shape_.dtype;
    bool const fp8 = !kv_scales && !caches.empty() && scalar_type_of(caches[0], &first) && first == ScalarType::kUInt8;
    if (fp8_scales && !fp8) throw_value_error("fp8_scales is only for uint8 (fp8 e4m3) kv_caches");
    if (fp8_scales && fp8_scales->size() != 2 * caches.size()) {
      throw_value_error("fp8_scales must hold two floats per layer (k_scale, v_scale: " +
                        std::to_string(2 * layers_.size()) + "), got " + std::to_string(fp8_scales->size()));
    }
    if (fp8_scales) {
      for (float f : *fp8_scales) {
        if (!(std::isfinite(f) && f > 0.0f)) throw_value_error("fp8_scales must be finite and > 0");
      }
    }
    // A float cache may have another float dtype than the model (attention then runs in the cache's).
    bool const float_cache = !kv_scales && !fp8 && !caches.empty() && scalar_type_of(caches[0], &first) &&
                             inflight::kernels::is_float_type(first);
    ScalarType const kv_dtype =
        kv_scales ? ScalarType::kInt8 : (fp8 ? ScalarType::kUInt8 : (float_cache ? first : shape_.dtype));
    bool seen_global = false, seen_window = false;
    window_blocks_ = 0;
    for (std::size_t i = 0; i < caches.size(); ++i) {
      Tensor const& c = caches[i];
      std::string const name = "kv_caches[" + std::to_string(i) + "]";
      require_dtype_of(c, name.c_str(), kv_dtype,
                       kv_scales ? "the dtype of a cache with kv_scales"
                                 : (fp8 ? "the dtype of kv_caches[0] (uint8: fp8 e4m3)"
                                        : (float_cache ? "the dtype of kv_caches[0]" : kModelDtype)));
      require_ndim(c, name.c_str(), 5, kCacheLayout);
      std::int64_t const nb = std::int64_t(c.shape(1)), tpb = std::int64_t(c.shape(2));
      require_shape(c, name.c_str(), {2, nb, tpb, shape_.num_kv_heads, shape_.head_dim}, kCacheLayout);
      if (nb < 1 || tpb < 1) throw_value_error(name + " has an empty dimension, shape " + shape_str(c));
      require_cpu_contiguous({{&c, name.c_str()}});
      bool const in_window = window_pool && (*window_pool)[i];
      if (i == 0) shape_.tokens_per_block = int(tpb);
      if (tpb != shape_.tokens_per_block) throw_value_error(name + " must have the tokens_per_block of kv_caches[0]");
      bool& seen = in_window ? seen_window : seen_global;
      int& blocks = in_window ? window_blocks_ : shape_.num_blocks;
      if (!seen) {
        blocks = int(nb);
        seen = true;
      } else if (nb != blocks) {
        throw_value_error(name + " must have the num_blocks of the other " + (in_window ? "window-pool" : "global") +
                          " layers' caches (" + std::to_string(blocks) + ")");
      }
      layers_[i].window_pool = in_window;
      layers_[i].num_blocks = int(nb);
      layers_[i].kv_cache = c.data();
      layers_[i].kv_scales = nullptr;
      layers_[i].k_scale = fp8_scales ? (*fp8_scales)[2 * i] : 1.0f;
      layers_[i].v_scale = fp8_scales ? (*fp8_scales)[2 * i + 1] : 1.0f;
      if (kv_scales) {
        Tensor const& sc = (*kv_scales)[i];
        std::string const sname = "kv_scales[" + std::to_string(i) + "]";
        require_dtype(sc, sname.c_str(), ScalarType::kFloat32);
        require_shape(sc, sname.c_str(), {2, nb, tpb, shape_.num_kv_heads},
                      "[2, num_blocks, tokens_per_block, num_kv_heads] (its cache's)");
        require_cpu_contiguous({{&sc, sname.c_str()}});
        layers_[i].kv_scales = static_cast<float*>(sc.data());
      }
    }
    shape_.kv_dtype = fp8 ? ScalarType::kFloat8E4M3 : kv_dtype;
    shape_.key_rotation = key_rotation;
    caches_ = std::move(caches);
    scales_ = kv_scales ? std::move(*kv_scales) : std::vector<Tensor>{};
    caches_set_ = true;
  }

  void forward(Tensor hidden, Tensor cos_sin, Tensor slot_mapping, int num_ctx_tokens,
               std::optional<Tensor> ctx_block_tables, std::optional<Tensor> ctx_cu_seqlens,
               std::optional<Tensor> ctx_kv_lens, std::optional<Tensor> dec_block_tables,
               std::optional<Tensor> dec_kv_lens, int num_threads, std::optional<Tensor> reduce_buffer,
               std::optional<nb::object> reduce, double reduce_timeout_s, std::optional<Tensor> cos_sin_local,
               std::optional<Tensor> window_slot_mapping, std::optional<Tensor> window_ctx_block_tables,
               std::optional<Tensor> window_dec_block_tables, std::optional<Tensor> positions,
               std::optional<Tensor> logits_rows, std::optional<Tensor> logits, std::optional<Tensor> input_ids) {
    if (!caches_set_) {
      throw_value_error("set_kv_caches() must be called after the last add_layer() and before forward()");
    }
    require_at_least(num_threads, 1, "num_threads");
    require_dtype_of(hidden, "hidden", shape_.dtype, kModelDtype);
    require_ndim(hidden, "hidden", 2, "[num_tokens, hidden_size]");
    std::int64_t const nt = std::int64_t(hidden.shape(0));
    require_dim(hidden, "hidden", 1, shape_.hidden, "hidden_size");
    // With positions, cos_sin and cos_sin_local are whole tables read at each token's position.
    Tensor const* pos = positions ? &*positions : nullptr;
    if (pos) {
      require_vector(*pos, "positions", ScalarType::kInt64, nt, "[num_tokens]");
      require_cpu_contiguous({{pos, "positions"}});
    }
    check_rope_table(cos_sin, "cos_sin", pos, nt, shape_.head_dim, shape_.dtype);
    bool const local_rope = std::any_of(layers_.begin(), layers_.end(), [](auto const& l) { return l.local_rope; });
    if (local_rope != cos_sin_local.has_value()) {
      throw_value_error(local_rope ? "the layers with local_rope need cos_sin_local"
                                   : "cos_sin_local is for layers with local_rope (this stack has none)");
    }
    if (cos_sin_local) check_rope_table(*cos_sin_local, "cos_sin_local", pos, nt, shape_.head_dim, shape_.dtype);
    // The step's token ids (set_embedding), embedded into hidden before the layers; the head's rows
    // (set_head): logits [len(logits_rows), vocab] in the model dtype.
    if (input_ids) {
      if (!has_embedding()) throw_value_error("input_ids need an embedding: call set_embedding() first");
      check_token_ids(*input_ids, nt, embed_.vocab);
    }
    if (logits.has_value() != logits_rows.has_value()) {
      throw_value_error("logits and logits_rows go together: pass both or neither");
    }
    if (logits && !has_head_) throw_value_error("logits need a head: call set_head() first");
    std::int64_t const num_logits_rows =
        logits ? check_logits_rows(*logits_rows, *logits, nt, head_.op.n, shape_.dtype) : 0;
    require_vector(slot_mapping, "slot_mapping", ScalarType::kInt64, nt, "[num_tokens]");
    if (num_ctx_tokens < 0 || num_ctx_tokens > nt) {
      throw_value_error("num_ctx_tokens must be in 0 .. " + std::to_string(nt) + ", got " +
                        std::to_string(num_ctx_tokens));
    }
    if (num_ctx_tokens > 0 && (!ctx_block_tables || !ctx_cu_seqlens || !ctx_kv_lens)) {
      throw_value_error("num_ctx_tokens > 0 needs ctx_block_tables, ctx_cu_seqlens and ctx_kv_lens");
    }
    if (num_ctx_tokens < nt && (!dec_block_tables || !dec_kv_lens)) {
      throw_value_error("decode tokens need dec_block_tables and dec_kv_lens");
    }
    Tensor const* ctx_tables = num_ctx_tokens > 0 ? &*ctx_block_tables : nullptr;
    Tensor const* ctx_cu = num_ctx_tokens > 0 ? &*ctx_cu_seqlens : nullptr;
    Tensor const* ctx_lens = num_ctx_tokens > 0 ? &*ctx_kv_lens : nullptr;
    Tensor const* dec_tables = num_ctx_tokens < nt ? &*dec_block_tables : nullptr;
    Tensor const* dec_lens = num_ctx_tokens < nt ? &*dec_kv_lens : nullptr;
    if (ctx_tables != nullptr) {
      require_ndim(*ctx_lens, "ctx_kv_lens", 1, "[batch_size]");
      std::int64_t const batch = std::int64_t(ctx_lens->shape(0));
      check_block_tables(*ctx_tables, *ctx_lens, batch, "len(ctx_kv_lens) (batch_size)", "ctx_");
      require_vector(*ctx_cu, "ctx_cu_seqlens", ScalarType::kInt32, batch + 1, "[batch_size + 1]");
    }
    if (dec_tables != nullptr) {
      check_block_tables(*dec_tables, *dec_lens, nt - num_ctx_tokens, "the decode tokens (num_tokens - num_ctx_tokens)",
                         "dec_");
    }
    // The kernels read the block tables with rows max_blocks_per_seq apart.
    require_cpu_contiguous({{&hidden, "hidden"},
                            {&cos_sin, "cos_sin"},
                            {cos_sin_local ? &*cos_sin_local : nullptr, "cos_sin_local"},
                            {&slot_mapping, "slot_mapping"},
                            {ctx_tables, "ctx_block_tables"},
                            {ctx_cu, "ctx_cu_seqlens"},
                            {ctx_lens, "ctx_kv_lens"},
                            {dec_tables, "dec_block_tables"},
                            {dec_lens, "dec_kv_lens"}});
    if (reduce.has_value() != reduce_buffer.has_value()) {
      throw_value_error("reduce and reduce_buffer go together (tensor parallelism): pass both or neither");
    }
    if (reduce_buffer) {
      require_dtype_of(*reduce_buffer, "reduce_buffer", shape_.dtype, kModelDtype);
      require_shape(*reduce_buffer, "reduce_buffer", {nt, shape_.hidden}, "[num_tokens, hidden_size]");
      require_cpu_contiguous({{&*reduce_buffer, "reduce_buffer"}});
    }
    KvCacheShape const cache{shape_.num_blocks, shape_.tokens_per_block, shape_.num_kv_heads, shape_.head_dim};
    check_slot_mapping_values(slot_mapping, cache.num_slots());
    // VSWA: the window pool's slots and tables, in the shapes of the main ones.
    bool const windowed = window_blocks_ > 0;
    if (windowed != window_slot_mapping.has_value()) {
      throw_value_error(windowed ? "the window-pool layers need window_slot_mapping"
                                 : "window_slot_mapping is for window-pool layers (set_kv_caches(window_pool=...))");
    }
    KvCacheShape const wcache{window_blocks_, shape_.tokens_per_block, shape_.num_kv_heads, shape_.head_dim};
    Tensor const* wctx = nullptr;
    Tensor const* wdec = nullptr;
    if (windowed) {
      require_vector(*window_slot_mapping, "window_slot_mapping", ScalarType::kInt64, nt, "[num_tokens]");
      check_slot_mapping_values(*window_slot_mapping, wcache.num_slots());
      for (auto [main, w, name] : {std::tuple{ctx_tables, &window_ctx_block_tables, "window_ctx_block_tables"},
                                   std::tuple{dec_tables, &window_dec_block_tables, "window_dec_block_tables"}}) {
        if (main == nullptr) continue;
        if (!w->has_value()) throw_value_error(std::string("the window-pool layers need ") + name);
        require_dtype(**w, name, ScalarType::kInt32);
        require_shape(**w, name, {static_cast<std::int64_t>(main->shape(0)), static_cast<std::int64_t>(main->shape(1))},
                      "the shape of its main block tables");
        require_cpu_contiguous({{&**w, name}});
        (main == ctx_tables ? wctx : wdec) = &**w;
      }
      check_block_table_values(*(wctx ? wctx : wdec), *(wctx ? ctx_lens : dec_lens), wcache,
                               wctx ? "window_ctx_" : "window_dec_");
      if (wctx && wdec) check_block_table_values(*wdec, *dec_lens, wcache, "window_dec_");
    }

    kc::LlamaStep step;
    step.hidden = hidden.data();
    step.num_tokens = int(nt);
    step.positions = positions ? static_cast<std::int64_t const*>(positions->data()) : nullptr;
    step.input_ids = input_ids ? static_cast<std::int64_t const*>(input_ids->data()) : nullptr;
    if (logits) {
      step.logits_rows = static_cast<std::int64_t const*>(logits_rows->data());
      step.num_logits_rows = int(num_logits_rows);
      step.logits = logits->data();
    }
    step.cos_sin = cos_sin.data();
    step.cos_sin_local = cos_sin_local ? cos_sin_local->data() : nullptr;
    step.slot_mapping = static_cast<std::int64_t const*>(slot_mapping.data());
    step.num_ctx_tokens = num_ctx_tokens;
    if (windowed) {
      step.window_slot_mapping = static_cast<std::int64_t const*>(window_slot_mapping->data());
      step.window_ctx_block_tables = wctx ? static_cast<std::int32_t const*>(wctx->data()) : nullptr;
      step.window_dec_block_tables = wdec ? static_cast<std::int32_t const*>(wdec->data()) : nullptr;
    }
    if (ctx_tables != nullptr) {
      check_block_table_values(*ctx_tables, *ctx_lens, cache, "ctx_");
      check_cu_seqlens_values(*ctx_cu, *ctx_lens, num_ctx_tokens, "num_ctx_tokens", "ctx_");
      step.ctx_batch = int(ctx_lens->shape(0));
      step.ctx_max_blocks = int(ctx_tables->shape(1));
      step.ctx_block_tables = static_cast<std::int32_t const*>(ctx_tables->data());
      step.ctx_cu_seqlens = static_cast<std::int32_t const*>(ctx_cu->data());
      step.ctx_kv_lens = static_cast<std::int32_t const*>(ctx_lens->data());
    }
    if (dec_tables != nullptr) {
      check_block_table_values(*dec_tables, *dec_lens, cache, "dec_");
      step.dec_batch = int(nt - num_ctx_tokens);
      step.dec_max_blocks = int(dec_tables->shape(1));
      step.dec_block_tables = static_cast<std::int32_t const*>(dec_tables->data());
      step.dec_kv_lens = static_cast<std::int32_t const*>(dec_lens->data());
    }

    PythonReduce python_reduce;
    ShmReduce shm_reduce;
    void (*reduce_fn)(void*) = nullptr;
    void* reduce_ctx = nullptr;
    if (reduce && nb::isinstance<kc::ShmComm>(*reduce)) {
      shm_reduce.comm = &nb::cast<kc::ShmComm&>(*reduce);
      shm_reduce.buf = reduce_buffer->data();
      shm_reduce.numel = nt * shape_.hidden;
      shm_reduce.dtype = shape_.dtype;
      shm_reduce.timeout_s = reduce_timeout_s;
      reduce_fn = &ShmReduce::call;
      reduce_ctx = &shm_reduce;
    } else if (reduce) {
      if (!PyCallable_Check(reduce->ptr())) throw_type_error("reduce must be a ShmComm or a callable");
      python_reduce.fn = nb::borrow<nb::callable>(*reduce);
      reduce_fn = &PythonReduce::call;
      reduce_ctx = &python_reduce;
    }
    try {
      nb::gil_scoped_release release;
      run(step, input_ids ? &embed_ : nullptr, logits ? &head_ : nullptr, num_threads,
          reduce_buffer ? reduce_buffer->data() : nullptr, reduce_fn, reduce_ctx);
    } catch (ReduceFailed const&) {
      throw nb::python_error();  // the reduction's own exception
    }
  }

  int num_layers() const { return int(layers_.size()); }

 private:
  struct FreeDeleter {
    void operator()(unsigned char* p) const { std::free(p); }
  };

  void run(kc::LlamaStep const& step, kc::LlamaEmbed const* embed, kc::LlamaHead const* head, int num_threads,
           void* reduce_buf, void (*reduce)(void*), void* reduce_ctx) {
    std::lock_guard<std::mutex> lock(mutex_);
    kc::LlamaLayersParams p;
    p.shape = shape_;
    p.layers = layers_.data();
    p.num_layers = int(layers_.size());
    p.step = step;
    p.embed = embed;
    p.head = head;
    p.num_threads = num_threads;
    std::size_t const need = std::size_t(kc::llama_layers_workspace_size(p));
    if (need > workspace_bytes_) {
      workspace_.reset(static_cast<unsigned char*>(std::aligned_alloc(64, (need + 63) / 64 * 64)));
      if (!workspace_) throw std::bad_alloc();
      workspace_bytes_ = need;
    }
    p.workspace = workspace_.get();
    p.workspace_bytes = std::int64_t(workspace_bytes_);
    if (reduce != nullptr) {
      p.reduce_buf = reduce_buf;
      p.reduce = reduce;
      p.reduce_ctx = reduce_ctx;
    }
    kc::launch_llama_layers(p, kc::ThreadPool::global());
  }

  kc::LinearOp linear_op(nb::object const& obj, std::string const& name, std::int64_t k, std::int64_t n) const {
    return gemm::linear_op(obj, name, k, n, shape_.dtype);
  }

  kc::LlamaShape shape_;
  std::vector<kc::LlamaLayerWeights> layers_;
  std::vector<Tensor> norms_;        // kept alive with the stack
  std::vector<nb::object> weights_;  // the W4A16Weight / W8A16Weight / DenseWeight objects, kept alive
  std::vector<Tensor> caches_;
  std::vector<Tensor> scales_;  // an int8 cache's per-layer scales (empty otherwise), kept alive
  kc::LlamaHead head_;          // set_head(): the final norm and the LM head
  Tensor head_norm_;            // kept alive
  nb::object head_weight_;      // kept alive
  bool has_head_ = false;
  kc::LlamaEmbed embed_;               // set_embedding(): the token embedding
  std::vector<Tensor> embed_tensors_;  // kept alive
  nb::object embed_object_;            // set_embedding_packed(): the A8Weight, kept alive
  bool caches_set_ = false;
  int window_blocks_ = 0;  // VSWA: num_blocks of the window-pool layers' caches (0: none)
  std::mutex mutex_;       // one forward at a time (the workspace is shared)
  std::unique_ptr<unsigned char, FreeDeleter> workspace_;
  std::size_t workspace_bytes_ = 0;
};

}  // namespace

INFLIGHT_REGISTER_OPS(llama_layers) {
  nb::class_<DenseWeight>(m, "DenseWeight",
                          "A dense weight [n, k] (+ bias [n]) validated and imported once, for LlamaLayerStack. "
                          "Keeps the tensors alive.")
      .def(nb::init<Tensor, std::optional<Tensor>>(), "weight"_a, "bias"_a.none())
      .def_prop_ro("n", &DenseWeight::n)
      .def_prop_ro("k", &DenseWeight::k);
  nb::class_<LlamaLayerStack>(m, "LlamaLayerStack",
                              "The decoder layers of a Llama-family model, run by one call per step on the CPU "
                              "(RMSNorm, q/k/v, RoPE, store_kv, attention, o_proj, MLP, residuals). Holds its "
                              "weights and KV caches alive.")
      .def(nb::init<int, int, int, int, int, float, float, std::string const&, bool, bool>(), "hidden_size"_a,
           "num_heads"_a, "num_kv_heads"_a, "head_dim"_a, "intermediate_size"_a, "eps"_a, "scale"_a, "dtype"_a,
           "qk_norm"_a = false, "gemma"_a = false,
           "qk_norm: an RMSNorm over head_dim per q head and per k head before RoPE (Qwen3, Gemma 3). gemma: "
           "Gemma 3's layer: (1 + w) norms in fp32, post_norm on the o_proj output before its residual add, "
           "pre_ffn_norm / post_ffn_norm around the MLP, GeGLU (tanh GELU).")
      .def("add_layer", &LlamaLayerStack::add_layer, "input_norm"_a, "post_norm"_a, "qkv"_a, "o"_a, "gate_up"_a,
           "down"_a, "q_norm"_a.none() = nb::none(), "k_norm"_a.none() = nb::none(),
           "pre_ffn_norm"_a.none() = nb::none(), "post_ffn_norm"_a.none() = nb::none(), "window"_a = 0,
           "local_rope"_a = false,
           "window: the layer's attention window (keys p-window+1 .. p; 0: global). local_rope: the layer "
           "rotates with forward's cos_sin_local (Gemma 3's sliding layers).")
      .def("set_kv_caches", &LlamaLayerStack::set_kv_caches, "kv_caches"_a, "kv_scales"_a.none() = nb::none(),
           "fp8_scales"_a.none() = nb::none(), "window_pool"_a.none() = nb::none(), "key_rotation"_a = 0,
           "One cache per layer, in a float dtype (the model's or another: attention then runs in the cache's); or "
           "int8 with kv_scales, one float32 [2, num_blocks, "
           "tokens_per_block, num_kv_heads] per layer (the per-token scales of an int8 KV cache); or uint8 "
           "holding FP8 E4M3 bytes, with fp8_scales [k_scale_0, v_scale_0, k_scale_1, ...] (None: all 1). "
           "window_pool (VSWA): per layer, True when its cache is in the window pool (its own num_blocks; "
           "forward's window_* slots and tables). key_rotation (int8 only): after RoPE, rotate each q and k "
           "head in blocks of this many channels by the Walsh-Hadamard matrix (inflight.layers.attention."
           "key_rotation_matrices); 0: none.")
      .def("forward", &LlamaLayerStack::forward, "hidden"_a.noconvert(), "cos_sin"_a, "slot_mapping"_a,
           "num_ctx_tokens"_a, "ctx_block_tables"_a.none(), "ctx_cu_seqlens"_a.none(), "ctx_kv_lens"_a.none(),
           "dec_block_tables"_a.none(), "dec_kv_lens"_a.none(), "num_threads"_a, "reduce_buffer"_a.none() = nb::none(),
           "reduce"_a.none() = nb::none(), "reduce_timeout_s"_a = 120.0, "cos_sin_local"_a.none() = nb::none(),
           "window_slot_mapping"_a.none() = nb::none(), "window_ctx_block_tables"_a.none() = nb::none(),
           "window_dec_block_tables"_a.none() = nb::none(), "positions"_a.none() = nb::none(),
           "logits_rows"_a.none() = nb::none(), "logits"_a.none() = nb::none(), "input_ids"_a.none() = nb::none(),
           "Runs every layer over the step's flattened batch, in place on hidden [num_tokens, hidden_size]. "
           "Tokens 0 .. num_ctx_tokens-1 are context chunks (ctx_*), the rest single-token decodes (dec_*). "
           "Tensor parallelism: after each layer's o_proj and down_proj the partial product is written to "
           "reduce_buffer [num_tokens, hidden_size] and reduced over the ranks in place: by reduce, a ShmComm "
           "(all_reduce in C++, no GIL) or a callable reduce() (called with the GIL). cos_sin_local: the RoPE "
           "rows of the layers added with local_rope. positions [num_tokens] int64: cos_sin and cos_sin_local are "
           "then whole tables [max_positions, 2, head_dim], read at each token's position. logits_rows "
           "[num_logits_rows] int64 and logits [num_logits_rows, vocab] (model dtype; needs set_head): after the "
           "layers, the final norm of those tokens' hidden states and the LM head into logits. input_ids "
           "[num_tokens] int64 (needs set_embedding): hidden is first overwritten with their embeddings.")
      .def("set_embedding", &LlamaLayerStack::set_embedding, "table"_a, "scales"_a.none(), "group"_a = 0,
           "scale"_a = 0.0f,
           "The model's start, run by forward() when it is given input_ids: table [vocab, hidden_size] in the "
           "model dtype (F.embedding), or int8 codes with scales [vocab, hidden_size / group] float16 (code x "
           "scale in fp32, rounded to the model dtype); scale != 0: then multiplied by it (Gemma's sqrt(hidden) "
           "in the model dtype).")
      .def("set_embedding_packed", &LlamaLayerStack::set_embedding_packed, "head"_a, "scale"_a = 0.0f,
           "set_embedding from a tied int8 embedding held only as its head's A8Weight (bits=8): the same values.")
      .def_prop_ro("has_embedding", &LlamaLayerStack::has_embedding)
      .def("set_head", &LlamaLayerStack::set_head, "final_norm"_a, "head"_a, "vocab"_a,
           "The model's end, run by forward() when it is given logits: the final RMSNorm (Gemma's with gemma=True) "
           "[hidden_size] in the model dtype, then the LM head, a W4A16Weight / W8A16Weight / A8Weight / "
           "DenseWeight mapping hidden_size -> vocab (W8A8: ValueError).")
      .def_prop_ro("has_head", &LlamaLayerStack::has_head)
      .def_prop_ro("num_layers", &LlamaLayerStack::num_layers);
}
