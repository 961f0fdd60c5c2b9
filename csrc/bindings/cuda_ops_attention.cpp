// CUDA attention ops: store_kv, paged_attention (decode), context_attention (prefill), their
// CUDA-core *_simt twins and the decode workspace size. The arguments and their checks are the CPU
// ops' (op_checks.h), with the stream (an integer cudaStream_t, e.g.
// torch.cuda.current_stream().cuda_stream) in num_threads' place, before the window; what only these kernels need
// (16-byte aligned rows, head_dim 64 or 128, grid limits) is checked here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <string>

#include "context_attention.h"
#include "cuda_launch.h"
#include "op_checks.h"
#include "paged_attention.h"
#include "registry.h"
#include "store_kv.h"

namespace nb = nanobind;
namespace ck = inflight::kernels::cuda;
using namespace inflight::bindings;

namespace {

// The cache's slots are addressed with 32-bit indices; the 16-byte copies need an aligned base.
void check_cuda_cache(Tensor const& kv_cache, KvCacheShape const& c) {
  require_aligned(kv_cache, "kv_cache", 16);
  if (c.num_slots() > 0x7fffffffLL) {
    throw_value_error("kv_cache holds " + std::to_string(c.num_slots()) + " slots; at most 2^31 - 1 are addressable");
  }
}

// q: rows may be strided (a slice of a fused qkv) but heads are contiguous, and the 16-byte copies
// need the row starts aligned.
void check_cuda_query(Tensor const& q, int head_dim) {
  require_contiguous(q, "q", 1);
  require_aligned(q, "q", 16);
  if ((row_stride(q) * static_cast<std::int64_t>(q.itemsize())) % 16 != 0) {
    throw_value_error("q's row stride (" + std::to_string(row_stride(q)) +
                      " elements) must be a multiple of 16 bytes; call .contiguous()");
  }
  if (head_dim != 64 && head_dim != 128) {
    throw_value_error("head_dim must be 64 or 128 (the instantiated sizes), got " + std::to_string(head_dim));
  }
}

template <class Params>
void run(cudaError_t (*launch)(Params const&, cudaStream_t), Params const& p, int device, std::uintptr_t stream,
         char const* what) {
  nb::gil_scoped_release release;
  DeviceGuard guard(device);
  check_cuda(launch(p, as_stream(stream)), what);
}

Tensor const* optional_tensor(std::optional<Tensor> const& t) { return t ? &*t : nullptr; }

void store_kv(Tensor const& k, Tensor const& v, Tensor const& kv_cache, Tensor const& slot_mapping,
              std::uintptr_t stream, std::optional<Tensor> const& kv_scales, double k_scale, double v_scale) {
  Tensor const* scales = optional_tensor(kv_scales);
  StoreKvArgs const a = check_store_kv_args(k, v, kv_cache, slot_mapping, scales, k_scale, v_scale);
  require_contiguous(k, "k", 1);
  require_contiguous(v, "v", 1);
  check_cuda_cache(kv_cache, a.cache);
  int const device = require_one_cuda_device(
      {{&k, "k"}, {&v, "v"}, {&kv_cache, "kv_cache"}, {&slot_mapping, "slot_mapping"}, {scales, "kv_scales"}});
  ck::StoreKvParams p{};
  fill_store_kv_params(p, k, v, kv_cache, slot_mapping, a);
  run(ck::launch_store_kv, p, device, stream, "store_kv");
}

// The params of paged_attention and its twin; *device: the tensors' device.
ck::PagedAttentionParams paged_params(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables,
                                      Tensor const& kv_lens, double scale, Tensor const& out,
                                      std::optional<Tensor> const& workspace, int window,
                                      std::optional<Tensor> const& kv_scales, double k_scale, double v_scale,
                                      int* device) {
  require_at_least(window, 0, "window");
  Tensor const* scales = optional_tensor(kv_scales);
  AttentionArgs const a = check_paged_attention_args(q, kv_cache, block_tables, kv_lens, out, scales, k_scale, v_scale);
  check_cuda_cache(kv_cache, a.cache);
  check_cuda_query(q, a.cache.head_dim);
  require_aligned(out, "out", 16);
  if (a.batch_size > 65535) {
    throw_value_error("batch_size (q.shape[0]) must be <= 65535, got " + std::to_string(a.batch_size));
  }
  Tensor const* ws = workspace ? &*workspace : nullptr;
  if (ws != nullptr) {
    require_contiguous(*ws, "workspace");
    require_aligned(*ws, "workspace", 16);
  }
  *device = require_one_cuda_device({{&q, "q"},
                                     {&kv_cache, "kv_cache"},
                                     {&block_tables, "block_tables"},
                                     {&kv_lens, "kv_lens"},
                                     {&out, "out"},
                                     {ws, "workspace"},
                                     {scales, "kv_scales"}});
  ck::PagedAttentionParams p{};
  fill_attention_params(p, q, kv_cache, block_tables, kv_lens, out, scale, a);
  p.workspace = ws != nullptr && ws->nbytes() > 0 ? ws->data() : nullptr;
  p.workspace_bytes = ws != nullptr ? static_cast<std::int64_t>(ws->nbytes()) : 0;
  p.window = window;
  return p;
}

void paged_attention(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables, Tensor const& kv_lens,
                     double scale, Tensor const& out, std::optional<Tensor> const& workspace, std::uintptr_t stream,
                     int window, std::optional<Tensor> const& kv_scales, double k_scale, double v_scale) {
  int device = 0;
  auto const p = paged_params(q, kv_cache, block_tables, kv_lens, scale, out, workspace, window, kv_scales, k_scale,
                              v_scale, &device);
  run(ck::launch_paged_attention, p, device, stream, "paged_attention");
}

void paged_attention_simt(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables, Tensor const& kv_lens,
                          double scale, Tensor const& out, std::uintptr_t stream, int window,
                          std::optional<Tensor> const& kv_scales, double k_scale, double v_scale) {
  int device = 0;
  auto const p = paged_params(q, kv_cache, block_tables, kv_lens, scale, out, std::nullopt, window, kv_scales, k_scale,
                              v_scale, &device);
  run(ck::launch_paged_attention_simt, p, device, stream, "paged_attention_simt");
}

// The params of context_attention and its twin; *device: the tensors' device.
ck::ContextAttentionParams context_params(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables,
                                          Tensor const& cu_seqlens, Tensor const& kv_lens, double scale,
                                          Tensor const& out, int window, std::optional<Tensor> const& kv_scales,
                                          double k_scale, double v_scale, int* device) {
  require_at_least(window, 0, "window");
  Tensor const* scales = optional_tensor(kv_scales);
  AttentionArgs const a =
      check_context_attention_args(q, kv_cache, block_tables, cu_seqlens, kv_lens, out, scales, k_scale, v_scale);
  check_cuda_cache(kv_cache, a.cache);
  check_cuda_query(q, a.cache.head_dim);
  require_aligned(out, "out", 16);
  if (a.num_tokens > 0x7fffffffLL - 64) {
    throw_value_error("num_tokens (q.shape[0]) must be < 2^31 - 64, got " + std::to_string(a.num_tokens));
  }
  *device = require_one_cuda_device({{&q, "q"},
                                     {&kv_cache, "kv_cache"},
                                     {&block_tables, "block_tables"},
                                     {&cu_seqlens, "cu_seqlens"},
                                     {&kv_lens, "kv_lens"},
                                     {&out, "out"},
                                     {scales, "kv_scales"}});
  ck::ContextAttentionParams p{};
  fill_attention_params(p, q, kv_cache, block_tables, kv_lens, out, scale, a);
  p.cu_seqlens = static_cast<std::int32_t const*>(cu_seqlens.data());
  p.num_tokens = a.num_tokens;
  p.window = window;
  return p;
}

void context_attention(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables, Tensor const& cu_seqlens,
                       Tensor const& kv_lens, double scale, Tensor const& out, std::uintptr_t stream, int window,
                       std::optional<Tensor> const& kv_scales, double k_scale, double v_scale) {
  int device = 0;
  auto const p = context_params(q, kv_cache, block_tables, cu_seqlens, kv_lens, scale, out, window, kv_scales, k_scale,
                                v_scale, &device);
  run(ck::launch_context_attention, p, device, stream, "context_attention");
}

void context_attention_simt(Tensor const& q, Tensor const& kv_cache, Tensor const& block_tables,
                            Tensor const& cu_seqlens, Tensor const& kv_lens, double scale, Tensor const& out,
                            std::uintptr_t stream, int window, std::optional<Tensor> const& kv_scales, double k_scale,
                            double v_scale) {
  int device = 0;
  auto const p = context_params(q, kv_cache, block_tables, cu_seqlens, kv_lens, scale, out, window, kv_scales, k_scale,
                                v_scale, &device);
  run(ck::launch_context_attention_simt, p, device, stream, "context_attention_simt");
}

}  // namespace

INFLIGHT_REGISTER_OPS(cuda_attention) {
  m.def("store_kv", &store_kv, nb::arg("k"), nb::arg("v"), nb::arg("kv_cache"), nb::arg("slot_mapping"),
        nb::arg("stream"), nb::arg("kv_scales").none() = nb::none(), nb::arg("k_scale") = 1.0, nb::arg("v_scale") = 1.0,
        "Writes k[t] and v[t] [num_tokens, num_kv_heads, head_dim] into kv_cache [2, num_blocks, tokens_per_block, "
        "num_kv_heads, head_dim] at flat slot slot_mapping[t] (int64; negative: skipped) on `stream`. An int8 "
        "kv_cache stores each (token, KV head) row quantised, its scale (max |x| / 127) into kv_scales [2, "
        "num_blocks, tokens_per_block, num_kv_heads] float32. A uint8 kv_cache holds FP8 E4M3 bytes: x / k_scale "
        "(x / v_scale), nearest even, saturated to +-448.");
  m.def("paged_attention", &paged_attention, nb::arg("q"), nb::arg("kv_cache"), nb::arg("block_tables"),
        nb::arg("kv_lens"), nb::arg("scale"), nb::arg("out"), nb::arg("workspace").none(), nb::arg("stream"),
        nb::arg("window") = 0, nb::arg("kv_scales").none() = nb::none(), nb::arg("k_scale") = 1.0,
        nb::arg("v_scale") = 1.0,
        "Decode attention: q [batch, num_heads, head_dim] against keys 0..kv_lens[b]-1 of the paged cache (window "
        "> 0: only the last `window` of them), into out. workspace (any contiguous CUDA tensor of "
        "paged_attention_workspace_size() bytes, or None) lets long contexts split over several CTAs; without it "
        "each sequence is one pass. float16/bfloat16 on tensor cores, float32 on CUDA cores; head_dim 64 or 128. "
        "An int8 kv_cache is read with its kv_scales, a uint8 (fp8 e4m3) one with k_scale and v_scale (see "
        "store_kv).");
  m.def("paged_attention_simt", &paged_attention_simt, nb::arg("q"), nb::arg("kv_cache"), nb::arg("block_tables"),
        nb::arg("kv_lens"), nb::arg("scale"), nb::arg("out"), nb::arg("stream"), nb::arg("window") = 0,
        nb::arg("kv_scales").none() = nb::none(), nb::arg("k_scale") = 1.0, nb::arg("v_scale") = 1.0,
        "paged_attention on the simple CUDA-core kernel for every dtype (slow; for tests and as a fallback).");
  m.def("paged_attention_workspace_size", &ck::paged_attention_workspace_size, nb::arg("batch_size"),
        nb::arg("num_heads"), nb::arg("max_kv_len"), nb::arg("head_dim"),
        "Bytes of workspace paged_attention can use for a batch whose longest context is max_kv_len (0: none "
        "needed).");
  m.def("context_attention", &context_attention, nb::arg("q"), nb::arg("kv_cache"), nb::arg("block_tables"),
        nb::arg("cu_seqlens"), nb::arg("kv_lens"), nb::arg("scale"), nb::arg("out"), nb::arg("stream"),
        nb::arg("window") = 0, nb::arg("kv_scales").none() = nb::none(), nb::arg("k_scale") = 1.0,
        nb::arg("v_scale") = 1.0,
        "Causal prefill attention over the paged cache: sequence i's queries q[cu_seqlens[i]:cu_seqlens[i+1]] "
        "(int32 offsets) sit at positions kv_lens[i] - q_len + r (window > 0: a query at p sees keys p - window "
        "+ 1 .. p only). float16/bfloat16 on tensor cores, float32 on "
        "CUDA cores; head_dim 64 or 128. An int8 kv_cache is read with its kv_scales, a uint8 (fp8 e4m3) one "
        "with k_scale and v_scale.");
  m.def("context_attention_simt", &context_attention_simt, nb::arg("q"), nb::arg("kv_cache"), nb::arg("block_tables"),
        nb::arg("cu_seqlens"), nb::arg("kv_lens"), nb::arg("scale"), nb::arg("out"), nb::arg("stream"),
        nb::arg("window") = 0, nb::arg("kv_scales").none() = nb::none(), nb::arg("k_scale") = 1.0,
        nb::arg("v_scale") = 1.0,
        "context_attention on the simple CUDA-core kernel for every dtype (slow; for tests and as a fallback).");
}
