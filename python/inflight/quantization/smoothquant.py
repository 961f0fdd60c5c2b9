"""SmoothQuant W8A8 checkpoints (``inflight quantize --method smoothquant``), TensorRT-LLM's mode.

Per linear layer input channel j, calibration finds ``act_max[j] = max |x_j|`` over the tokens of a
calibration text (transformers runs the float model; hooks read each projection's input), and the
weights give ``w_max[j] = max_n |W[n, j]|`` (over every projection that reads that input: q/k/v
together, gate/up together). The smoothing factor moves part of the activations' outliers into the
weights:

    s[j] = act_max[j] ** alpha / w_max[j] ** (1 - alpha)      (clamped to [1e-5, 1e5])
    W'   = W * s  (per input column),   x' = x / s

so ``x' @ W'.T == x @ W.T``. ``W'`` is quantised to int8 with one symmetric scale per output channel
(``scale[n] = max_j |W'[n, j]| / 127``); ``1 / s`` is stored as ``smooth`` and the kernel multiplies
``x`` by it before quantising each token (no norm weight is rewritten, so every projection, o_proj
and down_proj included, is smoothed).

Output: ``<proj>.qweight`` int8 [N, K], ``<proj>.scales`` fp32 [N], ``<proj>.smooth`` fp32 [K] for the
seven projections of every layer; a tied embedding (the LM head too) as int8 rows with an fp16 scale
per 32 values (``model.embed_tokens.qweight`` / ``.scales``: weight-only, GGUF Q8_0's form, read by
``W8A16Embedding``); everything else unchanged; ``quantization_config = {"quant_method":
"inflight_w8a8", "alpha": alpha, "embedding": "w8a16-g32" | None}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from inflight.quantization.checkpoint import copy_side_files
from inflight.quantization.w4a16 import quantize_w8
from inflight.utils.checkpoint_files import iter_safetensors

__all__ = ["W8A8_METHOD", "calibrate_act_max", "quantize_smoothquant", "smoothing_factors"]

W8A8_METHOD = "inflight_w8a8"
EMBEDDING_GROUP = 32
# Projections that read the same input, by the checkpoint names of a llama-family layer.
GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def smoothing_factors(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """SmoothQuant's ``s [K]`` for the projections ``weights`` ([N_i, K] each) that read one input."""
    w_max = torch.stack([w.float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    s = act_max.float().clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(1e-5, 1e5)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one fp32 scale per output row: ``(qweight int8, scales fp32)``."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


@torch.no_grad()
def calibrate_act_max(
    model_dir: str | os.PathLike, text: str, max_tokens: int = 2048, window: int = 512
) -> dict:
    """``{"model.layers.{i}.{proj}": act_max [K]}`` for the first projection of each group, from the
    float model (transformers, fp32) over the first ``max_tokens`` tokens of ``text``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = tok.encode(text, add_special_tokens=False)[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"the calibration text has {len(ids)} tokens; it needs at least 2")
    stats: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if any(name.endswith(group[0]) for group in GROUPS) and name.startswith("model.layers."):

            def hook(_m, inputs, _out, name=name):
                x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0).float()
                stats[name] = torch.maximum(stats[name], x) if name in stats else x

            hooks.append(module.register_forward_hook(hook))
    try:
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        for lo in range(0, len(ids), window):
            model(torch.tensor([bos + ids[lo : lo + window]]))
    finally:
        for h in hooks:
            h.remove()
    return stats


def quantize_smoothquant(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    calib_text: str,
    alpha: float = 0.5,
    calib_tokens: int = 2048,
) -> Path:
    """Writes the W8A8 (SmoothQuant) copy of a Hugging Face llama-family directory to ``out_dir``."""
    src, dst = Path(model_dir), Path(out_dir)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if src.resolve() == dst.resolve():
        raise ValueError(f"out_dir must differ from model_dir ({str(src)!r})")
    with open(src / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(f"{str(src)!r} is already quantised ({config['quantization_config']})")
    act_max = calibrate_act_max(src, calib_text, calib_tokens)
    tensors = dict(iter_safetensors(src))
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    replaced: set[str] = set()
    for name in list(tensors):
        for group in GROUPS:
            suffix = next((p for p in group if name.endswith(f".{p}.weight")), None)
            if suffix is None or not name.startswith("model.layers."):
                continue
            layer = name[: -len(f".{suffix}.weight")]
            key = f"{layer}.{group[0]}"
            if key in done:
                break
            if key not in act_max:
                raise ValueError(f"calibration saw no input of {key}")
            weights = [tensors[f"{layer}.{p}.weight"] for p in group]
            s = smoothing_factors(act_max[key], weights, alpha)
            for p, w in zip(group, weights):
                q, scales = quantize_per_channel(w.float() * s[None, :])
                out[f"{layer}.{p}.qweight"] = q
                out[f"{layer}.{p}.scales"] = scales
                out[f"{layer}.{p}.smooth"] = (1.0 / s).contiguous()
                replaced.add(f"{layer}.{p}.weight")
            done.add(key)
            break
    if not done:
        raise ValueError(
            f"no llama-family projections (model.layers.*.self_attn.q_proj.weight, ...) in {str(src)!r}"
        )
    # A tied embedding (also the LM head, read whole every step) becomes int8 rows with a scale per
    # 32 values, as GGUF's Q8_0 stores it: the engine's W8A16Embedding (the head is weight-only int8).
    embedding = None
    tied = config.get("tie_word_embeddings", False) and "lm_head.weight" not in tensors
    if tied and "model.embed_tokens.weight" in tensors:
        q, scales = quantize_w8(tensors["model.embed_tokens.weight"].float(), EMBEDDING_GROUP, torch.float16)
        out["model.embed_tokens.qweight"], out["model.embed_tokens.scales"] = q, scales
        replaced.add("model.embed_tokens.weight")
        embedding = f"w8a16-g{EMBEDDING_GROUP}"
    for name, t in tensors.items():
        if name not in replaced:
            out[name] = t.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": W8A8_METHOD, "alpha": alpha, "embedding": embedding}
    with open(dst / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    copy_side_files(src, dst)
    return dst
