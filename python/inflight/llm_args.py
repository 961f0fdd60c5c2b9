# ruff: noqa: RUF009  (arg() returns a dataclasses.field, as field() would: not a shared default)
"""The engine's arguments: :class:`LlmArgs` and its nested :class:`KvCacheConfig` / :class:`SchedulerConfig`.

Every argument is one field declared with :func:`arg`: its default, its help text and its rule
(:class:`Rule`). From that one line follow

- validation, once, on construction (configs are frozen; a bad value is a ``ValueError`` naming the
  argument, the value and what is allowed), with values normalised (dtype names, enums);
- the ``LLM(model, **kwargs)`` keyword (an unknown keyword is an error that lists the known ones);
- the command-line option of ``inflight generate`` / ``inflight serve`` (:func:`add_cli_arguments`,
  :meth:`LlmArgs.from_cli`): ``--max-batch-size`` for ``max_batch_size``, ``--kv-cache-max-tokens``
  for ``kv_cache_config.max_tokens`` (a nested config's fields carry its prefix unless they name a
  flag of their own). The parsed value's name is the flag's (``--tokens-per-block`` gives
  ``namespace.tokens_per_block``; a negated flag such as ``--disable-block-reuse`` gives
  ``namespace.disable_block_reuse``, True when given), and ``from_cli`` maps it back to the field;
- ``LLM(**args.to_kwargs())``, the engine an :class:`LlmArgs` describes.

Adding an engine argument is therefore one line here; the executor factory reads it from the
:class:`LlmArgs` it is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from inflight.batch_manager import CapacitySchedulerPolicy, ContextChunkingPolicy
from inflight.utils.dtypes import (
    FLOAT_DTYPES,
    dtype_name,
    kv_cache_dtype_name,
    parse_dtype,
    parse_kv_cache_dtype,
)

__all__ = [
    "KvCacheConfig",
    "LlmArgs",
    "SchedulerConfig",
    "SpeculativeConfig",
    "add_cli_arguments",
    "arg",
]


# ---------------------------------------------------------------------------------------------- rules


class Rule:
    """How one argument is checked, normalised and offered on the command line."""

    cli_type: Callable[[str], Any] | None = None  # argparse type; None: a flag without a value
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None  # the value's placeholder in --help (None: argparse's own)

    def check(self, name: str, value: Any) -> Any:
        """The normalised value, or ValueError naming ``name``."""
        return value

    def describe(self) -> str:
        return ""


@dataclass(frozen=True)
class Int(Rule):
    lo: int | None = None
    hi: int | None = None
    optional: bool = False
    cli_type: ClassVar = int
    metavar: ClassVar = "N"

    def describe(self) -> str:
        if self.hi is not None:
            what = f"an integer in [{self.lo}, {self.hi}]"
        else:
            what = f"an integer >= {self.lo}" if self.lo is not None else "an integer"
        return f"None or {what}" if self.optional else what

    def check(self, name: str, value: Any) -> Any:
        if value is None and self.optional:
            return None
        # bool is an Integral, but `max_batch_size=True` is a bug in the caller, not the number 1.
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        if ok:
            value = int(value)
            ok = (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)
        if not ok:
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")
        return value


@dataclass(frozen=True)
class Float(Rule):
    lo: float
    hi: float
    lo_open: bool = False
    cli_type: ClassVar = float
    metavar: ClassVar = "X"

    def describe(self) -> str:
        return f"a number in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"

    def check(self, name: str, value: Any) -> Any:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if ok:
            value = float(value)
            # NaN fails every comparison, so it would slip through a plain range check.
            ok = (
                math.isfinite(value)
                and (value > self.lo if self.lo_open else value >= self.lo)
                and value <= self.hi
            )
        if not ok:
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")
        return value


@dataclass(frozen=True)
class Bool(Rule):
    optional: bool = False  # None: "the engine decides" (e.g. by device)

    def describe(self) -> str:
        return "None or a bool" if self.optional else "a bool"

    def check(self, name: str, value: Any) -> Any:
        if (value is None and self.optional) or isinstance(value, bool):
            return value
        raise ValueError(f"{name} must be {self.describe()}, got {value!r}")


@dataclass(frozen=True)
class Choice(Rule):
    options: tuple[str, ...]
    optional: bool = False
    cli_type: ClassVar = str

    @property
    def choices(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.options

    def describe(self) -> str:
        return ("None or one of " if self.optional else "one of ") + str(list(self.options))

    def check(self, name: str, value: Any) -> Any:
        if value is None and self.optional:
            return None
        if isinstance(value, str) and value.lower() in self.options:
            return value.lower()
        raise ValueError(f"{name} must be {self.describe()}, got {value!r}")


@dataclass(frozen=True)
class EnumRule(Rule):
    """A member of ``enum_cls`` (a bound C++ enum or a Python Enum), or its name as a string."""

    enum_cls: Any
    cli_type: ClassVar = str

    @property
    def choices(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(self.enum_cls.__members__)

    @property
    def metavar(self) -> str:  # type: ignore[override]
        return "{" + ",".join(self.choices) + "}"

    def check(self, name: str, value: Any) -> Any:
        if isinstance(value, self.enum_cls):
            return value
        if isinstance(value, str) and value.upper() in self.enum_cls.__members__:
            return self.enum_cls[value.upper()]
        raise ValueError(f"{name} must be one of {', '.join(self.enum_cls.__members__)}, got {value!r}")


@dataclass(frozen=True)
class DType(Rule):
    """Stored as its canonical name ("auto", "float32", "bfloat16", "float16")."""

    cli_type: ClassVar = str
    metavar: ClassVar = "DTYPE"

    def check(self, name: str, value: Any) -> Any:
        dtype = parse_dtype(value, name)
        return "auto" if dtype is None else dtype_name(dtype)


@dataclass(frozen=True)
class KvDType(Rule):
    """A KV cache dtype, stored as its canonical name: DType's names, "int8" and "fp8"."""

    cli_type: ClassVar = str
    metavar: ClassVar = "DTYPE"

    def check(self, name: str, value: Any) -> Any:
        dtype = parse_kv_cache_dtype(value, name)
        return "auto" if dtype is None else kv_cache_dtype_name(dtype)


@dataclass(frozen=True)
class Device(Rule):
    """None (CUDA when available, else the CPU) or anything ``torch.device`` accepts; stored as a str."""

    cli_type: ClassVar = str

    def check(self, name: str, value: Any) -> Any:
        if value is None:
            return None
        try:
            return str(torch.device(value))
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(
                f"{name} must be None or a device such as 'cpu', 'cuda' or 'cuda:1', got {value!r}"
            ) from None


@dataclass(frozen=True)
class Config(Rule):
    """A nested config object of ``config_cls`` (None: its defaults)."""

    config_cls: type

    def check(self, name: str, value: Any) -> Any:
        if value is None:
            return self.config_cls()
        if not isinstance(value, self.config_cls):
            raise ValueError(f"{name} must be a {self.config_cls.__name__}, got {type(value).__name__}")
        return value


@dataclass(frozen=True)
class Scheduler(Rule):
    """A RequestScheduler (an object with ``schedule_request``) or a factory that returns one."""

    def check(self, name: str, value: Any) -> Any:
        if value is None or hasattr(value, "schedule_request") or callable(value):
            return value
        raise ValueError(f"{name} must be a RequestScheduler or a factory of one, got {type(value).__name__}")


def arg(
    default: Any,
    help: str,
    rule: Rule | None = None,
    *,
    flag: str | None = None,
    negate: bool = False,
    cli: bool = True,
) -> Any:
    """One argument: a dataclass field carrying its help, its rule and its command-line form.

    ``flag``: the option name when it is not ``--field-name`` (with a nested config's prefix);
    ``negate``: a bool whose default is True offered as a ``--disable-...``-style flag that sets it
    False (``help`` says what the field is on; the flag's help reads "turn off <help>");
    ``cli=False``: not on the command line (e.g. Python objects).
    """
    if negate and default is not True:
        raise TypeError("negate is for bools whose default is True")
    meta = {
        "help": help,
        "rule": rule if rule is not None else Rule(),
        "flag": flag,
        "negate": negate,
        "cli": cli,
    }
    if isinstance(default, (dict, list, set)):
        raise TypeError("arg defaults must be immutable")
    return dataclasses.field(default=default, metadata=meta)


class _Args:
    """Validation shared by every config class: each field through its rule, once."""

    _cli_prefix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            rule = f.metadata.get("rule")
            if rule is not None:
                object.__setattr__(self, f.name, rule.check(self._qualified(f.name), getattr(self, f.name)))
        self._validate()

    def _validate(self) -> None:
        """Checks across fields (after each field's own rule)."""

    @classmethod
    def _qualified(cls, name: str) -> str:
        return name

    def replace(self, **changes: Any):
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


# ---------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class KvCacheConfig(_Args):
    """Size and behaviour of the paged KV cache.

    ``free_memory_fraction`` follows TensorRT-LLM: the fraction of the memory that is *free after the
    weights are loaded* (and, on a GPU, after a warm-up forward) given to the KV pool — not vLLM's
    fraction of the total memory. On a CPU the pool is further capped at a few GiB (and by the
    container's memory limit) and is allocated lazily. ``max_tokens`` caps the pool in tokens either
    way. ``dtype="auto"`` stores KV in the model's dtype; ``dtype="int8"`` stores int8 codes with one
    fp32 scale per token and KV head (symmetric, max |x| / 127, computed when the token is written, no
    calibration), dequantised inside the attention kernels: about 3.8x the tokens of fp32 KV (1.9x of
    bf16) in the same bytes at head_dim 64. ``dtype="fp8"`` (or ``"fp8_e4m3"``) stores OCP FP8 E4M3
    values, one byte per element and no per-token scales (one scale per tensor for K and V, 1.0:
    values saturate at +-448), read exactly by the attention kernels: 4x the tokens of fp32 KV (2x of
    bf16).
    """

    _cli_prefix: ClassVar[str] = "kv-cache-"

    max_tokens: int | None = arg(None, "cap the KV pool at this many tokens", Int(1, optional=True))
    free_memory_fraction: float = arg(
        0.9,
        "fraction of the memory free after the weights given to the KV cache (TensorRT-LLM's meaning)",
        Float(0.0, 1.0, lo_open=True),
    )
    tokens_per_block: int = arg(
        32, "KV cache block size in tokens (a power of two)", Int(1), flag="--tokens-per-block"
    )
    enable_block_reuse: bool = arg(
        True,
        "prefix caching (reuse of KV blocks across requests)",
        Bool(),
        flag="--disable-block-reuse",
        negate=True,
    )
    dtype: str | torch.dtype = arg(
        "auto",
        "KV cache dtype: auto (the model's), float32, bfloat16, float16, int8 (one fp32 scale per token "
        "and KV head, computed on write), or fp8 (E4M3, also fp8_e4m3; one byte per element, no scales)",
        KvDType(),
    )
    memory_share: float = arg(
        1.0,
        "share of the machine's KV budget this engine takes (a model repository of N models gives "
        "each 1/N); applied after free_memory_fraction and the CPU cap",
        Float(0.0, 1.0, lo_open=True),
        cli=False,
    )
    host_cache_size: int | None = arg(
        None,
        "bytes of the secondary KV tier (TensorRT-LLM's name): evicted reusable blocks are offloaded "
        "there and onboarded on a prefix hit, and swap preemption moves paused requests there; host "
        "memory (pinned on a GPU), or a file with host_cache_path; None or 0: no secondary tier",
        Int(0, optional=True),
    )
    host_cache_path: str | None = arg(
        None,
        "a file on local disk that holds the secondary KV tier (mapped with mmap): a disk tier; needs "
        "host_cache_size. With block reuse it persists: a new engine of the same model (weights, KV "
        "dtype and layout, tier size) adopts the cached blocks it finds there (docs/batch-manager.md "
        "§3.10); any other file is rebuilt, with a warning",
    )
    sliding_window_pools: bool = arg(
        False,
        "VSWA: the sliding-window layers (Gemma 3's local layers) keep their KV in pools of their own "
        "whose blocks are released as the window moves, so their memory is bounded by the window; the "
        "budget is split for the most sequences of max_seq_len (the log shows the split); no secondary "
        "tier, beam search or parallel ranks with it yet",
        Bool(),
    )

    @classmethod
    def _qualified(cls, name: str) -> str:
        return (
            name
            if name in ("max_tokens", "free_memory_fraction", "tokens_per_block")
            else f"KvCacheConfig.{name}"
        )

    def _validate(self) -> None:
        tpb = self.tokens_per_block
        if tpb & (tpb - 1):  # the attention kernels index blocks with shifts and masks
            raise ValueError(f"tokens_per_block must be a power of two >= 1, got {tpb!r}")
        if self.sliding_window_pools and self.host_cache_size:
            raise ValueError(
                f"KvCacheConfig.sliding_window_pools=True cannot be combined with host_cache_size "
                f"({self.host_cache_size}): the sliding-window pools have no secondary tier yet"
            )
        path = self.host_cache_path
        if path is not None:
            if not isinstance(path, (str, os.PathLike)) or not str(path):
                raise ValueError(f"KvCacheConfig.host_cache_path must be None or a file path, got {path!r}")
            object.__setattr__(self, "host_cache_path", os.fspath(path))
            if not self.host_cache_size:
                raise ValueError(
                    f"KvCacheConfig.host_cache_path={self.host_cache_path!r} needs KvCacheConfig.host_cache_size "
                    f"(the tier's size in bytes), got {self.host_cache_size!r}"
                )


PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig(_Args):
    """Scheduling policies (enums of :mod:`inflight.batch_manager` or their names)."""

    capacity_scheduler_policy: CapacitySchedulerPolicy | str = arg(
        CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
        "who may hold KV memory: GUARANTEED_NO_EVICT, MAX_UTILIZATION (may pause requests), STATIC_BATCH",
        EnumRule(CapacitySchedulerPolicy),
        flag="--capacity-scheduler-policy",
    )
    context_chunking_policy: ContextChunkingPolicy | str = arg(
        ContextChunkingPolicy.FIRST_COME_FIRST_SERVED,
        "how chunked prefill splits the token budget: FIRST_COME_FIRST_SERVED, EQUAL_PROGRESS",
        EnumRule(ContextChunkingPolicy),
        flag="--context-chunking-policy",
    )
    preemption_mode: str = arg(
        "recompute",
        "what a request paused under MAX_UTILIZATION does with its KV: recompute (freed, prefilled again "
        "later) or swap (moved to the secondary tier of KvCacheConfig.host_cache_size and back, its "
        "position kept; recompute when the tier is full)",
        Choice(PREEMPTION_MODES),
        flag="--preemption-mode",
    )


SPECULATIVE_METHODS = ("ngram", "draft_model")
# Most draft tokens per step: a verification row is 1 + k tokens, and past ~16 drafts almost none
# survive (each must match); the bound also keeps a hostile config from inflating every step.
MAX_DRAFT_LEN = 32


@dataclass(frozen=True)
class SpeculativeConfig(_Args):
    """Speculative decoding (off unless ``method`` is set): a drafter proposes up to ``max_draft_len``
    tokens per generation step, the model scores them all in one forward, and the longest prefix the
    model agrees with (plus the model's own next token) is kept. Greedy and seeded outputs are the
    same as without speculation; only the speed changes.

    ``method``: ``ngram`` (prompt lookup: the last ``prompt_lookup_min``..``prompt_lookup_max``
    tokens matched earlier in the prompt or output, and what followed them proposed) or
    ``draft_model`` (a smaller model with the same tokenizer, ``draft_model``). TensorRT-LLM's name
    ``max_draft_len``; vLLM's ``prompt_lookup_min`` / ``prompt_lookup_max``.
    """

    _cli_prefix: ClassVar[str] = "speculative-"

    method: str | None = arg(
        None,
        "speculative decoding: ngram (prompt lookup) or draft_model (needs --draft-model); off by default",
        Choice(SPECULATIVE_METHODS, optional=True),
        flag="--speculative-method",
    )
    max_draft_len: int = arg(
        4,
        "most draft tokens proposed per step (adapted per request to what gets accepted)",
        Int(1, MAX_DRAFT_LEN),
        flag="--max-draft-len",
    )
    prompt_lookup_min: int = arg(1, "ngram: shortest suffix matched", Int(1, 64), flag="--prompt-lookup-min")
    prompt_lookup_max: int = arg(4, "ngram: longest suffix matched", Int(1, 64), flag="--prompt-lookup-max")
    draft_model: str | None = arg(
        None,
        "draft_model: the draft model (HF directory, .gguf file or known name) with the target's tokenizer",
        flag="--draft-model",
    )

    @classmethod
    def _qualified(cls, name: str) -> str:
        return f"SpeculativeConfig.{name}"

    def _validate(self) -> None:
        if self.draft_model is not None and not isinstance(self.draft_model, str):
            object.__setattr__(self, "draft_model", str(self.draft_model))  # a PathLike
        if self.method is None and self.draft_model is not None:
            object.__setattr__(self, "method", "draft_model")  # --draft-model alone means that
        if self.method == "draft_model" and self.draft_model is None:
            raise ValueError(
                "SpeculativeConfig.draft_model is required with method='draft_model' (a model directory, "
                ".gguf file or known name), got None"
            )
        if self.method == "ngram" and self.draft_model is not None:
            raise ValueError(
                f"SpeculativeConfig.draft_model must be None with method='ngram', got {self.draft_model!r}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"SpeculativeConfig.prompt_lookup_min must be <= prompt_lookup_max={self.prompt_lookup_max}, "
                f"got {self.prompt_lookup_min}"
            )

    @property
    def enabled(self) -> bool:
        return self.method is not None


QUANTIZATION_MODES = ("auto", "gguf", "none")
ACTIVATION_QUANTIZATIONS = ("auto", "none", "int8", "int16")
ATTENTION_BACKENDS = ("native", "torch")


@dataclass(frozen=True)
class LlmArgs(_Args):
    """Everything ``LLM(model, ...)`` accepts (frozen, validated on construction).

    Values found at run time (the KV pool's size, a reduced ``max_seq_len``) are not written back
    here: the executor factory returns them.
    """

    model: str = arg("smollm2", "a Hugging Face model directory, a .gguf file, or a known name", cli=False)
    dtype: str | torch.dtype = arg(
        "auto",
        "auto (the checkpoint's; float16 becomes bfloat16 on a CPU), float32, bfloat16, float16; for "
        "natively quantised weights, the activation dtype",
        DType(),
    )
    quantization: str | None = arg(
        None,
        "GGUF 4-bit weights: auto (native with dtype auto on a CPU, else dequantised), gguf (always "
        "native; dtype is the activation dtype, as vLLM runs GGUF files), none (always dequantised)",
        Choice(QUANTIZATION_MODES, optional=True),
    )
    activation_quantization: str | None = arg(
        None,
        "int8: natively quantised linear layers (GGUF, `inflight quantize`) quantise their input to int8 per "
        "group of 32 and multiply in integers (VNNI), as llama.cpp does: 3-4x faster GEMMs on an AVX512-VNNI "
        "CPU, close to but not bit-equal with the float activations; int16: the same with 16-bit codes (two "
        "int8 limbs: ~15 bits per group, GEMM relative error ~2e-5, SmolLM2's perplexity unchanged to 1e-5), "
        "1.5-2x faster than float activations from 4 rows; none: activations in dtype; auto (default): int16 "
        "where the CPU has AVX512-VNNI and the model natively quantised layers, else none. CPU only",
        Choice(ACTIVATION_QUANTIZATIONS, optional=True),
    )
    kv_cache_config: KvCacheConfig = arg(None, "the KV cache", Config(KvCacheConfig))
    # TensorRT-LLM's name. llguidance is the `structured` extra; xgrammar is optional (pip install xgrammar).
    guided_decoding_backend: str = arg(
        "llguidance",
        "structured output's grammar backend: llguidance, or xgrammar (when installed)",
        Choice(("llguidance", "xgrammar")),
    )
    scheduler_config: SchedulerConfig = arg(None, "the scheduling policies", Config(SchedulerConfig))
    speculative_config: SpeculativeConfig = arg(
        None, "speculative decoding (off by default)", Config(SpeculativeConfig)
    )
    max_batch_size: int = arg(256, "most requests in one forward", Int(1))
    max_num_tokens: int = arg(8192, "most tokens in one forward", Int(1))
    max_seq_len: int | None = arg(
        None,
        "prompt + output limit (default: the model's max_position_embeddings, reduced to what the KV "
        "pool holds)",
        Int(2, optional=True),
    )
    enable_chunked_prefill: bool = arg(False, "split long prompts over several steps", Bool())
    batch_invariant: bool = arg(
        True,
        "batch-invariant CPU kernels: a request's tokens and logprobs do not depend on the requests "
        "beside it, the prefill chunking or prefix reuse (off: the faster row-count-dependent kernel "
        "strategies; process-wide, like the kernels' ISA)",
        Bool(),
    )
    disable_overlap_scheduler: bool | None = arg(
        None,
        "run each step's host work after its forward instead of beside the next one (default: on a CPU)",
        Bool(optional=True),
    )
    scheduler: Any = arg(
        None,
        "a RequestScheduler, or a factory f(kv_cache_manager=, max_batch_size=, "
        "max_num_tokens=) returning one",
        Scheduler(),
        cli=False,
    )
    seed: int = arg(0, "seed of the requests without a seed of their own", Int(0, 2**63 - 1))
    attention_backend: str | None = arg(
        None,
        "native (C++ / CUDA kernels over the paged cache; the default) or torch (the plain-torch reference)",
        Choice(ATTENTION_BACKENDS, optional=True),
    )
    device: str | torch.device | None = arg(
        None, "cpu, cuda, cuda:1 ... (default: CUDA when available)", Device()
    )
    tensor_parallel_size: int = arg(
        1,
        "tensor-parallel ranks, one process each (this one is rank 0 and starts the others; under torchrun "
        "every rank runs the script)",
        Int(1),
    )
    pipeline_parallel_size: int = arg(
        1, "pipeline-parallel stages (layers split evenly; up to this many micro-batches in flight)", Int(1)
    )
    parallel_timeout: float = arg(
        120.0,
        "seconds a rank of a parallel engine waits for the others (start-up, each collective) before failing",
        Float(0.0, 86400.0, lo_open=True),
    )
    log_iteration_stats: int = arg(0, "log one line of engine stats every N iterations (0: off)", Int(0))
    # Bounds on the work one request may ask for (a public server meets hostile input).
    max_n: int = arg(128, "most sequences (n) one request may ask for", Int(1))
    # TensorRT-LLM's name. A beam request decodes K rows a step and holds K beams' KV blocks.
    max_beam_width: int = arg(8, "most beams (best_of) one beam-search request may keep", Int(1))
    # vLLM's default: top-N beyond 20 costs a large top-k per step for little use.
    max_logprobs: int = arg(20, "most top log-probabilities per token one request may ask for", Int(0))
    max_request_tokens: int | None = arg(
        None,
        "most tokens one request may ask to generate in all, n x max_tokens (a request without max_tokens "
        "counts what fits in max_seq_len; default: no bound beyond max_n and max_seq_len)",
        Int(1, optional=True),
    )
    max_prompt_bytes: int | None = arg(
        None,
        "most UTF-8 bytes of a text prompt (or of a conversation's contents), checked before tokenising "
        "(default: 16 x max_seq_len)",
        Int(1, optional=True),
    )

    def _validate(self) -> None:
        if not isinstance(self.model, str):
            object.__setattr__(self, "model", str(self.model))  # a PathLike
        tpb = self.kv_cache_config.tokens_per_block
        if self.enable_chunked_prefill and self.max_num_tokens < tpb:
            # A context chunk is a whole number of KV blocks (or a prompt's last piece): with a smaller
            # token budget no chunk of a longer prompt could ever be scheduled.
            raise ValueError(
                f"max_num_tokens must be >= KvCacheConfig.tokens_per_block ({tpb}) with "
                f"enable_chunked_prefill=True (a context chunk is a whole number of KV blocks), got "
                f"{self.max_num_tokens}"
            )
        if self.scheduler_config.preemption_mode == "swap" and not self.kv_cache_config.host_cache_size:
            # No default tier: it would commit host memory (or disk) nobody asked for.
            raise ValueError(
                "SchedulerConfig.preemption_mode='swap' needs KvCacheConfig.host_cache_size (bytes of the "
                f"secondary tier paused requests move to), got {self.kv_cache_config.host_cache_size!r}"
            )
        parallel = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.kv_cache_config.host_cache_size and parallel > 1:
            raise ValueError(
                "KvCacheConfig.host_cache_size (a secondary KV tier) is not supported by a parallel engine yet "
                f"(tensor_parallel_size={self.tensor_parallel_size}, pipeline_parallel_size="
                f"{self.pipeline_parallel_size}): the ranks' pools have no secondary tier; got "
                f"{self.kv_cache_config.host_cache_size}"
            )

    @classmethod
    def from_kwargs(cls, model: Any, **kwargs: Any) -> LlmArgs:
        """``LLM(model, **kwargs)``: an unknown keyword is a ValueError that lists the accepted ones."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "model"]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"unknown LLM argument(s): {', '.join(unknown)} (accepted: {', '.join(names)})")
        return cls(model=model, **kwargs)

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace, **overrides: Any) -> LlmArgs:
        """The arguments :func:`add_cli_arguments` parsed (``overrides`` win, e.g. ``model``)."""
        values = vars(namespace)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            rule = f.metadata.get("rule")
            if isinstance(rule, Config):
                nested = {
                    g.name: _parsed(g, values[dest])
                    for g, _, dest in _cli_fields(rule.config_cls, rule.config_cls._cli_prefix)
                    if dest in values
                }
                kwargs[f.name] = rule.config_cls(**nested)
        for f, _, dest in _cli_fields(cls, ""):
            if dest in values:
                kwargs[f.name] = _parsed(f, values[dest])
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_kwargs(self) -> dict[str, Any]:
        """Every field as a keyword (``model`` included): ``LLM(**args.to_kwargs())``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """``dtype`` as a torch dtype (None for "auto")."""
        return FLOAT_DTYPES.get(self.dtype)


# ---------------------------------------------------------------------------------------------- CLI


def _cli_option(f: dataclasses.Field, prefix: str) -> tuple[str, str]:
    """The field's flag and argparse dest; the dest is the flag's name, so that the namespace reads
    like the command line."""
    flag = f.metadata["flag"] or "--" + (prefix + f.name).replace("_", "-")
    return flag, flag.removeprefix("--").replace("-", "_")


def _cli_fields(cls: type, prefix: str) -> Iterator[tuple[dataclasses.Field, str, str]]:
    """(field, flag, argparse dest) of every command-line field of ``cls`` (not the nested configs)."""
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") and not isinstance(f.metadata.get("rule"), Config):
            yield (f, *_cli_option(f, prefix))


def _parsed(f: dataclasses.Field, value: Any) -> Any:
    """The field's value from its parsed option (a negated flag's True is the field's False)."""
    return not value if f.metadata["negate"] else value


def _add_field(group, f: dataclasses.Field, flag: str, dest: str, defaults: dict[str, Any]) -> None:
    meta = f.metadata
    rule: Rule = meta["rule"]
    default = defaults.get(f.name, f.default)
    if isinstance(rule, Bool):
        if meta["negate"]:
            group.add_argument(flag, dest=dest, action="store_true", help="turn off " + meta["help"])
        else:
            # --flag / --no-flag; absent, the field's own default (None means "decide").
            shown = "" if default is None else f" (default: {'on' if default else 'off'})"
            group.add_argument(
                flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=meta["help"] + shown,
            )
        return
    default = default.name if isinstance(rule, EnumRule) else default
    kwargs: dict[str, Any] = {"dest": dest, "default": default, "help": meta["help"]}
    if rule.cli_type is not None:
        kwargs["type"] = rule.cli_type
    if rule.choices is not None and not isinstance(rule, EnumRule):
        kwargs["choices"] = rule.choices
    elif rule.metavar is not None:
        kwargs["metavar"] = rule.metavar
    if default is not None:
        kwargs["help"] += f" (default: {default})"
    group.add_argument(flag, **kwargs)


def add_cli_arguments(
    parser: argparse.ArgumentParser,
    title: str = "engine",
    args_cls: type[LlmArgs] = LlmArgs,
    defaults: dict[str, Any] | None = None,
) -> None:
    """Adds one option per :class:`LlmArgs` field (nested configs flattened) to a group named
    ``title``; read back with :meth:`LlmArgs.from_cli`. The model itself is the command's own
    argument (``inflight serve MODEL``, ``inflight generate --model``). ``args_cls``: a subclass with
    more fields (their options come with them). ``defaults``: field name -> this command's default
    (``inflight serve`` has a public server's)."""
    defaults = defaults or {}
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(args_cls):
        rule = f.metadata.get("rule")
        if isinstance(rule, Config):
            for g, flag, dest in _cli_fields(rule.config_cls, rule.config_cls._cli_prefix):
                _add_field(group, g, flag, dest, defaults)
        elif f.metadata.get("cli"):
            _add_field(group, f, *_cli_option(f, ""), defaults)
