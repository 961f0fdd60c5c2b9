// The selection over a row's candidates (see sampling.h): the top-k and top-p cuts (a histogram of
// x narrows the window, then nth_element / a mass-weighted quickselect inside it) and the
// inverse-CDF draw among the kept candidates.
#include "sampling_select.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

namespace inflight::kernels::cpu::detail {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
// Selections over more candidates than this are first narrowed to one bin of a histogram of x
// (radix-select style); smaller ones go straight to nth_element / pivoting.
constexpr std::int64_t kHistogramMin = 512;
constexpr int kHistogramBins = 256;
// Weights per chunk of the draw's sums (chunked_sum).
constexpr std::int64_t kDrawChunk = 256;

double chunk_sum(float const* w, std::int64_t len) {
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  std::int64_t i = 0;
  for (; i + 4 <= len; i += 4) {
    for (int j = 0; j < 4; ++j) acc[j] += w[i + j];
  }
  for (; i < len; ++i) acc[0] += w[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// Histogram binning over [x_min, x_max], best first: bin(x) is non-increasing in x, so a bin is a
// rank interval and ties share a bin.
struct Binning {
  float x_max, scale;
  bool ok;  // false: the range is empty or degenerate (one bin would hold everything)
  int operator()(float x) const { return std::min(kHistogramBins - 1, static_cast<int>((x_max - x) * scale)); }
};

Binning make_binning(float x_min, float x_max) {
  float const scale = static_cast<float>(kHistogramBins) / (x_max - x_min);
  return {x_max, scale, x_max > x_min && std::isfinite(scale)};
}

// Partitions sel[0, n) so that sel[pos] is the (pos + 1)-th ranked and sel[0, pos) the ones above
// it: histogram bins narrow the window while it is large, nth_element finishes.
void rank_select(Cand* sel, std::int64_t n, std::int64_t pos) {
  std::int64_t lo = 0, hi = n;
  while (hi - lo > kHistogramMin) {
    float x_min = kInf, x_max = -kInf;
    for (std::int64_t i = lo; i < hi; ++i) {
      x_min = std::min(x_min, sel[i].x);
      x_max = std::max(x_max, sel[i].x);
    }
    Binning const bin = make_binning(x_min, x_max);
    if (!bin.ok) break;
    std::int64_t count[kHistogramBins] = {};
    for (std::int64_t i = lo; i < hi; ++i) ++count[sel[i].bin = bin(sel[i].x)];
    std::int64_t before = lo;
    int b = 0;
    while (before + count[b] <= pos) before += count[b++];
    if (count[b] == hi - lo) break;
    Cand* const first = std::partition(sel + lo, sel + hi, [b](Cand const& c) { return c.bin < b; });
    Cand* const last = std::partition(first, sel + hi, [b](Cand const& c) { return c.bin == b; });
    lo = first - sel;
    hi = last - sel;
  }
  std::nth_element(sel + lo, sel + pos, sel + hi, ranks_before);
}

// The smallest prefix, in rank order, of sel[0, n) whose mass reaches target: returns the position
// of its lowest-ranked element, with sel partitioned so that the prefix is sel[0, position], or -1
// if all n fall short. A quickselect on the pivot's rank that keeps the side holding the target.
std::int64_t mass_select(Cand* sel, std::int64_t n, double target) {
  std::int64_t lo = 0, hi = n;
  double acc = 0.0;      // the mass of sel[0, lo), all ranked above sel[lo, hi)
  bool bounded = false;  // a sum found sel[0, hi) to reach the target: if a rescan in another order
                         // falls a rounding short, the cut is still the window's last element
  while (hi - lo > 16) {
    std::int64_t const mid_at = lo + (hi - lo) / 2;
    Cand a = sel[lo], b = sel[mid_at], c = sel[hi - 1];
    if (ranks_before(b, a)) std::swap(a, b);
    if (ranks_before(c, b)) std::swap(b, c);
    if (ranks_before(b, a)) std::swap(a, b);
    Cand const pivot = b;
    Cand* const mid = std::partition(sel + lo, sel + hi, [&](Cand const& x) { return ranks_before(x, pivot); });
    std::swap(*mid, *std::find_if(mid, sel + hi, [&](Cand const& x) { return x.idx == pivot.idx; }));
    double mass = 0.0;
    for (Cand const* q = sel + lo; q < mid; ++q) mass += q->e;
    std::int64_t const m = mid - sel;
    if (acc + mass >= target) {
      hi = m;
      bounded = true;
    } else if (acc + mass + mid->e >= target) {
      return m;
    } else {
      acc += mass + mid->e;
      lo = m + 1;
    }
  }
  std::sort(sel + lo, sel + hi, ranks_before);
  for (std::int64_t i = lo; i < hi; ++i) {
    acc += sel[i].e;
    if (acc >= target) return i;
  }
  return bounded && hi > 0 ? hi - 1 : -1;
}

Cand candidate(Candidates const& cands, std::int64_t i) { return {cands.x[i], cands.e[i], cands.idx[i], 0}; }

// A selection's window: cands.sel[0, size), everything ranked above it counted in `above` and
// `mass_above`. bounded: a histogram placed the cut inside it.
struct Window {
  std::int64_t size;
  std::int64_t above;
  double mass_above;
  bool bounded;
};

// Copies into cands.sel the candidates, among those ranked at or above *limit (all if null), of
// the histogram bin that holds the cut: the (pos + 1)-th ranked (target < 0) or the first whose
// cumulative mass reaches target. Few candidates are copied whole. size 0: they fall short.
Window narrow(Candidates const& cands, std::int64_t n, Cand const* limit, std::int64_t pos, double target) {
  float x_min = kInf, x_max = -kInf;
  std::int64_t m = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    bool const in = limit == nullptr || !ranks_before(*limit, candidate(cands, i));
    cands.bin[i] = in ? 0 : -1;
    if (!in) continue;
    x_min = std::min(x_min, cands.x[i]);
    x_max = std::max(x_max, cands.x[i]);
    ++m;
  }
  Binning const bin = make_binning(x_min, x_max);
  if (m <= kHistogramMin || !bin.ok) {
    std::int64_t c = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      if (cands.bin[i] == 0) cands.sel[c++] = candidate(cands, i);
    }
    return {c, 0, 0.0, false};
  }
  // Four interleaved histograms: runs of one bin would otherwise chain every update on the last.
  std::int64_t count[4][kHistogramBins] = {};
  double mass[4][kHistogramBins] = {};
  bool const by_mass = target >= 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    if (cands.bin[i] < 0) continue;
    int const b = bin(cands.x[i]);
    cands.bin[i] = b;
    ++count[i & 3][b];
    if (by_mass) mass[i & 3][b] += cands.e[i];
  }
  for (int b = 0; b < kHistogramBins; ++b) {
    count[0][b] += count[1][b] + count[2][b] + count[3][b];
    mass[0][b] = (mass[0][b] + mass[1][b]) + (mass[2][b] + mass[3][b]);
  }
  int b = 0;
  std::int64_t above = 0;
  double mass_above = 0.0;
  if (!by_mass) {
    while (above + count[0][b] <= pos) above += count[0][b++];
  } else {
    while (b < kHistogramBins && mass_above + mass[0][b] < target) {
      mass_above += mass[0][b];
      above += count[0][b++];
    }
    if (b == kHistogramBins) return {0, above, mass_above, false};
  }
  std::int64_t c = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    if (cands.bin[i] == b) cands.sel[c++] = candidate(cands, i);
  }
  return {c, above, mass_above, true};
}

}  // namespace

bool select_cut(Candidates const& cands, std::int64_t n, std::int64_t k, float p, double z_all, Cand* cut) {
  bool has_cut = false;
  if (k != 0 && n > k) {
    Window const w = narrow(cands, n, nullptr, k - 1, -1.0);
    std::int64_t const pos = k - 1 - w.above;
    rank_select(cands.sel, w.size, pos);
    *cut = cands.sel[pos];
    has_cut = true;
  }
  if (p < 1.f) {
    Cand const limit = *cut;
    double z = z_all;
    if (k != 0) {
      z = 0.0;  // top-p is relative to the top-k mass (the reference renormalizes after top-k)
      for (std::int64_t i = 0; i < n; ++i) {
        if (!has_cut || !ranks_before(limit, candidate(cands, i))) z += cands.e[i];
      }
    }
    double const target = static_cast<double>(p) * z;
    Window const w = narrow(cands, n, has_cut ? &limit : nullptr, 0, target);
    if (w.size > 0) {
      std::int64_t at = mass_select(cands.sel, w.size, target - w.mass_above);
      if (at < 0 && w.bounded) {
        // The histogram put the cut in this window; summed in another order it fell a rounding
        // short: the window's lowest-ranked candidate.
        at = 0;
        for (std::int64_t i = 1; i < w.size; ++i) {
          if (ranks_before(cands.sel[at], cands.sel[i])) at = i;
        }
      }
      if (at >= 0) {
        *cut = cands.sel[at];
        has_cut = true;
      }
    }
  }
  return has_cut;
}

double chunked_sum(float const* w, std::int64_t n) {
  double total = 0.0;
  for (std::int64_t c = 0; c < n; c += kDrawChunk) total += chunk_sum(w + c, std::min(kDrawChunk, n - c));
  return total;
}

// Weights (kept: e, else 0) overwrite cands.e without branches (about half the candidates of a
// flat row are dropped, in no order a predictor could learn); sums go by chunks of kDrawChunk,
// each with independent accumulators, and only the chunk holding the target is scanned.
std::int64_t draw_candidates(Candidates const& cands, std::int64_t n, Cand const* cut, float min_p, double u,
                             std::int64_t fallback) {
  float const cut_x = cut != nullptr ? cut->x : -kInf;
  std::int32_t const cut_idx = cut != nullptr ? cut->idx : std::numeric_limits<std::int32_t>::max();
  float* const w = cands.e;
  float const* const x = cands.x;
  std::int32_t const* const idx = cands.idx;
  for (std::int64_t i = 0; i < n; ++i) {
    bool const ranked = (x[i] > cut_x) | ((x[i] == cut_x) & (idx[i] <= cut_idx));
    w[i] = (ranked & (w[i] >= min_p)) ? w[i] : 0.f;
  }
  double const total = chunked_sum(w, n);
  double const target = u * total;
  double acc = 0.0;
  std::int64_t last = -1;
  for (std::int64_t c = 0; c < n; c += kDrawChunk) {
    std::int64_t const len = std::min(kDrawChunk, n - c);
    double const s = chunk_sum(w + c, len);
    if (acc + s <= target) {
      acc += s;
      continue;
    }
    for (std::int64_t i = c; i < c + len; ++i) {
      if (!(w[i] > 0.f)) continue;
      acc += w[i];
      last = idx[i];
      if (acc > target) return last;
    }
    // The chunk's sum was a rounding above its rescan: carry on with the next.
  }
  if (last >= 0) return last;
  for (std::int64_t i = n - 1; i >= 0; --i) {
    if (w[i] > 0.f) return idx[i];  // u * total rounded up to the total: the last kept
  }
  return fallback;
}

}  // namespace inflight::kernels::cpu::detail
