// The argument checks an op's CPU and CUDA bindings share (see op_checks.h).
#include "op_checks.h"

#include <cmath>
#include <string>
#include <utility>

namespace inflight::bindings {
namespace {

constexpr char const* kCacheLayout = "[2, num_blocks, tokens_per_block, num_kv_heads, head_dim]";
constexpr char const* kColumn = "[N] (one entry per logits row)";

// The data pointer as T (host or device memory: only the pointer is cast).
template <class T>
T const* typed_data(Tensor const& a) {
  return static_cast<T const*>(a.data());
}

// The dtype rule first (a TypeError before any shape error, as for a float cache), then the shape.
KvCacheShape check_kv_cache(Tensor const& kv_cache, Tensor const& ref, char const* ref_name) {
  ScalarType t;
  if (kv_cache.dtype() != ref.dtype() &&
      !(scalar_type_of(kv_cache, &t) && (t == ScalarType::kInt8 || t == ScalarType::kUInt8))) {
    throw_type_error(std::string("kv_cache must have the dtype of ") + ref_name + " (" + dtype_str(ref) + "), got " +
                     dtype_str(kv_cache) + " (or be int8, with kv_scales, or uint8 holding fp8 e4m3 bytes)");
  }
  require_ndim(kv_cache, "kv_cache", 5, kCacheLayout);
  require_dim(kv_cache, "kv_cache", 0, 2, "2 (keys, values)");
  require_contiguous(kv_cache, "kv_cache");
  KvCacheShape const c{static_cast<std::int64_t>(kv_cache.shape(1)), static_cast<int>(kv_cache.shape(2)),
                       static_cast<int>(kv_cache.shape(3)), static_cast<int>(kv_cache.shape(4))};
  require_at_least(c.num_blocks, 1, "kv_cache.shape[1] (num_blocks)");
  require_at_least(c.tokens_per_block, 1, "kv_cache.shape[2] (tokens_per_block)");
  require_at_least(c.num_kv_heads, 1, "kv_cache.shape[3] (num_kv_heads)");
  require_at_least(c.head_dim, 1, "kv_cache.shape[4] (head_dim)");
  return c;
}

// The cache's element type (check_kv_cache passed it): `dtype` (q's, or k's), int8 with kv_scales
// of the cache's [2, num_blocks, tokens_per_block, num_kv_heads], float32, contiguous, or uint8 (fp8
// E4M3 bytes) with k_scale and v_scale.
KvCacheType check_kv_cache_type(Tensor const& kv_cache, ScalarType dtype, Tensor const* kv_scales,
                                KvCacheShape const& c, double k_scale, double v_scale) {
  constexpr char const* kScalesLayout = "[2, num_blocks, tokens_per_block, num_kv_heads]";
  ScalarType t;
  bool const fp8 = scalar_type_of(kv_cache, &t) && t == ScalarType::kUInt8;
  if (fp8) {
    if (kv_scales != nullptr) {
      throw_value_error(
          "kv_scales is only for an int8 kv_cache; a uint8 (fp8 e4m3) kv_cache has k_scale and "
          "v_scale instead (pass kv_scales=None)");
    }
    for (auto [value, name] : {std::pair{k_scale, "k_scale"}, std::pair{v_scale, "v_scale"}}) {
      if (!(std::isfinite(value) && value > 0.0 && std::isfinite(static_cast<float>(value)) &&
            static_cast<float>(value) > 0.0f)) {
        throw_value_error(std::string(name) + " must be a finite float32 > 0, got " + std::to_string(value));
      }
    }
    return {ScalarType::kFloat8E4M3, nullptr, static_cast<float>(k_scale), static_cast<float>(v_scale)};
  }
  if (k_scale != 1.0 || v_scale != 1.0) {
    throw_value_error("k_scale and v_scale are only for a uint8 (fp8 e4m3) kv_cache; this kv_cache is " +
                      dtype_str(kv_cache) + " (leave them at 1.0)");
  }
  if (!scalar_type_of(kv_cache, &t) || t != ScalarType::kInt8) {
    if (kv_scales != nullptr) {
      throw_value_error("kv_scales is only for an int8 kv_cache; this kv_cache is " + dtype_str(kv_cache) +
                        " (pass kv_scales=None)");
    }
    return {dtype, nullptr};
  }
  if (kv_scales == nullptr) {
    throw_value_error(std::string("an int8 kv_cache needs kv_scales, float32 ") + kScalesLayout + ", got None");
  }
  require_dtype(*kv_scales, "kv_scales", ScalarType::kFloat32);
  require_shape(*kv_scales, "kv_scales", {2, c.num_blocks, c.tokens_per_block, c.num_kv_heads}, kScalesLayout);
  require_contiguous(*kv_scales, "kv_scales");
  return {ScalarType::kInt8, static_cast<float*>(kv_scales->data())};
}

// q [rows, num_heads, head_dim] against the cache; returns num_heads.
int check_query(Tensor const& q, char const* layout, KvCacheShape const& c) {
  require_ndim(q, "q", 3, layout);
  require_dim(q, "q", 2, c.head_dim, "kv_cache.shape[4] (head_dim)");
  int const num_heads = static_cast<int>(q.shape(1));
  if (num_heads < 1 || num_heads % c.num_kv_heads != 0) {
    throw_value_error(
        "num_heads (q.shape[1] = " + std::to_string(num_heads) +
        ") must be a positive multiple of num_kv_heads (kv_cache.shape[3] = " + std::to_string(c.num_kv_heads) + ")");
  }
  return num_heads;
}

void check_attention_out(Tensor const& out, Tensor const& q, char const* layout) {
  require_same_dtype(out, "out", q, "q");
  require_shape(out, "out",
                {static_cast<std::int64_t>(q.shape(0)), static_cast<std::int64_t>(q.shape(1)),
                 static_cast<std::int64_t>(q.shape(2))},
                layout);
  require_contiguous(out, "out");
}

AttentionArgs attention_args(Tensor const& q, KvCacheShape const& cache, KvCacheType kv, ScalarType dtype,
                             int num_heads, Tensor const& block_tables, std::int64_t batch_size) {
  return {cache,
          kv,
          dtype,
          static_cast<std::int64_t>(q.shape(0)),
          static_cast<int>(batch_size),
          num_heads,
          static_cast<int>(block_tables.shape(1)),
          row_stride(block_tables)};
}

}  // namespace

StoreKvArgs check_store_kv_args(Tensor const& k, Tensor const& v, Tensor const& kv_cache, Tensor const& slot_mapping,
                                Tensor const* kv_scales, double k_scale, double v_scale) {
  ScalarType const dtype = float_type(k, "k");
  require_same_dtype(v, "v", k, "k");
  KvCacheShape const c = check_kv_cache(kv_cache, k, "k");
  KvCacheType const kv = check_kv_cache_type(kv_cache, dtype, kv_scales, c, k_scale, v_scale);
  require_ndim(k, "k", 3, "[num_tokens, num_kv_heads, head_dim]");
  require_dim(k, "k", 1, c.num_kv_heads, "kv_cache.shape[3] (num_kv_heads)");
  require_dim(k, "k", 2, c.head_dim, "kv_cache.shape[4] (head_dim)");
  std::int64_t const num_tokens = static_cast<std::int64_t>(k.shape(0));
  require_shape(v, "v", {num_tokens, c.num_kv_heads, c.head_dim}, "[num_tokens, num_kv_heads, head_dim] (k's)");
  require_vector(slot_mapping, "slot_mapping", ScalarType::kInt64, num_tokens, "[num_tokens]");
  return {c, dtype, num_tokens, kv};
}

AttentionArgs check_paged_attention_args(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables,
                                         Tensor const& kv_lens, Tensor const& out, Tensor const* kv_scales,
                                         double k_scale, double v_scale) {
  constexpr char const* kLayout = "[batch_size, num_heads, head_dim]";
  ScalarType const dtype = float_type(q, "q");
  KvCacheShape const c = check_kv_cache(kv_cache, q, "q");
  KvCacheType const kv = check_kv_cache_type(kv_cache, dtype, kv_scales, c, k_scale, v_scale);
  int const num_heads = check_query(q, kLayout, c);
  std::int64_t const batch_size = static_cast<std::int64_t>(q.shape(0));
  check_block_tables(block_tables, kv_lens, batch_size, "q.shape[0] (batch_size)");
  check_attention_out(out, q, kLayout);
  return attention_args(q, c, kv, dtype, num_heads, block_tables, batch_size);
}

AttentionArgs check_context_attention_args(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables,
                                           Tensor const& cu_seqlens, Tensor const& kv_lens, Tensor const& out,
                                           Tensor const* kv_scales, double k_scale, double v_scale) {
  constexpr char const* kLayout = "[num_tokens, num_heads, head_dim]";
  ScalarType const dtype = float_type(q, "q");
  KvCacheShape const c = check_kv_cache(kv_cache, q, "q");
  KvCacheType const kv = check_kv_cache_type(kv_cache, dtype, kv_scales, c, k_scale, v_scale);
  int const num_heads = check_query(q, kLayout, c);
  require_ndim(kv_lens, "kv_lens", 1, "[batch_size]");
  std::int64_t const batch_size = static_cast<std::int64_t>(kv_lens.shape(0));
  check_block_tables(block_tables, kv_lens, batch_size, "len(kv_lens) (batch_size)");
  require_vector(cu_seqlens, "cu_seqlens", ScalarType::kInt32, batch_size + 1, "[batch_size + 1]");
  check_attention_out(out, q, kLayout);
  return attention_args(q, c, kv, dtype, num_heads, block_tables, batch_size);
}

void fill_attention_params(kernels::AttentionParams& p, Tensor const& q, Tensor const& kv_cache,
                           Tensor const& block_tables, Tensor const& kv_lens, Tensor const& out, double scale,
                           AttentionArgs const& args) {
  p.q = q.data();
  p.q_token_stride = row_stride(q);
  p.kv_cache = kv_cache.data();
  p.num_blocks = args.cache.num_blocks;
  p.tokens_per_block = args.cache.tokens_per_block;
  p.block_tables = typed_data<std::int32_t>(block_tables);
  p.block_table_stride = args.block_table_stride;
  p.max_blocks_per_seq = args.max_blocks_per_seq;
  p.kv_lens = typed_data<std::int32_t>(kv_lens);
  p.out = out.data();
  p.batch_size = args.batch_size;
  p.num_heads = args.num_heads;
  p.num_kv_heads = args.cache.num_kv_heads;
  p.head_dim = args.cache.head_dim;
  p.scale = static_cast<float>(scale);
  p.dtype = args.dtype;
  p.kv_dtype = args.kv.kv_dtype;
  p.kv_scales = args.kv.kv_scales;
  p.k_scale = args.kv.k_scale;
  p.v_scale = args.kv.v_scale;
}

void check_block_tables(Tensor const& block_tables, Tensor const& kv_lens, std::int64_t batch_size,
                        char const* batch_what, std::string const& prefix) {
  std::string const tables = prefix + "block_tables", lens = prefix + "kv_lens";
  require_dtype(block_tables, tables.c_str(), ScalarType::kInt32);
  require_ndim(block_tables, tables.c_str(), 2, "[batch_size, max_blocks_per_seq]");
  require_dim(block_tables, tables.c_str(), 0, batch_size, batch_what);
  require_contiguous(block_tables, tables.c_str(), 1);
  require_vector(kv_lens, lens.c_str(), ScalarType::kInt32, batch_size, "[batch_size]");
}

void check_block_table_values(Tensor const& block_tables, Tensor const& kv_lens, KvCacheShape const& cache,
                              std::string const& prefix) {
  std::int64_t const batch_size = static_cast<std::int64_t>(kv_lens.shape(0));
  std::int64_t const max_blocks = static_cast<std::int64_t>(block_tables.shape(1));
  std::int64_t const stride = row_stride(block_tables);
  std::int64_t const cap = max_blocks * cache.tokens_per_block;
  auto const* ids = typed_data<std::int32_t>(block_tables);
  auto const* lens = typed_data<std::int32_t>(kv_lens);
  for (std::int64_t b = 0; b < batch_size; ++b) {
    std::int64_t const len = lens[b];
    if (len < 1 || len > cap) {
      throw_value_error(prefix + "kv_lens[" + std::to_string(b) + "] = " + std::to_string(len) + " must be in 1 .. " +
                        std::to_string(cap) + " (block_tables columns x tokens_per_block)");
    }
    std::int64_t const used = (len + cache.tokens_per_block - 1) / cache.tokens_per_block;
    for (std::int64_t j = 0; j < used; ++j) {
      std::int32_t const id = ids[b * stride + j];
      if (id < 0 || id >= cache.num_blocks) {
        throw_value_error(prefix + "block_tables[" + std::to_string(b) + ", " + std::to_string(j) + "] = " +
                          std::to_string(id) + " is outside the cache's 0 .. " + std::to_string(cache.num_blocks - 1));
      }
    }
  }
}

void check_cu_seqlens_values(Tensor const& cu_seqlens, Tensor const& kv_lens, std::int64_t num_tokens,
                             char const* num_tokens_what, std::string const& prefix) {
  std::int64_t const batch_size = static_cast<std::int64_t>(kv_lens.shape(0));
  auto const* cu = typed_data<std::int32_t>(cu_seqlens);
  auto const* lens = typed_data<std::int32_t>(kv_lens);
  std::string const name = prefix + "cu_seqlens";
  if (cu[0] != 0) throw_value_error(name + "[0] must be 0, got " + std::to_string(cu[0]));
  if (cu[batch_size] != num_tokens) {
    throw_value_error(name + "[" + std::to_string(batch_size) + "] = " + std::to_string(cu[batch_size]) + " must be " +
                      num_tokens_what + " = " + std::to_string(num_tokens));
  }
  for (std::int64_t b = 0; b < batch_size; ++b) {
    std::int64_t const q_len = std::int64_t(cu[b + 1]) - cu[b];
    if (q_len < 0 || q_len > lens[b]) {
      throw_value_error("sequence " + std::to_string(b) + " has " + std::to_string(q_len) + " queries (" + name + "[" +
                        std::to_string(b + 1) + "] - " + name + "[" + std::to_string(b) + "]), which must be in 0 .. " +
                        prefix + "kv_lens[" + std::to_string(b) + "] = " + std::to_string(lens[b]));
    }
  }
}

void check_slot_mapping_values(Tensor const& slot_mapping, std::int64_t num_slots) {
  auto const* slots = typed_data<std::int64_t>(slot_mapping);
  for (std::int64_t t = 0, n = static_cast<std::int64_t>(slot_mapping.shape(0)); t < n; ++t) {
    if (slots[t] >= num_slots) {
      throw_value_error("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slots[t]) +
                        " is outside the cache's " + std::to_string(num_slots) + " slots (negative: skip the token)");
    }
  }
}

QuantizedWeightArgs check_quantized_weight(Tensor const& qweight, Tensor const& scales, Tensor const* offsets,
                                           int group_size, int bits, GroupSizeRule const& rule) {
  bool const int4 = bits == 4;
  require_dtype(qweight, "qweight", int4 ? ScalarType::kUInt8 : ScalarType::kInt8);
  require_ndim(qweight, "qweight", 2, int4 ? "[n, k // 2]" : "[n, k]");
  std::int64_t const n = static_cast<std::int64_t>(qweight.shape(0));
  std::int64_t const k = static_cast<std::int64_t>(qweight.shape(1)) * (int4 ? 2 : 1);
  if (!rule.ok(group_size)) {
    throw_value_error(std::string("group_size must be ") + rule.allowed + ", got " + std::to_string(group_size));
  }
  if (k < group_size || k % group_size != 0) {
    throw_value_error(std::string(int4 ? "k (2 * qweight.shape[1])" : "k (qweight.shape[1])") +
                      " must be a positive multiple of group_size (" + std::to_string(group_size) + "), got " +
                      std::to_string(k));
  }
  constexpr char const* kGroups = "[n, k // group_size]";
  ScalarType const scale_type = float_type(scales, "scales");
  require_shape(scales, "scales", {n, k / group_size}, kGroups);
  if (offsets != nullptr) {
    require_same_dtype(*offsets, "offsets", scales, "scales");
    require_shape(*offsets, "offsets", {n, k / group_size}, kGroups);
  }
  return {n, k, scale_type};
}

WeightOnlyGemmArgs check_weight_only_gemm_args(Tensor const& x, std::initializer_list<ScalarType> x_types,
                                               Tensor const& qweight, Tensor const& scales, Tensor const* offsets,
                                               int group_size, int bits, GroupSizeRule const& rule, Tensor const& out,
                                               Tensor const* bias) {
  QuantizedWeightArgs const w = check_quantized_weight(qweight, scales, offsets, group_size, bits, rule);
  std::int64_t const m = check_gemm_x(x, x_types, w.k, bits == 4 ? "k (2 * qweight.shape[1])" : "k (qweight.shape[1])");
  check_gemm_out(out, x, m, w.n);
  if (bias != nullptr) check_gemm_bias(*bias, x, w.n);
  ScalarType dtype;
  scalar_type_of(x, &dtype);
  return {m, w.n, w.k, dtype, w.scale_type};
}

std::int64_t check_gemm_x(Tensor const& x, std::initializer_list<ScalarType> x_types, std::int64_t k,
                          char const* k_what) {
  float_type(x, "x", x_types);
  require_ndim(x, "x", 2, "[m, k]");
  require_dim(x, "x", 1, k, k_what);
  return static_cast<std::int64_t>(x.shape(0));
}

void check_gemm_out(Tensor const& out, Tensor const& x, std::int64_t m, std::int64_t n) {
  require_same_dtype(out, "out", x, "x");
  require_shape(out, "out", {m, n}, "[m, n]");
}

void check_gemm_bias(Tensor const& bias, Tensor const& x, std::int64_t n) {
  require_same_dtype(bias, "bias", x, "x");
  require_shape(bias, "bias", {n}, "[n]");
}

SamplingArgs check_sampling_args(Tensor const& logits, Tensor const& temperature, Tensor const& top_k,
                                 Tensor const& top_p, Tensor const& min_p, Tensor const& seeds, Tensor const& steps,
                                 Tensor const& out) {
  SamplingArgs s{};
  s.dtype = float_type(logits, "logits");
  require_ndim(logits, "logits", 2, "[N, V]");
  s.num_rows = static_cast<std::int64_t>(logits.shape(0));
  s.vocab_size = static_cast<std::int64_t>(logits.shape(1));
  if (s.vocab_size < 1 || s.vocab_size > 0x7fffffffLL) {
    throw_value_error("logits.shape[1] (V) must be in 1 .. 2^31 - 1, got " + std::to_string(s.vocab_size));
  }
  if (s.num_rows > 0 && s.vocab_size > 1 && logits.stride(1) != 1) {
    throw_value_error("logits must have unit stride along the vocabulary (dimension 1), got strides " +
                      strides_str(logits));
  }
  if (s.num_rows > 1 && logits.stride(0) < 0) {
    throw_value_error("logits must not have a negative row stride, got strides " + strides_str(logits));
  }
  s.row_stride = s.num_rows > 1 ? logits.stride(0) : 0;
  require_vector(temperature, "temperature", ScalarType::kFloat32, s.num_rows, kColumn);
  require_vector(top_k, "top_k", ScalarType::kInt32, s.num_rows, kColumn);
  require_vector(top_p, "top_p", ScalarType::kFloat32, s.num_rows, kColumn);
  require_vector(min_p, "min_p", ScalarType::kFloat32, s.num_rows, kColumn);
  require_dtype_in(seeds, "seeds", {ScalarType::kUInt64, ScalarType::kInt64});  // an int64 seed is its bits
  require_shape(seeds, "seeds", {s.num_rows}, kColumn);
  require_contiguous(seeds, "seeds");
  require_vector(steps, "steps", ScalarType::kInt64, s.num_rows, kColumn);
  require_vector(out, "out", ScalarType::kInt64, s.num_rows, kColumn);
  s.tensors = {NamedTensor{&logits, "logits"},
               {&temperature, "temperature"},
               {&top_k, "top_k"},
               {&top_p, "top_p"},
               {&min_p, "min_p"},
               {&seeds, "seeds"},
               {&steps, "steps"},
               {&out, "out"}};
  return s;
}

}  // namespace inflight::bindings
