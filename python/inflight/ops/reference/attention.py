"""Plain-torch twins of :mod:`inflight.ops.attention` (same signatures, same results up to rounding).

They compute the way :class:`~inflight.layers.torch_attention.TorchAttentionBackend` does: gather
each sequence's keys through its block table into a padded batch, matmuls in the input dtype,
softmax in fp32, probabilities rounded back to the input dtype. Batched (no Python loop over
sequences), so they also serve as the baseline in ``benchmarks/bench_attention_cpu.py``. Called
with fp32 tensors they are the ground truth the tests measure the low-precision error against.
``window > 0`` masks explicitly (a query at position ``p`` sees keys ``p - window < j <= p``).

INT8 KV cache (an int8 ``kv_cache`` with ``kv_scales``): :func:`quantize_kv` is the kernels'
quantiser bit for bit (the same codes and scales), and the attention twins read the dequantised cache
(``codes.float() * scale``, then rounded to q's dtype), so called with fp32 q they are the fp32
reference on the dequantised KV. The CPU kernels multiply int16 codes of the query (each head row of
``q * scale * log2(e)`` with one scale, :func:`quantize_query`) by the int8 key codes in exact integer
sums where ``head_dim`` is a multiple of 32, and likewise P.V: each tile of :data:`KEY_TILE` keys'
probabilities times their V scales as int16 codes with one scale per row (``round(p * 32767 / max)``)
times the bare V codes. The twins do both on CPU tensors, so they stay the kernels' math up to fp32
rounding and the odd code one step apart (on CUDA tensors they read q and P as they are, as the CUDA
kernels do).

FP8 KV cache (a uint8 ``kv_cache`` of E4M3 bytes, or a ``torch.float8_e4m3fn`` one, with ``k_scale`` and
``v_scale``): :func:`quantize_kv_fp8` is the kernels' encoder bit for bit (``(x / scale).clamp(-448,
448).to(torch.float8_e4m3fn)``, a NaN stored as 0), and the twins read ``e4m3 * scale`` (exact in fp32).
"""

from __future__ import annotations

import torch

__all__ = [
    "context_attention",
    "dequantize_kv",
    "dequantize_kv_fp8",
    "paged_attention",
    "quantize_kv",
    "quantize_kv_fp8",
    "quantize_query",
    "store_kv",
]

FP8_E4M3_MAX = 448.0


def _is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype in (torch.uint8, torch.float8_e4m3fn)


def quantize_kv_fp8(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """E4M3 bytes (uint8) of ``x / scale`` in fp32: round to nearest even, saturated to +-448 (infinity
    too), a NaN stored as 0 — the kernels' encoder (``float_to_e4m3``), bit for bit."""
    y = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).nan_to_num(0.0)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize_kv_fp8(
    codes: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """E4M3 bytes (uint8 or float8_e4m3fn) times ``scale`` in fp32, then to ``dtype``."""
    return (codes.view(torch.float8_e4m3fn).float() * scale).to(dtype)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantisation of the last dimension (one head row): ``(codes int8, scales
    float32)`` with ``scale = max|x| / 127`` and ``codes = round(x / scale)`` (ties to even), 0 for an
    all-zero row. The kernels' ``quantize_kv_row``, bit for bit for finite inputs (division too, not a
    reciprocal)."""
    xf = x.float()
    scales = xf.abs().amax(dim=-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(xf / safe[..., None]).clamp_(-127, 127)
    codes = torch.where((scales > 0)[..., None], codes, torch.zeros_like(codes))
    return codes.nan_to_num_(0.0).to(torch.int8), scales


def dequantize_kv(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``codes [..., head_dim]`` int8 times ``scales [...]`` in fp32 (one rounding), then to ``dtype``."""
    return (codes.float() * scales[..., None]).to(dtype)


LOG2E = 1.4426950408889634
KEY_TILE = 32  # the CPU kernels' keys per tile (each tile's probabilities share one int16 scale)


def quantize_query(q: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` as the CPU kernels read it against an int8 cache (``head_dim`` a multiple of 32): each
    head row of ``x = q * (scale * log2 e)`` (one fp32 product) as int16 codes ``round(x * (32767 /
    max|x|))`` (ties to even) with the scale ``max|x| / 32767``, returned dequantised and divided back
    by ``scale * log2 e``, in q's dtype."""
    mult = torch.tensor(scale * LOG2E, dtype=torch.float32)
    x = q.float() * mult
    amax = x.abs().amax(dim=-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    codes = torch.round(x * (torch.tensor(32767.0) / safe)).clamp_(-32767, 32767)
    return (codes * (amax / 32767.0) / mult).to(q.dtype)


def _int_scores(kv_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether the CPU kernels score this cache with integer sums (the CUDA kernels never do)."""
    return kv_cache.dtype == torch.int8 and head_dim % 32 == 0 and kv_cache.device.type == "cpu"


def _flat_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> torch.Tensor:
    """An int8 cache's scales as ``[2, num_slots, num_kv_heads]`` (the kernels' check, by name)."""
    _, num_blocks, tpb, num_kv_heads, _ = kv_cache.shape
    if kv_scales is None or tuple(kv_scales.shape) != (2, num_blocks, tpb, num_kv_heads):
        got = None if kv_scales is None else list(kv_scales.shape)
        raise ValueError(
            f"an int8 kv_cache needs kv_scales, float32 [2, num_blocks, tokens_per_block, num_kv_heads] = "
            f"{[2, num_blocks, tpb, num_kv_heads]}, got {got}"
        )
    return kv_scales.view(2, num_blocks * tpb, num_kv_heads)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    _, num_blocks, tpb, num_kv_heads, head_dim = kv_cache.shape
    if kv_cache.dtype == torch.float8_e4m3fn:
        kv_cache = kv_cache.view(torch.uint8)
    flat = kv_cache.view(2, num_blocks * tpb, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    if kv_cache.dtype == torch.int8:
        flat_scales = _flat_scales(kv_cache, kv_scales)
        for i, x in enumerate((k, v)):
            codes, scales = quantize_kv(x)
            flat[i].index_copy_(0, slot_mapping, codes)
            flat_scales[i].index_copy_(0, slot_mapping, scales)
        return
    if kv_cache.dtype == torch.uint8:
        flat[0].index_copy_(0, slot_mapping, quantize_kv_fp8(k, k_scale))
        flat[1].index_copy_(0, slot_mapping, quantize_kv_fp8(v, v_scale))
        return
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _slots(kv_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens_host: list[int]) -> torch.Tensor:
    """The flat cache slot of each sequence's key j < max_kv, ``[batch * max_kv]``."""
    tpb = kv_cache.shape[2]
    batch, max_kv = len(kv_lens_host), max(kv_lens_host)
    nblk = -(-max_kv // tpb)
    tables = block_tables[:, :nblk].to(torch.int64)
    offsets = torch.arange(tpb, device=kv_cache.device)
    return (tables[:, :, None] * tpb + offsets).reshape(batch, nblk * tpb)[:, :max_kv].reshape(-1)


def _int_pv(
    probs: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens_host: list[int],
    kv_scales: torch.Tensor,
) -> torch.Tensor:
    """``probs [batch, kvh, rows, max_kv]`` (fp32) times V as the CPU kernels multiply an int8 cache's
    V: per row and tile of :data:`KEY_TILE` keys (from key 0), ``p * v_scale`` as int16 codes
    ``round(p * (32767 / max))`` with the scale ``max / 32767``, times the bare V codes. Returns
    ``[batch, kvh, rows, head_dim]`` fp32."""
    _, num_blocks, tpb, num_kv_heads, head_dim = kv_cache.shape
    batch, kvh, rows, max_kv = probs.shape
    slots = _slots(kv_cache, block_tables, kv_lens_host)
    codes = kv_cache.view(2, num_blocks * tpb, num_kv_heads, head_dim)[1].index_select(0, slots)
    vscales = _flat_scales(kv_cache, kv_scales)[1].index_select(0, slots).view(batch, max_kv, kvh)
    p = probs * vscales.permute(0, 2, 1)[:, :, None, :]
    tiles = -(-max_kv // KEY_TILE)
    p = torch.nn.functional.pad(p, (0, tiles * KEY_TILE - max_kv)).view(batch, kvh, rows, tiles, KEY_TILE)
    amax = p.amax(-1, keepdim=True)
    mult = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
    pq = (torch.round(p * mult) * (amax / 32767.0)).view(batch, kvh, rows, tiles * KEY_TILE)[..., :max_kv]
    return torch.matmul(pq, codes.view(batch, max_kv, kvh, head_dim).permute(0, 2, 1, 3).float())


def _gather_kv(
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens_host: list[int],
    kv_scales: torch.Tensor | None,
    dtype: torch.dtype,
    fp8_scales: tuple[float, float] = (1.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of each sequence, padded: ``[batch, max_kv, kvh, hd]`` each, in the cache's
    dtype, or for an int8 or fp8 cache dequantised to ``dtype``."""
    _, num_blocks, tpb, num_kv_heads, head_dim = kv_cache.shape
    batch, max_kv = len(kv_lens_host), max(kv_lens_host)
    slots = _slots(kv_cache, block_tables, kv_lens_host)
    flat = kv_cache.view(2, num_blocks * tpb, num_kv_heads, head_dim)
    kv = flat.index_select(1, slots)
    if kv_cache.dtype == torch.int8:
        scales = _flat_scales(kv_cache, kv_scales).index_select(1, slots)
        kv = dequantize_kv(kv, scales, dtype)
    elif _is_fp8(kv_cache):
        kv = torch.stack([dequantize_kv_fp8(kv[i], fp8_scales[i], dtype) for i in range(2)])
    kv = kv.view(2, batch, max_kv, num_kv_heads, head_dim)
    return kv[0], kv[1]


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
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    lens = kv_lens.tolist()
    key, value = _gather_kv(
        kv_cache, block_tables, lens, kv_scales, q.dtype, (k_scale, v_scale)
    )  # [batch, max_kv, kvh, hd]
    max_kv = key.shape[1]
    if _int_scores(kv_cache, head_dim):
        q = quantize_query(q, scale)
    qh = q.reshape(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(qh, key.permute(0, 2, 3, 1)).float() * scale  # [batch, kvh, group, max_kv]
    j = torch.arange(max_kv, device=q.device)[None, :]
    kv_len_t = kv_lens.to(q.device)[:, None].long()
    valid = j < kv_len_t
    if window > 0:  # the query sits at kv_len - 1
        valid &= j > kv_len_t - 1 - window
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    if _int_scores(kv_cache, head_dim):
        probs = torch.softmax(scores, dim=-1)
        result = _int_pv(probs, kv_cache, block_tables, lens, kv_scales).to(q.dtype)
        result = result.reshape(batch, num_heads, head_dim)
    else:
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        result = torch.matmul(probs, value.transpose(1, 2)).reshape(batch, num_heads, head_dim)
    if out is None:
        return result
    out.copy_(result)
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
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    cu = cu_seqlens.tolist()
    lens = kv_lens.tolist()
    batch = len(lens)
    q_lens = [cu[i + 1] - cu[i] for i in range(batch)]
    max_q = max(q_lens)
    key, value = _gather_kv(
        kv_cache, block_tables, lens, kv_scales, q.dtype, (k_scale, v_scale)
    )  # [batch, max_kv, kvh, hd]
    max_kv = key.shape[1]
    if _int_scores(kv_cache, head_dim):
        q = quantize_query(q, scale)

    # Scatter the flattened queries into a padded [batch, max_q] layout.
    q_len_t = torch.tensor(q_lens, dtype=torch.int64)
    starts = torch.tensor(cu[:-1], dtype=torch.int64)
    row_base = torch.arange(batch, dtype=torch.int64) * max_q
    q_index = (torch.arange(num_tokens) + torch.repeat_interleave(row_base - starts, q_len_t)).to(q.device)
    qp = q.new_zeros(batch * max_q, num_heads, head_dim).index_copy_(0, q_index, q)
    # [batch, kvh, group * max_q, hd]: one batched matmul per KV head, its query heads as rows.
    qp = qp.view(batch, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qp = qp.reshape(batch, num_kv_heads, group * max_q, head_dim)

    # Query row r of sequence i sits at position kv_len - q_len + r and sees keys 0 .. that position
    # (the last `window` of them under a window). Padded rows (r >= q_len) are placed at kv_len - 1:
    # never fully masked, no NaN.
    kv_len_t = torch.tensor(lens, dtype=torch.int64)
    q_pos = (kv_len_t - q_len_t)[:, None] + torch.arange(max_q)[None, :]
    q_pos = torch.minimum(q_pos, kv_len_t[:, None] - 1)
    j = torch.arange(max_kv)
    mask = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_len_t[:, None, None])
    if window > 0:
        mask &= j[None, None, :] > q_pos[:, :, None] - window
    mask = mask.to(q.device)[:, None, None]  # [batch, 1, 1, max_q, max_kv]

    scores = torch.matmul(qp, key.permute(0, 2, 3, 1)).float() * scale  # [batch, kvh, group*max_q, max_kv]
    scores = scores.view(batch, num_kv_heads, group, max_q, max_kv).masked_fill_(~mask, float("-inf"))
    if _int_scores(kv_cache, head_dim):
        probs = torch.softmax(scores, dim=-1).view(batch, num_kv_heads, group * max_q, max_kv)
        res = _int_pv(probs, kv_cache, block_tables, lens, kv_scales).to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(batch, num_kv_heads, group * max_q, max_kv)
        res = torch.matmul(probs, value.transpose(1, 2))  # [batch, kvh, group * max_q, hd]
    res = res.view(batch, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    res = res.reshape(batch * max_q, num_heads, head_dim).index_select(0, q_index)
    if out is None:
        return res
    out.copy_(res)
    return out
