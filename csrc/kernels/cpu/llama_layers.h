// The decoder-layer stack of a Llama-family model in one call, on the CPU.
//
// The Python model runs a layer as ~15 torch ops; at SmolLM2's size (30 layers, hidden 576) each op
// costs more in dispatch than in arithmetic, so a decode step spends most of its time outside the
// kernels. This runs every layer of a step — RMSNorm, fused q/k/v GEMM, (QK-norm,) RoPE, store_kv,
// context and paged attention, o_proj + residual, RMSNorm, fused gate/up GEMM, SiLU·up, down_proj +
// residual — from C++ with no Python in between, over the same flattened batch, weights and paged KV
// cache the Python path uses (so the two can alternate step by step). Optionally it runs the model's
// ends as well (LlamaEmbed, LlamaHead): the token embedding before the layers, the final norm and the
// LM head after them, and RoPE rows read from the whole table by position (LlamaStep::positions). The cache is in the
// model dtype, int8 with per-token scales, or fp8 E4M3 with per-layer K and V scales (LlamaShape::kv_dtype; store_kv
// quantises, attention dequantises).
//
// Two variants of the layer, as the Python layer's two branches:
//   qk_norm (Qwen3, Gemma 3)  an RMSNorm over head_dim on every q head (q_norm) and every k head
//                             (k_norm), after the q/k/v GEMM and before RoPE.
//   gemma (Gemma 3)           every norm is Gemma's, (x / rms(x)) * (1 + w) in fp32, then rounded; the
//                             "sandwich": the o_proj output is normed (post_norm) before its residual
//                             add, the MLP has a norm on each side (pre_ffn_norm, post_ffn_norm); GeGLU
//                             with tanh-approximate GELU; per layer an attention window and a choice
//                             of RoPE table (the sliding layers' own base).
//
// Numerics follow the Python layer (inflight/models/llama.py) rounding point for rounding point:
// every intermediate the torch ops would materialise in the model dtype is rounded to it here too
// (for fp32 models rounding is the identity); arithmetic inside an op is fp32. The norms sum their
// squares in torch's order (bit for bit F.rms_norm); SiLU and GELU take exp / tanh from libm, which
// differs from torch's (SLEEF) by an ulp now and then.
//
// Like every kernel: a params struct (LlamaLayersParams) and a launcher, launch_llama_layers(params,
// pool), that allocates nothing (the workspace comes in) and runs the other ops' launchers on the same
// pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "a8_gemm.h"
#include "attention.h"
#include "dense_gemm.h"
#include "gemm.h"
#include "w8a8_gemm.h"

namespace inflight::kernels::cpu {

// One linear projection: which kernel, and its weight-side params (x, out, m, dtype and num_threads
// are filled per call).
struct LinearOp {
  enum class Kind : int { kW4A16 = 0, kW8A16 = 1, kDense = 2, kW8A8 = 3, kA8 = 4 };
  Kind kind = Kind::kW4A16;
  W4A16GemmParams w4;
  W8A16GemmParams w8;
  DenseGemmParams dense;  // weight in the model dtype
  W8A8GemmParams w8a8;    // its workspace is the step's shared scratch (LlamaShape::w8a8)
  A8GemmParams a8;        // likewise (LlamaShape::a8)
  std::int64_t n = 0, k = 0;
};

struct LlamaLayerWeights {
  void const* input_norm = nullptr;      // [hidden], model dtype
  void const* post_norm = nullptr;       // [hidden], model dtype: before the MLP; gemma: on the o_proj output
  void const* q_norm = nullptr;          // [head_dim], model dtype: with LlamaShape::qk_norm
  void const* k_norm = nullptr;          // [head_dim], model dtype: with LlamaShape::qk_norm
  void const* pre_ffn_norm = nullptr;    // [hidden], model dtype: with LlamaShape::gemma, before the MLP
  void const* post_ffn_norm = nullptr;   // [hidden], model dtype: with LlamaShape::gemma, on the MLP output
  int window = 0;                        // attention window (keys p-window+1 .. p); 0: global
  bool local_rope = false;               // rotate with LlamaStep::cos_sin_local instead of cos_sin
  LinearOp qkv;                          // hidden -> q_size + 2 * kv_size (q, k, v rows in that order)
  LinearOp o;                            // q_size -> hidden
  LinearOp gate_up;                      // hidden -> 2 * intermediate (gate rows, then up rows)
  LinearOp down;                         // intermediate -> hidden
  void* kv_cache = nullptr;              // [2, num_blocks, tokens_per_block, num_kv_heads, head_dim], kv_dtype
  float* kv_scales = nullptr;            // int8 cache: [2, num_blocks, tokens_per_block, num_kv_heads]
  float k_scale = 1.0f, v_scale = 1.0f;  // fp8 cache: the per-tensor scales of K and V
  // VSWA: the cache lives in the window pool (num_blocks blocks), read through LlamaStep's window_*
  // slot mapping and block tables; otherwise LlamaShape::num_blocks and the step's main ones.
  bool window_pool = false;
  int num_blocks = 0;  // of this layer's cache, when window_pool
};

struct LlamaShape {
  int hidden = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, intermediate = 0;
  float eps = 1e-6f;
  float scale = 1.0f;                          // attention softmax scale
  ScalarType dtype = ScalarType::kFloat32;     // the model dtype: float32, bfloat16 or float16
  ScalarType kv_dtype = ScalarType::kFloat32;  // every layer's cache: a float type, kInt8 or kFloat8E4M3
  int num_blocks = 0, tokens_per_block = 0;    // of every layer's cache (but a window pool's, num_blocks)
  bool w8a8 = false;                           // some projection is W8A8: the workspace holds its scratch
  bool a8 = false;                             // some projection is A8 (a8_gemm.h): likewise
  bool qk_norm = false;                        // q_norm / k_norm per head before RoPE (Qwen3, Gemma 3)
  bool gemma = false;                          // Gemma 3's layer (see the top of this file)
  // INT8 KV key rotation (inflight.layers.attention.key_rotation_matrices): after RoPE each q and k head
  // is rotated in blocks of key_rotation channels by the Sylvester Hadamard matrix (q scaled by 2^-a,
  // k by 2^-b: key_rotation_shifts); 0: none.
  int key_rotation = 0;
  // The dtype attention runs in: a float cache's (q, k and v converted to it when it is not the model
  // dtype, as the Python layers' native backend does; the output converted back), else the model's.
  ScalarType attention_dtype() const { return is_float_type(kv_dtype) ? kv_dtype : dtype; }
  int q_size() const { return num_heads * head_dim; }
  int kv_size() const { return num_kv_heads * head_dim; }
};

// One step's batch (the layout of inflight.layers.attention.AttentionMetadata): tokens
// 0 .. num_ctx_tokens-1 are context chunks of ctx_batch sequences, the rest are single-token decodes
// of dec_batch sequences.
struct LlamaStep {
  void* hidden = nullptr;  // [num_tokens, hidden], model dtype, in/out
  int num_tokens = 0;
  void const* cos_sin = nullptr;               // [num_tokens, 2, head_dim]: cos, then sign-folded sin
  void const* cos_sin_local = nullptr;         // like cos_sin, for the layers with local_rope (else unused)
  std::int64_t const* slot_mapping = nullptr;  // [num_tokens]; negative: not stored
  int num_ctx_tokens = 0;
  int ctx_batch = 0, ctx_max_blocks = 0;
  std::int32_t const* ctx_block_tables = nullptr;  // [ctx_batch, ctx_max_blocks]
  std::int32_t const* ctx_cu_seqlens = nullptr;    // [ctx_batch + 1]
  std::int32_t const* ctx_kv_lens = nullptr;       // [ctx_batch]
  int dec_batch = 0, dec_max_blocks = 0;
  std::int32_t const* dec_block_tables = nullptr;  // [dec_batch, dec_max_blocks]
  std::int32_t const* dec_kv_lens = nullptr;       // [dec_batch]
  // VSWA: the window pool's slot mapping and block tables (the shapes of the main ones), for the layers
  // with window_pool.
  std::int64_t const* window_slot_mapping = nullptr;
  std::int32_t const* window_ctx_block_tables = nullptr;
  std::int32_t const* window_dec_block_tables = nullptr;
  // null: cos_sin / cos_sin_local hold one row per token. Else [num_tokens] positions, and cos_sin /
  // cos_sin_local are whole tables ([max_positions, 2, head_dim]) that token t reads at row positions[t]
  // (the Python model's index_select, done in place).
  std::int64_t const* positions = nullptr;
  // With LlamaLayersParams::embed: [num_tokens] token ids, embedded into hidden before the layers.
  std::int64_t const* input_ids = nullptr;
  // With LlamaLayersParams::head: the tokens whose logits are wanted (indices into the step, in the
  // order of the logits rows) and the output, [num_logits_rows, head.n] in the model dtype.
  std::int64_t const* logits_rows = nullptr;
  int num_logits_rows = 0;
  void* logits = nullptr;
};

// The model's start (the first pipeline stage's), before the layers: step.hidden's rows are the
// embeddings of step.input_ids, as the Python model computes them. kDense: a row of the table in the
// model dtype (F.embedding); kInt8: int8 codes times their group's fp16 scale in fp32, rounded to the model
// dtype (W8A16Embedding.embed); kA8Packed: the same values read from the head's A8 packed copy. With scale != 0 (Gemma:
// sqrt(hidden) rounded to the model dtype) each value is then multiplied by it and rounded again.
struct LlamaEmbed {
  enum class Kind : int { kDense = 0, kInt8 = 1, kA8Packed = 2 };
  Kind kind = Kind::kDense;
  A8PackedWeight const* packed = nullptr;  // kA8Packed: the tied head's packed int8 rows (a8_int8_row)
  void const* table = nullptr;             // [vocab, hidden]: model dtype (kDense) or int8 (kInt8)
  void const* scales = nullptr;            // kInt8: [vocab, hidden / group] float16
  int group = 0;                           // kInt8
  std::int64_t vocab = 0;
  float scale = 0.0f;  // 0: none
};

// The model's end (the last pipeline stage's), after the layers: the final RMSNorm of the rows whose
// logits are wanted (gathered from the step's hidden states, the Python model's index_select + norm,
// Gemma's (1 + w) norm with LlamaShape::gemma) and the LM head GEMM. W8A8 heads are not supported (their
// scratch would be num_tokens x vocab int32).
struct LlamaHead {
  void const* final_norm = nullptr;  // [hidden], model dtype
  LinearOp op;                       // hidden -> op.n (the padded vocabulary)
};

// The op's params: layers[0 .. num_layers) run over the step, in place on step.hidden.
struct LlamaLayersParams {
  LlamaShape shape;
  LlamaLayerWeights const* layers = nullptr;  // [num_layers]
  int num_layers = 0;
  LlamaStep step;
  LlamaEmbed const* embed = nullptr;  // null: hidden comes in (step.input_ids is not read)
  LlamaHead const* head = nullptr;    // null: no head (step.logits_rows / logits are not read)
  // llama_layers_workspace_size(params) bytes, 64-byte aligned: the activations of one layer and the
  // paged-attention partials (their split depends on num_threads).
  void* workspace = nullptr;
  std::int64_t workspace_bytes = 0;
  int num_threads = 1;  // at most this many of the pool's threads, for every op of the step
  // Tensor parallelism (each rank holds a slice of every projection): after the o_proj and the down_proj
  // GEMM of every layer, the partial product [num_tokens, hidden] is written to reduce_buf (model dtype)
  // and reduce(reduce_ctx) is called, which must replace it in place by its sum over the ranks; then the
  // residual add. reduce == nullptr: one rank, no reduction (reduce_buf is not read).
  void* reduce_buf = nullptr;
  void (*reduce)(void* ctx) = nullptr;
  void* reduce_ctx = nullptr;
};

// The workspace launch_llama_layers needs for these params (their workspace fields are not read).
std::int64_t llama_layers_workspace_size(LlamaLayersParams const& params);

// Runs the step on the pool's threads. Callers validate (the binding does); throws
// std::invalid_argument only for a workspace smaller than llama_layers_workspace_size(params).
void launch_llama_layers(LlamaLayersParams const& params, ThreadPool& pool);

// A mixture-of-experts layer's experts (one call per layer, inflight.models.moe.quantized_experts):
// x's rows are grouped by expert (counts[e] rows for expert e, in expert order); for each expert with
// rows, out = down_e(act(gate_e(x)) * up_e(x)) on those rows (gate_up_e maps hidden -> 2 * intermediate,
// gate columns then up; act SiLU, or tanh GELU with gelu; each product rounded to dtype as torch does).
// W4A16 / W8A16 / dense projections (no W8A8: its scratch is the layer stack's).
struct MoeExpertsParams {
  LinearOp const* gate_up = nullptr;  // [num_experts]
  LinearOp const* down = nullptr;     // [num_experts]
  int num_experts = 0;
  std::int64_t const* counts = nullptr;  // [num_experts], summing to rows
  std::int64_t rows = 0;
  int hidden = 0, intermediate = 0;
  ScalarType dtype = ScalarType::kFloat32;  // x, out and the projections' activations
  bool gelu = false;
  void const* x = nullptr;    // [rows, hidden]
  void* out = nullptr;        // [rows, hidden]
  void* workspace = nullptr;  // moe_experts_workspace_size(params) bytes
  std::int64_t workspace_bytes = 0;
  int num_threads = 1;
};

// Bytes of scratch launch_moe_experts needs: one expert's gate_up output and its activation.
std::int64_t moe_experts_workspace_size(MoeExpertsParams const& params);

// Callers validate (the binding does); throws std::invalid_argument for a small workspace.
void launch_moe_experts(MoeExpertsParams const& params, ThreadPool& pool);

}  // namespace inflight::kernels::cpu
