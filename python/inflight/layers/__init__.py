"""Model building blocks: attention backends over the paged KV cache, linear, rotary, norm."""

from __future__ import annotations

from inflight.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    Fp8KvCache,
    Int8KvCache,
    KvCacheLike,
)
from inflight.layers.linear import Linear, LinearFactory
from inflight.layers.norm import RMSNorm, rms_norm
from inflight.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq
from inflight.layers.torch_attention import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "Fp8KvCache",
    "Int8KvCache",
    "KvCacheLike",
    "Linear",
    "LinearFactory",
    "RMSNorm",
    "RotaryEmbedding",
    "TorchAttentionBackend",
    "apply_rotary",
    "compute_inv_freq",
    "rms_norm",
]
