"""Fused CPU sampling (``inflight.ops.sample``) vs the torch path, V = 49152 (SmolLM2's vocabulary).

Baseline ("torch"): what the sampler runs off the CPU and ran before the fused op: temperature, a
full stable sort for top-k / top-p (``apply_temperature_top_k_top_p_min_p``), softmax, one Exp(1)
per logit and ``argmax(p / E)``. Native: the fused op, the per-row parameters prebuilt, as the
sampler passes them. Same process, same threads; median microseconds and the speed-up, per batch
size N and per filter. Two logit shapes: "llm" (a head of ~40 plausible tokens over a low bulk,
as real next-token distributions) and "flat" (randn * 3: thousands of tokens in a top-p 0.9 set,
the op's worst case).

    python benchmarks/bench_sampling_cpu.py [--sizes 1 16 64] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from inflight import _C
from inflight.ops.reference.sampling import apply_temperature_top_k_top_p_min_p
from inflight.ops.sampling import sample

VOCAB = 49152

# name: (temperature, top_k, top_p, min_p)
FILTERS: dict[str, tuple[float, int, float, float]] = {
    "T=1": (1.0, 0, 1.0, 0.0),
    "top-k 50": (1.0, 50, 1.0, 0.0),
    "top-p 0.9": (1.0, 0, 0.9, 0.0),
    "k50 p.95 minp.05 T.8": (0.8, 50, 0.95, 0.05),
    "min-p 0.05": (1.0, 0, 1.0, 0.05),
    "greedy": (0.0, 0, 1.0, 0.0),
}


def _time_us(fn: Callable[[], object], min_time: float = 0.3, max_iters: int = 2000) -> float:
    fn()  # warm-up
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < max_iters and (time.perf_counter() - start < min_time or len(samples) < 5):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(samples)


def make_logits(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return torch.randn(n, VOCAB, generator=gen) * 3
    logits = torch.randn(n, VOCAB, generator=gen) * 2
    head = torch.randint(0, VOCAB, (n, 40), generator=gen)
    return logits.scatter_(1, head, 8 + torch.randn(n, 40, generator=gen) * 3)


def torch_path(logits: torch.Tensor, t: float, k: int, p: float, mp: float) -> torch.Tensor:
    n = logits.shape[0]
    if t == 0.0:
        return logits.argmax(dim=-1)
    x = apply_temperature_top_k_top_p_min_p(
        logits,
        temperature=torch.full((n,), t),
        top_k=torch.full((n,), k) if k else None,
        top_p=torch.full((n,), p) if p < 1.0 else None,
        min_p=torch.full((n,), mp) if mp > 0.0 else None,
    )
    probs = torch.softmax(x, dim=-1)
    noise = torch.empty_like(probs).exponential_().clamp_min_(torch.finfo(probs.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)


def bench(kind: str, n: int, params: tuple[float, int, float, float]) -> tuple[float, float]:
    logits = make_logits(kind, n)
    t, k, p, mp = params
    cols = (
        np.full(n, t, np.float32),
        np.full(n, k, np.int32),
        np.full(n, p, np.float32),
        np.full(n, mp, np.float32),
        np.arange(n, dtype=np.uint64),
        np.zeros(n, np.int64),
    )
    out = torch.empty(n, dtype=torch.int64)
    t_native = _time_us(lambda: sample(logits, *cols, out=out))
    t_torch = _time_us(lambda: torch_path(logits, t, k, p, mp), max_iters=200)
    return t_native, t_torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--kinds", nargs="+", default=["llm", "flat"], choices=["llm", "flat"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"CPU sampling, V={VOCAB}, ISA {_C.cpu_isa()}, {torch.get_num_threads()} threads")
    header = f"{'logits':<6} {'N':>3} {'filter':<22} {'fused us':>10} {'torch us':>10} {'speed-up':>9}"
    print(header)
    print("-" * len(header))
    rows = []
    with torch.inference_mode():
        for kind in args.kinds:
            for n in args.sizes:
                for name, params in FILTERS.items():
                    t_native, t_torch = bench(kind, n, params)
                    rows.append(
                        {
                            "logits": kind,
                            "n": n,
                            "filter": name,
                            "fused_us": t_native,
                            "torch_us": t_torch,
                            "speedup": t_torch / t_native,
                        }
                    )
                    print(
                        f"{kind:<6} {n:>3} {name:<22} {t_native:>10.1f} {t_torch:>10.1f} {t_torch / t_native:>8.1f}x"
                    )
    if args.json:
        meta = {
            "isa": _C.cpu_isa(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "vocab": VOCAB,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
