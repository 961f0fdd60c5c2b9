"""GPU kernel benchmarks of ``inflight._C_cuda``, each against a baseline measured in the same run.

* paged decode attention: achieved bandwidth (bytes of K, V and queries read) against a read-only
  bandwidth kernel (``torch.sum`` over a buffer far larger than L2); goal >= 80 %.
* context (prefill) attention: TFLOP/s against torch SDPA (flash backend) on the same problem.
* W4A16 / W8A16 GEMM at batch 1..16 against torch's fp16 matmul on the dequantised weight, for
  8192x8192, 8192x28672 (in x out) and 28672x8192; goal >= 3x at batch 1 for W4A16.
* sampling: fused top-k/top-p sampling against torch softmax + multinomial.

Timing: CUDA events around each call, after warm-up, median of the repeats; L2 is flushed (a write
over a 512 MiB buffer) before every timed call, so weights and KV are read from HBM as in a real
step. Usage: ``python benchmarks/gpu/bench_kernels.py --out DIR [--quick]``; prints a table and writes
``DIR/bench_kernels.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from inflight.cuda import require_cuda_module

_FLUSH: torch.Tensor | None = None


def _flush_l2() -> None:
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    _FLUSH.fill_(1)


def time_ms(fn, warmup: int = 3, iters: int = 15, flush: bool = True) -> float:
    """Median milliseconds of one call of ``fn`` (CUDA events, L2 flushed before each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if flush:
            _flush_l2()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


# ------------------------------------------------------------------------------- baselines


def read_bandwidth_gbs() -> float:
    """Read-only HBM bandwidth: torch.sum over 2 GiB of fp16 (reads everything once, writes a scalar)."""
    x = torch.ones(1 << 30, dtype=torch.float16, device="cuda")
    ms = time_ms(lambda: x.sum(dtype=torch.float32), iters=10)
    return x.numel() * 2 / (ms * 1e-3) / 1e9


# ------------------------------------------------------------------------------- attention


def _paged_cache(batch, kv_len, num_kv_heads, head_dim, tpb, dtype):
    blocks = -(-kv_len // tpb)
    cache = torch.randn(2, batch * blocks, tpb, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    # Scattered blocks, as after a while of allocating and freeing.
    table = torch.randperm(batch * blocks, device="cuda").to(torch.int32).view(batch, blocks)
    return cache, table


def _decode_row(mod, read_gbs, batch, kv_len, heads, kvh, hd) -> dict:
    dtype, tpb = torch.float16, 16
    cache, table = _paged_cache(batch, kv_len, kvh, hd, tpb, dtype)
    q = torch.randn(batch, heads, hd, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    lens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    ws_bytes = max(1, mod.paged_attention_workspace_size(batch, heads, kv_len, hd))
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")
    scale = hd**-0.5
    ms = time_ms(lambda: mod.paged_attention(q, cache, table, lens, scale, out, ws, stream()))
    ms_nosplit = time_ms(lambda: mod.paged_attention(q, cache, table, lens, scale, out, None, stream()))
    bytes_read = batch * kv_len * kvh * hd * 2 * 2 + q.numel() * 2 + out.numel() * 2
    gbs = bytes_read / (ms * 1e-3) / 1e9
    return {
        "batch": batch,
        "kv_len": kv_len,
        "num_heads": heads,
        "num_kv_heads": kvh,
        "head_dim": hd,
        "ms": ms,
        "ms_no_split": ms_nosplit,
        "gb_per_s": gbs,
        "fraction_of_read_bw": gbs / read_gbs,
    }


def bench_decode(mod, read_gbs: float, quick: bool) -> list[dict]:
    configs = [
        # (batch, kv_len, num_heads, num_kv_heads, head_dim)
        (1, 32768, 32, 8, 128),
        (8, 8192, 32, 8, 128),
        (32, 4096, 32, 8, 128),
        (64, 2048, 32, 8, 128),
        (32, 4096, 32, 32, 128),
        (64, 2048, 16, 4, 64),
    ]
    rows = []
    for config in configs[:3] if quick else configs:
        rows.append(_decode_row(mod, read_gbs, *config))
        torch.cuda.empty_cache()
    return rows


def _prefill_row(mod, batch, seq, heads, kvh, hd) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype, tpb = torch.float16, 16
    cache, table = _paged_cache(batch, seq, kvh, hd, tpb, dtype)
    q = torch.randn(batch * seq, heads, hd, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * seq
    lens = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
    scale = hd**-0.5
    ms = time_ms(lambda: mod.context_attention(q, cache, table, cu, lens, scale, out, stream()), flush=False)
    # Baseline: the same problem as dense [batch, heads, seq, hd] tensors (K/V already expanded to every
    # query head), causal SDPA on the flash backend.
    qd = q.view(batch, seq, heads, hd).transpose(1, 2).contiguous()
    kd = torch.randn(batch, heads, seq, hd, device="cuda", dtype=dtype)
    vd = torch.randn_like(kd)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)

    try:
        ms_sdpa = time_ms(sdpa, flush=False)
    except RuntimeError as e:  # no flash kernel for this configuration
        ms_sdpa = float("nan")
        print(f"  SDPA flash unavailable: {e}", file=sys.stderr)
    flops = 4.0 * batch * heads * hd * (seq * (seq + 1) / 2)  # causal: QK^T and PV over the lower triangle
    return {
        "batch": batch,
        "seq_len": seq,
        "num_heads": heads,
        "num_kv_heads": kvh,
        "head_dim": hd,
        "ms": ms,
        "tflops": flops / (ms * 1e-3) / 1e12,
        "sdpa_flash_ms": ms_sdpa,
        "sdpa_flash_tflops": flops / (ms_sdpa * 1e-3) / 1e12,
        "ratio_vs_sdpa": ms_sdpa / ms,
    }


def bench_prefill(mod, quick: bool) -> list[dict]:
    configs = [(4, 2048, 32, 8, 128), (1, 8192, 32, 8, 128), (8, 1024, 32, 32, 128), (4, 2048, 16, 16, 64)]
    rows = []
    for config in configs[:2] if quick else configs:
        rows.append(_prefill_row(mod, *config))
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------- weight-only GEMM


def _gemm_rows(mod, k, n, batches) -> list[dict]:
    dtype, group = torch.float16, 128
    qweight = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.int32).to(torch.uint8)
    scales = (torch.rand(n, k // group, device="cuda") * 0.01).to(dtype)
    q8 = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int32).to(torch.int8)
    w = torch.randn(n, k, device="cuda", dtype=dtype)  # the baseline's fp16 weight
    rows = []
    for m in batches:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        ms4 = time_ms(
            lambda x=x, out=out: mod.w4a16_gemm(x, qweight, scales, None, group, out, None, stream())
        )
        ms8 = time_ms(lambda x=x, out=out: mod.w8a16_gemm(x, q8, scales, group, out, None, stream()))
        ms16 = time_ms(lambda x=x: F.linear(x, w))
        rows.append(
            {
                "m": m,
                "k": k,
                "n": n,
                "group_size": group,
                "w4a16_ms": ms4,
                "w8a16_ms": ms8,
                "fp16_matmul_ms": ms16,
                "w4a16_speedup": ms16 / ms4,
                "w8a16_speedup": ms16 / ms8,
                "w4a16_weight_gb_per_s": n * k / 2 / (ms4 * 1e-3) / 1e9,
            }
        )
    return rows


def bench_gemm(mod, quick: bool) -> list[dict]:
    shapes = [(8192, 8192), (8192, 28672), (28672, 8192)]  # (k = in features, n = out features)
    batches = [1, 2, 4, 8, 16] if quick else [1, 2, 3, 4, 8, 12, 16]
    rows = []
    for k, n in shapes:
        rows.extend(_gemm_rows(mod, k, n, batches))
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------- sampling


def _sampling_rows(mod, n, vocab) -> list[dict]:
    logits = torch.randn(n, vocab, device="cuda") * 4
    temperature = torch.full((n,), 0.8, device="cuda")
    top_k = torch.full((n,), 50, dtype=torch.int32, device="cuda")
    top_p = torch.full((n,), 0.9, device="cuda")
    min_p = torch.zeros(n, device="cuda")
    seeds = torch.arange(n, dtype=torch.int64, device="cuda")
    steps = torch.zeros(n, dtype=torch.int64, device="cuda")
    out = torch.empty(n, dtype=torch.int64, device="cuda")
    rows = []
    for label, k, p in (("plain", 0, 1.0), ("top_k=50,top_p=0.9", 50, 0.9)):
        top_k.fill_(k)
        top_p.fill_(p)
        ms = time_ms(
            lambda: mod.sample(logits, temperature, top_k, top_p, min_p, seeds, steps, out, stream()),
            flush=False,
        )
        rows.append({"rows": n, "vocab": vocab, "filters": label, "ms": ms})
    ms_torch = time_ms(
        lambda: torch.multinomial(torch.softmax(logits / temperature[:, None], dim=-1), 1), flush=False
    )
    rows.append(
        {"rows": n, "vocab": vocab, "filters": "torch softmax+multinomial (baseline)", "ms": ms_torch}
    )
    return rows


def bench_sampling(mod, quick: bool) -> list[dict]:
    rows = []
    for n, vocab in [(1, 128256), (64, 128256), (256, 32000)]:
        rows.extend(_sampling_rows(mod, n, vocab))
    return rows


# ------------------------------------------------------------------------------- main


def _print_table(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    if not rows:
        print("  (none)")
        return
    keys = list(rows[0].keys())
    print("  " + "  ".join(f"{k:>14}" for k in keys))
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k)
            cells.append(f"{v:>14.4g}" if isinstance(v, float) else f"{v!s:>14}")
        print("  " + "  ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for bench_kernels.json")
    ap.add_argument("--quick", action="store_true", help="fewer configurations")
    ap.add_argument("--only", nargs="*", default=None, help="subset: decode prefill gemm sampling")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    mod = require_cuda_module()
    torch.manual_seed(0)
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda_runtime_torch": torch.version.cuda,
        "cuda_runtime_inflight": mod.runtime_version(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "errors": {},
    }
    read_gbs = read_bandwidth_gbs()
    result["read_bandwidth_gb_per_s"] = read_gbs
    print(f"device: {result['device']}; read-only bandwidth (torch.sum over 2 GiB): {read_gbs:.0f} GB/s")

    stages = {
        "decode": lambda: bench_decode(mod, read_gbs, args.quick),
        "prefill": lambda: bench_prefill(mod, args.quick),
        "gemm": lambda: bench_gemm(mod, args.quick),
        "sampling": lambda: bench_sampling(mod, args.quick),
    }
    for name, fn in stages.items():
        if args.only and name not in args.only:
            continue
        t0 = time.time()
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001  (keep going: one broken stage must not hide the others)
            traceback.print_exc()
            result["errors"][name] = f"{type(e).__name__}: {e}"
            result[name] = []
        torch.cuda.empty_cache()
        _print_table(f"{name} ({time.time() - t0:.1f} s)", result[name])
        (args.out / "bench_kernels.json").write_text(json.dumps(result, indent=2, default=str))

    summary = {}
    if result.get("decode"):
        summary["decode_best_fraction_of_read_bw"] = max(r["fraction_of_read_bw"] for r in result["decode"])
    if result.get("prefill"):
        summary["prefill_best_ratio_vs_sdpa"] = max(
            (r["ratio_vs_sdpa"] for r in result["prefill"] if not math.isnan(r["ratio_vs_sdpa"])),
            default=None,
        )
    if result.get("gemm"):
        batch1 = [r["w4a16_speedup"] for r in result["gemm"] if r["m"] == 1]
        summary["w4a16_batch1_min_speedup"] = min(batch1) if batch1 else None
    result["summary"] = summary
    (args.out / "bench_kernels.json").write_text(json.dumps(result, indent=2, default=str))
    print("\nsummary:", json.dumps(summary, indent=2))
    print(f"wrote {args.out / 'bench_kernels.json'}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
