// The decoder-layer stack in one call (see llama_layers.h). The heavy parts are the existing
// launchers (W4A16/W8A16/dense GEMM, store_kv, context/paged attention), each picking its ISA at run time;
// the elementwise glue here is plain C++ that the compiler vectorises for the baseline ISA.
#include "llama_layers.h"

#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace inflight::kernels::cpu {
namespace {

constexpr std::size_t kAlign = 64;

std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Rounds an fp32 value to the storage type and back: the value torch would hold after an op.
template <class T>
inline float rnd(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return to_float(from_float<T>(v));
  }
}

// Tokens per thread below which the elementwise glue stays on one thread.
constexpr int kMinTokensPerThread = 16;

template <class F>
void for_tokens(int num_tokens, int num_threads, F&& f) {
  int const threads = std::max(1, std::min(num_threads, num_tokens / kMinTokensPerThread));
  pool_detail::parallel_for(num_tokens, threads, false, [&](std::int64_t t, int) { f(int(t)); });
}

// out = weight * rms_norm(x): normalised in fp32, rounded to T, then scaled (one more rounding), as
// inflight.layers.norm.rms_norm.
template <class T>
void rms_norm(T const* x, T const* weight, T* out, int num_tokens, int d, float eps, int num_threads) {
  for_tokens(num_tokens, num_threads, [&](int t) {
    T const* row = x + std::int64_t(t) * d;
    T* dst = out + std::int64_t(t) * d;
    constexpr int kLanes = 16;
    float partial[kLanes] = {};
    int j = 0;
    for (; j + kLanes <= d; j += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        float const v = to_float(row[j + l]);
        partial[l] += v * v;
      }
    float ss = 0.0f;
    for (; j < d; ++j) {
      float const v = to_float(row[j]);
      ss += v * v;
    }
    for (int l = 0; l < kLanes; ++l) ss += partial[l];
    float const r = 1.0f / std::sqrt(ss / float(d) + eps);
    for (int i = 0; i < d; ++i) dst[i] = from_float<T>(to_float(weight[i]) * rnd<T>(to_float(row[i]) * r));
  });
}

// RoPE (rotate-half) on the q and k heads of each qkv row, in place: x*cos + roll(x, hd/2)*signed_sin,
// each product and the sum rounded to T (three torch ops in the Python layer).
template <class T>
void rope(T* qkv, std::int64_t row_stride, T const* cos_sin, int num_tokens, int num_rot_heads, int head_dim,
          int num_threads) {
  int const half = head_dim / 2;
  for_tokens(num_tokens, num_threads, [&](int t) {
    T const* cs = cos_sin + std::int64_t(t) * 2 * head_dim;
    float cosv[kMaxHeadDim], sinv[kMaxHeadDim], x[kMaxHeadDim];
    for (int i = 0; i < head_dim; ++i) {
      cosv[i] = to_float(cs[i]);
      sinv[i] = to_float(cs[head_dim + i]);
    }
    T* row = qkv + std::int64_t(t) * row_stride;
    for (int h = 0; h < num_rot_heads; ++h) {
      T* head = row + std::int64_t(h) * head_dim;
      for (int i = 0; i < head_dim; ++i) x[i] = to_float(head[i]);
      for (int i = 0; i < head_dim; ++i) {
        int const src = i < half ? i + half : i - half;
        head[i] = from_float<T>(rnd<T>(x[i] * cosv[i]) + rnd<T>(x[src] * sinv[i]));
      }
    }
  });
}

template <class T>
void add_into(T* hidden, T const* y, int num_tokens, int d, int num_threads) {
  for_tokens(num_tokens, num_threads, [&](int t) {
    T* h = hidden + std::int64_t(t) * d;
    T const* src = y + std::int64_t(t) * d;
    for (int i = 0; i < d; ++i) h[i] = from_float<T>(to_float(h[i]) + to_float(src[i]));
  });
}

// inter = silu(gate) * up, gate and up the two halves of each gate_up row (F.silu then a multiply:
// two roundings to T).
template <class T>
void silu_mul(T const* gate_up, T* inter, int num_tokens, int n, int num_threads) {
  for_tokens(num_tokens, num_threads, [&](int t) {
    T const* g = gate_up + std::int64_t(t) * 2 * n;
    T const* u = g + n;
    T* out = inter + std::int64_t(t) * n;
    for (int i = 0; i < n; ++i) {
      float const gv = to_float(g[i]);
      out[i] = from_float<T>(rnd<T>(gv / (1.0f + std::exp(-gv))) * to_float(u[i]));
    }
  });
}

void linear(LinearOp const& op, void const* x, void* out, std::int64_t m, ScalarType x_type, int num_threads) {
  switch (op.kind) {
    case LinearOp::Kind::kW4A16: {
      W4A16GemmParams p = op.w4;
      p.x = x;
      p.out = out;
      p.m = m;
      p.x_type = x_type;
      p.num_threads = num_threads;
      w4a16_gemm(p);
      return;
    }
    case LinearOp::Kind::kW8A16: {
      W8A16GemmParams p = op.w8;
      p.x = x;
      p.out = out;
      p.m = m;
      p.x_type = x_type;
      p.num_threads = num_threads;
      w8a16_gemm(p);
      return;
    }
    case LinearOp::Kind::kDense: {
      DenseGemmParams p = op.dense;
      p.x = x;
      p.out = out;
      p.m = m;
      p.num_threads = num_threads;
      dense_gemm(p);
      return;
    }
  }
}

struct Buffers {
  void* normed;   // [T, hidden]
  void* qkv;      // [T, q + 2kv]
  void* attn;     // [T, q]
  void* gate_up;  // [T, 2 * intermediate]
  void* inter;    // [T, intermediate]
  void* tmp;      // [T, hidden]
  float* paged_ws;
};

PagedAttentionParams decode_params(LlamaShape const& s, LlamaStep const& step) {
  PagedAttentionParams p;
  p.q_stride_token = s.q_size() + 2 * s.kv_size();
  p.q_stride_head = s.head_dim;
  p.block_tables = step.dec_block_tables;
  p.kv_lens = step.dec_kv_lens;
  p.batch = step.dec_batch;
  p.num_heads = s.num_heads;
  p.num_kv_heads = s.num_kv_heads;
  p.head_dim = s.head_dim;
  p.num_blocks = s.num_blocks;
  p.tokens_per_block = s.tokens_per_block;
  p.max_blocks_per_seq = step.dec_max_blocks;
  p.scale = s.scale;
  p.dtype = s.dtype;
  p.num_threads = step.num_threads;
  return p;
}

// (bytes of the activation buffers, floats of the paged-attention workspace, the decode plan)
struct Layout {
  std::size_t sizes[6];
  std::size_t paged_floats = 0;
  PagedAttentionPlan plan;
};

Layout layout(LlamaShape const& s, LlamaStep const& step) {
  Layout l;
  std::size_t const e = scalar_type_size(s.dtype);
  std::size_t const t = std::size_t(step.num_tokens);
  std::size_t const widths[6] = {std::size_t(s.hidden),       std::size_t(s.q_size() + 2 * s.kv_size()),
                                 std::size_t(s.q_size()),     std::size_t(2 * s.intermediate),
                                 std::size_t(s.intermediate), std::size_t(s.hidden)};
  for (int i = 0; i < 6; ++i) l.sizes[i] = aligned(t * widths[i] * e);
  if (step.dec_batch > 0) {
    PagedAttentionParams const p = decode_params(s, step);
    l.plan = plan_paged_attention(p);
    l.paged_floats = paged_attention_workspace_floats(p, l.plan);
  }
  return l;
}

template <class T>
void forward_t(LlamaShape const& s, LlamaLayerWeights const* layers, int num_layers, LlamaStep const& step,
               void* workspace) {
  Layout const l = layout(s, step);
  auto* base = static_cast<unsigned char*>(workspace);
  void* bufs[6];
  for (int i = 0; i < 6; ++i) {
    bufs[i] = base;
    base += l.sizes[i];
  }
  T* normed = static_cast<T*>(bufs[0]);
  T* qkv = static_cast<T*>(bufs[1]);
  T* attn = static_cast<T*>(bufs[2]);
  T* gate_up = static_cast<T*>(bufs[3]);
  T* inter = static_cast<T*>(bufs[4]);
  T* tmp = static_cast<T*>(bufs[5]);
  float* paged_ws = l.paged_floats ? reinterpret_cast<float*>(base) : nullptr;

  int const nt = step.num_tokens;
  int const threads = step.num_threads;
  int const d = s.hidden;
  int const qkv_n = s.q_size() + 2 * s.kv_size();
  ScalarType const xt = s.dtype;
  T* hidden = static_cast<T*>(step.hidden);
  auto const* cos_sin = static_cast<T const*>(step.cos_sin);

  StoreKvParams store;
  store.k = qkv + s.q_size();
  store.v = qkv + s.q_size() + s.kv_size();
  store.k_stride_token = store.v_stride_token = qkv_n;
  store.k_stride_head = store.v_stride_head = s.head_dim;
  store.slot_mapping = step.slot_mapping;
  store.num_slots = std::int64_t(s.num_blocks) * s.tokens_per_block;
  store.num_tokens = nt;
  store.num_kv_heads = s.num_kv_heads;
  store.head_dim = s.head_dim;
  store.dtype = s.dtype;
  store.num_threads = threads;

  ContextAttentionParams ctx;
  ctx.q = qkv;
  ctx.q_stride_token = qkv_n;
  ctx.q_stride_head = s.head_dim;
  ctx.block_tables = step.ctx_block_tables;
  ctx.cu_seqlens = step.ctx_cu_seqlens;
  ctx.kv_lens = step.ctx_kv_lens;
  ctx.out = attn;
  ctx.batch = step.ctx_batch;
  ctx.num_tokens = step.num_ctx_tokens;
  ctx.num_heads = s.num_heads;
  ctx.num_kv_heads = s.num_kv_heads;
  ctx.head_dim = s.head_dim;
  ctx.num_blocks = s.num_blocks;
  ctx.tokens_per_block = s.tokens_per_block;
  ctx.max_blocks_per_seq = step.ctx_max_blocks;
  ctx.scale = s.scale;
  ctx.dtype = s.dtype;
  ctx.num_threads = threads;

  PagedAttentionParams dec = decode_params(s, step);
  dec.q = qkv + std::int64_t(step.num_ctx_tokens) * qkv_n;
  dec.out = attn + std::int64_t(step.num_ctx_tokens) * s.q_size();
  dec.workspace = paged_ws;

  for (int li = 0; li < num_layers; ++li) {
    LlamaLayerWeights const& L = layers[li];
    rms_norm<T>(hidden, static_cast<T const*>(L.input_norm), normed, nt, d, s.eps, threads);
    linear(L.qkv, normed, qkv, nt, xt, threads);
    rope<T>(qkv, qkv_n, cos_sin, nt, s.num_heads + s.num_kv_heads, s.head_dim, threads);
    store.kv_cache = L.kv_cache;
    store_kv(store);
    if (step.ctx_batch > 0) {
      ctx.kv_cache = L.kv_cache;
      context_attention(ctx);
    }
    if (step.dec_batch > 0) {
      dec.kv_cache = L.kv_cache;
      paged_attention(dec, l.plan);
    }
    linear(L.o, attn, tmp, nt, xt, threads);
    add_into<T>(hidden, tmp, nt, d, threads);
    rms_norm<T>(hidden, static_cast<T const*>(L.post_norm), normed, nt, d, s.eps, threads);
    linear(L.gate_up, normed, gate_up, nt, xt, threads);
    silu_mul<T>(gate_up, inter, nt, s.intermediate, threads);
    linear(L.down, inter, tmp, nt, xt, threads);
    add_into<T>(hidden, tmp, nt, d, threads);
  }
}

}  // namespace

std::size_t llama_layers_workspace_bytes(LlamaShape const& shape, LlamaStep const& step) {
  Layout const l = layout(shape, step);
  std::size_t total = 0;
  for (std::size_t s : l.sizes) total += s;
  return total + aligned(l.paged_floats * sizeof(float));
}

void llama_layers_forward(LlamaShape const& shape, LlamaLayerWeights const* layers, int num_layers,
                          LlamaStep const& step, void* workspace) {
  if (step.num_tokens == 0 || num_layers == 0) return;
  dispatch_float_type(shape.dtype, [&](auto t) { forward_t<decltype(t)>(shape, layers, num_layers, step, workspace); });
}

}  // namespace inflight::kernels::cpu
