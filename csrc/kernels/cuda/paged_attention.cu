#include <cmath>
#include <cstdint>

#include "attention_simt.h"
#include "device_utils.cuh"
#include "paged_attention.h"
#include "paged_kv.cuh"
#include "static_switch.h"

namespace inflight::kernels::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// T: half or __nv_bfloat16. kHeadDim: 64 or 128.
template <typename T, int kHeadDim>
struct DecodeConfig {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = 16;               // query heads per CTA: one MMA M tile
  static constexpr int kTileKeys = 16 * kWarps;  // keys per pipeline stage; warp w owns 16 of them
  static constexpr int kStages = 2;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  // 16 bytes of padding per shared-memory row: the 8 rows one ldmatrix phase reads then start in 8
  // different 4-bank groups (row pitch 4 words mod 32), so the loads are conflict-free.
  static constexpr int kRowElems = kHeadDim + 8;
  static constexpr int kQElems = kRows * kRowElems;
  static constexpr int kTileElems = kTileKeys * kRowElems;
  static constexpr int kSmemBytes = (kQElems + 2 * kStages * kTileElems) * static_cast<int>(sizeof(T));
  // The cross-warp merge reuses the pipeline buffers: per warp 16 rows of m, l and kHeadDim outputs
  // (rows kMergePitch floats apart: 8 extra words keep the float2 stores conflict-free).
  static constexpr int kMergePitch = kHeadDim + 8;
  static constexpr int kMergeBytes = (2 * kWarps * kRows + kWarps * kRows * kMergePitch) * 4;
  static_assert(kMergeBytes <= kSmemBytes, "merge scratch must fit in the pipeline buffers");
  static_assert(kThreads % kChunks == 0, "each thread copies one fixed column of 16-byte chunks");
};

// kKv: the cache holds T, int8 codes and p.kv_scales, or E4M3 bytes and p.k_scale / p.v_scale; int8
// and fp8 tiles are dequantised to T as they are loaded (through registers: a cp.async cannot convert),
// the rest is the 16-bit kernel.
template <typename T, int kHeadDim, KvKind kKv>
__global__ void __launch_bounds__(DecodeConfig<T, kHeadDim>::kThreads)
    paged_decode_kernel(PagedAttentionParams p, int num_partitions) {
  constexpr bool kInt8 = kKv == KvKind::kInt8;
  using C = DecodeConfig<T, kHeadDim>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);
  T* s_kv = s_q + C::kQElems;  // stage s: K tile at 2s, V tile at 2s + 1 (in kTileElems units)

  int const tid = threadIdx.x;
  int const warp = tid / 32;
  int const lane = tid % 32;
  int const g = lane / 4;  // MMA fragment row within an 8-row group
  int const t = lane % 4;  // MMA fragment column pair

  int const partition = blockIdx.x;
  int const group = p.num_heads / p.num_kv_heads;
  int const chunks_per_group = (group + C::kRows - 1) / C::kRows;
  int const kv_head = blockIdx.y / chunks_per_group;
  int const head_begin = kv_head * group + (blockIdx.y % chunks_per_group) * C::kRows;
  int const rows = min(C::kRows, kv_head * group + group - head_begin);
  int const seq = blockIdx.z;
  int const kv_len = clamp_kv_len(p.kv_lens[seq], p.max_blocks_per_seq, p.tokens_per_block);
  // Under a window only the keys key_begin .. kv_len - 1 are seen: the tiles before the one holding
  // key_begin are not read, and its keys before key_begin are masked.
  int const key_begin = p.window > 0 && kv_len > p.window ? kv_len - p.window : 0;
  int const first_tile = key_begin / C::kTileKeys;
  int const num_tiles = (kv_len + C::kTileKeys - 1) / C::kTileKeys - first_tile;
  int const my_tiles = partition < num_tiles ? (num_tiles - partition + num_partitions - 1) / num_partitions : 0;

  T const* q = static_cast<T const*>(p.q) + seq * p.q_token_stride;
  std::int64_t const half_rows = p.num_blocks * p.tokens_per_block * p.num_kv_heads;  // (slot, kv head) rows
  [[maybe_unused]] T const* k_cache = static_cast<T const*>(p.kv_cache);
  [[maybe_unused]] T const* v_cache = k_cache + half_rows * kHeadDim;
  [[maybe_unused]] std::int8_t const* k_codes = static_cast<std::int8_t const*>(p.kv_cache);
  [[maybe_unused]] std::int8_t const* v_codes = k_codes + half_rows * kHeadDim;
  [[maybe_unused]] float const* k_scales = p.kv_scales;
  [[maybe_unused]] float const* v_scales = kInt8 ? p.kv_scales + half_rows : nullptr;
  int const* table = p.block_tables + seq * p.block_table_stride;

  // Query rows: head_begin + r for r < rows; the rest of the 16-row tile is zero.
  for (int i = tid; i < C::kRows * C::kChunks; i += C::kThreads) {
    int const r = i / C::kChunks;
    int const c = i % C::kChunks;
    bool const valid = r < rows;
    T const* src = valid ? q + static_cast<std::int64_t>(head_begin + r) * kHeadDim + c * 8 : q;
    cp_async_16(s_q + r * C::kRowElems + c * 8, src, valid);
  }

  int const chunk = tid % C::kChunks;  // this thread's 16-byte column in every K/V row it copies
  auto load_tile = [&](int tile, int stage) {
    T* s_k = s_kv + (2 * stage) * C::kTileElems;
    T* s_v = s_k + C::kTileElems;
    for (int r = tid / C::kChunks; r < C::kTileKeys; r += C::kThreads / C::kChunks) {
      int const key = tile * C::kTileKeys + r;
      std::int64_t offset = -1;
      if (key >= key_begin && key < kv_len) {
        offset = paged_kv_offset(table, key, p.tokens_per_block, p.num_blocks, p.num_kv_heads, kHeadDim, kv_head);
      }
      bool const valid = offset >= 0;  // rows outside the keys are zero-filled (masked below; 0 * V stays 0)
      if constexpr (kKv != KvKind::kSame) {
        uint4 kd = make_uint4(0u, 0u, 0u, 0u), vd = kd;
        if (valid) {
          uint2 const kb = *reinterpret_cast<uint2 const*>(k_codes + offset + chunk * 8);
          uint2 const vb = *reinterpret_cast<uint2 const*>(v_codes + offset + chunk * 8);
          if constexpr (kInt8) {
            std::int64_t const row = offset / kHeadDim;
            kd = dequant_int8x8<T>(kb, k_scales[row]);
            vd = dequant_int8x8<T>(vb, v_scales[row]);
          } else {
            kd = dequant_fp8x8<T>(kb, p.k_scale);
            vd = dequant_fp8x8<T>(vb, p.v_scale);
          }
        }
        *reinterpret_cast<uint4*>(s_k + r * C::kRowElems + chunk * 8) = kd;
        *reinterpret_cast<uint4*>(s_v + r * C::kRowElems + chunk * 8) = vd;
      } else {
        std::int64_t const src = valid ? offset + chunk * 8 : 0;
        cp_async_16(s_k + r * C::kRowElems + chunk * 8, k_cache + src, valid);
        cp_async_16(s_v + r * C::kRowElems + chunk * 8, v_cache + src, valid);
      }
    }
  };

  if (my_tiles > 0) load_tile(first_tile + partition, 0);
  cp_async_commit();

  std::uint32_t q_frag[kHeadDim / 16][4];
  float o[kHeadDim / 8][4];
#pragma unroll
  for (int i = 0; i < kHeadDim / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // running max (log2 units) of rows g and g + 8
  float l[2] = {0.f, 0.f};              // this lane's part of the running sums
  float const scale_log2 = p.scale * kLog2e;
  int const mi = lane / 8;  // which of the four 8x8 matrices this lane addresses in ldmatrix

  for (int i = 0; i < my_tiles; ++i) {
    int const tile = first_tile + partition + i * num_partitions;
    // Prefetch the next tile into the other stage; the trailing barrier of the previous iteration
    // guarantees nobody still reads it. An empty group keeps the wait count uniform.
    if (i + 1 < my_tiles) load_tile(tile + num_partitions, (i + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    if (i == 0) {
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        ldmatrix_x4(q_frag[kk], s_q + ((mi & 1) * 8 + (lane & 7)) * C::kRowElems + kk * 16 + (mi >> 1) * 8);
      }
    }
    T const* s_k = s_kv + (2 * (i & 1)) * C::kTileElems + warp * 16 * C::kRowElems;
    T const* s_v = s_k + C::kTileElems;

    // S = Q K^T over this warp's 16 keys: two 8-key column tiles.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      std::uint32_t b[4];
      ldmatrix_x4(b, s_k + ((mi >> 1) * 8 + (lane & 7)) * C::kRowElems + kk * 16 + (mi & 1) * 8);
      mma_16816<T>(s[0], q_frag[kk], b[0], b[1]);
      mma_16816<T>(s[1], q_frag[kk], b[2], b[3]);
    }

    int const key_base = tile * C::kTileKeys + warp * 16 + 2 * t;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int const key = key_base + nt * 8 + (e & 1);
        s[nt][e] = key < kv_len && key >= key_begin ? s[nt][e] * scale_log2 : -INFINITY;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float const tile_max = quad_max(fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1])));
      float const m_new = fmaxf(m[r], tile_max);
      float const m_use = m_new == -INFINITY ? 0.f : m_new;  // no keys yet: avoid (-inf) - (-inf)
      float const alpha = exp2f(m[r] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        s[nt][2 * r] = exp2f(s[nt][2 * r] - m_use);
        s[nt][2 * r + 1] = exp2f(s[nt][2 * r + 1] - m_use);
        sum += s[nt][2 * r] + s[nt][2 * r + 1];
      }
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
#pragma unroll
      for (int d = 0; d < kHeadDim / 8; ++d) {
        o[d][2 * r] *= alpha;
        o[d][2 * r + 1] *= alpha;
      }
    }

    // O += P V: the S accumulators of the two column tiles are exactly the A fragment of one k-step.
    std::uint32_t const a[4] = {pack2<T>(s[0][0], s[0][1]), pack2<T>(s[0][2], s[0][3]), pack2<T>(s[1][0], s[1][1]),
                                pack2<T>(s[1][2], s[1][3])};
#pragma unroll
    for (int dd = 0; dd < kHeadDim / 16; ++dd) {
      std::uint32_t b[4];
      ldmatrix_x4_trans(b, s_v + ((mi & 1) * 8 + (lane & 7)) * C::kRowElems + dd * 16 + (mi >> 1) * 8);
      mma_16816<T>(o[2 * dd], a, b[0], b[1]);
      mma_16816<T>(o[2 * dd + 1], a, b[2], b[3]);
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers become the merge scratch

  // Merge the four warps (each saw a different quarter of every tile).
  float* s_m = reinterpret_cast<float*>(smem);  // [kWarps][kRows]
  float* s_l = s_m + C::kWarps * C::kRows;      // [kWarps][kRows]
  float* s_o = s_l + C::kWarps * C::kRows;      // [kWarps][kRows][kMergePitch]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float const lr = quad_sum(l[r]);
    if (t == 0) {
      s_m[warp * C::kRows + g + 8 * r] = m[r];
      s_l[warp * C::kRows + g + 8 * r] = lr;
    }
  }
#pragma unroll
  for (int d = 0; d < kHeadDim / 8; ++d) {
    float* row0 = s_o + (warp * C::kRows + g) * C::kMergePitch + d * 8 + 2 * t;
    *reinterpret_cast<float2*>(row0) = make_float2(o[d][0], o[d][1]);
    *reinterpret_cast<float2*>(row0 + 8 * C::kMergePitch) = make_float2(o[d][2], o[d][3]);
  }
  __syncthreads();

  float* ws_o = static_cast<float*>(p.workspace);
  float* ws_lse = ws_o + static_cast<std::int64_t>(p.batch_size) * p.num_heads * num_partitions * kHeadDim;
  for (int i = tid; i < rows * kHeadDim; i += C::kThreads) {
    int const r = i / kHeadDim;
    int const d = i % kHeadDim;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < C::kWarps; ++w) mx = fmaxf(mx, s_m[w * C::kRows + r]);
    float sum = 0.f, acc = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < C::kWarps; ++w) {
        float const f = exp2f(s_m[w * C::kRows + r] - mx);  // a warp with no keys: exp2(-inf) = 0
        sum += s_l[w * C::kRows + r] * f;
        acc += s_o[(w * C::kRows + r) * C::kMergePitch + d] * f;
      }
    }
    float const value = sum > 0.f ? acc / sum : 0.f;
    std::int64_t const bh = static_cast<std::int64_t>(seq) * p.num_heads + head_begin + r;
    if (num_partitions == 1) {
      static_cast<T*>(p.out)[bh * kHeadDim + d] = from_float<T>(value);
    } else {
      std::int64_t const slot = bh * num_partitions + partition;
      ws_o[slot * kHeadDim + d] = value;
      if (d == 0) ws_lse[slot] = sum > 0.f ? mx + log2f(sum) : -INFINITY;
    }
  }
}

// Merges the partitions of one (sequence, head) per block: out = sum_p w_p o_p / sum_p w_p with
// w_p = 2^(lse_p - max lse). T: output element type.
template <typename T>
__global__ void __launch_bounds__(128) paged_decode_merge_kernel(PagedAttentionParams p, int num_partitions) {
  __shared__ float s_w[kPagedAttentionMaxPartitions];
  __shared__ float s_inv;
  std::int64_t const bh = blockIdx.x;
  int const head_dim = p.head_dim;
  float const* ws_o = static_cast<float const*>(p.workspace);
  float const* ws_lse = ws_o + static_cast<std::int64_t>(p.batch_size) * p.num_heads * num_partitions * head_dim;
  float const* lse = ws_lse + bh * num_partitions;
  if (threadIdx.x < 32) {
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < num_partitions; i += 32) mx = fmaxf(mx, lse[i]);
    mx = warp_max(mx);
    float sum = 0.f;
    for (int i = threadIdx.x; i < num_partitions; i += 32) {
      float const w = (mx == -INFINITY || lse[i] == -INFINITY) ? 0.f : exp2f(lse[i] - mx);
      s_w[i] = w;
      sum += w;
    }
    sum = warp_sum(sum);
    if (threadIdx.x == 0) s_inv = sum > 0.f ? 1.f / sum : 0.f;
  }
  __syncthreads();
  float const inv = s_inv;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int i = 0; i < num_partitions; ++i) acc += s_w[i] * ws_o[(bh * num_partitions + i) * head_dim + d];
    static_cast<T*>(p.out)[bh * head_dim + d] = from_float<T>(acc * inv);
  }
}

int ceil_div(std::int64_t a, std::int64_t b) { return static_cast<int>((a + b - 1) / b); }

int max_partitions_for(std::int64_t max_kv_len) {
  std::int64_t const n = (max_kv_len + kPagedAttentionMinPartitionKeys - 1) / kPagedAttentionMinPartitionKeys;
  return static_cast<int>(n < 1 ? 1 : (n > kPagedAttentionMaxPartitions ? kPagedAttentionMaxPartitions : n));
}

// Partitions: enough CTAs for about four per multiprocessor, no partition shorter than
// kPagedAttentionMinPartitionKeys of the table's capacity (or of the window), and no more than the
// workspace holds.
cudaError_t choose_partitions(PagedAttentionParams const& p, int ctas_per_partition, int tile_keys,
                              int& num_partitions) {
  num_partitions = 1;
  if (p.workspace == nullptr) return cudaSuccess;
  std::int64_t const per_partition = static_cast<std::int64_t>(p.batch_size) * p.num_heads * (p.head_dim + 1) * 4;
  std::int64_t const by_workspace = p.workspace_bytes / per_partition;
  int device = 0, num_sms = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  status = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (status != cudaSuccess) return status;
  int const by_occupancy = ceil_div(4LL * num_sms, ctas_per_partition);
  // Keys a sequence can read: the table's capacity, or under a window at most window + one tile.
  std::int64_t max_keys = static_cast<std::int64_t>(p.max_blocks_per_seq) * p.tokens_per_block;
  if (p.window > 0 && p.window + tile_keys < max_keys) max_keys = p.window + tile_keys;
  int const by_length = max_partitions_for(max_keys);
  std::int64_t n = by_occupancy < by_length ? by_occupancy : by_length;
  if (n > by_workspace) n = by_workspace;
  num_partitions = n < 1 ? 1 : static_cast<int>(n);
  return cudaSuccess;
}

template <typename T, int kHeadDim, KvKind kKv>
cudaError_t launch_decode(PagedAttentionParams const& p, cudaStream_t stream) {
  using C = DecodeConfig<T, kHeadDim>;
  int const group = p.num_heads / p.num_kv_heads;
  int const chunks_per_group = (group + C::kRows - 1) / C::kRows;
  std::int64_t const grid_y = static_cast<std::int64_t>(p.num_kv_heads) * chunks_per_group;
  if (grid_y > 65535 || p.batch_size > 65535) return cudaErrorInvalidValue;
  int num_partitions = 1;
  cudaError_t status = choose_partitions(p, static_cast<int>(grid_y) * p.batch_size, C::kTileKeys, num_partitions);
  if (status != cudaSuccess) return status;

  auto kernel = paged_decode_kernel<T, kHeadDim, kKv>;
  status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  if (status != cudaSuccess) return status;
  dim3 grid(static_cast<unsigned>(num_partitions), static_cast<unsigned>(grid_y), static_cast<unsigned>(p.batch_size));
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p, num_partitions);
  status = cudaGetLastError();
  if (status != cudaSuccess || num_partitions == 1) return status;
  paged_decode_merge_kernel<T>
      <<<static_cast<unsigned>(p.batch_size * p.num_heads), 128, 0, stream>>>(p, num_partitions);
  return cudaGetLastError();
}

ContextAttentionParams as_decode_context(PagedAttentionParams const& p) {
  ContextAttentionParams c{};
  static_cast<AttentionParams&>(c) = p;
  c.cu_seqlens = nullptr;
  c.num_tokens = p.batch_size;
  return c;
}

}  // namespace

std::int64_t paged_attention_workspace_size(int batch_size, int num_heads, int max_kv_len, int head_dim) {
  int const n = max_partitions_for(max_kv_len);
  if (n <= 1 || batch_size <= 0 || num_heads <= 0 || head_dim <= 0) return 0;
  return static_cast<std::int64_t>(batch_size) * num_heads * n * (head_dim + 1) * 4;
}

cudaError_t launch_paged_attention(PagedAttentionParams const& params, cudaStream_t stream) {
  if (params.batch_size == 0 || params.num_heads == 0) return cudaSuccess;
  if (params.num_kv_heads <= 0 || params.num_heads % params.num_kv_heads != 0) return cudaErrorInvalidValue;
  KvKind kind = KvKind::kSame;
  if (!kv_kind_of(params.dtype, params.kv_dtype, params.kv_scales, kind)) return cudaErrorInvalidValue;
  if (params.dtype == ScalarType::kFloat32) return launch_attention_simt(as_decode_context(params), stream);
  return HALF_TYPE_SWITCH(params.dtype, T, [&] {
    return HEAD_DIM_SWITCH(params.head_dim, kHeadDim, [&] {
      return KV_KIND_SWITCH(kind, kKv, [&] { return launch_decode<T, kHeadDim, kKv>(params, stream); });
    });
  });
}

cudaError_t launch_paged_attention_simt(PagedAttentionParams const& params, cudaStream_t stream) {
  if (params.batch_size == 0 || params.num_heads == 0) return cudaSuccess;
  return launch_attention_simt(as_decode_context(params), stream);
}

}  // namespace inflight::kernels::cuda
