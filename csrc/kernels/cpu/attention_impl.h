// The attention algorithms, written once over a vector-traits class V and instantiated per ISA in
// attention.cpp (portable, V = scalar), attention_avx2.cpp and attention_avx512.cpp, through the
// compile-time dispatch of attention_dispatch.h (q's dtype x the cache's: the same, or int8 x head_dim).
//
// Every TU that includes this header defines INFLIGHT_ATTENTION_ISA (a namespace name) first: all
// code here lives in that per-ISA namespace, so the inline functions compiled with -mavx512f in one
// TU can never be picked by the linker for the portable TU (which must run on any x86-64).
//
// V provides (kWidth = lanes of one fp32 register):
//   Reg, kWidth, kKeyTile (keys per tile), kQkRows, kPvRows, kPvChunk (register blocking)
//   zero, set1, load, store, add, sub, mul, fmadd, max, hsum, hmax, exp2
//   reduce_lanes(Reg const* v)  -> Reg whose lane i is the sum of v[i]'s lanes (i < kWidth)
//   transpose(Reg* v)           in place, a kWidth x kWidth block
//   load_cvt(T const*)          kWidth elements of T (float, BFloat16, Float16, int8_t) widened to fp32;
//                               Float8E4M3 bytes as e4m3 * 2^-8 (the fp16 trick of scalar_type.h, exact)
//   store_cvt(T*, Reg)          rounded to T (round to nearest even)
#pragma once

#ifndef INFLIGHT_ATTENTION_ISA
#error "define INFLIGHT_ATTENTION_ISA (the per-ISA namespace) before including attention_impl.h"
#endif

#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attention.h"
#include "cpu_features.h"

namespace inflight::kernels::cpu::INFLIGHT_ATTENTION_ISA {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Query rows (query tokens x heads of one KV group) per context work item: enough rows to amortise
// packing the key tile, few enough that one long prompt still splits into many work items.
constexpr int kContextRows = 48;
constexpr int kMaxContextRows = std::max(kContextRows, kMaxGroupSize);
// Decode prefetches the K/V rows this many tiles ahead of the one it computes.
constexpr int kPrefetchTiles = 2;

// kHeadDim: the head dim this instantiation is unrolled for; 0 = read it from the params at run
// time (any multiple of V::kWidth up to kMaxHeadDim). T: the element type of q and out (float,
// BFloat16, Float16). C: the cache's, T or int8_t (codes with one fp32 scale per token and KV head,
// dequantised where a 16-bit cache is widened) or Float8E4M3 (E4M3 bytes with one scale per tensor for K
// and one for V: widened as a 16-bit cache is, to e4m3 * 2^-8; 256 * k_scale goes into q's scale,
// 256 * v_scale into the output's 1 / l).
template <class V, int kHeadDim, class T, class C = T>
struct AttentionKernels {
  using Reg = typename V::Reg;
  static constexpr bool kInt8 = std::is_same_v<C, std::int8_t>;
  static constexpr bool kFp8 = std::is_same_v<C, Float8E4M3>;
  // One byte per element (int8 or fp8): decode reads V in place, widening it in P.V.
  static constexpr bool kNarrow = kInt8 || kFp8;
  // An fp32 cache is read in place; any other is widened (and dequantised) into fp32 tiles first.
  static constexpr bool kInPlace = std::is_same_v<C, float>;
  static_assert(std::is_same_v<C, T> || kNarrow, "the cache holds q's dtype, int8 codes or E4M3 bytes");
  static constexpr int W = V::kWidth;
  static constexpr int kBufHd = kHeadDim ? kHeadDim : kMaxHeadDim;  // stack buffer row length
  // Keys per tile in both kernels (one step of the online softmax): V's choice, a multiple of W
  // large enough to amortise the per-tile softmax update and K transpose.
  static constexpr int kKeyTile = V::kKeyTile;
  static constexpr int kTileVecs = kKeyTile / W;  // vectors per score row
  static_assert(kKeyTile % W == 0 && kBufHd % W == 0);

  static int head_dim(int runtime_head_dim) { return kHeadDim ? kHeadDim : runtime_head_dim; }
  // Vectors per head row: a compile-time constant in the unrolled instantiations even where a
  // helper is not inlined (a run-time trip count would keep q and the accumulators out of registers).
  static int vecs(int runtime_nvec) { return kHeadDim ? kHeadDim / W : runtime_nvec; }

  // What the cache's per-tensor scales fold into: q's scale (K) and the output's normalisation (V);
  // 1 for every cache but fp8 (whose widened bytes are e4m3 * 2^-8).
  static float k_factor(AttentionParams const& p) {
    if constexpr (kFp8) return 256.0f * p.k_scale;
    (void)p;
    return 1.0f;
  }
  static float v_factor(AttentionParams const& p) {
    if constexpr (kFp8) return 256.0f * p.v_scale;
    (void)p;
    return 1.0f;
  }

  // ---- building blocks ---------------------------------------------------------------------------

  // o[r, c] += sum_i p[r, i] * vrows[i][c] for R rows and NC vectors of columns starting at vector c0.
  // E: the rows' element type, float (packed or an fp32 cache), int8_t or Float8E4M3 (widened here, once
  // for all R rows: the int8 / fp8 decode reads V without packing it; int8's scales are in p).
  template <int R, int NC, class E>
  static void pv_block(float* o, int o_stride, float const* p, int p_stride, E const* const* vrows, int n, int c0) {
    Reg acc[R][NC];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NC; ++c) acc[r][c] = V::load(o + r * o_stride + (c0 + c) * W);
    for (int i = 0; i < n; ++i) {
      Reg vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = V::load_cvt(vrows[i] + (c0 + c) * W);
      for (int r = 0; r < R; ++r) {
        Reg pb = V::set1(p[r * p_stride + i]);
        for (int c = 0; c < NC; ++c) acc[r][c] = V::fmadd(pb, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NC; ++c) V::store(o + r * o_stride + (c0 + c) * W, acc[r][c]);
  }

  template <int R, class E>
  static void pv_rows_fixed(float* o, int o_stride, float const* p, int p_stride, E const* const* vrows, int n,
                            int nvec_rt) {
    int const nvec = vecs(nvec_rt);
    constexpr int NC = V::kPvChunk;
    int c0 = 0;
    for (; c0 + NC <= nvec; c0 += NC) pv_block<R, NC, E>(o, o_stride, p, p_stride, vrows, n, c0);
    if constexpr (kHeadDim == 0 || kHeadDim / W % NC != 0) {
      for (; c0 < nvec; ++c0) pv_block<R, 1, E>(o, o_stride, p, p_stride, vrows, n, c0);
    }
  }

  // All `rows` rows: blocks of kPvRows, then the remainder (2 or 3 rows in one pass over V).
  template <class E>
  static void pv_rows(float* o, int o_stride, float const* p, int p_stride, E const* const* vrows, int n, int rows,
                      int nvec_rt) {
    int const nvec = vecs(nvec_rt);
    constexpr int R = V::kPvRows;
    int r = 0;
    for (; r + R <= rows; r += R)
      pv_rows_fixed<R, E>(o + r * o_stride, o_stride, p + r * p_stride, p_stride, vrows, n, nvec);
    // The remainder in one pass over V (a GQA group of 3 is all remainder when R = 4).
    int const rem = rows - r;
    if constexpr (R > 3) {
      if (rem == 3) return pv_rows_fixed<3, E>(o + r * o_stride, o_stride, p + r * p_stride, p_stride, vrows, n, nvec);
    }
    if constexpr (R > 2) {
      if (rem == 2) return pv_rows_fixed<2, E>(o + r * o_stride, o_stride, p + r * p_stride, p_stride, vrows, n, nvec);
    }
    for (; r < rows; ++r) pv_rows_fixed<1, E>(o + r * o_stride, o_stride, p + r * p_stride, p_stride, vrows, n, nvec);
  }

  // s[r, 0:kKeyTile] = q[r, :] . kt[:, 0:kKeyTile] for R rows (kt: the key tile transposed, [hd][kKeyTile]).
  template <int R>
  static void qk_block(float* s, float const* q, int q_stride, float const* kt, int hd_rt) {
    int const hd = head_dim(hd_rt);
    Reg acc[R][kTileVecs];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kTileVecs; ++v) acc[r][v] = V::zero();
    for (int d = 0; d < hd; ++d) {
      Reg k[kTileVecs];
      for (int v = 0; v < kTileVecs; ++v) k[v] = V::load(kt + d * kKeyTile + v * W);
      for (int r = 0; r < R; ++r) {
        Reg qb = V::set1(q[r * q_stride + d]);
        for (int v = 0; v < kTileVecs; ++v) acc[r][v] = V::fmadd(qb, k[v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kTileVecs; ++v) V::store(s + r * kKeyTile + v * W, acc[r][v]);
  }

  static void qk_rows(float* s, float const* q, int q_stride, float const* kt, int rows, int hd) {
    constexpr int R = V::kQkRows;
    int r = 0;
    for (; r + R <= rows; r += R) qk_block<R>(s + r * kKeyTile, q + r * q_stride, q_stride, kt, hd);
    for (; r < rows; ++r) qk_block<1>(s + r * kKeyTile, q + r * q_stride, q_stride, kt, hd);
  }

  // Online-softmax update of one row of scores (log2 domain, already scaled): s[0:kKeyTile] becomes
  // the probabilities exp2(s - m_new); returns the factor the row's accumulator must be scaled by.
  static float softmax_update(float* s, float& m, float& l) {
    Reg mx = V::load(s);
    for (int v = 1; v < kTileVecs; ++v) mx = V::max(mx, V::load(s + v * W));
    float const m_new = std::max(m, V::hmax(mx));
    // A row whose keys are all masked so far (m_new = -inf) keeps zero weights, never NaN.
    float const m_use = m_new == kNegInf ? 0.0f : m_new;
    float const alpha = std::exp2(m - m_use);  // once per row and tile
    Reg const mb = V::set1(m_use);
    Reg sum = V::zero();
    for (int v = 0; v < kTileVecs; ++v) {
      Reg p = V::exp2(V::sub(V::load(s + v * W), mb));
      V::store(s + v * W, p);
      sum = V::add(sum, p);
    }
    l = l * alpha + V::hsum(sum);
    m = m_new;
    return alpha;
  }

  static void scale_row(float* o, float alpha, int nvec_rt) {
    int const nvec = vecs(nvec_rt);
    if (alpha == 1.0f) return;
    Reg const a = V::set1(alpha);
    for (int c = 0; c < nvec; ++c) V::store(o + c * W, V::mul(V::load(o + c * W), a));
  }

  // W cache elements as fp32: widened, and for int8 codes times their row's scale (one rounding, as
  // the reference's codes.float() * scale).
  static Reg load_kv(C const* src, float scale) {
    if constexpr (kInt8) {
      return V::mul(V::load_cvt(src), V::set1(scale));
    } else {
      (void)scale;
      return V::load_cvt(src);
    }
  }

  // fp32 view of a cache row: the row itself for fp32, else converted into buf.
  static float const* row_f32(C const* src, float scale, float* buf, int nvec_rt) {
    int const nvec = vecs(nvec_rt);
    if constexpr (kInPlace) {
      (void)buf;
      (void)nvec;
      (void)scale;
      return src;
    } else {
      for (int c = 0; c < nvec; ++c) V::store(buf + c * W, load_kv(src + c * W, scale));
      return buf;
    }
  }

  // dst[0:count] = src[0:count] widened to fp32, int8 codes without their scale (count: a multiple of W).
  static void widen_row(float* dst, C const* src, int count) {
    for (int c = 0; c < count; c += W) V::store(dst + c, V::load_cvt(src + c));
  }

  // dst[0:W * nv] *= f[0:W * nv] (nv vectors): an int8 tile's per-key scales applied to a row of scores
  // or probabilities.
  static void mul_rows(float* dst, float const* f, int nv) {
    for (int v = 0; v < nv; ++v) V::store(dst + v * W, V::mul(V::load(dst + v * W), V::load(f + v * W)));
  }

  // The scale of cache row `row` (slot * num_kv_heads + head) of one half (K or V); 1 without scales.
  static float row_scale(float const* scales, int64_t row) {
    if constexpr (kInt8) {
      return scales[row];
    } else {
      (void)scales;
      (void)row;
      return 1.0f;
    }
  }

  static void load_query_rows(float* dst, T const* src, float scale, int nvec_rt) {
    int const nvec = vecs(nvec_rt);
    Reg const sb = V::set1(scale);
    for (int c = 0; c < nvec; ++c) V::store(dst + c * W, V::mul(V::load_cvt(src + c * W), sb));
  }

  // An int8 cache's scores come from integer dot products: the (scaled) query row as int16 codes with
  // one scale, times the int8 key codes, exact int32 sums, then sq * sum * the key's scale. 15 bits
  // for q cost nothing next to the keys' 7 (the reference, ops/reference/attention.py, quantises q the
  // same way), and the sums are exact, so every ISA path and every batch gives the same bits. Head dims
  // that are not a multiple of 32 keep the fp32 products.
  static constexpr bool int_scores(int hd) { return kInt8 && hd % 32 == 0; }

  // codes = round-half-even(x * (32767 / max|x|)), returns max|x| / 32767 (0 for an all-zero row).
  static float quantize_query_row(std::int16_t* codes, float const* x, int hd) {
    float amax = 0.0f;
    for (int i = 0; i < hd; ++i) amax = std::max(amax, std::fabs(x[i]));
    if (!(amax > 0.0f) || !std::isfinite(amax)) {
      std::fill(codes, codes + hd, std::int16_t(0));
      return amax > 0.0f ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    }
    float const inv = 32767.0f / amax;
    for (int i = 0; i < hd; ++i) {
      float const r = std::nearbyint(std::clamp(x[i] * inv, -32767.0f, 32767.0f));
      codes[i] = static_cast<std::int16_t>(r == r ? r : 0.0f);
    }
    return amax / 32767.0f;
  }

  // Row r < rows of s (kKeyTile apart): s[i] = sq[r] * (qi[r * hd] . kcodes[i]) for i < n, the rest -inf.
  static void code_scores(float* s, std::int16_t const* qi, float const* sq, int rows, C const* const* kcodes, int n,
                          int hd) {
    if constexpr (kInt8) {
      V::template qk_codes<kHeadDim>(s, kKeyTile, qi, hd, sq, rows, kcodes, n, hd);
    } else {
      (void)qi, (void)sq, (void)kcodes, (void)hd;
    }
    for (int r = 0; r < rows; ++r)
      for (int i = n; i < kKeyTile; ++i) s[r * kKeyTile + i] = kNegInf;
  }

  // o[r] += P[r] . V for rows r < rows of p (kKeyTile apart, the probabilities times their keys' V
  // scales) over the bare V codes, as integers: per row and tile the probabilities become int16 codes
  // with one scale (round(p * 32767 / max p)), the sums of codes times V codes are exact int32, and the
  // row gains sum * scale (VPDPWSSD / VPMADDWD over key pairs, or a scalar loop: the same sums). Half
  // the work of widening V to fp32 for a GQA group; the reference twins round P the same way.
  // Rows go four at a time: their probability codes, then one pass over V for all four.
  template <class E>
  static void code_pv(float* o, float const* p, int rows, E const* const* vcodes, int n, int hd) {
    if constexpr (kInt8) {
      constexpr int R = 4;
      alignas(64) std::int16_t pc[R][kKeyTile];
      float ps[R];
      for (int r0 = 0; r0 < rows; r0 += R) {
        int const m = std::min(R, rows - r0);
        for (int r = 0; r < m; ++r) ps[r] = V::prob_codes(pc[r], p + (r0 + r) * kKeyTile);
        float* dst = o + r0 * hd;
        if (m == 4) {
          V::template pv_codes_block<4>(dst, hd, pc, ps, vcodes, n, hd);
        } else if (m == 3) {
          V::template pv_codes_block<3>(dst, hd, pc, ps, vcodes, n, hd);
        } else if (m == 2) {
          V::template pv_codes_block<2>(dst, hd, pc, ps, vcodes, n, hd);
        } else {
          V::template pv_codes_block<1>(dst, hd, pc, ps, vcodes, n, hd);
        }
      }
    } else {
      (void)o, (void)p, (void)rows, (void)vcodes, (void)n, (void)hd;
    }
  }

  static void store_output_row(T* dst, float const* acc, float inv_l, int nvec_rt) {
    int const nvec = vecs(nvec_rt);
    Reg const f = V::set1(inv_l);
    for (int c = 0; c < nvec; ++c) V::store_cvt(dst + c * W, V::mul(V::load(acc + c * W), f));
  }

  // ---- paged attention (decode) ------------------------------------------------------------------

  // s[0:kKeyTile] = q . krows[i] for i < n (the rest -inf), W keys at a time: per key a vector of
  // partial sums, then W of them reduced to one vector at once (reduce_lanes).
  static void decode_scores(float* s, float const* q, float const* const* krows, int n, int nvec_rt) {
    int const nvec = vecs(nvec_rt);
    constexpr int kQVecs = kHeadDim ? kHeadDim / W : 1;  // q held in registers when unrolled
    Reg qv[kQVecs];
    if constexpr (kHeadDim != 0)
      for (int c = 0; c < kQVecs; ++c) qv[c] = V::load(q + c * W);
    auto q_vec = [&](int c) { return kHeadDim != 0 ? qv[c] : V::load(q + c * W); };
    // Two interleaved chains halve the FMA latency each key waits on.
    auto dot = [&](float const* kr) {
      Reg d0 = V::mul(q_vec(0), V::load(kr));
      Reg d1 = nvec > 1 ? V::mul(q_vec(1), V::load(kr + W)) : V::zero();
      for (int c = 2; c < nvec; c += 2) {
        d0 = V::fmadd(q_vec(c), V::load(kr + c * W), d0);
        if (c + 1 < nvec) d1 = V::fmadd(q_vec(c + 1), V::load(kr + (c + 1) * W), d1);
      }
      return V::add(d0, d1);
    };
    for (int w0 = 0; w0 < n; w0 += W) {
      Reg parts[W];
      if (w0 + W <= n) {  // a full group: unrolled, the partial sums stay in registers
        for (int i = 0; i < W; ++i) parts[i] = dot(krows[w0 + i]);
      } else {
        for (int i = 0; i < W; ++i) parts[i] = w0 + i < n ? dot(krows[w0 + i]) : V::zero();
      }
      V::store(s + w0, V::reduce_lanes(parts));
    }
    for (int i = n; i < kKeyTile; ++i) s[i] = kNegInf;
  }

  // Cache row (slot * num_kv_heads) of keys t0 .. t0+n-1 of a sequence: one division per tile,
  // not one per key.
  static void tile_rows(int64_t* rows, int32_t const* table, int t0, int n, int tpb, int kvh) {
    int blk = t0 / tpb, off = t0 % tpb;
    for (int i = 0; i < n; ++i) {
      rows[i] = (int64_t(table[blk]) * tpb + off) * kvh;
      if (++off == tpb) {
        off = 0;
        ++blk;
      }
    }
  }

  // Prefetch the K and V rows of a tile (this item's KV heads, adjacent in each token's row): the
  // blocks of a sequence are scattered, so the hardware prefetcher restarts at every block, and a
  // decode step streams the whole cache from DRAM (30 layers' caches do not fit in L3).
  // fp32 cache, 16 sequences x 185 keys, 30 layers' caches, one Zen 4 thread: 55 ns per key and KV head
  // with it, 69 without (17 with the cache in L3, where prefetching costs 8 %; a plain read of the same
  // rows in the same order takes 25-30). 1 to 5 tiles ahead, T0 instead of T1, the prefetches issued in
  // three parts, V pulled into L1 before the scores, or the next sequence's first tiles prefetched at
  // the end of an item: none moved it beyond this VM's noise (5-10 %).
  static void prefetch_tile(C const* k_cache, C const* v_cache, float const* k_scales, float const* v_scales,
                            int64_t const* rows, int n, int64_t g0, int ng, int hd) {
    int64_t const bytes = int64_t(ng) * hd * int64_t(sizeof(C));
    for (int i = 0; i < n; ++i) {
      char const* k = reinterpret_cast<char const*>(k_cache + (rows[i] + g0) * hd);
      char const* v = reinterpret_cast<char const*>(v_cache + (rows[i] + g0) * hd);
      for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(k + off, 0, 2);  // into L2: a tile two ahead would evict L1's working set
        __builtin_prefetch(v + off, 0, 2);
      }
      if constexpr (kInt8) {  // a token's scales for these heads: a few bytes, mostly one line
        __builtin_prefetch(k_scales + rows[i] + g0, 0, 2);
        __builtin_prefetch(v_scales + rows[i] + g0, 0, 2);
      }
    }
  }

  // One (sequence, run of KV heads, partition): the run's query heads against keys [j0, j1), partitions
  // counted from the window's first key (keys before it are never read).
  // A work item takes several KV heads because a token's rows for all KV heads are adjacent in the
  // cache: one item per KV head would read every block once per head, at a stride (measured here:
  // ~10 GB/s from DRAM for that pattern against ~18 GB/s for the block in order, one thread).
  // Writes the normalised output when the sequence is not split, else (m, l, acc) to the workspace.
  static void decode_item(PagedAttentionParams const& p, PagedAttentionPlan const& plan, int b, int g0, int ng,
                          int part) {
    int const kv_len = p.kv_lens[b];
    int const key0 = decode_key_begin(p.window, kv_len);
    // Batch invariance: one partition (never split), its tiles at multiples of kKeyTile as in context
    // attention; the keys of the first tile before key0 are masked.
    bool const aligned = plan.max_partitions == 1 && batch_invariant();
    int const j0 = aligned ? key_tile_begin(key0, kKeyTile, true) : key0 + part * plan.partition_size;
    if (j0 >= kv_len) return;
    int const j1 = aligned ? kv_len : std::min(kv_len, j0 + plan.partition_size);
    int const hd = head_dim(p.head_dim), nvec = hd / W;
    int const group = p.num_heads / p.num_kv_heads;
    int const heads = ng * group, h0 = g0 * group;  // this item's query heads: h0 .. h0 + heads - 1
    int const tpb = p.tokens_per_block, kvh = p.num_kv_heads;
    T const* q = static_cast<T const*>(p.q);
    C const* k_cache = static_cast<C const*>(p.kv_cache);
    C const* v_cache = k_cache + int64_t(p.num_blocks) * tpb * kvh * hd;
    float const* k_scales = p.kv_scales;
    float const* v_scales = kInt8 ? k_scales + int64_t(p.num_blocks) * tpb * kvh : nullptr;
    int32_t const* table = p.block_tables + int64_t(b) * p.block_table_stride;

    alignas(64) float qf[kMaxGroupSize * kBufHd];
    alignas(64) float acc[kMaxGroupSize * kBufHd];
    alignas(64) float s[kMaxGroupSize * kKeyTile];
    // bf16 / fp16: the tile's K and V rows of this item's KV heads widened to fp32, in cache order
    // ([key][kv head][head_dim]); int8: the K codes widened (P.V widens the V codes in place, once for
    // the group's rows). fp32 rows are read in place: a copy costs more than it saves.
    constexpr int kPackFloats = kInPlace ? 1 : kKeyTile * kMaxDecodeRowFloats;
    alignas(64) float kpack[kPackFloats];
    alignas(64) float vpack[kInPlace || kNarrow ? 1 : kPackFloats];
    int const row_floats = ng * hd;
    // int8: the tile's codes are widened as they are (like a 16-bit cache), and the scales applied
    // per key instead of per element: q . (c_j s_j) = s_j (q . c_j) to the scores, and p_j s_j to the
    // probabilities before P.V (l sums the unscaled p_j). [kv head][key]; 1 past the tile's keys.
    alignas(64) float kscale[kInt8 ? kMaxGroupSize * kKeyTile : 1];
    alignas(64) float vscale[kInt8 ? kMaxGroupSize * kKeyTile : 1];
    // Prefetch distance in tiles (an int8 tile looking twice as far ahead measured no faster on Zen 4).
    constexpr int kAhead = kPrefetchTiles;
    int64_t rows[kKeyTile], pf_rows[kKeyTile];
    float const* krows[kKeyTile];
    // V rows as P.V reads them: fp32 (in place or packed), or an int8 / fp8 cache's bytes in place.
    using VRow = std::conditional_t<kNarrow, C, float>;
    VRow const* vrows[kKeyTile];
    float m[kMaxGroupSize], l[kMaxGroupSize];

    bool const codes = int_scores(hd);
    alignas(64) std::int16_t qcodes[kInt8 ? kMaxGroupSize * kBufHd : 1];
    float qscale[kInt8 ? kMaxGroupSize : 1];
    C const* kcodes[kKeyTile];
    for (int h = 0; h < heads; ++h) {
      load_query_rows(qf + h * hd, q + b * p.q_token_stride + int64_t(h0 + h) * p.q_head_stride,
                      p.scale * kLog2e * k_factor(p), nvec);
      if constexpr (kInt8) {
        if (codes) qscale[h] = quantize_query_row(qcodes + h * hd, qf + h * hd, hd);
      }
      std::fill(acc + h * hd, acc + (h + 1) * hd, 0.0f);
      m[h] = kNegInf;
      l[h] = 0.0f;
    }

    for (int d = 1; d < kAhead; ++d) {
      int const t = j0 + d * kKeyTile;
      if (t >= j1) break;
      tile_rows(pf_rows, table, t, std::min(kKeyTile, j1 - t), tpb, kvh);
      prefetch_tile(k_cache, v_cache, k_scales, v_scales, pf_rows, std::min(kKeyTile, j1 - t), g0, ng, hd);
    }
    for (int t0 = j0; t0 < j1; t0 += kKeyTile) {
      int const n = std::min(kKeyTile, j1 - t0);
      tile_rows(rows, table, t0, n, tpb, kvh);
      if (int const t = t0 + kAhead * kKeyTile; t < j1) {
        tile_rows(pf_rows, table, t, std::min(kKeyTile, j1 - t), tpb, kvh);
        prefetch_tile(k_cache, v_cache, k_scales, v_scales, pf_rows, std::min(kKeyTile, j1 - t), g0, ng, hd);
      }
      // Convert the tile in cache order (each token's rows for these KV heads are adjacent), so the
      // hardware prefetcher sees one stream per block.
      if constexpr (!kInPlace) {
        for (int i = 0; i < n && !codes; ++i) {
          widen_row(kpack + i * row_floats, k_cache + (rows[i] + g0) * hd, row_floats);
          if constexpr (!kNarrow) widen_row(vpack + i * row_floats, v_cache + (rows[i] + g0) * hd, row_floats);
        }
        // A narrow cache's V (and with integer products its K) is read in place, one KV head at a time
        // (strided), so pull the tile (in L2 by now) into L1 in cache order first: int8 1.49x -> 1.6x
        // bf16's speed on Zen 4.
        if constexpr (kNarrow) {
          for (int i = 0; i < n; ++i) {
            char const* k = reinterpret_cast<char const*>(k_cache + (rows[i] + g0) * hd);
            char const* v = reinterpret_cast<char const*>(v_cache + (rows[i] + g0) * hd);
            for (int off = 0; off < row_floats; off += 64) {
              if (codes) __builtin_prefetch(k + off, 0, 3);
              __builtin_prefetch(v + off, 0, 3);
            }
          }
        }
      }
      if constexpr (kInt8) {
        for (int gi = 0; gi < ng; ++gi) {
          for (int i = 0; i < kKeyTile; ++i) {
            kscale[gi * kKeyTile + i] = i < n ? k_scales[rows[i] + g0 + gi] : 1.0f;
            vscale[gi * kKeyTile + i] = i < n ? v_scales[rows[i] + g0 + gi] : 1.0f;
          }
        }
      }
      for (int gi = 0; gi < ng; ++gi) {
        for (int i = 0; i < n; ++i) {
          if constexpr (kInPlace) {
            krows[i] = k_cache + (rows[i] + g0 + gi) * hd;
            vrows[i] = v_cache + (rows[i] + g0 + gi) * hd;
          } else if constexpr (kNarrow) {
            krows[i] = kpack + i * row_floats + gi * hd;
            kcodes[i] = k_cache + (rows[i] + g0 + gi) * hd;
            vrows[i] = v_cache + (rows[i] + g0 + gi) * hd;
          } else {
            krows[i] = kpack + i * row_floats + gi * hd;
            vrows[i] = vpack + i * row_floats + gi * hd;
          }
        }
        if (codes)
          code_scores(s + gi * group * kKeyTile, qcodes + gi * group * hd, qscale + gi * group, group, kcodes, n, hd);
        for (int h = gi * group; h < (gi + 1) * group; ++h) {
          if (!codes) decode_scores(s + h * kKeyTile, qf + h * hd, krows, n, nvec);
          if constexpr (kInt8) mul_rows(s + h * kKeyTile, kscale + gi * kKeyTile, kTileVecs);
          if (t0 < key0) std::fill_n(s + h * kKeyTile, key0 - t0, kNegInf);  // before the window
          scale_row(acc + h * hd, softmax_update(s + h * kKeyTile, m[h], l[h]), nvec);
          if constexpr (kInt8) mul_rows(s + h * kKeyTile, vscale + gi * kKeyTile, kTileVecs);
        }
        if (codes) {
          code_pv(acc + gi * group * hd, s + gi * group * kKeyTile, group, vrows, n, hd);
        } else {
          pv_rows(acc + gi * group * hd, hd, s + gi * group * kKeyTile, kKeyTile, vrows, n, group, nvec);
        }
      }
    }

    if (plan.max_partitions == 1 || kv_len - key0 <= plan.partition_size) {
      T* out = static_cast<T*>(p.out) + (int64_t(b) * p.num_heads + h0) * hd;
      for (int h = 0; h < heads; ++h) store_output_row(out + h * hd, acc + h * hd, v_factor(p) / l[h], nvec);
    } else {
      for (int h = 0; h < heads; ++h) {
        float* ws = static_cast<float*>(p.workspace) +
                    ((int64_t(b) * p.num_heads + h0 + h) * plan.max_partitions + part) * (hd + 2);
        ws[0] = m[h];
        ws[1] = l[h];
        std::memcpy(ws + 2, acc + h * hd, sizeof(float) * hd);
      }
    }
  }

  // Log-sum-exp merge of one (sequence, head)'s partitions.
  static void merge_partitions(PagedAttentionParams const& p, PagedAttentionPlan const& plan, int b, int h) {
    int const num_keys = p.kv_lens[b] - decode_key_begin(p.window, p.kv_lens[b]);
    if (num_keys <= plan.partition_size) return;
    int const hd = head_dim(p.head_dim), nvec = hd / W;
    int const num_parts = (num_keys + plan.partition_size - 1) / plan.partition_size;
    float const* ws =
        static_cast<float const*>(p.workspace) + (int64_t(b) * p.num_heads + h) * plan.max_partitions * (hd + 2);
    float m_max = kNegInf;
    for (int i = 0; i < num_parts; ++i) m_max = std::max(m_max, ws[i * (hd + 2)]);
    alignas(64) float acc[kBufHd];
    std::fill(acc, acc + hd, 0.0f);
    float l_sum = 0.0f;
    for (int i = 0; i < num_parts; ++i) {
      float const* part = ws + i * (hd + 2);
      float const w = std::exp2(part[0] - m_max);
      l_sum += part[1] * w;
      Reg const wb = V::set1(w);
      for (int c = 0; c < nvec; ++c)
        V::store(acc + c * W, V::fmadd(wb, V::load(part + 2 + c * W), V::load(acc + c * W)));
    }
    store_output_row(static_cast<T*>(p.out) + (int64_t(b) * p.num_heads + h) * hd, acc, v_factor(p) / l_sum, nvec);
  }

  static void paged_attention(PagedAttentionParams const& p, PagedAttentionPlan const& plan, ThreadPool& pool) {
    int const kv_per_item = plan.kv_heads_per_item;
    int const kv_chunks = (p.num_kv_heads + kv_per_item - 1) / kv_per_item;
    int64_t const num_items = int64_t(p.batch_size) * kv_chunks * plan.max_partitions;
    int64_t const num_rows = int64_t(p.batch_size) * p.num_heads;
    pool_detail::parallel_for(pool, num_items, plan.num_threads, true, [&](int64_t item, int) {
      int64_t const bc = item / plan.max_partitions;
      int const g0 = int(bc % kv_chunks) * kv_per_item;
      decode_item(p, plan, int(bc / kv_chunks), g0, std::min(kv_per_item, p.num_kv_heads - g0),
                  int(item % plan.max_partitions));
    });
    // parallel_for returns when every partition is written: merge them.
    if (plan.max_partitions > 1) {
      pool_detail::parallel_for(pool, num_rows, plan.num_threads, false, [&](int64_t bh, int) {
        merge_partitions(p, plan, int(bh / p.num_heads), int(bh % p.num_heads));
      });
    }
  }

  // ---- context attention (prefill, chunked prefill) -----------------------------------------------

  // One (sequence, kv head, query tile): query tokens [r0, r0 + nq) of the sequence, each with the
  // group's heads as rows (row = token * group + head), flash-style over key tiles from the first
  // row's window start (0 without a window) to the last row's position.
  static void context_item(ContextAttentionParams const& p, int b, int g, int r0, int nq) {
    int const hd = head_dim(p.head_dim), nvec = hd / W;
    int const group = p.num_heads / p.num_kv_heads;
    int const tpb = p.tokens_per_block, kvh = p.num_kv_heads;
    int const tok0 = p.cu_seqlens[b];
    int const q_len = p.cu_seqlens[b + 1] - tok0;
    int const kv_len = p.kv_lens[b];
    int const pos0 = kv_len - q_len + r0;  // position of the tile's first query token
    int const num_keys = pos0 + nq;        // keys 0 .. last query's position
    // Batch invariance: every row's scores by decode_scores (one dot product per key, as in decode),
    // over key tiles at multiples of kKeyTile, and int8 scales applied to the scores and probabilities
    // as decode does; a row's bits then depend on its own position only, not on the query tile, the
    // chunk or whether it is a decode. Otherwise the key tile is packed transposed for qk_rows.
    bool const invariant = batch_invariant();
    // Keys before the first row's window (the tile holding it, under batch invariance): skipped.
    int const key0 = key_tile_begin(window_key_begin(p.window, pos0), kKeyTile, invariant);
    int const rows = nq * group;
    T const* q = static_cast<T const*>(p.q);
    C const* k_cache = static_cast<C const*>(p.kv_cache);
    C const* v_cache = k_cache + int64_t(p.num_blocks) * tpb * kvh * hd;
    float const* k_scales = p.kv_scales;
    float const* v_scales = kInt8 ? k_scales + int64_t(p.num_blocks) * tpb * kvh : nullptr;
    int32_t const* table = p.block_tables + int64_t(b) * p.block_table_stride;

    alignas(64) float qf[kMaxContextRows * kBufHd];
    alignas(64) float o[kMaxContextRows * kBufHd];
    alignas(64) float s[kMaxContextRows * kKeyTile];
    alignas(64) float kt[kBufHd * kKeyTile];
    alignas(64) float vbuf[kInPlace ? 1 : kKeyTile * kBufHd];
    int64_t key_rows[kKeyTile];
    float const* vrows[kKeyTile];
    float const* krows[kKeyTile];  // batch invariance: fp32 key rows (in place, or widened into kt)
    C const* ksrc[kKeyTile];
    C const* vsrc[kKeyTile];  // batch invariance over an int8 cache: the V codes in place
    alignas(64) float kscale[kKeyTile];
    alignas(64) float vscale[kKeyTile];
    float m[kMaxContextRows], l[kMaxContextRows];

    for (int r = 0; r < nq; ++r)
      for (int h = 0; h < group; ++h)
        load_query_rows(qf + (r * group + h) * hd,
                        q + int64_t(tok0 + r0 + r) * p.q_token_stride + (int64_t(g) * group + h) * p.q_head_stride,
                        p.scale * kLog2e * k_factor(p), nvec);
    // Batch invariance over an int8 cache: integer scores and P.V as decode computes them.
    bool const codes = invariant && int_scores(hd);
    alignas(64) std::int16_t qcodes[kInt8 ? kMaxContextRows * kBufHd : 1];
    float qscale[kInt8 ? kMaxContextRows : 1];
    if constexpr (kInt8) {
      if (codes)
        for (int r = 0; r < rows; ++r) qscale[r] = quantize_query_row(qcodes + r * hd, qf + r * hd, hd);
    }
    std::fill(o, o + rows * hd, 0.0f);
    std::fill(m, m + rows, kNegInf);
    std::fill(l, l + rows, 0.0f);

    for (int kt0 = key0; kt0 < num_keys; kt0 += kKeyTile) {
      int const n = std::min(kKeyTile, num_keys - kt0);
      tile_rows(key_rows, table, kt0, n, tpb, kvh);
      if (invariant) {
        for (int i = 0; i < kKeyTile; ++i) {
          int64_t const row = i < n ? key_rows[i] + g : 0;
          kscale[i] = i < n ? row_scale(k_scales, row) : 1.0f;
          vscale[i] = i < n ? row_scale(v_scales, row) : 1.0f;
          if (i >= n) continue;
          if constexpr (kInPlace) {
            krows[i] = k_cache + row * hd;
          } else if (codes) {
            ksrc[i] = k_cache + row * hd;
          } else {
            widen_row(kt + i * hd, k_cache + row * hd, hd);  // int8: the codes, scaled below
            krows[i] = kt + i * hd;
          }
          if (codes) {
            vsrc[i] = v_cache + row * hd;
          } else {
            vrows[i] = row_f32(v_cache + row * hd, 1.0f, vbuf + i * hd, nvec);
          }
        }
        if (codes) code_scores(s, qcodes, qscale, rows, ksrc, n, hd);
        for (int r = 0; r < rows; ++r) {
          if (!codes) decode_scores(s + r * kKeyTile, qf + r * hd, krows, n, nvec);
          if constexpr (kInt8) mul_rows(s + r * kKeyTile, kscale, kTileVecs);
        }
      } else {
        for (int i = 0; i < n; ++i) {
          int64_t const row = key_rows[i] + g;
          ksrc[i] = k_cache + row * hd;
          kscale[i] = row_scale(k_scales, row);
          vrows[i] = row_f32(v_cache + row * hd, row_scale(v_scales, row), vbuf + i * hd, nvec);
        }
        // Pack the key tile transposed ([hd][kKeyTile], fp32; missing keys as zeros), W x W at a time.
        for (int w0 = 0; w0 < kKeyTile; w0 += W) {
          for (int c = 0; c < nvec; ++c) {
            Reg blk[W];
            for (int i = 0; i < W; ++i) blk[i] = w0 + i < n ? load_kv(ksrc[w0 + i] + c * W, kscale[w0 + i]) : V::zero();
            V::transpose(blk);
            for (int i = 0; i < W; ++i) V::store(kt + (c * W + i) * kKeyTile + w0, blk[i]);
          }
        }
        qk_rows(s, qf, hd, kt, rows, hd);
      }
      // Causal mask (and the tile's missing keys): row r sees keys j <= pos0 + r.
      if (kt0 + kKeyTile - 1 > pos0) {
        for (int r = 0; r < nq; ++r) {
          int const first_masked = std::clamp(pos0 + r - kt0 + 1, 0, n);
          if (first_masked == kKeyTile) continue;
          for (int h = 0; h < group; ++h) {
            float* sr = s + (r * group + h) * kKeyTile;
            for (int j = first_masked; j < kKeyTile; ++j) sr[j] = kNegInf;
          }
        }
      }
      // Window mask: row r sees keys j > pos0 + r - window (a row may see none of this tile yet).
      if (p.window > 0 && kt0 < pos0 + nq - p.window) {
        for (int r = 0; r < nq; ++r) {
          int const first_visible = std::clamp(pos0 + r - p.window + 1 - kt0, 0, kKeyTile);
          for (int h = 0; h < group; ++h) std::fill_n(s + (r * group + h) * kKeyTile, first_visible, kNegInf);
        }
      }
      for (int r = 0; r < rows; ++r) {
        scale_row(o + r * hd, softmax_update(s + r * kKeyTile, m[r], l[r]), nvec);
        if (kInt8 && invariant) mul_rows(s + r * kKeyTile, vscale, kTileVecs);  // V holds the bare codes
      }
      if (codes) {
        code_pv(o, s, rows, vsrc, n, hd);
      } else {
        pv_rows(o, hd, s, kKeyTile, vrows, n, rows, nvec);
      }
    }

    T* out = static_cast<T*>(p.out);
    for (int r = 0; r < nq; ++r)
      for (int h = 0; h < group; ++h)
        store_output_row(out + (int64_t(tok0 + r0 + r) * p.num_heads + int64_t(g) * group + h) * hd,
                         o + (r * group + h) * hd, v_factor(p) / l[r * group + h], nvec);
  }

  static void context_attention(ContextAttentionParams const& p, ThreadPool& pool) {
    int const group = p.num_heads / p.num_kv_heads;
    int const tile_q = std::max(1, kContextRows / group);
    int max_q_len = 0;
    int64_t macs = 0;
    for (int b = 0; b < p.batch_size; ++b) {
      int const q_len = p.cu_seqlens[b + 1] - p.cu_seqlens[b];
      max_q_len = std::max(max_q_len, q_len);
      int64_t keys = p.kv_lens[b] - q_len / 2;  // per query, on average
      if (p.window > 0) keys = std::min<int64_t>(keys, p.window);
      macs += int64_t(q_len) * keys * p.num_heads * p.head_dim * 2;
    }
    int const num_threads = int(std::clamp<int64_t>(macs / kMinMacsPerThread, 1, std::max(p.num_threads, 1)));
    int const max_tiles = (max_q_len + tile_q - 1) / tile_q;
    int64_t const per_tile = int64_t(p.batch_size) * p.num_kv_heads;
    int64_t const num_items = per_tile * max_tiles;
    pool_detail::parallel_for(pool, num_items, num_threads, true, [&](int64_t item, int) {
      // Last query tiles first: they see the most keys, so the long items start early.
      int const tile = max_tiles - 1 - int(item / per_tile);
      int const b = int(item % per_tile / p.num_kv_heads), g = int(item % p.num_kv_heads);
      int const q_len = p.cu_seqlens[b + 1] - p.cu_seqlens[b];
      int const r0 = tile * tile_q;
      if (r0 >= q_len) return;
      context_item(p, b, g, r0, std::min(tile_q, q_len - r0));
    });
  }
};

}  // namespace inflight::kernels::cpu::INFLIGHT_ATTENTION_ISA
