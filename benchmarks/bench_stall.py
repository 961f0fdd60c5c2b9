"""How long one long prompt freezes everyone else's stream: a stream decodes while an 8,000-token prompt
arrives; the stream's longest gap between tokens is the stall. SmolLM2-135M (its GGUF), same run for
every configuration:

  offline    LLM's defaults: chunked prefill off, 8192-token budget (the whole prompt in one step)
  chunk-N    chunked prefill on, an N-token budget (--budgets; `inflight serve` runs with chunked
             prefill on and the budget of serve/server.py's SERVE_DEFAULTS)

Also reported: the long prompt's time to first token (what fairness costs it) and the stream's median
gap (its decode step).

    python benchmarks/bench_stall.py [--prompt-tokens 8000] [--budgets 2048 512 256] [--no-offline]
        [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import platform
import statistics
import sys
import time

OFFLINE = {"enable_chunked_prefill": False, "max_num_tokens": 8192}


async def _measure(llm, prompt_tokens: int) -> dict:
    from inflight import SamplingParams

    stamps: list[float] = []
    long_done: dict[str, float] = {}
    stream = llm.generate_async(
        [100 + i for i in range(16)],
        SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
        streaming=True,
    )
    t_long = None
    long_handle = None
    async for _ in stream:
        stamps.append(time.perf_counter())
        if len(stamps) == 40:  # the stream is in steady decode: the long prompt arrives
            t_long = time.perf_counter()
            long_handle = llm.generate_async(
                [200 + i % 40000 for i in range(prompt_tokens)], SamplingParams(max_tokens=1, temperature=0.0)
            )
        if long_handle is not None and "ttft" not in long_done and long_handle.done:
            long_done["ttft"] = time.perf_counter() - t_long
    await long_handle
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    during = [b - a for a, b in itertools.pairwise(stamps) if b >= t_long]
    return {
        "max_stall_s": max(during),
        "median_gap_ms": statistics.median(gaps) * 1e3,
        "long_prompt_ttft_s": long_handle.result().metrics.get("ttft", float("nan")),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budgets", type=int, nargs="+", default=[2048, 512, 256], help="chunked-prefill budgets")
    p.add_argument("--no-offline", action="store_true", help="skip the unchunked configuration")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    configs = {} if args.no_offline else {"offline": OFFLINE}
    for budget in args.budgets:
        configs[f"chunk-{budget}"] = {"enable_chunked_prefill": True, "max_num_tokens": budget}

    from inflight import LLM, KvCacheConfig

    with open("/proc/cpuinfo") as f:
        cpu = next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
            platform.processor(),
        )
    rows = []
    print(f"CPU: {cpu}; a stream decoding while a {args.prompt_tokens}-token prompt prefills (SmolLM2-135M)")
    print(f"{'config':<10} {'max stall s':>12} {'stream median gap ms':>21} {'long prompt TTFT s':>19}")
    for _ in range(args.repeats):
        for name, kwargs in configs.items():
            with LLM("smollm2", kv_cache_config=KvCacheConfig(max_tokens=16384), **kwargs) as llm:
                row = {"config": name, **kwargs, **asyncio.run(_measure(llm, args.prompt_tokens))}
            rows.append(row)
            print(
                f"{name:<10} {row['max_stall_s']:>12.2f} {row['median_gap_ms']:>21.1f} "
                f"{row['long_prompt_ttft_s']:>19.2f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "prompt_tokens": args.prompt_tokens, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
