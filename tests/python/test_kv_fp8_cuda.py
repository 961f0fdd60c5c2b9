"""FP8 (E4M3) KV cache on the CUDA kernels of ``inflight._C_cuda`` (called directly, as
test_kv_int8_cuda.py does): store_kv's bytes against torch's saturating E4M3 conversion (the plain-torch
encoder), and both attention kernels (tensor cores for fp16 / bf16 q, the CUDA-core kernel for fp32 and
the *_simt twins) against the fp32 reference on the dequantised cache, within 2x of the low-precision
reference's own error. Tests marked ``cuda`` skip without a GPU (conftest.py); the boundary checks at
the bottom run wherever the module was compiled, and compare the CPU binding's messages with the CUDA
binding's.
"""

from __future__ import annotations

import math

import pytest
import torch

from inflight.cuda import cuda_module, require_cuda_module
from inflight.ops.reference import attention as ref

cuda = pytest.mark.cuda
_DEV = "cuda"
K_SCALE, V_SCALE = 0.37, 2.5


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _assert_within_2x(got, ref_lp, truth, what: str) -> None:
    err = (got.float() - truth).abs().max().item()
    ref_err = (ref_lp.float() - truth).abs().max().item()
    floor = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 1e-5}[got.dtype]
    bound = 2.0 * ref_err + floor * max(truth.abs().max().item(), 1.0)
    assert math.isfinite(err) and err <= bound, f"{what}: error {err:.3g} > {bound:.3g} (ref {ref_err:.3g})"


def _fp8_cache(kv_lens, num_kv_heads, head_dim, tpb, seed=0):
    """An fp8 cache (uint8 E4M3 bytes) encoded from random rows of varied magnitude, blocks scattered."""
    g = torch.Generator().manual_seed(seed)
    blocks = [max(1, -(-n // tpb)) for n in kv_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=g)
    x = torch.randn(2, num_blocks, tpb, num_kv_heads, head_dim, generator=g)
    x = x * torch.exp(torch.randn(2, num_blocks, tpb, num_kv_heads, 1, generator=g))
    cache = torch.stack([ref.quantize_kv_fp8(x[0], K_SCALE), ref.quantize_kv_fp8(x[1], V_SCALE)])
    table = torch.zeros(len(kv_lens), max(blocks) + 2, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return cache.to(_DEV), table.to(_DEV)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_store_kv_fp8_equals_reference_encoder(dtype, head_dim):
    mod = require_cuda_module()
    n, kvh, tpb, nb = 37, 3, 16, 9
    g = torch.Generator().manual_seed(head_dim)
    fused = torch.randn(n, 2 * kvh + 1, head_dim, generator=g) * torch.exp(
        3 * torch.randn(n, 2 * kvh + 1, 1, generator=g)
    )
    fused[4, 1, :3] = torch.tensor([1e6, -1e6, 0.0])  # saturated, and a zero
    fused = fused.to(dtype).to(_DEV)
    k, v = fused[:, :kvh], fused[:, kvh : 2 * kvh]  # strided, as slices of a qkv projection
    slots = torch.randperm(nb * tpb, generator=g)[:n].to(_DEV)
    slots[::5] = -1
    cache = torch.full((2, nb, tpb, kvh, head_dim), 0x55, dtype=torch.uint8, device=_DEV)
    want = cache.cpu()
    ref.store_kv(k.cpu(), v.cpu(), want, slots.cpu(), k_scale=K_SCALE, v_scale=V_SCALE)
    mod.store_kv(k, v, cache, slots, _stream(), None, K_SCALE, V_SCALE)
    torch.cuda.synchronize()
    assert torch.equal(cache.cpu(), want)


@cuda
def test_store_kv_fp8_every_representable_value():
    mod = require_cuda_module()
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[~vals.isnan()]
    mids = (vals[:126] + vals[1:127]) / 2  # ties between the positive neighbours: to the even code
    x = torch.cat([vals, mids, -mids, torch.tensor([500.0, -1e30, float("inf")])])
    rows = -(-x.numel() // 16)
    flat = torch.zeros(rows * 16)
    flat[: x.numel()] = x
    k = flat.view(rows, 1, 16).to(_DEV)
    cache = torch.zeros(2, rows, 1, 1, 16, dtype=torch.uint8, device=_DEV)
    mod.store_kv(k, k, cache, torch.arange(rows, device=_DEV), _stream(), None, 1.0, 1.0)
    torch.cuda.synchronize()
    assert torch.equal(cache[0].reshape(-1).cpu(), ref.quantize_kv_fp8(flat))


_DECODE_LENS = [1, 17, 97, 1025, 64, 63]


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [0, 40])
def test_paged_attention_fp8(dtype, head_dim, group, window):
    mod = require_cuda_module()
    kvh = 2
    cache, table = _fp8_cache(_DECODE_LENS, kvh, head_dim, 16, seed=group)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(_DECODE_LENS), kvh * group, head_dim, generator=g).to(dtype).to(_DEV)
    lens = torch.tensor(_DECODE_LENS, dtype=torch.int32, device=_DEV)
    args = (cache, table, lens, head_dim**-0.5)
    sc = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    truth = ref.paged_attention(q.float(), *args, window=window, **sc)
    ref_lp = ref.paged_attention(q, *args, window=window, **sc)
    ws_bytes = mod.paged_attention_workspace_size(q.shape[0], q.shape[1], max(_DECODE_LENS), head_dim)
    for ws in (None, torch.empty(max(ws_bytes, 16), dtype=torch.uint8, device=_DEV)):
        out = torch.full_like(q, float("nan"))
        mod.paged_attention(q, *args, out, ws, _stream(), window, None, K_SCALE, V_SCALE)
        _assert_within_2x(
            out, ref_lp, truth, f"paged {dtype} hd={head_dim} group={group} split={ws is not None}"
        )
    out = torch.full_like(q, float("nan"))
    mod.paged_attention_simt(q, *args, out, _stream(), window, None, K_SCALE, V_SCALE)
    _assert_within_2x(out, ref_lp, truth, f"paged_simt {dtype} hd={head_dim} group={group}")


_CONTEXT_SEQS = [(1, 1), (17, 17), (97, 97), (300, 1025), (5, 97), (0, 7), (65, 130)]


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [0, 33])
def test_context_attention_fp8(dtype, head_dim, window):
    mod = require_cuda_module()
    kvh, group = 2, 3
    cache, table = _fp8_cache([kv for _, kv in _CONTEXT_SEQS], kvh, head_dim, 16, seed=head_dim)
    q_lens = [ql for ql, _ in _CONTEXT_SEQS]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(q_lens), kvh * group, head_dim, generator=g).to(dtype).to(_DEV)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=_DEV)
    lens = torch.tensor([kv for _, kv in _CONTEXT_SEQS], dtype=torch.int32, device=_DEV)
    args = (cache, table, cu, lens, head_dim**-0.5)
    sc = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    truth = ref.context_attention(q.float(), *args, window=window, **sc)
    ref_lp = ref.context_attention(q, *args, window=window, **sc)
    for op in (mod.context_attention, mod.context_attention_simt):
        out = torch.full_like(q, float("nan"))
        op(q, *args, out, _stream(), window, None, K_SCALE, V_SCALE)
        _assert_within_2x(out, ref_lp, truth, f"{op.__name__} {dtype} hd={head_dim} window={window}")


@cuda
def test_native_ops_fp8_on_cuda_through_the_wrappers():
    """inflight.ops routes CUDA tensors with an fp8 cache (a float8_e4m3fn view too) to the kernels."""
    from inflight.ops import attention as ops

    kvh, hd, tpb = 2, 64, 16
    cache, table = _fp8_cache([40, 3], kvh, hd, tpb)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, kvh, hd, generator=g).half().to(_DEV)
    slots = (table[:, 0].long() * tpb + 2).contiguous()
    sc = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    ops.store_kv(k, k, cache.view(torch.float8_e4m3fn), slots, **sc)
    q = torch.randn(2, 8, hd, generator=g).half().to(_DEV)
    lens = torch.tensor([40, 3], dtype=torch.int32, device=_DEV)
    got = ops.paged_attention(q, cache, table, lens, 0.125, **sc)
    truth = ref.paged_attention(q.float(), cache, table, lens, 0.125, **sc)
    _assert_within_2x(got, ref.paged_attention(q, cache, table, lens, 0.125, **sc), truth, "wrapper")


# ------------------------------------------------------------------------------- boundary checks (no GPU needed)

_mod = cuda_module()
needs_module = pytest.mark.skipif(_mod is None, reason="inflight was built without CUDA kernels")


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares whatever was raised
        return type(exc), str(exc)
    return None


@needs_module
def test_fp8_boundary_cpu_and_cuda_raise_the_same():
    """kv_scales beside an fp8 cache, a bad k_scale / v_scale, a scale beside a float cache: the same
    exception and message from the CPU and the CUDA binding (the shared checks run first)."""
    from inflight import _C

    f16 = torch.float16
    q = torch.zeros(2, 4, 64, dtype=f16)
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.uint8)
    scales = torch.zeros(2, 4, 16, 2)
    table = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = torch.zeros_like(q)
    k = torch.zeros(3, 2, 64, dtype=f16)
    slots = torch.zeros(3, dtype=torch.int64)
    cases = {
        "kv_scales beside fp8 (paged)": (
            lambda: _C.paged_attention(q, cache, table, lens, 0.1, out, 1, 0, scales),
            lambda: _mod.paged_attention(q, cache, table, lens, 0.1, out, None, 0, 0, scales),
        ),
        "k_scale 0 (context)": (
            lambda: _C.context_attention(q, cache, table, cu, lens, 0.1, out, 1, 0, None, 0.0, 1.0),
            lambda: _mod.context_attention(q, cache, table, cu, lens, 0.1, out, 0, 0, None, 0.0, 1.0),
        ),
        "v_scale nan (store)": (
            lambda: _C.store_kv(k, k, cache, slots, 1, None, 1.0, float("nan")),
            lambda: _mod.store_kv(k, k, cache, slots, 0, None, 1.0, float("nan")),
        ),
        "k_scale beside a float cache": (
            lambda: _C.store_kv(k, k, cache.half(), slots, 1, None, 2.0, 1.0),
            lambda: _mod.store_kv(k, k, cache.half(), slots, 0, None, 2.0, 1.0),
        ),
    }
    for what, (cpu, gpu) in cases.items():
        got_cpu, got_gpu = _raised(cpu), _raised(gpu)
        assert got_cpu is not None and got_cpu == got_gpu, (
            f"{what}: CPU raised {got_cpu}, CUDA raised {got_gpu}"
        )
        assert "scale" in got_cpu[1], got_cpu
    # Valid arguments on CPU tensors: only the device check is left, and it names the argument.
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        _mod.paged_attention(q, cache, table, lens, 0.1, out, None, 0, 0, None, 1.0, 1.0)
