// CUDA attention ops: store_kv, paged_attention (decode), context_attention (prefill), their
// CUDA-core *_simt twins and the decode workspace size. Same argument order as the CPU ops, with the
// stream (an integer cudaStream_t, e.g. torch.cuda.current_stream().cuda_stream) last.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "context_attention.h"
#include "cuda_ops_util.h"
#include "paged_attention.h"
#include "registry.h"
#include "store_kv.h"

namespace nb = nanobind;
namespace ck = inflight::kernels::cuda;
using namespace inflight::bindings::cuda_ops;

namespace {

constexpr auto kInt = nb::dlpack::dtype_code::Int;

// The cache's shape, checked against the query/key side: [2, num_blocks, tokens_per_block, num_kv_heads,
// head_dim], contiguous, of `dtype_ref`'s dtype.
struct CacheShape {
  std::int64_t num_blocks;
  int tokens_per_block;
  int num_kv_heads;
  int head_dim;
};

CacheShape check_cache(Tensor const& kv_cache, Tensor const& dtype_ref, char const* ref_name) {
  require_ndim(kv_cache, "kv_cache", 5, "[2, num_blocks, tokens_per_block, num_kv_heads, head_dim]");
  require_dim(kv_cache, "kv_cache", 0, 2, "2 (keys, values)");
  require_same_dtype(kv_cache, "kv_cache", dtype_ref, ref_name);
  require_contiguous(kv_cache, "kv_cache");
  require_aligned(kv_cache, "kv_cache", 16);
  CacheShape c{static_cast<std::int64_t>(kv_cache.shape(1)), static_cast<int>(kv_cache.shape(2)),
               static_cast<int>(kv_cache.shape(3)), static_cast<int>(kv_cache.shape(4))};
  require_positive(c.tokens_per_block, "kv_cache.shape[2] (tokens_per_block)");
  require_positive(c.num_kv_heads, "kv_cache.shape[3] (num_kv_heads)");
  if (c.num_blocks * c.tokens_per_block > 0x7fffffffLL) {
    throw std::invalid_argument("kv_cache holds " + std::to_string(c.num_blocks * c.tokens_per_block) +
                                " slots; at most 2^31 - 1 are addressable");
  }
  return c;
}

void check_head_dim(int head_dim) {
  if (head_dim != 64 && head_dim != 128) {
    throw std::invalid_argument("head_dim must be 64 or 128 (the instantiated sizes), got " + std::to_string(head_dim));
  }
}

void check_heads(int num_heads, int num_kv_heads) {
  if (num_heads < 1 || num_heads % num_kv_heads != 0) {
    throw std::invalid_argument("num_heads (" + std::to_string(num_heads) +
                                ") must be a positive multiple of num_kv_heads (" + std::to_string(num_kv_heads) + ")");
  }
}

// q: [rows, num_heads, head_dim] with contiguous heads; rows may be strided (a slice of a fused qkv) but
// the 16-byte copies need the row starts aligned.
void check_query(Tensor const& q, char const* layout, CacheShape const& c) {
  require_ndim(q, "q", 3, layout);
  require_rows_contiguous(q, "q");
  require_aligned(q, "q", 16);
  if ((row_stride(q) * static_cast<std::int64_t>(q.itemsize())) % 16 != 0) {
    throw std::invalid_argument("q's row stride (" + std::to_string(row_stride(q)) +
                                " elements) must be a multiple of 16 bytes; call .contiguous()");
  }
  require_dim(q, "q", 2, c.head_dim, "kv_cache.shape[4] (head_dim)");
  check_head_dim(c.head_dim);
  check_heads(static_cast<int>(q.shape(1)), c.num_kv_heads);
}

void check_block_tables(Tensor const& block_tables, std::int64_t batch_size, char const* batch_what) {
  require_ndim(block_tables, "block_tables", 2, "[batch_size, max_blocks_per_seq]");
  require_dtype(block_tables, "block_tables", kInt, 32, "int32");
  require_dim(block_tables, "block_tables", 0, batch_size, batch_what);
  if (block_tables.shape(1) > 1 && block_tables.stride(1) != 1) {
    throw std::invalid_argument("block_tables must be contiguous along its second dimension");
  }
  if (block_tables.shape(0) > 1 && block_tables.stride(0) < 0) {
    throw std::invalid_argument("block_tables must not have a negative stride");
  }
}

void check_int32_vector(Tensor const& a, char const* name, std::int64_t length, char const* what) {
  require_ndim(a, name, 1, what);
  require_dtype(a, name, kInt, 32, "int32");
  require_dim(a, name, 0, length, what);
  require_contiguous(a, name);
}

void check_output(Tensor const& out, Tensor const& q) {
  require_ndim(out, "out", 3, "like q");
  for (std::size_t i = 0; i < 3; ++i) require_dim(out, "out", i, static_cast<std::int64_t>(q.shape(i)), "q's");
  require_same_dtype(out, "out", q, "q");
  require_contiguous(out, "out");
  require_aligned(out, "out", 16);
}

void store_kv(Tensor const& k, Tensor const& v, Tensor const& kv_cache, Tensor const& slot_mapping,
              std::uintptr_t stream) {
  ScalarType const dtype = float_type(k, "k", /*allow_float32=*/true);
  require_ndim(k, "k", 3, "[num_tokens, num_kv_heads, head_dim]");
  require_ndim(v, "v", 3, "[num_tokens, num_kv_heads, head_dim]");
  for (std::size_t i = 0; i < 3; ++i) require_dim(v, "v", i, static_cast<std::int64_t>(k.shape(i)), "k's");
  require_same_dtype(v, "v", k, "k");
  require_rows_contiguous(k, "k");
  require_rows_contiguous(v, "v");
  CacheShape const c = check_cache(kv_cache, k, "k");
  require_dim(k, "k", 1, c.num_kv_heads, "kv_cache.shape[3] (num_kv_heads)");
  require_dim(k, "k", 2, c.head_dim, "kv_cache.shape[4] (head_dim)");
  std::int64_t const num_tokens = static_cast<std::int64_t>(k.shape(0));
  require_ndim(slot_mapping, "slot_mapping", 1, "[num_tokens]");
  require_dtype(slot_mapping, "slot_mapping", kInt, 64, "int64");
  require_dim(slot_mapping, "slot_mapping", 0, num_tokens, "k.shape[0] (num_tokens)");
  require_contiguous(slot_mapping, "slot_mapping");
  int const device =
      common_cuda_device({{&k, "k"}, {&v, "v"}, {&kv_cache, "kv_cache"}, {&slot_mapping, "slot_mapping"}});

  ck::StoreKvParams p{};
  p.k = k.data();
  p.v = v.data();
  p.kv_cache = kv_cache.data();
  p.slot_mapping = static_cast<std::int64_t const*>(slot_mapping.data());
  p.num_tokens = num_tokens;
  p.k_token_stride = row_stride(k);
  p.v_token_stride = row_stride(v);
  p.num_kv_heads = c.num_kv_heads;
  p.head_dim = c.head_dim;
  p.num_slots = c.num_blocks * c.tokens_per_block;
  p.dtype = dtype;
  nb::gil_scoped_release release;
  DeviceGuard guard(device);
  check_cuda(ck::launch_store_kv(p, as_stream(stream)), "store_kv");
}

ck::PagedAttentionParams paged_params(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables,
                                      Tensor const& kv_lens, double scale, Tensor const& out,
                                      std::optional<Tensor> const& workspace, ScalarType& dtype, int& device) {
  dtype = float_type(q, "q", /*allow_float32=*/true);
  CacheShape const c = check_cache(kv_cache, q, "q");
  check_query(q, "[batch_size, num_heads, head_dim]", c);
  std::int64_t const batch_size = static_cast<std::int64_t>(q.shape(0));
  if (batch_size > 65535)
    throw std::invalid_argument("batch_size (q.shape[0]) must be <= 65535, got " + std::to_string(batch_size));
  check_block_tables(block_tables, batch_size, "q.shape[0] (batch_size)");
  check_int32_vector(kv_lens, "kv_lens", batch_size, "[batch_size]");
  check_output(out, q);
  if (workspace) {
    require_contiguous(*workspace, "workspace");
    require_aligned(*workspace, "workspace", 16);
    device = common_cuda_device({{&q, "q"},
                                 {&kv_cache, "kv_cache"},
                                 {&block_tables, "block_tables"},
                                 {&kv_lens, "kv_lens"},
                                 {&out, "out"},
                                 {&*workspace, "workspace"}});
  } else {
    device = common_cuda_device(
        {{&q, "q"}, {&kv_cache, "kv_cache"}, {&block_tables, "block_tables"}, {&kv_lens, "kv_lens"}, {&out, "out"}});
  }
  ck::PagedAttentionParams p{};
  p.q = q.data();
  p.q_token_stride = row_stride(q);
  p.kv_cache = kv_cache.data();
  p.num_blocks = c.num_blocks;
  p.tokens_per_block = c.tokens_per_block;
  p.block_tables = static_cast<std::int32_t const*>(block_tables.data());
  p.block_table_stride =
      block_tables.shape(0) > 1 ? block_tables.stride(0) : static_cast<std::int64_t>(block_tables.shape(1));
  p.max_blocks_per_seq = static_cast<int>(block_tables.shape(1));
  p.kv_lens = static_cast<std::int32_t const*>(kv_lens.data());
  p.out = out.data();
  p.workspace = workspace && workspace->nbytes() > 0 ? workspace->data() : nullptr;
  p.workspace_bytes = workspace ? static_cast<std::int64_t>(workspace->nbytes()) : 0;
  p.batch_size = static_cast<int>(batch_size);
  p.num_heads = static_cast<int>(q.shape(1));
  p.num_kv_heads = c.num_kv_heads;
  p.head_dim = c.head_dim;
  p.scale = static_cast<float>(scale);
  p.dtype = dtype;
  return p;
}

void paged_attention(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables, Tensor const& kv_lens,
                     double scale, Tensor const& out, std::optional<Tensor> const& workspace, std::uintptr_t stream) {
  ScalarType dtype{};
  int device = 0;
  ck::PagedAttentionParams const p =
      paged_params(q, kv_cache, block_tables, kv_lens, scale, out, workspace, dtype, device);
  nb::gil_scoped_release release;
  DeviceGuard guard(device);
  check_cuda(ck::launch_paged_attention(p, as_stream(stream)), "paged_attention");
}

void paged_attention_simt(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables, Tensor const& kv_lens,
                          double scale, Tensor const& out, std::uintptr_t stream) {
  ScalarType dtype{};
  int device = 0;
  ck::PagedAttentionParams const p =
      paged_params(q, kv_cache, block_tables, kv_lens, scale, out, std::nullopt, dtype, device);
  nb::gil_scoped_release release;
  DeviceGuard guard(device);
  check_cuda(ck::launch_paged_attention_simt(p, as_stream(stream)), "paged_attention_simt");
}

ck::ContextAttentionParams context_params(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables,
                                          Tensor const& cu_seqlens, Tensor const& kv_lens, double scale,
                                          Tensor const& out, ScalarType& dtype, int& device) {
  dtype = float_type(q, "q", /*allow_float32=*/true);
  CacheShape const c = check_cache(kv_cache, q, "q");
  check_query(q, "[num_tokens, num_heads, head_dim]", c);
  std::int64_t const num_tokens = static_cast<std::int64_t>(q.shape(0));
  if (num_tokens > 0x7fffffffLL - 64) throw std::invalid_argument("num_tokens (q.shape[0]) is too large");
  require_ndim(kv_lens, "kv_lens", 1, "[batch_size]");
  std::int64_t const batch_size = static_cast<std::int64_t>(kv_lens.shape(0));
  check_int32_vector(kv_lens, "kv_lens", batch_size, "[batch_size]");
  check_int32_vector(cu_seqlens, "cu_seqlens", batch_size + 1, "[batch_size + 1] (len(kv_lens) + 1)");
  check_block_tables(block_tables, batch_size, "len(kv_lens) (batch_size)");
  check_output(out, q);
  device = common_cuda_device({{&q, "q"},
                               {&kv_cache, "kv_cache"},
                               {&block_tables, "block_tables"},
                               {&cu_seqlens, "cu_seqlens"},
                               {&kv_lens, "kv_lens"},
                               {&out, "out"}});
  ck::ContextAttentionParams p{};
  p.q = q.data();
  p.q_token_stride = row_stride(q);
  p.kv_cache = kv_cache.data();
  p.num_blocks = c.num_blocks;
  p.tokens_per_block = c.tokens_per_block;
  p.block_tables = static_cast<std::int32_t const*>(block_tables.data());
  p.block_table_stride =
      block_tables.shape(0) > 1 ? block_tables.stride(0) : static_cast<std::int64_t>(block_tables.shape(1));
  p.max_blocks_per_seq = static_cast<int>(block_tables.shape(1));
  p.cu_seqlens = static_cast<std::int32_t const*>(cu_seqlens.data());
  p.kv_lens = static_cast<std::int32_t const*>(kv_lens.data());
  p.out = out.data();
  p.num_tokens = num_tokens;
  p.batch_size = static_cast<int>(batch_size);
  p.num_heads = static_cast<int>(q.shape(1));
  p.num_kv_heads = c.num_kv_heads;
  p.head_dim = c.head_dim;
  p.scale = static_cast<float>(scale);
  p.dtype = dtype;
  return p;
}

void context_attention(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables, Tensor const& cu_seqlens,
                       Tensor const& kv_lens, double scale, Tensor const& out, std::uintptr_t stream) {
  ScalarType dtype{};
  int device = 0;
  ck::ContextAttentionParams const p =
      context_params(q, kv_cache, block_tables, cu_seqlens, kv_lens, scale, out, dtype, device);
  nb::gil_scoped_release release;
  DeviceGuard guard(device);
  check_cuda(ck::launch_context_attention(p, as_stream(stream)), "context_attention");
}

void context_attention_simt(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables,
                            Tensor const& cu_seqlens, Tensor const& kv_lens, double scale, Tensor const& out,
                            std::uintptr_t stream) {
  ScalarType dtype{};
  int device = 0;
  ck::ContextAttentionParams const p =
      context_params(q, kv_cache, block_tables, cu_seqlens, kv_lens, scale, out, dtype, device);
  nb::gil_scoped_release release;
  DeviceGuard guard(device);
  check_cuda(ck::launch_context_attention_simt(p, as_stream(stream)), "context_attention_simt");
}

}  // namespace

INFLIGHT_REGISTER_OPS(cuda_attention) {
  m.def("store_kv", &store_kv, nb::arg("k"), nb::arg("v"), nb::arg("kv_cache"), nb::arg("slot_mapping"),
        nb::arg("stream"),
        "Writes k[t] and v[t] [num_tokens, num_kv_heads, head_dim] into kv_cache [2, num_blocks, tokens_per_block, "
        "num_kv_heads, head_dim] at flat slot slot_mapping[t] (int64; negative: skipped) on `stream`.");
  m.def("paged_attention", &paged_attention, nb::arg("q"), nb::arg("kv_cache"), nb::arg("block_tables"),
        nb::arg("kv_lens"), nb::arg("scale"), nb::arg("out"), nb::arg("workspace").none(), nb::arg("stream"),
        "Decode attention: q [batch, num_heads, head_dim] against keys 0..kv_lens[b]-1 of the paged cache, into "
        "out. workspace (any contiguous CUDA tensor of paged_attention_workspace_size() bytes, or None) lets "
        "long contexts split over several CTAs; without it each sequence is one pass. float16/bfloat16 on "
        "tensor cores, float32 on CUDA cores; head_dim 64 or 128.");
  m.def("paged_attention_simt", &paged_attention_simt, nb::arg("q"), nb::arg("kv_cache"), nb::arg("block_tables"),
        nb::arg("kv_lens"), nb::arg("scale"), nb::arg("out"), nb::arg("stream"),
        "paged_attention on the simple CUDA-core kernel for every dtype (slow; for tests and as a fallback).");
  m.def("paged_attention_workspace_size", &ck::paged_attention_workspace_size, nb::arg("batch_size"),
        nb::arg("num_heads"), nb::arg("max_kv_len"), nb::arg("head_dim"),
        "Bytes of workspace paged_attention can use for a batch whose longest context is max_kv_len (0: none "
        "needed).");
  m.def("context_attention", &context_attention, nb::arg("q"), nb::arg("kv_cache"), nb::arg("block_tables"),
        nb::arg("cu_seqlens"), nb::arg("kv_lens"), nb::arg("scale"), nb::arg("out"), nb::arg("stream"),
        "Causal prefill attention over the paged cache: sequence i's queries q[cu_seqlens[i]:cu_seqlens[i+1]] "
        "(int32 offsets) sit at positions kv_lens[i] - q_len + r. float16/bfloat16 on tensor cores, float32 on "
        "CUDA cores; head_dim 64 or 128.");
  m.def("context_attention_simt", &context_attention_simt, nb::arg("q"), nb::arg("kv_cache"), nb::arg("block_tables"),
        nb::arg("cu_seqlens"), nb::arg("kv_lens"), nb::arg("scale"), nb::arg("out"), nb::arg("stream"),
        "context_attention on the simple CUDA-core kernel for every dtype (slow; for tests and as a fallback).");
}
