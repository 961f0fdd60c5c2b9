// Attention launchers (ISA dispatch, decode partition plan), store_kv, and the portable path: the
// same algorithms as the AVX2 / AVX-512 files over a one-lane "vector" of plain floats, with the scalar
// bf16 / fp16 conversions of scalar_type.h, so it runs on any x86-64 (and is what
// INFLIGHT_CPU_ISA=portable tests).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "cpu_features.h"
#include "thread_pool.h"

#define INFLIGHT_ATTENTION_ISA portable
#include "attention_dispatch.h"

namespace inflight::kernels::cpu::portable {
namespace {

struct Vec1 {
  using Reg = float;
  static constexpr int kWidth = 1;
  static constexpr int kKeyTile = 32;
  static constexpr int kQkRows = 1;
  static constexpr int kPvRows = 1;
  static constexpr int kPvChunk = 16;  // a run of 16 floats the compiler can vectorise with SSE2

  static Reg zero() { return 0.0f; }
  static Reg set1(float x) { return x; }
  static Reg load(float const* p) { return *p; }
  static void store(float* p, Reg v) { *p = v; }
  static Reg add(Reg a, Reg b) { return a + b; }
  static Reg sub(Reg a, Reg b) { return a - b; }
  static Reg mul(Reg a, Reg b) { return a * b; }
  static Reg fmadd(Reg a, Reg b, Reg c) { return a * b + c; }
  static Reg max(Reg a, Reg b) { return std::max(a, b); }
  static float hsum(Reg v) { return v; }
  static float hmax(Reg v) { return v; }
  static Reg exp2(Reg x) { return std::exp2(x); }
  static Reg reduce_lanes(Reg const* v) { return v[0]; }
  static void transpose(Reg*) {}

  // s[r * s_stride + i] = sq[r] * float(q[r * q_stride] . krows[i]) for r < rows, i < n: exact int32
  // sums of int16 query codes times int8 key codes.
  template <int kHd>
  static void qk_codes(float* s, int s_stride, std::int16_t const* q, int q_stride, float const* sq, int rows,
                       std::int8_t const* const* krows, int n, int hd) {
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < n; ++i) {
        std::int32_t d = 0;
        for (int c = 0; c < hd; ++c) d += std::int32_t(q[r * q_stride + c]) * krows[i][c];
        s[r * s_stride + i] = float(d) * sq[r];
      }
    }
  }

  // The vector paths' prob_codes and pv_codes_block one lane at a time (the same codes, the same int32 sums).
  static float prob_codes(std::int16_t* codes, float const* p) {
    float amax = 0.0f;
    for (int i = 0; i < kKeyTile; ++i) amax = std::max(amax, p[i]);
    float const f = amax > 0.0f ? 32767.0f / amax : 0.0f;
    for (int i = 0; i < kKeyTile; ++i) codes[i] = static_cast<std::int16_t>(std::nearbyint(p[i] * f));
    return amax / 32767.0f;
  }

  template <int R>
  static void pv_codes_block(float* o, int o_stride, std::int16_t const (*pc)[kKeyTile], float const* ps,
                             std::int8_t const* const* vrows, int n, int hd) {
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < hd; ++c) {
        std::int32_t sum = 0;
        for (int i = 0; i < n; ++i) sum += std::int32_t(pc[r][i]) * vrows[i][c];
        o[r * o_stride + c] = fmadd(float(sum), ps[r], o[r * o_stride + c]);
      }
    }
  }

  template <class T>
  static Reg load_cvt(T const* p) {
    return to_float(*p);
  }
  static Reg load_cvt(std::int8_t const* p) { return float(*p); }
  static Reg load_cvt(Float8E4M3 const* p) { return f16_to_float(e4m3_to_f16_bits(p->bits)); }  // e4m3 * 2^-8
  template <class T>
  static void store_cvt(T* p, Reg v) {
    *p = from_float<T>(v);
  }
};

// One instantiation: the run-time head_dim (any value up to kMaxHeadDim).
using Kernels = Dispatch<Vec1>;

}  // namespace
}  // namespace inflight::kernels::cpu::portable

namespace inflight::kernels::cpu {

namespace {
// Partition sizes are multiples of every ISA's key tile.
constexpr int kTile = 64;
// A partition smaller than this costs more to merge than it gains in balance.
constexpr int kMinPartition = 128;
// Work items per thread to aim for: enough that dynamic scheduling evens out unequal items.
constexpr int kItemsPerThread = 8;

// The split of plan_paged_attention, or (split = false) one partition per sequence. Lengths are the
// keys each sequence reads: its window's, not kv_len, so a windowed decode costs and splits by window.
PagedAttentionPlan make_plan(PagedAttentionParams const& p, bool split) {
  int max_kv = 0;
  int64_t total = 0;
  for (int b = 0; b < p.batch_size; ++b) {
    int const keys = p.kv_lens[b] - decode_key_begin(p.window, p.kv_lens[b]);
    max_kv = std::max(max_kv, keys);
    total += keys;
  }
  PagedAttentionPlan plan;
  plan.partition_size = std::max(max_kv, 1);
  plan.max_partitions = 1;
  int64_t const bytes = total * p.num_kv_heads * p.head_dim * 2 * int64_t(scalar_type_size(p.kv_dtype));  // K and V
  plan.num_threads = int(std::clamp<int64_t>(bytes / kMinDecodeBytesPerThread, 1, std::max(p.num_threads, 1)));
  int const per_item = decode_kv_heads_per_item(p.num_heads, p.num_kv_heads, p.head_dim);
  plan.kv_heads_per_item = per_item;
  int64_t const kv_chunks = (p.num_kv_heads + per_item - 1) / per_item;
  if (batch_invariant()) {
    // Fewer items than threads: one KV head per item (each head computes alike in any item).
    if (int64_t(p.batch_size) * kv_chunks < plan.num_threads) plan.kv_heads_per_item = 1;
    return plan;
  }
  if (!split || plan.num_threads <= 1 || max_kv <= kMinPartition) return plan;
  int64_t const target = int64_t(plan.num_threads) * kItemsPerThread;
  int64_t size = (total * kv_chunks + target - 1) / target;
  size = std::max<int64_t>(kMinPartition, (size + kTile - 1) / kTile * kTile);
  if (size >= max_kv) return plan;
  plan.partition_size = int(size);
  plan.max_partitions = int((max_kv + size - 1) / size);
  return plan;
}

// Bytes of the partials of the split sequences: (m, l, acc[head_dim]) per (sequence, head, partition).
int64_t workspace_bytes(PagedAttentionParams const& p, PagedAttentionPlan const& plan) {
  if (plan.max_partitions <= 1) return 0;
  return int64_t(p.batch_size) * p.num_heads * plan.max_partitions * (p.head_dim + 2) * int64_t(sizeof(float));
}

}  // namespace

PagedAttentionPlan plan_paged_attention(PagedAttentionParams const& p) { return make_plan(p, true); }

int64_t paged_attention_workspace_size(PagedAttentionParams const& p) {
  return workspace_bytes(p, plan_paged_attention(p));
}

namespace {

// store_kv into a one-byte cache (int8 or fp8): encode(src, dst, slot row, is_v) writes one (token, KV
// head) row of head_dim elements at dst. Encoding costs a few operations per element: threads pay off
// from a few thousand rows.
template <class T, class Code, class Encode>
void store_kv_narrow(StoreKvParams const& p, ThreadPool& pool, Encode encode) {
  int64_t const row = p.head_dim;
  auto* const k_cache = static_cast<Code*>(p.kv_cache);
  Code* const v_cache = k_cache + p.num_slots * p.num_kv_heads * row;
  T const* const k = static_cast<T const*>(p.k);
  T const* const v = static_cast<T const*>(p.v);
  int const threads = p.num_tokens * p.num_kv_heads * row >= (int64_t(1) << 16) ? p.num_threads : 1;
  pool_detail::parallel_for(pool, p.num_tokens, threads, false, [&](int64_t t, int) {
    int64_t const slot = p.slot_mapping[t];
    if (slot < 0) return;
    for (int h = 0; h < p.num_kv_heads; ++h) {
      int64_t const dst = slot * p.num_kv_heads + h;
      encode(k + t * p.k_token_stride + h * p.k_head_stride, k_cache + dst * row, dst, false);
      encode(v + t * p.v_token_stride + h * p.v_head_stride, v_cache + dst * row, dst, true);
    }
  });
}

// int8: each row quantised with its own scale.
template <class T>
void store_kv_int8(StoreKvParams const& p, ThreadPool& pool) {
  float* const k_scales = p.kv_scales;
  float* const v_scales = k_scales + p.num_slots * p.num_kv_heads;
  store_kv_narrow<T, std::int8_t>(p, pool, [&](T const* x, std::int8_t* dst, int64_t r, bool is_v) {
    (is_v ? v_scales : k_scales)[r] = quantize_kv_row(x, p.head_dim, dst);
  });
}

// fp8: each element divided by its tensor's scale (IEEE division, as the reference's x / scale), then
// encoded to E4M3 (nearest even, saturating; float_to_e4m3).
template <class T>
void store_kv_fp8(StoreKvParams const& p, ThreadPool& pool) {
  store_kv_narrow<T, std::uint8_t>(p, pool, [&](T const* x, std::uint8_t* dst, int64_t, bool is_v) {
    float const scale = is_v ? p.v_scale : p.k_scale;
    for (int i = 0; i < p.head_dim; ++i) dst[i] = float_to_e4m3(to_float(x[i]) / scale);
  });
}

}  // namespace

void launch_store_kv(StoreKvParams const& p, ThreadPool& pool) {
  if (p.kv_dtype == ScalarType::kInt8 || p.kv_dtype == ScalarType::kFloat8E4M3) {
    bool const int8 = p.kv_dtype == ScalarType::kInt8;
    if (!dispatch_float_type(p.dtype, [&](auto t) {
          if (int8) {
            store_kv_int8<decltype(t)>(p, pool);
          } else {
            store_kv_fp8<decltype(t)>(p, pool);
          }
        })) {
      throw std::invalid_argument("store_kv: k and v must be a float type");
    }
    return;
  }
  if (p.kv_dtype != p.dtype) {
    throw std::invalid_argument("store_kv: the cache must have k's dtype or be int8 or fp8");
  }
  size_t const es = scalar_type_size(p.dtype);
  size_t const row_bytes = size_t(p.head_dim) * es;
  char* const k_cache = static_cast<char*>(p.kv_cache);
  char* const v_cache = k_cache + size_t(p.num_slots) * p.num_kv_heads * row_bytes;
  char const* const k = static_cast<char const*>(p.k);
  char const* const v = static_cast<char const*>(p.v);
  // A copy: a thread pays off only for long prompts.
  int const threads = size_t(p.num_tokens) * p.num_kv_heads * row_bytes >= (size_t(1) << 18) ? p.num_threads : 1;
  pool_detail::parallel_for(pool, p.num_tokens, threads, false, [&](int64_t t, int) {
    int64_t const slot = p.slot_mapping[t];
    if (slot < 0) return;
    size_t const dst = size_t(slot) * p.num_kv_heads * row_bytes;
    for (int h = 0; h < p.num_kv_heads; ++h) {
      std::memcpy(k_cache + dst + h * row_bytes, k + (t * p.k_token_stride + h * p.k_head_stride) * int64_t(es),
                  row_bytes);
      std::memcpy(v_cache + dst + h * row_bytes, v + (t * p.v_token_stride + h * p.v_head_stride) * int64_t(es),
                  row_bytes);
    }
  });
}

// The portable path runs every head dim; it refuses only a dtype combination outside the set (a
// float q with a cache of its dtype, of int8 or of fp8), which the bindings never pass.
void paged_attention_portable(PagedAttentionParams const& params, PagedAttentionPlan const& plan, ThreadPool& pool) {
  if (!portable::Kernels::paged_attention(params, plan, pool)) {
    throw std::invalid_argument("paged_attention: q must be a float type and the cache q's dtype, int8 or fp8");
  }
}

void context_attention_portable(ContextAttentionParams const& params, ThreadPool& pool) {
  if (!portable::Kernels::context_attention(params, pool)) {
    throw std::invalid_argument("context_attention: q must be a float type and the cache q's dtype, int8 or fp8");
  }
}

void launch_paged_attention(PagedAttentionParams const& params, ThreadPool& pool) {
  if (params.batch_size == 0) return;
  PagedAttentionPlan plan = plan_paged_attention(params);
  if (plan.max_partitions > 1 &&
      (params.workspace == nullptr || params.workspace_bytes < workspace_bytes(params, plan))) {
    plan = make_plan(params, false);  // no room for the partials: every sequence in one pass
  }
  switch (selected_isa()) {
    case Isa::kAvx512:
      if (paged_attention_avx512(params, plan, pool)) return;
      [[fallthrough]];
    case Isa::kAvx512F:  // the AVX-512 kernels store bf16 with BF16 instructions
    case Isa::kAvx2:
      if (paged_attention_avx2(params, plan, pool)) return;
      [[fallthrough]];
    case Isa::kPortable:
      paged_attention_portable(params, plan, pool);
  }
}

void launch_context_attention(ContextAttentionParams const& params, ThreadPool& pool) {
  if (params.batch_size == 0 || params.num_tokens == 0) return;
  switch (selected_isa()) {
    case Isa::kAvx512:
      if (context_attention_avx512(params, pool)) return;
      [[fallthrough]];
    case Isa::kAvx512F:
    case Isa::kAvx2:
      if (context_attention_avx2(params, pool)) return;
      [[fallthrough]];
    case Isa::kPortable:
      context_attention_portable(params, pool);
  }
}

}  // namespace inflight::kernels::cpu
