"""One full scheduling step, C++ batch manager vs its pure-Python twin, in the same run.

A step = capacity scheduling + micro-batch scheduling (chunked context, token budget) + writing the
block tables of the scheduled batch into an int32 array. Active requests are in mixed states: ~60 %
generating, ~20 % contexts part-way through chunked prefill, ~20 % new. Binding costs are included:
the C++ side gets the executor's RequestList (no per-step conversion); "C++ (list)" shows the cost of
passing a plain Python list instead.

    python benchmarks/bench_scheduler.py [--sizes 256 1024 4096] [--policy GUARANTEED_NO_EVICT] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np

from inflight.batch_manager import (
    CapacityScheduler,
    CapacitySchedulerPolicy,
    ContextChunkingConfig,
    ContextChunkingPolicy,
    KVCacheManager,
    LlmRequest,
    LlmRequestState,
    MicroBatchScheduler,
    RequestList,
)
from inflight.batch_manager import reference as ref

TOKENS_PER_BLOCK = 32
MAX_SEQ_LEN = 4096
MAX_NUM_TOKENS = 8192


def make_requests(n: int, kv, seed: int) -> list[LlmRequest]:
    """n requests in mixed states, their sequences already in `kv` where they have started."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(32000) for _ in range(rng.randint(16, 512))]
        req = LlmRequest(i, rng.randint(64, 512), prompt)
        kind = rng.random()
        if kind < 0.6:  # generating
            kv.add_sequence(i, req.prompt_len, 1, req)
            req.set_context_chunk_size(req.prompt_len)
            req.move_to_next_context_chunk()
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
            for _ in range(rng.randint(1, 48)):
                req.add_new_token(rng.randrange(32000))
                kv.add_token(i)
            req.add_new_token(rng.randrange(32000))
        elif kind < 0.8:  # context part-way through
            kv.add_sequence(i, req.prompt_len, 1, req)
            req.set_context_chunk_size(min(req.prompt_len - 1, 64))
            req.move_to_next_context_chunk()
        reqs.append(req)
    return reqs


def build(n: int, policy, impl: str, seed: int):
    kv_cls = ref.KVCacheManager if impl == "twin" else KVCacheManager
    cap_cls = ref.CapacityScheduler if impl == "twin" else CapacityScheduler
    mb_cls = ref.MicroBatchScheduler if impl == "twin" else MicroBatchScheduler
    kv = kv_cls(n * (512 + 560) // TOKENS_PER_BLOCK + 64, TOKENS_PER_BLOCK, MAX_SEQ_LEN, False)
    reqs = make_requests(n, kv, seed)
    cap = cap_cls(n, policy)
    mb = mb_cls(ContextChunkingConfig(ContextChunkingPolicy.FIRST_COME_FIRST_SERVED, 64), None)
    active = RequestList(reqs) if impl == "cpp" else reqs
    table = np.zeros((n, kv.max_blocks_per_seq), dtype=np.int32)

    def step():
        fitting, _paused = cap.schedule(active, kv)
        ctx, gen = mb.schedule(fitting, set(), n, MAX_NUM_TOKENS)
        # Block tables of every scheduled request that holds KV already (new contexts get theirs in
        # prepare_resources, which would change the state this benchmark repeats).
        started = [r for r in ctx if not r.is_first_context_chunk]
        if impl == "cpp":
            kv.copy_block_tables(RequestList(started) + gen, table)
        else:
            kv.copy_block_tables([r.request_id for r in started] + [r.request_id for r in gen], table)
        return len(ctx), len(gen)

    return step


def time_step(step, min_time: float) -> float:
    step()  # warm-up
    samples = []
    deadline = time.perf_counter() + min_time
    while time.perf_counter() < deadline or len(samples) < 5:
        t0 = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description="C++ vs Python-twin scheduling step")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument(
        "--policy", default="GUARANTEED_NO_EVICT", choices=list(CapacitySchedulerPolicy.__members__)
    )
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds of timing per case")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    policy = CapacitySchedulerPolicy[args.policy]

    rows = []
    print(
        f"policy {args.policy}, max_num_tokens {MAX_NUM_TOKENS}, FCFS chunking (unit 64), tpb {TOKENS_PER_BLOCK}"
    )
    print(
        f"{'requests':>8} {'scheduled (ctx+gen)':>20} {'C++ us':>9} {'C++ list us':>12} {'twin us':>10} {'twin/C++':>9}"
    )
    for n in args.sizes:
        cpp = build(n, policy, "cpp", seed=n)
        cpp_list = build(n, policy, "cpp_list", seed=n)
        twin = build(n, policy, "twin", seed=n)
        scheduled = cpp()
        if scheduled != twin():
            raise SystemExit(f"C++ and twin disagree at n={n}: {scheduled} vs {twin()}")
        t_cpp = time_step(cpp, args.min_time)
        t_list = time_step(cpp_list, args.min_time)
        t_twin = time_step(twin, max(args.min_time, 0.5))
        rows.append(
            dict(
                num_requests=n,
                num_context=scheduled[0],
                num_generation=scheduled[1],
                cpp_us=t_cpp,
                cpp_list_us=t_list,
                twin_us=t_twin,
                ratio=t_twin / t_cpp,
            )
        )
        print(
            f"{n:>8} {f'{scheduled[0]}+{scheduled[1]}':>20} {t_cpp:>9.1f} {t_list:>12.1f} {t_twin:>10.0f} "
            f"{t_twin / t_cpp:>8.0f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(policy=args.policy, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
