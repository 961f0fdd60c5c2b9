// Grouped-weight x int8-activation GEMM on the CPU ("A8"): out[M, N] = x[M, K] @ W[N, K]^T (+ bias) for
// the weight-only formats of gemm.h (int4 with or without offsets, int8; groups of 16 to 128) with the
// activations quantised to int8 on the fly, one scale per group of E elements of a row (llama.cpp's Q8
// activations). Products are summed exactly in int32 per group (AVX512-VNNI VPDPBUSD, or a portable
// loop), then scaled in fp32.
//
// E, the epilogue group, is 32, or 16 for weights in groups of 16 (GGUF Q6_K's sub-blocks); weights in
// groups of 64 or 128 repeat their scale over each 32. Per row m of x and group g (elements g*E ..):
//   amax      = max |x|                          (over the group, in fp32)
//   q[i]      = round_half_even(x[i] * (127 / amax)) in [-127, 127]   (0 for an all-zero group, and
//               d = 0, for one so small that 127 / amax overflows)
//   d         = amax / 127,   sq = sum q[i] (int32),   ds = d * float(sq)
// and per output channel n, with the weight's unsigned codes u (int4: 0..15; int8: q + 128), its zero
// point z (asymmetric int4: 0; symmetric int4: 8; int8: 128), scale s and, asymmetric, offset o:
//   acc       = sum_i u[i] * q[i] - z * sq                           (exact in int32)
//   f         = fma(float(acc), s * d, f)                             (then, asymmetric:)
//   f         = fma(o, ds, f)
// over the groups in order from f = 0; out = f (+ bias[n]) rounded once to x's dtype. Every ISA does
// exactly these operations in this order: the portable and the VNNI paths give the same bits, and a
// row's result depends on that row alone (per-row, per-group scales; one fixed order): the kernel is
// batch-invariant at every M, decode included.
//
// A16 (act_bits = 16) is the same GEMM with ~15-bit activations: per group, d = amax / 32512 and
// q = round_half_even(x * (32512 / amax)) in [-32512, 32512], held as two int8 limbs q = 256 h + l with
// h = (q + 128) >> 8 in [-127, 127] and l = q - 256 h in [-128, 127]. Each limb takes the int8 path's
// VPDPBUSD; the group's sum is acc = 256 * sum_i u[i] * h[i] + sum_i u[i] * l[i] - z * sq (exact in int32:
// |acc| < 2^28), then the same epilogue. Every row's result again depends on that row alone, at every M.
//
// Weights are packed once (A8PackedWeight) in panels of 64 output channels (four blocks of 16), one
// record per panel and group, the panel's records back to back, so that a panel is one sequential
// stream (decode reads each weight byte once, from memory): first the codes, int4 as E/8 vectors per
// block of 64 bytes, lane c (4 bytes) holding channel c's codes of k-quads 2v (low nibbles) and 2v+1
// (high nibbles), int8 as E/4 vectors per block, one k-quad each, so one 64-byte load feeds VPDPBUSD
// for 16 channels by 4 k (int8) or, after a nibble split, by 8 k (int4); then the 64 channels' scales
// and (asymmetric int4) offsets, fp16 when every value is exactly an fp16 (GGUF's Q4_0 / Q4_1 / Q8_0 /
// Q5_0), else fp32. The caller passes a workspace (a8_workspace_bytes); nothing is allocated inside.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpu_features.h"
#include "inflight/kernels/scalar_type.h"
#include "thread_pool.h"

namespace inflight::kernels::cpu {

inline constexpr int kA8Panel = 64;         // output channels per packed panel (four VPDPBUSD blocks of 16)
inline constexpr float kA16Max = 32512.0f;  // A16's largest code, 127 * 256: the high limb stays in int8

struct A8PackedWeight {
  int bits = 4;        // 4 or 8
  bool asym = false;   // int4 with offsets (w = s * u + o); else w = s * (u - zero_point)
  int zero_point = 8;  // 0 (asymmetric int4), 8 (symmetric int4), 128 (int8)
  int group = 32;      // E: 16 or 32
  bool f16_scales = true;
  std::int64_t n = 0, k = 0;
  // [panels][k / E] records: codes [vectors per block][4 blocks][64], scales [64], offsets [64] (asym)
  std::vector<std::uint8_t> data;
  std::vector<float> bias;  // [panels * 64] (zero-padded) or empty
  std::int64_t groups() const { return k / group; }
  std::int64_t panels() const { return (n + kA8Panel - 1) / kA8Panel; }
  int vectors_per_block() const { return bits == 4 ? group / 8 : group / 4; }
  std::int64_t code_bytes() const { return std::int64_t(vectors_per_block()) * 4 * 64; }
  int scale_bytes() const { return f16_scales ? 2 : 4; }
  // One (panel, group) record: the codes, then the scales, then the offsets.
  std::int64_t record_bytes() const { return code_bytes() + (asym ? 2 : 1) * kA8Panel * scale_bytes(); }
  std::int64_t panel_bytes() const { return groups() * record_bytes(); }
};

// Packs the weight-only formats of gemm.h: bits 4 (qweight [n, k / 2] uint8, the low nibble the even k;
// offsets [n, k / group_size] or nullptr for symmetric) or 8 (qweight [n, k] int8, offsets nullptr);
// scales [n, k / group_size] in fp32 (convert 16-bit scales first: exact); bias [n] fp32 or nullptr.
// group_size: 32, 64 or 128, or 16 for int8; k a multiple of it. Throws std::invalid_argument on
// anything else.
A8PackedWeight pack_a8_weight(int bits, void const* qweight, float const* scales, float const* offsets,
                              float const* bias, std::int64_t n, std::int64_t k, int group_size);

// The inverse of pack_a8_weight: writes the original qweight (bits 4: [n, k / 2] uint8; 8: [n, k] int8), scales
// and (asymmetric int4) offsets ([n, k / group_size] fp32: the packed values, exact) of a packed weight.
// group_size is the one it was packed with (groups of 64 and 128 are stored as repeated groups of 32).
// Lets a layer drop its original tensors once packed and rebuild them on demand.
void unpack_a8_weight(A8PackedWeight const& w, int group_size, void* qweight, float* scales, float* offsets);

// Row `row` of a packed int8 weight (bits 8) dequantised: out[i] = float(code) * scale in fp32, as
// W8A16Embedding.embed computes a token's embedding from the tensors (the tied head's packed copy then
// serves the lookup too).
void a8_int8_row(A8PackedWeight const& w, std::int64_t row, float* out);

struct A8GemmParams {
  void const* x = nullptr;                 // [m, k], dtype, row-major contiguous
  A8PackedWeight const* weight = nullptr;  // packed once
  void* out = nullptr;                     // [m, n], dtype, row-major contiguous; fully overwritten
  void* workspace = nullptr;               // a8_workspace_bytes(m, weight) bytes, 64-byte aligned
  std::int64_t m = 0;
  ScalarType dtype = ScalarType::kFloat32;  // of x and out: float32, bfloat16 or float16
  int num_threads = 1;                      // at most this many of the pool's threads
  int act_bits = 8;                         // 8 (A8) or 16 (A16: two int8 limbs per element)
};

// The workspace of m rows: k codes per row and limb, then d, sq and ds (k / group each per row).
std::size_t a8_workspace_bytes(std::int64_t m, A8PackedWeight const& w, int act_bits = 8);

// Validates (std::invalid_argument naming the field), quantises x into the workspace (threads split the
// rows) and runs the products (threads split the panels, or the rows when there are few panels).
void launch_a8_gemm(A8GemmParams const& p, ThreadPool& pool);

// Whether launch_a8_gemm runs the VNNI tiles with the CPU kernels selected now (else the portable loop).
bool a8_vectorised();

// The activations of rows [0, m) in the layout above: q [m][limbs][k] int8 (limbs = act_bits / 8: A16's
// high limb, then its low limb), d, ds [m][k / group] fp32 and sq [m][k / group] int32 (exposed for
// tests and for the reference). Portable; the VNNI file has a vectorised copy that computes the same
// bits.
void quantize_a8_activations(void const* x, ScalarType dtype, std::int64_t m, std::int64_t k, int group, std::int8_t* q,
                             float* d, std::int32_t* sq, float* ds, int act_bits = 8);

namespace a8_detail {
// Where the quantised activations are: rows of k int8 codes and k / group scales and sums.
struct Activations {
  std::int8_t const* q = nullptr;  // row r, limb j at q + (r * limbs + j) * k
  float const* d = nullptr;
  std::int32_t const* sq = nullptr;
  float const* ds = nullptr;
  std::int64_t k = 0, groups = 0;
  int limbs = 1;  // 1 (A8) or 2 (A16)
};

// out rows [m_lo, m_hi) x panels [p_lo, p_hi) of one ISA (the epilogue and the store included).
void gemm_portable(A8PackedWeight const& w, Activations const& a, std::int64_t m_lo, std::int64_t m_hi,
                   std::int64_t p_lo, std::int64_t p_hi, void* out, ScalarType dtype);
void gemm_avx512vnni(A8PackedWeight const& w, Activations const& a, std::int64_t m_lo, std::int64_t m_hi,
                     std::int64_t p_lo, std::int64_t p_hi, void* out, ScalarType dtype);
void quantize_avx512(void const* x, ScalarType dtype, std::int64_t m, std::int64_t k, int group, std::int8_t* q,
                     float* d, std::int32_t* sq, float* ds, int limbs);
}  // namespace a8_detail

}  // namespace inflight::kernels::cpu
