// Launcher of the dense GEMM (validate once, then run the selected ISA's path) and its portable path.
//
// Portable (baseline x86-64 / any CPU): one weight row at a time, converted to fp32 a block at a time
// into a stack buffer, then dotted with every row of the M tile. The 8-lane partial sums let the
// compiler vectorise without reassociating (no -ffast-math needed).
#include "dense_gemm.h"

#include <stdexcept>
#include <string>

#include "cpu_features.h"

namespace inflight::kernels::cpu {
namespace {

using namespace gemm_detail;

constexpr int kBlock = 256;  // weights converted per block (1 KiB of fp32: stays in L1)
constexpr int kLanes = 8;

// dot(w[0:len], x[0:len]) in fp32, as kLanes interleaved partial sums.
template <class T>
inline float dot_block(float const* w, T const* x, int len) {
  float part[kLanes] = {};
  int j = 0;
  for (; j + kLanes <= len; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] += w[j + l] * to_float(x[j + l]);
  }
  for (int l = 0; j < len; ++j, ++l) part[l] += w[j] * to_float(x[j]);
  float s = 0.0f;
  for (float v : part) s += v;
  return s;
}

// T: storage type of x, weight, bias and out.
template <class T>
struct DensePortable {
  static constexpr int kNR = 1;     // one weight row per tile
  static constexpr int kMaxMR = 8;  // rows of x sharing each converted weight block
  DenseGemmParams const& p;

  void tile(int mr, std::int64_t m0, std::int64_t n0) const { dispatch_mr<kMaxMR>(*this, mr, m0, n0); }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n) const {
    std::int64_t const k_dim = p.k;
    T const* w = static_cast<T const*>(p.weight) + n * k_dim;
    T const* x = static_cast<T const*>(p.x) + m0 * k_dim;
    float acc[MR] = {};
    float wbuf[kBlock];
    for (std::int64_t k0 = 0; k0 < k_dim; k0 += kBlock) {
      int const len = static_cast<int>(std::min<std::int64_t>(kBlock, k_dim - k0));
      for (int j = 0; j < len; ++j) wbuf[j] = to_float(w[k0 + j]);
      for (int i = 0; i < MR; ++i) acc[i] += dot_block(wbuf, x + i * k_dim + k0, len);
    }
    T* out = static_cast<T*>(p.out);
    T const* bias = static_cast<T const*>(p.bias);
    for (int i = 0; i < MR; ++i)
      store_out(out + (m0 + i) * (p.out_row_stride > 0 ? p.out_row_stride : p.n), bias, n, acc[i]);
  }
};

void check(DenseGemmParams const& p) {
  std::string const where = "dense_gemm: ";
  if (!is_float_type(p.dtype)) {
    throw std::invalid_argument(where + "dtype must be float32, bfloat16 or float16, got " + scalar_type_name(p.dtype));
  }
  if (p.m < 0) throw std::invalid_argument(where + "m must be >= 0, got " + std::to_string(p.m));
  if (p.n < 1) throw std::invalid_argument(where + "n must be >= 1, got " + std::to_string(p.n));
  if (p.k < 1) throw std::invalid_argument(where + "k must be >= 1, got " + std::to_string(p.k));
  if (p.out_row_stride != 0 && p.out_row_stride < p.n) {
    throw std::invalid_argument(where + "out_row_stride must be 0 or >= n = " + std::to_string(p.n) + ", got " +
                                std::to_string(p.out_row_stride));
  }
  if (p.num_threads < 1) {
    throw std::invalid_argument(where + "num_threads must be >= 1, got " + std::to_string(p.num_threads));
  }
  if (p.m > 0 && (p.x == nullptr || p.weight == nullptr || p.out == nullptr)) {
    throw std::invalid_argument(where + "x, weight and out must not be null (bias may be)");
  }
}

}  // namespace

void dense_gemm_portable(DenseGemmParams const& p, ThreadPool& pool) {
  dispatch_float_type(p.dtype, [&](auto t) {
    using T = decltype(t);
    run_tiles(DensePortable<T>{p}, p.m, p.n, p.k * static_cast<std::int64_t>(sizeof(T)), p.num_threads, pool);
  });
}

void launch_dense_gemm(DenseGemmParams const& p, ThreadPool& pool) {
  check(p);
  if (p.m == 0) return;
  switch (selected_isa()) {
    case Isa::kAvx512:
      dense_gemm_avx512(p, pool);
      break;
    case Isa::kAvx2:
      dense_gemm_avx2(p, pool);
      break;
    case Isa::kPortable:
      dense_gemm_portable(p, pool);
      break;
  }
}

}  // namespace inflight::kernels::cpu
