// The element types of the kernels' tensors: one vocabulary for the CPU kernels, the host side of the
// CUDA kernels and the bindings. ScalarType (one numbering), its names and sizes, the storage types
// of the 16-bit floats, the only scalar conversions between them and fp32, and the compile-time
// dispatch of the CPU kernels over the float types.
//
// Conversions round to nearest even; infinities and subnormals are exact (nothing is flushed to
// zero). A NaN stays a quiet NaN and keeps its sign and the top bits of its payload: what the x86
// converters do (F16C's VCVTPS2PH and VCVTPH2PS, AVX512-BF16's VCVTNEPS2BF16), so a scalar tail
// writes the bits the vector body beside it writes. bf16 -> fp32 is a 16-bit shift, as every vector
// load does it. The vectorised conversions stay in the per-ISA files; the CUDA kernels use cuda_fp16.h.
//
// Free of CUDA headers (the bindings and the CPU files include it) and C++17 (nvcc compiles the .cu
// files as C++17). Every function has internal linkage: the per-ISA CPU files are compiled with
// different -m flags, and an inline function with external linkage could be merged by the linker
// into its AVX-512 copy and then run on a CPU without AVX-512.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace inflight::kernels {

// The values are part of the kernels' interface (a dtype travels as one through the params structs);
// the float types come first.
enum class ScalarType : int {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kInt8 = 3,    // int8 weights
  kUInt8 = 4,   // int4 weights, two per byte
  kInt32 = 5,   // block tables, sequence lengths, top-k
  kInt64 = 6,   // slot mappings, steps, sampled token ids
  kUInt64 = 7,  // RNG seeds
  // OCP FP8 E4M3 (e4m3fn) bytes: the FP8 KV cache (attention_params.h). Torch holds them as uint8 (the
  // bindings take a uint8 kv_cache as this type) or float8_e4m3fn.
  kFloat8E4M3 = 8,
};

// Storage of the 16-bit floats: the bit pattern, as torch.bfloat16 / torch.float16 hold it (arithmetic
// happens in fp32).
struct BFloat16 {
  std::uint16_t bits;
};
struct Float16 {
  std::uint16_t bits;
};
static_assert(sizeof(BFloat16) == 2 && sizeof(Float16) == 2, "16-bit storage types must match torch's");
// Storage of an OCP FP8 E4M3 (e4m3fn) value: its byte (sign, 4 exponent bits with bias 7, 3 mantissa
// bits; no infinity, 0x7f / 0xff are NaN, the largest finite value is 448).
struct Float8E4M3 {
  std::uint8_t bits;
};
static_assert(sizeof(Float8E4M3) == 1, "an E4M3 value is one byte");

namespace {

// Indexed by ScalarType.
constexpr char const* kScalarTypeNames[] = {"float32", "bfloat16", "float16", "int8",         "uint8",
                                            "int32",   "int64",    "uint64",  "float8_e4m3fn"};
constexpr std::size_t kScalarTypeSizes[] = {4, 2, 2, 1, 1, 4, 8, 8, 1};
constexpr int kNumScalarTypes = static_cast<int>(sizeof(kScalarTypeSizes) / sizeof(kScalarTypeSizes[0]));
static_assert(static_cast<int>(ScalarType::kFloat8E4M3) + 1 == kNumScalarTypes &&
                  sizeof(kScalarTypeNames) / sizeof(kScalarTypeNames[0]) == kNumScalarTypes,
              "one name and one size per ScalarType");

constexpr bool is_scalar_type(ScalarType t) {
  return static_cast<int>(t) >= 0 && static_cast<int>(t) < kNumScalarTypes;
}

// The torch name without the "torch." prefix ("unknown" for a value outside the enum).
constexpr char const* scalar_type_name(ScalarType t) {
  return is_scalar_type(t) ? kScalarTypeNames[static_cast<int>(t)] : "unknown";
}

// Bytes per element (0 for a value outside the enum).
constexpr std::size_t scalar_type_size(ScalarType t) {
  return is_scalar_type(t) ? kScalarTypeSizes[static_cast<int>(t)] : 0;
}

// The types the kernels compute in (their activations, caches, scales and logits).
constexpr bool is_float_type(ScalarType t) {
  return t == ScalarType::kFloat32 || t == ScalarType::kBFloat16 || t == ScalarType::kFloat16;
}

inline float float_from_bits(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline std::uint32_t bits_of_float(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline float bf16_to_float(std::uint16_t bits) { return float_from_bits(static_cast<std::uint32_t>(bits) << 16); }

inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t const u = bits_of_float(f);
  // Adding 0x7fff plus the lowest kept bit carries into the kept bits exactly when rounding up (ties to
  // even); an overflow carries into the exponent and gives infinity, as it should. A NaN is kept quiet.
  // Both computed and one selected (no branch), so that loops over rows of it vectorise.
  std::uint32_t const rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  std::uint32_t const nan = (u >> 16) | 0x0040u;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

inline float f16_to_float(std::uint16_t bits) {
  std::uint32_t const sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  std::uint32_t const magnitude = bits & 0x7fffu;
  // Normal, infinity or NaN: the fields moved into place with the exponent field 112 too high (so that
  // 31, infinity or NaN, becomes 255), then one exact multiply by 2^-112 takes it down again. Infinity
  // stays infinity, and a NaN comes out of the multiply quiet, with its payload.
  float const scaled = float_from_bits((magnitude << 13) + 0x70000000u) * 0x1.0p-112f;
  // Zero or subnormal, magnitude * 2^-24: 0.5f has an ulp of 2^-24, so 0.5 + magnitude * 2^-24 is the
  // float whose low mantissa bits are magnitude; subtracting 0.5f is exact.
  float const tiny = float_from_bits(0x3f000000u | magnitude) - 0.5f;
  return float_from_bits(sign | bits_of_float(magnitude >= 0x0400u ? scaled : tiny));
}

// The fp16 conversions have no branches (every case computed, one selected), so that loops over them
// vectorise: the portable kernels widen whole K/V rows with f16_to_float.
inline std::uint16_t float_to_f16(float f) {
  std::uint32_t const u = bits_of_float(f);
  std::uint32_t const sign = (u >> 16) & 0x8000u;
  std::uint32_t const a = u & 0x7fffffffu;
  std::uint32_t const nan = 0x7e00u | ((a >> 13) & 0x3ffu);  // quiet, top payload bits
  // A normal half: rebias the exponent (127 - 15) and round off 13 mantissa bits to nearest even (adding
  // 0xfff plus the lowest kept bit carries exactly when rounding up); a carry moves into the exponent,
  // and everything from 65520 on becomes infinity.
  std::uint32_t const rounded = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
  std::uint32_t const normal = rounded < 0x7c00u ? rounded : 0x7c00u;
  // Below 2^-14 a subnormal half, m * 2^-24: adding 0.5f (whose ulp is 2^-24) lets the FPU round |f| to
  // that grid, to nearest even; m = 1024 is the smallest normal half, correctly.
  std::uint32_t const subnormal = bits_of_float(float_from_bits(a) + 0.5f) - 0x3f000000u;
  std::uint32_t const result = a > 0x7f800000u ? nan : (a >= 0x38800000u ? normal : subnormal);
  return static_cast<std::uint16_t>(sign | result);
}

// E4M3 byte b -> the fp16 bit pattern ((b & 0x80) << 8) | ((b & 0x7f) << 7): sign, exponent and mantissa
// moved into fp16's fields, which is e4m3(b) * 2^-8 exactly, for normal and subnormal values alike (an
// E4M3 subnormal m * 2^-9 lands on the fp16 subnormal m * 2^-17). The vector kernels widen KV bytes this
// way (then F16C's VCVTPH2PS) and fold the 256 into their scales. NaN codes are never stored.
inline std::uint16_t e4m3_to_f16_bits(std::uint8_t b) {
  return static_cast<std::uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
}

// The value of an E4M3 byte, exactly (a NaN code gives a NaN).
inline float e4m3_to_float(std::uint8_t b) {
  if ((b & 0x7fu) == 0x7fu) return float_from_bits(0x7fc00000u | (static_cast<std::uint32_t>(b & 0x80u) << 24));
  return f16_to_float(e4m3_to_f16_bits(b)) * 256.0f;
}

// fp32 -> E4M3, round to nearest even, saturating: |x| >= 448 (infinity included) gives +-448, as
// torch's x.clamp(-448, 448).to(torch.float8_e4m3fn) does. A NaN is stored as 0 (the KV stores never
// write a NaN code: the kernels' fp16 widening would read it as a number), a zero keeps its sign.
inline std::uint8_t float_to_e4m3(float f) {
  std::uint32_t const u = bits_of_float(f);
  std::uint32_t const sign = (u >> 24) & 0x80u;
  std::uint32_t const a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0;              // NaN
  if (a >= 0x43e00000u) return sign | 0x7eu;  // >= 448 (and infinity): saturate
  if (a < 0x3c800000u) {                      // below 2^-6: a subnormal m * 2^-9, m = 0 .. 8
    // 16384 has an ulp of 2^-9: the FPU rounds |x| to that grid, to nearest even; m = 8 is the
    // smallest normal (code 0x08), correctly.
    float const r = (float_from_bits(a) + 16384.0f) - 16384.0f;
    return static_cast<std::uint8_t>(sign | static_cast<std::uint32_t>(r * 512.0f));
  }
  // A normal value: rebias the exponent (127 - 7) and round off 20 mantissa bits to nearest even (adding
  // 0x7ffff plus the lowest kept bit carries exactly when rounding up; a carry moves into the exponent).
  std::uint32_t const rounded = (a - (120u << 23) + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  return static_cast<std::uint8_t>(sign | (rounded < 0x7eu ? rounded : 0x7eu));
}

inline float to_float(float v) { return v; }
inline float to_float(BFloat16 v) { return bf16_to_float(v.bits); }
inline float to_float(Float16 v) { return f16_to_float(v.bits); }

// T: float, BFloat16 or Float16.
template <class T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) {
  return v;
}
template <>
inline BFloat16 from_float<BFloat16>(float v) {
  return BFloat16{float_to_bf16(v)};
}
template <>
inline Float16 from_float<Float16>(float v) {
  return Float16{float_to_f16(v)};
}

// Calls f(T{}) with T the storage type of the float type t (float, BFloat16, Float16) and returns
// true; false for any other type. The compile-time dispatch of the CPU kernels over dtypes.
template <class F>
inline bool dispatch_float_type(ScalarType t, F&& f) {
  switch (t) {
    case ScalarType::kFloat32:
      f(float{});
      return true;
    case ScalarType::kBFloat16:
      f(BFloat16{});
      return true;
    case ScalarType::kFloat16:
      f(Float16{});
      return true;
    default:
      return false;
  }
}

}  // namespace
}  // namespace inflight::kernels
