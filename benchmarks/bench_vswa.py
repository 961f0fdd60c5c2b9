"""KV bytes per token of a long Gemma 3 request with sliding-window pools (VSWA) against one pool.

Gemma 3 270M has 18 layers: 15 slide over 512 tokens, 3 are global. With one pool every layer keeps
the KV of every token; with ``KvCacheConfig(sliding_window_pools=True)`` the sliding layers release the
blocks their window no longer sees, so their share stays at about 512 tokens whatever the length. Two
engines of the same model in one process, the same byte budget, the same request (a ``--context``-token
prompt, chunked prefill, ``--new`` greedy tokens):

- the KV the request holds at its last decode step (every pool, every layer), per token of the request;
- the sequences of max_seq_len that fit at once in the same bytes (the engines' planners);
- the total time of each (prefill and decode; the fused CPU stack in both), and whether the greedy
  tokens are identical.

    python benchmarks/bench_vswa.py [--model gemma3-270m] [--context 8192] [--new 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from bench_common import cpu_header

from inflight import KvCacheConfig
from inflight.executor.resource_manager import KVCacheResourceManager
from inflight.llm import LLM
from inflight.ops import cpu_info
from inflight.sampling_params import SamplingParams


def _run(model: str, args, vswa: bool, prompt: list[int]) -> dict:
    kv = KvCacheConfig(max_tokens=args.pool_tokens, sliding_window_pools=vswa)
    llm = LLM(
        model,
        kv_cache_config=kv,
        max_seq_len=args.context + args.new + 64,
        enable_chunked_prefill=True,
        max_num_tokens=args.chunk,
    )
    held: dict = {}
    original = KVCacheResourceManager.prepare_resources

    def prepare(self, batch):  # the blocks the request holds in each pool after each step's allocation
        original(self, batch)
        for req in batch.generation_requests:
            rid = req.request_id
            pools = [
                (self, self.impl.get_num_held_blocks(rid) if vswa else len(self.impl.get_block_ids(rid)))
            ]
            pools += [(g.kv, g.kv.impl.get_num_held_blocks(rid)) for g in self.window_groups]
            held["bytes"] = sum(n * m.block_bytes for m, n in pools)
            held["tokens"] = self.impl.get_num_tokens(rid)
            held["blocks"] = [n for _, n in pools]

    KVCacheResourceManager.prepare_resources = prepare
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        total = time.perf_counter() - t0
    finally:
        KVCacheResourceManager.prepare_resources = original
    manager = llm.executor.kv_cache_manager
    if manager.window_plan is not None:  # the planner's split (kv_cache_creator.plan_window_pools)
        seqs = manager.window_plan.sequences
    else:
        seqs = manager.num_blocks / -(-llm.max_seq_len // manager.tokens_per_block)
    ttft = out.metrics.get("ttft") if isinstance(getattr(out, "metrics", None), dict) else None
    llm.shutdown()
    return {
        "vswa": vswa,
        "tokens": out.token_ids,
        "kv_bytes": held["bytes"],
        "kv_tokens": held["tokens"],
        "held_blocks": held["blocks"],
        "bytes_per_token": held["bytes"] / held["tokens"],
        "pool_bytes": manager.bytes,
        "sequences_at_max_seq_len": seqs,
        "seconds": total,
        "ttft": ttft,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens generated")
    ap.add_argument("--chunk", type=int, default=1024, help="max_num_tokens: the prefill chunk")
    ap.add_argument("--pool-tokens", type=int, default=3 * 8192, help="KV budget of one pool, in tokens")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    print(cpu_header())
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 200000) for _ in range(args.context)]
    rows = [_run(args.model, args, vswa, prompt) for vswa in (False, True)]
    base, vswa = rows
    ratio = base["bytes_per_token"] / vswa["bytes_per_token"]
    print(f"\n{args.model}: a {args.context}-token prompt + {args.new} greedy tokens, chunks of {args.chunk}")
    print(
        "| KV layout | held blocks (pools) | KV bytes / token | seqs of max_seq_len in the budget | total s |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {'VSWA (sliding-window pools)' if r['vswa'] else 'one pool (baseline)'} | {r['held_blocks']} | "
            f"{r['bytes_per_token']:.0f} | {r['sequences_at_max_seq_len']:.2f} | {r['seconds']:.1f} |"
        )
    same = base["tokens"] == vswa["tokens"]
    print(f"\nKV bytes per token: {ratio:.2f}x less with VSWA; greedy tokens identical: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"cpu": cpu_info(), "args": vars(args), "rows": rows, "ratio": ratio, "identical": same},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
