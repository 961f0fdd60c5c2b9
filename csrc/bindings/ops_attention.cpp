// Attention ops over the paged KV cache (csrc/kernels/cpu/attention.h): store_kv, paged_attention,
// context_attention. Tensors arrive through DLPack without a copy. Every argument is checked here,
// once (the kernels trust their params): dtypes and shapes as the CUDA ops check them (op_checks.h),
// then what the CPU kernels need: q, k and v may be strided views (e.g. slices of a fused qkv
// projection) as long as head_dim is contiguous, the kernels' head and group limits, the devices, and
// the host values the kernels index with (kv_lens, block ids, cu_seqlens, slots). The GIL is released
// around the kernels.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "attention.h"
#include "op_checks.h"
#include "registry.h"

namespace nb = nanobind;
namespace kc = inflight::kernels::cpu;
using namespace nb::literals;
using namespace inflight::bindings;

namespace {

// The head layout and sizes the CPU kernels take.
void check_cpu_query(Tensor const& q, AttentionArgs const& a) {
  require_contiguous(q, "q", 2);
  int const group = a.num_heads / a.cache.num_kv_heads;
  if (group > kc::kMaxGroupSize) {
    throw_value_error("num_heads / num_kv_heads must be <= " + std::to_string(kc::kMaxGroupSize) + ", got " +
                      std::to_string(group));
  }
  if (a.cache.head_dim > kc::kMaxHeadDim) {
    throw_value_error("head_dim must be <= " + std::to_string(kc::kMaxHeadDim) + ", got " +
                      std::to_string(a.cache.head_dim));
  }
}

Tensor const* optional_tensor(std::optional<Tensor> const& t) { return t ? &*t : nullptr; }

void store_kv(Tensor k, Tensor v, Tensor kv_cache, Tensor slot_mapping, int num_threads,
              std::optional<Tensor> kv_scales, double k_scale, double v_scale) {
  require_at_least(num_threads, 1, "num_threads");
  Tensor const* scales = optional_tensor(kv_scales);
  StoreKvArgs const a = check_store_kv_args(k, v, kv_cache, slot_mapping, scales, k_scale, v_scale);
  require_contiguous(k, "k", 2);
  require_contiguous(v, "v", 2);
  require_cpu({{&k, "k"}, {&v, "v"}, {&kv_cache, "kv_cache"}, {&slot_mapping, "slot_mapping"}, {scales, "kv_scales"}});
  check_slot_mapping_values(slot_mapping, a.cache.num_slots());
  kc::StoreKvParams p;
  fill_store_kv_params(p, k, v, kv_cache, slot_mapping, a);
  p.k_head_stride = k.stride(1);
  p.v_head_stride = v.stride(1);
  p.num_threads = num_threads;
  nb::gil_scoped_release release;
  kc::launch_store_kv(p, kc::ThreadPool::global());
}

void paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor kv_lens, float scale, Tensor out,
                     int num_threads, int window, std::optional<Tensor> kv_scales, double k_scale, double v_scale) {
  require_at_least(num_threads, 1, "num_threads");
  require_at_least(window, 0, "window");
  Tensor const* scales = optional_tensor(kv_scales);
  AttentionArgs const a = check_paged_attention_args(q, kv_cache, block_tables, kv_lens, out, scales, k_scale, v_scale);
  check_cpu_query(q, a);
  require_cpu({{&q, "q"},
               {&kv_cache, "kv_cache"},
               {&block_tables, "block_tables"},
               {&kv_lens, "kv_lens"},
               {&out, "out"},
               {scales, "kv_scales"}});
  check_block_table_values(block_tables, kv_lens, a.cache);
  if (a.batch_size == 0) return;
  kc::PagedAttentionParams p;
  fill_attention_params(p, q, kv_cache, block_tables, kv_lens, out, scale, a);
  p.q_head_stride = q.stride(1);
  p.num_threads = num_threads;
  p.window = window;
  nb::gil_scoped_release release;
  // The partials of split sequences; the kernels allocate nothing themselves.
  p.workspace_bytes = kc::paged_attention_workspace_size(p);
  std::unique_ptr<float[]> workspace(p.workspace_bytes ? new float[p.workspace_bytes / sizeof(float)] : nullptr);
  p.workspace = workspace.get();
  kc::launch_paged_attention(p, kc::ThreadPool::global());
}

void context_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor cu_seqlens, Tensor kv_lens, float scale,
                       Tensor out, int num_threads, int window, std::optional<Tensor> kv_scales, double k_scale,
                       double v_scale) {
  require_at_least(num_threads, 1, "num_threads");
  require_at_least(window, 0, "window");
  Tensor const* scales = optional_tensor(kv_scales);
  AttentionArgs const a =
      check_context_attention_args(q, kv_cache, block_tables, cu_seqlens, kv_lens, out, scales, k_scale, v_scale);
  check_cpu_query(q, a);
  require_cpu({{&q, "q"},
               {&kv_cache, "kv_cache"},
               {&block_tables, "block_tables"},
               {&cu_seqlens, "cu_seqlens"},
               {&kv_lens, "kv_lens"},
               {&out, "out"},
               {scales, "kv_scales"}});
  check_block_table_values(block_tables, kv_lens, a.cache);
  check_cu_seqlens_values(cu_seqlens, kv_lens, a.num_tokens, "q.shape[0] (num_tokens)");
  kc::ContextAttentionParams p;
  fill_attention_params(p, q, kv_cache, block_tables, kv_lens, out, scale, a);
  p.q_head_stride = q.stride(1);
  p.cu_seqlens = static_cast<std::int32_t const*>(cu_seqlens.data());
  p.num_tokens = a.num_tokens;
  p.num_threads = num_threads;
  p.window = window;
  nb::gil_scoped_release release;
  kc::launch_context_attention(p, kc::ThreadPool::global());
}

}  // namespace

INFLIGHT_REGISTER_OPS(attention) {
  m.def("store_kv", &store_kv, "k"_a, "v"_a, "kv_cache"_a.noconvert(), "slot_mapping"_a, "num_threads"_a,
        "kv_scales"_a.noconvert().none() = nb::none(), "k_scale"_a = 1.0, "v_scale"_a = 1.0,
        "Writes k, v [num_tokens, num_kv_heads, head_dim] into kv_cache [2, num_blocks, tokens_per_block, "
        "num_kv_heads, head_dim] at slot_mapping [num_tokens] int64 (slot = block * tokens_per_block + offset; "
        "negative = skip). In place. An int8 kv_cache stores each (token, KV head) row quantised, its scale "
        "(max |x| / 127) into kv_scales [2, num_blocks, tokens_per_block, num_kv_heads] float32. A uint8 kv_cache "
        "holds FP8 E4M3 bytes: x / k_scale (x / v_scale) rounded to nearest even, saturated to +-448.");
  m.def("paged_attention", &paged_attention, "q"_a, "kv_cache"_a, "block_tables"_a, "kv_lens"_a, "scale"_a,
        "out"_a.noconvert(), "num_threads"_a, "window"_a = 0, "kv_scales"_a.none() = nb::none(), "k_scale"_a = 1.0,
        "v_scale"_a = 1.0,
        "Decode attention: q [batch, num_heads, head_dim], one query per sequence, against keys 0 .. kv_lens[i]-1 "
        "of its blocks (block_tables [batch, max_blocks] int32, kv_lens [batch] int32); window > 0: only the "
        "last `window` of them (sliding-window attention), 0: all. Writes out [batch, num_heads, head_dim] "
        "(contiguous, q's dtype). An int8 kv_cache is read with its kv_scales, a uint8 (fp8 e4m3) one with k_scale "
        "and v_scale (see store_kv).");
  m.def("context_attention", &context_attention, "q"_a, "kv_cache"_a, "block_tables"_a, "cu_seqlens"_a, "kv_lens"_a,
        "scale"_a, "out"_a.noconvert(), "num_threads"_a, "window"_a = 0, "kv_scales"_a.none() = nb::none(),
        "k_scale"_a = 1.0, "v_scale"_a = 1.0,
        "Prefill / chunked-prefill attention: sequence i's queries are q rows cu_seqlens[i] .. cu_seqlens[i+1]-1 "
        "at positions kv_lens[i] - q_len + r, causal over the sequence's cached keys; window > 0: a query at "
        "position p sees only keys p - window + 1 .. p (sliding-window attention), 0: all. Writes out "
        "[num_tokens, num_heads, head_dim] (contiguous, q's dtype). An int8 kv_cache is read with its kv_scales, a "
        "uint8 (fp8 e4m3) one with k_scale and v_scale.");
}
