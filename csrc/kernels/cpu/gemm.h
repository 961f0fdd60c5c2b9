// Weight-only-quantised GEMM on the CPU: out[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias).
//
// Weights are dequantised in registers, a few vectors at a time; no full-size weight is ever written.
// Decode (M = 1..16) is memory-bound: every weight byte is read from memory once per call, threads
// split N, and each dequantised weight vector is reused across a tile of M rows (the M tiles of one
// N chunk re-read the chunk from L2, not from memory).
//
// Formats (the canonical interchange layout; the CUDA kernels read the same):
//   int4:  qweight [N, K/2] uint8; byte j of a row holds k = 2j in its low nibble and k = 2j+1 in its
//          high nibble. scales [N, K/group_size]. Asymmetric: offsets [N, K/group_size],
//          w = scale * q + offset (a value-space offset: GGUF Q4_1 stores its minimum that way).
//          Symmetric (offsets == nullptr): w = scale * (q - 8) (GGUF Q4_0).
//   int8:  qweight [N, K] int8, scales [N, K/group_size], w = scale * q (GGUF Q8_0: group 32).
//   fp8:   the int8 layout holding OCP FP8 E4M3 (e4m3fn) bytes instead (fp8_e4m3 set): w = scale * fp8(q),
//          fp8(q) converted exactly in registers (FP8 checkpoints: per-tensor or 128 x 128 block scales).
// x, out and bias share one dtype (fp32, bf16 or fp16); scales and offsets share another, scale_type
// (fp32, bf16, fp16). Products and sums are fp32; out is rounded once, to nearest even. group_size is
// 32, 64 or 128; int8 also takes 16 (GGUF Q6_K's sub-blocks).
//
// Kernels follow the params struct + launcher + compile-time dispatch pattern: the launcher,
// launch_<op>(params, pool), validates the struct and picks the ISA (cpu_features.h); the pool is a
// parameter, as the stream of the CUDA launchers; each ISA file instantiates its micro-kernels for the
// explicit set {dtype: f32, bf16, f16} x {scale_type: f32, bf16, f16} x {symmetric, asymmetric} x
// {M tile}.
//
// Where the code is (the dense GEMM, dense_gemm.h, shares all of it):
//   gemm.h, gemm.cpp       params, launchers, and the ISA-neutral driver (threads, tiles, addressing)
//   gemm_portable.cpp      the portable path: one row-by-row algorithm for int4, int8 and dense weights
//   gemm_impl.h            the FMA algorithms written once over vector traits (W4Fma, W8Fma, DenseTile,
//                          the epilogue), instantiated by gemm_avx2.cpp (Vec256) and the AVX-512 files
//   gemm_fma_panel_impl.h  FmaPanel: gemm_impl.h's W8Fma / W4Fma with each weight dequantised once per
//                          panel of weight rows (the same bits), for the AVX-512 files
//   gemm_avx512.h          Vec512 and the AVX-512-only strategies, one file each (listed there)
//   gemm_avx512f.cpp       AVX-512 without BF16: Vec512, the tiled strategy (gemm_tiled_impl.h) and
//                          gemm_impl.h's kernels, in namespace gemm_avx512f
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <type_traits>
#include <vector>

#include "cpu_features.h"
#include "inflight/kernels/scalar_type.h"
#include "thread_pool.h"

namespace inflight::kernels::cpu {

// The fields and names of the CUDA op's params (kernels/cuda/w4a16_gemm.h, w8a16_gemm.h); the CPU reads
// x and out contiguous (the CUDA op takes row strides) and has num_threads.
struct W4A16GemmParams {
  void const* x = nullptr;                // [m, k], dtype, row-major contiguous
  std::uint8_t const* qweight = nullptr;  // [n, k / 2]
  void const* scales = nullptr;           // [n, k / group_size], scale_type
  void const* offsets = nullptr;          // [n, k / group_size], scale_type; nullptr: symmetric
  ScalarType scale_type = ScalarType::kFloat32;
  void const* bias = nullptr;  // [n], dtype; nullptr: none
  void* out = nullptr;         // [m, n], dtype, row-major contiguous
  std::int64_t m = 0, n = 0, k = 0;
  int group_size = 0;
  ScalarType dtype = ScalarType::kFloat32;  // of x, bias and out
  int num_threads = 1;                      // CPU only: at most this many of the pool's threads
};

struct W8A16GemmParams {
  void const* x = nullptr;               // [m, k], dtype, row-major contiguous
  std::int8_t const* qweight = nullptr;  // [n, k]: int8, or E4M3 bytes when fp8_e4m3
  bool fp8_e4m3 = false;
  void const* scales = nullptr;  // [n, k / group_size], scale_type
  ScalarType scale_type = ScalarType::kFloat32;
  void const* bias = nullptr;  // [n], dtype; nullptr: none
  void* out = nullptr;         // [m, n], dtype, row-major contiguous
  std::int64_t m = 0, n = 0, k = 0;
  int group_size = 0;
  ScalarType dtype = ScalarType::kFloat32;  // of x, bias and out
  int num_threads = 1;                      // CPU only: at most this many of the pool's threads
};

// Launchers: validate the params (std::invalid_argument naming the field, value and allowed range),
// then run the path of selected_isa() on up to p.num_threads threads of `pool`. Nothing is
// allocated; `out` is fully overwritten.
void launch_w4a16_gemm(W4A16GemmParams const& p, ThreadPool& pool);
void launch_w8a16_gemm(W8A16GemmParams const& p, ThreadPool& pool);

// Per-ISA paths (gemm_portable.cpp, gemm_avx2.cpp, gemm_avx512.cpp); only the launchers call them.
void w4a16_gemm_portable(W4A16GemmParams const& p, ThreadPool& pool);
void w8a16_gemm_portable(W8A16GemmParams const& p, ThreadPool& pool);
void w4a16_gemm_avx2(W4A16GemmParams const& p, ThreadPool& pool);
void w8a16_gemm_avx2(W8A16GemmParams const& p, ThreadPool& pool);
void w4a16_gemm_avx512(W4A16GemmParams const& p, ThreadPool& pool);
void w8a16_gemm_avx512(W8A16GemmParams const& p, ThreadPool& pool);
void w4a16_gemm_avx512f(W4A16GemmParams const& p, ThreadPool& pool);  // gemm_avx512f.cpp (no BF16)
void w8a16_gemm_avx512f(W8A16GemmParams const& p, ThreadPool& pool);

// ------------------------------------------------------------------------------------------------
// Shared by the ISA files: the ISA-neutral driver (threads, tiles, M-tile dispatch) and the tile
// addressing. Everything below has internal linkage (anonymous namespace): each ISA file is compiled
// with its own -m flags, and a shared inline definition could otherwise be merged by the linker into
// the AVX-512 copy and then run on a CPU without AVX-512 (as in scalar_type.h). The algorithms written
// once over a vector-traits class are in gemm_impl.h (per-ISA namespaces, for the same reason).
namespace gemm_detail {
namespace {

// Below this many weight bytes per call one thread does it all: the fork/join would cost more.
constexpr std::int64_t kMinBytesPerThread = 16 * 1024;
// When M needs several M tiles, an N chunk's weights stay in L2 (1-2 MiB per core) while every M
// tile walks over them.
constexpr std::int64_t kChunkBytes = 512 * 1024;

// Runs the kernel over the whole [m, n] output. Kernel provides:
//   kNR     rows of N per tile (the last tile may be partial: the kernel clamps and does not store),
//   kMaxMR  rows of M per tile (the last M tile may be smaller),
//   tile(int mr, int64_t m0, int64_t n0[, void const* scratch]) const,
// and optionally max_mr() const (<= kMaxMR, e.g. depending on k or m), and (kernels that reorder x
// once per M tile into a per-thread scratch buffer) kScratchBytes and
// prepare(int mr, int64_t m0, void* scratch) const.
// Threads get contiguous runs of N tiles (each weight byte is read by one thread). With one M tile a
// thread prepares once and streams its whole run; with several, its run is cut into chunks small
// enough to stay in L2 while all M tiles pass over them.
template <class Kernel>
constexpr std::size_t scratch_bytes() {
  if constexpr (requires { Kernel::kScratchBytes; }) {
    return Kernel::kScratchBytes;
  } else {
    return 0;
  }
}

// One thread's share: N tiles [t0, t1), in chunks of `chunk` tiles, each walked by every M tile.
template <class Kernel>
void run_tile_range(Kernel const& kernel, std::int64_t m, int max_mr, std::int64_t t0, std::int64_t t1,
                    std::int64_t chunk) {
  constexpr int kNR = Kernel::kNR;
  constexpr std::size_t kScratch = scratch_bytes<Kernel>();
  alignas(64) unsigned char scratch[kScratch > 0 ? kScratch : 1];
  for (std::int64_t c0 = t0; c0 < t1; c0 += chunk) {
    std::int64_t const c1 = std::min(t1, c0 + chunk);
    for (std::int64_t m0 = 0; m0 < m; m0 += max_mr) {
      int const mr = static_cast<int>(std::min<std::int64_t>(max_mr, m - m0));
      if constexpr (kScratch > 0) {
        kernel.prepare(mr, m0, scratch);
        for (std::int64_t t = c0; t < c1; ++t) kernel.tile(mr, m0, t * kNR, scratch);
      } else {
        for (std::int64_t t = c0; t < c1; ++t) kernel.tile(mr, m0, t * kNR);
      }
    }
  }
}

template <class Kernel>
void run_tiles(Kernel const& kernel, std::int64_t m, std::int64_t n, std::int64_t weight_row_bytes, int num_threads,
               ThreadPool& pool) {
  constexpr int kNR = Kernel::kNR;
  int max_mr = Kernel::kMaxMR;
  if constexpr (requires { kernel.max_mr(); }) max_mr = kernel.max_mr();
  std::int64_t const num_tiles = (n + kNR - 1) / kNR;
  std::int64_t const tile_bytes = std::max<std::int64_t>(1, weight_row_bytes * kNR);
  std::int64_t const chunk = m <= max_mr ? num_tiles : std::max<std::int64_t>(1, kChunkBytes / tile_bytes);
  std::int64_t const by_work = std::max<std::int64_t>(1, weight_row_bytes * n / kMinBytesPerThread);
  int const threads = static_cast<int>(std::min<std::int64_t>({num_threads, num_tiles, by_work}));
  if (threads <= 1) {
    run_tile_range(kernel, m, max_mr, 0, num_tiles, chunk);
    return;
  }
  auto task = [&](int i, int count) {
    run_tile_range(kernel, m, max_mr, num_tiles * i / count, num_tiles * (i + 1) / count, chunk);
  };
  pool.run(threads, TaskRef(task));
}

// Scratch buffers for the tasks of one parallel call, owned by the calling thread: they grow and stay
// (no allocation, and no page faults, per call), and they are allocated here, before any task runs, so
// that a failed allocation is an exception in the caller, never in a pool worker. Internal linkage: one
// set per TU and calling thread.
inline unsigned char* const* task_buffers(int count, std::size_t bytes) {
  struct Buffers {
    std::vector<unsigned char*> data;
    std::vector<std::size_t> size;
    ~Buffers() {
      for (unsigned char* d : data) std::free(d);
    }
  };
  thread_local Buffers buffers;
  if (buffers.data.size() < static_cast<std::size_t>(count)) {
    buffers.data.resize(static_cast<std::size_t>(count), nullptr);
    buffers.size.resize(static_cast<std::size_t>(count), 0);
  }
  for (std::size_t i = 0; i < static_cast<std::size_t>(count); ++i) {
    if (buffers.size[i] >= bytes) continue;
    std::free(buffers.data[i]);
    buffers.data[i] = nullptr;
    buffers.size[i] = 0;
    std::size_t const size = (bytes + 4095) / 4096 * 4096;
    buffers.data[i] = static_cast<unsigned char*>(std::aligned_alloc(64, size));
    if (buffers.data[i] == nullptr) throw std::bad_alloc();
    buffers.size[i] = size;
  }
  return buffers.data.data();
}

// Runs a panel kernel (kNR; scratch_bytes(); run_range(t0, t1, scratch): N tiles [t0, t1), every row of
// M) with threads split as run_tiles splits them: contiguous runs of N tiles, each weight byte read by
// one thread, each task with its own scratch.
template <class Kernel>
void run_thread_ranges(Kernel const& kernel, std::int64_t n, std::int64_t weight_row_bytes, int num_threads,
                       ThreadPool& pool) {
  std::int64_t const num_tiles = (n + Kernel::kNR - 1) / Kernel::kNR;
  std::int64_t const by_work = std::max<std::int64_t>(1, weight_row_bytes * n / kMinBytesPerThread);
  int const threads = static_cast<int>(std::min<std::int64_t>({num_threads, num_tiles, by_work}));
  unsigned char* const* scratch = task_buffers(threads, kernel.scratch_bytes());
  auto task = [&](int i, int count) {
    kernel.run_range(num_tiles * i / count, num_tiles * (i + 1) / count, scratch[i]);
  };
  if (threads <= 1) {
    task(0, 1);
    return;
  }
  pool.run(threads, TaskRef(task));
}

// Calls k.template run<MR>(args...) for the runtime mr in [1, kMaxMR]: the compile-time M tile.
template <int MR, class K, class... Args>
inline void dispatch_mr(K const& k, int mr, Args... args) {
  if constexpr (MR >= 1) {
    if (mr == MR) {
      k.template run<MR>(args...);
      return;
    }
    dispatch_mr<MR - 1>(k, mr, args...);
  }
}

// Bytes of one quantised weight row: two int4 weights per byte, or one int8.
inline std::int64_t row_bytes(W4A16GemmParams const& p) { return p.k / 2; }
inline std::int64_t row_bytes(W8A16GemmParams const& p) { return p.k; }

// Where kNR consecutive rows n0.. of a quantised weight start: the weight bytes, the scales and (kAsym,
// int4 only) the offsets of each. Rows past n are clamped to the last row: computed, never stored.
// kNR: rows per tile; ST: scale/offset storage type; kAsym: offsets given; Params: W4A16GemmParams or
// W8A16GemmParams.
template <int kNR, class ST, bool kAsym, class Params>
struct QuantTile {
  using Byte = std::remove_cv_t<std::remove_pointer_t<decltype(Params::qweight)>>;  // uint8 (int4 pairs) or int8
  std::int64_t row[kNR];
  Byte const* w[kNR];
  ST const* s[kNR];
  ST const* o[kNR];  // nullptr unless kAsym

  [[gnu::always_inline]] QuantTile(Params const& p, std::int64_t n0) {
    std::int64_t const groups = p.k / p.group_size;
    for (int r = 0; r < kNR; ++r) {
      row[r] = std::min(n0 + r, p.n - 1);
      w[r] = p.qweight + row[r] * row_bytes(p);
      s[r] = static_cast<ST const*>(p.scales) + row[r] * groups;
      if constexpr (kAsym) {
        o[r] = static_cast<ST const*>(p.offsets) + row[r] * groups;
      } else {
        o[r] = nullptr;
      }
    }
  }
};

// Calls fn(XT{}, ST{}, std::bool_constant<kAsym>{}) for p's x type, scale type and whether it has
// offsets: the compile-time types of an int4 kernel.
template <class Fn>
inline void dispatch_w4(W4A16GemmParams const& p, Fn&& fn) {
  dispatch_float_type(p.dtype, [&](auto xt) {
    dispatch_float_type(p.scale_type, [&](auto st) {
      if (p.offsets != nullptr) {
        fn(xt, st, std::true_type{});
      } else {
        fn(xt, st, std::false_type{});
      }
    });
  });
}

// The compile-time types of an int8 kernel: x, scales, and whether the bytes are E4M3 (fp8_e4m3).
template <class Fn>
inline void dispatch_w8(W8A16GemmParams const& p, Fn&& fn) {
  dispatch_float_type(p.dtype, [&](auto xt) {
    dispatch_float_type(p.scale_type, [&](auto st) {
      if (p.fp8_e4m3) {
        fn(xt, st, std::true_type{});
      } else {
        fn(xt, st, std::false_type{});
      }
    });
  });
}

// Stores one output element: fp32 sum + bias, rounded once to the output type.
template <class XT>
inline void store_out(XT* out, XT const* bias, std::int64_t n_idx, float v) {
  if (bias != nullptr) v += to_float(bias[n_idx]);
  out[n_idx] = from_float<XT>(v);
}

// The launchers' last step: the path of selected_isa(). Params: the op's params struct.
template <class Params>
inline void run_selected_isa(Params const& p, ThreadPool& pool, void (*portable)(Params const&, ThreadPool&),
                             void (*avx2)(Params const&, ThreadPool&), void (*avx512f)(Params const&, ThreadPool&),
                             void (*avx512)(Params const&, ThreadPool&)) {
  switch (selected_isa()) {
    case Isa::kAvx512:
      avx512(p, pool);
      break;
    case Isa::kAvx512F:
      avx512f(p, pool);
      break;
    case Isa::kAvx2:
      avx2(p, pool);
      break;
    case Isa::kPortable:
      portable(p, pool);
      break;
  }
}

}  // namespace
}  // namespace gemm_detail
}  // namespace inflight::kernels::cpu
