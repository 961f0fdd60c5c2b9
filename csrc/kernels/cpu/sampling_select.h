// The selection over one row's candidates, for the sampling launcher (sampling.cpp): the top-k and
// top-p cuts and the inverse-CDF draw among the kept candidates. Candidates are the tokens above a
// threshold that provably holds the cut (see sampling.h); selections cost O(candidates), not a sort
// of the vocabulary. Portable code only (sampling.cpp and sampling_select.cpp, no -m flags).
#pragma once

#include <cstdint>

namespace inflight::kernels::cpu::detail {

// A candidate token: x = l / T, e = exp(x - m_div); bin is scratch for histogram narrowing.
struct Cand {
  float x;
  float e;
  std::int32_t idx;
  std::int32_t bin;
};

// Rank order: larger x first, then the lower index (a stable descending sort).
inline bool ranks_before(Cand const& a, Cand const& b) { return a.x > b.x || (a.x == b.x && a.idx < b.idx); }

// One row's candidates in index order (per-thread scratch of V = vocab_size entries; the launcher
// gives x, e and idx 16 more, for block_collect's whole-vector stores).
struct Candidates {
  float* x;           // [V + 16]
  float* e;           // [V + 16]
  std::int32_t* idx;  // [V + 16]
  std::int32_t* bin;  // [V] histogram bin of each candidate
  Cand* sel;          // [V] the candidates a selection works on
};

// The top-k then top-p cut over the n candidates (a top set that holds it): k = 0 keeps all, p = 1
// keeps all, z_all is the row's Z (the top-p mass is relative to the top-k mass where k != 0).
// Returns true with *cut the lowest-ranked kept candidate, false when all n are kept. Reorders
// cands.sel and cands.bin only.
bool select_cut(Candidates const& cands, std::int64_t n, std::int64_t k, float p, double z_all, Cand* cut);

// The inverse-CDF draw at u in [0, 1), in index order, over the candidates ranked at or above *cut
// (all if null) with e >= min_p; fallback when none is kept. Overwrites cands.e with the weights.
std::int64_t draw_candidates(Candidates const& cands, std::int64_t n, Cand const* cut, float min_p, double u,
                             std::int64_t fallback);

// sum of w[0, n) in double, in the order draw_candidates sums (chunks of 256, each with four
// accumulators).
double chunked_sum(float const* w, std::int64_t n);

}  // namespace inflight::kernels::cpu::detail
