// Portable (baseline x86-64 / any CPU) paths of the W4A16, W8A16 and dense GEMMs, one algorithm for the
// three: one weight row at a time, decoded a block at a time (a quantisation group, or 256 dense
// values) into an fp32 stack buffer, then dotted with every row of the M tile. The 8-lane partial sums
// let the compiler vectorise without reassociating (no -ffast-math needed). Only the decoding of a
// block differs per weight format (W4Rows, W8Rows, DenseRows).
#include <cmath>

#include "dense_gemm.h"
#include "gemm.h"

namespace inflight::kernels::cpu {
namespace {

using namespace gemm_detail;

constexpr int kLanes = 8;
constexpr int kMaxGroup = 128;    // quantisation groups: 32, 64 or 128 weights
constexpr int kDenseBlock = 256;  // dense weights converted per block (1 KiB of fp32: stays in L1)

// dot(w[0:len], x[0:len]) in fp32, as kLanes interleaved partial sums. T: storage type of x; kTail:
// len may be other than a multiple of kLanes (without the tail loop, part[] stays in registers).
template <bool kTail, class T>
inline float dot_block(float const* w, T const* x, int len) {
  float part[kLanes] = {};
  int j = 0;
  for (; j + kLanes <= len; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] += w[j + l] * to_float(x[j + l]);
  }
  if constexpr (kTail) {
    for (int l = 0; j < len; ++j, ++l) part[l] += w[j] * to_float(x[j]);
  }
  float s = 0.0f;
  for (float v : part) s += v;
  return s;
}

// The row-by-row algorithm. XT: storage type of x, bias and out; Rows: the weight format, providing
//   Row row(int64_t n) const   the decoder of weight row n: int decode(int64_t b, float (&buf)[kMaxBlock])
//                              writes block b (values b * block() ..) as fp32 and returns its length
//                              (inlined: as a call it costs ~10% at K = 576),
//   int block() const          values per block (every block but the last is full),
//   kMaxBlock                  the largest block; as the buffer's size it also bounds the trip counts of
//                              the decode loops, which lets GCC unroll them,
//   kWholeLanes                every block's length is a multiple of kLanes,
//   k, x, bias, out, ldo       the GEMM's operands (ldo: out's row stride).
template <class XT, class Rows>
struct RowByRow {
  static constexpr int kNR = 1;     // one weight row per tile
  static constexpr int kMaxMR = 8;  // rows of x sharing each decoded block
  Rows rows;

  void tile(int mr, std::int64_t m0, std::int64_t n0) const { dispatch_mr<kMaxMR>(*this, mr, m0, n0); }

  template <int MR>
  void run(std::int64_t m0, std::int64_t n) const {
    std::int64_t const k_dim = rows.k;
    int const block = rows.block();
    XT const* x = static_cast<XT const*>(rows.x) + m0 * k_dim;
    auto const row = rows.row(n);
    float acc[MR] = {};
    float wbuf[Rows::kMaxBlock];
    for (std::int64_t b = 0, k0 = 0; k0 < k_dim; ++b, k0 += block) {
      int const len = row.decode(b, wbuf);
      for (int i = 0; i < MR; ++i) acc[i] += dot_block<!Rows::kWholeLanes>(wbuf, x + i * k_dim + k0, len);
    }
    XT* out = static_cast<XT*>(rows.out);
    XT const* bias = static_cast<XT const*>(rows.bias);
    for (int i = 0; i < MR; ++i) store_out(out + (m0 + i) * rows.ldo, bias, n, acc[i]);
  }
};

// The operands every format shares, from its params struct.
struct Operands {
  void const* x;
  void const* bias;
  void* out;
  std::int64_t k, ldo;
};

// int4 weights, blocks of one group. ST: scale/offset storage type; kAsym: offsets given.
template <class ST, bool kAsym>
struct W4Rows : Operands {
  static constexpr int kMaxBlock = kMaxGroup;
  static constexpr bool kWholeLanes = true;  // groups of 32, 64 or 128
  W4A16GemmParams const& p;
  explicit W4Rows(W4A16GemmParams const& params)
      : Operands{params.x, params.bias, params.out, params.k, params.n}, p(params) {}
  int block() const { return p.group_size; }

  struct Row {
    QuantTile<1, ST, kAsym, W4A16GemmParams> t;
    int g_size;
    [[gnu::always_inline]] int decode(std::int64_t g, float (&wbuf)[kMaxBlock]) const {
      float const sc = to_float(t.s[0][g]);
      // Symmetric: sc * q - 8 * sc == sc * (q - 8) exactly whenever sc * q is exact (fp16/bf16 scales).
      float const of = kAsym ? to_float(t.o[0][g]) : -8.0f * sc;
      std::uint8_t const* wg = t.w[0] + g * (g_size / 2);
      for (int j = 0; j < g_size / 2; ++j) {
        wbuf[2 * j] = static_cast<float>(wg[j] & 0xf) * sc + of;
        wbuf[2 * j + 1] = static_cast<float>(wg[j] >> 4) * sc + of;
      }
      return g_size;
    }
  };
  [[gnu::always_inline]] Row row(std::int64_t n) const { return Row{{p, n}, p.group_size}; }
};

// One OCP FP8 E4M3 (e4m3fn) byte as fp32, exactly: (8 + m) 2^(e - 10), or m 2^-9 when e = 0.
inline float fp8_e4m3_to_float(std::uint8_t b) {
  int const e = (b >> 3) & 0xf;
  int const m = b & 7;
  float const v = e != 0 ? std::ldexp(static_cast<float>(8 + m), e - 10) : std::ldexp(static_cast<float>(m), -9);
  return (b & 0x80) != 0 ? -v : v;
}

// int8 (or E4M3) weights, blocks of one group. ST: scale storage type.
template <class ST, bool kFp8>
struct W8Rows : Operands {
  static constexpr int kMaxBlock = kMaxGroup;
  static constexpr bool kWholeLanes = true;
  W8A16GemmParams const& p;
  explicit W8Rows(W8A16GemmParams const& params)
      : Operands{params.x, params.bias, params.out, params.k, params.n}, p(params) {}
  int block() const { return p.group_size; }

  struct Row {
    QuantTile<1, ST, false, W8A16GemmParams> t;
    int g_size;
    [[gnu::always_inline]] int decode(std::int64_t g, float (&wbuf)[kMaxBlock]) const {
      float const sc = to_float(t.s[0][g]);
      std::int8_t const* wg = t.w[0] + g * g_size;
      for (int j = 0; j < g_size; ++j) {
        float const q = kFp8 ? fp8_e4m3_to_float(static_cast<std::uint8_t>(wg[j])) : static_cast<float>(wg[j]);
        wbuf[j] = q * sc;
      }
      return g_size;
    }
  };
  [[gnu::always_inline]] Row row(std::int64_t n) const { return Row{{p, n}, p.group_size}; }
};

// Unquantised weights of type T, blocks of kDenseBlock values (the last may be shorter).
template <class T>
struct DenseRows : Operands {
  static constexpr int kMaxBlock = kDenseBlock;
  static constexpr bool kWholeLanes = false;  // any k
  explicit DenseRows(DenseGemmParams const& p)
      : Operands{p.x, p.bias, p.out, p.k, p.out_row_stride > 0 ? p.out_row_stride : p.n}, weight(p.weight) {}
  void const* weight;
  int block() const { return kDenseBlock; }

  struct Row {
    T const* w;
    std::int64_t k;
    [[gnu::always_inline]] int decode(std::int64_t b, float (&wbuf)[kMaxBlock]) const {
      std::int64_t const k0 = b * kDenseBlock;
      int const len = static_cast<int>(std::min<std::int64_t>(kDenseBlock, k - k0));
      for (int j = 0; j < len; ++j) wbuf[j] = to_float(w[k0 + j]);
      return len;
    }
  };
  Row row(std::int64_t n) const { return Row{static_cast<T const*>(weight) + n * k, k}; }
};

}  // namespace

void w4a16_gemm_portable(W4A16GemmParams const& p, ThreadPool& pool) {
  dispatch_w4(p, [&](auto xt, auto st, auto asym) {
    using Rows = W4Rows<decltype(st), asym>;
    run_tiles(RowByRow<decltype(xt), Rows>{Rows(p)}, p.m, p.n, row_bytes(p), p.num_threads, pool);
  });
}

void w8a16_gemm_portable(W8A16GemmParams const& p, ThreadPool& pool) {
  dispatch_w8(p, [&](auto xt, auto st, auto fp8) {
    using Rows = W8Rows<decltype(st), fp8>;
    run_tiles(RowByRow<decltype(xt), Rows>{Rows(p)}, p.m, p.n, row_bytes(p), p.num_threads, pool);
  });
}

void dense_gemm_portable(DenseGemmParams const& p, ThreadPool& pool) {
  dispatch_float_type(p.dtype, [&](auto t) {
    using T = decltype(t);
    run_tiles(RowByRow<T, DenseRows<T>>{DenseRows<T>(p)}, p.m, p.n, p.k * static_cast<std::int64_t>(sizeof(T)),
              p.num_threads, pool);
  });
}

}  // namespace inflight::kernels::cpu
