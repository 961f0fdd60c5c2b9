// Portable block kernels of the fused sampler (see sampling.h): sampling_impl.h over a one-lane
// "vector" of plain floats, with the scalar bf16 / fp16 conversions of scalar_type.h and libm's exp,
// so that it runs on any x86-64 (and is what INFLIGHT_CPU_ISA=portable tests).
#include <cmath>
#include <cstdint>

#define INFLIGHT_SAMPLING_ISA portable
#include "sampling_impl.h"

namespace inflight::kernels::cpu::portable {
namespace {

struct Scalar {
  using Reg = float;
  using Mask = bool;
  // The block sums add each e to one double, in index order.
  using Acc = double;
  static constexpr int kWidth = 1;
  static constexpr int kUnroll = 1;

  static Reg set1(float x) { return x; }
  static Reg sub(Reg a, Reg b) { return a - b; }
  static Reg div(Reg a, Reg b) { return a / b; }
  // Multiply, then subtract: two roundings (baseline x86-64 has no FMA), so the max token gets e^0 = 1
  // exactly.
  static Reg scale_shift(Reg x, Reg s, Reg m) { return x * s - m; }
  static Reg exp(Reg x) { return std::exp(x); }

  // T: float, BFloat16 or Float16.
  template <class T>
  static Reg load(T const* p) {
    return to_float(*p);
  }
  // T: as load.
  template <class T>
  static Reg load_part(T const* p, std::int64_t) {
    return to_float(*p);  // left >= 1 = kWidth
  }
  static void store(float* p, Reg v) { *p = v; }
  static void store_part(float* p, Reg v, std::int64_t) { *p = v; }

  static Mask cmp_ge(Reg a, Reg b) { return a >= b; }
  static Mask mask_or(Mask a, Mask b) { return a || b; }
  static unsigned bits(Mask m) { return m ? 1u : 0u; }
  static unsigned valid_bits(std::int64_t) { return 1u; }

  static Acc acc_zero() { return 0.0; }
  static Acc acc_add(Acc a, Reg e) { return a + e; }
  static Acc acc_add_if(Acc a, Mask m, Reg e) { return m ? a + e : a; }
  static Acc acc_merge(Acc a, Acc b) { return a + b; }
  static double acc_total(Acc a) { return a; }

  static std::int64_t compress(float* l_out, std::int32_t* idx_out, Reg v, unsigned, std::int32_t first) {
    *l_out = v;  // only called with the lane set
    *idx_out = first;
    return 1;
  }
};

}  // namespace
}  // namespace inflight::kernels::cpu::portable

namespace inflight::kernels::cpu::detail {

SamplingBlockKernels const& sampling_kernels_portable(ScalarType dtype) {
  return portable::SamplingBlocks<portable::Scalar>::table(dtype);
}

}  // namespace inflight::kernels::cpu::detail
