"""TorchAttentionBackend: the plain-torch reference backend over the paged KV cache.

Per layer: store this step's K/V at ``slot_mapping`` (in place), then gather every sequence's
blocks into a padded ``[batch, max_kv_len]`` view and run one batched SDPA per sequence group with
a boolean mask. No Python loop over sequences runs per layer.

Groups: the context chunks (sequences ``0 .. num_contexts-1``) and the decode steps are attended in
two calls rather than one, because padding every decode query up to a long context chunk's length
would multiply the work by ``max_q_len`` for no output. Within a group queries are padded to the
group's longest.

The indices and masks depend only on the metadata, so they are built once per step (the first layer
to see a metadata object) and reused by the other layers: the backend keeps the last plan together
with a reference to its metadata object, so identity comparison cannot be fooled by id() reuse.

An :class:`~inflight.layers.attention.Int8KvCache` is written with the kernels' quantiser (the plain-
torch twin, :func:`inflight.ops.reference.attention.quantize_kv`: the same codes and scales) and read
dequantised to q's dtype, after which the attention is the float cache's. An
:class:`~inflight.layers.attention.Fp8KvCache` likewise: written with the kernels' encoder's twin
(:func:`~inflight.ops.reference.attention.quantize_kv_fp8`, the same bytes) and read as
``kv.view(torch.float8_e4m3fn).float() * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inflight.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    Fp8KvCache,
    Int8KvCache,
    KvCacheLike,
)
from inflight.ops.reference.attention import dequantize_kv, dequantize_kv_fp8, quantize_kv, quantize_kv_fp8

# SDPA grew enable_gqa in torch 2.5; older torches get repeat_interleave instead.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


# An int8 cache's flat scales, or an fp8 cache's (k_scale, v_scale); None for a float cache.
_Scales = torch.Tensor | tuple[float, float] | None


def _gather(
    flat: torch.Tensor, flat_scales: _Scales, slots: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """K and V of the flat ``slots`` in ``dtype`` (an int8 or fp8 cache dequantised): ``[2, len(slots),
    kvh, hd]``. index_select on the flat slot axis is a plain row gather (much cheaper than advanced
    indexing)."""
    kv = flat.index_select(1, slots)
    if isinstance(flat_scales, tuple):
        return torch.stack([dequantize_kv_fp8(kv[i], flat_scales[i], dtype) for i in range(2)])
    if flat_scales is not None:
        return dequantize_kv(kv, flat_scales.index_select(1, slots), dtype)
    return kv if kv.dtype == dtype else kv.to(dtype)


def _decode_attention(
    q: torch.Tensor, flat: torch.Tensor, flat_scales: _Scales, g: _GroupPlan, scale: float
) -> torch.Tensor:
    """One query token per sequence: two small batched matmuls instead of SDPA, whose CPU kernel
    spends milliseconds on a masked single-row query. GQA without copies: the query heads of one KV
    head form the rows of one matmul."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = flat.shape[2]
    group = num_heads // num_kv_heads
    max_kv = g.gather.shape[1]
    kv = _gather(flat, flat_scales, g.gather.reshape(-1), q.dtype).view(
        2, batch, max_kv, num_kv_heads, head_dim
    )
    key = kv[0].permute(0, 2, 3, 1)  # [batch, kvh, hd, max_kv]
    value = kv[1].transpose(1, 2)  # [batch, kvh, max_kv, hd]
    qh = q.view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(qh, key).float() * scale  # [batch, kvh, group, max_kv]
    if g.mask is not None:
        scores.masked_fill_(~g.mask.view(batch, 1, 1, max_kv), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, value).reshape(batch, num_heads, head_dim)


@dataclass(frozen=True)
class _GroupPlan:
    """Work for sequences ``seq_begin .. seq_end-1`` (flattened tokens ``tok_begin .. tok_end-1``)."""

    tok_begin: int
    tok_end: int
    batch: int
    max_q: int
    gather: torch.Tensor  # [batch, max_kv] int64: cache slot of each sequence's kv index j
    q_index: (
        torch.Tensor | None
    )  # [num_tokens_in_group] int64 rows of the padded [batch*max_q]; None: no padding
    mask: torch.Tensor | None  # [batch, 1, max_q, max_kv] bool (True = attend); None: attend to all
    is_causal: bool  # every sequence has q_len == kv_len == max_kv: SDPA's own causal mask is exact


def _plan_group(
    metadata: AttentionMetadata, seq_begin: int, seq_end: int, device: torch.device, window: int = 0
) -> _GroupPlan:
    seq_lens = metadata.seq_lens_host[seq_begin:seq_end]
    kv_lens = metadata.kv_lens_host[seq_begin:seq_end]
    batch = len(seq_lens)
    max_q, max_kv = max(seq_lens), max(kv_lens)
    tpb = metadata.tokens_per_block
    tok_begin = sum(metadata.seq_lens_host[:seq_begin])
    tok_end = tok_begin + sum(seq_lens)

    num_blocks = -(-max_kv // tpb)
    if metadata.block_tables.shape[1] < num_blocks:
        raise ValueError(
            f"block_tables has {metadata.block_tables.shape[1]} columns, but a kv_len of {max_kv} "
            f"needs {num_blocks} blocks of {tpb} tokens"
        )
    tables = metadata.block_tables[seq_begin:seq_end, :num_blocks].to(device=device, dtype=torch.int64)
    offsets = torch.arange(tpb, device=device, dtype=torch.int64)
    gather = (tables[:, :, None] * tpb + offsets).reshape(batch, num_blocks * tpb)[:, :max_kv]

    uniform_q = all(s == max_q for s in seq_lens)
    q_index = None
    if not uniform_q:
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        starts = torch.cumsum(lens, 0) - lens  # first flattened token of each sequence (group-local)
        row_base = torch.arange(batch, dtype=torch.int64) * max_q
        q_index = (torch.arange(tok_end - tok_begin) + torch.repeat_interleave(row_base - starts, lens)).to(
            device
        )

    all_full = all(k == max_kv for k in kv_lens)
    # A window that no query can exceed changes nothing (the plan of a global layer).
    if window and max_kv <= window:
        window = 0
    is_causal = all_full and max_q == max_kv and uniform_q and max_q > 1 and not window
    mask = None
    if not is_causal and not (all_full and max_q == 1 and not window):
        q_len = torch.tensor(seq_lens, dtype=torch.int64)
        kv_len = torch.tensor(kv_lens, dtype=torch.int64)
        # Query row r of sequence i sits at position kv_len - q_len + r. Padded rows (r >= q_len)
        # get positions >= kv_len, so they see all kv_len keys: never fully masked, no NaN.
        q_pos = (kv_len - q_len)[:, None] + torch.arange(max_q)[None, :]
        j = torch.arange(max_kv)
        mask = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_len[:, None, None])
        if window:  # a sliding window: only the last `window` positions up to the query's own
            mask &= j[None, None, :] > q_pos[:, :, None] - window
        mask = mask[:, None].to(device)
    return _GroupPlan(tok_begin, tok_end, batch, max_q, gather, q_index, mask, is_causal)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        # Memo of the step's plans by window (global layers: 0), for one metadata object; see the
        # module docstring.
        self._planned_for: AttentionMetadata | None = None
        self._plans: dict[int, tuple[_GroupPlan, ...]] = {}

    def _get_plan(
        self, metadata: AttentionMetadata, device: torch.device, window: int = 0
    ) -> tuple[_GroupPlan, ...]:
        if self._planned_for is not metadata:
            metadata.check()
            self._planned_for, self._plans = metadata, {}
        plan = self._plans.get(window)
        if plan is None:
            nc, bs = metadata.num_contexts, metadata.batch_size
            groups = [(b, e) for b, e in ((0, nc), (nc, bs)) if e > b]
            plan = self._plans[window] = tuple(_plan_group(metadata, b, e, device, window) for b, e in groups)
        return plan

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
        num_heads, head_dim = q.shape[1], q.shape[2]
        _, num_blocks, tpb, num_kv_heads, _ = kv_cache.shape
        flat_scales: _Scales = None
        if isinstance(kv_cache, Fp8KvCache):
            flat = kv_cache.kv.view(2, num_blocks * tpb, num_kv_heads, head_dim)
            flat_scales = (kv_cache.k_scale, kv_cache.v_scale)
            for i, x in enumerate((k, v)):
                flat[i].index_copy_(0, metadata.slot_mapping, quantize_kv_fp8(x, flat_scales[i]))
        elif isinstance(kv_cache, Int8KvCache):
            flat = kv_cache.kv.view(2, num_blocks * tpb, num_kv_heads, head_dim)
            flat_scales = kv_cache.scales.view(2, num_blocks * tpb, num_kv_heads)
            for i, x in enumerate((k, v)):
                codes, scales = quantize_kv(x)
                flat[i].index_copy_(0, metadata.slot_mapping, codes)
                flat_scales[i].index_copy_(0, metadata.slot_mapping, scales)
        else:
            flat = kv_cache.view(2, num_blocks * tpb, num_kv_heads, head_dim)
            if k.dtype != flat.dtype:  # a cache kept in another dtype than the activations
                k, v = k.to(flat.dtype), v.to(flat.dtype)
            flat[0].index_copy_(0, metadata.slot_mapping, k)
            flat[1].index_copy_(0, metadata.slot_mapping, v)

        outs = []
        for g in self._get_plan(metadata, q.device, window):
            if g.max_q == 1:
                outs.append(_decode_attention(q[g.tok_begin : g.tok_end], flat, flat_scales, g, scale))
                continue
            kv = _gather(flat, flat_scales, g.gather.reshape(-1), q.dtype)
            kv = kv.view(2, *g.gather.shape, num_kv_heads, head_dim)  # [2, batch, max_kv, kvh, hd]
            key = kv[0].transpose(1, 2)
            value = kv[1].transpose(1, 2)
            qg = q[g.tok_begin : g.tok_end]
            if g.q_index is None:
                qp = qg.reshape(g.batch, g.max_q, num_heads, head_dim)
            else:
                qp = qg.new_zeros(g.batch * g.max_q, num_heads, head_dim)
                qp = qp.index_copy_(0, g.q_index, qg).view(g.batch, g.max_q, num_heads, head_dim)
            qp = qp.transpose(1, 2)  # [batch, heads, max_q, hd]
            if num_heads != num_kv_heads and not _SDPA_HAS_GQA:
                rep = num_heads // num_kv_heads
                key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
            gqa = {"enable_gqa": True} if num_heads != num_kv_heads and _SDPA_HAS_GQA else {}
            out = F.scaled_dot_product_attention(
                qp, key, value, attn_mask=g.mask, is_causal=g.is_causal, scale=scale, **gqa
            )
            out = out.transpose(1, 2)  # [batch, max_q, heads, hd]
            if g.q_index is None:
                out = out.reshape(g.tok_end - g.tok_begin, num_heads, head_dim)
            else:
                out = out.reshape(g.batch * g.max_q, num_heads, head_dim).index_select(0, g.q_index)
            outs.append(out)
        if not outs:
            return q.new_empty(0, num_heads, head_dim)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
