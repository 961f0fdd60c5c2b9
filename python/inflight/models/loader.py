"""``load_model``: what ``LLM(model=...)`` accepts (a Hugging Face directory, a ``.gguf`` file or a known
short name), resolved to a model with its weights loaded, its config and its tokenizer.

This is the one loader: the engine and the tests both build models through :func:`load_model`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from inflight.cuda import cuda_compiled
from inflight.layers.attention import AttentionBackend
from inflight.layers.linear import Linear
from inflight.layers.native_attention import NativeAttentionBackend
from inflight.layers.quantized_linear import (
    ACTIVATION_QUANTIZATIONS,
    W4A16Linear,
    W8A8Linear,
    W8A16Embedding,
    W8A16Linear,
)
from inflight.layers.torch_attention import TorchAttentionBackend
from inflight.models import gguf_loader, gguf_tokenizer
from inflight.models.config import ModelConfig
from inflight.models.llama import LlamaForCausalLM
from inflight.parallel.comm import SINGLE, TensorParallel
from inflight.parallel.sharding import PipelineStage
from inflight.quantization.fp8 import FP8_METHOD, fp8_group_size, iter_fp8_tensors
from inflight.quantization.smoothquant import W8A8_METHOD
from inflight.utils.checkpoint_files import iter_safetensors
from inflight.utils.dtypes import checkpoint_dtype, parse_dtype
from inflight.utils.host_memory import drop_tokenizer_build_tables, release_free_heap

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

logger = logging.getLogger("inflight")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Any  # a transformers tokenizer, or None (token-id prompts only)
    dtype: torch.dtype
    activation_quantization: str = "none"  # what "auto" resolved to: "none", "int8" or "int16"


class GGUFLinearFactory:
    """The linear factory of a GGUF model run natively: each module gets the layer class of its
    :class:`~inflight.models.gguf_loader.ModuleFormat` (W4A16Linear, W8A16Linear, or a dense Linear for
    one the kernels cannot run). The model asks :meth:`for_module`; a module the plan does not name
    (called directly) is dense."""

    def __init__(self, plan: gguf_loader.GGUFQuantPlan) -> None:
        self.plan = plan

    def for_module(self, layer: int, module: str):
        fmt = self.plan.format_of(layer, module)
        if fmt.bits == 4:
            return partial(
                W4A16Linear, group_size=fmt.group_size, symmetric=fmt.symmetric, scale_dtype=fmt.scale_dtype
            )
        if fmt.bits == 8:
            return partial(W8A16Linear, group_size=fmt.group_size, scale_dtype=fmt.scale_dtype)
        return Linear

    def __call__(self, *args, **kwargs):
        return Linear(*args, **kwargs)


def _fp8_linear(in_features, output_sizes, bias=False, dtype=torch.float32, device=None, *, block):
    """A layer of an FP8 checkpoint: E4M3 weights, fp32 scales per group of the block's columns."""
    return W8A16Linear(
        in_features,
        output_sizes,
        bias,
        dtype,
        device,
        group_size=fp8_group_size(in_features, block),
        scale_dtype=torch.float32,
        weight_format="fp8_e4m3",
    )


def _warn_dequantised(path: Path, kinds: dict[str, int], dtype: torch.dtype, what: str) -> None:
    logger.warning(
        "%s: GGUF tensor types %s have no native kernel set here (native: linears in %s, a tied embedding "
        "in %s); they are dequantised to %s, %s",
        path.name,
        ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())),
        "/".join(sorted(gguf_loader.W4_KINDS | gguf_loader.W8_KINDS)),
        "/".join(sorted(gguf_loader.W8_KINDS)),
        str(dtype).removeprefix("torch."),
        what,
    )


ATTENTION_BACKENDS = ("native", "torch")


def make_attention_backend(
    name: str | AttentionBackend | None, device: torch.device | None = None
) -> AttentionBackend:
    """ "native" (the C++ / CUDA kernels; the default) or "torch" (the plain-torch reference); an
    :class:`AttentionBackend` instance is used as it is."""
    if isinstance(name, AttentionBackend):
        return name
    if name is None:
        name = "native"
        if device is not None and device.type == "cuda" and not cuda_compiled():
            name = "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "native":
        return NativeAttentionBackend()
    raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {name!r}")


def auto_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    """The checkpoint's dtype; on a CPU float16 becomes bfloat16 (CPU float16 matmuls are slow)."""
    dtype = checkpoint_dtype(config.checkpoint_dtype)
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.bfloat16
    return dtype


# Activation dtype of natively quantised weights on a CPU with dtype="auto": fp32, exact fp32 math (greedy
# tokens equal transformers' fp32 run of the same GGUF). Single-stream decode is as fast as with bf16
# activations (memory-bound; ~7 ms per SmolLM2 step either way); batches of 12+ rows run ~1.3-2x faster
# with bf16 activations (VDPBF16PS), which LLM(..., dtype="bfloat16", quantization="gguf") selects.
QUANTIZED_CPU_DTYPE = torch.float32


def load_tokenizer(path: Path):
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # a second or two to import: only when there is a tokenizer

    return AutoTokenizer.from_pretrained(str(path))


QUANTIZATION_MODES = ("auto", "gguf", "none")


def check_quantization(value: str | None) -> str:
    """The quantization mode: "auto" (None), "gguf" or "none"; anything else is a ValueError."""
    if value is None:
        return "auto"
    if not isinstance(value, str) or value.lower() not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be None or one of {list(QUANTIZATION_MODES)}, got {value!r}")
    return value.lower()


def a16_vectorised() -> bool:
    """Whether the A8 / A16 GEMM runs its AVX512-VNNI tiles with the CPU kernels selected now (else
    its portable loop, far slower than the float kernels)."""
    from inflight import _C

    return bool(_C.a8_vectorised())


def check_activation_quantization(value: str | None, device: torch.device) -> str:
    """The activation quantization: "auto" (None), "none", "int8" or "int16" (the last two CPU only);
    "auto" is "none" off the CPU. Anything else is a ValueError."""
    if value is None:
        value = "auto"
    if not isinstance(value, str) or value.lower() not in ("auto", *ACTIVATION_QUANTIZATIONS):
        raise ValueError(
            f"activation_quantization must be None or one of {['auto', *ACTIVATION_QUANTIZATIONS]}, "
            f"got {value!r}"
        )
    value = value.lower()
    if value == "auto":
        return value if device.type == "cpu" else "none"
    if value != "none" and device.type != "cpu":
        raise ValueError(
            f"activation_quantization={value!r} runs on the CPU only (the A8 GEMM), got device {str(device)!r}"
        )
    return value


def load_config(model: str | os.PathLike) -> ModelConfig:
    """The config of what ``load_model(model)`` would load (no weights read)."""
    known = gguf_loader.resolve_known_model(str(model)) if isinstance(model, str) else None
    path = known if known is not None else Path(os.fspath(model)).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_loader.read_gguf(path)[1]
    if path.is_dir():
        return ModelConfig.from_hf_dir(path)
    raise ValueError(
        f"model must be a Hugging Face model directory, a .gguf file or one of "
        f"{sorted(gguf_loader.KNOWN_MODELS)}, got {str(model)!r}"
    )


def load_model(
    model: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    attention_backend: str | AttentionBackend | None = None,
    max_seq_len: int | None = None,
    quantization: str | None = None,
    tp: TensorParallel = SINGLE,
    stage: PipelineStage | None = None,
    activation_quantization: str | None = None,
) -> LoadedModel:
    """``model``: a Hugging Face model directory, a ``.gguf`` file, or a known short name
    (``smollm2``). ``dtype``: a name of :mod:`inflight.utils.dtypes`, a torch dtype, or None / "auto".
    ``device``: default the CPU.

    ``quantization`` decides what happens to a GGUF file's 4-bit weights:
      - "auto" (None): native 4-bit kernels when ``dtype`` is auto and the device a CPU (fp32
        activations); an explicit dtype dequantises every weight into that dtype;
      - "gguf": always native (Q4_0/Q4_1/Q4_K linears as W4A16, Q5_0/Q8_0/Q6_K ones and a tied Q8_0
        embedding as W8A16; a module of another type or of mixed bits dequantised), with ``dtype``
        as the activation dtype (auto: fp32 on a CPU, fp16 on a GPU), as vLLM runs GGUF files;
      - "none": always dequantised (auto dtype: bf16 on a CPU, fp16 on a GPU).
    Quantised Hugging Face directories (``inflight quantize``) always run natively.

    ``activation_quantization="int8"`` (CPU only): the natively quantised linear layers quantise their
    input to int8 per group of 32 and multiply in integers (the A8 GEMM, as llama.cpp does); ``"int16"``
    the same with 16-bit codes (A16: ~15 bits per group); a model without such layers is a ValueError.
    "none": activations in ``dtype``. None / "auto" (the default): "int16" where the CPU runs the A16
    GEMM's VNNI tiles and the model has natively quantised layers (its perplexity equals the float
    activations' to 1e-5; 1.5-2x faster from 4 rows), else "none". LoadedModel records the outcome.

    ``tp``: this process's tensor-parallel rank; the model keeps only its slice of each tensor (the
    file is read whole, the other slices are dropped as they are read). ``stage``: this process's
    pipeline stage (its layers, and whether it embeds / has the head); default the whole model."""
    dtype = parse_dtype(dtype)
    device = torch.device(device) if device is not None else torch.device("cpu")
    mode = check_quantization(quantization)
    act_mode = check_activation_quantization(activation_quantization, device)
    known = gguf_loader.resolve_known_model(str(model)) if isinstance(model, str) else None
    path = known if known is not None else Path(os.fspath(model)).expanduser()
    factories: dict[str, Any] = {}
    if path.is_file() and path.suffix == ".gguf":
        reader, config = gguf_loader.read_gguf(path)
        # "auto": dtype="auto" on a CPU keeps the weights the kernels run natively quantised; an
        # explicit dtype dequantises everything into it.
        native = mode == "gguf" or (mode == "auto" and dtype is None and device.type == "cpu")
        plan = gguf_loader.gguf_quant_plan(reader, config) if native else None
        if mode == "gguf" and plan is None:
            raise ValueError(
                f"quantization='gguf' needs linear weights of {path.name} in a natively run type "
                f"({sorted(gguf_loader.W4_KINDS | gguf_loader.W8_KINDS)}), found "
                f"{sorted(gguf_loader.gguf_linear_kinds(reader))}; use quantization=None to dequantise"
            )
        if plan is not None:
            if dtype is None:
                dtype = QUANTIZED_CPU_DTYPE if device.type == "cpu" else torch.float16
            factories["linear_factory"] = GGUFLinearFactory(plan)
            if plan.embedding is not None:
                e = plan.embedding
                factories["embedding_factory"] = partial(
                    W8A16Embedding, group_size=e.group_size, scale_dtype=e.scale_dtype
                )
            logger.info("%s: native GGUF weights: %s", path.name, plan.describe())
            if plan.dequantised:
                _warn_dequantised(path, plan.dequantised, dtype, "the rest runs natively")
            weights = gguf_loader.iter_gguf_quantized_tensors(reader, config, dtype, plan)
        else:
            # Dequantised weights: bfloat16 by default (the fp32 copy is twice the memory traffic).
            dtype = (
                dtype if dtype is not None else (torch.bfloat16 if device.type == "cpu" else torch.float16)
            )
            if native:  # the caller asked for native weights: say which types have no kernel
                unsupported = {
                    k: n
                    for k, n in gguf_loader.gguf_tensor_kinds(reader).items()
                    if k not in ("F32", "F16", "BF16")
                }
                _warn_dequantised(path, unsupported, dtype, "all weights are dequantised")
            weights = gguf_loader.iter_gguf_tensors(reader, config, dtype)
        tokenizer_fn = lambda: gguf_tokenizer.load_gguf_tokenizer(path, config)  # noqa: E731
    elif path.is_dir():
        if mode == "gguf":
            raise ValueError(f"quantization='gguf' needs a .gguf file, got the directory {str(path)!r}")
        config = ModelConfig.from_hf_dir(path)
        method = None if config.quantization is None else config.quantization["quant_method"]
        weights = iter_safetensors(path)
        if method == FP8_METHOD:
            block = config.quantization["weight_block_size"]
            skipped = [m for m in config.quantization["modules_to_not_convert"] if "proj" in m]
            if skipped:
                raise ValueError(
                    f"quantization_config.modules_to_not_convert lists projections {skipped[:4]}: an FP8 "
                    "checkpoint with unquantised layer projections is not supported"
                )
            factories["linear_factory"] = partial(_fp8_linear, block=block)
            weights = iter_fp8_tensors(weights, block)
        elif method == W8A8_METHOD:
            if tp.size > 1:
                raise ValueError(
                    "a W8A8 (SmoothQuant) checkpoint runs with tensor_parallel_size=1 only, for now"
                )
            factories["linear_factory"] = W8A8Linear
            if config.quantization.get("embedding") == "w8a16-g32":
                factories["embedding_factory"] = partial(W8A16Embedding, group_size=32)
            if dtype is None and device.type == "cpu":
                dtype = QUANTIZED_CPU_DTYPE
        elif config.quantization is not None:
            factories["linear_factory"] = partial(
                W4A16Linear,
                group_size=config.quantization["group_size"],
                symmetric=config.quantization["symmetric"],
            )
            if dtype is None and device.type == "cpu":
                dtype = QUANTIZED_CPU_DTYPE
        dtype = dtype if dtype is not None else auto_dtype(config, device)
        tokenizer_fn = lambda: load_tokenizer(path)  # noqa: E731
    else:
        raise ValueError(
            f"model must be a Hugging Face model directory, a .gguf file or one of "
            f"{sorted(gguf_loader.KNOWN_MODELS)}, got {str(model)!r}"
        )
    config.check_max_seq_len(max_seq_len if max_seq_len is not None else config.max_position_embeddings)
    backend = make_attention_backend(attention_backend, device)
    # The tokenizer first: its load is transient-heavy (a JSON parse of the whole vocabulary), and its
    # garbage goes back to the OS before the weights arrive, so the two peaks do not add up.
    tokenizer = tokenizer_fn()
    entries = drop_tokenizer_build_tables(tokenizer)
    release_free_heap()
    net = LlamaForCausalLM(
        config, dtype, backend, max_seq_len=max_seq_len, device=device, tp=tp, stage=stage, **factories
    )
    net.load_weights(weights)
    net.eval()
    if act_mode == "auto":
        act_mode = "none"
        count = net.set_activation_quantization("int16") if a16_vectorised() else 0
        if count > 0:
            act_mode = "int16"
            logger.info(
                "int16 activations (A16 GEMM) in %d quantised linear layers (activation_quantization 'auto'; "
                "'none' keeps %s activations)",
                count,
                str(dtype).removeprefix("torch."),
            )
    elif act_mode != "none":
        count = net.set_activation_quantization(act_mode)
        if count == 0:
            raise ValueError(
                f"activation_quantization={act_mode!r} needs natively quantised linear weights (a GGUF file run "
                f"with quantization None or 'gguf', or an `inflight quantize --method w4a16` directory); "
                f"{path.name} loaded without any"
            )
        logger.info(
            "%s activations (A%d GEMM) in %d quantised linear layers",
            act_mode,
            8 if act_mode == "int8" else 16,
            count,
        )
    if device.type == "cpu":
        _pack_now(net)
    _release_load_garbage(path, entries)
    return LoadedModel(net, config, tokenizer, dtype, act_mode)


def _release_load_garbage(path: Path, entries: int) -> None:
    """After loading: give the freed heap back to the OS (logged, with the ``entries`` of the tokenizer's
    Python vocabulary and merges dropped before the weights were read)."""
    freed = release_free_heap()
    if freed is not None:
        logger.info(
            "returned %.0f MiB of freed heap to the OS after loading %s%s",
            freed,
            path.name,
            f" (the tokenizer's Python copy of {entries} vocabulary entries and merges dropped)"
            if entries
            else "",
        )


def _pack_now(net: torch.nn.Module) -> None:
    """Builds the packed weights of the kernels that copy them (the A8 / A16 GEMM's, W8A8's) now, not at
    the first forward, and drops the tensors they were packed from (rebuilt exactly when read: see
    ``set_packed_only``; a tied int8 embedding's lookup reads its head's packed rows), so that the weights
    are held once when the KV budget is sized from the free memory next."""
    packed = dropped = 0
    for module in net.modules():
        if hasattr(module, "packs_a_copy") and module.packs_a_copy():
            module.set_packed_only()
            packed += module.kernel_weight().nbytes
            dropped += module.originals_dropped
    if not packed:
        return
    logger.info(
        "packed weights: %.1f MiB; %d layers hold only them (their checkpoint tensors dropped)",
        packed / 2**20,
        dropped,
    )
