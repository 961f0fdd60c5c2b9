// The sampling launcher (workspace, threading) and the row algorithm (the passes over the blocks, the
// candidate thresholds, the draw over a whole row); see sampling.h. The selection among candidates is
// in sampling_select.cpp, the block kernels (every loop over logits) in sampling_impl.h.
#include "sampling.h"
#include "sampling_select.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>

namespace inflight::kernels::cpu {
namespace {

using detail::BlockStats;
using detail::Cand;
using detail::Candidates;
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

// Per-thread scratch.
struct ThreadArea {
  BlockMax* maxes;    // [num_blocks] (row mode)
  BlockStats* stats;  // [num_blocks] (row mode)
  Candidates cand;
  float* ebuf;  // [kSamplingBlock]
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

class RowSampler {
 public:
  RowSampler(SamplingParams const& p, SamplingBlockKernels const& k, Layout const& lay, std::byte* ws)
      : p_(p), k_(k), lay_(lay), ws_(ws), elem_(static_cast<std::int64_t>(scalar_type_size(p.dtype))) {}

  std::int64_t num_blocks() const { return lay_.num_blocks; }

  ThreadArea area(int thread) const {
    std::byte* base = ws_ + lay_.thread_base + lay_.thread_stride * static_cast<std::size_t>(thread);
    Candidates const cand{reinterpret_cast<float*>(base + lay_.t_x), reinterpret_cast<float*>(base + lay_.t_e),
                          reinterpret_cast<std::int32_t*>(base + lay_.t_idx),
                          reinterpret_cast<std::int32_t*>(base + lay_.t_bin),
                          reinterpret_cast<Cand*>(base + lay_.t_sel)};
    return {reinterpret_cast<BlockMax*>(base + lay_.t_maxes), reinterpret_cast<BlockStats*>(base + lay_.t_stats), cand,
            reinterpret_cast<float*>(base + lay_.t_ebuf)};
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
                              area.cand.x + n, area.cand.idx + n);
      }
      if (pl.k != 0 && n < pl.k && !last_level) continue;
      k_.divide_exp(area.cand.x, n, pl.t, pl.m_div, area.cand.e);
      // Every token below the threshold has x <= edge, so the candidates with x > edge are a top
      // set: everything that outranks one of them is among them, ties with non-candidates included.
      float const edge = threshold / pl.t;
      float x_min = kInf;
      for (std::int64_t i = 0; i < n; ++i) x_min = std::min(x_min, area.cand.x[i]);
      std::int64_t kept = n;
      if (!(x_min > edge)) {  // rare: ties at the edge, or -inf logits at the last level
        kept = 0;
        for (std::int64_t i = 0; i < n; ++i) {
          if (area.cand.x[i] > edge) {
            area.cand.x[kept] = area.cand.x[i];
            area.cand.e[kept] = area.cand.e[i];
            area.cand.idx[kept] = area.cand.idx[i];
            ++kept;
          }
        }
      }
      mass = pl.k == 0 ? detail::chunked_sum(area.cand.e, kept) : 0.0;
      if (!last_level && (pl.k != 0 ? kept < pl.k : mass < static_cast<double>(pl.p) * z_all)) continue;
      Cand cut{};
      bool const has_cut = detail::select_cut(area.cand, kept, pl.k, pl.p, z_all, &cut);
      return detail::draw_candidates(area.cand, kept, has_cut ? &cut : nullptr, pl.min_p, u, pl.argmax);
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
    case Isa::kAvx512F:  // sampling_avx512.cpp is built with the BF16 flags: the AVX2 kernels here
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
