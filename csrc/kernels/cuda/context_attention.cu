#include <cmath>
#include <cstdint>

#include "attention_simt.h"
#include "context_attention.h"
#include "device_utils.cuh"
#include "paged_kv.cuh"
#include "static_switch.h"

namespace inflight::kernels::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// T: half or __nv_bfloat16. kHeadDim: 64 or 128.
template <typename T, int kHeadDim>
struct PrefillConfig {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = 16 * kWarps;   // query rows per CTA; warp w owns rows 16w .. 16w+15
  static constexpr int kBlockN = 64;            // keys per pipeline stage
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  // 16 bytes of padding per row keep ldmatrix and the 32-bit output staging stores conflict-free.
  static constexpr int kRowElems = kHeadDim + 8;
  static constexpr int kQElems = kBlockM * kRowElems;
  static constexpr int kTileElems = kBlockN * kRowElems;
  static constexpr int kSmemBytes = (kQElems + 4 * kTileElems) * static_cast<int>(sizeof(T));  // Q + 2 x (K, V)
  static_assert(kThreads % kChunks == 0, "each thread copies one fixed column of 16-byte chunks");
};

// Finds the (sequence, tile) of virtual tile `v` when sequence i owns ceil(q_len_i / block_m) tiles, in
// order. Run by every warp of the CTA on the same inputs, so the answer is uniform without a barrier.
__device__ bool locate_tile(int const* cu_seqlens, int batch_size, int v, int block_m, int& seq, int& tile) {
  int const lane = threadIdx.x % 32;
  int base = 0;  // tiles of the sequences before this chunk of 32
  for (int s0 = 0; s0 < batch_size; s0 += 32) {
    int const s = s0 + lane;
    int n = 0;
    if (s < batch_size) {
      int const len = cu_seqlens[s + 1] - cu_seqlens[s];
      n = len > 0 ? (len + block_m - 1) / block_m : 0;
    }
    int inclusive = n;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      int const y = __shfl_up_sync(kFullMask, inclusive, offset);
      if (lane >= offset) inclusive += y;
    }
    int const total = __shfl_sync(kFullMask, inclusive, 31);
    if (v < base + total) {
      unsigned const ballot = __ballot_sync(kFullMask, base + inclusive > v);
      int const owner = __ffs(ballot) - 1;
      int const owner_inclusive = __shfl_sync(kFullMask, inclusive, owner);
      int const owner_n = __shfl_sync(kFullMask, n, owner);
      seq = s0 + owner;
      tile = v - (base + owner_inclusive - owner_n);
      return true;
    }
    base += total;
  }
  return false;
}

// kKv: the cache holds T, int8 codes and p.kv_scales, or E4M3 bytes and p.k_scale / p.v_scale; int8
// and fp8 tiles are dequantised to T as they are loaded (through registers: a cp.async cannot convert),
// the rest is the 16-bit kernel.
template <typename T, int kHeadDim, KvKind kKv>
__global__ void __launch_bounds__(PrefillConfig<T, kHeadDim>::kThreads)
    context_attention_kernel(ContextAttentionParams p) {
  constexpr bool kInt8 = kKv == KvKind::kInt8;
  using C = PrefillConfig<T, kHeadDim>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);
  T* s_kv = s_q + C::kQElems;  // stage s: K tile at 2s, V tile at 2s + 1 (in kTileElems units)

  int seq = 0, tile = 0;
  if (!locate_tile(p.cu_seqlens, p.batch_size, blockIdx.x, C::kBlockM, seq, tile)) return;  // uniform

  int const tid = threadIdx.x;
  int const warp = tid / 32;
  int const lane = tid % 32;
  int const g = lane / 4;
  int const t = lane % 4;
  int const mi = lane / 8;  // which of the four 8x8 matrices this lane addresses in ldmatrix

  int const head = blockIdx.y;
  int const kv_head = head / (p.num_heads / p.num_kv_heads);
  int const q_start = p.cu_seqlens[seq];
  int const q_len = p.cu_seqlens[seq + 1] - q_start;
  int const kv_len = clamp_kv_len(p.kv_lens[seq], p.max_blocks_per_seq, p.tokens_per_block);
  int const m0 = tile * C::kBlockM;  // first query row of this tile within the sequence
  int const rows_here = min(C::kBlockM, q_len - m0);
  // Position of row r of this tile: pos0 + r. Keys needed: up to the last row's position.
  std::int64_t const pos0 = static_cast<std::int64_t>(kv_len) - q_len + m0;
  std::int64_t const last_key = pos0 + rows_here - 1;
  int const num_keys = last_key + 1 < 0 ? 0 : (last_key + 1 > kv_len ? kv_len : static_cast<int>(last_key + 1));
  int const num_tiles = (num_keys + C::kBlockN - 1) / C::kBlockN;
  // Under a window row r sees keys > pos0 + r - window: the tiles before the first row's window start
  // are skipped (0 .. first_tile - 1), the rest masked per row.
  std::int64_t const key_lo = p.window > 0 && pos0 - p.window + 1 > 0 ? pos0 - p.window + 1 : 0;
  int const first_tile = key_lo < num_keys ? static_cast<int>(key_lo / C::kBlockN) : num_tiles;

  T const* q = static_cast<T const*>(p.q) + static_cast<std::int64_t>(head) * kHeadDim;
  std::int64_t const half_rows = p.num_blocks * p.tokens_per_block * p.num_kv_heads;  // (slot, kv head) rows
  [[maybe_unused]] T const* k_cache = static_cast<T const*>(p.kv_cache);
  [[maybe_unused]] T const* v_cache = k_cache + half_rows * kHeadDim;
  [[maybe_unused]] std::int8_t const* k_codes = static_cast<std::int8_t const*>(p.kv_cache);
  [[maybe_unused]] std::int8_t const* v_codes = k_codes + half_rows * kHeadDim;
  [[maybe_unused]] float const* k_scales = p.kv_scales;
  [[maybe_unused]] float const* v_scales = kInt8 ? p.kv_scales + half_rows : nullptr;
  int const* table = p.block_tables + seq * p.block_table_stride;
  int const chunk = tid % C::kChunks;  // this thread's 16-byte column in every row it copies

  // Query rows past the sequence's end are zero-filled, never read.
  for (int r = tid / C::kChunks; r < C::kBlockM; r += C::kThreads / C::kChunks) {
    bool const valid = r < rows_here;
    T const* src = valid ? q + (q_start + m0 + r) * p.q_token_stride + chunk * 8 : q;
    cp_async_16(s_q + r * C::kRowElems + chunk * 8, src, valid);
  }

  auto load_tile = [&](int kv_tile, int stage) {
    T* s_k = s_kv + (2 * stage) * C::kTileElems;
    T* s_v = s_k + C::kTileElems;
    for (int r = tid / C::kChunks; r < C::kBlockN; r += C::kThreads / C::kChunks) {
      int const key = kv_tile * C::kBlockN + r;
      std::int64_t offset = -1;
      if (key >= key_lo && key < num_keys) {
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

  if (first_tile < num_tiles) load_tile(first_tile, 0);
  cp_async_commit();

  std::uint32_t q_frag[kHeadDim / 16][4];
  float o[kHeadDim / 8][4];
#pragma unroll
  for (int i = 0; i < kHeadDim / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // running max (log2 units) of rows g and g + 8 of this warp
  float l[2] = {0.f, 0.f};              // this lane's part of the running sums
  float const scale_log2 = p.scale * kLog2e;
  // Positions of this lane's two rows.
  std::int64_t const row_pos[2] = {pos0 + warp * 16 + g, pos0 + warp * 16 + g + 8};
  // Keys at or before these are outside the rows' windows (-1: no window).
  std::int64_t const row_lo[2] = {p.window > 0 ? row_pos[0] - p.window : -1, p.window > 0 ? row_pos[1] - p.window : -1};

  for (int n = first_tile; n < num_tiles; ++n) {
    int const stage = (n - first_tile) & 1;
    // Prefetch tile n + 1 into the other stage (free: the previous iteration ended with a barrier).
    if (n + 1 < num_tiles) load_tile(n + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    if (n == first_tile) {
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        ldmatrix_x4(q_frag[kk], s_q + (warp * 16 + (mi & 1) * 8 + (lane & 7)) * C::kRowElems + kk * 16 + (mi >> 1) * 8);
      }
    }
    T const* s_k = s_kv + (2 * stage) * C::kTileElems;
    T const* s_v = s_k + C::kTileElems;

    // S = Q K^T: 16 rows x 64 keys per warp, eight 8-key column tiles.
    float s[C::kBlockN / 8][4];
#pragma unroll
    for (int j = 0; j < C::kBlockN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < C::kBlockN / 16; ++nn) {
        std::uint32_t b[4];
        ldmatrix_x4(b, s_k + (nn * 16 + (mi >> 1) * 8 + (lane & 7)) * C::kRowElems + kk * 16 + (mi & 1) * 8);
        mma_16816<T>(s[2 * nn], q_frag[kk], b[0], b[1]);
        mma_16816<T>(s[2 * nn + 1], q_frag[kk], b[2], b[3]);
      }
    }

    // Causal, window and length mask, then the online softmax update of both rows.
    int const key_base = n * C::kBlockN + 2 * t;
#pragma unroll
    for (int j = 0; j < C::kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int const key = key_base + j * 8 + (e & 1);
        bool const visible = key < kv_len && key <= row_pos[e >> 1] && key > row_lo[e >> 1];
        s[j][e] = visible ? s[j][e] * scale_log2 : -INFINITY;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < C::kBlockN / 8; ++j) tile_max = fmaxf(tile_max, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      tile_max = quad_max(tile_max);
      float const m_new = fmaxf(m[r], tile_max);
      float const m_use = m_new == -INFINITY ? 0.f : m_new;  // no visible key yet: avoid (-inf) - (-inf)
      float const alpha = exp2f(m[r] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < C::kBlockN / 8; ++j) {
        s[j][2 * r] = exp2f(s[j][2 * r] - m_use);
        s[j][2 * r + 1] = exp2f(s[j][2 * r + 1] - m_use);
        sum += s[j][2 * r] + s[j][2 * r + 1];
      }
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
#pragma unroll
      for (int d = 0; d < kHeadDim / 8; ++d) {
        o[d][2 * r] *= alpha;
        o[d][2 * r + 1] *= alpha;
      }
    }

    // O += P V, 16 keys per k-step: the accumulators of column tiles 2kk and 2kk+1 form the A fragment.
#pragma unroll
    for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
      std::uint32_t const a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                  pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dd = 0; dd < kHeadDim / 16; ++dd) {
        std::uint32_t b[4];
        ldmatrix_x4_trans(b, s_v + (kk * 16 + (mi & 1) * 8 + (lane & 7)) * C::kRowElems + dd * 16 + (mi >> 1) * 8);
        mma_16816<T>(o[2 * dd], a, b[0], b[1]);
        mma_16816<T>(o[2 * dd + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  // With no key tile the Q copies above were never waited on by a barrier; make them land before the
  // staging area (this warp's Q rows) is overwritten.
  __syncthreads();

  // Normalise, stage this warp's 16 rows in its own Q rows, then write them with 16-byte stores.
  T* s_out = s_q + warp * 16 * C::kRowElems;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float const lr = quad_sum(l[r]);
    float const inv = lr > 0.f ? 1.f / lr : 0.f;
#pragma unroll
    for (int d = 0; d < kHeadDim / 8; ++d) {
      *reinterpret_cast<std::uint32_t*>(s_out + (g + 8 * r) * C::kRowElems + d * 8 + 2 * t) =
          pack2<T>(o[d][2 * r] * inv, o[d][2 * r + 1] * inv);
    }
  }
  __syncwarp();
  T* out = static_cast<T*>(p.out) + static_cast<std::int64_t>(head) * kHeadDim;
  std::int64_t const out_stride = static_cast<std::int64_t>(p.num_heads) * kHeadDim;
  for (int i = lane; i < 16 * C::kChunks; i += 32) {
    int const r = i / C::kChunks;
    int const c = i % C::kChunks;
    int const row = warp * 16 + r;
    if (row < rows_here) {
      *reinterpret_cast<uint4*>(out + (q_start + m0 + row) * out_stride + c * 8) =
          *reinterpret_cast<uint4 const*>(s_out + r * C::kRowElems + c * 8);
    }
  }
}

template <typename T, int kHeadDim, KvKind kKv>
cudaError_t launch_prefill(ContextAttentionParams const& p, cudaStream_t stream) {
  using C = PrefillConfig<T, kHeadDim>;
  // Upper bound on sum_i ceil(q_len_i / kBlockM) for q_len_i summing to num_tokens.
  std::int64_t const tiles = (p.num_tokens + C::kBlockM - 1) / C::kBlockM + p.batch_size;
  if (tiles > 0x7fffffff || p.num_heads > 65535) return cudaErrorInvalidValue;
  auto kernel = context_attention_kernel<T, kHeadDim, kKv>;
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  if (status != cudaSuccess) return status;
  dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(p.num_heads));
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_context_attention(ContextAttentionParams const& params, cudaStream_t stream) {
  if (params.num_tokens == 0 || params.batch_size == 0 || params.num_heads == 0) return cudaSuccess;
  if (params.num_kv_heads <= 0 || params.num_heads % params.num_kv_heads != 0) return cudaErrorInvalidValue;
  if (params.cu_seqlens == nullptr) return cudaErrorInvalidValue;
  KvKind kind = KvKind::kSame;
  if (!kv_kind_of(params.dtype, params.kv_dtype, params.kv_scales, kind)) return cudaErrorInvalidValue;
  if (params.dtype == ScalarType::kFloat32) return launch_attention_simt(params, stream);
  return HALF_TYPE_SWITCH(params.dtype, T, [&] {
    return HEAD_DIM_SWITCH(params.head_dim, kHeadDim, [&] {
      return KV_KIND_SWITCH(kind, kKv, [&] { return launch_prefill<T, kHeadDim, kKv>(params, stream); });
    });
  });
}

cudaError_t launch_context_attention_simt(ContextAttentionParams const& params, cudaStream_t stream) {
  if (params.cu_seqlens == nullptr) return cudaErrorInvalidValue;
  return launch_attention_simt(params, stream);
}

}  // namespace inflight::kernels::cuda
