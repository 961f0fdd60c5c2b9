"""Dense CPU GEMM (``inflight.ops.dense_gemm``) vs torch ``F.linear`` at SmolLM2-135M shapes.

Each row is one projection shape, batch size M, dtype and thread count; both variants run in the same
process with the same weights, activations and thread count (``torch.set_num_threads``), and the last
column is ``F.linear`` time / ``dense_gemm`` time (> 1: ours is faster). Both allocate their output.

``--cache cold`` (default) cycles through enough weight copies to exceed the L3 cache, as a decode step
does (every layer's weights stream from memory once per token); ``--cache hot`` reuses one weight.
Times are medians (``--percentile``) of single calls, in microseconds; the two variants run in
alternating blocks of calls, each after a warm-up (see ``_time_pair``).

    python benchmarks/bench_dense_gemm_cpu.py [--batches 1 4 16 64] [--threads 1 2] [--dtypes fp32 bf16]
                                              [--cache cold|hot|both] [--percentile 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from inflight import _C
from inflight.ops.gemm import dense_gemm

# (name, K = in_features, N = out_features)
SHAPES = [
    ("qkv fused 576->960", 576, 960),
    ("o_proj 576->576", 576, 576),
    ("gate_up fused 576->3072", 576, 3072),
    ("down 1536->576", 1536, 576),
    ("lm_head 576->49152", 576, 49152),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COLD_BYTES = 96 << 20  # per variant: well past the 32 MiB L3


def _warm(f, seconds: float) -> None:
    """Untimed calls of f for `seconds` (at least two)."""
    f()
    end = time.perf_counter() + seconds
    while True:
        f()
        if time.perf_counter() >= end:
            return


def _time_pair(fa, fb, calls: int, percentile: float, rounds: int = 4) -> tuple[float, float]:
    """The `percentile`-th percentile (50: the median) of `calls` single timed calls of fa and of fb, in
    microseconds, taken in `rounds` alternating blocks so that both see the same machine (other work
    on a shared 2-core machine comes and goes).

    Each block starts with 15 ms of untimed calls: what is timed is each op's steady state, not the
    switch between the two thread pools (after a parallel torch op its OpenMP worker spins for a few
    ms, holding one core, and inflight's parked pool worker has to be woken; the reverse for torch)."""
    a, b = [], []
    per_block = max(1, -(-calls // rounds))
    for i in range(rounds):
        for f, samples in ((fa, a), (fb, b)) if i % 2 == 0 else ((fb, b), (fa, a)):
            _warm(f, 0.015)
            for _ in range(per_block):
                t0 = time.perf_counter()
                f()
                samples.append(time.perf_counter() - t0)
    a.sort()
    b.sort()
    i = min(len(a) - 1, int(len(a) * percentile / 100))
    return a[i] * 1e6, b[i] * 1e6


def _cycle(items):
    """A function returning the items in turn, forever (cold-cache runs: each call uses the next copy)."""
    return itertools.cycle(items).__next__


def bench(
    k: int,
    n: int,
    dtype: torch.dtype,
    batches: list[int],
    threads: list[int],
    cache: str,
    calls: int,
    percentile: float,
) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    nbytes = w.numel() * w.element_size()
    copies = 1 if cache == "hot" else max(1, -(-COLD_BYTES // nbytes))
    # Separate copies per variant: with the variants alternating, a shared list would hand one the
    # weights the other had just pulled into the cache.
    ours_w, theirs_w = [w.clone() for _ in range(copies)], [w.clone() for _ in range(copies)]
    rows = []
    for m in batches:
        x = torch.randn(m, k, generator=gen).to(dtype)
        for t in threads:
            torch.set_num_threads(t)
            ours, theirs = _cycle(ours_w), _cycle(theirs_w)
            us_ours, us_torch = _time_pair(
                lambda x=x, w=ours: dense_gemm(x, w()),
                lambda x=x, w=theirs: F.linear(x, w()),
                calls,
                percentile,
            )
            rows.append(
                {
                    "k": k,
                    "n": n,
                    "m": m,
                    "dtype": str(dtype).removeprefix("torch."),
                    "threads": t,
                    "cache": cache,
                    "dense_gemm_us": us_ours,
                    "f_linear_us": us_torch,
                    "weight_gb_s": nbytes / us_ours / 1e3,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    ap.add_argument("--cache", choices=["cold", "hot", "both"], default="cold")
    ap.add_argument("--calls", type=int, default=0, help="timed calls per cell (default: by size, 20..400)")
    ap.add_argument(
        "--percentile",
        type=float,
        default=50.0,
        help="statistic of the timed calls (default 50: the median; on a busy machine a low one, "
        "e.g. 10, shows the time of calls no other process interrupted)",
    )
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args()

    before = torch.get_num_threads()
    print(f"torch {torch.__version__}, cpu isa: {_C.cpu_isa()}, threads: {args.threads}, cache: {args.cache}")
    print(
        f"{'shape':<26}{'dtype':>6}{'cache':>6}{'thr':>4}{'M':>4}{'dense_gemm':>12}{'F.linear':>10}"
        f"{'ratio':>8}{'GB/s':>7}   (us, percentile {args.percentile:g} of single calls; ratio = F.linear / "
        "dense_gemm)"
    )
    rows = []
    caches = ["cold", "hot"] if args.cache == "both" else [args.cache]
    try:
        for cache in caches:
            for name, k, n in SHAPES:
                for dname in args.dtypes:
                    calls = args.calls or max(20, min(400, int(4e8 / (n * k))))
                    for r in bench(
                        k, n, DTYPES[dname], args.batches, args.threads, cache, calls, args.percentile
                    ):
                        rows.append({"shape": name, **r})
                        print(
                            f"{name:<26}{dname:>6}{cache:>6}{r['threads']:>4}{r['m']:>4}"
                            f"{r['dense_gemm_us']:>12.1f}{r['f_linear_us']:>10.1f}"
                            f"{r['f_linear_us'] / r['dense_gemm_us']:>7.2f}x{r['weight_gb_s']:>7.1f}",
                            flush=True,
                        )
    finally:
        torch.set_num_threads(before)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
