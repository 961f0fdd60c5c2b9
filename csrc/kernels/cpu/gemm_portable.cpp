// Portable (baseline x86-64 / any CPU) W4A16 and W8A16 paths: one weight row at a time, dequantised a
// group at a time into a small stack buffer, then dotted with every row of the M tile. The 8-lane
// partial sums let the compiler vectorise without reassociating (no -ffast-math needed).
#include "gemm.h"

namespace inflight::kernels::cpu {
namespace {

using namespace gemm_detail;

constexpr int kMaxGroup = 128;
constexpr int kLanes = 8;

// Adds dot(w[0:g], x[0:g]) to acc; g is a multiple of kLanes.
template <class XT>
inline float dot_group(float const* w, XT const* x, int g) {
  float part[kLanes] = {};
  for (int k = 0; k < g; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] += w[k + l] * to_float(x[k + l]);
  }
  float s = 0.0f;
  for (float v : part) s += v;
  return s;
}

// XT: activation/output storage type; ST: scale/offset storage type; kAsym: offsets present.
template <class XT, class ST, bool kAsym>
struct W4Portable {
  static constexpr int kNR = 1;     // one weight row per tile
  static constexpr int kMaxMR = 8;  // rows of x sharing each dequantised group
  W4A16GemmParams const& p;

  void tile(int mr, std::int64_t m0, std::int64_t n0) const { dispatch_mr<kMaxMR>(*this, mr, m0, n0); }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    std::uint8_t const* w = p.qweight + n * (k_dim / 2);
    ST const* s = static_cast<ST const*>(p.scales) + n * groups;
    ST const* o = static_cast<ST const*>(p.offsets) + n * groups;
    XT const* x = static_cast<XT const*>(p.x) + m0 * k_dim;
    float acc[MR] = {};
    float wbuf[kMaxGroup];
    for (std::int64_t g = 0; g < groups; ++g) {
      float const sc = to_float(s[g]);
      // Symmetric: sc * q - 8 * sc == sc * (q - 8) exactly whenever sc * q is exact (fp16/bf16 scales).
      float const of = kAsym ? to_float(o[g]) : -8.0f * sc;
      std::uint8_t const* wg = w + g * (g_size / 2);
      for (int j = 0; j < g_size / 2; ++j) {
        wbuf[2 * j] = static_cast<float>(wg[j] & 0xf) * sc + of;
        wbuf[2 * j + 1] = static_cast<float>(wg[j] >> 4) * sc + of;
      }
      for (int i = 0; i < MR; ++i) acc[i] += dot_group(wbuf, x + i * k_dim + g * g_size, g_size);
    }
    XT* out = static_cast<XT*>(p.out);
    XT const* bias = static_cast<XT const*>(p.bias);
    for (int i = 0; i < MR; ++i) store_out(out + (m0 + i) * p.n, bias, n, acc[i]);
  }
};

template <class XT, class ST>
struct W8Portable {
  static constexpr int kNR = 1;
  static constexpr int kMaxMR = 8;
  W8A16GemmParams const& p;

  void tile(int mr, std::int64_t m0, std::int64_t n0) const { dispatch_mr<kMaxMR>(*this, mr, m0, n0); }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    std::int8_t const* w = p.qweight + n * k_dim;
    ST const* s = static_cast<ST const*>(p.scales) + n * groups;
    XT const* x = static_cast<XT const*>(p.x) + m0 * k_dim;
    float acc[MR] = {};
    float wbuf[kMaxGroup];
    for (std::int64_t g = 0; g < groups; ++g) {
      float const sc = to_float(s[g]);
      std::int8_t const* wg = w + g * g_size;
      for (int j = 0; j < g_size; ++j) wbuf[j] = static_cast<float>(wg[j]) * sc;
      for (int i = 0; i < MR; ++i) acc[i] += dot_group(wbuf, x + i * k_dim + g * g_size, g_size);
    }
    XT* out = static_cast<XT*>(p.out);
    XT const* bias = static_cast<XT const*>(p.bias);
    for (int i = 0; i < MR; ++i) store_out(out + (m0 + i) * p.n, bias, n, acc[i]);
  }
};

}  // namespace

void w4a16_gemm_portable(W4A16GemmParams const& p, ThreadPool& pool) {
  dispatch_float_type(p.dtype, [&](auto xt) {
    dispatch_float_type(p.scale_type, [&](auto st) {
      using XT = decltype(xt);
      using ST = decltype(st);
      if (p.offsets != nullptr) {
        run_tiles(W4Portable<XT, ST, true>{p}, p.m, p.n, p.k / 2, p.num_threads, pool);
      } else {
        run_tiles(W4Portable<XT, ST, false>{p}, p.m, p.n, p.k / 2, p.num_threads, pool);
      }
    });
  });
}

void w8a16_gemm_portable(W8A16GemmParams const& p, ThreadPool& pool) {
  dispatch_float_type(p.dtype, [&](auto xt) {
    dispatch_float_type(p.scale_type, [&](auto st) {
      run_tiles(W8Portable<decltype(xt), decltype(st)>{p}, p.m, p.n, p.k, p.num_threads, pool);
    });
  });
}

}  // namespace inflight::kernels::cpu
