// The sampling launcher (workspace, threading) and the row algorithm (thresholds, selection, the
// draw). The block kernels it calls are in sampling_impl.h; see sampling.h.
#include "sampling.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

namespace inflight::kernels::cpu {
namespace {

using detail::BlockStats;
using detail::SamplingBlockKernels;
using detail::StatsArgs;
using detail::StatsMode;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Logits per thread below which more threads cost more than they save: a row of 32k logits takes
// ~15 us on one core, a fork/join a few us on an idle machine and up to a scheduler time slice
// (ms) when the cores are shared. So one 49152-logit row stays on one thread; two rows, or one
// row of a 128k vocabulary, are split.
constexpr std::int64_t kMinLogitsPerThread = 32768;
// Candidate thresholds stop doubling their gap below the max here (in logits for top-k, nats for
// top-p); past it every token is a candidate.
constexpr float kMaxGap = 128.f;
// Logits in the strided sample that candidate thresholds are estimated from.
constexpr std::int64_t kSampleSize = 512;
// Selections over more candidates than this are first narrowed to one bin of a histogram of x
// (radix-select style); smaller ones go straight to nth_element / pivoting.
constexpr std::int64_t kHistogramMin = 512;
constexpr int kHistogramBins = 256;

struct BlockMax {
  float max;
  std::int64_t argmax;
};

// One row's parameters after the max pass.
struct RowPlan {
  float l_max;
  std::int64_t argmax;
  bool greedy;  // T <= 0, or no finite maximum (all -inf / NaN, or +inf), or l / T overflows
  float t;
  StatsMode mode;
  bool select;     // top-k or top-p: the candidate path
  std::int64_t k;  // 0: no top-k
  float p;         // 1: no top-p
  float min_p;     // 0: no min-p
  StatsArgs args;
  float m_div;  // l_max / T: the candidates' shift (their x divides, as the reference does)
};

// A candidate token: x = l / T, e = exp(x - m_div); bin is scratch for histogram narrowing.
struct Cand {
  float x;
  float e;
  std::int32_t idx;
  std::int32_t bin;
};

// Rank order: larger x first, then the lower index (a stable descending sort).
inline bool ranks_before(Cand const& a, Cand const& b) { return a.x > b.x || (a.x == b.x && a.idx < b.idx); }

// Per-thread scratch.
struct ThreadArea {
  BlockMax* maxes;         // [num_blocks] (row mode)
  BlockStats* stats;       // [num_blocks] (row mode)
  float* cand_x;           // [V + 16] candidates in index order
  float* cand_e;           // [V + 16]
  std::int32_t* cand_idx;  // [V + 16]
  std::int32_t* cand_bin;  // [V] histogram bin of each candidate
  Cand* sel;               // [V] the candidates a selection works on
  float* ebuf;             // [kSamplingBlock]
};

struct Layout {
  int threads = 1;
  bool staged = false;  // rows split over threads (few rows) rather than one row per thread
  std::int64_t num_blocks = 0;
  std::size_t plans = 0, maxes = 0, stats = 0;  // staged: shared arrays
  std::size_t thread_base = 0, thread_stride = 0;
  std::size_t t_maxes = 0, t_stats = 0, t_x = 0, t_e = 0, t_idx = 0, t_bin = 0, t_sel = 0, t_ebuf = 0;
  std::size_t total = 0;
};

std::size_t align_up(std::size_t v) { return (v + 63) & ~std::size_t{63}; }

Layout make_layout(std::int64_t num_rows, std::int64_t vocab, int num_threads) {
  Layout lay;
  auto const n = static_cast<std::size_t>(std::max<std::int64_t>(num_rows, 0));
  auto const v = static_cast<std::size_t>(std::max<std::int64_t>(vocab, 1));
  lay.num_blocks = (static_cast<std::int64_t>(v) + kSamplingBlock - 1) / kSamplingBlock;
  auto const nb = static_cast<std::size_t>(lay.num_blocks);
  std::int64_t const work = static_cast<std::int64_t>(n * v) / kMinLogitsPerThread;
  lay.threads = static_cast<int>(std::clamp<std::int64_t>(work, 1, std::max(num_threads, 1)));
  lay.staged = lay.threads > 1 && num_rows < lay.threads;
  std::size_t off = 0;
  auto take = [&off](std::size_t bytes) {
    std::size_t const at = off;
    off = align_up(off + bytes);
    return at;
  };
  if (lay.staged) {
    lay.plans = take(n * sizeof(RowPlan));
    lay.maxes = take(n * nb * sizeof(BlockMax));
    lay.stats = take(n * nb * sizeof(BlockStats));
  }
  lay.thread_base = off;
  std::size_t t = 0;
  auto take_t = [&t](std::size_t bytes) {
    std::size_t const at = t;
    t = align_up(t + bytes);
    return at;
  };
  lay.t_maxes = take_t(nb * sizeof(BlockMax));
  lay.t_stats = take_t(nb * sizeof(BlockStats));
  // + 16: the vector collect stores whole vectors past the last candidate.
  lay.t_x = take_t((v + 16) * sizeof(float));
  lay.t_e = take_t((v + 16) * sizeof(float));
  lay.t_idx = take_t((v + 16) * sizeof(std::int32_t));
  lay.t_bin = take_t(v * sizeof(std::int32_t));
  lay.t_sel = take_t(v * sizeof(Cand));
  lay.t_ebuf = take_t(kSamplingBlock * sizeof(float));
  lay.thread_stride = t;
  lay.total = off + t * static_cast<std::size_t>(lay.threads) + 64;  // + 64: to align the caller's buffer
  return lay;
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

class RowSampler {
 public:
  RowSampler(SamplingParams const& p, SamplingBlockKernels const& k, Layout const& lay, std::byte* ws)
      : p_(p), k_(k), lay_(lay), ws_(ws), elem_(static_cast<std::int64_t>(scalar_type_size(p.dtype))) {}

  std::int64_t num_blocks() const { return lay_.num_blocks; }

  ThreadArea area(int thread) const {
    std::byte* base = ws_ + lay_.thread_base + lay_.thread_stride * static_cast<std::size_t>(thread);
    return {reinterpret_cast<BlockMax*>(base + lay_.t_maxes),   reinterpret_cast<BlockStats*>(base + lay_.t_stats),
            reinterpret_cast<float*>(base + lay_.t_x),          reinterpret_cast<float*>(base + lay_.t_e),
            reinterpret_cast<std::int32_t*>(base + lay_.t_idx), reinterpret_cast<std::int32_t*>(base + lay_.t_bin),
            reinterpret_cast<Cand*>(base + lay_.t_sel),         reinterpret_cast<float*>(base + lay_.t_ebuf)};
  }
  RowPlan* plans() const { return reinterpret_cast<RowPlan*>(ws_ + lay_.plans); }
  BlockMax* shared_maxes(std::int64_t row) const {
    return reinterpret_cast<BlockMax*>(ws_ + lay_.maxes) + row * lay_.num_blocks;
  }
  BlockStats* shared_stats(std::int64_t row) const {
    return reinterpret_cast<BlockStats*>(ws_ + lay_.stats) + row * lay_.num_blocks;
  }

  void max_pass(std::int64_t row, std::int64_t b, BlockMax* out) const {
    k_.block_max(block(row, b), block_len(b), &out->max, &out->argmax);
    out->argmax += b * kSamplingBlock;
  }

  void plan(std::int64_t row, BlockMax const* maxes, RowPlan* pl) const {
    // Blocks in order, strict >: the first index of the maximum, as torch.argmax.
    float l_max = maxes[0].max;
    std::int64_t argmax = maxes[0].argmax;
    for (std::int64_t b = 1; b < lay_.num_blocks; ++b) {
      if (maxes[b].max > l_max) {
        l_max = maxes[b].max;
        argmax = maxes[b].argmax;
      }
    }
    pl->l_max = l_max;
    pl->argmax = argmax;
    float const t = p_.temperature[row];
    pl->t = t;
    pl->greedy = !(t > 0.f) || !std::isfinite(l_max);
    if (pl->greedy) return;
    StatsArgs& a = pl->args;
    a.inv_t = 1.f / t;
    a.m = l_max * a.inv_t;
    pl->m_div = l_max / t;
    // A tiny temperature can overflow x = l / T; such a row is one-hot anyway.
    if (!std::isfinite(a.m) || !std::isfinite(pl->m_div) || !std::isfinite(a.inv_t)) {
      pl->greedy = true;
      return;
    }
    std::int64_t const k = p_.top_k[row];
    pl->k = (k > 0 && k < p_.vocab_size) ? k : 0;
    pl->p = p_.top_p[row] < 1.f ? p_.top_p[row] : 1.f;
    pl->min_p = p_.min_p[row] > 0.f ? p_.min_p[row] : 0.f;
    a.min_p = pl->min_p;
    pl->select = pl->k != 0 || pl->p < 1.f;
    // Candidate rows apply min-p to the candidates; the others need its mass from the stream.
    pl->mode = !pl->select && pl->min_p > 0.f ? StatsMode::kMinP : StatsMode::kSum;
  }

  void stats_pass(std::int64_t row, std::int64_t b, RowPlan const& pl, BlockStats* out) const {
    k_.block_stats[static_cast<int>(pl.mode)](block(row, b), block_len(b), pl.args, out);
  }

  std::int64_t finish(std::int64_t row, RowPlan const& pl, BlockStats const* stats, ThreadArea const& area) const {
    if (pl.greedy) return pl.argmax;
    double const u = sampling_uniform(p_.seeds[row], static_cast<std::uint64_t>(p_.steps[row]));
    return pl.select ? draw_selected(row, pl, stats, area, u) : draw_full(row, pl, stats, area, u);
  }

 private:
  void const* block(std::int64_t row, std::int64_t b) const {
    return static_cast<char const*>(p_.logits) + (row * p_.row_stride + b * kSamplingBlock) * elem_;
  }
  std::int64_t block_len(std::int64_t b) const { return std::min(kSamplingBlock, p_.vocab_size - b * kSamplingBlock); }

  // No top-k / top-p: inverse CDF over the whole row, in index order. The per-block sums find the
  // block; one rescan of it (the same e values) finds the token.
  std::int64_t draw_full(std::int64_t row, RowPlan const& pl, BlockStats const* stats, ThreadArea const& area,
                         double u) const {
    bool const min_p = pl.mode == StatsMode::kMinP;
    double total = 0.0;
    for (std::int64_t b = 0; b < lay_.num_blocks; ++b) total += min_p ? stats[b].sum_kept : stats[b].sum;
    double const target = u * total;
    double acc = 0.0;
    std::int64_t last = -1;
    for (std::int64_t b = 0; b < lay_.num_blocks; ++b) {
      double const s = min_p ? stats[b].sum_kept : stats[b].sum;
      if (acc + s <= target) {
        acc += s;
        continue;
      }
      std::int64_t const n = block_len(b);
      k_.block_exp(block(row, b), n, pl.args.inv_t, pl.args.m, area.ebuf);
      for (std::int64_t i = 0; i < n; ++i) {
        float const e = area.ebuf[i];
        if (!(e > 0.f) || (min_p && !(e >= pl.min_p))) continue;
        acc += e;
        last = b * kSamplingBlock + i;
        if (acc > target) return last;
      }
      // The block's sum (vector order) was a rounding above its rescan: carry on with the next.
    }
    return last >= 0 ? last : pl.argmax;
  }

  // Top-k / top-p: candidates are the tokens above a threshold, lowered until they hold the cut;
  // then select and draw. Thresholds: for top-k, a rank estimate from a strided sample of the row;
  // for top-p, 1 nat below the max (enough for peaked rows), then estimates from the exact mass
  // above the last threshold plus a strided sample below it. When an estimate fails, the gap below
  // the max doubles; past kMaxGap every token is a candidate.
  std::int64_t draw_selected(std::int64_t row, RowPlan const& pl, BlockStats const* stats, ThreadArea const& area,
                             double u) const {
    double z_all = 0.0;
    for (std::int64_t b = 0; b < lay_.num_blocks; ++b) z_all += stats[b].sum;
    float const unit = pl.k != 0 ? 1.f : pl.t;  // gaps: logits for top-k (rank does not depend on T), nats for top-p
    float threshold = pl.k != 0 ? rank_estimate(row, pl, area) : pl.l_max - pl.t;
    double mass = 0.0;  // of the candidates above the threshold (top-p)
    for (;; threshold = lower(pl, threshold, mass, unit, row, area, z_all)) {
      bool const last_level = threshold == -kInf;
      std::int64_t n = 0;
      for (std::int64_t b = 0; b < lay_.num_blocks; ++b) {
        n += k_.block_collect(block(row, b), block_len(b), threshold, static_cast<std::int32_t>(b * kSamplingBlock),
                              area.cand_x + n, area.cand_idx + n);
      }
      if (pl.k != 0 && n < pl.k && !last_level) continue;
      k_.divide_exp(area.cand_x, n, pl.t, pl.m_div, area.cand_e);
      // Every token below the threshold has x <= edge, so the candidates with x > edge are a top
      // set: everything that outranks one of them is among them, ties with non-candidates included.
      float const edge = threshold / pl.t;
      float x_min = kInf;
      for (std::int64_t i = 0; i < n; ++i) x_min = std::min(x_min, area.cand_x[i]);
      std::int64_t kept = n;
      if (!(x_min > edge)) {  // rare: ties at the edge, or -inf logits at the last level
        kept = 0;
        for (std::int64_t i = 0; i < n; ++i) {
          if (area.cand_x[i] > edge) {
            area.cand_x[kept] = area.cand_x[i];
            area.cand_e[kept] = area.cand_e[i];
            area.cand_idx[kept] = area.cand_idx[i];
            ++kept;
          }
        }
      }
      mass = 0.0;
      if (pl.k == 0) {
        for (std::int64_t c = 0; c < kept; c += kDrawChunk) {
          mass += chunk_sum(area.cand_e + c, std::min(kDrawChunk, kept - c));
        }
      }
      if (!last_level && (pl.k != 0 ? kept < pl.k : mass < static_cast<double>(pl.p) * z_all)) continue;
      Cand cut{};
      bool const has_cut = select(pl, area, kept, z_all, &cut);
      return draw_candidates(pl, area, kept, has_cut ? &cut : nullptr, u);
    }
  }

  // The next, lower, threshold (see draw_selected); `mass` is the exact mass above `threshold`.
  float lower(RowPlan const& pl, float threshold, double mass, float unit, std::int64_t row, ThreadArea const& area,
              double z_all) const {
    if (pl.k == 0) {
      float const next = mass_estimate(row, pl, area, threshold, mass, z_all);
      if (next < threshold && next > -kInf) return next;
    }
    float const gap = std::max(pl.l_max - threshold, unit);
    float const next = gap >= kMaxGap * unit ? -kInf : pl.l_max - 2.f * gap;
    return next < threshold ? next : -kInf;
  }

  // About kSampleSize logits of the row, evenly strided, into area.ebuf; returns how many (0 when
  // the row has too many blocks for the buffer) and the stride.
  std::int64_t gather_sample(std::int64_t row, ThreadArea const& area, std::int64_t* stride) const {
    *stride = std::max<std::int64_t>(1, p_.vocab_size / kSampleSize);
    if (p_.vocab_size / *stride + lay_.num_blocks > kSamplingBlock) return 0;
    std::int64_t n = 0;
    for (std::int64_t b = 0; b < lay_.num_blocks; ++b) {
      void const* src = block(row, b);
      for (std::int64_t i = 0; i < block_len(b); i += *stride) area.ebuf[n++] = load_logit(src, i);
    }
    return n;
  }

  float load_logit(void const* src, std::int64_t i) const {
    switch (p_.dtype) {
      case ScalarType::kBFloat16:
        return to_float(static_cast<BFloat16 const*>(src)[i]);
      case ScalarType::kFloat16:
        return to_float(static_cast<Float16 const*>(src)[i]);
      default:
        return static_cast<float const*>(src)[i];
    }
  }

  // A threshold with, by the sample, about 2k + 2 strides of tokens above it (k of them needed).
  float rank_estimate(std::int64_t row, RowPlan const& pl, ThreadArea const& area) const {
    std::int64_t stride = 1;
    std::int64_t const n = gather_sample(row, area, &stride);
    std::int64_t const j = 2 * ((pl.k + stride - 1) / stride) + 2;
    if (n == 0 || j > n) return -kInf;
    std::nth_element(area.ebuf, area.ebuf + j - 1, area.ebuf + n, std::greater<float>());
    return std::min(area.ebuf[j - 1], pl.l_max);
  }

  // A threshold below `above` where, by the sample, the tokens hold the top-p mass with a margin
  // (a quarter of the mass beyond it): the exact mass above `above` plus the sampled tokens below
  // it, each standing for `stride` tokens. (The sample says little about the sparse top of a row,
  // which the exact part covers.) -inf if the sample never gets there.
  float mass_estimate(std::int64_t row, RowPlan const& pl, ThreadArea const& area, float above, double mass_above,
                      double total) const {
    double const target = static_cast<double>(pl.p) * total;
    double const want = target + 0.25 * (total - target);
    std::int64_t stride = 1;
    std::int64_t n = gather_sample(row, area, &stride);
    n = std::partition(area.ebuf, area.ebuf + n, [above](float v) { return v < above; }) - area.ebuf;
    std::sort(area.ebuf, area.ebuf + n, std::greater<float>());
    double mass = mass_above;
    for (std::int64_t i = 0; i < n; ++i) {
      mass += static_cast<double>(stride) * std::exp(static_cast<double>(area.ebuf[i] / pl.t - pl.m_div));
      if (mass >= want) return area.ebuf[i];
    }
    return -kInf;
  }

  // The top-k then top-p cut over n candidates (a top set that holds it): returns true with *cut
  // the lowest-ranked kept candidate, false when all n are kept.
  static bool select(RowPlan const& pl, ThreadArea const& area, std::int64_t n, double z_all, Cand* cut) {
    bool has_cut = false;
    if (pl.k != 0 && n > pl.k) {
      Window const w = narrow(area, n, nullptr, pl.k - 1, -1.0);
      std::int64_t const pos = pl.k - 1 - w.above;
      rank_select(area.sel, w.size, pos);
      *cut = area.sel[pos];
      has_cut = true;
    }
    if (pl.p < 1.f) {
      Cand const limit = *cut;
      double z = z_all;
      if (pl.k != 0) {
        z = 0.0;  // top-p is relative to the top-k mass (the reference renormalizes after top-k)
        for (std::int64_t i = 0; i < n; ++i) {
          if (!has_cut || !ranks_before(limit, candidate(area, i))) z += area.cand_e[i];
        }
      }
      double const target = static_cast<double>(pl.p) * z;
      Window const w = narrow(area, n, has_cut ? &limit : nullptr, 0, target);
      if (w.size > 0) {
        std::int64_t at = mass_select(area.sel, w.size, target - w.mass_above);
        if (at < 0 && w.bounded) {
          // The histogram put the cut in this window; summed in another order it fell a rounding
          // short: the window's lowest-ranked candidate.
          at = 0;
          for (std::int64_t i = 1; i < w.size; ++i) {
            if (ranks_before(area.sel[at], area.sel[i])) at = i;
          }
        }
        if (at >= 0) {
          *cut = area.sel[at];
          has_cut = true;
        }
      }
    }
    return has_cut;
  }

  static Cand candidate(ThreadArea const& area, std::int64_t i) {
    return {area.cand_x[i], area.cand_e[i], area.cand_idx[i], 0};
  }

  // A selection's window: area.sel[0, size), everything ranked above it counted in `above` and
  // `mass_above`. bounded: a histogram placed the cut inside it.
  struct Window {
    std::int64_t size;
    std::int64_t above;
    double mass_above;
    bool bounded;
  };

  // Copies into area.sel the candidates, among those ranked at or above *limit (all if null), of
  // the histogram bin that holds the cut: the (pos + 1)-th ranked (target < 0) or the first whose
  // cumulative mass reaches target. Few candidates are copied whole. size 0: they fall short.
  static Window narrow(ThreadArea const& area, std::int64_t n, Cand const* limit, std::int64_t pos, double target) {
    float x_min = kInf, x_max = -kInf;
    std::int64_t m = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      bool const in = limit == nullptr || !ranks_before(*limit, candidate(area, i));
      area.cand_bin[i] = in ? 0 : -1;
      if (!in) continue;
      x_min = std::min(x_min, area.cand_x[i]);
      x_max = std::max(x_max, area.cand_x[i]);
      ++m;
    }
    Binning const bin = make_binning(x_min, x_max);
    if (m <= kHistogramMin || !bin.ok) {
      std::int64_t c = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        if (area.cand_bin[i] == 0) area.sel[c++] = candidate(area, i);
      }
      return {c, 0, 0.0, false};
    }
    // Four interleaved histograms: runs of one bin would otherwise chain every update on the last.
    std::int64_t count[4][kHistogramBins] = {};
    double mass[4][kHistogramBins] = {};
    bool const by_mass = target >= 0.0;
    for (std::int64_t i = 0; i < n; ++i) {
      if (area.cand_bin[i] < 0) continue;
      int const b = bin(area.cand_x[i]);
      area.cand_bin[i] = b;
      ++count[i & 3][b];
      if (by_mass) mass[i & 3][b] += area.cand_e[i];
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
      if (area.cand_bin[i] == b) area.sel[c++] = candidate(area, i);
    }
    return {c, above, mass_above, true};
  }

  // Inverse CDF, in index order, over the candidates ranked at or above *cut with e >= min_p.
  // Weights (kept: e, else 0) overwrite cand_e without branches (about half the candidates of a
  // flat row are dropped, in no order a predictor could learn); sums go by chunks of kDrawChunk,
  // each with independent accumulators, and only the chunk holding the target is scanned.
  static std::int64_t draw_candidates(RowPlan const& pl, ThreadArea const& area, std::int64_t n, Cand const* cut,
                                      double u) {
    float const cut_x = cut != nullptr ? cut->x : -kInf;
    std::int32_t const cut_idx = cut != nullptr ? cut->idx : std::numeric_limits<std::int32_t>::max();
    float const min_p = pl.min_p;
    float* const w = area.cand_e;
    float const* const x = area.cand_x;
    std::int32_t const* const idx = area.cand_idx;
    for (std::int64_t i = 0; i < n; ++i) {
      bool const ranked = (x[i] > cut_x) | ((x[i] == cut_x) & (idx[i] <= cut_idx));
      w[i] = (ranked & (w[i] >= min_p)) ? w[i] : 0.f;
    }
    double total = 0.0;
    for (std::int64_t c = 0; c < n; c += kDrawChunk) total += chunk_sum(w + c, std::min(kDrawChunk, n - c));
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
    return pl.argmax;
  }

  static constexpr std::int64_t kDrawChunk = 256;

  static double chunk_sum(float const* w, std::int64_t len) {
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    std::int64_t i = 0;
    for (; i + 4 <= len; i += 4) {
      for (int j = 0; j < 4; ++j) acc[j] += w[i + j];
    }
    for (; i < len; ++i) acc[0] += w[i];
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
  }

  SamplingParams const& p_;
  SamplingBlockKernels const& k_;
  Layout const& lay_;
  std::byte* ws_;
  std::int64_t elem_;
};
SamplingBlockKernels const& kernels_for(Isa isa, ScalarType dtype) {
  switch (isa) {
    case Isa::kAvx512:
      return detail::sampling_kernels_avx512(dtype);
    case Isa::kAvx2:
      return detail::sampling_kernels_avx2(dtype);
    case Isa::kPortable:
      break;
  }
  return detail::sampling_kernels_portable(dtype);
}

}  // namespace

std::int64_t sampling_workspace_size(std::int64_t num_rows, std::int64_t vocab_size, int num_threads) {
  return static_cast<std::int64_t>(make_layout(num_rows, vocab_size, num_threads).total);
}

void launch_sampling(SamplingParams const& p, ThreadPool& pool) {
  if (p.num_rows <= 0) return;
  if (p.vocab_size <= 0 || p.vocab_size > std::numeric_limits<std::int32_t>::max()) {
    throw std::invalid_argument("vocab_size must be in [1, 2**31), got " + std::to_string(p.vocab_size));
  }
  if (!is_float_type(p.dtype)) {
    throw std::invalid_argument(std::string("dtype must be float32, bfloat16 or float16, got ") +
                                scalar_type_name(p.dtype));
  }
  Layout const lay = make_layout(p.num_rows, p.vocab_size, p.num_threads);
  if (p.workspace == nullptr || p.workspace_bytes < static_cast<std::int64_t>(lay.total)) {
    throw std::invalid_argument("sampling workspace must be >= " + std::to_string(lay.total) + " bytes, got " +
                                std::to_string(p.workspace_bytes));
  }
  auto const addr = reinterpret_cast<std::uintptr_t>(p.workspace);
  auto* ws = static_cast<std::byte*>(p.workspace) + ((64 - addr % 64) % 64);
  RowSampler const rs(p, kernels_for(selected_isa(), p.dtype), lay, ws);
  std::int64_t const nb = rs.num_blocks();
  std::int64_t const rows = p.num_rows;
  int const nt = lay.threads;

  if (!lay.staged) {
    // Many rows: each thread owns whole rows (they stay in its cache across the passes).
    pool_detail::parallel_for(pool, rows, nt, true, [&](std::int64_t r, int thread) {
      ThreadArea const area = rs.area(thread);
      for (std::int64_t b = 0; b < nb; ++b) rs.max_pass(r, b, &area.maxes[b]);
      RowPlan pl;
      rs.plan(r, area.maxes, &pl);
      if (!pl.greedy) {
        for (std::int64_t b = 0; b < nb; ++b) rs.stats_pass(r, b, pl, &area.stats[b]);
      }
      p.out[r] = rs.finish(r, pl, area.stats, area);
    });
    return;
  }

  // Fewer rows than threads: the two streaming passes are split over (row, block); the finish,
  // which reads few candidates, is per row. Same blocks, same combine order as above.
  RowPlan* plans = rs.plans();
  // Four phases, each complete (parallel_for returns) before the next reads its results.
  pool_detail::parallel_for(pool, rows * nb, nt, false, [&](std::int64_t t, int) {
    rs.max_pass(t / nb, t % nb, rs.shared_maxes(t / nb) + t % nb);
  });
  for (std::int64_t r = 0; r < rows; ++r) rs.plan(r, rs.shared_maxes(r), &plans[r]);
  pool_detail::parallel_for(pool, rows * nb, nt, false, [&](std::int64_t t, int) {
    if (!plans[t / nb].greedy) rs.stats_pass(t / nb, t % nb, plans[t / nb], rs.shared_stats(t / nb) + t % nb);
  });
  pool_detail::parallel_for(pool, rows, nt, true, [&](std::int64_t r, int thread) {
    p.out[r] = rs.finish(r, plans[r], rs.shared_stats(r), rs.area(thread));
  });
}

}  // namespace inflight::kernels::cpu
