// The checks of LlamaLayerStack's ends (ops_llama.cpp; llama_layers.h: LlamaEmbed, LlamaHead and the
// positions, input_ids and logits rows of LlamaStep). Every value a kernel indexes with is checked here,
// so a bad id, position or row is a ValueError naming it and its limit, never a read out of bounds.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "llama_layers.h"
#include "tensor_checks.h"

namespace inflight::bindings {

// A RoPE table: [num_tokens, 2, head_dim] (one row per token) or, with positions, [max_positions, 2,
// head_dim] with every position inside it.
inline void check_rope_table(Tensor const& table, char const* name, Tensor const* positions, std::int64_t nt,
                             int head_dim, ScalarType dtype) {
  require_dtype_of(table, name, dtype, "the model dtype");
  if (positions == nullptr) {
    require_shape(table, name, {nt, 2, head_dim}, "[num_tokens, 2, head_dim]");
    return;
  }
  require_ndim(table, name, 3, "[max_positions, 2, head_dim] (with positions)");
  std::int64_t const rows = std::int64_t(table.shape(0));
  require_shape(table, name, {rows, 2, head_dim}, "[max_positions, 2, head_dim] (with positions)");
  auto const* pos = static_cast<std::int64_t const*>(positions->data());
  for (std::int64_t t = 0; t < nt; ++t) {
    if (pos[t] < 0 || pos[t] >= rows) {
      throw_value_error("positions[" + std::to_string(t) + "] = " + std::to_string(pos[t]) + " is outside " + name +
                        "'s " + std::to_string(rows) + " rows (max_positions)");
    }
  }
}

// input_ids [num_tokens] int64, each in 0 .. vocab-1.
inline void check_token_ids(Tensor const& ids, std::int64_t nt, std::int64_t vocab) {
  require_vector(ids, "input_ids", ScalarType::kInt64, nt, "[num_tokens]");
  require_cpu_contiguous({{&ids, "input_ids"}});
  auto const* v = static_cast<std::int64_t const*>(ids.data());
  for (std::int64_t t = 0; t < nt; ++t) {
    if (v[t] < 0 || v[t] >= vocab) {
      throw_value_error("input_ids[" + std::to_string(t) + "] = " + std::to_string(v[t]) +
                        " is outside the vocabulary (0 .. " + std::to_string(vocab - 1) + ")");
    }
  }
}

// logits_rows [R] int64 (R <= num_tokens: the stack's buffers hold one row per token), each a token of
// the step; logits [R, vocab] in the model dtype. Returns R.
inline std::int64_t check_logits_rows(Tensor const& rows, Tensor const& logits, std::int64_t nt, std::int64_t vocab,
                                      ScalarType dtype) {
  require_ndim(rows, "logits_rows", 1, "[num_logits_rows]");
  std::int64_t const n = std::int64_t(rows.shape(0));
  require_vector(rows, "logits_rows", ScalarType::kInt64, n, "[num_logits_rows]");
  if (n > nt) {
    throw_value_error("logits_rows must hold at most num_tokens (" + std::to_string(nt) + ") rows, got " +
                      std::to_string(n));
  }
  require_dtype_of(logits, "logits", dtype, "the model dtype");
  require_shape(logits, "logits", {n, vocab}, "[len(logits_rows), vocab]");
  require_cpu_contiguous({{&rows, "logits_rows"}, {&logits, "logits"}});
  auto const* r = static_cast<std::int64_t const*>(rows.data());
  for (std::int64_t i = 0; i < n; ++i) {
    if (r[i] < 0 || r[i] >= nt) {
      throw_value_error("logits_rows[" + std::to_string(i) + "] = " + std::to_string(r[i]) +
                        " is not a token of this step (0 .. " + std::to_string(nt - 1) + ")");
    }
  }
  return n;
}

// set_head's final norm: [hidden] in the model dtype.
inline void check_final_norm(Tensor const& final_norm, ScalarType dtype, int hidden) {
  require_dtype_of(final_norm, "final_norm", dtype, "the model dtype");
  require_shape(final_norm, "final_norm", {hidden}, "[hidden_size]");
  require_cpu_contiguous({{&final_norm, "final_norm"}});
}

// set_embedding's arguments: table [vocab, hidden] in the model dtype, or int8 with scales [vocab,
// hidden / group] float16; scale finite (0: none).
inline kernels::cpu::LlamaEmbed make_llama_embed(Tensor const& table, Tensor const* scales, int group, float scale,
                                                 int hidden, ScalarType dtype) {
  namespace kc = kernels::cpu;
  require_ndim(table, "table", 2, "[vocab, hidden_size]");
  std::int64_t const vocab = std::int64_t(table.shape(0));
  require_at_least(vocab, 1, "vocab");
  require_shape(table, "table", {vocab, hidden}, "[vocab, hidden_size]");
  kc::LlamaEmbed e;
  if (scales != nullptr) {
    require_dtype(table, "table", ScalarType::kInt8);
    require_at_least(group, 1, "group");
    if (hidden % group != 0) {
      throw_value_error("group (" + std::to_string(group) + ") must divide hidden_size (" + std::to_string(hidden) +
                        ")");
    }
    require_dtype(*scales, "scales", ScalarType::kFloat16);
    require_shape(*scales, "scales", {vocab, hidden / group}, "[vocab, hidden_size / group]");
    require_cpu_contiguous({{&table, "table"}, {scales, "scales"}});
    e.kind = kc::LlamaEmbed::Kind::kInt8;
    e.scales = scales->data();
    e.group = group;
  } else {
    require_dtype_of(table, "table", dtype, "the model dtype");
    require_cpu_contiguous({{&table, "table"}});
  }
  if (!std::isfinite(scale)) throw_value_error("scale must be finite, got " + std::to_string(scale));
  e.table = table.data();
  e.vocab = vocab;
  e.scale = scale;
  return e;
}

// set_embedding_packed's argument: a tied int8 embedding's head, packed for the A8 GEMM (bits 8, k =
// hidden), whose rows the stack then reads (LlamaEmbed::kA8Packed); scale as above.
inline kernels::cpu::LlamaEmbed make_packed_llama_embed(kernels::cpu::A8PackedWeight const& w, float scale,
                                                        int hidden) {
  if (w.bits != 8) throw_value_error("head must hold int8 weights (bits=8), got bits=" + std::to_string(w.bits));
  if (w.k != hidden) {
    throw_value_error("head must have k = hidden_size (" + std::to_string(hidden) + "), got " + std::to_string(w.k));
  }
  if (!std::isfinite(scale)) throw_value_error("scale must be finite, got " + std::to_string(scale));
  kernels::cpu::LlamaEmbed e;
  e.kind = kernels::cpu::LlamaEmbed::Kind::kA8Packed;
  e.packed = &w;
  e.vocab = w.n;
  e.scale = scale;
  return e;
}

}  // namespace inflight::bindings
