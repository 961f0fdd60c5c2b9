// Fused sampling on the CPU: temperature, top-k, top-p, min-p and one draw per row.
//
// Per row of V logits l with temperature T (x = l / T, m = max x):
//   1. max pass: l_max and its first index. Greedy rows (T <= 0) stop here: the argmax, first
//      index on ties, as torch.argmax.
//   2. stats pass: Z = sum exp(x - m) (and, for rows whose only filter is min-p, the kept mass).
//   3. finish. Rows without top-k / top-p: one inverse-CDF draw, in index order, at u * Z_kept,
//      from the per-block sums and a rescan of one block. Rows with top-k / top-p: candidates are
//      the tokens above a threshold, lowered until they provably hold the cut (k tokens, or p * Z
//      of the mass). Thresholds come from a strided sample of ~512 logits (the k-th rank; the mass
//      below the last threshold), 1 nat below the max first for top-p, then a doubling gap. The
//      top-k and top-p cuts are selections over the candidates (a histogram of x picks the bin
//      holding the cut, then nth_element / a mass-weighted quickselect inside it), not a sort of V;
//      min-p keeps exp(x - m) >= min_p; then the same inverse-CDF draw over the kept candidates.
//      Peaked LLM distributions have tens of candidates; a flat row with a large top-p set costs
//      O(candidates).
//
// Determinism: the random number is a pure function of (seed, step) (splitmix64, below), and a row
// is cut into fixed blocks of kSamplingBlock logits whose partial sums are combined in block order,
// so a row's token is the same whether the row is split over threads (few rows) or owned by one
// thread (many rows), and whatever else is in the batch. It may differ between ISAs only where a
// draw lands within rounding of a CDF boundary.
//
// Semantics (masks as executor/sampler.py's apply_temperature_top_k_top_p_min_p): top_k <= 0 or
// >= V keeps all; ranks break ties by the lower index; top_p >= 1 keeps all, else the smallest set
// of most likely tokens whose mass (normalized over the top-k set) reaches top_p, at least one;
// min_p drops tokens whose probability is below min_p times the largest.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu_features.h"
#include "inflight/kernels/scalar_type.h"
#include "thread_pool.h"

namespace inflight::kernels::cpu {

// Logits per block: fixed, not derived from the thread count (see "Determinism" above).
inline constexpr std::int64_t kSamplingBlock = 4096;

// The fields and names of the CUDA op's params (kernels/cuda/sampling.h); the CPU-only ones are marked.
struct SamplingParams {
  void const* logits = nullptr;  // [num_rows, vocab_size], unit stride along the vocabulary
  std::int64_t row_stride = 0;   // elements between rows; 0 broadcasts one row to all rows
  std::int64_t num_rows = 0;
  std::int64_t vocab_size = 0;              // in [1, 2^31)
  float const* temperature = nullptr;       // [num_rows]; <= 0: greedy
  std::int32_t const* top_k = nullptr;      // [num_rows]; <= 0 or >= vocab_size: all tokens
  float const* top_p = nullptr;             // [num_rows]; in (0, 1], 1: all tokens
  float const* min_p = nullptr;             // [num_rows]; in [0, 1], 0: all tokens
  std::uint64_t const* seeds = nullptr;     // [num_rows], the RNG key
  std::int64_t const* steps = nullptr;      // [num_rows], >= 0 (the RNG counter)
  std::int64_t* out = nullptr;              // [num_rows], the sampled token ids
  ScalarType dtype = ScalarType::kFloat32;  // of the logits: float32, bfloat16 or float16
  // CPU only: sampling_workspace_size(num_rows, vocab_size, num_threads) bytes of scratch (the caller
  // allocates it; the kernel allocates nothing), and at most num_threads of the pool's threads.
  void* workspace = nullptr;
  std::int64_t workspace_bytes = 0;
  int num_threads = 1;
};

// The workspace launch_sampling needs.
std::int64_t sampling_workspace_size(std::int64_t num_rows, std::int64_t vocab_size, int num_threads);

// Samples every row into params.out with the kernels of selected_isa(), on the pool's threads. Throws
// std::invalid_argument for a vocab_size or dtype out of range or a workspace that is too small.
void launch_sampling(SamplingParams const& params, ThreadPool& pool);

// Internal linkage: the per-ISA files include this header with their own -m flags (see scalar_type.h).
namespace {

// splitmix64's finalizer (Steele, Lea, Flood 2014): a bijective 64-bit mix with full avalanche.
constexpr std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The uniform in [0, 1) that row (seed, step) draws with: 53 random bits, exact in a double.
// ops/reference/sampling.py computes the same number with numpy.
constexpr double sampling_uniform(std::uint64_t seed, std::uint64_t step) {
  return static_cast<double>(splitmix64(splitmix64(seed) ^ step) >> 11) * 0x1.0p-53;
}

}  // namespace

namespace detail {

// What the stats pass accumulates besides Z.
enum class StatsMode : int {
  kSum = 0,   // Z only
  kMinP = 1,  // and the mass of e >= min_p (rows whose only filter is min-p)
};
inline constexpr int kStatsModes = 2;

struct StatsArgs {
  float inv_t;  // 1 / T: the streaming passes multiply (the candidates divide, as the reference)
  float m;      // l_max * inv_t, so that the max token has e = 1: exactly in the portable path; the vector
                // paths fuse l * inv_t - m (one rounding), so there e = exp(the rounding error of m)
  float min_p;  // kMinP
};

struct BlockStats {
  double sum;       // sum of e = exp(l * inv_t - m)
  double sum_kept;  // kMinP: sum of e over e >= min_p
};

// The per-ISA, per-dtype pieces; every loop over logits lives in one of these. Blocks are at most
// kSamplingBlock long. Written once, over vector traits, in sampling_impl.h.
struct SamplingBlockKernels {
  // max over [0, n) (NaN ignored) and the first index holding it; n >= 1.
  void (*block_max)(void const* src, std::int64_t n, float* max, std::int64_t* argmax);
  // Indexed by StatsMode.
  void (*block_stats[kStatsModes])(void const* src, std::int64_t n, StatsArgs const& args, BlockStats* out);
  // e[i] = exp(l[i] * inv_t - m), bitwise the values block_stats sums.
  void (*block_exp)(void const* src, std::int64_t n, float inv_t, float m, float* e);
  // Appends l[i] >= threshold (as float) and base + i, in index order; returns how many. May write
  // up to 16 elements past that count (whole-vector stores): the outputs have that slack.
  std::int64_t (*block_collect)(void const* src, std::int64_t n, float threshold, std::int32_t base, float* l_out,
                                std::int32_t* idx_out);
  // In place x[i] = x[i] / t (the reference's division), then e[i] = exp(x[i] - m).
  void (*divide_exp)(float* x, std::int64_t n, float t, float m, float* e);
};

SamplingBlockKernels const& sampling_kernels_portable(ScalarType dtype);
SamplingBlockKernels const& sampling_kernels_avx2(ScalarType dtype);
SamplingBlockKernels const& sampling_kernels_avx512(ScalarType dtype);

}  // namespace detail
}  // namespace inflight::kernels::cpu
