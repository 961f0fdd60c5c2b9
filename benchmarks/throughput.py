"""Offline throughput on SmolLM2-135M: inflight vs transformers `generate` (left padding), same dtype,
same prompts, same machine, in one run.

Cases:
  (a) 16 prompts of 16-200 tokens x 128 new tokens (ignore_eos)
  (b) 64 prompts of 16-500 tokens, output lengths 32-256; transformers runs batches of 16 in arrival
      order, each to its longest requested output, and only the requested tokens count
  (c) one prompt, 128 new tokens

    python benchmarks/throughput.py [--dtypes float32 bfloat16 auto q4-bfloat16] [--cases a b c]
        [--w8a8 DIR] [--json out.json]

--w8a8 DIR adds the row "w8a8": a SmoothQuant W8A8 checkpoint of SmolLM2 (`inflight quantize --method
smoothquant` of the GGUF dequantised to a Hugging Face directory), against transformers fp32.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

import torch


def make_cases(seed: int = 0) -> dict[str, list[tuple[list[int], int]]]:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]  # ordinary (non-special) token ids

    return {
        "a": [(prompt(rng.randint(16, 200)), 128) for _ in range(16)],
        "b": [(prompt(rng.randint(16, 500)), rng.randint(32, 256)) for _ in range(64)],
        "c": [(prompt(61), 128)],
    }


def run_inflight(llm, reqs) -> tuple[float, int]:
    from inflight import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n == sum(m for _, m in reqs), "inflight did not produce exactly the requested tokens"
    return dt, n


def run_transformers(model, reqs, batch_size: int = 16) -> tuple[float, int]:
    t0 = time.perf_counter()
    counted = 0
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), 0, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (p, _) in enumerate(batch):  # left padding
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        longest = max(n for _, n in batch)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] - width == longest
        counted += sum(n for _, n in batch)  # only the requested tokens count
    return time.perf_counter() - t0, counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16", "auto", "q4-bfloat16"],
        choices=["float32", "bfloat16", "auto", "q4-bfloat16"],
        help="float32 / bfloat16: dequantised weights on both sides; auto: inflight's native "
        "4-bit path (fp32 model; int16 activation codes into the GEMMs on an AVX512-VNNI CPU) vs "
        "transformers fp32; q4-bfloat16: inflight's 4-bit "
        "weights with bf16 activations (quantization='gguf') vs transformers bf16",
    )
    parser.add_argument("--cases", nargs="+", default=["a", "b", "c"])
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--w8a8", metavar="DIR", help="also a SmoothQuant W8A8 checkpoint (row 'w8a8')")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.w8a8:
        args.dtypes = [*args.dtypes, "w8a8"]

    from transformers import AutoModelForCausalLM, GgufConfig

    from inflight import LLM, KvCacheConfig
    from inflight.models.gguf_loader import resolve_known_model

    path = resolve_known_model("smollm2")
    cases = make_cases()
    rows = []
    from inflight.ops import describe_cpu

    print(f"CPU: {describe_cpu()}; threads: {torch.get_num_threads()}")
    print(f"{'case':>4} {'dtype':>11} {'inflight tok/s':>15} {'transformers tok/s':>19} {'ratio':>7}")
    for dtype in args.dtypes:
        # "auto": inflight's default for the GGUF (4-bit weights run natively, an fp32 model whose
        # GEMM inputs are int16 codes on a VNNI CPU), against transformers in fp32.
        # One engine alive at a time: a live LLM's executor thread holds an OpenMP pool of its own, and
        # with two pools libgomp stops spinning between parallel regions, which slowed transformers'
        # generate ~1.5x in the same process. Each engine runs all cases, then is released.
        if dtype == "q4-bfloat16":
            llm = LLM(
                "smollm2",
                dtype="bfloat16",
                quantization="gguf",
                activation_quantization="none",  # bf16 activations into the GEMMs too
                kv_cache_config=KvCacheConfig(max_tokens=64 * 1024),
            )
        elif dtype == "w8a8":
            llm = LLM(args.w8a8, kv_cache_config=KvCacheConfig(max_tokens=64 * 1024))
        else:
            llm = LLM("smollm2", dtype=dtype, kv_cache_config=KvCacheConfig(max_tokens=64 * 1024))
        run_inflight(llm, [(cases["c"][0][0], 8)])  # warm-up
        results = {case: run_inflight(llm, cases[case]) for case in args.cases}
        llm.shutdown()
        del llm
        gc.collect()
        hf_results = {}
        if not args.skip_transformers:
            hf_dtype = {"auto": torch.float32, "w8a8": torch.float32, "q4-bfloat16": torch.bfloat16}.get(
                dtype
            ) or getattr(torch, dtype)
            # Dense weights in hf_dtype (transformers may otherwise keep GGUF blocks packed).
            hf = AutoModelForCausalLM.from_pretrained(
                str(path.parent),
                gguf_file=path.name,
                dtype=hf_dtype,
                quantization_config=GgufConfig(dequantize=True),
            ).eval()
            hf.generation_config.eos_token_id = None
            hf_results = {case: run_transformers(hf, cases[case]) for case in args.cases}
            del hf
            gc.collect()
        for case in args.cases:
            t_if, n_if = results[case]
            row = dict(case=case, dtype=dtype, inflight_tok_s=n_if / t_if, inflight_s=t_if, tokens=n_if)
            hf_s = ""
            if case in hf_results:
                t_hf, n_hf = hf_results[case]
                row.update(
                    transformers_tok_s=n_hf / t_hf, transformers_s=t_hf, ratio=(n_if / t_if) / (n_hf / t_hf)
                )
                hf_s = f"{row['transformers_tok_s']:>19.1f} {row['ratio']:>6.2f}x"
            rows.append(row)
            print(f"{case:>4} {dtype:>11} {row['inflight_tok_s']:>15.1f} {hf_s}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
