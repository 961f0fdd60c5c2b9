// W8A8 GEMM: packing, the activation quantisation, the portable int32 products, the epilogue, and the
// launcher (w8a8_gemm.h). Only the int32 products differ per ISA (w8a8_gemm_avx512vnni.cpp for VNNI).
#include "w8a8_gemm.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace inflight::kernels::cpu {

namespace {

std::int64_t round_up4(std::int64_t k) { return (k + 3) / 4 * 4; }

template <class T>
void quantize_rows(T const* x, float const* smooth, std::int64_t m, std::int64_t k, std::uint8_t* qa,
                   float* row_scales) {
  std::int64_t const kp = round_up4(k);
  auto const smoothed = [&](T const* row, std::int64_t i) {
    float const v = to_float(row[i]);
    return smooth != nullptr ? v * smooth[i] : v;
  };
  for (std::int64_t r = 0; r < m; ++r) {
    T const* row = x + r * k;
    float amax = 0.0f;
    for (std::int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(smoothed(row, i)));
    // A row so small that 127 / amax overflows (amax below ~4e-37) counts as all zero.
    bool const tiny = amax > 0.0f && std::isinf(127.0f / amax);
    float const inv = amax > 0.0f && !tiny ? 127.0f / amax : 0.0f;
    row_scales[r] = tiny ? 0.0f : amax / 127.0f;
    std::uint8_t* q = qa + r * kp;
    for (std::int64_t i = 0; i < k; ++i) {
      // |v| <= 127 (and slightly above by rounding): adding and subtracting 1.5 * 2^23 rounds it to an
      // integer, half to even, in the default rounding mode, with plain SSE2 (nearbyintf would be a
      // libm call per element on the baseline ISA); the loop vectorises.
      float const v = smoothed(row, i) * inv;
      float const r = (v + 12582912.0f) - 12582912.0f;
      q[i] = static_cast<std::uint8_t>(static_cast<int>(std::clamp(r, -127.0f, 127.0f)) + 128);
    }
    for (std::int64_t i = k; i < kp; ++i) q[i] = 128;
  }
}

template <class T>
void epilogue_rows(std::int32_t const* c, float const* row_scales, W8A8PackedWeight const& w, float const* bias,
                   std::int64_t row_lo, std::int64_t row_hi, T* out) {
  std::int64_t const np = w.n_padded();
  for (std::int64_t r = row_lo; r < row_hi; ++r) {
    float const a = row_scales[r];
    std::int32_t const* cr = c + r * np;
    T* o = out + r * w.n;
    for (std::int64_t j = 0; j < w.n; ++j) {
      float const s = a * w.scales[static_cast<std::size_t>(j)];
      float v = static_cast<float>(cr[j]) * s;
      if (bias != nullptr) v = v + bias[j];
      o[j] = from_float<T>(v);
    }
  }
}

}  // namespace

W8A8PackedWeight pack_w8a8_weight(std::int8_t const* qweight, float const* scales, std::int64_t n, std::int64_t k) {
  if (n < 1 || k < 1) throw std::invalid_argument("pack_w8a8_weight: n and k must be >= 1");
  W8A8PackedWeight w;
  w.n = n;
  w.k = k;
  w.k4 = (k + 3) / 4;
  std::int64_t const np = w.n_padded();
  w.data.assign(static_cast<std::size_t>(np * w.k4 * 4), 0);
  w.wsum.assign(static_cast<std::size_t>(np), 0);
  w.scales.assign(static_cast<std::size_t>(np), 0.0f);
  for (std::int64_t j = 0; j < n; ++j) {
    std::int64_t const b = j / kW8A8Block, c = j % kW8A8Block;
    std::int8_t* dst = w.data.data() + b * w.k4 * kW8A8Block * 4;
    std::int32_t sum = 0;
    for (std::int64_t i = 0; i < k; ++i) {
      std::int8_t const v = qweight[j * k + i];
      dst[(i / 4) * kW8A8Block * 4 + c * 4 + i % 4] = v;
      sum += v;
    }
    w.wsum[static_cast<std::size_t>(j)] = 128 * sum;
    w.scales[static_cast<std::size_t>(j)] = scales[j];
  }
  return w;
}

void unpack_w8a8_weight(W8A8PackedWeight const& w, std::int8_t* qweight, float* scales) {
  for (std::int64_t j = 0; j < w.n; ++j) {
    std::int64_t const b = j / kW8A8Block, c = j % kW8A8Block;
    std::int8_t const* src = w.data.data() + b * w.k4 * kW8A8Block * 4;
    for (std::int64_t i = 0; i < w.k; ++i) qweight[j * w.k + i] = src[(i / 4) * kW8A8Block * 4 + c * 4 + i % 4];
    scales[j] = w.scales[static_cast<std::size_t>(j)];
  }
}

void quantize_w8a8_activations(void const* x, ScalarType dtype, float const* smooth, std::int64_t m, std::int64_t k,
                               std::uint8_t* qa, float* row_scales) {
  switch (dtype) {
    case ScalarType::kFloat32:
      return quantize_rows(static_cast<float const*>(x), smooth, m, k, qa, row_scales);
    case ScalarType::kBFloat16:
      return quantize_rows(static_cast<BFloat16 const*>(x), smooth, m, k, qa, row_scales);
    case ScalarType::kFloat16:
      return quantize_rows(static_cast<Float16 const*>(x), smooth, m, k, qa, row_scales);
    default:
      throw std::invalid_argument("w8a8_gemm: x must be fp32, bf16 or fp16");
  }
}

namespace w8a8_detail {

void int_gemm_portable(std::uint8_t const* qa, std::int64_t m, W8A8PackedWeight const& w, std::int64_t block_lo,
                       std::int64_t block_hi, std::int32_t* c) {
  std::int64_t const kp = w.k4 * 4, np = w.n_padded();
  for (std::int64_t b = block_lo; b < block_hi; ++b) {
    std::int8_t const* wb = w.data.data() + b * w.k4 * kW8A8Block * 4;
    for (std::int64_t r = 0; r < m; ++r) {
      std::uint8_t const* a = qa + r * kp;
      std::int32_t acc[kW8A8Block] = {};
      for (std::int64_t q = 0; q < w.k4; ++q) {
        std::int8_t const* wq = wb + q * kW8A8Block * 4;
        for (int col = 0; col < kW8A8Block; ++col) {
          for (int t = 0; t < 4; ++t) acc[col] += static_cast<std::int32_t>(a[q * 4 + t]) * wq[col * 4 + t];
        }
      }
      std::int32_t* cr = c + r * np + b * kW8A8Block;
      for (int col = 0; col < kW8A8Block; ++col)
        cr[col] = acc[col] - w.wsum[static_cast<std::size_t>(b * kW8A8Block + col)];
    }
  }
}

}  // namespace w8a8_detail

std::size_t w8a8_workspace_bytes(std::int64_t m, W8A8PackedWeight const& w) {
  auto const align = [](std::size_t v) { return (v + 63) / 64 * 64; };
  return align(static_cast<std::size_t>(m * w.k4 * 4)) + align(static_cast<std::size_t>(m) * sizeof(float)) +
         static_cast<std::size_t>(m * w.n_padded()) * sizeof(std::int32_t);
}

void launch_w8a8_gemm(W8A8GemmParams const& p, ThreadPool& pool) {
  if (p.weight == nullptr || p.x == nullptr || p.out == nullptr || p.workspace == nullptr) {
    throw std::invalid_argument("w8a8_gemm: x, weight, out and workspace must be given");
  }
  if (p.m < 1) throw std::invalid_argument("w8a8_gemm: m must be >= 1, got " + std::to_string(p.m));
  W8A8PackedWeight const& w = *p.weight;
  auto const align = [](std::size_t v) { return (v + 63) / 64 * 64; };
  auto* qa = static_cast<std::uint8_t*>(p.workspace);
  auto* row_scales = reinterpret_cast<float*>(qa + align(static_cast<std::size_t>(p.m * w.k4 * 4)));
  auto* c = reinterpret_cast<std::int32_t*>(reinterpret_cast<char*>(row_scales) +
                                            align(static_cast<std::size_t>(p.m) * sizeof(float)));
  {  // The activations by rows (each row's scale depends on that row alone).
    std::size_t const row_bytes = static_cast<std::size_t>(w.k) * scalar_type_size(p.dtype);
    int const qthreads =
        static_cast<int>(std::min<std::int64_t>({p.num_threads, p.m, std::max<std::int64_t>((p.m * w.k) >> 14, 1)}));
    auto quantize = [&](int i, int n) {
      std::int64_t const lo = p.m * i / n, hi = p.m * (i + 1) / n;
      if (lo >= hi) return;
      quantize_w8a8_activations(static_cast<char const*>(p.x) + static_cast<std::size_t>(lo) * row_bytes, p.dtype,
                                p.smooth, hi - lo, w.k, qa + lo * w.k4 * 4, row_scales + lo);
    };
    pool.run(std::max(qthreads, 1), TaskRef(quantize));
  }

  // VPDPBUSD needs AVX512-VNNI, which kAvx512 includes and a kAvx512F CPU may have.
  bool const vnni = selected_isa() == Isa::kAvx512 || (selected_isa() == Isa::kAvx512F && cpu_features().avx512vnni);
  std::int64_t const nb = w.num_blocks();
  // Threads split the column blocks, in groups of 4 (the VNNI tile's width); each is worth its launch
  // only with enough work (~64k multiply-adds).
  std::int64_t const groups = (nb + 3) / 4;
  std::int64_t const work = p.m * w.n_padded() * w.k4 * 4;
  int threads =
      static_cast<int>(std::min<std::int64_t>({p.num_threads, groups, std::max<std::int64_t>(work >> 16, 1)}));
  threads = std::max(threads, 1);
  auto task = [&](int i, int n) {
    std::int64_t const g_lo = groups * i / n, g_hi = groups * (i + 1) / n;
    std::int64_t const lo = std::min(g_lo * 4, nb), hi = std::min(g_hi * 4, nb);
    if (lo >= hi) return;
    if (vnni) {
      w8a8_detail::int_gemm_avx512(qa, p.m, w, lo, hi, c);
    } else {
      w8a8_detail::int_gemm_portable(qa, p.m, w, lo, hi, c);
    }
  };
  pool.run(threads, TaskRef(task));
  // The epilogue by rows (each row's columns in one pass).
  int const ethreads =
      static_cast<int>(std::min<std::int64_t>({p.num_threads, p.m, std::max<std::int64_t>((p.m * w.n) >> 14, 1)}));
  auto epilogue = [&](int i, int n) {
    std::int64_t const lo = p.m * i / n, hi = p.m * (i + 1) / n;
    switch (p.dtype) {
      case ScalarType::kFloat32:
        return epilogue_rows(c, row_scales, w, p.bias, lo, hi, static_cast<float*>(p.out));
      case ScalarType::kBFloat16:
        return epilogue_rows(c, row_scales, w, p.bias, lo, hi, static_cast<BFloat16*>(p.out));
      default:
        return epilogue_rows(c, row_scales, w, p.bias, lo, hi, static_cast<Float16*>(p.out));
    }
  };
  pool.run(std::max(ethreads, 1), TaskRef(epilogue));
}

}  // namespace inflight::kernels::cpu
