"""Scheduling demo of the C++ batch manager (the README's first command until the executor lands).

48 requests with shared prompt prefixes arrive over time; a small KV pool and MAX_UTILIZATION make
the capacity scheduler pause and later recompute requests; chunked prefill splits long prompts. The
model is a stand-in (see inflight.executor.simulator), everything else is the real C++ runtime.
"""

from __future__ import annotations

import argparse
import random

from inflight.batch_manager import (
    CapacitySchedulerPolicy,
    ContextChunkingConfig,
    ContextChunkingPolicy,
    KVCacheManager,
    LlmRequest,
)
from inflight.executor.scheduler import BindCapacityScheduler, BindMicroBatchScheduler, SimpleScheduler
from inflight.executor.simulator import SchedulingSimulator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--num-blocks", type=int, default=48)
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument(
        "--policy", default="MAX_UTILIZATION", choices=list(CapacitySchedulerPolicy.__members__)
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    kv = KVCacheManager(args.num_blocks, args.tokens_per_block, max_seq_len=512, enable_block_reuse=True)
    scheduler = SimpleScheduler(
        BindCapacityScheduler(16, kv, policy=args.policy),
        BindMicroBatchScheduler(
            max_batch_size=8,
            max_num_tokens=128,
            ctx_chunk_config=ContextChunkingConfig(ContextChunkingPolicy.FIRST_COME_FIRST_SERVED, 16),
        ),
    )
    sim = SchedulingSimulator(scheduler, kv)
    system_prompts = [[rng.randrange(32000) for _ in range(48)] for _ in range(3)]
    pending = []
    for i in range(args.num_requests):
        prompt = rng.choice(system_prompts) + [rng.randrange(32000) for _ in range(rng.randint(1, 120))]
        pending.append(
            (
                rng.randint(0, 60),
                LlmRequest(i, rng.randint(4, 64), prompt, priority=rng.choice([0.5, 0.5, 0.9])),
            )
        )
    pending.sort(key=lambda p: p[0])

    print(f"KV pool: {args.num_blocks} blocks x {args.tokens_per_block} tokens; policy {args.policy}")
    print(f"{'step':>4} {'ctx (id:chunk)':<34} {'gen':>4} {'paused':<12} {'tokens':>6} {'free':>5}")
    step = 0
    total_paused = 0
    while pending or not sim.idle:
        while pending and pending[0][0] <= step:
            sim.add_request(pending.pop(0)[1])
        rec = sim.step()
        total_paused += len(rec.paused_ids)
        if rec.context_ids or rec.paused_ids or step % 10 == 0:
            ctx = " ".join(f"{i}:{c}" for i, c in zip(rec.context_ids, rec.context_chunk_sizes))
            print(
                f"{step:>4} {ctx[:34]:<34} {len(rec.generation_ids):>4} {str(rec.paused_ids)[:12]:<12} "
                f"{rec.num_tokens:>6} {rec.num_free_blocks:>5}"
            )
        step += 1
    stats = kv.get_kv_cache_stats()
    print(f"\n{len(sim.finished)} requests finished in {step} steps; {total_paused} preemptions")
    print(
        f"prefix reuse: {stats.reused_blocks} blocks reused, {stats.missed_blocks} missed, "
        f"hit rate {stats.cache_hit_rate:.1%}; all blocks free at the end: {stats.used_num_blocks == 0}"
    )
    kv.check_integrity()


if __name__ == "__main__":
    main()
