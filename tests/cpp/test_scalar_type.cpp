// The element-type vocabulary (inflight/kernels/scalar_type.h): names, sizes, the dispatch, and the
// scalar conversions against independent references: the compiler's _Float16 for fp16, exact double
// arithmetic for bf16 and FP8 E4M3. Every 16-bit pattern and every E4M3 byte is decoded; fp32 inputs
// are swept with a stride that visits every exponent and the rounding boundaries.
#include "inflight/kernels/scalar_type.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace ik = inflight::kernels;

namespace {

float as_float(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

std::uint16_t bits_of(_Float16 h) {
  std::uint16_t u;
  std::memcpy(&u, &h, sizeof u);
  return u;
}

// Round to nearest even, by exact arithmetic on the two neighbouring bf16 values.
std::uint16_t reference_bf16(float f) {
  std::uint32_t const u = bits_of(f);
  std::uint16_t const lo = static_cast<std::uint16_t>(u >> 16);  // toward zero
  if ((u & 0xffffu) == 0) return lo;
  std::uint16_t const hi = static_cast<std::uint16_t>(lo + 1);  // away from zero (may be infinity)
  double const v = std::fabs(static_cast<double>(f));
  double const lo_v = std::fabs(static_cast<double>(as_float(static_cast<std::uint32_t>(lo) << 16)));
  // The value past the largest finite one, had the exponent room: 2^128.
  double const hi_v = (hi & 0x7fffu) == 0x7f80u
                          ? std::ldexp(1.0, 128)
                          : std::fabs(static_cast<double>(as_float(static_cast<std::uint32_t>(hi) << 16)));
  double const d_lo = v - lo_v, d_hi = hi_v - v;
  if (d_lo < d_hi) return lo;
  if (d_hi < d_lo) return hi;
  return (lo & 1u) ? hi : lo;
}

// A sweep of fp32 bit patterns: every 2^12-th pattern (all exponents and signs), plus the patterns
// next to each multiple of 2^13 (fp16 rounding boundaries) and 2^16 (bf16 boundaries).
std::vector<std::uint32_t> fp32_sweep() {
  std::vector<std::uint32_t> out;
  for (std::uint64_t u = 0; u <= 0xffffffffull; u += 0x1000u) {
    for (std::uint32_t d : {0u, 1u, 0xfffu, 0x1000u, 0x1001u, 0x7fffu, 0x8000u, 0x8001u}) {
      out.push_back(static_cast<std::uint32_t>(u + d));
    }
  }
  return out;
}

TEST(ScalarType, NamesSizesAndFloatTypes) {
  EXPECT_STREQ(ik::scalar_type_name(ik::ScalarType::kFloat32), "float32");
  EXPECT_STREQ(ik::scalar_type_name(ik::ScalarType::kBFloat16), "bfloat16");
  EXPECT_STREQ(ik::scalar_type_name(ik::ScalarType::kFloat16), "float16");
  EXPECT_STREQ(ik::scalar_type_name(ik::ScalarType::kUInt64), "uint64");
  EXPECT_STREQ(ik::scalar_type_name(ik::ScalarType::kFloat8E4M3), "float8_e4m3fn");
  EXPECT_EQ(ik::scalar_type_size(ik::ScalarType::kFloat8E4M3), 1u);
  EXPECT_FALSE(ik::is_float_type(ik::ScalarType::kFloat8E4M3));
  EXPECT_STREQ(ik::scalar_type_name(static_cast<ik::ScalarType>(99)), "unknown");
  EXPECT_EQ(ik::scalar_type_size(ik::ScalarType::kFloat32), 4u);
  EXPECT_EQ(ik::scalar_type_size(ik::ScalarType::kBFloat16), 2u);
  EXPECT_EQ(ik::scalar_type_size(ik::ScalarType::kUInt8), 1u);
  EXPECT_EQ(ik::scalar_type_size(ik::ScalarType::kInt64), 8u);
  EXPECT_TRUE(ik::is_float_type(ik::ScalarType::kFloat16));
  EXPECT_FALSE(ik::is_float_type(ik::ScalarType::kInt32));
}

TEST(ScalarType, DispatchNamesTheStorageType) {
  auto storage_size = [](ik::ScalarType t) {
    std::size_t size = 0;
    bool const ok = ik::dispatch_float_type(t, [&](auto v) { size = sizeof(v); });
    return ok ? size : 0;
  };
  EXPECT_EQ(storage_size(ik::ScalarType::kFloat32), 4u);
  EXPECT_EQ(storage_size(ik::ScalarType::kBFloat16), 2u);
  EXPECT_EQ(storage_size(ik::ScalarType::kFloat16), 2u);
  EXPECT_EQ(storage_size(ik::ScalarType::kInt32), 0u);
  bool bf16 = false;
  ik::dispatch_float_type(ik::ScalarType::kBFloat16, [&](auto v) { bf16 = std::is_same_v<decltype(v), ik::BFloat16>; });
  EXPECT_TRUE(bf16);
}

TEST(ScalarType, Bf16DecodeIsAShift) {
  for (std::uint32_t h = 0; h <= 0xffffu; ++h) {
    ASSERT_EQ(bits_of(ik::bf16_to_float(static_cast<std::uint16_t>(h))), h << 16) << std::hex << h;
  }
}

TEST(ScalarType, F16DecodeIsExactAndQuietsNaN) {
  for (std::uint32_t h = 0; h <= 0xffffu; ++h) {
    std::uint16_t const bits = static_cast<std::uint16_t>(h);
    float const got = ik::f16_to_float(bits);
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0) {
      // NaN: sign and payload kept, quiet bit set.
      std::uint32_t const want = ((h & 0x8000u) << 16) | 0x7fc00000u | ((h & 0x3ffu) << 13);
      ASSERT_EQ(bits_of(got), want) << std::hex << h;
      continue;
    }
    _Float16 ref;
    std::memcpy(&ref, &bits, sizeof ref);
    ASSERT_EQ(bits_of(got), bits_of(static_cast<float>(ref))) << std::hex << h;
  }
}

TEST(ScalarType, F16EncodeRoundsToNearestEven) {
  for (std::uint32_t u : fp32_sweep()) {
    float const f = as_float(u);
    std::uint16_t const got = ik::float_to_f16(f);
    if (std::isnan(f)) {
      std::uint16_t const want = static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x3ffu));
      ASSERT_EQ(got, want) << std::hex << u;
      continue;
    }
    ASSERT_EQ(got, bits_of(static_cast<_Float16>(f))) << std::hex << u;
  }
}

TEST(ScalarType, Bf16EncodeRoundsToNearestEven) {
  for (std::uint32_t u : fp32_sweep()) {
    float const f = as_float(u);
    std::uint16_t const got = ik::float_to_bf16(f);
    if (std::isnan(f)) {
      ASSERT_EQ(got, static_cast<std::uint16_t>((u >> 16) | 0x40u)) << std::hex << u;
      continue;
    }
    ASSERT_EQ(got, reference_bf16(f)) << std::hex << u;
  }
}

TEST(ScalarType, EdgeValues) {
  float const inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(ik::float_to_bf16(inf), 0x7f80);
  EXPECT_EQ(ik::float_to_bf16(-inf), 0xff80);
  EXPECT_EQ(ik::float_to_f16(inf), 0x7c00);
  EXPECT_EQ(ik::float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(ik::float_to_f16(65520.0f), 0x7c00);       // the midpoint to the next binade rounds up
  EXPECT_EQ(ik::float_to_f16(0x1.0p-24f), 0x0001);     // the smallest subnormal
  EXPECT_EQ(ik::float_to_f16(0x1.0p-25f), 0x0000);     // its half ties to even (zero)
  EXPECT_EQ(ik::float_to_f16(-0x1.8p-25f), 0x8001);    // above the half rounds up, sign kept
  EXPECT_EQ(ik::float_to_bf16(as_float(1u)), 0x0000);  // fp32 subnormals round, not flush
  EXPECT_EQ(ik::float_to_bf16(as_float(0x8000ffffu)), 0x8001);
  EXPECT_EQ(ik::from_float<ik::BFloat16>(1.0f).bits, 0x3f80);
  EXPECT_EQ(ik::to_float(ik::Float16{0x3c00}), 1.0f);
  EXPECT_EQ(ik::float_to_bf16(as_float(0x7fa12345u)), 0x7fe1);  // as VCVTNEPS2BF16
  EXPECT_EQ(ik::float_to_f16(as_float(0x7fa12345u)), 0x7f09);   // as VCVTPS2PH
}

// The value of an E4M3 byte from its fields (exact in double): (8 + m) 2^(e - 10), m 2^-9 when e = 0.
double reference_e4m3(std::uint8_t b) {
  int const e = (b >> 3) & 0xf, m = b & 7;
  double const v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (b & 0x80) ? -v : v;
}

// fp32 -> E4M3 by exact arithmetic: the nearest of the 127 non-negative finite values (ties to the even
// code), saturated at 448, a NaN stored as 0.
std::uint8_t reference_to_e4m3(float f) {
  if (std::isnan(f)) return 0;
  std::uint8_t const sign = std::signbit(f) ? 0x80 : 0;
  double const v = std::fabs(static_cast<double>(f));
  if (v >= 448.0) return sign | 0x7e;
  std::uint8_t lo = 0;
  while (lo < 0x7e && reference_e4m3(static_cast<std::uint8_t>(lo + 1)) <= v) ++lo;
  if (reference_e4m3(lo) == v) return sign | lo;
  std::uint8_t const hi = static_cast<std::uint8_t>(lo + 1);
  double const d_lo = v - reference_e4m3(lo), d_hi = reference_e4m3(hi) - v;
  if (d_lo < d_hi) return sign | lo;
  if (d_hi < d_lo) return sign | hi;
  return sign | ((lo & 1) ? hi : lo);
}

TEST(ScalarType, E4m3DecodeIsExactThroughFp16) {
  for (int b = 0; b < 256; ++b) {
    std::uint8_t const byte = static_cast<std::uint8_t>(b);
    if ((b & 0x7f) == 0x7f) {
      ASSERT_TRUE(std::isnan(ik::e4m3_to_float(byte))) << b;
      continue;
    }
    double const want = reference_e4m3(byte);
    ASSERT_EQ(static_cast<double>(ik::e4m3_to_float(byte)), want) << b;
    // The fp16 pattern the vector kernels widen is the value times 2^-8, exactly.
    ASSERT_EQ(static_cast<double>(ik::f16_to_float(ik::e4m3_to_f16_bits(byte))), std::ldexp(want, -8)) << b;
    ASSERT_EQ(std::signbit(ik::e4m3_to_float(byte)), (b & 0x80) != 0) << b;
    ASSERT_EQ(ik::float_to_e4m3(ik::e4m3_to_float(byte)), byte) << b;  // every value round-trips
  }
}

TEST(ScalarType, E4m3EncodeRoundsToNearestEvenAndSaturates) {
  for (std::uint32_t u : fp32_sweep()) {
    float const f = as_float(u);
    ASSERT_EQ(ik::float_to_e4m3(f), reference_to_e4m3(f)) << std::hex << u;
  }
  float const inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(ik::float_to_e4m3(inf), 0x7e);
  EXPECT_EQ(ik::float_to_e4m3(-inf), 0xfe);
  EXPECT_EQ(ik::float_to_e4m3(464.0f), 0x7e);       // past the largest finite value: saturated
  EXPECT_EQ(ik::float_to_e4m3(0x1.0p-10f), 0x00);   // half the smallest subnormal ties to zero
  EXPECT_EQ(ik::float_to_e4m3(0x1.8p-9f), 0x02);    // 1.5 subnormal steps tie to 2 (even)
  EXPECT_EQ(ik::float_to_e4m3(-0x1.1p-10f), 0x81);  // above the half rounds up, sign kept
  EXPECT_EQ(ik::float_to_e4m3(0x1.fp-7f), 0x08);    // the top subnormal range rounds to the min normal
  EXPECT_EQ(ik::float_to_e4m3(1.0625f), 0x38);      // 1 + 1/16 ties to 1.0 (even)
  EXPECT_EQ(ik::float_to_e4m3(1.1875f), 0x3a);      // 1 + 3/16 ties to 1.25 (even)
  EXPECT_EQ(ik::float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(ik::float_to_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x00);
}

}  // namespace
