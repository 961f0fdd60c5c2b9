// Attention ops over the paged KV cache (csrc/kernels/cpu/attention.h): store_kv, paged_attention,
// context_attention. Tensors arrive through DLPack without a copy; every argument is checked here,
// once, with errors that name it (the kernels trust their params). q, k and v may be strided views
// (e.g. slices of a fused qkv projection) as long as head_dim is contiguous; kv_cache, the index
// tensors and out must be C-contiguous. The GIL is released around the kernels.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <memory>
#include <string>

#include "attention.h"
#include "registry.h"

namespace nb = nanobind;
namespace kc = inflight::kernels::cpu;
namespace ik = inflight::kernels;
using namespace nb::literals;

namespace {

using Array = nb::ndarray<>;

std::string dtype_name(nb::dlpack::dtype dt) {
  using Code = nb::dlpack::dtype_code;
  char const* kind = "unknown";
  switch (static_cast<Code>(dt.code)) {
    case Code::Int:
      kind = "int";
      break;
    case Code::UInt:
      kind = "uint";
      break;
    case Code::Float:
      kind = "float";
      break;
    case Code::Bfloat:
      kind = "bfloat";
      break;
    case Code::Bool:
      kind = "bool";
      break;
    default:
      break;
  }
  return std::string(kind) + std::to_string(dt.bits);
}

std::string shape_str(Array const& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

[[noreturn]] void fail(std::string const& msg) { throw nb::value_error(msg.c_str()); }

void check_cpu(Array const& a, char const* name) {
  if (a.device_type() != nb::device::cpu::value)
    throw nb::type_error((std::string(name) + " must be a CPU tensor (the CUDA ops live in inflight._C_cuda)").c_str());
}

ik::ScalarType element_type(Array const& a, char const* name) {
  nb::dlpack::dtype const dt = a.dtype();
  using Code = nb::dlpack::dtype_code;
  if (dt.lanes == 1 && dt.code == uint8_t(Code::Float) && dt.bits == 32) return ik::ScalarType::kFloat32;
  if (dt.lanes == 1 && dt.code == uint8_t(Code::Bfloat) && dt.bits == 16) return ik::ScalarType::kBFloat16;
  if (dt.lanes == 1 && dt.code == uint8_t(Code::Float) && dt.bits == 16) return ik::ScalarType::kFloat16;
  throw nb::type_error((std::string(name) + " must be float32, bfloat16 or float16, got " + dtype_name(dt)).c_str());
}

void check_same_dtype(Array const& a, char const* name, Array const& ref, char const* ref_name) {
  if (a.dtype() != ref.dtype())
    throw nb::type_error((std::string(name) + " must have " + ref_name + "'s dtype (" + dtype_name(ref.dtype()) +
                          "), got " + dtype_name(a.dtype()))
                             .c_str());
}

void check_int(Array const& a, char const* name, int bits) {
  nb::dlpack::dtype const dt = a.dtype();
  if (dt.code != uint8_t(nb::dlpack::dtype_code::Int) || dt.bits != bits || dt.lanes != 1)
    throw nb::type_error(
        (std::string(name) + " must be int" + std::to_string(bits) + ", got " + dtype_name(dt)).c_str());
}

void check_ndim(Array const& a, char const* name, size_t ndim, char const* layout) {
  if (a.ndim() != ndim)
    fail(std::string(name) + " must be " + std::to_string(ndim) + "-D " + layout + ", got shape " + shape_str(a));
}

void check_contiguous(Array const& a, char const* name) {
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected)
      fail(std::string(name) + " must be C-contiguous (shape " + shape_str(a) + ")");
    expected *= int64_t(a.shape(i));
  }
}

void check_rows_contiguous(Array const& a, char const* name) {
  if (a.shape(a.ndim() - 1) > 1 && a.stride(a.ndim() - 1) != 1)
    fail(std::string(name) + " must be contiguous in its last dim (head_dim)");
}

void check_dim(Array const& a, char const* name, size_t dim, int64_t expected, char const* what) {
  if (int64_t(a.shape(dim)) != expected)
    fail(std::string(name) + ".shape[" + std::to_string(dim) + "] must be " + what + " (" + std::to_string(expected) +
         "), got " + std::to_string(a.shape(dim)));
}

void check_threads(int num_threads) {
  if (num_threads < 1) fail("num_threads must be >= 1, got " + std::to_string(num_threads));
}

struct CacheShape {
  int num_blocks, tokens_per_block, num_kv_heads, head_dim;
};

CacheShape check_cache(Array const& kv_cache) {
  check_cpu(kv_cache, "kv_cache");
  check_ndim(kv_cache, "kv_cache", 5, "[2, num_blocks, tokens_per_block, num_kv_heads, head_dim]");
  element_type(kv_cache, "kv_cache");
  check_dim(kv_cache, "kv_cache", 0, 2, "2 (K and V)");
  check_contiguous(kv_cache, "kv_cache");
  CacheShape c{int(kv_cache.shape(1)), int(kv_cache.shape(2)), int(kv_cache.shape(3)), int(kv_cache.shape(4))};
  if (c.num_blocks < 1 || c.tokens_per_block < 1 || c.num_kv_heads < 1 || c.head_dim < 1)
    fail("kv_cache has an empty dimension: shape " + shape_str(kv_cache));
  return c;
}

// q [num_tokens, num_heads, head_dim] against the cache; returns num_heads.
int check_query(Array const& q, CacheShape const& c, Array const& kv_cache, char const* layout) {
  check_cpu(q, "q");
  check_ndim(q, "q", 3, layout);
  element_type(q, "q");
  check_same_dtype(kv_cache, "kv_cache", q, "q");
  check_rows_contiguous(q, "q");
  check_dim(q, "q", 2, c.head_dim, "kv_cache's head_dim");
  int const num_heads = int(q.shape(1));
  if (num_heads < 1 || num_heads % c.num_kv_heads != 0)
    fail("q's num_heads (" + std::to_string(num_heads) + ") must be a positive multiple of kv_cache's num_kv_heads (" +
         std::to_string(c.num_kv_heads) + ")");
  if (num_heads / c.num_kv_heads > kc::kMaxGroupSize)
    fail("num_heads / num_kv_heads must be <= " + std::to_string(kc::kMaxGroupSize) + ", got " +
         std::to_string(num_heads / c.num_kv_heads));
  if (c.head_dim > kc::kMaxHeadDim)
    fail("head_dim must be <= " + std::to_string(kc::kMaxHeadDim) + ", got " + std::to_string(c.head_dim));
  return num_heads;
}

void check_out(Array const& out, Array const& q) {
  check_cpu(out, "out");
  check_same_dtype(out, "out", q, "q");
  check_ndim(out, "out", 3, "like q");
  for (size_t i = 0; i < 3; ++i) check_dim(out, "out", i, int64_t(q.shape(i)), "q's");
  check_contiguous(out, "out");
}

// block_tables [batch, max_blocks] int32 and kv_lens [batch] int32: every kv_len fits the table and
// every block id it reaches is in the cache (the kernels index the cache with them unchecked).
void check_tables(Array const& block_tables, Array const& kv_lens, int batch, CacheShape const& c) {
  check_cpu(block_tables, "block_tables");
  check_cpu(kv_lens, "kv_lens");
  check_int(block_tables, "block_tables", 32);
  check_int(kv_lens, "kv_lens", 32);
  check_ndim(block_tables, "block_tables", 2, "[batch, max_blocks_per_seq]");
  check_ndim(kv_lens, "kv_lens", 1, "[batch]");
  check_dim(block_tables, "block_tables", 0, batch, "the batch size");
  check_dim(kv_lens, "kv_lens", 0, batch, "the batch size");
  check_contiguous(block_tables, "block_tables");
  check_contiguous(kv_lens, "kv_lens");
  int64_t const max_blocks = int64_t(block_tables.shape(1));
  auto const* tables = static_cast<int32_t const*>(block_tables.data());
  auto const* lens = static_cast<int32_t const*>(kv_lens.data());
  for (int b = 0; b < batch; ++b) {
    int64_t const len = lens[b];
    if (len < 1 || len > max_blocks * c.tokens_per_block)
      fail("kv_lens[" + std::to_string(b) + "] = " + std::to_string(len) + " must be in 1 .. " +
           std::to_string(max_blocks * c.tokens_per_block) + " (block_tables columns x tokens_per_block)");
    int64_t const used = (len + c.tokens_per_block - 1) / c.tokens_per_block;
    for (int64_t j = 0; j < used; ++j) {
      int32_t const id = tables[b * max_blocks + j];
      if (id < 0 || id >= c.num_blocks)
        fail("block_tables[" + std::to_string(b) + ", " + std::to_string(j) + "] = " + std::to_string(id) +
             " is outside the cache's 0 .. " + std::to_string(c.num_blocks - 1));
    }
  }
}

void store_kv(Array k, Array v, Array kv_cache, Array slot_mapping, int num_threads) {
  check_threads(num_threads);
  CacheShape const c = check_cache(kv_cache);
  check_cpu(k, "k");
  check_cpu(v, "v");
  check_cpu(slot_mapping, "slot_mapping");
  check_ndim(k, "k", 3, "[num_tokens, num_kv_heads, head_dim]");
  check_ndim(v, "v", 3, "[num_tokens, num_kv_heads, head_dim]");
  check_same_dtype(k, "k", kv_cache, "kv_cache");
  check_same_dtype(v, "v", kv_cache, "kv_cache");
  check_dim(k, "k", 1, c.num_kv_heads, "kv_cache's num_kv_heads");
  check_dim(k, "k", 2, c.head_dim, "kv_cache's head_dim");
  for (size_t i = 0; i < 3; ++i) check_dim(v, "v", i, int64_t(k.shape(i)), "k's");
  check_rows_contiguous(k, "k");
  check_rows_contiguous(v, "v");
  check_int(slot_mapping, "slot_mapping", 64);
  check_ndim(slot_mapping, "slot_mapping", 1, "[num_tokens]");
  check_dim(slot_mapping, "slot_mapping", 0, int64_t(k.shape(0)), "k's num_tokens");
  check_contiguous(slot_mapping, "slot_mapping");

  kc::StoreKvParams p;
  p.k = k.data();
  p.v = v.data();
  p.k_token_stride = k.stride(0);
  p.k_head_stride = k.stride(1);
  p.v_token_stride = v.stride(0);
  p.v_head_stride = v.stride(1);
  p.kv_cache = kv_cache.data();
  p.slot_mapping = static_cast<int64_t const*>(slot_mapping.data());
  p.num_slots = int64_t(c.num_blocks) * c.tokens_per_block;
  p.num_tokens = int(k.shape(0));
  p.num_kv_heads = c.num_kv_heads;
  p.head_dim = c.head_dim;
  p.dtype = element_type(kv_cache, "kv_cache");
  p.num_threads = num_threads;
  for (int t = 0; t < p.num_tokens; ++t)
    if (p.slot_mapping[t] >= p.num_slots)
      fail("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(p.slot_mapping[t]) +
           " is outside the cache's " + std::to_string(p.num_slots) + " slots (negative = skip)");
  nb::gil_scoped_release release;
  kc::launch_store_kv(p, kc::ThreadPool::global());
}

void paged_attention(Array q, Array kv_cache, Array block_tables, Array kv_lens, float scale, Array out,
                     int num_threads) {
  check_threads(num_threads);
  CacheShape const c = check_cache(kv_cache);
  int const num_heads = check_query(q, c, kv_cache, "[batch, num_heads, head_dim]");
  check_out(out, q);
  int const batch = int(q.shape(0));
  check_tables(block_tables, kv_lens, batch, c);

  kc::PagedAttentionParams p;
  p.q = q.data();
  p.q_token_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.kv_cache = kv_cache.data();
  p.block_tables = static_cast<int32_t const*>(block_tables.data());
  p.kv_lens = static_cast<int32_t const*>(kv_lens.data());
  p.out = out.data();
  p.batch_size = batch;
  p.num_heads = num_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.head_dim = c.head_dim;
  p.num_blocks = c.num_blocks;
  p.tokens_per_block = c.tokens_per_block;
  p.max_blocks_per_seq = int(block_tables.shape(1));
  p.block_table_stride = int64_t(block_tables.shape(1));
  p.scale = scale;
  p.dtype = element_type(q, "q");
  p.num_threads = num_threads;
  if (batch == 0) return;
  nb::gil_scoped_release release;
  // The partials of split sequences; the kernels allocate nothing themselves.
  p.workspace_bytes = kc::paged_attention_workspace_size(p);
  std::unique_ptr<float[]> workspace(p.workspace_bytes ? new float[p.workspace_bytes / sizeof(float)] : nullptr);
  p.workspace = workspace.get();
  kc::launch_paged_attention(p, kc::ThreadPool::global());
}

void context_attention(Array q, Array kv_cache, Array block_tables, Array cu_seqlens, Array kv_lens, float scale,
                       Array out, int num_threads) {
  check_threads(num_threads);
  CacheShape const c = check_cache(kv_cache);
  int const num_heads = check_query(q, c, kv_cache, "[num_tokens, num_heads, head_dim]");
  check_out(out, q);
  int const num_tokens = int(q.shape(0));
  check_cpu(cu_seqlens, "cu_seqlens");
  check_int(cu_seqlens, "cu_seqlens", 32);
  check_ndim(cu_seqlens, "cu_seqlens", 1, "[batch + 1]");
  check_contiguous(cu_seqlens, "cu_seqlens");
  if (cu_seqlens.shape(0) < 1) fail("cu_seqlens must have batch + 1 >= 1 entries, got 0");
  int const batch = int(cu_seqlens.shape(0)) - 1;
  check_tables(block_tables, kv_lens, batch, c);
  auto const* cu = static_cast<int32_t const*>(cu_seqlens.data());
  auto const* lens = static_cast<int32_t const*>(kv_lens.data());
  if (cu[0] != 0) fail("cu_seqlens[0] must be 0, got " + std::to_string(cu[0]));
  if (cu[batch] != num_tokens)
    fail("cu_seqlens[-1] = " + std::to_string(cu[batch]) + " must equal q's num_tokens (" + std::to_string(num_tokens) +
         ")");
  for (int b = 0; b < batch; ++b) {
    int const q_len = cu[b + 1] - cu[b];
    if (q_len < 0 || q_len > lens[b])
      fail("sequence " + std::to_string(b) + ": need 0 <= q_len (cu_seqlens[i+1] - cu_seqlens[i] = " +
           std::to_string(q_len) + ") <= kv_lens[i] (" + std::to_string(lens[b]) + ")");
  }

  kc::ContextAttentionParams p;
  p.q = q.data();
  p.q_token_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.kv_cache = kv_cache.data();
  p.block_tables = static_cast<int32_t const*>(block_tables.data());
  p.cu_seqlens = cu;
  p.kv_lens = lens;
  p.out = out.data();
  p.batch_size = batch;
  p.num_tokens = num_tokens;
  p.num_heads = num_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.head_dim = c.head_dim;
  p.num_blocks = c.num_blocks;
  p.tokens_per_block = c.tokens_per_block;
  p.max_blocks_per_seq = int(block_tables.shape(1));
  p.block_table_stride = int64_t(block_tables.shape(1));
  p.scale = scale;
  p.dtype = element_type(q, "q");
  p.num_threads = num_threads;
  nb::gil_scoped_release release;
  kc::launch_context_attention(p, kc::ThreadPool::global());
}

}  // namespace

INFLIGHT_REGISTER_OPS(attention) {
  m.def("store_kv", &store_kv, "k"_a, "v"_a, "kv_cache"_a.noconvert(), "slot_mapping"_a, "num_threads"_a,
        "Writes k, v [num_tokens, num_kv_heads, head_dim] into kv_cache [2, num_blocks, tokens_per_block, "
        "num_kv_heads, head_dim] at slot_mapping [num_tokens] int64 (slot = block * tokens_per_block + offset; "
        "negative = skip). In place.");
  m.def("paged_attention", &paged_attention, "q"_a, "kv_cache"_a, "block_tables"_a, "kv_lens"_a, "scale"_a,
        "out"_a.noconvert(), "num_threads"_a,
        "Decode attention: q [batch, num_heads, head_dim], one query per sequence, against keys 0 .. kv_lens[i]-1 "
        "of its blocks (block_tables [batch, max_blocks] int32, kv_lens [batch] int32). Writes out [batch, "
        "num_heads, head_dim] (contiguous, q's dtype).");
  m.def("context_attention", &context_attention, "q"_a, "kv_cache"_a, "block_tables"_a, "cu_seqlens"_a, "kv_lens"_a,
        "scale"_a, "out"_a.noconvert(), "num_threads"_a,
        "Prefill / chunked-prefill attention: sequence i's queries are q rows cu_seqlens[i] .. cu_seqlens[i+1]-1 "
        "at positions kv_lens[i] - q_len + r, causal over the sequence's cached keys. Writes out [num_tokens, "
        "num_heads, head_dim] (contiguous, q's dtype).");
}
