// sampling: one token per row of logits [N, V]: temperature, top-k, top-p, min-p, then one inverse-CDF
// draw in token-id order with the uniform u = sampling_uniform(seeds[i], steps[i]). The semantics and
// the random number are those of the CPU kernel (csrc/kernels/cpu/sampling.h) and its plain-torch twin
// (python/inflight/ops/reference/sampling.py), so the three pick the same token except where u lands
// within rounding of a CDF or mask boundary:
//   greedy (T <= 0, or no finite max, or l / T overflowing): argmax, first index on ties;
//   x = l / T ranks tokens (ties: lower id first); top_k in (0, V) keeps the k best; top_p < 1 keeps
//   the smallest rank prefix whose mass (over the top-k set) reaches top_p; min_p keeps
//   exp(x - x_max) >= min_p; the draw is the first kept id whose cumulative exp(x - x_max) exceeds
//   u times the kept total.
//
// One CTA of 1024 threads per row; thread t owns a contiguous chunk of the row, so every reduction
// and scan runs in a fixed order (the token is a pure function of the row and its key). Ranked cuts
// are radix selects over the order-preserving bits of x (counts for top-k, 2^-40 fixed-point masses
// for top-p: integer atomics, hence deterministic), not a sort.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "inflight/kernels/scalar_type.h"

namespace inflight::kernels::cuda {

// The fields and names of the CPU op's params (kernels/cpu/sampling.h), which also has a workspace and a
// thread count.
struct SamplingParams {
  void const* logits;          // [num_rows, vocab_size], unit stride along the vocabulary
  std::int64_t row_stride;     // elements between rows (0 broadcasts one row)
  std::int64_t num_rows;       // below 2^31
  std::int64_t vocab_size;     // in [1, 2^31)
  float const* temperature;    // [num_rows]
  std::int32_t const* top_k;   // [num_rows]; <= 0 or >= vocab_size: all
  float const* top_p;          // [num_rows]; >= 1: all
  float const* min_p;          // [num_rows]; <= 0: all
  std::uint64_t const* seeds;  // [num_rows]
  std::int64_t const* steps;   // [num_rows]
  std::int64_t* out;           // [num_rows]
  ScalarType dtype;            // of the logits: float32, bfloat16 or float16
};

cudaError_t launch_sampling(SamplingParams const& params, cudaStream_t stream);

}  // namespace inflight::kernels::cuda
