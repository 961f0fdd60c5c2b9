// The AVX-512 panel strategy: batched bf16 x, m >= kPanelMinM. gemm_avx512.h lists the others.
#include "gemm_avx512.h"

namespace inflight::kernels::cpu::gemm_avx512 {
namespace {

// ---- Batched bf16 x, m >= kPanelMinM: W4Bf16Panel, W8Bf16Panel ----------------------------------------------------
//
// Each thread dequantises a panel of weight rows (at most kPanelBytes, so it stays in L2) into bf16 in
// natural k order, then runs the dense bf16 kernel (VDPBF16PS, dense_gemm_avx512) of all m rows against
// it, writing that column block of out. The weights are rounded to bf16 once more (s * q + o in fp32,
// then to nearest even): the numerics of the model dequantised to bf16. The dequantisation (7
// instructions per 32 weights) is shared by all m rows, where W4Dot repeats it per 3-row tile and
// multiplies in 128-weight chunks with a scale FMA each; from ~12 rows on the panel is faster (1 thread,
// SmolLM2 shapes: ~1.1x at 16 rows, ~1.5x at 64, ~1.6-1.8x at 256).
constexpr std::int64_t kPanelMinM = 12;
constexpr std::int64_t kPanelBytes = 96 * 1024;

// Runs a panel dequantiser D (D::dequantise(n0, rows, bf16 panel), D::p with the GEMM's m, n, k, x,
// bias, out and num_threads) over all of N: panels of near-equal size, a multiple of the thread count.
template <class D>
void run_panels(D const& deq, ThreadPool& pool) {
  auto const& p = deq.p;
  std::int64_t const cap = kPanelBytes / (2 * p.k) / 4 * 4;
  int const threads = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(p.num_threads, (p.n + 7) / 8)));
  std::int64_t panels = (p.n + cap - 1) / cap;
  panels = (panels + threads - 1) / threads * threads;
  std::int64_t const rows = std::min(cap, ((p.n + panels - 1) / panels + 3) / 4 * 4);
  std::int64_t const count = (p.n + rows - 1) / rows;
  auto task = [&](int i, int nt) {
    alignas(64) std::uint16_t panel[kPanelBytes / 2];
    for (std::int64_t c = count * i / nt; c < count * (i + 1) / nt; ++c) {
      std::int64_t const n0 = c * rows;
      std::int64_t const nr = std::min(rows, p.n - n0);
      deq.dequantise(n0, nr, panel);
      DenseGemmParams d;
      d.x = p.x;
      d.weight = panel;
      d.bias = p.bias != nullptr ? static_cast<BFloat16 const*>(p.bias) + n0 : nullptr;
      d.out = static_cast<BFloat16*>(p.out) + n0;
      d.m = p.m;
      d.n = nr;
      d.k = p.k;
      d.out_row_stride = p.n;
      d.dtype = ScalarType::kBFloat16;
      d.num_threads = 1;
      dense_gemm_avx512(d, pool);
    }
  };
  int const used = static_cast<int>(std::min<std::int64_t>(threads, count));
  if (used <= 1) {
    task(0, 1);
  } else {
    pool.run(used, TaskRef(task));
  }
}

// Whether a panel of at least 8 rows fits kPanelBytes.
inline bool panel_fits(std::int64_t k) { return kPanelBytes / (2 * k) >= 8; }

template <class ST, bool kAsym>
struct W4Bf16Panel {
  W4A16GemmParams const& p;

  // Rows [n0, n0 + rows) of the weight as bf16, row stride k. Per row and group, the 16 possible weights
  // (q * scale + offset in fp32, rounded to bf16) form a word table; VPERMW looks 32 weights up at once
  // by their nibbles, already in natural k order.
  void dequantise(std::int64_t n0, std::int64_t rows, std::uint16_t* panel) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    __m512 const iota = nibble_values<kAsym>();
    __m512i const nibbles = _mm512_set1_epi32(0x000f000f);
    for (std::int64_t r = 0; r < rows; ++r) {
      std::uint8_t const* w = p.qweight + (n0 + r) * (k_dim / 2);
      ST const* s = static_cast<ST const*>(p.scales) + (n0 + r) * groups;
      ST const* o = kAsym ? static_cast<ST const*>(p.offsets) + (n0 + r) * groups : nullptr;
      std::uint16_t* dst = panel + r * k_dim;
      for (std::int64_t g = 0; g < groups; ++g) {
        __m512 const sc = Vec512::bcast(s + g);
        __m512 const t32 = group_table<kAsym>(iota, sc, kAsym ? Vec512::bcast(o + g) : iota);
        __m512i const table = (__m512i)_mm512_cvtne2ps_pbh(t32, t32);  // words 0..15 (and again 16..31)
        for (std::int64_t kb = g * g_size; kb < (g + 1) * g_size; kb += 32) {
          __m512i const d = _mm512_cvtepu8_epi32(load_bytes16(w + kb / 2));
          // (d | d << 12) & 0x000f000f: byte j's low nibble in word 2j (k = kb + 2j), its high in word 2j + 1.
          __m512i const idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), nibbles, 0xa8);
          _mm512_store_si512(dst + kb, _mm512_permutexvar_epi16(idx, table));
        }
      }
    }
  }
};

// int8 weights: w = q * scale in fp32, rounded to bf16.
template <class ST, bool kFp8>
struct W8Bf16Panel {
  W8A16GemmParams const& p;

  void dequantise(std::int64_t n0, std::int64_t rows, std::uint16_t* panel) const {
    std::int64_t const k_dim = p.k;
    int const g_size = p.group_size;
    std::int64_t const groups = k_dim / g_size;
    for (std::int64_t r = 0; r < rows; ++r) {
      std::int8_t const* w = p.qweight + (n0 + r) * k_dim;
      ST const* s = static_cast<ST const*>(p.scales) + (n0 + r) * groups;
      std::uint16_t* dst = panel + r * k_dim;
      // 32 weights per step, each 16 with its group's scale (groups of 16 or more).
      for (std::int64_t kb = 0; kb < k_dim; kb += 32) {
        __m512 const a = _mm512_mul_ps(Vec512::w8<kFp8>(w + kb), Vec512::bcast(s + kb / g_size));
        __m512 const b = _mm512_mul_ps(Vec512::w8<kFp8>(w + kb + 16), Vec512::bcast(s + (kb + 16) / g_size));
        _mm512_store_si512(dst + kb, (__m512i)_mm512_cvtne2ps_pbh(b, a));
      }
    }
  }
};

}  // namespace

bool w4a16_panels(W4A16GemmParams const& p, ThreadPool& pool) {
  if (p.dtype != ScalarType::kBFloat16 || p.m < kPanelMinM || !panel_fits(p.k)) return false;
  dispatch_float_type(p.scale_type, [&](auto st) {
    using ST = decltype(st);
    if (p.offsets != nullptr) {
      run_panels(W4Bf16Panel<ST, true>{p}, pool);
    } else {
      run_panels(W4Bf16Panel<ST, false>{p}, pool);
    }
  });
  return true;
}

bool w8a16_panels(W8A16GemmParams const& p, ThreadPool& pool) {
  // Panels dequantise 32 weights per step: k a multiple of 32 (groups of 16 allow k = 16 (2j + 1)).
  if (p.dtype != ScalarType::kBFloat16 || p.m < kPanelMinM || !panel_fits(p.k) || p.k % 32 != 0) return false;
  dispatch_float_type(p.scale_type, [&](auto st) {
    if (p.fp8_e4m3) {
      run_panels(W8Bf16Panel<decltype(st), true>{p}, pool);
    } else {
      run_panels(W8Bf16Panel<decltype(st), false>{p}, pool);
    }
  });
  return true;
}

}  // namespace inflight::kernels::cpu::gemm_avx512
