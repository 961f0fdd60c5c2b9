// Device helpers shared by the kernels: element conversions, warp reductions, cp.async, ldmatrix and
// the m16n8k16 tensor-core MMA. Everything here needs sm_80 or newer (cp.async, bf16 MMA), which is
// the oldest architecture the package is built for.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace inflight::kernels::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

// ------------------------------------------------------------------------------- conversions

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ half from_float<half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two floats as one 32-bit register of two 16-bit elements, `lo` in the low half (the element with
// the smaller index, as the MMA fragments expect). T: half or __nv_bfloat16.
template <typename T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ std::uint32_t pack2<half>(float lo, float hi) {
  half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<std::uint32_t*>(&h);
}
template <>
__device__ __forceinline__ std::uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<std::uint32_t*>(&h);
}

// ------------------------------------------------------------------------------- warp reductions

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Reductions over the 4 lanes of an MMA "quad" (lanes 4g .. 4g+3 hold one accumulator row).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(kFullMask, v, 1);
  v += __shfl_xor_sync(kFullMask, v, 2);
  return v;
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 1));
  v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 2));
  return v;
}

// ------------------------------------------------------------------------------- memory

__device__ __forceinline__ std::uint32_t smem_addr(void const* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous global -> shared copy. With `pred` false nothing is read and the 16 bytes are
// zero-filled (src-size 0); `src` must still be a valid address, so callers pass a tensor base there.
__device__ __forceinline__ void cp_async_16(void* smem_dst, void const* gmem_src, bool pred) {
  int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem_dst)), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Streaming 16-byte load that skips L1 (weights read once); read-only data only.
__device__ __forceinline__ uint4 ld_stream_16(void const* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// ------------------------------------------------------------------------------- tensor cores

// Four 8x8 matrices of 16-bit elements from shared memory; lanes 8i..8i+7 give the row addresses of
// matrix i, and r[i] receives, in each lane l, row l/4, columns 2(l%4) and 2(l%4)+1 of matrix i.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], void const* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}

// As ldmatrix_x4, transposed: lane l receives rows 2(l%4) and 2(l%4)+1 of column l/4.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], void const* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}

// d += a * b with a 16x16 (row-major), b 16x8 (column-major), fp32 accumulators.
// Fragments (g = lane/4, t = lane%4): a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..],
// a[3] = A[g+8][2t+8..]; b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g];
// d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..2t+1]. T: half or __nv_bfloat16.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], std::uint32_t const (&a)[4], std::uint32_t b0,
                                          std::uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<half>(float (&d)[4], std::uint32_t const (&a)[4], std::uint32_t b0,
                                                std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], std::uint32_t const (&a)[4], std::uint32_t b0,
                                                         std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ------------------------------------------------------------------------------- bit tricks

// (a & b) | c in one instruction.
__device__ __forceinline__ std::uint32_t lop3_and_or(std::uint32_t a, std::uint32_t b, std::uint32_t c) {
  std::uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

__device__ __forceinline__ std::uint32_t prmt(std::uint32_t a, std::uint32_t b, std::uint32_t selector) {
  return __byte_perm(a, b, selector);
}

}  // namespace inflight::kernels::cuda
