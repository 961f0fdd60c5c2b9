"""The decoder's two costs on SmolLM2-135M (Q4_1 GGUF), each with its baseline in the same run:

1. Structured output: case (a) of throughput.py with and without a JSON-schema constraint, same engine.
2. Beam search: K=4 beams against transformers' generate(num_beams=4) on the same prompts and weights
   (benchmarks/bench_beam_search.py, which also runs alone with more options).

Case (a): 16 chat-templated prompts asking for a JSON record, up to 128 new tokens each, greedy.
Guided, each request ends when its JSON is complete (EOS) or at 128 tokens; unguided, each prompt
generates exactly the number of tokens its guided run did (EOS ignored), so that both batches shrink
alike. Throughput is generated tokens over wall time. Rounds alternate unguided / guided
(--repeats); medians.

Goals (issue 15): guided >= 0.9x unguided; beam search K=4 >= 2x transformers.

    python benchmarks/bench_decoder.py [--repeats 3] [--part guided|beams|all] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
    "additionalProperties": False,
}
PEOPLE = [
    "a retired sailor",
    "a young painter",
    "a chess coach",
    "a baker in Lyon",
    "a nurse",
    "a pilot",
    "a jazz drummer",
    "a botanist",
    "a cyclist",
    "a librarian",
    "a chef",
    "a student of physics",
    "a farmer",
    "a poet",
    "a mountain guide",
    "a software tester",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--part", choices=["guided", "beams", "all"], default="all")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = {}
    if args.part in ("guided", "all"):
        result["guided"] = guided_part(args)
    if args.part in ("beams", "all"):
        from bench_beam_search import run

        print()
        beams = run(4, 8, 32, args.repeats)
        result["beams"] = beams
        ratios = [r["ratio"] for r in beams["rows"] if r["engine"].startswith("inflight 4-bit")]
        print(
            f"goal (beam search K=4 >= 2x transformers): {', '.join(f'{x:.2f}x' for x in ratios)}, "
            f"{'met' if min(ratios) >= 2 else 'not met'}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def guided_part(args) -> dict:
    from inflight import LLM, GuidedDecodingParams, KvCacheConfig, SamplingParams
    from inflight.ops import describe_cpu

    llm = LLM("smollm2", kv_cache_config=KvCacheConfig(enable_block_reuse=False))
    prompts = [
        llm.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"Describe {p} as a JSON record with name, age, city, hobbies and employed.",
                }
            ]
        )
        for p in PEOPLE
    ]
    guided = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, guided_decoding=GuidedDecodingParams(json=SCHEMA)
    )
    llm.generate(prompts[:2], guided, use_tqdm=False)  # warm-up: the grammar compiles once
    # The unguided run generates exactly as many tokens per prompt as the guided one (EOS ignored), so
    # both batches shrink alike as requests finish: the difference is the cost of the masks.
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, guided, use_tqdm=False)]
    plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    rates: dict[str, list[float]] = {"unguided": [], "guided": []}
    valid = 0
    for _ in range(args.repeats):
        for name, params in (("unguided", plain), ("guided", guided)):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
            if name == "guided":
                for o in outs:
                    try:
                        json.loads(o.outputs[0].text)
                        valid += o.outputs[0].finish_reason == "stop"
                    except json.JSONDecodeError:
                        pass
    llm.shutdown()
    med = {k: statistics.median(v) for k, v in rates.items()}
    header = f"CPU: {describe_cpu()}, {torch.get_num_threads()} threads"
    print(
        f"\n{header}\nSmolLM2-135M Q4_1, 16 prompts x {min(lengths)}-{max(lengths)} tokens (mean "
        f"{sum(lengths) / len(lengths):.0f}, as the guided runs ended), greedy, {args.repeats} rounds"
    )
    print("\n| run | tok/s (median) | vs unguided |\n|---|---:|---:|")
    for k in ("unguided", "guided"):
        print(f"| {k} | {med[k]:.1f} | {med[k] / med['unguided']:.2f}x |")
    ratio = med["guided"] / med["unguided"]
    print(f"\nguided outputs that parse as JSON and ended on EOS: {valid} of {16 * args.repeats}")
    print(f"goal (guided >= 0.9x unguided): {ratio:.2f}x, {'met' if ratio >= 0.9 else 'not met'}")
    return {"header": header, "lengths": lengths, "rates": rates, "median": med, "valid": valid}


if __name__ == "__main__":
    main()
