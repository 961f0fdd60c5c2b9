// The compile-time dispatch of the attention kernels (attention_impl.h): the element type of q and
// out, the cache's (the same, int8 codes with scales, or E4M3 bytes), then head_dim, over a small explicit set of
// instantiations that each ISA file names (its Kernels alias). Included by the per-ISA files instead of
// attention_impl.h, with INFLIGHT_ATTENTION_ISA defined first, for the same internal-linkage reason.
#pragma once

#include "attention_impl.h"

namespace inflight::kernels::cpu::INFLIGHT_ATTENTION_ISA {

// Compile-time dispatch: the element type, the cache's (the same, int8 or fp8), then head_dim over
// kHeadDims (0 = run-time head_dim). False for a combination outside that set.
template <class V, int... kHeadDims>
struct Dispatch {
  template <class T, class C>
  static bool by_head_dim(int hd, auto&& fn) {
    bool done = false;
    auto try_one = [&]<int kHd>() {
      if (!done && hd == kHd) {
        fn.template operator()<AttentionKernels<V, kHd, T, C>>();
        done = true;
      }
    };
    (void)try_one;  // unused when kHeadDims is empty (the portable path)
    (try_one.template operator()<kHeadDims>(), ...);
    if (done) return true;
    if (hd % V::kWidth != 0 || hd > kMaxHeadDim) return false;
    fn.template operator()<AttentionKernels<V, 0, T, C>>();
    return true;
  }

  static bool run(ScalarType dtype, ScalarType kv_dtype, int hd, auto&& fn) {
    bool done = false;
    dispatch_float_type(dtype, [&](auto t) {
      using T = decltype(t);
      if (kv_dtype == ScalarType::kInt8) {
        done = by_head_dim<T, std::int8_t>(hd, fn);
      } else if (kv_dtype == ScalarType::kFloat8E4M3) {
        done = by_head_dim<T, Float8E4M3>(hd, fn);
      } else if (kv_dtype == dtype) {
        done = by_head_dim<T, T>(hd, fn);
      }
    });
    return done;
  }

  static bool paged_attention(PagedAttentionParams const& p, PagedAttentionPlan const& plan, ThreadPool& pool) {
    return run(p.dtype, p.kv_dtype, p.head_dim, [&]<class K>() { K::paged_attention(p, plan, pool); });
  }
  static bool context_attention(ContextAttentionParams const& p, ThreadPool& pool) {
    return run(p.dtype, p.kv_dtype, p.head_dim, [&]<class K>() { K::context_attention(p, pool); });
  }
};

}  // namespace inflight::kernels::cpu::INFLIGHT_ATTENTION_ISA
