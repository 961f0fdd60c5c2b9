// CPU kernel pieces that have no Python entry point of their own: the vectorised gated-MLP activations
// (activation.h) against float64, the A8 GEMM's two activation quantisers (a8_gemm.h) against each
// other, bit for bit, the A8 and W8A8 packs' inverses (unpack_a8_weight, unpack_w8a8_weight) against the
// packed tensors, and the fused layer stack's glue (llama_glue.h) built for AVX-512 against its baseline
// copy (this file's own instantiation), bit for bit. Tests of a path the CPU lacks are skipped.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "a8_gemm.h"
#include "activation.h"
#include "cpu_features.h"
#include "llama_glue.h"
#include "llama_glue_isa.h"
#include "thread_pool.h"
#include "w8a8_gemm.h"

namespace kc = inflight::kernels::cpu;
namespace ik = inflight::kernels;

namespace {

// Error of `got` in units of the fp32 spacing at max(|want|, floor).
double ulps(float got, double want, double floor) {
  double const ref = std::max(std::fabs(want), floor);
  int e = 0;
  std::frexp(static_cast<float>(ref), &e);
  return std::fabs(got - want) / std::ldexp(1.0, e - 24);
}

// Every 97th fp32 bit pattern that is finite (both signs): ~88M inputs over the whole range.
std::vector<float> sweep() {
  std::vector<float> x;
  for (std::uint32_t b = 0; b < 0x7f800000u; b += 97) {
    float f;
    std::memcpy(&f, &b, 4);
    x.push_back(f);
    x.push_back(-f);
  }
  return x;
}

bool has_avx512f() { return kc::best_isa() >= kc::Isa::kAvx512F; }

}  // namespace

// Against float64, over the whole fp32 range: within 4 ulp wherever the result is a normal fp32 number,
// but where e^-x (SiLU, x < -88.7) or e^-2z (GELU, x < -10) overflows and x / (1 + inf) = -0, as with
// torch's and libm's exp (the true value is below 1e-37 there). libm's form of GELU, 1 + tanh(z),
// cancels below x ~ -2 (~250 units of 2^-10 |x| off); this one does not.
void expect_within_ulps(bool gelu, double limit) {
  std::vector<float> x = sweep(), out(x.size());
  kc::gated_activation_avx512f(x.data(), out.data(), static_cast<std::int64_t>(x.size()), gelu);
  double worst = 0;
  float at = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    double const v = x[i];
    // GELU: z as every fp32 evaluation rounds it (the kernel's operations; |d log gelu / dz| ~ 2|z|
    // turns its last-bit rounding into up to ~2|z| ulp of the result, in torch's too), then the rest
    // in float64 through the same identity (1 + tanh(z) cancels in float64 too, from x ~ -6).
    float const xf = x[i];
    double const z = float(M_SQRT2 * M_2_SQRTPI * 0.5) * std::fma(0.044715f, (xf * xf) * xf, xf);
    double const want = gelu ? v / (1.0 + std::exp(-2.0 * z)) : v / (1.0 + std::exp(-v));
    if (!std::isfinite(want) || std::fabs(want) < 1.2e-38) continue;  // subnormal: absolute error < 1e-44
    if ((gelu ? -2.0 * z : -v) > 88.7) continue;  // e^.. overflows: x / (1 + inf) = -0 (|want| < 1e-37)
    double const err = ulps(out[i], want, 0.0);
    if (err > worst) {
      worst = err;
      at = x[i];
    }
  }
  EXPECT_LE(worst, limit) << "at x = " << at;
}

TEST(GatedActivation, SiluWithinFourUlp) {
  if (!has_avx512f()) GTEST_SKIP() << "no AVX-512F";
  expect_within_ulps(false, 4.0);
}

TEST(GatedActivation, GeluTanhWithinFourUlp) {
  if (!has_avx512f()) GTEST_SKIP() << "no AVX-512F";
  expect_within_ulps(true, 4.0);
}

TEST(GatedActivation, TailAndSpecialValues) {
  if (!has_avx512f()) GTEST_SKIP() << "no AVX-512F";
  std::vector<float> x = {0.0f, -0.0f, 1.0f, -1.0f, 100.0f, -100.0f, 1e30f, -1e30f, 0.3f, 0.7f, -0.7f};
  for (bool gelu : {false, true}) {
    std::vector<float> out(x.size(), 123.0f);
    kc::gated_activation_avx512f(x.data(), out.data(), static_cast<std::int64_t>(x.size()), gelu);
    EXPECT_EQ(out[0], 0.0f);
    EXPECT_FLOAT_EQ(out[4], 100.0f);       // silu(100) = gelu(100) = 100
    EXPECT_LT(std::fabs(out[5]), 1e-30f);  // silu(-100) = -3.8e-42, gelu(-100) = -0
    EXPECT_EQ(out[6], 1e30f);
    EXPECT_NEAR(out[2], gelu ? 0.841192f : 0.731059f, 1e-6);
  }
}

TEST(A8Quantize, VectorAndPortableGiveTheSameBits) {
  if (!kc::cpu_features().avx512f || !kc::cpu_features().avx512vnni) GTEST_SKIP() << "no AVX512-VNNI";
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::int64_t const m = 4096, k = 64;
  std::vector<float> x(m * k);
  for (std::int64_t r = 0; r < m; ++r) {
    float const scale = std::pow(unit(rng), 4.0f) * 100.0f;  // magnitudes over many octaves
    for (std::int64_t i = 0; i < k; ++i) x[r * k + i] = normal(rng) * scale;
  }
  for (int limbs : {1, 2}) {
    for (int group : {16, 32}) {
      std::int64_t const groups = m * k / group;
      std::vector<std::int8_t> q1(m * k * limbs), q2(m * k * limbs);
      std::vector<float> d1(groups), d2(groups), ds1(groups), ds2(groups);
      std::vector<std::int32_t> s1(groups), s2(groups);
      kc::quantize_a8_activations(x.data(), inflight::kernels::ScalarType::kFloat32, m, k, group, q1.data(), d1.data(),
                                  s1.data(), ds1.data(), 8 * limbs);
      kc::a8_detail::quantize_avx512(x.data(), inflight::kernels::ScalarType::kFloat32, m, k, group, q2.data(),
                                     d2.data(), s2.data(), ds2.data(), limbs);
      EXPECT_EQ(q1, q2) << "group " << group << ", limbs " << limbs;
      if (limbs == 2) {  // the limbs make the 16-bit code: 256 h + l within +-32512, its sum sq
        for (std::int64_t r = 0; r < m; r += 97) {
          std::int32_t sum = 0;
          for (std::int64_t i = 0; i < group; ++i) {
            int const v = 256 * q1[r * 2 * k + i] + q1[r * 2 * k + k + i];
            EXPECT_LE(std::abs(v), 32512);
            EXPECT_LE(std::abs(v - x[r * k + i] / d1[r * (k / group)]), 0.5f + 1e-3f);
            sum += v;
          }
          EXPECT_EQ(sum, s1[r * (k / group)]);
        }
      }
      EXPECT_EQ(s1, s2);
      EXPECT_EQ(0, std::memcmp(d1.data(), d2.data(), d1.size() * 4));
      EXPECT_EQ(0, std::memcmp(ds1.data(), ds2.data(), ds1.size() * 4));
    }
  }
}

// ---- the layer stack's glue: AVX-512 copy against the baseline copy ----------------------------------

// pack_a8_weight's inverse gives back the tensors exactly (int4 with and without offsets, int8; groups
// of 16 to 128; scales that fp16 holds and ones it does not), and a8_int8_row is code x scale in fp32.
TEST(A8Pack, UnpackGivesBackTheTensorsAndRowsDequantise) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  struct Case {
    int bits, group;
    bool asym, f16;
  };
  for (Case const c : {Case{4, 32, true, true}, Case{4, 64, false, true}, Case{4, 128, true, false},
                       Case{8, 16, false, true}, Case{8, 32, false, false}, Case{8, 128, false, true}}) {
    std::int64_t const n = 70, k = 256, wg = k / c.group;
    std::vector<std::uint8_t> q(static_cast<std::size_t>(c.bits == 4 ? n * k / 2 : n * k));
    for (auto& b : q) b = static_cast<std::uint8_t>(byte(rng));
    if (c.bits == 8) {
      for (auto& b : q) b = b == 128 ? 0 : b;  // int8 codes in [-127, 127]
    }
    std::vector<float> s(static_cast<std::size_t>(n * wg)), o(s.size());
    for (std::size_t i = 0; i < s.size(); ++i) {
      // values fp16 holds, or ones with more mantissa bits
      s[i] = normal(rng) * 0.01f;
      o[i] = normal(rng);
      if (c.f16) {
        s[i] = ik::to_float(ik::from_float<ik::Float16>(s[i]));
        o[i] = ik::to_float(ik::from_float<ik::Float16>(o[i]));
      }
    }
    kc::A8PackedWeight const w =
        kc::pack_a8_weight(c.bits, q.data(), s.data(), c.asym ? o.data() : nullptr, nullptr, n, k, c.group);
    EXPECT_EQ(w.f16_scales, c.f16);
    std::vector<std::uint8_t> q2(q.size(), 0xAA);
    std::vector<float> s2(s.size(), -1.0f), o2(o.size(), -1.0f);
    kc::unpack_a8_weight(w, c.group, q2.data(), s2.data(), c.asym ? o2.data() : nullptr);
    EXPECT_EQ(q2, q) << "bits " << c.bits << " group " << c.group;
    EXPECT_EQ(s2, s) << "bits " << c.bits << " group " << c.group;
    if (c.asym) EXPECT_EQ(o2, o) << "group " << c.group;
    if (c.bits == 8) {
      std::vector<float> row(static_cast<std::size_t>(k));
      for (std::int64_t r : {std::int64_t{0}, std::int64_t{63}, std::int64_t{64}, n - 1}) {
        kc::a8_int8_row(w, r, row.data());
        for (std::int64_t i = 0; i < k; ++i) {
          float const want = float(static_cast<std::int8_t>(q[r * k + i])) * s[r * wg + i / c.group];
          ASSERT_EQ(row[i], want) << "row " << r << " element " << i;
        }
      }
    }
    EXPECT_THROW(kc::unpack_a8_weight(w, c.group, q2.data(), s2.data(), c.asym ? nullptr : o2.data()),
                 std::invalid_argument);
  }
}

// pack_w8a8_weight's inverse gives back the codes and scales exactly (k not a multiple of 4, n not one of 16).
TEST(W8A8Pack, UnpackGivesBackTheTensors) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> code(-127, 127);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto const [n, k] : {std::pair<std::int64_t, std::int64_t>{16, 64}, {37, 101}, {3, 5}}) {
    std::vector<std::int8_t> q(static_cast<std::size_t>(n * k));
    for (auto& v : q) v = static_cast<std::int8_t>(code(rng));
    std::vector<float> s(static_cast<std::size_t>(n));
    for (auto& v : s) v = normal(rng) * 0.01f;
    kc::W8A8PackedWeight const w = kc::pack_w8a8_weight(q.data(), s.data(), n, k);
    std::vector<std::int8_t> q2(q.size(), 99);
    std::vector<float> s2(s.size(), -1.0f);
    kc::unpack_w8a8_weight(w, q2.data(), s2.data());
    EXPECT_EQ(q2, q) << "n " << n << " k " << k;
    EXPECT_EQ(s2, s) << "n " << n << " k " << k;
  }
}

namespace {

using inflight::kernels::BFloat16;
using inflight::kernels::Float16;
using inflight::kernels::ScalarType;
namespace glue = kc::llama_glue;

// Values over many octaves, both signs, some exact zeros: what rounding and the norms' sums see.
template <class T>
std::vector<T> random_values(std::size_t n, std::uint32_t seed, float scale = 3.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    float const x = i % 37 == 5 ? 0.0f : normal(rng) * scale * std::pow(unit(rng), 3.0f) * 8.0f;
    v[i] = inflight::kernels::from_float<T>(x);
  }
  return v;
}

using kc::glue_avx512f::dtype_of;

template <class T>
bool same_bits(std::vector<T> const& a, std::vector<T> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

constexpr int kThreads = 2;

template <class T, bool kGemma, bool kAdd>
void check_rms_norm(int tokens, int d, bool gather) {
  kc::ThreadPool& pool = kc::ThreadPool::global();
  auto const x = random_values<T>(std::size_t(tokens) * d, 11 + d);
  auto const w = random_values<T>(std::size_t(d), 12 + d, 0.5f);
  std::vector<std::int64_t> rows;
  for (int t = 0; t < tokens; ++t) rows.push_back((t * 7 + 3) % tokens);
  auto want = random_values<T>(std::size_t(tokens) * d, 13 + d);  // kAdd adds into it
  auto got = want;
  std::int64_t const* r = gather ? rows.data() : nullptr;
  glue::rms_norm<T, kGemma, kAdd>(x.data(), w.data(), want.data(), tokens, d, 1e-6f, kc::Threads{pool, kThreads}, r);
  kc::glue_avx512f::rms_norm(dtype_of<T>(), kGemma, kAdd, x.data(), w.data(), got.data(), tokens, d, 1e-6f, pool,
                             kThreads, r);
  EXPECT_TRUE(same_bits(want, got)) << "rms_norm gemma=" << kGemma << " add=" << kAdd << " tokens=" << tokens
                                    << " d=" << d << " gather=" << gather;
}

template <class T>
void check_glue_type() {
  for (int tokens : {1, 5, 40}) {
    for (int d : {576, 100, 7, 2304}) {
      for (bool gather : {false, true}) {
        check_rms_norm<T, false, false>(tokens, d, gather);
        check_rms_norm<T, true, false>(tokens, d, gather);
        check_rms_norm<T, true, true>(tokens, d, gather);
        check_rms_norm<T, false, true>(tokens, d, gather);
      }
    }
  }
  kc::ThreadPool& pool = kc::ThreadPool::global();
  for (int tokens : {1, 3, 33}) {
    for (int d : {576, 13}) {
      auto const y = random_values<T>(std::size_t(tokens) * d, 21);
      auto want = random_values<T>(std::size_t(tokens) * d, 22);
      auto got = want;
      glue::add_into<T>(want.data(), y.data(), tokens, d, kc::Threads{pool, kThreads});
      kc::glue_avx512f::add_into(dtype_of<T>(), got.data(), y.data(), tokens, d, pool, kThreads);
      EXPECT_TRUE(same_bits(want, got)) << "add_into tokens=" << tokens << " d=" << d;
    }
    for (int n : {1536, 100}) {
      auto const gate_up = random_values<T>(std::size_t(tokens) * 2 * n, 23);
      for (bool gelu : {false, true}) {
        std::vector<T> want(std::size_t(tokens) * n), got(std::size_t(tokens) * n);
        if (gelu) {
          glue::act_mul<T, true>(gate_up.data(), want.data(), tokens, n, kc::Threads{pool, kThreads});
        } else {
          glue::act_mul<T, false>(gate_up.data(), want.data(), tokens, n, kc::Threads{pool, kThreads});
        }
        kc::glue_avx512f::act_mul(dtype_of<T>(), gelu, gate_up.data(), got.data(), tokens, n, pool, kThreads);
        EXPECT_TRUE(same_bits(want, got)) << "act_mul gelu=" << gelu << " tokens=" << tokens << " n=" << n;
      }
    }
  }
  // QK-norm + RoPE over fused qkv rows (3 q heads, 1 k head, then v), positions read from a table.
  int const heads = 3, kv_heads = 1;
  for (int hd : {64, 128}) {
    for (int tokens : {1, 4, 35}) {
      std::int64_t const stride = std::int64_t(heads + 2 * kv_heads) * hd;
      auto const qkv = random_values<T>(std::size_t(tokens) * stride, 31 + hd);
      auto const table = random_values<T>(std::size_t(64) * 2 * hd, 32, 0.4f);
      auto const q_norm = random_values<T>(std::size_t(hd), 33, 0.5f);
      auto const k_norm = random_values<T>(std::size_t(hd), 34, 0.5f);
      std::vector<std::int64_t> positions;
      for (int t = 0; t < tokens; ++t) positions.push_back((t * 13 + 5) % 64);
      for (int variant = 0; variant < 4; ++variant) {
        bool const qk_norm = variant >= 1;
        bool const gemma = variant == 2;
        int const rotation = variant == 3 ? 32 : 0;
        auto want = qkv;
        auto got = qkv;
        T const* qn = qk_norm ? q_norm.data() : nullptr;
        T const* kn = qk_norm ? k_norm.data() : nullptr;
        if (gemma) {
          glue::qk_norm_rope<T, true>(want.data(), stride, table.data(), positions.data(), tokens, heads, kv_heads, hd,
                                      qn, kn, 1e-6f, rotation, kc::Threads{pool, kThreads});
        } else {
          glue::qk_norm_rope<T, false>(want.data(), stride, table.data(), positions.data(), tokens, heads, kv_heads, hd,
                                       qn, kn, 1e-6f, rotation, kc::Threads{pool, kThreads});
        }
        kc::glue_avx512f::qk_norm_rope(dtype_of<T>(), gemma, got.data(), stride, table.data(), positions.data(), tokens,
                                       heads, kv_heads, hd, qn, kn, 1e-6f, rotation, pool, kThreads);
        EXPECT_TRUE(same_bits(want, got))
            << "qk_norm_rope variant=" << variant << " head_dim=" << hd << " tokens=" << tokens;
      }
    }
  }
}

}  // namespace

// The glue's AVX-512 copy (llama_glue_avx512f.cpp, -ffp-contract=off) must compute the bits of the
// baseline copy: the norms' sums in torch's order, every rounding point kept, no FMA contraction.
TEST(LayerGlue, Avx512CopyGivesTheBaselineBitsFp32) {
  if (!has_avx512f()) GTEST_SKIP() << "no AVX-512F";
  check_glue_type<float>();
}

TEST(LayerGlue, Avx512CopyGivesTheBaselineBitsBf16) {
  if (!has_avx512f()) GTEST_SKIP() << "no AVX-512F";
  check_glue_type<BFloat16>();
}

TEST(LayerGlue, Avx512CopyGivesTheBaselineBitsFp16) {
  if (!has_avx512f()) GTEST_SKIP() << "no AVX-512F";
  check_glue_type<Float16>();
}
