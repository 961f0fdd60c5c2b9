"""NativeAttentionBackend: attention over the paged KV cache by the C++ / CUDA kernels.

Per layer: ``store_kv`` (this step's K/V into the cache, in place), then ``context_attention`` over
the context chunks (sequences ``0 .. num_contexts-1``, reading earlier chunks and reused prefix
blocks straight from the cache) and ``paged_attention`` over the decodes, both writing into one
preallocated ``[num_tokens, num_heads, head_dim]`` output. No Python loop over sequences.

A decode step that carries more than one query token (``1 + draft`` tokens) goes through
``context_attention``, which handles any query length: the executor puts those rows right after the
context chunks, so the single-token decodes after them stay on ``paged_attention`` (a multi-token
row among them sends everything from the first context on through ``context_attention``).

The per-step argument slices depend only on the metadata, so they are built once per step (by the
first layer to see a metadata object) and reused by the other layers (a sliding-window layer passes
its ``window`` to both kernels, which then read only the window's keys), as in
:class:`~inflight.layers.torch_attention.TorchAttentionBackend`.

An :class:`~inflight.layers.attention.Int8KvCache` goes to the same kernels with its scales: the store
quantises, the attention kernels dequantise as they read; q and the output keep the model's dtype.
An :class:`~inflight.layers.attention.Fp8KvCache` likewise, with its per-tensor ``k_scale`` and
``v_scale`` (E4M3 bytes written by the store, widened exactly by the attention kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    Fp8KvCache,
    Int8KvCache,
    KvCacheLike,
)
from inflight.ops.attention import context_attention, paged_attention, store_kv


@dataclass(frozen=True)
class KernelPlan:
    """One step's arguments of the attention kernels, sliced from the metadata once per step."""

    num_context_tokens: int  # flattened tokens 0 .. num_context_tokens-1 go to context_attention
    # context_attention's arguments (None: no context work this step)
    ctx_block_tables: torch.Tensor | None
    ctx_cu_seqlens: torch.Tensor | None
    ctx_kv_lens: torch.Tensor | None
    # paged_attention's arguments (None: no single-token decodes this step)
    dec_block_tables: torch.Tensor | None
    dec_kv_lens: torch.Tensor | None


def plan_kernels(metadata: AttentionMetadata) -> KernelPlan:
    """Splits the step into the context_attention part and the paged_attention part."""
    metadata.check()
    nc, bs = metadata.num_contexts, metadata.batch_size
    lens = metadata.seq_lens_host
    # Multi-token decodes (drafts) go with the context chunks: up to the last of them.
    multi = [i for i in range(nc, bs) if lens[i] != 1]
    if multi:
        nc = multi[-1] + 1
    num_ctx_tokens = sum(metadata.seq_lens_host[:nc])
    i32 = torch.int32
    ctx = dec = (None, None)
    cu = None
    if nc > 0:
        ctx = (metadata.block_tables[:nc].to(i32).contiguous(), metadata.kv_lens[:nc].to(i32).contiguous())
        cu = metadata.cu_seqlens[: nc + 1].to(i32).contiguous()
    if nc < bs:
        dec = (metadata.block_tables[nc:].to(i32).contiguous(), metadata.kv_lens[nc:].to(i32).contiguous())
    return KernelPlan(num_ctx_tokens, ctx[0], cu, ctx[1], dec[0], dec[1])


class NativeAttentionBackend(AttentionBackend):
    name = "native"

    def __init__(self) -> None:
        # One-entry memo (metadata object, its plan); identity, not id(), so reuse cannot fool it.
        self._planned_for: AttentionMetadata | None = None
        self._plan: KernelPlan | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KvCacheLike,
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        if self._planned_for is not metadata:
            self._plan, self._planned_for = plan_kernels(metadata), metadata
        plan = self._plan
        dtype = q.dtype
        scales = None
        ks = vs = 1.0
        if isinstance(kv_cache, Int8KvCache):  # the kernels quantise and dequantise; q stays as it is
            kv_cache, scales = kv_cache.kv, kv_cache.scales
        elif isinstance(kv_cache, Fp8KvCache):  # likewise, with one scale per tensor
            kv_cache, ks, vs = kv_cache.kv, kv_cache.k_scale, kv_cache.v_scale
        elif kv_cache.dtype != dtype:  # a cache kept in another dtype: the kernels run in the cache's
            q, k, v = q.to(kv_cache.dtype), k.to(kv_cache.dtype), v.to(kv_cache.dtype)
        store_kv(k, v, kv_cache, metadata.slot_mapping, scales, ks, vs)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        n = plan.num_context_tokens
        if plan.ctx_block_tables is not None:
            qc, oc = (q, out) if n == q.shape[0] else (q[:n], out[:n])
            context_attention(
                qc,
                kv_cache,
                plan.ctx_block_tables,
                plan.ctx_cu_seqlens,
                plan.ctx_kv_lens,
                scale,
                oc,
                window=window,
                kv_scales=scales,
                k_scale=ks,
                v_scale=vs,
            )
        if plan.dec_block_tables is not None:
            qd, od = (q, out) if n == 0 else (q[n:], out[n:])
            paged_attention(
                qd,
                kv_cache,
                plan.dec_block_tables,
                plan.dec_kv_lens,
                scale,
                od,
                window=window,
                kv_scales=scales,
                k_scale=ks,
                v_scale=vs,
            )
        return out if out.dtype == dtype else out.to(dtype)
