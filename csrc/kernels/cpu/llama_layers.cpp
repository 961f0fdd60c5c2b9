// The decoder-layer stack in one call (see llama_layers.h). The heavy parts are the existing
// launchers (W4A16/W8A16/dense GEMM, store_kv, context/paged attention), each picking its ISA at run time;
// the elementwise glue (llama_layers_ops.h over llama_glue.h) runs its AVX-512 copy where the CPU has it.
#include "llama_layers.h"

#include "llama_layers_ops.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace inflight::kernels::cpu {
namespace {

constexpr std::size_t kAlign = 64;

std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

using namespace llama_ops;

// The fields paged and context attention share (the same names in both params), for q read out of
// the fused qkv rows.
template <class P>
P attention_params(LlamaShape const& s, std::int32_t const* block_tables, int max_blocks, std::int32_t const* kv_lens,
                   int batch_size, int num_threads) {
  P p;
  p.q_token_stride = s.q_size() + 2 * s.kv_size();
  p.q_head_stride = s.head_dim;
  p.num_blocks = s.num_blocks;
  p.tokens_per_block = s.tokens_per_block;
  p.block_tables = block_tables;
  p.block_table_stride = max_blocks;
  p.max_blocks_per_seq = max_blocks;
  p.kv_lens = kv_lens;
  p.batch_size = batch_size;
  p.num_heads = s.num_heads;
  p.num_kv_heads = s.num_kv_heads;
  p.head_dim = s.head_dim;
  p.scale = s.scale;
  p.dtype = s.attention_dtype();
  p.kv_dtype = s.kv_dtype;
  p.num_threads = num_threads;
  return p;
}

// The decode sequences' params, without q, out, the cache and the workspace.
PagedAttentionParams decode_params(LlamaShape const& s, LlamaStep const& step, int num_threads) {
  return attention_params<PagedAttentionParams>(s, step.dec_block_tables, step.dec_max_blocks, step.dec_kv_lens,
                                                step.dec_batch, num_threads);
}

// Bytes of the activation buffers and of the paged-attention workspace.
struct Layout {
  // normed, qkv, attn, gate_up, inter, tmp; then, with a float cache of another dtype than the model's,
  // qkv and attn in the cache's dtype (else empty).
  std::size_t sizes[8];
  std::size_t paged_bytes = 0;
  std::size_t total() const {
    std::size_t sum = aligned(paged_bytes);
    for (std::size_t b : sizes) sum += b;
    return sum;
  }
};

Layout layout(LlamaLayersParams const& p) {
  LlamaShape const& s = p.shape;
  LlamaStep const& step = p.step;
  Layout l;
  std::size_t const e = scalar_type_size(s.dtype);
  std::size_t const t = std::size_t(step.num_tokens);
  std::size_t const widths[6] = {std::size_t(s.hidden),       std::size_t(s.q_size() + 2 * s.kv_size()),
                                 std::size_t(s.q_size()),     std::size_t(2 * s.intermediate),
                                 std::size_t(s.intermediate), std::size_t(s.hidden)};
  for (int i = 0; i < 6; ++i) l.sizes[i] = aligned(t * widths[i] * e);
  std::size_t const ea = s.attention_dtype() != s.dtype ? scalar_type_size(s.attention_dtype()) : 0;
  l.sizes[6] = aligned(t * widths[1] * ea);
  l.sizes[7] = aligned(t * widths[2] * ea);
  if (step.dec_batch > 0) {
    // The split depends on the window: room for the largest of the layers' windows' partials.
    PagedAttentionParams dec = decode_params(s, step, p.num_threads);
    for (int i = 0; i < p.num_layers; ++i) {
      if (i > 0 && p.layers[i].window == p.layers[i - 1].window) continue;
      dec.window = p.layers[i].window;
      l.paged_bytes = std::max(l.paged_bytes, std::size_t(paged_attention_workspace_size(dec)));
    }
  }
  if (s.w8a8) {  // the widest W8A8 projection's scratch (w8a8_workspace_bytes), sharing the region
    std::size_t const k = std::size_t(std::max({s.hidden, s.q_size(), s.intermediate}));
    std::size_t const n = std::size_t(std::max(s.q_size() + 2 * s.kv_size(), 2 * s.intermediate));
    std::size_t const w8a8 = aligned(t * ((k + 3) / 4 * 4)) + aligned(t * sizeof(float)) +
                             t * ((n + kW8A8Block - 1) / kW8A8Block * kW8A8Block) * sizeof(std::int32_t);
    l.paged_bytes = std::max(l.paged_bytes, w8a8);
  }
  if (s.a8) {  // the widest A8 projection's scratch (a8_workspace_bytes at the smallest group, 16, two limbs)
    std::size_t const k = std::size_t(std::max({s.hidden, s.q_size(), s.intermediate}));
    l.paged_bytes = std::max(l.paged_bytes, aligned(2 * t * k) + 3 * aligned(t * (k / 16) * sizeof(float)));
  }
  return l;
}

template <class T, bool kGemma>
void forward_t(LlamaLayersParams const& params, ThreadPool& pool) {
  LlamaShape const& s = params.shape;
  LlamaStep const& step = params.step;
  Threads const threads{pool, params.num_threads};
  Layout const l = layout(params);
  auto* base = static_cast<unsigned char*>(params.workspace);
  void* bufs[8];
  for (int i = 0; i < 8; ++i) {
    bufs[i] = base;
    base += l.sizes[i];
  }
  T* normed = static_cast<T*>(bufs[0]);
  T* qkv = static_cast<T*>(bufs[1]);
  T* attn = static_cast<T*>(bufs[2]);
  T* gate_up = static_cast<T*>(bufs[3]);
  T* inter = static_cast<T*>(bufs[4]);
  T* tmp = static_cast<T*>(bufs[5]);
  // The row-parallel projections' output: the caller's buffer when it is reduced over ranks.
  T* proj = params.reduce != nullptr ? static_cast<T*>(params.reduce_buf) : tmp;

  int const nt = step.num_tokens;
  int const d = s.hidden;
  int const qkv_n = s.q_size() + 2 * s.kv_size();
  T* hidden = static_cast<T*>(step.hidden);
  auto const* cos_sin = static_cast<T const*>(step.cos_sin);
  auto const* cos_sin_local = static_cast<T const*>(step.cos_sin_local);

  // Attention's q, k, v and output: qkv and attn, or (a float cache of another dtype) their copies in it.
  ScalarType const adt = s.attention_dtype();
  bool const convert = adt != s.dtype;
  std::size_t const ae = scalar_type_size(adt);
  auto* const qkv_a = static_cast<unsigned char*>(convert ? bufs[6] : static_cast<void*>(qkv));
  auto* const attn_a = static_cast<unsigned char*>(convert ? bufs[7] : static_cast<void*>(attn));

  StoreKvParams store;
  store.k = qkv_a + std::size_t(s.q_size()) * ae;
  store.v = qkv_a + std::size_t(s.q_size() + s.kv_size()) * ae;
  store.k_token_stride = store.v_token_stride = qkv_n;
  store.k_head_stride = store.v_head_stride = s.head_dim;
  store.slot_mapping = step.slot_mapping;
  store.num_slots = std::int64_t(s.num_blocks) * s.tokens_per_block;
  store.num_tokens = nt;
  store.num_kv_heads = s.num_kv_heads;
  store.head_dim = s.head_dim;
  store.dtype = adt;
  store.kv_dtype = s.kv_dtype;
  store.num_threads = params.num_threads;

  auto ctx = attention_params<ContextAttentionParams>(s, step.ctx_block_tables, step.ctx_max_blocks, step.ctx_kv_lens,
                                                      step.ctx_batch, params.num_threads);
  ctx.q = qkv_a;
  ctx.cu_seqlens = step.ctx_cu_seqlens;
  ctx.out = attn_a;
  ctx.num_tokens = step.num_ctx_tokens;

  PagedAttentionParams dec = decode_params(s, step, params.num_threads);
  dec.q = qkv_a + std::size_t(step.num_ctx_tokens) * std::size_t(qkv_n) * ae;
  dec.out = attn_a + std::size_t(step.num_ctx_tokens) * std::size_t(s.q_size()) * ae;
  dec.workspace = l.paged_bytes ? base : nullptr;
  void* const scratch = l.paged_bytes ? base : nullptr;
  dec.workspace_bytes = std::int64_t(l.paged_bytes);

  if (params.embed != nullptr) embed_tokens<T>(*params.embed, step.input_ids, hidden, nt, d, threads);
  for (int li = 0; li < params.num_layers; ++li) {
    LlamaLayerWeights const& L = params.layers[li];
    auto const* post_norm = static_cast<T const*>(L.post_norm);
    rms_norm<T, kGemma>(hidden, static_cast<T const*>(L.input_norm), normed, nt, d, s.eps, threads);
    linear(L.qkv, normed, qkv, nt, s.dtype, threads, scratch);
    qk_norm_rope<T, kGemma>(qkv, qkv_n, L.local_rope ? cos_sin_local : cos_sin, step.positions, nt, s.num_heads,
                            s.num_kv_heads, s.head_dim, static_cast<T const*>(s.qk_norm ? L.q_norm : nullptr),
                            static_cast<T const*>(L.k_norm), s.eps, s.key_rotation, threads);
    if (convert) convert_rows(qkv, qkv_a, adt, nt, qkv_n, threads);
    // VSWA: a layer of the window pool stores and reads through that pool's slots and tables.
    int const num_blocks = L.window_pool ? L.num_blocks : s.num_blocks;
    store.slot_mapping = L.window_pool ? step.window_slot_mapping : step.slot_mapping;
    store.num_slots = std::int64_t(num_blocks) * s.tokens_per_block;
    ctx.block_tables = L.window_pool ? step.window_ctx_block_tables : step.ctx_block_tables;
    ctx.num_blocks = num_blocks;
    dec.block_tables = L.window_pool ? step.window_dec_block_tables : step.dec_block_tables;
    dec.num_blocks = num_blocks;
    store.kv_cache = L.kv_cache;
    store.kv_scales = L.kv_scales;
    store.k_scale = L.k_scale;
    store.v_scale = L.v_scale;
    launch_store_kv(store, pool);
    if (step.ctx_batch > 0) {
      ctx.kv_cache = L.kv_cache;
      ctx.kv_scales = L.kv_scales;
      ctx.k_scale = L.k_scale;
      ctx.v_scale = L.v_scale;
      ctx.window = L.window;
      launch_context_attention(ctx, pool);
    }
    if (step.dec_batch > 0) {
      dec.kv_cache = L.kv_cache;
      dec.kv_scales = L.kv_scales;
      dec.k_scale = L.k_scale;
      dec.v_scale = L.v_scale;
      dec.window = L.window;
      launch_paged_attention(dec, pool);
    }
    if (convert) convert_rows_back(attn_a, adt, attn, nt, s.q_size(), threads);
    linear(L.o, attn, proj, nt, s.dtype, threads, scratch);
    if (params.reduce != nullptr) params.reduce(params.reduce_ctx);
    if constexpr (kGemma) {  // hidden += post_norm(o); the MLP between pre_ffn_norm and post_ffn_norm
      rms_norm<T, true, true>(proj, post_norm, hidden, nt, d, s.eps, threads);
      rms_norm<T, true>(hidden, static_cast<T const*>(L.pre_ffn_norm), normed, nt, d, s.eps, threads);
    } else {
      add_into<T>(hidden, proj, nt, d, threads);
      rms_norm<T, false>(hidden, post_norm, normed, nt, d, s.eps, threads);
    }
    linear(L.gate_up, normed, gate_up, nt, s.dtype, threads, scratch);
    act_mul<T, kGemma>(gate_up, inter, nt, s.intermediate, threads);
    linear(L.down, inter, proj, nt, s.dtype, threads, scratch);
    if (params.reduce != nullptr) params.reduce(params.reduce_ctx);
    if constexpr (kGemma) {
      rms_norm<T, true, true>(proj, static_cast<T const*>(L.post_ffn_norm), hidden, nt, d, s.eps, threads);
    } else {
      add_into<T>(hidden, proj, nt, d, threads);
    }
  }
  LlamaHead const* head = params.head;
  if (head != nullptr && step.num_logits_rows > 0) {  // the final norm of the wanted rows, then the LM head
    rms_norm<T, kGemma>(hidden, static_cast<T const*>(head->final_norm), normed, step.num_logits_rows, d, s.eps,
                        threads, step.logits_rows);
    linear(head->op, normed, step.logits, step.num_logits_rows, s.dtype, threads, scratch);
  }
}

}  // namespace

std::int64_t llama_layers_workspace_size(LlamaLayersParams const& params) {
  return std::int64_t(layout(params).total());
}

void launch_llama_layers(LlamaLayersParams const& params, ThreadPool& pool) {
  if (params.step.num_tokens == 0 || params.num_layers == 0) return;
  std::int64_t const need = llama_layers_workspace_size(params);
  if (params.workspace == nullptr || params.workspace_bytes < need) {
    throw std::invalid_argument("llama_layers: workspace must be >= " + std::to_string(need) + " bytes, got " +
                                std::to_string(params.workspace_bytes));
  }
  dispatch_float_type(params.shape.dtype, [&](auto t) {
    if (params.shape.gemma) {
      forward_t<decltype(t), true>(params, pool);
    } else {
      forward_t<decltype(t), false>(params, pool);
    }
  });
}

std::int64_t moe_experts_workspace_size(MoeExpertsParams const& params) {
  std::int64_t most = 0;
  for (int e = 0; e < params.num_experts; ++e) most = std::max(most, params.counts[e]);
  return most * 3 * params.intermediate * std::int64_t(scalar_type_size(params.dtype));
}

void launch_moe_experts(MoeExpertsParams const& params, ThreadPool& pool) {
  if (params.rows == 0) return;
  std::int64_t const need = moe_experts_workspace_size(params);
  if (params.workspace == nullptr || params.workspace_bytes < need) {
    throw std::invalid_argument("moe_experts: workspace must be >= " + std::to_string(need) + " bytes, got " +
                                std::to_string(params.workspace_bytes));
  }
  Threads const threads{pool, params.num_threads};
  dispatch_float_type(params.dtype, [&](auto t) {
    using T = decltype(t);
    auto const* x = static_cast<T const*>(params.x);
    auto* out = static_cast<T*>(params.out);
    auto* gate_up = static_cast<T*>(params.workspace);
    std::int64_t start = 0;
    for (int e = 0; e < params.num_experts; ++e) {
      std::int64_t const n = params.counts[e];
      if (n == 0) continue;
      T* inter = gate_up + n * 2 * params.intermediate;
      linear(params.gate_up[e], x + start * params.hidden, gate_up, n, params.dtype, threads, nullptr);
      if (params.gelu) {
        act_mul<T, true>(gate_up, inter, int(n), params.intermediate, threads);
      } else {
        act_mul<T, false>(gate_up, inter, int(n), params.intermediate, threads);
      }
      linear(params.down[e], inter, out + start * params.hidden, n, params.dtype, threads, nullptr);
      start += n;
    }
  });
}

}  // namespace inflight::kernels::cpu
