"""CPU attention kernels vs the plain-torch reference, at SmolLM2-135M shapes.

9 query heads, 3 KV heads, head_dim 64, 32 tokens per block, shuffled blocks. For each case and
dtype: the native op (``inflight.ops.attention``) and its plain-torch twin
(``inflight.ops.reference.attention``, the same batched gather + matmul + softmax the torch backend
runs) in the same process, same threads; median microseconds and the speed-up.

    python benchmarks/bench_attention_cpu.py [--dtypes fp32,bf16] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from inflight import _C
from inflight.ops import attention as native
from inflight.ops.reference import attention as reference

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, TOKENS_PER_BLOCK = 9, 3, 64, 32
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _time_us(fn: Callable[[], object], min_time: float = 0.3, max_iters: int = 2000) -> float:
    fn()  # warm-up
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < max_iters and (time.perf_counter() - start < min_time or len(samples) < 5):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(samples)


def _paged_setup(kv_lens: list[int], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tpb = TOKENS_PER_BLOCK
    blocks_per_seq = [-(-n // tpb) for n in kv_lens]
    num_blocks = sum(blocks_per_seq) + 4
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    cache = torch.randn(2, num_blocks, tpb, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    tables = torch.zeros(len(kv_lens), max(blocks_per_seq), dtype=torch.int32)
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = torch.tensor([ids.pop() for _ in range(nb)], dtype=torch.int32)
    return cache, tables, torch.tensor(kv_lens, dtype=torch.int32), gen


def bench_paged(batch: int, kv_len: int, dtype: torch.dtype) -> tuple[float, float]:
    cache, tables, kv_lens, gen = _paged_setup([kv_len] * batch, dtype)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    t_native = _time_us(lambda: native.paged_attention(q, cache, tables, kv_lens, scale, out))
    t_ref = _time_us(lambda: reference.paged_attention(q, cache, tables, kv_lens, scale))
    return t_native, t_ref


def bench_context(q_lens: list[int], cached: int, dtype: torch.dtype) -> tuple[float, float]:
    kv = [cached + n for n in q_lens]
    cache, tables, kv_lens, gen = _paged_setup(kv, dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    t_native = _time_us(lambda: native.context_attention(q, cache, tables, cu, kv_lens, scale, out))
    t_ref = _time_us(lambda: reference.context_attention(q, cache, tables, cu, kv_lens, scale))
    return t_native, t_ref


CASES: list[tuple[str, Callable[[torch.dtype], tuple[float, float]]]] = [
    ("paged_attention  batch 1, kv 128", lambda d: bench_paged(1, 128, d)),
    ("paged_attention  batch 1, kv 1024", lambda d: bench_paged(1, 1024, d)),
    ("paged_attention  batch 16, kv 128", lambda d: bench_paged(16, 128, d)),
    ("paged_attention  batch 16, kv 1024", lambda d: bench_paged(16, 1024, d)),
    ("context_attention 1 x 512", lambda d: bench_context([512], 0, d)),
    ("context_attention 4 x 128", lambda d: bench_context([128] * 4, 0, d)),
    ("context_attention 4 x 128 after 384 cached", lambda d: bench_context([128] * 4, 384, d)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = []
    print(
        f"CPU attention, SmolLM2 shapes (heads {NUM_HEADS}/{NUM_KV_HEADS}, head_dim {HEAD_DIM}, "
        f"tpb {TOKENS_PER_BLOCK}), ISA {_C.cpu_isa()}, {torch.get_num_threads()} threads"
    )
    header = f"{'case':<44} {'dtype':>5} {'native us':>10} {'torch us':>10} {'speed-up':>9}"
    print(header)
    print("-" * len(header))
    with torch.inference_mode():
        for name, fn in CASES:
            for dname in args.dtypes.split(","):
                t_native, t_ref = fn(DTYPES[dname])
                rows.append(
                    {
                        "case": name,
                        "dtype": dname,
                        "native_us": t_native,
                        "torch_us": t_ref,
                        "speedup": t_ref / t_native,
                    }
                )
                print(f"{name:<44} {dname:>5} {t_native:>10.1f} {t_ref:>10.1f} {t_ref / t_native:>8.1f}x")
    if args.json:
        meta = {"isa": _C.cpu_isa(), "threads": torch.get_num_threads(), "torch": torch.__version__}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
