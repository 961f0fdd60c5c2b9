"""CUDA ops of ``inflight._C_cuda`` against the plain-torch references, on CUDA tensors.

The kernels are called directly (``require_cuda_module()``), not through the typed wrappers, so these
tests pin the kernels themselves. Tolerances follow the style guide: a low-precision kernel's error
against an fp32 ground truth stays within 2x the plain-torch reference's own low-precision error (plus
a small floor). Sizes are awkward on purpose (kv lens 1, 17, 97, 1025; GQA groups 1/3/4; partial
blocks and tiles). Tests marked ``cuda`` are skipped without a GPU (conftest.py); the boundary
checks at the bottom run anywhere the module was compiled.
"""

from __future__ import annotations

import math

import pytest
import torch

from inflight.cuda import cuda_module, require_cuda_module

cuda = pytest.mark.cuda
_DEV = "cuda"  # one name for the device, so the helpers can be dry-run elsewhere

# Value written into the rows past kv_len of a sequence's last (partial) block: finite, so the
# reference (which gathers and masks them) is unaffected, but large enough that a kernel reading
# them unmasked fails loudly. Blocks no sequence owns hold NaN.
_TAIL = 1000.0


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _floor(dtype: torch.dtype) -> float:
    return {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 1e-5}[dtype]


def _assert_within_2x(got: torch.Tensor, ref_lp: torch.Tensor, truth: torch.Tensor, what: str) -> None:
    err = (got.float() - truth.float()).abs().max().item()
    ref_err = (ref_lp.float() - truth.float()).abs().max().item()
    scale = max(truth.float().abs().max().item(), 1.0)
    bound = 2.0 * ref_err + _floor(got.dtype) * scale
    assert math.isfinite(err), f"{what}: non-finite output"
    assert err <= bound, (
        f"{what}: max error {err:.3g} > bound {bound:.3g} (reference's own error {ref_err:.3g})"
    )


# ------------------------------------------------------------------------------- paged cache fixtures


def _make_cache(kv_lens, num_kv_heads, head_dim, tpb, dtype, seed=0):
    """A cache whose blocks are scattered (random permutation), with poisoned tails and spare blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks = [max(1, -(-n // tpb)) for n in kv_lens]
    spare = 3
    num_blocks = sum(blocks) + spare
    max_blocks = max(blocks) + 2  # wider than needed: the kernels must not care
    perm = torch.randperm(num_blocks, generator=g)
    cache = torch.randn(2, num_blocks, tpb, num_kv_heads, head_dim, generator=g)
    table = torch.zeros(len(kv_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(kv_lens):
        ids = perm[used : used + blocks[i]]
        used += blocks[i]
        table[i, : blocks[i]] = ids.to(torch.int32)
        tail = n - (blocks[i] - 1) * tpb
        cache[:, ids[-1], tail:] = _TAIL
    cache[:, perm[used:]] = float("nan")
    return cache.to(dtype).to(_DEV), table.to(_DEV)


def _ref_attention():
    from inflight.ops.reference import attention

    return attention


# ------------------------------------------------------------------------------- store_kv


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_store_kv_matches_index_copy(dtype):
    mod = require_cuda_module()
    num_tokens, kvh, hd, tpb, num_blocks = 37, 3, 64, 16, 9
    # k and v as strided slices of one fused tensor, as a qkv projection yields them.
    fused = torch.randn(num_tokens, 2 * kvh + 1, hd, device=_DEV).to(dtype)
    k, v = fused[:, :kvh], fused[:, kvh : 2 * kvh]
    slots = torch.randperm(num_blocks * tpb, device=_DEV)[:num_tokens].to(torch.int64)
    slots[::5] = -1  # padding tokens are skipped
    cache = torch.randn(2, num_blocks, tpb, kvh, hd, device=_DEV).to(dtype)
    expected = cache.clone()
    flat = expected.view(2, num_blocks * tpb, kvh, hd)
    keep = slots >= 0
    flat[0, slots[keep]] = k[keep]
    flat[1, slots[keep]] = v[keep]
    mod.store_kv(k, v, cache, slots, _stream())
    torch.cuda.synchronize()
    assert torch.equal(cache, expected)


@cuda
def test_store_kv_empty_and_odd_widths():
    mod = require_cuda_module()
    cache = torch.zeros(2, 2, 4, 1, 64, device=_DEV, dtype=torch.float16)
    empty = torch.empty(0, 1, 64, device=_DEV, dtype=torch.float16)
    mod.store_kv(empty, empty, cache, torch.empty(0, dtype=torch.int64, device=_DEV), _stream())
    k = torch.arange(64, device=_DEV, dtype=torch.float16).view(1, 1, 64)
    mod.store_kv(k, -k, cache, torch.tensor([5], device=_DEV), _stream())
    torch.cuda.synchronize()
    assert torch.equal(cache[0, 1, 1, 0], k[0, 0]) and torch.equal(cache[1, 1, 1, 0], -k[0, 0])
    assert cache.abs().sum().item() == 2 * k.float().sum().item()


# ------------------------------------------------------------------------------- paged_attention (decode)

_DECODE_LENS = [1, 17, 97, 1025, 64, 63]


def _decode_case(dtype, head_dim, group, num_kv_heads=2, tpb=16, lens=_DECODE_LENS, seed=0):
    cache, table = _make_cache(lens, num_kv_heads, head_dim, tpb, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=g).to(dtype).to(_DEV)
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=_DEV)
    return q, cache, table, kv_lens, head_dim**-0.5


def _decode_truth(q, cache, table, kv_lens, scale):
    ref = _ref_attention()
    truth = ref.paged_attention(q.float(), _nan_free(cache).float(), table, kv_lens, scale)
    ref_lp = ref.paged_attention(q, _nan_free(cache), table, kv_lens, scale)
    return truth, ref_lp


def _nan_free(cache):
    # The reference gathers through whole blocks of the table; the NaN spare blocks are never in it,
    # but torch's index_select reads only what is indexed, so this is only a guard for index 0 reuse.
    return torch.nan_to_num(cache, nan=0.0)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("split", [False, True])
def test_paged_attention(dtype, head_dim, group, split):
    mod = require_cuda_module()
    q, cache, table, kv_lens, scale = _decode_case(dtype, head_dim, group)
    batch, num_heads, _ = q.shape
    workspace = None
    if split:
        size = mod.paged_attention_workspace_size(batch, num_heads, max(_DECODE_LENS), head_dim)
        assert size > 0
        workspace = torch.empty(size, dtype=torch.uint8, device=_DEV)
    out = torch.full_like(q, float("nan"))
    mod.paged_attention(q, cache, table, kv_lens, scale, out, workspace, _stream())
    truth, ref_lp = _decode_truth(q, cache, table, kv_lens, scale)
    _assert_within_2x(
        out, ref_lp, truth, f"paged_attention {dtype} hd={head_dim} group={group} split={split}"
    )


@cuda
def test_paged_attention_large_group_and_odd_block_size():
    # 20 query heads per KV head: two 16-row head chunks; 7 tokens per block: keys straddle blocks
    # inside every tile.
    mod = require_cuda_module()
    q, cache, table, kv_lens, scale = _decode_case(torch.float16, 128, 20, num_kv_heads=1, tpb=7)
    out = torch.empty_like(q)
    ws = torch.empty(
        mod.paged_attention_workspace_size(q.shape[0], q.shape[1], 1025, 128), dtype=torch.uint8, device=_DEV
    )
    mod.paged_attention(q, cache, table, kv_lens, scale, out, ws, _stream())
    truth, ref_lp = _decode_truth(q, cache, table, kv_lens, scale)
    _assert_within_2x(out, ref_lp, truth, "paged_attention group=20 tpb=7")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_paged_attention_simt_and_float32(dtype):
    mod = require_cuda_module()
    q, cache, table, kv_lens, scale = _decode_case(dtype, 64, 3)
    truth, ref_lp = _decode_truth(q, cache, table, kv_lens, scale)
    out = torch.empty_like(q)
    mod.paged_attention_simt(q, cache, table, kv_lens, scale, out, _stream())
    _assert_within_2x(out, ref_lp, truth, f"paged_attention_simt {dtype}")
    if dtype == torch.float32:  # the float32 path of paged_attention is the same CUDA-core kernel
        out2 = torch.empty_like(q)
        mod.paged_attention(q, cache, table, kv_lens, scale, out2, None, _stream())
        torch.testing.assert_close(out2, truth, atol=1e-4, rtol=1e-4)


@cuda
def test_paged_attention_zero_length_and_strided_query():
    mod = require_cuda_module()
    q, cache, table, kv_lens, scale = _decode_case(torch.float16, 64, 4, lens=[0, 5, 300])
    fused = torch.randn(q.shape[0], q.shape[1] + 4, 64, device=_DEV, dtype=torch.float16)
    fused[:, : q.shape[1]] = q
    q_view = fused[:, : q.shape[1]]  # rows strided like a slice of a fused qkv projection
    out = torch.full_like(q, float("nan"))
    mod.paged_attention(q_view, cache, table, kv_lens, scale, out, None, _stream())
    torch.cuda.synchronize()
    assert torch.all(out[0] == 0), "kv_len 0 gives a zero row"
    truth, ref_lp = _decode_truth(q[1:], cache, table[1:], kv_lens[1:], scale)
    _assert_within_2x(out[1:], ref_lp, truth, "paged_attention strided q")


# ------------------------------------------------------------------------------- context_attention

# (q_len, kv_len): whole prompts, chunked prefill continuing a history, and an empty sequence.
_CONTEXT_SEQS = [(1, 1), (17, 17), (97, 97), (1025, 1025), (5, 97), (64, 1025), (0, 7), (65, 130)]


def _context_case(dtype, head_dim, group, num_kv_heads=2, tpb=16, seqs=_CONTEXT_SEQS, seed=0):
    q_lens = [s[0] for s in seqs]
    kv_lens_l = [s[1] for s in seqs]
    cache, table = _make_cache(kv_lens_l, num_kv_heads, head_dim, tpb, dtype, seed)
    g = torch.Generator().manual_seed(seed + 2)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=g).to(dtype).to(_DEV)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=_DEV)
    kv_lens = torch.tensor(kv_lens_l, dtype=torch.int32, device=_DEV)
    return q, cache, table, cu, kv_lens, head_dim**-0.5


def _context_truth(q, cache, table, cu, kv_lens, scale):
    ref = _ref_attention()
    truth = ref.context_attention(q.float(), _nan_free(cache).float(), table, cu, kv_lens, scale)
    ref_lp = ref.context_attention(q, _nan_free(cache), table, cu, kv_lens, scale)
    return truth, ref_lp


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_context_attention(dtype, head_dim, group):
    mod = require_cuda_module()
    q, cache, table, cu, kv_lens, scale = _context_case(dtype, head_dim, group)
    out = torch.full_like(q, float("nan"))
    mod.context_attention(q, cache, table, cu, kv_lens, scale, out, _stream())
    truth, ref_lp = _context_truth(q, cache, table, cu, kv_lens, scale)
    _assert_within_2x(out, ref_lp, truth, f"context_attention {dtype} hd={head_dim} group={group}")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_context_attention_simt_and_float32(dtype):
    mod = require_cuda_module()
    seqs = [(1, 1), (17, 17), (40, 97), (0, 3), (97, 97)]
    q, cache, table, cu, kv_lens, scale = _context_case(dtype, 128, 3, tpb=5, seqs=seqs)
    truth, ref_lp = _context_truth(q, cache, table, cu, kv_lens, scale)
    out = torch.empty_like(q)
    mod.context_attention_simt(q, cache, table, cu, kv_lens, scale, out, _stream())
    _assert_within_2x(out, ref_lp, truth, f"context_attention_simt {dtype}")
    if dtype == torch.float32:
        out2 = torch.empty_like(q)
        mod.context_attention(q, cache, table, cu, kv_lens, scale, out2, _stream())
        torch.testing.assert_close(out2, truth, atol=1e-4, rtol=1e-4)


@cuda
def test_context_attention_many_sequences():
    # More than 32 sequences: the tile lookup scans cu_seqlens in chunks of 32.
    mod = require_cuda_module()
    g = torch.Generator().manual_seed(3)
    seqs = [
        (int(a), int(a) + int(b))
        for a, b in zip(torch.randint(0, 80, (45,), generator=g), torch.randint(0, 40, (45,), generator=g))
    ]
    seqs = [(ql, max(kv, 1)) for ql, kv in seqs]
    q, cache, table, cu, kv_lens, scale = _context_case(torch.bfloat16, 64, 4, seqs=seqs)
    out = torch.empty_like(q)
    mod.context_attention(q, cache, table, cu, kv_lens, scale, out, _stream())
    truth, ref_lp = _context_truth(q, cache, table, cu, kv_lens, scale)
    _assert_within_2x(out, ref_lp, truth, "context_attention 45 sequences")


# ------------------------------------------------------------------------------- W4A16 / W8A16


def _ref_gemm():
    from inflight.ops.reference import gemm

    return gemm


def _w4_case(m, n, k, group, asym, dtype, scale_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(_DEV)
    qweight = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int64).to(torch.uint8).to(_DEV)
    scale_dtype = scale_dtype or dtype
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.005).to(scale_dtype).to(_DEV)
    offsets = (
        ((torch.rand(n, k // group, generator=g) - 0.5) * 0.1).to(scale_dtype).to(_DEV) if asym else None
    )
    return x, qweight, scales, offsets


def _gemm_check(got, x, w_fp32, bias, what):
    truth = x.float() @ w_fp32.T
    ref_lp = x @ w_fp32.to(x.dtype).T
    if bias is not None:
        truth = truth + bias.float()
        ref_lp = ref_lp + bias
    _assert_within_2x(got, ref_lp, truth, what)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("asym", [False, True])
def test_w4a16_gemm(dtype, group, asym):
    mod = require_cuda_module()
    ref = _ref_gemm()
    n, k = 200, group * 13  # n not a multiple of the 32-row CTA tile; k ends inside a 128-k slice
    for m in list(range(1, 17)) + [33]:
        x, qweight, scales, offsets = _w4_case(m, n, k, group, asym, dtype, seed=m)
        out = torch.full((m, n), float("nan"), dtype=dtype, device=_DEV)
        mod.w4a16_gemm(x, qweight, scales, offsets, group, out, None, _stream())
        w = ref.dequantize_w4(qweight, scales, offsets, group)
        _gemm_check(out, x, w, None, f"w4a16 {dtype} group={group} asym={asym} m={m}")


@cuda
def test_w4a16_gemm_bias_float32_scales_and_strided_io():
    mod = require_cuda_module()
    ref = _ref_gemm()
    m, n, k, group = 5, 96, 512, 128
    x, qweight, scales, offsets = _w4_case(m, n, k, group, True, torch.float16, scale_dtype=torch.float32)
    wide_x = torch.zeros(m, k + 64, dtype=torch.float16, device=_DEV)
    wide_x[:, :k] = x
    bias = torch.randn(n, device=_DEV).to(torch.float16)
    wide_out = torch.full((m, n + 8), float("nan"), dtype=torch.float16, device=_DEV)
    out = wide_out[:, :n]
    mod.w4a16_gemm(wide_x[:, :k], qweight, scales, offsets, group, out, bias, _stream())
    torch.cuda.synchronize()
    assert torch.isnan(wide_out[:, n:]).all(), "wrote outside out's rows"
    _gemm_check(
        out, x, ref.dequantize_w4(qweight, scales, offsets, group), bias, "w4a16 bias/fp32 scales/strided"
    )


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_w8a16_gemm(dtype, group):
    mod = require_cuda_module()
    ref = _ref_gemm()
    n, k = 136, group * 13
    for m in (1, 5, 8, 9, 16, 33):
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, k, generator=g).to(dtype).to(_DEV)
        qweight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int64).to(torch.int8).to(_DEV)
        scales = (torch.rand(n, k // group, generator=g) * 0.002 + 0.0005).to(dtype).to(_DEV)
        bias = torch.randn(n, generator=g).to(dtype).to(_DEV) if m % 2 else None
        out = torch.full((m, n), float("nan"), dtype=dtype, device=_DEV)
        mod.w8a16_gemm(x, qweight, scales, group, out, bias, _stream())
        _gemm_check(
            out, x, ref.dequantize_w8(qweight, scales, group), bias, f"w8a16 {dtype} group={group} m={m}"
        )


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w8a16_fp8_gemm(dtype):
    """E4M3 weights (every finite code, subnormals included) with 128-column groups, as FP8 checkpoints."""
    mod = require_cuda_module()
    ref = _ref_gemm()
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    n, k = 136, 128 * 5
    for m in (1, 5, 16, 33):
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, k, generator=g).to(dtype).to(_DEV)
        q = codes[torch.randint(0, len(codes), (n, k), generator=g)].view(torch.float8_e4m3fn)
        scales = (torch.rand(n, k // 128, generator=g) * 0.002 + 0.0005).to(_DEV)
        out = torch.full((m, n), float("nan"), dtype=dtype, device=_DEV)
        mod.w8a16_fp8_gemm(x, q.view(torch.int8).to(_DEV), scales, 128, out, None, _stream())
        _gemm_check(out, x, ref.dequantize_w8(q.to(_DEV), scales, 128), None, f"w8a16 fp8 {dtype} m={m}")


# ------------------------------------------------------------------------------- sampling


def _sampling_inputs(rows, vocab, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    logits[1, 7] = logits[1, 30] = logits[1].max() + 1  # a tie for the maximum: first index wins
    logits[2, :] = torch.round(logits[2])  # many ties in rank order
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.2
    temperature[0] = 0.0  # greedy
    temperature[1] = 0.0
    top_k = torch.randint(0, 60, (rows,), generator=g, dtype=torch.int32)
    top_k[::3] = 0
    top_k[min(4, rows - 1)] = 1
    top_p = torch.where(
        torch.rand(rows, generator=g) < 0.5, torch.ones(rows), torch.rand(rows, generator=g) * 0.9 + 0.05
    )
    min_p = torch.where(
        torch.rand(rows, generator=g) < 0.7, torch.zeros(rows), torch.rand(rows, generator=g) * 0.2
    )
    seeds = torch.randint(0, 2**62, (rows,), generator=g, dtype=torch.int64).view(torch.uint64)
    steps = torch.randint(0, 10_000, (rows,), generator=g, dtype=torch.int64)
    return logits, temperature, top_k, top_p, min_p, seeds, steps


def _sample_cuda(mod, logits, temperature, top_k, top_p, min_p, seeds, steps):
    dev = [t.to(_DEV) for t in (logits, temperature, top_k, top_p, min_p, seeds, steps)]
    out = torch.full((logits.shape[0],), -1, dtype=torch.int64, device=_DEV)
    mod.sample(*dev, out, _stream())
    return out.cpu()


@cuda
@pytest.mark.parametrize("vocab", [1, 97, 1000, 32_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_matches_reference(vocab, dtype):
    from inflight.ops.reference import sampling as ref

    mod = require_cuda_module()
    rows = 64 if vocab > 40 else 3
    inputs = _sampling_inputs(rows, max(vocab, 40), seed=vocab)
    logits = inputs[0][:, :vocab].to(dtype)
    args = (logits, *inputs[1:])
    got = _sample_cuda(mod, *args)
    want = ref.sample(logits.float(), *inputs[1:])
    assert ((got >= 0) & (got < vocab)).all()
    assert got[0].item() == want[0].item()  # greedy rows are exact
    if vocab > 40:
        assert got[1].item() == 7
    # Elsewhere identical except where u lands within rounding of a boundary: rare by construction.
    mismatches = int((got != want).sum())
    assert mismatches <= max(1, rows // 50), (
        f"{mismatches} of {rows} rows differ: {got.tolist()} vs {want.tolist()}"
    )


@cuda
def test_sample_is_deterministic_and_batch_independent():
    mod = require_cuda_module()
    inputs = _sampling_inputs(16, 5000, seed=11)
    a = _sample_cuda(mod, *inputs)
    b = _sample_cuda(mod, *inputs)
    assert torch.equal(a, b)
    alone = _sample_cuda(mod, *(t[5:6] for t in inputs))
    assert alone.item() == a[5].item()


# ------------------------------------------------------------------------------- coexistence with torch


@cuda
def test_static_runtime_coexists_with_torch_runtime():
    """Our statically linked CUDA runtime and torch's share the device's primary context: torch allocates
    and launches, our kernels run on torch's streams, and both see each other's results in order."""
    mod = require_cuda_module()
    device_before = torch.cuda.current_device()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        stream = torch.cuda.current_stream().cuda_stream
        buf = torch.zeros(1 << 20, dtype=torch.float32, device=_DEV)
        buf.add_(1.0)  # torch's kernel, then ours on the same stream: ordered without a sync
        mod.fill(buf.data_ptr(), buf.numel() // 2, 3.0, 1, stream)
        total = buf.sum()  # torch again, after ours
        q, cache, table, kv_lens, scale = _decode_case(torch.float16, 128, 4)
        out = torch.empty_like(q)
        mod.paged_attention(q, cache, table, kv_lens, scale, out, None, stream)
        doubled = out * 2
    torch.cuda.synchronize()
    assert total.item() == (1 << 19) * 3.0 + (1 << 19) * 1.0
    truth, ref_lp = _decode_truth(q, cache, table, kv_lens, scale)
    _assert_within_2x(doubled / 2, ref_lp, truth, "paged_attention on a torch side stream")
    assert torch.cuda.current_device() == device_before
    assert mod.device_count() == torch.cuda.device_count()
    x = torch.randn(64, 64, device=_DEV)
    torch.testing.assert_close((x @ x.T).cpu(), x.cpu() @ x.cpu().T, atol=1e-3, rtol=1e-3)


# ------------------------------------------------------------------------------- boundary checks (no GPU needed)

_mod = cuda_module()
needs_module = pytest.mark.skipif(_mod is None, reason="inflight was built without CUDA kernels")


@needs_module
def test_boundary_rejects_cpu_tensors_by_name():
    k = torch.zeros(3, 2, 64, dtype=torch.float16)
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="k must be a CUDA tensor"):
        _mod.store_kv(k, k, cache, torch.zeros(3, dtype=torch.int64), 0)


@needs_module
def test_boundary_messages_name_the_argument():
    q = torch.zeros(2, 4, 64, dtype=torch.float16)
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.float16)
    table = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    out = torch.zeros_like(q)
    with pytest.raises(TypeError, match="block_tables must be int32, got int64"):
        _mod.paged_attention(q, cache, table.long(), lens, 0.1, out, None, 0)
    with pytest.raises(TypeError, match=r"kv_cache must have the dtype of q \(float16\), got float32"):
        _mod.paged_attention(q, cache.float(), table, lens, 0.1, out, None, 0)
    with pytest.raises(ValueError, match="head_dim must be 64 or 128"):
        q96 = torch.zeros(2, 4, 96, dtype=torch.float16)
        _mod.paged_attention(
            q96,
            torch.zeros(2, 4, 16, 2, 96, dtype=torch.float16),
            table,
            lens,
            0.1,
            torch.zeros_like(q96),
            None,
            0,
        )
    with pytest.raises(ValueError, match="num_heads"):
        _mod.paged_attention(
            torch.zeros(2, 3, 64, dtype=torch.float16),
            cache,
            table,
            lens,
            0.1,
            torch.zeros(2, 3, 64, dtype=torch.float16),
            None,
            0,
        )
    with pytest.raises(ValueError, match="cu_seqlens"):
        _mod.context_attention(q, cache, table, torch.zeros(2, dtype=torch.int32), lens, 0.1, out, 0)
    with pytest.raises(ValueError, match="out must be contiguous"):
        _mod.paged_attention(
            q, cache, table, lens, 0.1, torch.zeros(4, 2, 64, dtype=torch.float16).transpose(0, 1), None, 0
        )
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        _mod.paged_attention(q, cache, table, lens, 0.1, out, None, 0)


@needs_module
def test_boundary_gemm_and_sampling_messages():
    x = torch.zeros(2, 256, dtype=torch.float16)
    qweight = torch.zeros(8, 128, dtype=torch.uint8)
    scales = torch.zeros(8, 2, dtype=torch.float16)
    out = torch.zeros(2, 8, dtype=torch.float16)
    with pytest.raises(TypeError, match="x must be bfloat16 or float16, got float32"):
        _mod.w4a16_gemm(x.float(), qweight, scales, None, 128, out, None, 0)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 32"):
        _mod.w4a16_gemm(x, qweight, scales, None, 48, out, None, 0)
    with pytest.raises(
        ValueError, match=r"scales must have shape \[n, k // group_size\] = \[8, 4\], got \[8, 2\]"
    ):
        _mod.w4a16_gemm(x, qweight, scales, None, 64, out, None, 0)
    with pytest.raises(TypeError, match="qweight must be int8, got uint8"):
        _mod.w8a16_gemm(x, qweight, scales, 128, out, None, 0)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        _mod.w4a16_gemm(x, qweight, scales, None, 128, out, None, 0)
    logits = torch.zeros(2, 10)
    cols = (
        torch.ones(2),
        torch.zeros(2, dtype=torch.int32),
        torch.ones(2),
        torch.zeros(2),
        torch.zeros(2, dtype=torch.uint64),
        torch.zeros(2, dtype=torch.int64),
    )
    with pytest.raises(TypeError, match="top_k must be int32, got int64"):
        _mod.sample(logits, cols[0], cols[1].long(), *cols[2:], torch.zeros(2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="logits must be a CUDA tensor"):
        _mod.sample(logits, *cols, torch.zeros(2, dtype=torch.int64), 0)


def _raised(call):
    try:
        call()
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    raise AssertionError("no exception raised")


@needs_module
def test_boundary_cpu_and_cuda_raise_the_same():
    """The same mistake raises the same exception type and message from inflight._C (CPU) and
    inflight._C_cuda: both bindings run the shared checks (csrc/bindings/op_checks.h) before their
    device's own, so CPU tensors reach them here without a GPU."""
    from inflight import _C

    f16 = torch.float16
    q = torch.zeros(2, 4, 64, dtype=f16)
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=f16)
    table = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = torch.zeros_like(q)
    k = torch.zeros(3, 2, 64, dtype=f16)
    slots = torch.zeros(3, dtype=torch.int64)
    x = torch.zeros(2, 256, dtype=f16)
    qweight = torch.zeros(8, 128, dtype=torch.uint8)
    scales = torch.zeros(8, 4, dtype=f16)
    gout = torch.zeros(2, 8, dtype=f16)
    cols = [
        torch.ones(2),
        torch.zeros(2, dtype=torch.int32),
        torch.ones(2),
        torch.zeros(2),
        torch.zeros(2, dtype=torch.int64),
        torch.zeros(2, dtype=torch.int64),
    ]

    def paged(*a):
        return (lambda: _C.paged_attention(*a, 1)), (lambda: _mod.paged_attention(*a, None, 0))

    def context(*a):
        return (lambda: _C.context_attention(*a, 1)), (lambda: _mod.context_attention(*a, 0))

    def store(*a):
        return (lambda: _C.store_kv(*a, 1)), (lambda: _mod.store_kv(*a, 0))

    def w4(*a):
        return (lambda: _C.w4a16_gemm(*a, 1)), (lambda: _mod.w4a16_gemm(*a, 0))

    def w8(*a):
        return (lambda: _C.w8a16_gemm(*a, 1)), (lambda: _mod.w8a16_gemm(*a, 0))

    def sample(logits, c, o):
        return (lambda: _C.sample(logits, *c, o, 1)), (lambda: _mod.sample(logits, *c, o, 0))

    cases = {
        "block_tables dtype": paged(q, cache, table.long(), lens, 0.1, out),
        "kv_cache dtype": paged(q, cache.float(), table, lens, 0.1, out),
        "kv_cache ndim": paged(q, cache[0], table, lens, 0.1, out),
        "num_heads": paged(
            torch.zeros(2, 3, 64, dtype=f16), cache, table, lens, 0.1, torch.zeros(2, 3, 64, dtype=f16)
        ),
        "kv_lens length": paged(q, cache, table, lens[:1], 0.1, out),
        "out layout": paged(q, cache, table, lens, 0.1, torch.zeros(4, 2, 64, dtype=f16).transpose(0, 1)),
        "out dtype": paged(q, cache, table, lens, 0.1, out.float()),
        "cu_seqlens length": context(q, cache, table, cu[:2], lens, 0.1, out),
        "v dtype": store(k, k.float(), cache, slots),
        "k heads": store(torch.zeros(3, 4, 64, dtype=f16), torch.zeros(3, 4, 64, dtype=f16), cache, slots),
        "slot_mapping dtype": store(k, k, cache, slots.int()),
        "qweight dtype": w4(x, qweight.to(torch.int8), scales, None, 64, gout, None),
        "scales shape": w4(x, qweight, scales[:, :2], None, 64, gout, None),
        "offsets dtype": w4(x, qweight, scales, scales.float(), 64, gout, None),
        "x k": w4(x[:, :128], qweight, scales, None, 64, gout, None),
        "gemm out dtype": w4(x, qweight, scales, None, 64, gout.bfloat16(), None),
        "bias shape": w4(x, qweight, scales, None, 64, gout, torch.zeros(9, dtype=f16)),
        "k multiple": w8(x[:, :96], torch.zeros(8, 96, dtype=torch.int8), scales[:, :1], 64, gout, None),
        "logits dtype": sample(
            torch.zeros(2, 10, dtype=torch.int64), cols, torch.zeros(2, dtype=torch.int64)
        ),
        "top_k dtype": sample(
            torch.zeros(2, 10), [cols[0], cols[1].long(), *cols[2:]], torch.zeros(2, dtype=torch.int64)
        ),
        "temperature length": sample(
            torch.zeros(2, 10), [torch.ones(3), *cols[1:]], torch.zeros(2, dtype=torch.int64)
        ),
        "out dtype (sample)": sample(torch.zeros(2, 10), cols, torch.zeros(2, dtype=torch.int32)),
    }
    for what, (cpu, gpu) in cases.items():
        got_cpu, got_gpu = _raised(cpu), _raised(gpu)
        assert got_cpu == got_gpu, f"{what}: CPU raised {got_cpu}, CUDA raised {got_gpu}"
        # The rule: a wrong dtype is a TypeError, a wrong shape or layout a ValueError.
        assert got_cpu[0] is (TypeError if "dtype" in what else ValueError), f"{what}: {got_cpu}"
