"""INT8 and FP8 (E4M3) KV caches vs a bf16 KV cache on the CPU: decode attention time and concurrency,
in one process.

1. **Decode attention**: ``paged_attention`` for a batch of ``--batch`` sequences of ``--context``
   keys each, at SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64, 32-token
   blocks, shuffled), bf16 queries, over a bf16 cache, an int8 cache (codes + one fp32 scale per token
   and KV head) and an fp8 cache (E4M3 bytes, per-tensor scales). A decode step reads every layer's
   cache once, and 30 layers' caches do not fit in any cache level, so each timed step runs the op over
   ``--layers`` distinct caches (more bytes than the L3 holds) and the time is reported per layer; the
   dtypes take turns round by round (the order rotated), and the medians are compared (ratio = bf16 /
   int8 or bf16 / fp8: > 1 means the quantised cache is faster).
2. **Concurrency**: how many requests of ``--request-tokens`` tokens the KV pool of a fixed byte
   budget (``--budget-mib``) holds at once, the pool sized as the engine sizes it (bytes per token
   including the int8 scales; fp8 has none) and filled through the C++ KVCacheManager until it refuses one.

    python benchmarks/bench_kv_int8.py [--context 4096] [--batch 16] [--layers 8] [--rounds 7]
                                       [--budget-mib 1024] [--request-tokens 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch
from bench_common import cpu_header

from inflight.batch_manager import KVCacheManager
from inflight.executor.kv_cache_creator import kv_bytes_per_token
from inflight.ops import attention as ops
from inflight.ops import cpu_info
from inflight.ops.reference.attention import quantize_kv_fp8

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, TPB = 30, 9, 3, 64, 32  # SmolLM2-135M
KINDS = ("bf16", "int8", "fp8")
DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _tables(batch: int, context: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    per_seq = -(-context // TPB)
    num_blocks = batch * per_seq
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables = torch.tensor(ids, dtype=torch.int32).view(batch, per_seq)
    return tables, torch.full((batch,), context, dtype=torch.int32), num_blocks


def _caches(kind: str, layers: int, num_blocks: int, gen: torch.Generator):
    """``layers`` caches of ``kind`` (bf16 / int8 / fp8), as (cache, scales or None) pairs."""
    shape = (2, num_blocks, TPB, NUM_KV_HEADS, HEAD_DIM)
    out = []
    for _ in range(layers):
        if kind == "int8":
            codes = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
            out.append((codes, 0.01 * torch.rand(shape[:4], generator=gen) + 1e-3))
        elif kind == "fp8":  # E4M3 bytes (uint8) of normal-sized values, unit scales
            out.append((quantize_kv_fp8(torch.randn(shape, generator=gen)), None))
        else:
            out.append((torch.randn(shape, generator=gen).to(torch.bfloat16), None))
    return out


def bench_decode(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    tables, kv_lens, num_blocks = _tables(args.batch, args.context, seed=1)
    q = torch.randn(args.batch, NUM_HEADS, HEAD_DIM, generator=gen).bfloat16()
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    caches = {kind: _caches(kind, args.layers, num_blocks, gen) for kind in KINDS}

    def step(kind: str) -> None:
        for cache, scales in caches[kind]:
            ops.paged_attention(q, cache, tables, kv_lens, scale, out, kv_scales=scales)

    for kind in caches:  # warm-up: page in every cache, start the threads
        step(kind)
    samples: dict[str, list[float]] = {k: [] for k in caches}
    for r in range(args.rounds):
        for kind in KINDS[r % 3 :] + KINDS[: r % 3]:
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter_ns()
                step(kind)
                times.append((time.perf_counter_ns() - t0) / 1e3 / args.layers)
            samples[kind].append(statistics.median(times))
    med = {k: statistics.median(v) for k, v in samples.items()}
    kv_bytes = {
        k: args.batch * args.context * kv_bytes_per_token(1, NUM_KV_HEADS, HEAD_DIM, DTYPES[k]) for k in KINDS
    }
    return {
        "us_per_layer": med,
        "rounds_us_per_layer": samples,
        "kv_bytes_per_layer": kv_bytes,
        "read_gb_s": {k: kv_bytes[k] / (med[k] * 1e3) for k in med},
        "ratio_bf16_over_int8": med["bf16"] / med["int8"],
        "ratio_bf16_over_fp8": med["bf16"] / med["fp8"],
    }


def bench_concurrency(args) -> dict:
    budget = args.budget_mib << 20
    rows = {}
    for kind, dtype in DTYPES.items():
        bpt = kv_bytes_per_token(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, dtype)
        num_blocks = budget // (bpt * TPB)
        kv = KVCacheManager(num_blocks, TPB, args.request_tokens, False)
        served = 0
        while True:
            try:
                kv.add_sequence(served, args.request_tokens, 1, None)
            except RuntimeError:
                break
            served += 1
        rows[kind] = {
            "bytes_per_token": bpt,
            "num_blocks": num_blocks,
            "pool_mib": num_blocks * TPB * bpt / 2**20,
            "requests": served,
        }
    rows["ratio_int8_over_bf16"] = rows["int8"]["requests"] / max(rows["bf16"]["requests"], 1)
    rows["ratio_fp8_over_bf16"] = rows["fp8"]["requests"] / max(rows["bf16"]["requests"], 1)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096, help="keys per sequence")
    ap.add_argument("--batch", type=int, default=16, help="sequences per decode step")
    ap.add_argument("--layers", type=int, default=8, help="distinct caches per timed step (past the L3)")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds per dtype")
    ap.add_argument("--iters", type=int, default=5, help="timed steps per round")
    ap.add_argument("--budget-mib", type=int, default=1024, help="the fixed KV byte budget (MiB)")
    ap.add_argument("--request-tokens", type=int, default=2048, help="tokens of one request")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    load_start = os.getloadavg()
    print(cpu_header())
    info = cpu_info()
    print("cpu_info:", json.dumps(info, sort_keys=True))
    with torch.inference_mode():
        dec = bench_decode(args)
    conc = bench_concurrency(args)
    load_end = os.getloadavg()

    print(
        f"\nDecode attention, batch {args.batch} x {args.context} keys, heads {NUM_HEADS}/{NUM_KV_HEADS}, "
        f"head_dim {HEAD_DIM}, bf16 q, {args.layers} layers' caches per step, {args.rounds} rounds"
    )
    print(
        "| KV cache | us per layer (median) | KV MiB per layer | GB/s read | vs bf16 |\n|---|---:|---:|---:|---:|"
    )
    for kind in KINDS:
        us = dec["us_per_layer"][kind]
        print(
            f"| {kind} | {us:.0f} | {dec['kv_bytes_per_layer'][kind] / 2**20:.1f} | "
            f"{dec['read_gb_s'][kind]:.1f} | {dec['us_per_layer']['bf16'] / us:.2f}x |"
        )
    print(
        f"\nConcurrency: requests of {args.request_tokens} tokens in a {args.budget_mib} MiB KV budget "
        f"(SmolLM2: {NUM_LAYERS} layers, {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, {TPB}-token blocks)"
    )
    print("| KV cache | B/token | blocks | requests at once | vs bf16 |\n|---|---:|---:|---:|---:|")
    for kind in KINDS:
        r = conc[kind]
        print(
            f"| {kind} | {r['bytes_per_token']} | {r['num_blocks']} | {r['requests']} | "
            f"{r['requests'] / max(conc['bf16']['requests'], 1):.2f}x |"
        )
    print(f"\nload average: start {load_start[0]:.2f}, end {load_end[0]:.2f} ({os.cpu_count()} CPUs)")
    if args.json:
        result = {
            "header": cpu_header(),
            "cpu_info": info,
            "command": "python benchmarks/bench_kv_int8.py "
            + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json" and v is not None
            ),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "load_average": {"start": load_start, "end": load_end, "cpus": os.cpu_count()},
            "decode": dec,
            "concurrency": conc,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
