"""ModelConfig: the subset of a Hugging Face ``config.json`` that the llama-family model uses.

Validated once, at load time. Anything in the checkpoint's config that our model would not compute
the way ``transformers`` does (another activation, rope type, a sliding window that the run would
actually hit, quantised weights) is refused here with a ``ValueError`` naming the field and value,
so a model never loads and then silently produces different outputs.

RoPE parameters come in two forms and both are read:
- Hub checkpoints (transformers 4): top-level ``rope_theta`` and ``rope_scaling`` (``{"type"|"rope_type": ...}``).
- transformers 5 ``save_pretrained``: ``rope_parameters = {"rope_theta": ..., "rope_type": ..., ...}`` and no
  top-level ``rope_theta``.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inflight.models.moe import moe_fields, validate_moe
from inflight.quantization.fp8 import FP8_METHOD, parse_fp8_config
from inflight.quantization.smoothquant import W8A8_METHOD
from inflight.quantization.w4a16 import GROUP_SIZES, QUANT_METHOD

# HF architecture name -> model_type. One model class covers them all: they differ only in which
# projections carry a bias, the tied LM head, QK-norm (Qwen3) and the sliding-window fields, all of
# which are config.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # Gemma 3's text model: (1 + w) RMSNorms before and after attention and MLP, QK-norm, GeGLU,
    # scaled embeddings, and interleaved sliding-window / global layers with their own RoPE bases.
    "Gemma3ForCausalLM": "gemma3_text",
    # Mixture of experts (inflight.models.moe): Mistral / Qwen3 attention, routed expert MLPs.
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}

# Rope types we compute exactly as transformers does; "default" is stored as rope_scaling=None.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# transformers' class default when a (very old) checkpoint names no theta at all.
_HF_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    """Frozen and validated on construction. Use :meth:`from_hf_dir` / :meth:`from_dict` for checkpoints."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; else a normalised dict with "rope_type" ("linear" | "llama3") and its
    # parameters ("factor", and for llama3 "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"). Treat as read-only: it is copied on construction.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # bias on o_proj (Llama's attention_bias covers it; Qwen2 has none)
    mlp_bias: bool = False
    # RMSNorm over each head of q and of k after the projection, before RoPE (Qwen3's QK-norm).
    qk_norm: bool = False
    # The MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU).
    hidden_act: str = "silu"
    # Per layer: the attention window (0: global). None: every layer global (or sliding_window, for
    # the checkpoints that apply it everywhere). Gemma 3's sliding layers use rope_local_theta.
    layer_windows: tuple[int, ...] | None = None
    rope_local_theta: float | None = None
    # Attention's scale is query_pre_attn_scalar ** -0.5 when set (Gemma), else head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # The window that the model actually applies (None: full attention in every layer).
    sliding_window: int | None = None
    # The checkpoint's stored dtype ("bfloat16", ...), for dtype="auto"; None when not stated.
    checkpoint_dtype: str | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE; see inflight.models.moe): each token of a sparse layer
    # (moe_layers[i] True) runs its num_experts_per_tok best experts, MLPs of moe_intermediate_size;
    # norm_topk_prob renormalises their routing weights. num_experts 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    model_type: str = field(default="", compare=False)
    # Weight-only quantisation of the checkpoint's linear layers, or None (float weights). The only
    # method: {"quant_method": "inflight_w4a16", "group_size": 32 | 64 | 128, "symmetric": bool}, or
    # {"quant_method": "inflight_w8a8", "alpha": float} (SmoothQuant), or {"quant_method": "fp8",
    # "weight_block_size": (rows, cols) | None, "modules_to_not_convert": (...)} (FP8 checkpoints)
    # (written by `inflight quantize`). Treat as read-only.
    quantization: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if not self.model_type:
            object.__setattr__(self, "model_type", SUPPORTED_ARCHITECTURES[self.architecture])
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"rms_norm_eps must be a finite number > 0, got {self.rms_norm_eps!r}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be a finite number > 0, got {self.rope_theta!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window!r}")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (silu, gelu_pytorch_tanh)")
        if self.layer_windows is not None:
            object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))
            if len(self.layer_windows) != self.num_hidden_layers or any(w < 0 for w in self.layer_windows):
                raise ValueError(
                    f"layer_windows must hold one window >= 0 per layer ({self.num_hidden_layers}), "
                    f"got {self.layer_windows!r}"
                )
        if self.bos_token_id is not None and not (0 <= self.bos_token_id < self.vocab_size):
            raise ValueError(f"bos_token_id must be in [0, {self.vocab_size}), got {self.bos_token_id}")
        for t in self.eos_token_ids:
            if not (0 <= t < self.vocab_size):
                raise ValueError(f"eos_token_id must be in [0, {self.vocab_size}), got {t}")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
            _validate_rope_scaling(self.rope_scaling)
        object.__setattr__(self, "moe_layers", tuple(bool(m) for m in self.moe_layers))
        validate_moe(self)

    def __hash__(self) -> int:
        # The generated hash would fail on the rope_scaling dict; hash its items instead.
        items = tuple(
            (f, tuple(sorted(v.items())) if isinstance(v, dict) else v) for f, v in self.__dict__.items()
        )
        return hash(items)

    # ---- derived -------------------------------------------------------------------------------

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def is_gemma(self) -> bool:
        return self.model_type == "gemma3_text"

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return bool(self.moe_layers) and self.moe_layers[layer]

    def window_of(self, layer: int) -> int:
        """Layer ``layer``'s attention window (0: global)."""
        return self.layer_windows[layer] if self.layer_windows is not None else 0

    @property
    def attention_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        return float(base) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def check_max_seq_len(self, max_seq_len: int) -> int:
        """Raise ValueError if a run with sequences up to ``max_seq_len`` tokens would diverge.

        A sliding window only changes the result once a sequence is longer than the window; we do not
        implement windowed attention, so such a run is refused instead of computing full attention.
        """
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be an integer >= 1, got {max_seq_len!r}")
        if max_seq_len > self.max_position_embeddings:
            raise ValueError(
                f"max_seq_len must be <= max_position_embeddings ({self.max_position_embeddings}), "
                f"got {max_seq_len}"
            )
        if (
            self.layer_windows is None
            and self.sliding_window is not None
            and self.sliding_window < max_seq_len
        ):
            raise ValueError(
                f"sliding_window attention is not supported: the model's sliding_window "
                f"({self.sliding_window}) is smaller than max_seq_len ({max_seq_len}); pass "
                f"max_seq_len <= {self.sliding_window}"
            )
        return max_seq_len

    # ---- construction ----------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {str(path)!r}")
        with open(config_path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config dict (either rope form), refusing what we would compute differently."""
        architecture = _parse_architecture(d)
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        if model_type == "gemma3_text":
            return _gemma3_from_dict(cls, d, architecture)

        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        quantization = _parse_quantization(d.get("quantization_config"))
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor {d['partial_rotary_factor']!r} is not supported")

        hidden_size = _req_int(d, "hidden_size")
        num_heads = _req_int(d, "num_attention_heads")
        num_kv_heads = d.get("num_key_value_heads")
        if num_kv_heads is None:
            num_kv_heads = num_heads
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(
                    f"hidden_size ({hidden_size}) must be a multiple of num_attention_heads ({num_heads}) "
                    "when head_dim is not given"
                )
            head_dim = hidden_size // num_heads
        max_pos = _req_int(d, "max_position_embeddings")
        rope_theta, rope_scaling = _parse_rope(d, max_pos)

        if model_type == "qwen2":
            attention_bias, o_proj_bias = True, False
        elif model_type in ("llama", "qwen3", "qwen3_moe"):  # Qwen3's attention_bias covers o_proj too
            attention_bias = o_proj_bias = bool(d.get("attention_bias", False))
        else:  # mistral, mixtral: no biases at all in their attention
            attention_bias = o_proj_bias = False
        mlp_bias = bool(d.get("mlp_bias", False)) if model_type == "llama" else False

        eos_ids = _eos_ids(d)
        dtype = d.get("torch_dtype", d.get("dtype"))
        return cls(
            architecture=architecture,
            vocab_size=_req_int(d, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_req_int(d, "intermediate_size"),
            num_hidden_layers=_req_int(d, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            # transformers' Llama/Mistral/Qwen2 configs all default to an untied head.
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=_parse_sliding_window(d, model_type),
            checkpoint_dtype=dtype if isinstance(dtype, str) else None,
            model_type=model_type,
            quantization=quantization,
            **moe_fields(d, model_type, quantization),
        )


def _parse_quantization(q: Any) -> dict[str, Any] | None:
    if not q:
        return None
    method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
    if method == W8A8_METHOD:
        embedding = q.get("embedding")
        if embedding not in (None, "w8a16-g32"):
            raise ValueError(f"quantization_config.embedding must be None or 'w8a16-g32', got {embedding!r}")
        return {"quant_method": method, "alpha": q.get("alpha"), "embedding": embedding}
    if method == FP8_METHOD:
        return parse_fp8_config(q)
    if method != QUANT_METHOD:
        raise ValueError(
            f"quantization_config (quant_method {method!r}) is not supported (only {QUANT_METHOD!r}, "
            f"{W8A8_METHOD!r} and {FP8_METHOD!r})"
        )
    group_size = q.get("group_size")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"quantization_config.group_size must be 32, 64 or 128, got {group_size!r}")
    symmetric = q.get("symmetric", False)
    if not isinstance(symmetric, bool):
        raise ValueError(f"quantization_config.symmetric must be a boolean, got {symmetric!r}")
    return {"quant_method": method, "group_size": group_size, "symmetric": symmetric}


def _eos_ids(d: dict[str, Any]) -> tuple[int, ...]:
    """``eos_token_id`` (absent, one id or a list) as a tuple."""
    eos = d.get("eos_token_id")
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(int(e) for e in eos)


def _req_int(d: dict[str, Any], key: str) -> int:
    if key not in d or d[key] is None:
        raise ValueError(f"config.json lacks required field {key!r}")
    value = d[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


def _parse_architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures")
    if archs:
        if len(archs) != 1:
            raise ValueError(f"architectures must name exactly one architecture, got {archs!r}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = d.get("model_type")
        if model_type is not None and model_type != SUPPORTED_ARCHITECTURES[arch]:
            raise ValueError(f"model_type {model_type!r} does not match architecture {arch!r}")
        return arch
    model_type = d.get("model_type")
    if model_type not in _MODEL_TYPE_TO_ARCH:
        raise ValueError(
            f"model_type {model_type!r} is not supported (and no architectures given); supported: "
            f"{sorted(_MODEL_TYPE_TO_ARCH)}"
        )
    return _MODEL_TYPE_TO_ARCH[model_type]


def _parse_rope(d: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """Merge both rope forms into (theta, normalised scaling dict or None)."""
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = d.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a dict or null, got {value!r}")
        if any(isinstance(v, dict) for v in value.values()):
            raise ValueError(f"{key} per layer type ({sorted(value)}) is not supported")
        params.update(value)

    theta = d.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta")
    elif params.get("rope_theta") is not None and float(params["rope_theta"]) != float(theta):
        raise ValueError(
            f"rope_theta ({theta}) disagrees with rope_parameters.rope_theta ({params['rope_theta']})"
        )
    if theta is None:
        warnings.warn(
            f"config.json names no rope_theta (neither top-level nor in rope_parameters); using "
            f"transformers' default {_HF_DEFAULT_ROPE_THETA}",
            stacklevel=3,
        )
        theta = _HF_DEFAULT_ROPE_THETA
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {params['partial_rotary_factor']!r} is not supported")

    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} (rope scaling) is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    scaling: dict[str, Any] = {"rope_type": rope_type}
    if "factor" not in params:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks 'factor'")
    scaling["factor"] = float(params["factor"])
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ValueError(f"rope_scaling of type 'llama3' lacks {key!r}")
            scaling[key] = float(params[key])
        # Same precedence as transformers' standardize_rope_params.
        orig = d.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
        scaling["original_max_position_embeddings"] = int(orig if orig is not None else max_pos)
    _validate_rope_scaling(scaling)
    return float(theta), scaling


def _validate_rope_scaling(s: dict[str, Any]) -> None:
    rope_type = s.get("rope_type")
    if rope_type not in ("linear", "llama3"):
        raise ValueError(f"rope_type {rope_type!r} (rope scaling) is not supported")
    required = ["factor"]
    if rope_type == "llama3":
        required += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    for key in required:
        if s.get(key) is None:
            raise ValueError(f"rope_scaling of type {rope_type!r} lacks {key!r}")
    if not s["factor"] > 0:
        raise ValueError(f"rope_scaling factor must be > 0, got {s['factor']!r}")
    if rope_type == "llama3":
        if not s["high_freq_factor"] > s["low_freq_factor"] > 0:
            raise ValueError(
                f"llama3 rope_scaling needs high_freq_factor > low_freq_factor > 0, got "
                f"{s['high_freq_factor']} and {s['low_freq_factor']}"
            )
        if s["original_max_position_embeddings"] < 1:
            raise ValueError(
                f"original_max_position_embeddings must be >= 1, got {s['original_max_position_embeddings']}"
            )


def _parse_sliding_window(d: dict[str, Any], model_type: str) -> int | None:
    """The window transformers would actually apply in some layer, or None."""
    window = d.get("sliding_window")
    if window is None:
        return None
    if model_type in ("mistral", "mixtral"):
        return int(window)
    if model_type == "qwen3_moe":  # every layer, when use_sliding_window (Qwen3MoeConfig)
        return int(window) if d.get("use_sliding_window", False) else None
    if model_type in ("qwen2", "qwen3"):
        # Qwen2/3 ignore sliding_window unless use_sliding_window, and then only in layers
        # >= max_window_layers (or those that layer_types marks "sliding_attention").
        if not d.get("use_sliding_window", False):
            return None
        layer_types = d.get("layer_types")
        if layer_types is None:
            n = d.get("num_hidden_layers", 0)
            layer_types = [
                "sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
                for i in range(n)
            ]
        return int(window) if "sliding_attention" in layer_types else None
    # Llama has no sliding window in transformers; a stray key would be ignored by it too.
    return None


def _gemma3_from_dict(cls, d: dict[str, Any], architecture: str) -> ModelConfig:
    """Gemma 3's text config (``Gemma3TextConfig``), refusing what the model would compute differently."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            raise ValueError(f"{key} {d[key]!r} is not supported (Gemma 3 has none)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (causal attention only)")
    act = d.get("hidden_activation", d.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
    n_layers = _req_int(d, "num_hidden_layers")
    window = _req_int(d, "sliding_window")
    layer_types = d.get("layer_types")
    if layer_types is None:
        pattern = int(d.get("sliding_window_pattern", 6))
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)
        ]
    if len(layer_types) != n_layers or set(layer_types) - {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"layer_types must name full_attention or sliding_attention for each of {n_layers} layers"
        )
    max_pos = _req_int(d, "max_position_embeddings")
    rope = d.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:  # transformers 5: per layer type
        global_rope, local_rope = (
            dict(rope["full_attention"] or {}),
            dict(rope.get("sliding_attention") or {}),
        )
    else:  # transformers 4: rope_theta, rope_local_base_freq, rope_scaling for the global layers
        global_rope = dict(d.get("rope_scaling") or {})
        global_rope["rope_theta"] = d.get("rope_theta", 1_000_000.0)
        local_rope = {"rope_type": "default", "rope_theta": d.get("rope_local_base_freq", 10_000.0)}
    local_type = local_rope.get("rope_type", local_rope.get("type", "default"))
    if local_type != "default":
        raise ValueError(
            f"rope_parameters.sliding_attention.rope_type {local_type!r} is not supported (only 'default')"
        )
    theta, scaling = _parse_rope({"rope_parameters": global_rope}, max_pos)
    hidden = _req_int(d, "hidden_size")
    eos_ids = _eos_ids(d)
    dtype = d.get("torch_dtype", d.get("dtype"))
    bias = bool(d.get("attention_bias", False))
    return cls(
        architecture=architecture,
        vocab_size=_req_int(d, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_req_int(d, "intermediate_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=_req_int(d, "num_attention_heads"),
        num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
        head_dim=_req_int(d, "head_dim"),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
        hidden_act="gelu_pytorch_tanh",
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
        sliding_window=window,
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in layer_types),
        rope_local_theta=float(local_rope.get("rope_theta", 10_000.0)),
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", d["head_dim"])),
        checkpoint_dtype=dtype if isinstance(dtype, str) else None,
        model_type="gemma3_text",
        quantization=_parse_quantization(d.get("quantization_config")),
    )
