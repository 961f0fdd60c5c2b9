"""Attention over the paged KV cache: typed wrappers over the C++ (CPU) and CUDA kernels.

KV cache layout, one tensor per layer: ``[2, num_blocks, tokens_per_block, num_kv_heads, head_dim]``
(index 0 = K, 1 = V); token ``p`` of sequence ``i`` lives at slot
``block_tables[i, p // tokens_per_block] * tokens_per_block + p % tokens_per_block``.

The cache has q's dtype (float32, bfloat16 or float16), or is int8 with ``kv_scales``
``[2, num_blocks, tokens_per_block, num_kv_heads]`` float32: one scale per token and KV head,
``max |x| / 127`` of that row, written by :func:`store_kv` as it quantises (round to nearest even) and
read by the attention ops, which dequantise as they read (INT8 KV cache). Or it holds FP8 E4M3 bytes
(uint8, or a ``torch.float8_e4m3fn`` tensor, passed as its bytes) with one scale per tensor,
``k_scale`` and ``v_scale`` (FP8 KV cache): :func:`store_kv` writes ``e4m3(x / scale)`` (nearest even,
saturated to +-448) and the attention ops read ``e4m3 * scale`` exactly. Accumulation is fp32. CPU tensors go to
:mod:`inflight._C` (threads = ``torch.get_num_threads()``), CUDA tensors to :mod:`inflight._C_cuda`
on the current stream. ``window`` (both attention ops): sliding-window attention as in transformers,
a query at position ``p`` sees only keys ``p - window < j <= p``; 0 means no window. q, k and v may be strided views (a slice of a fused qkv projection) as long as
head_dim is contiguous; ``out`` must be contiguous. Arguments are validated in C++ (errors name them).
Plain-torch twins: :mod:`inflight.ops.reference.attention`.

CPU tensors cross as DLPack capsules made by ``torch.utils.dlpack.to_dlpack`` (~0.3 us each) rather
than as tensors, whose ``__dlpack__`` is a Python-level method (~2.2 us each): the backend calls
these ops in every layer, so that is ~10 us a call, ~0.5 ms a 30-layer step. Same memory, no copy.
"""

from __future__ import annotations

import torch
from torch.utils.dlpack import to_dlpack as _dl

from inflight import _C
from inflight.cuda import require_cuda_module

__all__ = ["context_attention", "paged_attention", "store_kv"]


def _cuda_op(name: str):
    return getattr(require_cuda_module(), name)


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def _check_window(window: int) -> None:
    if type(window) is not int:  # not bool, not a float that nanobind would name vaguely
        raise TypeError(f"window must be an int >= 0 (0: no window), got {type(window).__name__}")


def _opt(t: torch.Tensor | None):
    return None if t is None else _dl(t)


def _bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """A float8_e4m3fn cache as its uint8 bytes (what the kernels take); any other cache as it is."""
    return kv_cache.view(torch.uint8) if kv_cache.dtype == torch.float8_e4m3fn else kv_cache


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``k``, ``v`` ``[num_tokens, num_kv_heads, head_dim]`` into ``kv_cache`` at
    ``slot_mapping`` ``[num_tokens]`` int64, in place; a negative slot skips its token (padding). An
    int8 ``kv_cache`` gets each (token, KV head) row quantised, its scale written to ``kv_scales``; an
    fp8 one (uint8 / float8_e4m3fn) gets ``e4m3(k / k_scale)`` and ``e4m3(v / v_scale)``."""
    kv_cache = _bytes(kv_cache)
    if k.is_cuda:
        _cuda_op("store_kv")(k, v, kv_cache, slot_mapping, _stream(k), kv_scales, k_scale, v_scale)
        return
    _C.store_kv(
        _dl(k),
        _dl(v),
        _dl(kv_cache),
        _dl(slot_mapping),
        torch.get_num_threads(),
        _opt(kv_scales),
        k_scale,
        v_scale,
    )


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    kv_scales: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Decode attention: ``q`` ``[batch, num_heads, head_dim]`` holds one query per sequence, which
    attends to its keys ``0 .. kv_lens[i]-1`` (``block_tables`` ``[batch, max_blocks]`` int32,
    ``kv_lens`` ``[batch]`` int32); with ``window > 0`` only to the last ``window`` of them (the keys
    before are not read). GQA when num_heads is a multiple of num_kv_heads. ``kv_scales``: with an
    int8 ``kv_cache``; ``k_scale``, ``v_scale`` with an fp8 one. Returns ``out`` ``[batch, num_heads,
    head_dim]`` (allocated when None)."""
    _check_window(window)
    kv_cache = _bytes(kv_cache)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.is_cuda:
        # No split-K workspace: one partition per (sequence, head); a caller that wants long
        # contexts split passes through the _C_cuda op with a workspace of
        # paged_attention_workspace_size(...) bytes.
        _cuda_op("paged_attention")(
            q,
            kv_cache,
            block_tables,
            kv_lens,
            scale,
            out,
            None,
            _stream(q),
            window,
            kv_scales,
            k_scale,
            v_scale,
        )
    else:
        _C.paged_attention(
            _dl(q),
            _dl(kv_cache),
            _dl(block_tables),
            _dl(kv_lens),
            scale,
            _dl(out),
            torch.get_num_threads(),
            window,
            _opt(kv_scales),
            k_scale,
            v_scale,
        )
    return out


def context_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    kv_scales: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Prefill / chunked-prefill attention over the paged cache. Sequence ``i``'s queries are rows
    ``cu_seqlens[i] .. cu_seqlens[i+1]-1`` of ``q`` ``[num_tokens, num_heads, head_dim]``, at
    positions ``kv_lens[i] - q_len_i + r``; each attends causally to the sequence's cached keys
    (earlier chunks and reused prefix blocks included; this step's K/V must already be stored), with
    ``window > 0`` only to keys ``position - window + 1 .. position``. ``cu_seqlens`` ``[batch + 1]``
    int32, ``kv_lens`` ``[batch]`` int32; ``kv_scales`` with an int8 ``kv_cache``, ``k_scale`` and
    ``v_scale`` with an fp8 one. Returns ``out`` ``[num_tokens, num_heads, head_dim]`` (allocated when
    None)."""
    _check_window(window)
    kv_cache = _bytes(kv_cache)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.is_cuda:
        _cuda_op("context_attention")(
            q,
            kv_cache,
            block_tables,
            cu_seqlens,
            kv_lens,
            scale,
            out,
            _stream(q),
            window,
            kv_scales,
            k_scale,
            v_scale,
        )
    else:
        _C.context_attention(
            _dl(q),
            _dl(kv_cache),
            _dl(block_tables),
            _dl(cu_seqlens),
            _dl(kv_lens),
            scale,
            _dl(out),
            torch.get_num_threads(),
            window,
            _opt(kv_scales),
            k_scale,
            v_scale,
        )
    return out
