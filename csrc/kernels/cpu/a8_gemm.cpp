// A8 GEMM (a8_gemm.h): packing, the portable activation quantisation and products, the launcher. The
// VNNI tiles and a vectorised quantisation computing the same bits are in a8_gemm_avx512vnni.cpp.
#include "a8_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace inflight::kernels::cpu {

namespace {

std::size_t align64(std::size_t v) { return (v + 63) / 64 * 64; }

bool fits_f16(float v) { return f16_to_float(float_to_f16(v)) == v; }

template <class T>
void quantize_rows(T const* x, std::int64_t m, std::int64_t k, int group, std::int8_t* q, float* d, std::int32_t* sq,
                   float* ds, int limbs) {
  std::int64_t const groups = k / group;
  float const qmax = limbs == 2 ? kA16Max : 127.0f;
  for (std::int64_t r = 0; r < m; ++r) {
    for (std::int64_t g = 0; g < groups; ++g) {
      T const* xs = x + r * k + g * group;
      std::int8_t* qs = q + r * limbs * k + g * group;
      float amax = 0.0f;
      for (int i = 0; i < group; ++i) amax = std::max(amax, std::fabs(to_float(xs[i])));
      // A group so small that qmax / amax overflows (amax below ~1e-35) counts as all zero.
      bool const tiny = amax > 0.0f && std::isinf(qmax / amax);
      float const inv = amax > 0.0f && !tiny ? qmax / amax : 0.0f;
      std::int32_t sum = 0;
      for (int i = 0; i < group; ++i) {
        // |v| <= qmax (and a rounding above): adding and subtracting 1.5 * 2^23 rounds it to an integer,
        // half to even, in the default rounding mode, as the vector copy does.
        float const v = to_float(xs[i]) * inv;
        float const rv = (v + 12582912.0f) - 12582912.0f;
        int const qi = static_cast<int>(std::clamp(rv, -qmax, qmax));
        if (limbs == 2) {
          int const h = (qi + 128) >> 8;  // an arithmetic shift: floor
          qs[i] = static_cast<std::int8_t>(h);
          qs[k + i] = static_cast<std::int8_t>(qi - 256 * h);
        } else {
          qs[i] = static_cast<std::int8_t>(qi);
        }
        sum += qi;
      }
      float const dg = tiny ? 0.0f : amax / qmax;
      d[r * groups + g] = dg;
      sq[r * groups + g] = sum;
      ds[r * groups + g] = dg * static_cast<float>(sum);
    }
  }
}

// The unsigned code of channel cc (0..63) of panel p at element i of group g.
int code(A8PackedWeight const& w, std::int64_t p, std::int64_t g, int cc, int i) {
  int const quad = i / 4, t = i % 4, blk = cc / 16, lane = cc % 16;
  int const v = w.bits == 4 ? quad / 2 : quad;
  std::uint8_t const byte =
      w.data[static_cast<std::size_t>((p * w.groups() + g) * w.record_bytes() + (v * 4 + blk) * 64 + lane * 4 + t)];
  if (w.bits == 8) return byte;
  return (quad % 2) != 0 ? byte >> 4 : byte & 0x0F;
}

// Channel cc's scale (which = 0) or offset (which = 1) of panel p's group g.
float scale_at(A8PackedWeight const& w, std::int64_t p, std::int64_t g, int cc, int which) {
  std::uint8_t const* at = w.data.data() + (p * w.groups() + g) * w.record_bytes() + w.code_bytes() +
                           (which * kA8Panel + cc) * w.scale_bytes();
  if (w.f16_scales) {
    std::uint16_t h;
    std::memcpy(&h, at, 2);
    return f16_to_float(h);
  }
  float f;
  std::memcpy(&f, at, 4);
  return f;
}

template <class T>
void gemm_portable_t(A8PackedWeight const& w, a8_detail::Activations const& a, std::int64_t m_lo, std::int64_t m_hi,
                     std::int64_t p_lo, std::int64_t p_hi, T* out) {
  std::int64_t const groups = w.groups();
  for (std::int64_t r = m_lo; r < m_hi; ++r) {
    for (std::int64_t p = p_lo; p < p_hi; ++p) {
      for (int cc = 0; cc < kA8Panel; ++cc) {
        std::int64_t const c = p * kA8Panel + cc;
        if (c >= w.n) break;
        float f = 0.0f;
        for (std::int64_t g = 0; g < groups; ++g) {
          std::int8_t const* qs = a.q + r * a.limbs * a.k + g * w.group;
          std::int32_t acc = -w.zero_point * a.sq[r * groups + g];
          for (int i = 0; i < w.group; ++i) {
            int const qi = a.limbs == 2 ? 256 * qs[i] + qs[a.k + i] : qs[i];
            acc += code(w, p, g, cc, i) * qi;
          }
          float const sd = scale_at(w, p, g, cc, 0) * a.d[r * groups + g];
          f = std::fma(static_cast<float>(acc), sd, f);
          if (w.asym) f = std::fma(scale_at(w, p, g, cc, 1), a.ds[r * groups + g], f);
        }
        if (!w.bias.empty()) f = f + w.bias[static_cast<std::size_t>(c)];
        out[r * w.n + c] = from_float<T>(f);
      }
    }
  }
}

}  // namespace

A8PackedWeight pack_a8_weight(int bits, void const* qweight, float const* scales, float const* offsets,
                              float const* bias, std::int64_t n, std::int64_t k, int group_size) {
  std::string const where = "pack_a8_weight: ";
  if (bits != 4 && bits != 8) throw std::invalid_argument(where + "bits must be 4 or 8, got " + std::to_string(bits));
  bool const group_ok = group_size == 32 || group_size == 64 || group_size == 128 || (bits == 8 && group_size == 16);
  if (!group_ok) {
    throw std::invalid_argument(where + "group_size must be " + (bits == 8 ? "16, " : "") + "32, 64 or 128, got " +
                                std::to_string(group_size));
  }
  if (n < 1) throw std::invalid_argument(where + "n must be >= 1, got " + std::to_string(n));
  if (k < group_size || k % group_size != 0) {
    throw std::invalid_argument(where + "k must be a positive multiple of group_size (" + std::to_string(group_size) +
                                "), got " + std::to_string(k));
  }
  if (bits == 8 && offsets != nullptr) throw std::invalid_argument(where + "int8 weights take no offsets");
  if (qweight == nullptr || scales == nullptr) throw std::invalid_argument(where + "qweight and scales must be given");

  A8PackedWeight w;
  w.bits = bits;
  w.asym = offsets != nullptr;
  w.zero_point = bits == 8 ? 128 : (w.asym ? 0 : 8);
  w.group = group_size == 16 ? 16 : 32;
  w.n = n;
  w.k = k;
  std::int64_t const wgroups = k / group_size, groups = w.groups(), panels = w.panels();
  for (std::int64_t i = 0; i < n * wgroups && w.f16_scales; ++i) {
    w.f16_scales = fits_f16(scales[i]) && (offsets == nullptr || fits_f16(offsets[i]));
  }
  w.data.assign(static_cast<std::size_t>(panels * w.panel_bytes()), 0);
  auto put_scale = [&](std::uint8_t* dst, float v) {
    if (w.f16_scales) {
      std::uint16_t const h = float_to_f16(v);
      std::memcpy(dst, &h, 2);
    } else {
      std::memcpy(dst, &v, 4);
    }
  };
  for (std::int64_t c = 0; c < n; ++c) {
    std::int64_t const p = c / kA8Panel;
    int const cc = static_cast<int>(c % kA8Panel), blk = cc / 16, lane = cc % 16;
    for (std::int64_t g = 0; g < groups; ++g) {
      std::int64_t const src = c * wgroups + g * w.group / group_size;
      std::uint8_t* gd = w.data.data() + (p * groups + g) * w.record_bytes();
      std::uint8_t* gs = gd + w.code_bytes();
      put_scale(gs + cc * w.scale_bytes(), scales[src]);
      if (w.asym) put_scale(gs + (kA8Panel + cc) * w.scale_bytes(), offsets[src]);
      for (int i = 0; i < w.group; ++i) {
        std::int64_t const e = g * w.group + i;
        int const quad = i / 4, t = i % 4;
        int const v = bits == 4 ? quad / 2 : quad;
        std::uint8_t* dst = gd + (v * 4 + blk) * 64 + lane * 4 + t;
        if (bits == 4) {
          std::uint8_t const byte = static_cast<std::uint8_t const*>(qweight)[c * (k / 2) + e / 2];
          std::uint8_t const u = (e % 2) != 0 ? byte >> 4 : byte & 0x0F;
          *dst |= static_cast<std::uint8_t>(u << ((quad % 2) * 4));
        } else {
          *dst = static_cast<std::uint8_t>(static_cast<int>(static_cast<std::int8_t const*>(qweight)[c * k + e]) + 128);
        }
      }
    }
  }
  if (bias != nullptr) {
    w.bias.assign(static_cast<std::size_t>(panels * kA8Panel), 0.0f);  // padded: the tiles load whole blocks
    std::copy(bias, bias + n, w.bias.begin());
  }
  return w;
}

void unpack_a8_weight(A8PackedWeight const& w, int group_size, void* qweight, float* scales, float* offsets) {
  std::string const where = "unpack_a8_weight: ";
  if (group_size < w.group || group_size % w.group != 0 || w.k % group_size != 0 ||
      (group_size != w.group && w.group != 32)) {
    throw std::invalid_argument(where + "group_size " + std::to_string(group_size) +
                                " is not the one the weight was packed with");
  }
  if (w.asym != (offsets != nullptr)) {
    throw std::invalid_argument(where + (w.asym ? "offsets must be given for an asymmetric weight"
                                                : "offsets must be null for a symmetric weight"));
  }
  std::int64_t const wgroups = w.k / group_size, groups = w.groups(), stride = group_size / w.group;
  for (std::int64_t c = 0; c < w.n; ++c) {
    std::int64_t const p = c / kA8Panel;
    int const cc = static_cast<int>(c % kA8Panel);
    for (std::int64_t g = 0; g < groups; ++g) {
      if (g % stride == 0) {  // a group of 64 / 128 repeats its scale over each 32: take the first
        std::int64_t const dst = c * wgroups + g / stride;
        scales[dst] = scale_at(w, p, g, cc, 0);
        if (w.asym) offsets[dst] = scale_at(w, p, g, cc, 1);
      }
      for (int i = 0; i < w.group; ++i) {
        std::int64_t const e = g * w.group + i;
        int const u = code(w, p, g, cc, i);
        if (w.bits == 4) {
          std::uint8_t& dst = static_cast<std::uint8_t*>(qweight)[c * (w.k / 2) + e / 2];
          dst = (e % 2) != 0 ? static_cast<std::uint8_t>((dst & 0x0F) | (u << 4))
                             : static_cast<std::uint8_t>((dst & 0xF0) | u);
        } else {
          static_cast<std::int8_t*>(qweight)[c * w.k + e] = static_cast<std::int8_t>(u - 128);
        }
      }
    }
  }
}

void a8_int8_row(A8PackedWeight const& w, std::int64_t row, float* out) {
  std::int64_t const p = row / kA8Panel;
  int const cc = static_cast<int>(row % kA8Panel);
  for (std::int64_t g = 0; g < w.groups(); ++g) {
    float const s = scale_at(w, p, g, cc, 0);
    for (int i = 0; i < w.group; ++i) out[g * w.group + i] = float(code(w, p, g, cc, i) - 128) * s;
  }
}

void quantize_a8_activations(void const* x, ScalarType dtype, std::int64_t m, std::int64_t k, int group, std::int8_t* q,
                             float* d, std::int32_t* sq, float* ds, int act_bits) {
  if (act_bits != 8 && act_bits != 16) {
    throw std::invalid_argument("a8_gemm: act_bits must be 8 or 16, got " + std::to_string(act_bits));
  }
  int const limbs = act_bits / 8;
  switch (dtype) {
    case ScalarType::kFloat32:
      return quantize_rows(static_cast<float const*>(x), m, k, group, q, d, sq, ds, limbs);
    case ScalarType::kBFloat16:
      return quantize_rows(static_cast<BFloat16 const*>(x), m, k, group, q, d, sq, ds, limbs);
    case ScalarType::kFloat16:
      return quantize_rows(static_cast<Float16 const*>(x), m, k, group, q, d, sq, ds, limbs);
    default:
      throw std::invalid_argument("a8_gemm: x must be fp32, bf16 or fp16");
  }
}

namespace a8_detail {

void gemm_portable(A8PackedWeight const& w, Activations const& a, std::int64_t m_lo, std::int64_t m_hi,
                   std::int64_t p_lo, std::int64_t p_hi, void* out, ScalarType dtype) {
  dispatch_float_type(dtype, [&](auto t) {
    using T = decltype(t);
    gemm_portable_t(w, a, m_lo, m_hi, p_lo, p_hi, static_cast<T*>(out));
  });
}

}  // namespace a8_detail

bool a8_vectorised() {
  // VPDPBUSD needs AVX512-VNNI, which kAvx512 includes and a kAvx512F CPU may have.
  Isa const isa = selected_isa();
  return isa == Isa::kAvx512 || (isa == Isa::kAvx512F && cpu_features().avx512vnni);
}

std::size_t a8_workspace_bytes(std::int64_t m, A8PackedWeight const& w, int act_bits) {
  std::size_t const rows = static_cast<std::size_t>(std::max<std::int64_t>(m, 0));
  std::size_t const per = rows * static_cast<std::size_t>(w.groups()) * 4;
  std::size_t const limbs = act_bits == 16 ? 2 : 1;
  return align64(rows * limbs * static_cast<std::size_t>(w.k)) + 3 * align64(per);
}

void launch_a8_gemm(A8GemmParams const& p, ThreadPool& pool) {
  if (p.weight == nullptr) throw std::invalid_argument("a8_gemm: weight must be given");
  if (p.m < 0) throw std::invalid_argument("a8_gemm: m must be >= 0, got " + std::to_string(p.m));
  if (!is_float_type(p.dtype)) {
    throw std::invalid_argument(std::string("a8_gemm: dtype must be float32, bfloat16 or float16, got ") +
                                scalar_type_name(p.dtype));
  }
  if (p.num_threads < 1) {
    throw std::invalid_argument("a8_gemm: num_threads must be >= 1, got " + std::to_string(p.num_threads));
  }
  if (p.act_bits != 8 && p.act_bits != 16) {
    throw std::invalid_argument("a8_gemm: act_bits must be 8 or 16, got " + std::to_string(p.act_bits));
  }
  if (p.m == 0) return;
  if (p.x == nullptr || p.out == nullptr || p.workspace == nullptr) {
    throw std::invalid_argument("a8_gemm: x, out and workspace must be given");
  }
  int const limbs = p.act_bits / 8;
  A8PackedWeight const& w = *p.weight;
  std::int64_t const groups = w.groups();
  std::size_t const per = align64(static_cast<std::size_t>(p.m * groups) * 4);
  auto* base = static_cast<unsigned char*>(p.workspace);
  a8_detail::Activations a;
  a.k = w.k;
  a.groups = groups;
  auto* q = reinterpret_cast<std::int8_t*>(base);
  auto* d = reinterpret_cast<float*>(base + align64(static_cast<std::size_t>(p.m * limbs * w.k)));
  auto* sq = reinterpret_cast<std::int32_t*>(reinterpret_cast<unsigned char*>(d) + per);
  auto* ds = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(sq) + per);
  a.q = q;
  a.d = d;
  a.sq = sq;
  a.ds = ds;
  a.limbs = limbs;

  bool const vnni = a8_vectorised();

  {  // The activations by rows (each group's scale depends on that group alone).
    std::size_t const row_bytes = static_cast<std::size_t>(w.k) * scalar_type_size(p.dtype);
    int const threads =
        static_cast<int>(std::min<std::int64_t>({p.num_threads, p.m, std::max<std::int64_t>((p.m * w.k) >> 15, 1)}));
    auto quantize = [&](int i, int n) {
      std::int64_t const lo = p.m * i / n, hi = p.m * (i + 1) / n;
      if (lo >= hi) return;
      void const* x = static_cast<char const*>(p.x) + static_cast<std::size_t>(lo) * row_bytes;
      std::size_t const off = static_cast<std::size_t>(lo * groups);
      std::int8_t* const qr = q + lo * limbs * w.k;
      if (vnni) {
        a8_detail::quantize_avx512(x, p.dtype, hi - lo, w.k, w.group, qr, d + off, sq + off, ds + off, limbs);
      } else {
        quantize_a8_activations(x, p.dtype, hi - lo, w.k, w.group, qr, d + off, sq + off, ds + off, p.act_bits);
      }
    };
    pool.run(std::max(threads, 1), TaskRef(quantize));
  }

  // Threads split the panels (each weight byte read by one thread); with fewer panels than ~4 per
  // thread and enough rows, they split the rows instead (in tiles of 4), every thread reading the
  // whole weight from the shared cache. Each is worth waking with ~256k multiply-adds of its own.
  std::int64_t const panels = w.panels();
  std::int64_t const work = p.m * panels * kA8Panel * w.k;
  int const threads = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(p.num_threads, work >> 18)));
  bool const by_rows = panels < 4 * threads && p.m >= 8 * threads;
  auto run = [&](std::int64_t m_lo, std::int64_t m_hi, std::int64_t p_lo, std::int64_t p_hi) {
    if (m_lo >= m_hi || p_lo >= p_hi) return;
    if (vnni) {
      a8_detail::gemm_avx512vnni(w, a, m_lo, m_hi, p_lo, p_hi, p.out, p.dtype);
    } else {
      a8_detail::gemm_portable(w, a, m_lo, m_hi, p_lo, p_hi, p.out, p.dtype);
    }
  };
  auto task = [&](int i, int n) {
    if (by_rows) {
      std::int64_t const tiles = (p.m + 3) / 4;
      run(std::min(p.m, tiles * i / n * 4), std::min(p.m, tiles * (i + 1) / n * 4), 0, panels);
    } else {
      run(0, p.m, panels * i / n, panels * (i + 1) / n);
    }
  };
  pool.run(threads, TaskRef(task));
}

}  // namespace inflight::kernels::cpu
