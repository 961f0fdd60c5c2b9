// The decoder-layer stack in one call (see llama_layers.h). The heavy parts are the existing
// launchers (W4A16/W8A16/dense GEMM, store_kv, context/paged attention), each picking its ISA at run time;
// the elementwise glue here is plain C++ that the compiler vectorises for the baseline ISA.
#include "llama_layers.h"

#include "activation.h"
#include "hadamard.h"

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

// The step's threads: at most `num` of the pool's.
struct Threads {
  ThreadPool& pool;
  int num;
};

template <class F>
void for_tokens(int num_tokens, Threads t, F&& f) {
  int const threads = std::max(1, std::min(t.num, num_tokens / kMinTokensPerThread));
  pool_detail::parallel_for(t.pool, num_tokens, threads, false, [&](std::int64_t i, int) { f(int(i)); });
}

// sum(x * x) over a row of d values in fp32, in the order torch sums a contiguous row
// (aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum), so that
// the normalisation agrees bit for bit with F.rms_norm (on the CPU x * rsqrt(mean(x.pow(2)) + eps)):
// vectors of 8 floats (torch runs its AVX2 sum kernel on AVX-512 machines too), 4 accumulators over
// interleaved vectors, cascaded in levels of 16 (or more) steps for long rows; then the vectors past the
// last whole step into the first accumulator, the accumulators in order, and the row's scalar tail
// followed by the 8 lanes in order. No FMA here (this file is built for the baseline ISA): each square
// is rounded before it is added, as x.pow(2) is.
template <class T>
inline float sum_squares(T const* row, int d) {
  constexpr int kW = 8, kIlp = 4, kLevels = 4;
  int const nvec = d / kW;
  int const steps = nvec / kIlp;
  int ceil_log2 = 0;
  while ((1 << ceil_log2) < steps) ++ceil_log2;
  int const level_power = std::max(4, ceil_log2 / kLevels);
  int const level_step = 1 << level_power;
  int const level_mask = level_step - 1;
  float acc[kLevels][kIlp][kW] = {};
  auto add_vec = [&](float* dst, int v) {
    for (int l = 0; l < kW; ++l) {
      float const x = to_float(row[v * kW + l]);
      dst[l] += x * x;
    }
  };
  int i = 0;
  while (i + level_step <= steps) {
    for (int j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) add_vec(acc[0][k], i * kIlp + k);
    for (int lv = 1; lv < kLevels; ++lv) {
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < kW; ++l) {
          acc[lv][k][l] += acc[lv - 1][k][l];
          acc[lv - 1][k][l] = 0.0f;
        }
      if ((i & (level_mask << (lv * level_power))) != 0) break;
    }
  }
  for (; i < steps; ++i)
    for (int k = 0; k < kIlp; ++k) add_vec(acc[0][k], i * kIlp + k);
  for (int lv = 1; lv < kLevels; ++lv)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < kW; ++l) acc[0][k][l] += acc[lv][k][l];
  for (int v = steps * kIlp; v < nvec; ++v) add_vec(acc[0][0], v);
  for (int k = 1; k < kIlp; ++k)
    for (int l = 0; l < kW; ++l) acc[0][0][l] += acc[0][k][l];
  float sum = 0.0f;
  for (int j = nvec * kW; j < d; ++j) {
    float const x = to_float(row[j]);
    sum += x * x;
  }
  for (int l = 0; l < kW; ++l) sum += acc[0][0][l];
  return sum;
}

// 1 / rms(x) of a row of d values in fp32: rsqrt(mean(x^2) + eps), the mean a division by d.
template <class T>
inline float inv_rms(T const* row, int d, float eps) {
  return 1.0f / std::sqrt(sum_squares(row, d) / float(d) + eps);
}

// One normalised element, x * r the fp32 normalisation. Llama's (inflight.layers.norm.rms_norm):
// rounded to T, then scaled by the weight (one more rounding). Gemma's (GemmaRMSNorm): scaled by
// 1 + weight in fp32, then rounded once.
template <class T, bool kGemma>
inline T norm_elem(float x, float r, T w) {
  if constexpr (kGemma) {
    float const normed = x * r;
    return from_float<T>(normed * (1.0f + to_float(w)));
  } else {
    return from_float<T>(to_float(w) * rnd<T>(x * r));
  }
}

// out = norm(x) (kAdd: out += norm(x), the residual add of a normed branch, one more rounding).
template <class T, bool kGemma, bool kAdd = false>
void rms_norm(T const* x, T const* weight, T* out, int num_tokens, int d, float eps, Threads threads) {
  for_tokens(num_tokens, threads, [&](int t) {
    T const* row = x + std::int64_t(t) * d;
    T* dst = out + std::int64_t(t) * d;
    float const r = inv_rms(row, d, eps);
    for (int i = 0; i < d; ++i) {
      T const y = norm_elem<T, kGemma>(to_float(row[i]), r, weight[i]);
      dst[i] = kAdd ? from_float<T>(to_float(dst[i]) + to_float(y)) : y;
    }
  });
}

// RoPE (rotate-half) on the q and k heads of each qkv row, in place: x*cos + roll(x, hd/2)*signed_sin,
// each product and the sum rounded to T (three torch ops in the Python layer). With q_norm / k_norm
// (QK-norm) each head is first normalised (its rounding points kept: RoPE reads the rounded values).
// key_rotation > 0 (an INT8 cache): each rotated head is then turned by the Walsh-Hadamard block
// (hadamard.h) and scaled, q by 2^-a and k by 2^-b, before one rounding to T.
template <class T, bool kGemma>
void qk_norm_rope(T* qkv, std::int64_t row_stride, T const* cos_sin, int num_tokens, int num_heads, int num_kv_heads,
                  int head_dim, T const* q_norm, T const* k_norm, float eps, int key_rotation, Threads threads) {
  int const half = head_dim / 2;
  float q_rot_scale = 1.0f, k_rot_scale = 1.0f;
  if (key_rotation > 0) key_rotation_scales(key_rotation, &q_rot_scale, &k_rot_scale);
  for_tokens(num_tokens, threads, [&](int t) {
    T const* cs = cos_sin + std::int64_t(t) * 2 * head_dim;
    float cosv[kMaxHeadDim], sinv[kMaxHeadDim], x[kMaxHeadDim];
    for (int i = 0; i < head_dim; ++i) {
      cosv[i] = to_float(cs[i]);
      sinv[i] = to_float(cs[head_dim + i]);
    }
    T* row = qkv + std::int64_t(t) * row_stride;
    for (int h = 0; h < num_heads + num_kv_heads; ++h) {
      T* head = row + std::int64_t(h) * head_dim;
      if (q_norm != nullptr) {
        T const* w = h < num_heads ? q_norm : k_norm;
        float const r = inv_rms(head, head_dim, eps);
        for (int i = 0; i < head_dim; ++i) x[i] = to_float(norm_elem<T, kGemma>(to_float(head[i]), r, w[i]));
      } else {
        for (int i = 0; i < head_dim; ++i) x[i] = to_float(head[i]);
      }
      if (key_rotation == 0) {
        for (int i = 0; i < head_dim; ++i) {
          int const src = i < half ? i + half : i - half;
          head[i] = from_float<T>(rnd<T>(x[i] * cosv[i]) + rnd<T>(x[src] * sinv[i]));
        }
      } else {  // an INT8 cache: rotate the RoPE'd head (rounded to T, as the Python layer)
        float y[kMaxHeadDim];
        for (int i = 0; i < head_dim; ++i) {
          int const src = i < half ? i + half : i - half;
          y[i] = to_float(from_float<T>(rnd<T>(x[i] * cosv[i]) + rnd<T>(x[src] * sinv[i])));
        }
        hadamard_blocks(y, head_dim, key_rotation);
        float const sc = h < num_heads ? q_rot_scale : k_rot_scale;
        for (int i = 0; i < head_dim; ++i) head[i] = from_float<T>(y[i] * sc);
      }
    }
  });
}

// dst = src for rows x width values, each rounded to To as torch's .to() rounds (nearest even).
template <class From, class To>
void convert_n(From const* src, To* dst, int rows, int width, Threads threads) {
  for_tokens(rows, threads, [&](int t) {
    From const* a = src + std::int64_t(t) * width;
    To* b = dst + std::int64_t(t) * width;
    for (int i = 0; i < width; ++i) b[i] = from_float<To>(to_float(a[i]));
  });
}

// A float cache of another dtype than the model's: rows of T into that dtype, and back.
template <class T>
void convert_rows(T const* src, void* dst, ScalarType dst_dtype, int rows, int width, Threads threads) {
  dispatch_float_type(dst_dtype, [&](auto d) {
    using D = decltype(d);
    convert_n<T, D>(src, static_cast<D*>(dst), rows, width, threads);
  });
}

template <class T>
void convert_rows_back(void const* src, ScalarType src_dtype, T* dst, int rows, int width, Threads threads) {
  dispatch_float_type(src_dtype, [&](auto d) {
    using D = decltype(d);
    convert_n<D, T>(static_cast<D const*>(src), dst, rows, width, threads);
  });
}

template <class T>
void add_into(T* hidden, T const* y, int num_tokens, int d, Threads threads) {
  for_tokens(num_tokens, threads, [&](int t) {
    T* h = hidden + std::int64_t(t) * d;
    T const* src = y + std::int64_t(t) * d;
    for (int i = 0; i < d; ++i) h[i] = from_float<T>(to_float(h[i]) + to_float(src[i]));
  });
}

// F.gelu(x, approximate="tanh") in fp32, in torch's CPU kernel's order of operations.
inline float gelu_tanh(float x) {
  constexpr float kBeta = float(M_SQRT2 * M_2_SQRTPI * 0.5);
  constexpr float kKappa = 0.044715f;
  float const cube = x * x * x;
  float const inner = kBeta * (x + kKappa * cube);
  return 0.5f * x * (1.0f + std::tanh(inner));
}

// inter = act(gate) * up, gate and up the two halves of each gate_up row (F.silu or F.gelu, then a
// multiply: two roundings to T). kGelu: GeGLU (Gemma), else SwiGLU.
// On AVX-512 the activations are vectorised (activation.h: within an ulp or two, as libm's), in
// pieces of kActChunk elements.
template <class T, bool kGelu>
void act_mul(T const* gate_up, T* inter, int num_tokens, int n, Threads threads) {
  constexpr int kActChunk = 256;
  bool const vector = selected_isa() >= Isa::kAvx512F;
  for_tokens(num_tokens, threads, [&](int t) {
    T const* g = gate_up + std::int64_t(t) * 2 * n;
    T const* u = g + n;
    T* out = inter + std::int64_t(t) * n;
    if (!vector) {
      for (int i = 0; i < n; ++i) {
        float const gv = to_float(g[i]);
        float const a = kGelu ? gelu_tanh(gv) : gv / (1.0f + std::exp(-gv));
        out[i] = from_float<T>(rnd<T>(a) * to_float(u[i]));
      }
      return;
    }
    float a[kActChunk];
    for (int i0 = 0; i0 < n; i0 += kActChunk) {
      int const len = std::min(kActChunk, n - i0);
      for (int i = 0; i < len; ++i) a[i] = to_float(g[i0 + i]);
      gated_activation_avx512f(a, a, len, kGelu);
      for (int i = 0; i < len; ++i) out[i0 + i] = from_float<T>(rnd<T>(a[i]) * to_float(u[i0 + i]));
    }
  });
}

// scratch: the step's shared scratch (the paged-attention partials' region, not in use during a
// projection), large enough for a W8A8 or A8 projection of the step's tokens.
void linear(LinearOp const& op, void const* x, void* out, std::int64_t m, ScalarType dtype, Threads threads,
            void* scratch) {
  switch (op.kind) {
    case LinearOp::Kind::kW8A8: {
      W8A8GemmParams p = op.w8a8;
      p.x = x;
      p.out = out;
      p.m = m;
      p.dtype = dtype;
      p.workspace = scratch;
      p.num_threads = threads.num;
      launch_w8a8_gemm(p, threads.pool);
      return;
    }
    case LinearOp::Kind::kA8: {
      A8GemmParams p = op.a8;
      p.x = x;
      p.out = out;
      p.m = m;
      p.dtype = dtype;
      p.workspace = scratch;
      p.num_threads = threads.num;
      launch_a8_gemm(p, threads.pool);
      return;
    }
    case LinearOp::Kind::kW4A16: {
      W4A16GemmParams p = op.w4;
      p.x = x;
      p.out = out;
      p.m = m;
      p.dtype = dtype;
      p.num_threads = threads.num;
      launch_w4a16_gemm(p, threads.pool);
      return;
    }
    case LinearOp::Kind::kW8A16: {
      W8A16GemmParams p = op.w8;
      p.x = x;
      p.out = out;
      p.m = m;
      p.dtype = dtype;
      p.num_threads = threads.num;
      launch_w8a16_gemm(p, threads.pool);
      return;
    }
    case LinearOp::Kind::kDense: {
      DenseGemmParams p = op.dense;
      p.x = x;
      p.out = out;
      p.m = m;
      p.num_threads = threads.num;
      launch_dense_gemm(p, threads.pool);
      return;
    }
  }
}

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
  if (s.a8) {  // the widest A8 projection's scratch (a8_workspace_bytes at the smallest group, 16)
    std::size_t const k = std::size_t(std::max({s.hidden, s.q_size(), s.intermediate}));
    l.paged_bytes = std::max(l.paged_bytes, aligned(t * k) + 3 * aligned(t * (k / 16) * sizeof(float)));
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

  for (int li = 0; li < params.num_layers; ++li) {
    LlamaLayerWeights const& L = params.layers[li];
    auto const* post_norm = static_cast<T const*>(L.post_norm);
    rms_norm<T, kGemma>(hidden, static_cast<T const*>(L.input_norm), normed, nt, d, s.eps, threads);
    linear(L.qkv, normed, qkv, nt, s.dtype, threads, scratch);
    qk_norm_rope<T, kGemma>(qkv, qkv_n, L.local_rope ? cos_sin_local : cos_sin, nt, s.num_heads, s.num_kv_heads,
                            s.head_dim, static_cast<T const*>(s.qk_norm ? L.q_norm : nullptr),
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
