// The sampling block kernels (sampling.h's SamplingBlockKernels: every loop over logits), written
// once over a vector-traits class V and instantiated per ISA in sampling_portable.cpp (V = one float,
// the plain C++ of any x86-64), sampling_avx2.cpp and sampling_avx512.cpp.
//
// Every TU that includes this header defines INFLIGHT_SAMPLING_ISA (a namespace name) first: all
// code here lives in that per-ISA namespace, so the inline functions compiled with -mavx512f in one
// TU can never be picked by the linker for the portable TU (which must run on any x86-64).
//
// What a block kernel computes is fixed per ISA, bit for bit: V fixes the lane count, the order in
// which a block's terms are summed (V::kUnroll independent accumulators of kWidth lanes, vector j of
// the block into accumulator j % kUnroll, then a pairwise tree), the accumulator type, the exp and
// the rounding of l * inv_t - m. So a row's token is a pure function of its logits, its key and the
// ISA (see "Determinism" in sampling.h).
//
// V provides (Reg: kWidth floats; Mask: one predicate per lane; Acc: what a block's sums accumulate
// in; left >= 1 counts the lanes still in the block, all of them when left >= kWidth):
//   kWidth, kUnroll (a power of two)
//   set1, sub, div, max(a, b) (b where a is NaN, as VMAXPS), hmax(Reg) -> float (max, hmax and cmp_eq:
//       kWidth > 1 only, see block_max)
//   scale_shift(x, s, m)          x * s - m, rounded as the ISA has always rounded it
//   exp(x)                        e^x for x <= 0, e^-inf = 0 (vector ISAs: exp_cephes, NaN -> 0; portable:
//                                 libm, NaN -> NaN)
//   load(T const*)                kWidth elements of T (float, BFloat16, Float16) widened to fp32
//   load_part(T const*, left)     the same, lanes >= left read as -inf
//   store(float*, Reg), store_part(float*, Reg, left)   (the lanes < left only)
//   cmp_ge, cmp_eq -> Mask (ordered), mask_or, bits(Mask) -> unsigned (lane i at bit i)
//   valid_bits(left) -> unsigned  the bits of the lanes < left
//   acc_zero, acc_add(Acc, Reg), acc_add_if(Acc, Mask, Reg), acc_merge(Acc, Acc), acc_total(Acc) -> double
//   compress(float* l_out, int32_t* idx_out, Reg v, unsigned hit, int32_t first) -> int64_t: appends
//       the lanes in `hit` and their indices first + lane, in lane order; returns how many. May write
//       up to kWidth elements (a whole vector) at each output.
#pragma once

#ifndef INFLIGHT_SAMPLING_ISA
#error "define INFLIGHT_SAMPLING_ISA (the per-ISA namespace) before including sampling_impl.h"
#endif

#include <cstdint>
#include <limits>

#include "sampling.h"

namespace inflight::kernels::cpu::INFLIGHT_SAMPLING_ISA {

// e^x for x <= 0, for the vector ISAs' V::exp (Cephes expf: x = n ln2 + r, ln2 in two parts so that
// r is exact, e^r = 1 + r + r^2 P(r) with P of degree 5); e^0 is exactly 1. x < -87 (e^x < 2^-125)
// and NaN give 0, so masked (-inf) lanes weigh nothing. V: vector traits with mul, add, fmadd(a, b,
// c) = a * b + c, fnmadd(a, b, c) = c - a * b, round (to nearest), cmp_ge, max (as above) and
// pow2_live(y, n, live) = y * 2^n in the lanes of live, 0 elsewhere (n integral, >= -126).
template <class V>
inline typename V::Reg exp_cephes(typename V::Reg x) {
  auto const c = [](float v) { return V::set1(v); };
  typename V::Mask const live = V::cmp_ge(x, c(-87.f));
  x = V::max(x, c(-87.f));
  typename V::Reg const n = V::round(V::mul(x, c(1.44269504088896341f)));
  typename V::Reg r = V::fnmadd(n, c(0.693359375f), x);
  r = V::fnmadd(n, c(-2.12194440e-4f), r);
  typename V::Reg p = c(1.9875691500e-4f);
  p = V::fmadd(p, r, c(1.3981999507e-3f));
  p = V::fmadd(p, r, c(8.3334519073e-3f));
  p = V::fmadd(p, r, c(4.1665795894e-2f));
  p = V::fmadd(p, r, c(1.6666665459e-1f));
  p = V::fmadd(p, r, c(5.0000001201e-1f));
  typename V::Reg const y = V::add(V::fmadd(p, V::mul(r, r), r), c(1.f));
  return V::pow2_live(y, n, live);
}

// V: the vector traits above.
template <class V>
struct SamplingBlocks {
  using Reg = typename V::Reg;
  using Mask = typename V::Mask;
  using Acc = typename V::Acc;
  static constexpr std::int64_t W = V::kWidth;
  static constexpr int U = V::kUnroll;
  static_assert(U >= 1 && (U & (U - 1)) == 0, "the accumulator tree is pairwise");
  static_assert(W <= 16, "block_collect's outputs have 16 elements of slack (sampling.cpp's layout)");
  static constexpr float kInf = std::numeric_limits<float>::infinity();

  // Pairwise tree over a[Lo, Lo + Len): ((a0 op a1) op (a2 op a3)) for four. Lo, Len: the range, at
  // compile time so that the accumulators stay in registers; X: Reg, Mask or Acc; Op: the combine.
  template <int Lo = 0, int Len = U, class X, class Op>
  static X tree(X const* a, Op op) {
    if constexpr (Len == 1) {
      return a[Lo];
    } else {
      return op(tree<Lo, Len / 2>(a, op), tree<Lo + Len / 2, Len / 2>(a, op));
    }
  }

  // max over [0, n) (NaN ignored) and the first index holding it. One lane (portable): one pass, a
  // strict > keeping the first index (a branch the predictor learns: the max rarely changes); a
  // block with nothing above -inf reports index 0. Vectors: U independent max chains, then a scan
  // for the first lane equal to the max, U vectors per branch; a block with nothing above -inf
  // reports its first -inf. (Each path's answer for such a block since it was written, kept so that
  // no ISA's tokens change; it reaches the output only as the argmax of a row of -inf and NaN.) T:
  // the logits' storage type.
  template <class T>
  static void block_max(void const* src, std::int64_t n, float* max, std::int64_t* argmax) {
    T const* l = static_cast<T const*>(src);
    if constexpr (W == 1) {
      float best = -kInf;
      std::int64_t at = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        float const v = V::load(l + i);
        if (v > best) {
          best = v;
          at = i;
        }
      }
      *max = best;
      *argmax = at;
    } else {
      Reg acc[U];
      for (int u = 0; u < U; ++u) acc[u] = V::set1(-kInf);
      std::int64_t i = 0;
      for (; i + U * W <= n; i += U * W) {
#pragma GCC unroll 16
        for (int u = 0; u < U; ++u) acc[u] = V::max(V::load(l + i + u * W), acc[u]);  // NaN: keeps acc
      }
      for (; i < n; i += W) acc[0] = V::max(V::load_part(l + i, n - i), acc[0]);
      float const best = V::hmax(tree(acc, [](Reg a, Reg b) { return V::max(a, b); }));
      *max = best;
      *argmax = 0;
      Reg const b = V::set1(best);
      for (i = 0; i + U * W <= n; i += U * W) {
        Mask hit[U];
#pragma GCC unroll 16
        for (int u = 0; u < U; ++u) hit[u] = V::cmp_eq(V::load(l + i + u * W), b);
        if (V::bits(tree(hit, [](Mask x, Mask y) { return V::mask_or(x, y); })) == 0) continue;
#pragma GCC unroll 16
        for (int u = 0; u < U; ++u) {
          if (unsigned const h = V::bits(hit[u]); h != 0) {
            *argmax = i + u * W + __builtin_ctz(h);
            return;
          }
        }
      }
      for (; i < n; i += W) {
        unsigned const h = V::bits(V::cmp_eq(V::load_part(l + i, n - i), b)) & V::valid_bits(n - i);
        if (h != 0) {
          *argmax = i + __builtin_ctz(h);
          return;
        }
      }
    }
  }

  // Z = sum of e = exp(l * inv_t - m), and for kMinP the sum over e >= min_p. T: the logits' storage
  // type; M: what is accumulated besides Z (StatsMode).
  template <class T, detail::StatsMode M>
  static void block_stats(void const* src, std::int64_t n, detail::StatsArgs const& a, detail::BlockStats* out) {
    T const* l = static_cast<T const*>(src);
    Reg const inv_t = V::set1(a.inv_t), shift = V::set1(a.m), min_p = V::set1(a.min_p);
    // U vectors per iteration: U independent exp chains keep the FMA ports busy.
    Acc sum[U], kept[U];
    for (int u = 0; u < U; ++u) sum[u] = kept[u] = V::acc_zero();
    auto add = [&](int u, Reg x) {
      Reg const e = V::exp(V::scale_shift(x, inv_t, shift));
      sum[u] = V::acc_add(sum[u], e);
      if constexpr (M == detail::StatsMode::kMinP) kept[u] = V::acc_add_if(kept[u], V::cmp_ge(e, min_p), e);
    };
    std::int64_t i = 0;
    for (; i + U * W <= n; i += U * W) {
#pragma GCC unroll 16
      for (int u = 0; u < U; ++u) add(u, V::load(l + i + u * W));
    }
    // The last (< U) vectors, the partial one last: vector j of the block still goes to sum[j % U].
    // Unrolled, so that every accumulator index is a constant (the accumulators stay in registers).
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u, i += W) {
      if (i >= n) break;
      add(u, V::load_part(l + i, n - i));
    }
    auto const merge = [](Acc x, Acc y) { return V::acc_merge(x, y); };
    out->sum = V::acc_total(tree(sum, merge));
    out->sum_kept = V::acc_total(tree(kept, merge));
  }

  // e[i] = exp(l[i] * inv_t - m), bitwise the values block_stats sums. T: the logits' storage type.
  template <class T>
  static void block_exp(void const* src, std::int64_t n, float inv_t, float m, float* e) {
    T const* l = static_cast<T const*>(src);
    Reg const it = V::set1(inv_t), shift = V::set1(m);
    std::int64_t i = 0;
    for (; i + W <= n; i += W) V::store(e + i, V::exp(V::scale_shift(V::load(l + i), it, shift)));
    if (i < n) V::store_part(e + i, V::exp(V::scale_shift(V::load_part(l + i, n - i), it, shift)), n - i);
  }

  // Appends l[i] >= threshold (as float) and base + i, in index order; returns how many. T: the
  // logits' storage type.
  template <class T>
  static std::int64_t block_collect(void const* src, std::int64_t n, float threshold, std::int32_t base, float* l_out,
                                    std::int32_t* idx_out) {
    T const* l = static_cast<T const*>(src);
    Reg const thr = V::set1(threshold);
    std::int64_t c = 0;
    std::int64_t i = 0;
    // Candidates are rare: test U vectors with one branch.
    for (; i + U * W <= n; i += U * W) {
      Reg v[U];
      Mask hit[U];
#pragma GCC unroll 16
      for (int u = 0; u < U; ++u) {
        v[u] = V::load(l + i + u * W);
        hit[u] = V::cmp_ge(v[u], thr);
      }
      if (V::bits(tree(hit, [](Mask x, Mask y) { return V::mask_or(x, y); })) == 0) continue;
      // Unrolled, so that v and hit stay in registers.
#pragma GCC unroll 16
      for (int u = 0; u < U; ++u) {
        unsigned const h = V::bits(hit[u]);
        if (h != 0) c += V::compress(l_out + c, idx_out + c, v[u], h, base + static_cast<std::int32_t>(i + u * W));
      }
    }
    for (; i < n; i += W) {
      Reg const v = V::load_part(l + i, n - i);
      unsigned const h = V::bits(V::cmp_ge(v, thr)) & V::valid_bits(n - i);  // thr may be -inf
      if (h != 0) c += V::compress(l_out + c, idx_out + c, v, h, base + static_cast<std::int32_t>(i));
    }
    return c;
  }

  // In place x[i] = x[i] / t (the reference's division), then e[i] = exp(x[i] - m).
  static void divide_exp(float* x, std::int64_t n, float t, float m, float* e) {
    Reg const tv = V::set1(t), shift = V::set1(m);
    std::int64_t i = 0;
    for (; i + W <= n; i += W) {
      Reg const v = V::div(V::load(x + i), tv);
      V::store(x + i, v);
      V::store(e + i, V::exp(V::sub(v, shift)));
    }
    if (i < n) {
      Reg const v = V::div(V::load_part(x + i, n - i), tv);
      V::store_part(x + i, v, n - i);
      V::store_part(e + i, V::exp(V::sub(v, shift)), n - i);
    }
  }

  // T: the logits' storage type the entries read.
  template <class T>
  static detail::SamplingBlockKernels make() {
    return {&block_max<T>,
            {&block_stats<T, detail::StatsMode::kSum>, &block_stats<T, detail::StatsMode::kMinP>},
            &block_exp<T>,
            &block_collect<T>,
            &divide_exp};
  }

  // The entries for a float dtype (indexed by ScalarType: float32, bfloat16, float16 come first).
  static detail::SamplingBlockKernels const& table(ScalarType dtype) {
    static detail::SamplingBlockKernels const kernels[3] = {make<float>(), make<BFloat16>(), make<Float16>()};
    return kernels[static_cast<int>(dtype)];
  }
};

}  // namespace inflight::kernels::cpu::INFLIGHT_SAMPLING_ISA
