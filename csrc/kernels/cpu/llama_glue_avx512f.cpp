// llama_glue.h compiled for AVX-512 (F/BW/VL/DQ) with -ffp-contract=off (CMakeLists.txt): the same
// source and operations as the baseline copy, so the same bits, in 16-lane vectors with native 16-bit
// loads, stores and bf16 rounding.
#include "llama_glue_isa.h"

#include "llama_glue.h"

namespace inflight::kernels::cpu::glue_avx512f {
namespace {

// Calls f(T{}, bool_constant<a>{}, bool_constant<b>{}) for the runtime flags.
template <class F>
void dispatch(ScalarType dtype, bool a, bool b, F&& f) {
  dispatch_float_type(dtype, [&](auto t) {
    if (a) {
      if (b) {
        f(t, std::true_type{}, std::true_type{});
      } else {
        f(t, std::true_type{}, std::false_type{});
      }
    } else if (b) {
      f(t, std::false_type{}, std::true_type{});
    } else {
      f(t, std::false_type{}, std::false_type{});
    }
  });
}

}  // namespace

void rms_norm(ScalarType dtype, bool gemma, bool add, void const* x, void const* weight, void* out, int num_tokens,
              int d, float eps, ThreadPool& pool, int num_threads, std::int64_t const* rows) {
  dispatch(dtype, gemma, add, [&](auto t, auto g, auto a) {
    using T = decltype(t);
    llama_glue::rms_norm<T, decltype(g)::value, decltype(a)::value>(
        static_cast<T const*>(x), static_cast<T const*>(weight), static_cast<T*>(out), num_tokens, d, eps,
        Threads{pool, num_threads}, rows);
  });
}

void qk_norm_rope(ScalarType dtype, bool gemma, void* qkv, std::int64_t row_stride, void const* cos_sin,
                  std::int64_t const* positions, int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                  void const* q_norm, void const* k_norm, float eps, int key_rotation, ThreadPool& pool,
                  int num_threads) {
  dispatch(dtype, gemma, false, [&](auto t, auto g, auto) {
    using T = decltype(t);
    llama_glue::qk_norm_rope<T, decltype(g)::value>(static_cast<T*>(qkv), row_stride, static_cast<T const*>(cos_sin),
                                                    positions, num_tokens, num_heads, num_kv_heads, head_dim,
                                                    static_cast<T const*>(q_norm), static_cast<T const*>(k_norm), eps,
                                                    key_rotation, Threads{pool, num_threads});
  });
}

void add_into(ScalarType dtype, void* hidden, void const* y, int num_tokens, int d, ThreadPool& pool, int num_threads) {
  dispatch_float_type(dtype, [&](auto t) {
    using T = decltype(t);
    llama_glue::add_into<T>(static_cast<T*>(hidden), static_cast<T const*>(y), num_tokens, d,
                            Threads{pool, num_threads});
  });
}

void act_mul(ScalarType dtype, bool gelu, void const* gate_up, void* inter, int num_tokens, int n, ThreadPool& pool,
             int num_threads) {
  dispatch(dtype, gelu, false, [&](auto t, auto g, auto) {
    using T = decltype(t);
    llama_glue::act_mul<T, decltype(g)::value>(static_cast<T const*>(gate_up), static_cast<T*>(inter), num_tokens, n,
                                               Threads{pool, num_threads});
  });
}

}  // namespace inflight::kernels::cpu::glue_avx512f
