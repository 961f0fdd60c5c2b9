#include <climits>
#include <cmath>
#include <cstdint>

#include "device_utils.cuh"
#include "sampling.h"
#include "static_switch.h"

namespace inflight::kernels::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;                     // radix digits of 8 bits, four passes over a 32-bit key
constexpr double kFixedOne = 1099511627776.0;  // 2^40: top-p masses as integers (deterministic atomics)

__device__ __forceinline__ std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// As csrc/kernels/cpu/sampling.h: 53 random bits of splitmix64(splitmix64(seed) ^ step), exact in a double.
__device__ __forceinline__ double sampling_uniform(std::uint64_t seed, std::uint64_t step) {
  return static_cast<double>(splitmix64(splitmix64(seed) ^ step) >> 11) * 0x1.0p-53;
}

// Order-preserving map of a float onto uint32 (larger float, larger key). NaN is excluded by callers.
__device__ __forceinline__ std::uint32_t order_key(float x) {
  std::uint32_t const bits = __float_as_uint(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

struct SharedState {
  double d[kWarps];
  unsigned long long u64[kWarps];
  unsigned int u32[kWarps];
  float f[kWarps];
  int i[kWarps];
  unsigned long long hist[kBins];  // radix histogram (counts or fixed-point masses)
  // Results broadcast by warp 0 / one thread.
  unsigned int digit;
  unsigned long long above;
  int found;
  int token;
};

// ------------------------------------------------------------------------------- block primitives
// Every thread of the block calls these (they synchronise); results are identical in all threads and
// do not depend on timing: the combine order is fixed.

template <typename V, typename Op>
__device__ V block_reduce(V v, Op op, V* scratch) {
  int const lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, offset));
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  V r = scratch[0];
  for (int w = 1; w < kWarps; ++w) r = op(r, scratch[w]);
  __syncthreads();
  return r;
}

// Exclusive prefix sum in thread order; `total` receives the sum over all threads.
template <typename V>
__device__ V block_exclusive_scan(V v, V* scratch, V& total) {
  int const lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  V inclusive = v;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    V const y = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += y;
  }
  V exclusive = __shfl_up_sync(kFullMask, inclusive, 1);
  if (lane == 0) exclusive = V(0);
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  V before = V(0), all = V(0);
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += scratch[w];
    all += scratch[w];
  }
  __syncthreads();
  total = all;
  return before + exclusive;
}

// The row as the kernel sees it: x = l / T ranks tokens; e = exp(x - x_max) weighs them.
template <typename T>
struct Row {
  T const* logits;
  float t;      // temperature
  float inv_t;  // 1 / t
  float m;      // l_max * inv_t (unranked rows: e = exp(l * inv_t - m), as the CPU's stats pass)
  float m_div;  // l_max / t (ranked rows: e = exp(l / t - m_div), as the CPU's candidates)
  bool ranked;  // top-k or top-p in use

  __device__ float x(int i) const { return to_float(logits[i]) / t; }
  // Explicit roundings (no fused multiply-add) so that e matches the CPU kernel's bit for bit before exp.
  __device__ float e(int i) const {
    float const l = to_float(logits[i]);
    return ranked ? expf(__fsub_rn(l / t, m_div)) : expf(__fsub_rn(__fmul_rn(l, inv_t), m));
  }
};

// Radix select, descending: among elements i in [begin, end) with in_set(i), keyed by key(i) and
// weighted by weight(i), finds the key K with  W(key > K) < target <= W(key >= K). Returns false when
// the whole set weighs less than target. On success, *above = W(key > K) and *at_key = W(key == K).
template <typename InSet, typename Key, typename Weight>
__device__ bool radix_select_desc(int begin, int end, InSet in_set, Key key, Weight weight, unsigned long long target,
                                  SharedState& sh, std::uint32_t* result, unsigned long long* above,
                                  unsigned long long* at_key) {
  std::uint32_t prefix = 0, mask = 0;
  unsigned long long acc_above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < kBins; b += kThreads) sh.hist[b] = 0;
    __syncthreads();
    for (int i = begin; i < end; ++i) {
      if (!in_set(i)) continue;
      std::uint32_t const k = key(i);
      if ((k & mask) != prefix) continue;
      unsigned long long const w = weight(i);
      if (w != 0) atomicAdd(&sh.hist[(k >> shift) & 0xffu], w);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l holds bins 255 - 8l down to 248 - 8l: lane order is descending bin order.
      int const lane = threadIdx.x;
      unsigned long long const remaining = target - acc_above;
      unsigned long long lane_sum = 0;
      for (int j = 0; j < 8; ++j) lane_sum += sh.hist[kBins - 1 - 8 * lane - j];
      unsigned long long inclusive = lane_sum;
#pragma unroll
      for (int offset = 1; offset < 32; offset *= 2) {
        unsigned long long const y = __shfl_up_sync(kFullMask, inclusive, offset);
        if (lane >= offset) inclusive += y;
      }
      unsigned const ballot = __ballot_sync(kFullMask, inclusive >= remaining);
      if (lane == 0) sh.found = ballot != 0;
      if (ballot != 0 && lane == __ffs(ballot) - 1) {
        unsigned long long cum = inclusive - lane_sum;
        for (int j = 0; j < 8; ++j) {
          int const bin = kBins - 1 - 8 * lane - j;
          if (cum + sh.hist[bin] >= remaining) {
            sh.digit = static_cast<unsigned>(bin);
            sh.above = cum;
            break;
          }
          cum += sh.hist[bin];
        }
      }
    }
    __syncthreads();
    bool const found = sh.found != 0;
    unsigned const digit = found ? sh.digit : 0u;
    unsigned long long const bin_above = found ? sh.above : 0ull;
    unsigned long long const bin_weight = found ? sh.hist[digit] : 0ull;
    __syncthreads();  // before the next pass clears the histogram
    if (!found) return false;
    prefix |= static_cast<std::uint32_t>(digit) << shift;
    mask |= 0xffu << shift;
    acc_above += bin_above;
    if (shift == 0) *at_key = bin_weight;
  }
  *result = prefix;
  *above = acc_above;
  return true;
}

// The index of the j-th (1-based) element of [begin, end) with is_tie(i), in index order over the
// whole row; *count receives how many there are. Returns INT_MAX when j exceeds the count.
template <typename IsTie>
__device__ int nth_in_order(int begin, int end, IsTie is_tie, unsigned int j, SharedState& sh, unsigned int* count) {
  unsigned int c = 0;
  for (int i = begin; i < end; ++i) c += is_tie(i) ? 1u : 0u;
  unsigned int total = 0;
  unsigned int const before = block_exclusive_scan(c, sh.u32, total);
  if (threadIdx.x == 0) sh.found = INT_MAX;
  __syncthreads();
  if (before < j && j <= before + c) {
    unsigned int seen = before;
    for (int i = begin; i < end; ++i) {
      if (is_tie(i) && ++seen == j) {
        sh.found = i;  // exactly one thread gets here
        break;
      }
    }
  }
  __syncthreads();
  int const result = sh.found;
  __syncthreads();
  *count = total;
  return result;
}

// ------------------------------------------------------------------------------- the kernel

// T: logit element type (float, half, __nv_bfloat16).
template <typename T>
__global__ void __launch_bounds__(kThreads) sampling_kernel(SamplingParams p) {
  __shared__ SharedState sh;
  std::int64_t const row_index = blockIdx.x;
  int const vocab = static_cast<int>(p.vocab_size);  // < 2^31 (the launcher checks)
  int const chunk = (vocab + kThreads - 1) / kThreads;
  int const begin = min(vocab, static_cast<int>(threadIdx.x) * chunk);
  int const end = min(vocab, begin + chunk);
  T const* logits = static_cast<T const*>(p.logits) + row_index * p.row_stride;

  // 1. Max and its first index (NaN never wins), as torch.argmax.
  float best = -INFINITY;
  int at = INT_MAX;
  for (int i = begin; i < end; ++i) {
    float const v = to_float(logits[i]);
    if (v > best) {
      best = v;
      at = i;
    }
  }
  float const l_max = block_reduce(best, [](float a, float b) { return fmaxf(a, b); }, sh.f);
  int const argmax_raw = block_reduce(best == l_max ? at : INT_MAX, [](int a, int b) { return min(a, b); }, sh.i);
  int const argmax = argmax_raw == INT_MAX ? 0 : argmax_raw;

  float const t = p.temperature[row_index];
  bool greedy = !(t > 0.f) || !isfinite(l_max);
  Row<T> row{logits, t, 0.f, 0.f, 0.f, false};
  if (!greedy) {
    row.inv_t = 1.f / t;
    row.m = __fmul_rn(l_max, row.inv_t);
    row.m_div = l_max / t;
    // A tiny temperature can overflow x = l / T; such a row is one-hot anyway.
    greedy = !isfinite(row.m) || !isfinite(row.m_div) || !isfinite(row.inv_t);
  }
  if (greedy) {  // uniform over the block
    if (threadIdx.x == 0) p.out[row_index] = argmax;
    return;
  }

  int const top_k_raw = p.top_k[row_index];
  int const top_k = (top_k_raw > 0 && top_k_raw < vocab) ? top_k_raw : 0;
  float const top_p = p.top_p[row_index] < 1.f ? p.top_p[row_index] : 1.f;
  float const min_p = p.min_p[row_index] > 0.f ? p.min_p[row_index] : 0.f;
  row.ranked = top_k != 0 || top_p < 1.f;

  auto valid = [&](int i) { return !isnan(row.x(i)); };
  auto key = [&](int i) { return order_key(row.x(i)); };

  // 2. Top-k: the k-th ranked key, then the tie at that key that is the k-th overall.
  bool k_cut = false;
  std::uint32_t k_key = 0;
  int k_index = 0;
  if (top_k != 0) {
    std::uint32_t found_key = 0;
    unsigned long long above = 0, at_key = 0;
    bool const ok = radix_select_desc(
        begin, end, valid, key, [](int) { return 1ull; }, static_cast<unsigned long long>(top_k), sh, &found_key,
        &above, &at_key);
    if (ok) {
      unsigned int ties = 0;
      int const idx = nth_in_order(
          begin, end, [&](int i) { return valid(i) && key(i) == found_key; }, static_cast<unsigned int>(top_k - above),
          sh, &ties);
      k_cut = true;
      k_key = found_key;
      k_index = idx == INT_MAX ? vocab : idx;
    }
  }
  auto in_top_k = [&](int i) {
    if (!valid(i)) return false;
    if (!k_cut) return true;
    std::uint32_t const k = key(i);
    return k > k_key || (k == k_key && i <= k_index);
  };

  // 3. Top-p over the top-k set: the smallest rank prefix whose mass reaches top_p of the set's mass.
  bool p_cut = false;
  std::uint32_t p_key = 0;
  int p_index = 0;
  if (top_p < 1.f) {
    auto fixed_mass = [&](int i) { return static_cast<unsigned long long>(row.e(i) * kFixedOne); };
    unsigned long long local = 0;
    for (int i = begin; i < end; ++i) {
      if (in_top_k(i)) local += fixed_mass(i);
    }
    unsigned long long const z =
        block_reduce(local, [](unsigned long long a, unsigned long long b) { return a + b; }, sh.u64);
    double const want = ceil(static_cast<double>(top_p) * static_cast<double>(z));
    unsigned long long target = want < 1.0 ? 1ull : static_cast<unsigned long long>(want);
    if (target > z) target = z;
    std::uint32_t found_key = 0;
    unsigned long long above = 0, at_key = 0;
    bool const ok =
        z > 0 && radix_select_desc(begin, end, in_top_k, key, fixed_mass, target, sh, &found_key, &above, &at_key);
    if (ok) {
      unsigned int ties = 0;
      // Every tie has the same x, hence the same mass: at_key / ties each. Count them first.
      nth_in_order(begin, end, [&](int i) { return in_top_k(i) && key(i) == found_key; }, 0u, sh, &ties);
      unsigned long long const each = ties > 0 ? at_key / ties : 0;
      unsigned long long const need = target - above;
      unsigned long long j = each > 0 ? (need + each - 1) / each : ties;
      if (j < 1) j = 1;
      if (j > ties) j = ties;
      unsigned int unused = 0;
      int const idx = nth_in_order(
          begin, end, [&](int i) { return in_top_k(i) && key(i) == found_key; }, static_cast<unsigned int>(j), sh,
          &unused);
      p_cut = true;
      p_key = found_key;
      p_index = idx == INT_MAX ? vocab : idx;
    }
  }

  // 4. The kept set, and the inverse-CDF draw over it in index order.
  auto kept_e = [&](int i) -> float {  // 0 when dropped
    if (!in_top_k(i)) return 0.f;
    if (p_cut) {
      std::uint32_t const k = key(i);
      if (!(k > p_key || (k == p_key && i <= p_index))) return 0.f;
    }
    float const e = row.e(i);
    if (!(e > 0.f) || (min_p > 0.f && !(e >= min_p))) return 0.f;
    return e;
  };
  double local_sum = 0.0;
  int local_last = -1;
  for (int i = begin; i < end; ++i) {
    float const e = kept_e(i);
    if (e > 0.f) {
      local_sum += e;
      local_last = i;
    }
  }
  double total = 0.0;
  double const before = block_exclusive_scan(local_sum, sh.d, total);
  int const last = block_reduce(local_last, [](int a, int b) { return max(a, b); }, sh.i);
  double const target = sampling_uniform(p.seeds[row_index], static_cast<std::uint64_t>(p.steps[row_index])) * total;
  if (threadIdx.x == 0) sh.token = INT_MAX;
  __syncthreads();
  if (local_sum > 0.0 && before <= target && before + local_sum > target) {
    // The rescan adds the same values in the same order as local_sum, so it crosses by the chunk's end.
    double acc = 0.0;
    for (int i = begin; i < end; ++i) {
      float const e = kept_e(i);
      if (e > 0.f) {
        acc += e;
        if (before + acc > target) {
          atomicMin(&sh.token, i);  // the first crossing in index order wins
          break;
        }
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int token = sh.token;
    if (token == INT_MAX) token = last >= 0 ? last : argmax;  // u * total rounded up to the total
    p.out[row_index] = token;
  }
}

}  // namespace

cudaError_t launch_sampling(SamplingParams const& params, cudaStream_t stream) {
  if (params.num_rows == 0) return cudaSuccess;
  if (params.vocab_size < 1 || params.vocab_size > 0x7fffffffLL || params.num_rows > 0x7fffffffLL) {
    return cudaErrorInvalidValue;
  }
  return SCALAR_TYPE_SWITCH(params.dtype, T, [&] {
    sampling_kernel<T><<<static_cast<unsigned>(params.num_rows), kThreads, 0, stream>>>(params);
    return cudaGetLastError();
  });
}

}  // namespace inflight::kernels::cuda
