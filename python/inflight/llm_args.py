"""Configuration objects of the LLM API (frozen, validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.batch_manager import CapacitySchedulerPolicy, ContextChunkingPolicy

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(value: str | torch.dtype, name: str = "dtype", allow_auto: bool = True) -> torch.dtype | None:
    """A torch dtype from a name or dtype; None for "auto" (when allowed)."""
    if isinstance(value, torch.dtype):
        if value in (torch.float32, torch.bfloat16, torch.float16):
            return value
    elif isinstance(value, str):
        key = value.lower().removeprefix("torch.")
        if key == "auto" and allow_auto:
            return None
        if key in _DTYPES:
            return _DTYPES[key]
    allowed = "'auto', " if allow_auto else ""
    raise ValueError(
        f"{name} must be {allowed}'float32', 'bfloat16', 'float16' (or fp32/bf16/fp16, or a torch dtype), "
        f"got {value!r}"
    )


def _enum(value, enum_cls, name: str):
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str) and value.upper() in enum_cls.__members__:
        return enum_cls[value.upper()]
    raise ValueError(f"{name} must be one of {', '.join(enum_cls.__members__)}, got {value!r}")


@dataclass(frozen=True)
class KvCacheConfig:
    """Size and behaviour of the paged KV cache.

    ``free_memory_fraction`` follows TensorRT-LLM: the fraction of the memory that is *free after the
    weights are loaded* (and, on a GPU, after a warm-up forward) given to the KV pool — not vLLM's
    fraction of the total memory. On a CPU the pool is further capped at a few GiB (and by the
    container's memory limit) and is allocated lazily. ``max_tokens`` caps the pool in tokens either
    way. ``dtype="auto"`` stores KV in the model's dtype.
    """

    max_tokens: int | None = None
    free_memory_fraction: float = 0.9
    tokens_per_block: int = 32
    enable_block_reuse: bool = True
    dtype: str | torch.dtype = "auto"

    def __post_init__(self):
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.free_memory_fraction, (int, float)) or not 0.0 < self.free_memory_fraction <= 1.0:
            raise ValueError(f"free_memory_fraction must be in (0, 1], got {self.free_memory_fraction!r}")
        tpb = self.tokens_per_block
        if isinstance(tpb, bool) or not isinstance(tpb, int) or tpb < 1 or tpb & (tpb - 1):
            # The attention kernels index blocks with shifts and masks.
            raise ValueError(f"tokens_per_block must be a power of two >= 1, got {tpb!r}")
        if not isinstance(self.enable_block_reuse, bool):
            raise ValueError(f"enable_block_reuse must be a bool, got {self.enable_block_reuse!r}")
        parse_dtype(self.dtype, "KvCacheConfig.dtype")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling policies (enums of :mod:`inflight.batch_manager` or their names)."""

    capacity_scheduler_policy: CapacitySchedulerPolicy | str = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    context_chunking_policy: ContextChunkingPolicy | str = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED

    def __post_init__(self):
        object.__setattr__(
            self,
            "capacity_scheduler_policy",
            _enum(self.capacity_scheduler_policy, CapacitySchedulerPolicy, "capacity_scheduler_policy"),
        )
        object.__setattr__(
            self,
            "context_chunking_policy",
            _enum(self.context_chunking_policy, ContextChunkingPolicy, "context_chunking_policy"),
        )
