#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_simt.h"
#include "device_utils.cuh"
#include "paged_kv.cuh"
#include "static_switch.h"

namespace inflight::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr float kLog2e = 1.4426950408889634f;

// Sequence owning flattened query token `token`: the largest s in [0, batch) with cu_seqlens[s] <= token
// (empty sequences share their start with the next one, so the largest is the one with tokens).
__device__ int find_sequence(int const* cu_seqlens, int batch_size, std::int64_t token) {
  int lo = 0, hi = batch_size - 1;
  while (lo < hi) {
    int const mid = (lo + hi + 1) / 2;
    if (cu_seqlens[mid] <= token) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Element i of a cache row as fp32: widened, or for int8 codes (E4M3 bytes) times the row's (tensor's)
// scale.
template <typename C>
__device__ __forceinline__ float kv_value(C const* row, int i, float scale) {
  if constexpr (std::is_same_v<C, std::int8_t> || std::is_same_v<C, __nv_fp8_e4m3>) {
    return static_cast<float>(row[i]) * scale;
  } else {
    (void)scale;
    return to_float(row[i]);
  }
}

// T: element type of q and out. C: the cache's, T, int8_t (codes with p.kv_scales) or __nv_fp8_e4m3
// (with p.k_scale, p.v_scale). kHeadDim:
// channels per head, a multiple of 32.
template <typename T, typename C, int kHeadDim>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) attention_simt_kernel(ContextAttentionParams p) {
  constexpr bool kInt8 = std::is_same_v<C, std::int8_t>;
  constexpr int kPerLane = kHeadDim / 32;
  int const warp = threadIdx.x / 32;
  int const lane = threadIdx.x % 32;
  std::int64_t const token = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (token >= p.num_tokens) return;  // whole warps only: no block-wide synchronisation below
  int const head = blockIdx.y;

  int seq = 0, q_len = 1;
  std::int64_t row = 0;
  if (p.cu_seqlens == nullptr) {
    if (token >= p.batch_size) return;
    seq = static_cast<int>(token);
  } else {
    if (p.batch_size <= 0 || token < p.cu_seqlens[0] || token >= p.cu_seqlens[p.batch_size]) return;
    seq = find_sequence(p.cu_seqlens, p.batch_size, token);
    q_len = p.cu_seqlens[seq + 1] - p.cu_seqlens[seq];
    row = token - p.cu_seqlens[seq];
  }
  int const kv_len = clamp_kv_len(p.kv_lens[seq], p.max_blocks_per_seq, p.tokens_per_block);
  std::int64_t const q_pos = static_cast<std::int64_t>(kv_len) - q_len + row;
  int const num_keys = q_pos + 1 < 0 ? 0 : (q_pos + 1 > kv_len ? kv_len : static_cast<int>(q_pos + 1));
  // Under a window the query sees keys q_pos - window + 1 .. q_pos only.
  int const first_key = p.window > 0 && q_pos - p.window + 1 > 0 ? static_cast<int>(q_pos - p.window + 1) : 0;
  int const kv_head = head / (p.num_heads / p.num_kv_heads);

  T const* q = static_cast<T const*>(p.q) + token * p.q_token_stride + static_cast<std::int64_t>(head) * kHeadDim;
  float q_reg[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) q_reg[i] = to_float(q[lane * kPerLane + i]);

  std::int64_t const half_rows = p.num_blocks * p.tokens_per_block * p.num_kv_heads;  // (slot, kv head) rows
  C const* k_cache = static_cast<C const*>(p.kv_cache);
  C const* v_cache = k_cache + half_rows * kHeadDim;
  float const* k_scales = p.kv_scales;
  float const* v_scales = kInt8 ? p.kv_scales + half_rows : nullptr;
  int const* table = p.block_tables + seq * p.block_table_stride;
  float const scale_log2 = p.scale * kLog2e;

  float acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (int j = first_key; j < num_keys; ++j) {
    std::int64_t const offset =
        paged_kv_offset(table, j, p.tokens_per_block, p.num_blocks, p.num_kv_heads, kHeadDim, kv_head);
    if (offset < 0) continue;  // the same value in every lane: the warp stays converged
    C const* k = k_cache + offset + lane * kPerLane;
    C const* v = v_cache + offset + lane * kPerLane;
    float const k_scale = kInt8 ? k_scales[offset / kHeadDim] : p.k_scale;  // p's: 1 unless fp8
    float const v_scale = kInt8 ? v_scales[offset / kHeadDim] : p.v_scale;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) dot += q_reg[i] * kv_value(k, i, k_scale);
    float const s = warp_sum(dot) * scale_log2;
    float const m_new = fmaxf(m, s);
    float const alpha = exp2f(m - m_new);  // m = -inf at the first key: alpha = 0
    float const pj = exp2f(s - m_new);
    l = l * alpha + pj;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] = acc[i] * alpha + pj * kv_value(v, i, v_scale);
    m = m_new;
  }
  float const inv = l > 0.f ? 1.f / l : 0.f;
  T* out = static_cast<T*>(p.out) + (token * p.num_heads + head) * kHeadDim;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) out[lane * kPerLane + i] = from_float<T>(acc[i] * inv);
}

}  // namespace

cudaError_t launch_attention_simt(ContextAttentionParams const& params, cudaStream_t stream) {
  if (params.num_tokens == 0 || params.batch_size == 0 || params.num_heads == 0) return cudaSuccess;
  if (params.num_kv_heads <= 0 || params.num_heads % params.num_kv_heads != 0) return cudaErrorInvalidValue;
  std::int64_t const blocks = (params.num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > 0x7fffffff || params.num_heads > 65535) return cudaErrorInvalidValue;
  KvKind kind = KvKind::kSame;
  if (!kv_kind_of(params.dtype, params.kv_dtype, params.kv_scales, kind)) return cudaErrorInvalidValue;
  dim3 const grid(static_cast<unsigned>(blocks), static_cast<unsigned>(params.num_heads));
  return SCALAR_TYPE_SWITCH(params.dtype, T, [&] {
    return HEAD_DIM_SWITCH(params.head_dim, kHeadDim, [&] {
      if (kind == KvKind::kInt8) {
        attention_simt_kernel<T, std::int8_t, kHeadDim><<<grid, kWarpsPerBlock * 32, 0, stream>>>(params);
      } else if (kind == KvKind::kFp8) {
        attention_simt_kernel<T, __nv_fp8_e4m3, kHeadDim><<<grid, kWarpsPerBlock * 32, 0, stream>>>(params);
      } else {
        attention_simt_kernel<T, T, kHeadDim><<<grid, kWarpsPerBlock * 32, 0, stream>>>(params);
      }
      return cudaGetLastError();
    });
  });
}

}  // namespace inflight::kernels::cuda
