"""Attention over the paged KV cache: the metadata object and the backend interface.

The executor builds one :class:`AttentionMetadata` per step and the model hands it, unchanged, to
its attention backend in every layer. The batch is flattened: no padding between sequences.
Sequences ``0 .. num_contexts-1`` are context chunks (many query tokens each), the rest are decode
steps (one query token each, or ``1 + draft`` tokens). Token ``t`` of the flattened batch belongs to
the sequence ``i`` with ``cu_seqlens[i] <= t < cu_seqlens[i+1]`` and sits at ``positions[t]``.

KV cache layout, one tensor per layer: ``[2, num_blocks, tokens_per_block, num_kv_heads, head_dim]``
(index 0 = K, 1 = V). Token ``p`` of a sequence lives in block ``block_tables[i, p // tpb]`` at
offset ``p % tpb``; ``slot_mapping[t] = block_id * tpb + offset`` is where this step's token ``t``
is written.

A layer's cache is that tensor in a float dtype, an :class:`Int8KvCache` (``KvCacheConfig(dtype=
"int8")``): int8 codes in the same layout plus one fp32 scale per token per KV head, or an
:class:`Fp8KvCache` (``KvCacheConfig(dtype="fp8")``): FP8 E4M3 bytes in the same layout and one scale
per tensor for K and for V. Backends take any of them (``KvCacheLike``).

INT8 key rotation: over an INT8 cache a layer rotates each query and key head by the same orthogonal
Walsh-Hadamard matrix before the keys are stored (:func:`key_rotation_matrices`), so ``q . k`` is what
it was while each key row's one scale no longer follows its few largest channels alone.
"""

from __future__ import annotations

import abc
import functools
import os
from dataclasses import dataclass

import torch

# The rotation INT8 KV keys carry: recorded by a persistent KV tier (its codes are rotated keys), so a
# cache written under another rule is not adopted.
KEY_ROTATION_VERSION = "hadamard-v1"
KEY_ROTATION_MAX_BLOCK = 128


def key_rotation_enabled() -> bool:
    """INT8 KV key rotation, on unless ``INFLIGHT_KV_KEY_ROTATION=0`` (kept for comparisons)."""
    return os.environ.get("INFLIGHT_KV_KEY_ROTATION", "1").strip().lower() not in ("0", "false", "off", "no")


def key_rotation_mode() -> str:
    """:data:`KEY_ROTATION_VERSION`, or ``"off"`` under ``INFLIGHT_KV_KEY_ROTATION=0``."""
    return KEY_ROTATION_VERSION if key_rotation_enabled() else "off"


def key_rotation_block(head_dim: int) -> int:
    """The Walsh-Hadamard block of a head: the largest power of two dividing ``head_dim``, at most
    :data:`KEY_ROTATION_MAX_BLOCK` (64 for head_dim 64, 32 for 96, 128 for 128 and 256)."""
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    return min(head_dim & -head_dim, KEY_ROTATION_MAX_BLOCK)


def key_rotation_shifts(block: int) -> tuple[int, int]:
    """``(a, b)``: queries are scaled by ``2**-a`` and keys by ``2**-b`` after the unnormalised
    transform (``H H^T = block * I``), ``a + b = log2(block)``, so ``(H q / 2**a) . (H k / 2**b) = q . k``
    with scalings that round nothing."""
    log = block.bit_length() - 1
    return (log + 1) // 2, log // 2


@functools.lru_cache(maxsize=16)
def key_rotation_matrices(
    head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_mat, k_mat)`` ``[head_dim, head_dim]`` in ``dtype``: ``q @ q_mat`` and ``k @ k_mat`` rotate
    each head in blocks of :func:`key_rotation_block` by the Sylvester Hadamard matrix, scaled by
    :func:`key_rotation_shifts` (entries +-2**-a and +-2**-b, exact in every float dtype).

    Why: an INT8 cache stores each key row with one scale, ``max |k| / 127``; RoPE'd keys have a few
    channels much larger than the rest, so most channels get a coarse step and ``q . k`` loses precision.
    The rotation spreads each large channel over the whole block (SmolLM2: half the log-likelihood
    noise of an unrotated INT8 cache); queries rotate the same way, so attention is unchanged but for
    rounding."""
    block = key_rotation_block(head_dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    a, b = key_rotation_shifts(block)
    full = torch.block_diag(*([h] * (head_dim // block)))
    # Transposed: x @ m applies H (symmetric) to each row x.
    return (full * 2.0**-a).to(dtype=dtype, device=device), (full * 2.0**-b).to(dtype=dtype, device=device)


@dataclass(frozen=True, eq=False)
class Int8KvCache:
    """One layer's INT8 KV cache: ``kv`` int8 ``[2, num_blocks, tokens_per_block, num_kv_heads,
    head_dim]`` (the float cache's layout) and ``scales`` float32 ``[2, num_blocks, tokens_per_block,
    num_kv_heads]``. Code ``kv[i, b, o, h, d]`` stands for ``kv[i, b, o, h, d] * scales[i, b, o, h]``:
    symmetric, one scale per token and KV head, ``max |x| / 127`` over the row's head_dim values, set
    when the token is stored (no calibration). Both tensors are views into the engine's pool (written
    in place), so this object is immutable and cheap."""

    kv: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        if self.kv.dtype != torch.int8 or self.kv.dim() != 5 or self.kv.shape[0] != 2:
            raise ValueError(
                "Int8KvCache.kv must be int8 [2, num_blocks, tokens_per_block, num_kv_heads, head_dim], "
                f"got {self.kv.dtype} {list(self.kv.shape)}"
            )
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != tuple(self.kv.shape[:4]):
            raise ValueError(
                f"Int8KvCache.scales must be float32 {list(self.kv.shape[:4])} (kv's shape without head_dim), "
                f"got {self.scales.dtype} {list(self.scales.shape)}"
            )
        if self.scales.device != self.kv.device:
            raise ValueError(f"Int8KvCache.scales is on {self.scales.device}, kv on {self.kv.device}")

    @property
    def shape(self) -> torch.Size:
        return self.kv.shape

    @property
    def device(self) -> torch.device:
        return self.kv.device


# The largest finite FP8 E4M3 (e4m3fn) value: stores saturate to it.
FP8_E4M3_MAX = 448.0


@dataclass(frozen=True, eq=False)
class Fp8KvCache:
    """One layer's FP8 KV cache: ``kv`` uint8 ``[2, num_blocks, tokens_per_block, num_kv_heads,
    head_dim]`` (the float cache's layout) holding OCP FP8 E4M3 (e4m3fn) bytes, and one scale per
    tensor: element ``x`` of K is stored as ``e4m3(x / k_scale)`` (round to nearest even, saturated to
    +-448, as ``(x / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn)``) and read as
    ``kv.view(torch.float8_e4m3fn).float() * k_scale``; V likewise with ``v_scale``. No per-token
    scales, no calibration (1.0 by default: K and V of these models are far inside +-448). uint8, not
    float8_e4m3fn, because torch's CPU kernels lack ``index_copy_`` and others for float8; :attr:`values`
    is the float8 view. ``kv`` is a view into the engine's pool (written in place)."""

    kv: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kv.dtype != torch.uint8 or self.kv.dim() != 5 or self.kv.shape[0] != 2:
            raise ValueError(
                "Fp8KvCache.kv must be uint8 (E4M3 bytes) [2, num_blocks, tokens_per_block, num_kv_heads, "
                f"head_dim], got {self.kv.dtype} {list(self.kv.shape)}"
            )
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not (0.0 < float(value) < float("inf")):
                raise ValueError(f"Fp8KvCache.{name} must be a finite float > 0, got {value!r}")

    @property
    def values(self) -> torch.Tensor:
        """``kv`` as ``torch.float8_e4m3fn`` (the same memory)."""
        return self.kv.view(torch.float8_e4m3fn)

    @property
    def shape(self) -> torch.Size:
        return self.kv.shape

    @property
    def device(self) -> torch.device:
        return self.kv.device


# One layer's KV cache as the backends take it.
KvCacheLike = torch.Tensor | Int8KvCache | Fp8KvCache


@dataclass(frozen=True)
class AttentionMetadata:
    num_contexts: int
    num_tokens: int
    tokens_per_block: int
    seq_lens: torch.Tensor  # [batch] int32: query tokens of each sequence in this step
    cu_seqlens: torch.Tensor  # [batch + 1] int32: prefix sums of seq_lens
    kv_lens: torch.Tensor  # [batch] int32: tokens in KV after this step (cached + this step's)
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [batch, max_blocks] int32 (unused entries 0)
    logits_indices: torch.Tensor  # [num_logits] int64: flattened tokens whose logits are returned
    # Host copies (Python ints), so backends need no device->host sync to plan their work.
    seq_lens_host: tuple[int, ...]
    kv_lens_host: tuple[int, ...]
    # VSWA (KvCacheConfig.sliding_window_pools): window -> this metadata with the block tables and
    # slot mapping of that window's own pool, for its layers (for_window). None: one pool.
    window_metadata: dict[int, AttentionMetadata] | None = None

    def for_window(self, window: int) -> AttentionMetadata:
        """The metadata of the layers of ``window`` (0: global layers): this one, or that window's pool's."""
        if self.window_metadata is None:
            return self
        return self.window_metadata.get(window, self)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_generations(self) -> int:
        return self.batch_size - self.num_contexts

    @property
    def max_q_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens_host, default=0)

    def check(self) -> None:
        """Raises ValueError when the host lengths are inconsistent (backends call it once per step)."""
        if sum(self.seq_lens_host) != self.num_tokens:
            raise ValueError(
                f"seq_lens sum to {sum(self.seq_lens_host)}, but num_tokens is {self.num_tokens}"
            )
        for i, (s, k) in enumerate(zip(self.seq_lens_host, self.kv_lens_host)):
            if s < 1 or k < s:
                raise ValueError(f"sequence {i}: need 1 <= seq_len <= kv_len, got seq_len={s}, kv_len={k}")


class AttentionBackend(abc.ABC):
    """Stores this step's K/V into the paged cache, then attends over the cache (causally)."""

    name: str = "abstract"

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: KvCacheLike,  # [2, num_blocks, tokens_per_block, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Query token ``t`` at position ``p`` attends to its sequence's tokens ``0..p``; with a
        ``window`` W > 0 (a sliding-window layer) only to ``p-W+1..p``, transformers' convention."""
