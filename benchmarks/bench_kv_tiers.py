"""Time to first token of a request whose long prefix sits in the disk tier, against recomputing it.

Two engines of the same model in one process, each with a primary KV pool that holds one request:

- **disk tier**: ``KvCacheConfig(host_cache_size=..., host_cache_path=FILE)`` (block reuse on): a
  request of ``--prefix`` tokens (+ a short tail) runs, an unrelated prompt of the same length evicts its
  blocks from the primary pool (they are offloaded to the file), then the prefix with a new tail is
  timed: its prefix blocks are onboarded from the tier and only the tail is prefilled.
- **memory tier**: the same with the tier in host memory (no ``host_cache_path``), for reference.
- **recompute** (the baseline): the same requests without a secondary tier: the evicted prefix is
  prefilled again.

Each round runs every engine (the order alternating); the table shows median time to first token
(the response's ``ttft``: queueing + prefill + the first token) and the ratio recompute / disk tier
(> 1: the tier is faster). The tier file is written shortly before it is read, so its pages are usually still
in the page cache: the figure is the warm case of the disk tier (a cold read adds the disk's time for
``--prefix`` tokens of KV, the bytes shown).

- **after restart** (the persistent tier, docs/batch-manager.md §3.10): the disk-tier engine is shut down
  (its index written, the primary pool's cached blocks moved into the file), and each round a new ``LLM`` on
  the same file starts, adopts the tier, serves one short unrelated request (its one-time warm-up) and then
  the prefix with a new tail, timed: the prefix comes from the file. Twice per round: with the file's pages
  in the page cache, and with them dropped first (``posix_fadvise(DONTNEED)``). Adopting reads and hashes
  every adopted block (their digests are checked), so the cold read is paid at start-up: the table shows the
  engine's start-up time (``LLM(...)``: weights, the weights' digest, the adoption) beside the TTFT.

    python benchmarks/bench_kv_tiers.py [--model smollm2] [--prefix 2048] [--rounds 5] [--dir DIR]
                                        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

import torch
from bench_common import cpu_header

from inflight import KvCacheConfig
from inflight.llm import LLM
from inflight.ops import cpu_info
from inflight.sampling_params import SamplingParams

TAIL = 16  # tokens after the prefix: the part prefilled on a hit


def _engine(model: str, pool_tokens: int, tpb: int, tier_path: str | None, tier_bytes: int) -> LLM:
    kv = KvCacheConfig(
        max_tokens=pool_tokens,
        tokens_per_block=tpb,
        host_cache_size=tier_bytes or None,
        host_cache_path=tier_path,
    )
    return LLM(model, kv_cache_config=kv, max_seq_len=pool_tokens)


def _ttft(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False
    )
    return out[0].metrics["ttft"]


def _drop_page_cache(path: str) -> None:
    """Drops the file's clean pages from the page cache (its dirty pages are written first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefix", type=int, default=2048, help="tokens of the shared prefix")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--dir", default=None, help="directory of the tier file (default: a temporary one)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    print(cpu_header())
    print("cpu_info:", cpu_info())
    tpb = args.tokens_per_block
    pool_tokens = -(-(args.prefix + TAIL + 1) // tpb) * tpb  # one request, not two
    workdir = args.dir or tempfile.mkdtemp(prefix="bench-kv-tiers-")
    tier_path = os.path.join(workdir, "kv-tier.bin")
    # Room for a few prefixes: the evictors' blocks are offloaded too.
    base = _engine(args.model, pool_tokens, tpb, None, 0)
    bpt = base.kv_budget.bytes_per_token
    tier = _engine(args.model, pool_tokens, tpb, tier_path, 4 * pool_tokens * bpt)
    memory = _engine(args.model, pool_tokens, tpb, None, 4 * pool_tokens * bpt)
    vocab = base.model_config.vocab_size

    rng = random.Random(0)

    def rand(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    prefix = rand(args.prefix)
    engines = {"disk tier": tier, "memory tier": memory, "recompute": base}
    for llm in engines.values():  # warm-up, and the prefix's first computation
        _ttft(llm, prefix + rand(TAIL))
    times: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(args.rounds):
        evictor = rand(args.prefix + TAIL)
        tail = rand(TAIL)
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            llm = engines[name]
            _ttft(llm, evictor)  # pushes the prefix out of the primary pool
            times[name].append(_ttft(llm, prefix + tail))
    stats = tier.executor.kv_cache_manager.get_kv_cache_stats()
    assert stats["onboarded_blocks"] >= args.rounds * (args.prefix // tpb), stats

    # After a restart: a new LLM on the same file, its first prefix request served from the file.
    tier.shutdown()
    restart_cases = {"after restart": False, "after restart, pages dropped": True}
    startup: dict[str, list[float]] = {k: [] for k in restart_cases}
    adopted: list[int] = []
    for name in restart_cases:
        times[name] = []
    for _ in range(args.rounds):
        for name, cold in restart_cases.items():
            if cold:
                _drop_page_cache(tier_path)
            t0 = time.perf_counter()
            llm = _engine(args.model, pool_tokens, tpb, tier_path, 4 * pool_tokens * bpt)
            startup[name].append(time.perf_counter() - t0)
            adopted.append(
                llm.executor.kv_cache_manager.get_kv_cache_stats()["reusable_num_secondary_blocks"]
            )
            _ttft(llm, rand(TAIL))  # the engine's one-time warm-up, on a prompt that shares nothing
            times[name].append(_ttft(llm, prefix + rand(TAIL)))
            after = llm.executor.kv_cache_manager.get_kv_cache_stats()
            assert after["secondary_reused_blocks"] >= args.prefix // tpb, (
                after
            )  # the prefix came from the file
            llm.shutdown()  # writes the index again (the prefix flushed back into the file)
    engines.update(dict.fromkeys(restart_cases))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["recompute"] / med["disk tier"]
    restart_ratio = {k: med["recompute"] / med[k] for k in restart_cases}
    kv_mib = args.prefix * bpt / 2**20
    print(
        f"\nmodel {args.model}, prefix {args.prefix} tokens (+{TAIL}), {tpb}-token blocks, primary pool "
        f"{pool_tokens} tokens, torch threads {torch.get_num_threads()}; tier file {tier_path}"
    )
    print(
        f"prefix KV: {kv_mib:.1f} MiB ({bpt} B/token); tier stats: onboarded {stats['onboarded_blocks']}, "
        f"offloaded {stats['offloaded_blocks']}, secondary hit rate {stats['secondary_hit_rate']:.2f}"
    )
    print(
        f"after restart: adopted {min(adopted)}..{max(adopted)} cached blocks per start; engine start-up "
        + ", ".join(f"{k} {statistics.median(v):.2f} s" for k, v in startup.items())
    )
    print("\n| case | median TTFT (ms) | min (ms) | rounds | recompute / case |\n|---|---:|---:|---:|---:|")
    for name in engines:
        print(
            f"| {name} | {1e3 * med[name]:.1f} | {1e3 * min(times[name]):.1f} | {len(times[name])} "
            f"| {med['recompute'] / med[name]:.2f}x |"
        )
    print(f"\nratio recompute / disk tier: {ratio:.2f}x")
    for name, r in restart_ratio.items():
        print(f"ratio recompute / {name}: {r:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "header": cpu_header(),
                    "times_s": times,
                    "median_s": med,
                    "ratio": ratio,
                    "restart_ratio": restart_ratio,
                    "restart_startup_s": startup,
                    "restart_adopted_blocks": adopted,
                    "kv_stats": stats,
                },
                f,
                indent=1,
            )
    for llm in engines.values():
        if llm is not None:
            llm.shutdown()
    if args.dir is None:
        os.remove(tier_path)
        os.rmdir(workdir)


if __name__ == "__main__":
    main()
