// The kernel shared by w4a16_gemm and w8a16_gemm (see w4a16_gemm.h for the scheme), parametrised by a
// weight format: Int4Format or Int8Format below.
//
// MMA m16n8k16 with A = 16 weight rows x 16 k and B = 16 k x 8 batch rows. A lane (g = lane/4,
// t = lane%4) holds, per k-step, A[g][2t,2t+1], A[g+8][2t,2t+1], A[g][2t+8,2t+9], A[g+8][2t+8,2t+9] and
// B[2t,2t+1][g], B[2t+8,2t+9][g]. Those "logical" k indices are mapped to physical k inside the
// 16-byte weight chunk the lane loaded itself (lane t of a quad loads chunk t of the quad's slice), and
// x is read in the same order, so A and B always agree on which physical k each product uses.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "device_utils.cuh"
#include "inflight/kernels/scalar_type.h"
#include "static_switch.h"

namespace inflight::kernels::cuda {

struct WeightOnlyGemmArgs {
  void const* x;
  std::int64_t x_row_stride;
  std::uint8_t const* qweight;
  std::int64_t qweight_row_bytes;
  void const* scales;
  void const* offsets;    // null: symmetric
  ScalarType scale_type;  // of scales and offsets
  void const* bias;       // [n] of the output type, or null
  void* out;
  std::int64_t out_row_stride;
  int m, n, k, group_size;
};

// 16-bit element pairs: T2 and the conversions the formats need. T: half or __nv_bfloat16.
template <typename T>
struct Half2Ops;

template <>
struct Half2Ops<half> {
  using T2 = half2;
  static constexpr std::uint32_t kMagic = 0x64006400u;  // 1024.0 in both halves: 1024 + n is exact
  __device__ static T2 splat(half v) { return __half2half2(v); }
};

template <>
struct Half2Ops<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static constexpr std::uint32_t kMagic = 0x43004300u;  // 128.0 in both halves: 128 + n is exact
  __device__ static T2 splat(__nv_bfloat16 v) { return __bfloat162bfloat162(v); }
};

// One scale or offset, rounded to T. The dtype is uniform over the grid, so the branch costs nothing.
template <typename T>
__device__ __forceinline__ T load_group_param(void const* base, std::int64_t i, ScalarType type) {
  switch (type) {
    case ScalarType::kFloat16:
      return from_float<T>(__half2float(static_cast<half const*>(base)[i]));
    case ScalarType::kBFloat16:
      return from_float<T>(__bfloat162float(static_cast<__nv_bfloat16 const*>(base)[i]));
    default:
      break;  // float32
  }
  return from_float<T>(static_cast<float const*>(base)[i]);
}

template <typename T2>
__device__ __forceinline__ T2 as_t2(std::uint32_t bits) {
  return *reinterpret_cast<T2*>(&bits);
}
template <typename T2>
__device__ __forceinline__ std::uint32_t as_bits(T2 v) {
  return *reinterpret_cast<std::uint32_t*>(&v);
}

// 4-bit weights: a 16-byte chunk is 32 consecutive k (word w: k 8w .. 8w+7, nibble i = k 8w+i), eight
// k-steps. k-step 2w pairs nibbles (0,4) and (1,5) of word w, k-step 2w+1 pairs (2,6) and (3,7): those
// are the pairs one AND-OR with the 0x000f000f mask extracts from the word shifted by 0, 4, 8 and 12.
struct Int4Format {
  static constexpr int kKPerChunk = 32;
  static constexpr int kKSteps = 8;
  static constexpr int kXVecs = 4;  // 16-byte vectors of x per chunk and batch row
  static constexpr int kMinGroup = 32;
  static constexpr int kKPerByte = 2;

  // Dequantised pairs for k-step `s` of one weight row: lo = A[row][2t,2t+1], hi = A[row][2t+8,2t+9].
  template <typename T, bool kAsym>
  __device__ static void a_pairs(uint4 const& w, int s, typename Half2Ops<T>::T2 scale, typename Half2Ops<T>::T2 offset,
                                 std::uint32_t& lo, std::uint32_t& hi) {
    using T2 = typename Half2Ops<T>::T2;
    std::uint32_t const word = (&w.x)[s / 2];
    int const shift = (s % 2) * 8;  // k-step 2w: shifts 0 and 4; 2w+1: shifts 8 and 12
    // magic + q is exact; subtracting magic (+ 8 when symmetric) leaves q or q - 8 exactly, so the
    // only rounding is the final multiply-add, as in a float reference.
    // In both formats one unit of q is one unit of the mantissa's last place, so +8 is +0x0008.
    constexpr std::uint32_t kBias = Half2Ops<T>::kMagic + (kAsym ? 0u : 0x00080008u);
    T2 const bias = as_t2<T2>(kBias);
    T2 const q_lo = __hsub2(as_t2<T2>(lop3_and_or(word >> shift, 0x000f000fu, Half2Ops<T>::kMagic)), bias);
    T2 const q_hi = __hsub2(as_t2<T2>(lop3_and_or(word >> (shift + 4), 0x000f000fu, Half2Ops<T>::kMagic)), bias);
    if constexpr (kAsym) {
      lo = as_bits(__hfma2(q_lo, scale, offset));
      hi = as_bits(__hfma2(q_hi, scale, offset));
    } else {
      lo = as_bits(__hmul2(q_lo, scale));
      hi = as_bits(__hmul2(q_hi, scale));
    }
  }

  // B fragment for k-step `s` from the lane's 32 x values (xr[i] = x[2i], x[2i+1]).
  __device__ static void b_frag(std::uint32_t const (&xr)[16], int s, std::uint32_t& b0, std::uint32_t& b1) {
    int const base = (s / 2) * 4 + (s % 2);     // word w: registers 4w .. 4w+3 hold x[8w .. 8w+7]
    b0 = prmt(xr[base], xr[base + 2], 0x5410);  // (x[8w + j], x[8w + 4 + j]), j = 0 or 2
    b1 = prmt(xr[base], xr[base + 2], 0x7632);  // (x[8w + j + 1], x[8w + 5 + j])
  }
};

// 8-bit weights: a 16-byte chunk is 16 consecutive k (word w: k 4w .. 4w+3), four k-steps; k-step w
// pairs bytes (0,2) and (1,3) of word w.
struct Int8Format {
  static constexpr int kKPerChunk = 16;
  static constexpr int kKSteps = 4;
  static constexpr int kXVecs = 2;
  static constexpr int kMinGroup = 16;
  static constexpr int kKPerByte = 1;

  template <typename T>
  __device__ static void bytes_to_pairs(std::uint32_t word, std::uint32_t& p02, std::uint32_t& p13) {
    std::uint32_t const u = word ^ 0x80808080u;  // int8 b -> uint8 b + 128
    if constexpr (std::is_same_v<T, half>) {
      // half: 0x64XX = 1024 + XX exactly; subtract 1024 + 128.
      half2 const bias = as_t2<half2>(0x64806480u);
      p02 = as_bits(__hsub2(as_t2<half2>(prmt(u, 0x64646464u, 0x4240)), bias));
      p13 = as_bits(__hsub2(as_t2<half2>(prmt(u, 0x64646464u, 0x4341)), bias));
    } else {
      // bfloat16 cannot hold 128 + 255 exactly: go through float (0x4B0000XX = 2^23 + XX).
      auto byte_to_float = [](std::uint32_t v, std::uint32_t selector) {
        return __uint_as_float(prmt(v, 0x4B000000u, selector)) - 8388736.f;  // 2^23 + 128
      };
      p02 = as_bits(__floats2bfloat162_rn(byte_to_float(u, 0x7440), byte_to_float(u, 0x7442)));
      p13 = as_bits(__floats2bfloat162_rn(byte_to_float(u, 0x7441), byte_to_float(u, 0x7443)));
    }
  }

  template <typename T, bool kAsym>
  __device__ static void a_pairs(uint4 const& w, int s, typename Half2Ops<T>::T2 scale,
                                 typename Half2Ops<T>::T2 /*offset*/, std::uint32_t& lo, std::uint32_t& hi) {
    using T2 = typename Half2Ops<T>::T2;
    static_assert(!kAsym, "int8 weights are symmetric");
    std::uint32_t p02, p13;
    bytes_to_pairs<T>((&w.x)[s], p02, p13);
    lo = as_bits(__hmul2(as_t2<T2>(p02), scale));
    hi = as_bits(__hmul2(as_t2<T2>(p13), scale));
  }

  __device__ static void b_frag(std::uint32_t const (&xr)[8], int s, std::uint32_t& b0, std::uint32_t& b1) {
    b0 = prmt(xr[2 * s], xr[2 * s + 1], 0x5410);  // (x[4s], x[4s + 2])
    b1 = prmt(xr[2 * s], xr[2 * s + 1], 0x7632);  // (x[4s + 1], x[4s + 3])
  }
};

// OCP FP8 E4M3 (e4m3fn) weights in the int8 layout (an FP8 checkpoint's): the same chunks, k-steps and B
// fragments; each byte's sign, exponent and mantissa moved into fp16's fields is the value times 2^-8
// (subnormals included), so one exact multiply by 256 gives it; bfloat16 goes through float (exact: E4M3
// has 3 mantissa bits).
struct Fp8Format : Int8Format {
  template <typename T>
  __device__ static void bytes_to_pairs(std::uint32_t word, std::uint32_t& p02, std::uint32_t& p13) {
    auto to_half2 = [](std::uint32_t b) {  // two bytes, zero-extended to 16 bits each
      std::uint32_t const h = ((b & 0x007f007fu) << 7) | ((b & 0x00800080u) << 8);
      return __hmul2(as_t2<half2>(h), as_t2<half2>(0x5c005c00u));  // x 256
    };
    half2 const h02 = to_half2(prmt(word, 0u, 0x4240));
    half2 const h13 = to_half2(prmt(word, 0u, 0x4341));
    if constexpr (std::is_same_v<T, half>) {
      p02 = as_bits(h02);
      p13 = as_bits(h13);
    } else {
      p02 = as_bits(__float22bfloat162_rn(__half22float2(h02)));
      p13 = as_bits(__float22bfloat162_rn(__half22float2(h13)));
    }
  }

  template <typename T, bool kAsym>
  __device__ static void a_pairs(uint4 const& w, int s, typename Half2Ops<T>::T2 scale,
                                 typename Half2Ops<T>::T2 /*offset*/, std::uint32_t& lo, std::uint32_t& hi) {
    using T2 = typename Half2Ops<T>::T2;
    static_assert(!kAsym, "fp8 weights are symmetric");
    std::uint32_t p02, p13;
    bytes_to_pairs<T>((&w.x)[s], p02, p13);
    lo = as_bits(__hmul2(as_t2<T2>(p02), scale));
    hi = as_bits(__hmul2(as_t2<T2>(p13), scale));
  }
};

constexpr int kWogBatchPerCta = 16;  // batch rows per grid row (blockIdx.y)

// CTA shape per batch tile count. Batches of at most 8 (kNTiles 1) barely reuse x, so CTAs are small
// (16 weight rows, 4 warps over K): many CTAs, an even spread over the multiprocessors. Larger batches
// (kNTiles 2) read 16 rows of x per k, so each warp owns 32 weight rows and a CTA 8 warps, halving the
// traffic of x per weight byte.
template <int kNTiles>
struct WogShape {
  static constexpr int kMTiles = kNTiles == 1 ? 1 : 2;  // 16-row weight tiles per warp
  static constexpr int kWarps = kNTiles == 1 ? 4 : 8;   // all splitting K
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerCta = 16 * kMTiles;
};

// T: half or __nv_bfloat16. Format: Int4Format or Int8Format. kAsym: offsets present (int4 only).
// kNTiles: 8-row batch tiles computed (1 when at most 8 batch rows remain, else 2).
template <typename T, typename Format, bool kAsym, int kNTiles>
__global__ void __launch_bounds__(WogShape<kNTiles>::kThreads) weight_only_gemm_kernel(WeightOnlyGemmArgs a) {
  using T2 = typename Half2Ops<T>::T2;
  constexpr int kMTiles = WogShape<kNTiles>::kMTiles;
  constexpr int kWarps = WogShape<kNTiles>::kWarps;
  constexpr int kThreads = WogShape<kNTiles>::kThreads;
  constexpr int kRowsPerCta = WogShape<kNTiles>::kRowsPerCta;
  constexpr int kXRegs = Format::kXVecs * 4;
  constexpr int kKPerIter = 4 * Format::kKPerChunk;  // one quad covers this many k per iteration

  struct Chunk {
    uint4 w[kMTiles][2];  // rows g and g + 8 of each m-tile
    T2 scale[kMTiles][2];
    T2 offset[kMTiles][2];
    std::uint32_t x[kNTiles][kXRegs];
  };

  int const warp = threadIdx.x / 32;
  int const lane = threadIdx.x % 32;
  int const g = lane / 4;
  int const t = lane % 4;
  int const row0 = blockIdx.x * kRowsPerCta;
  int const batch0 = blockIdx.y * kWogBatchPerCta;
  int const num_groups = a.k / a.group_size;
  T const* x = static_cast<T const*>(a.x);

  auto load = [&](int iter, Chunk& c) {
    int const kb = iter * kKPerIter + t * Format::kKPerChunk;
    bool const k_ok = kb < a.k;
    int const group = k_ok ? kb / a.group_size : 0;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int const row = row0 + mt * 16 + g + 8 * h;
        bool const ok = k_ok && row < a.n;
        // Bytes per k: 1/2 (int4) or 1 (int8), i.e. 16 bytes per kKPerChunk k.
        c.w[mt][h] = ok ? ld_stream_16(a.qweight + row * a.qweight_row_bytes +
                                       static_cast<std::int64_t>(kb) * 16 / Format::kKPerChunk)
                        : make_uint4(0u, 0u, 0u, 0u);
        T const zero = from_float<T>(0.f);
        std::int64_t const at = static_cast<std::int64_t>(row) * num_groups + group;
        T const s = ok ? load_group_param<T>(a.scales, at, a.scale_type) : zero;
        c.scale[mt][h] = Half2Ops<T>::splat(s);
        if constexpr (kAsym) {
          T const o = ok ? load_group_param<T>(a.offsets, at, a.scale_type) : zero;
          c.offset[mt][h] = Half2Ops<T>::splat(o);
        } else {
          c.offset[mt][h] = Half2Ops<T>::splat(zero);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      int const b = batch0 + nt * 8 + g;
      bool const ok = k_ok && b < a.m;
      uint4 const* src = reinterpret_cast<uint4 const*>(ok ? x + b * a.x_row_stride + kb : x);
#pragma unroll
      for (int v = 0; v < Format::kXVecs; ++v) {
        uint4 const val = ok ? __ldg(src + v) : make_uint4(0u, 0u, 0u, 0u);
        c.x[nt][4 * v + 0] = val.x;
        c.x[nt][4 * v + 1] = val.y;
        c.x[nt][4 * v + 2] = val.z;
        c.x[nt][4 * v + 3] = val.w;
      }
    }
  };

  float acc[kMTiles][kNTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
  }

  int const num_iters = (a.k + kKPerIter - 1) / kKPerIter;
  // Register double buffering: the loads of the warp's next slice are in flight while this one is
  // dequantised and multiplied.
  Chunk cur, next;
  if (warp < num_iters) load(warp, cur);
  for (int iter = warp; iter < num_iters; iter += kWarps) {
    if (iter + kWarps < num_iters) load(iter + kWarps, next);
#pragma unroll
    for (int s = 0; s < Format::kKSteps; ++s) {
      std::uint32_t b[kNTiles][2];
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) Format::b_frag(cur.x[nt], s, b[nt][0], b[nt][1]);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        std::uint32_t frag[4];
        Format::template a_pairs<T, kAsym>(cur.w[mt][0], s, cur.scale[mt][0], cur.offset[mt][0], frag[0], frag[2]);
        Format::template a_pairs<T, kAsym>(cur.w[mt][1], s, cur.scale[mt][1], cur.offset[mt][1], frag[1], frag[3]);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) mma_16816<T>(acc[mt][nt], frag, b[nt][0], b[nt][1]);
      }
    }
    cur = next;
  }

  // Reduce the warps' partial sums: red[warp][slot][lane], slot = (mt * kNTiles + nt) * 4 + e.
  constexpr int kSlots = kMTiles * kNTiles * 4;
  __shared__ float red[kWarps][kSlots][32];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) red[warp][(mt * kNTiles + nt) * 4 + e][lane] = acc[mt][nt][e];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kSlots * 32; i += kThreads) {
    int const slot = i / 32;
    int const l = i % 32;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[w][slot][l];
    int const e = slot % 4;
    int const nt = (slot / 4) % kNTiles;
    int const mt = slot / (4 * kNTiles);
    // D[i][j] = out[batch j][weight row i]: i = g (+8 for e >= 2), j = 2t (+1 for odd e).
    int const row = row0 + mt * 16 + l / 4 + 8 * (e / 2);
    int const b = batch0 + nt * 8 + 2 * (l % 4) + (e % 2);
    if (row < a.n && b < a.m) {
      if (a.bias != nullptr) sum += to_float(static_cast<T const*>(a.bias)[row]);
      static_cast<T*>(a.out)[b * a.out_row_stride + row] = from_float<T>(sum);
    }
  }
}

template <typename T, typename Format, bool kAsym>
cudaError_t launch_weight_only_gemm(WeightOnlyGemmArgs const& a, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return cudaSuccess;
  std::int64_t const grid_y = (static_cast<std::int64_t>(a.m) + kWogBatchPerCta - 1) / kWogBatchPerCta;
  if (grid_y > 65535) return cudaErrorInvalidValue;
  auto launch = [&](auto n_tiles) {
    constexpr int kNTiles = decltype(n_tiles)::value;
    using Shape = WogShape<kNTiles>;
    dim3 grid(static_cast<unsigned>((a.n + Shape::kRowsPerCta - 1) / Shape::kRowsPerCta),
              static_cast<unsigned>(grid_y));
    weight_only_gemm_kernel<T, Format, kAsym, kNTiles><<<grid, Shape::kThreads, 0, stream>>>(a);
    return cudaGetLastError();
  };
  return a.m <= 8 ? launch(std::integral_constant<int, 1>{}) : launch(std::integral_constant<int, 2>{});
}

// The launcher of both ops: their params share the field names. kOffsets: Params has offsets (the
// int4 op); the kernel is then instantiated for both symmetric and asymmetric weights.
template <typename Format, bool kOffsets, typename Params>
cudaError_t launch_weight_only_op(Params const& p, cudaStream_t stream) {
  constexpr std::int64_t kIntMax = 0x7fffffff;
  if (p.group_size <= 0 || p.group_size % Format::kMinGroup != 0 || p.k % p.group_size != 0) {
    return cudaErrorInvalidValue;
  }
  if (p.m < 0 || p.n < 0 || p.k < 0 || p.m > kIntMax || p.n > kIntMax || p.k > kIntMax) return cudaErrorInvalidValue;
  WeightOnlyGemmArgs a{};
  a.x = p.x;
  a.x_row_stride = p.x_row_stride;
  a.qweight = reinterpret_cast<std::uint8_t const*>(p.qweight);
  a.qweight_row_bytes = p.k / Format::kKPerByte;
  a.scales = p.scales;
  if constexpr (kOffsets) a.offsets = p.offsets;
  a.scale_type = p.scale_type;
  a.bias = p.bias;
  a.out = p.out;
  a.out_row_stride = p.out_row_stride;
  a.m = static_cast<int>(p.m);
  a.n = static_cast<int>(p.n);
  a.k = static_cast<int>(p.k);
  a.group_size = p.group_size;
  return HALF_TYPE_SWITCH(p.dtype, T, [&] {
    if constexpr (kOffsets) {
      return BOOL_SWITCH(a.offsets != nullptr, kAsym,
                         [&] { return launch_weight_only_gemm<T, Format, kAsym>(a, stream); });
    } else {
      return launch_weight_only_gemm<T, Format, false>(a, stream);
    }
  });
}

}  // namespace inflight::kernels::cuda
