"""GGUF K-quant files run natively vs dequantised: Gemma 3 270M (Q4_K_M GGUF: Q5_0, Q4_K, Q6_K and Q8_0
tensors) decode speed on the CPU, in one run, one system at a time.

Systems:
  inflight          LLM("gemma3-270m"): every tensor type of the file runs natively (Q5_0 / Q8_0 / Q6_K as
                    W8A16, Q4_K as W4A16, the Q8_0 tied embedding as the W8A16 LM head), fp32 model,
                    activation_quantization "auto" (int16 activations into the GEMMs on an AVX512-VNNI CPU)
  inflight-fp32act  the same with fp32 activations into the GEMMs (activation_quantization="none")
  inflight-bf16     LLM("gemma3-270m", dtype="bfloat16", quantization="gguf"): the same native weights,
                    bf16 activations (and bf16 KV)
  inflight-bf16-deq LLM("gemma3-270m", dtype="bfloat16"): every weight dequantised to bf16 (what the
                    default load did before these types ran natively)
  inflight-a8       LLM("gemma3-270m", activation_quantization="int8"): the native weights with int8
                    activations (the A8 GEMM: llama.cpp's arithmetic), fp32 elsewhere
  transformers      AutoModelForCausalLM from the same GGUF (dequantised to fp32), greedy `generate`
  llama.cpp         the same file through llama-cpp-python's C API (as benchmarks/bench_decode_cpu.py runs
                    it: decode, then argmax), when llama_cpp is importable (`pip install
                    "inflight-llm[llamacpp]"`); the table's "vs llama.cpp" column is each system's ratio to it

Cases (as benchmarks/bench_decode_cpu.py): "single" = one chat-templated prompt, greedy, --max-tokens new
tokens, EOS ignored (prefill ms, decode tok/s); "batched" = case (a) of benchmarks/throughput.py (16
prompts x --max-tokens), generated tok/s over the whole call. The table gives each system's ratio to
inflight, the weight bytes one decode step reads, and the tokens' agreement with transformers.

    python benchmarks/bench_gguf_native.py [--repeats 3] [--max-tokens 64] [--skip-transformers]
        [--skip-llamacpp]
        [--out FILE]   (default: docs/bench/gguf-native-gemma3-<cpu>-cpu.json)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import cpu_header, cpu_tag
from bench_decode_cpu import (
    CHAT,
    INFLIGHT_VARIANTS,
    InflightRunner,
    LlamaCppRunner,
    TransformersRunner,
    _leading_agreement,
    measure,
)
from throughput import make_cases

MODEL = "gemma3-270m"
INFLIGHT_VARIANTS.setdefault("bf16-deq", ("inflight-bf16-deq", "bfloat16", "none", None))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.repeats < 1 or args.max_tokens < 2 or args.threads < 1:
        p.error("--repeats and --threads must be >= 1, --max-tokens >= 2")
    torch.set_num_threads(args.threads)

    from inflight.models.gguf_loader import resolve_known_model
    from inflight.models.gguf_tokenizer import GEMMA_CHAT_TEMPLATE, load_gguf_tokenizer
    from inflight.ops import cpu_info, describe_cpu

    path = resolve_known_model(MODEL)
    tok = load_gguf_tokenizer(path)
    # The file has no chat template: Gemma's turn format, as LLM.chat renders it.
    text = tok.apply_chat_template(
        CHAT, chat_template=GEMMA_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    ids = list(tok.encode(text, add_special_tokens=False))
    n = args.max_tokens
    vocab = len(tok)
    # Random ordinary ids (100..49000), as throughput.py's case (a): ordinary tokens in Gemma's vocabulary too.
    reqs = [(prompt, n) for prompt, _ in make_cases()[BATCHED_CASE]]
    max_kv = sum(len(q) + n for q, _ in reqs) + 1024
    print(f"CPU: {describe_cpu()}", flush=True)
    print(f"cpu_info: {cpu_info()}", flush=True)
    load0 = os.getloadavg()
    print(
        f"model {path.name} (vocab {vocab}); threads {args.threads}; load average {load0[0]:.1f}", flush=True
    )

    factories = [
        ("inflight", lambda: InflightRunner(max_kv, "fp32", MODEL)),
        ("inflight-fp32act", lambda: InflightRunner(max_kv, "fp32act", MODEL)),
        ("inflight-bf16", lambda: InflightRunner(max_kv, "bf16", MODEL)),
        ("inflight-bf16-deq", lambda: InflightRunner(max_kv, "bf16-deq", MODEL)),
        ("inflight-a8", lambda: InflightRunner(max_kv, "int8", MODEL)),
    ]
    if not args.skip_transformers:
        factories.append(("transformers", lambda: TransformersRunner(path)))
    llama_version = None
    if not args.skip_llamacpp:
        try:
            import llama_cpp

            llama_version = getattr(llama_cpp, "__version__", None) or "unknown"
            max_len = max(len(ids) + n, max(len(q) + m for q, m in reqs)) + 16
            factories.append(("llama.cpp", lambda: LlamaCppRunner(path, args.threads, max_len)))
        except ImportError:
            print("llama.cpp: skipped (llama_cpp is not importable; pip install 'inflight-llm[llamacpp]')")
    rows: list[dict] = []
    for name, make in factories:
        print(f"{name}: loading", flush=True)
        runner = make()
        try:
            rows.extend(measure(runner, ids, n, reqs, args.repeats, lambda m: print(m, flush=True)))
        finally:
            runner.close()
            del runner
            gc.collect()

    single = {r["system"]: r for r in rows if r["case"] == "single"}
    batched = {r["system"]: r for r in rows if r["case"] == "batched"}
    ref_tokens = single.get("transformers", {}).get("tokens")
    print(f"\n{path.name}, {len(ids)}-token prompt, {n} new tokens; CPU: {describe_cpu()}")
    print(
        " system            | decode tok/s | inflight/x | prefill ms | batched tok/s | inflight/x | "
        "weights MiB/token | same tokens as transformers | vs llama.cpp (decode / batched)"
    )
    print("-" * 160)
    cpp_s = single.get("llama.cpp", {}).get("decode_tok_s")
    cpp_b = batched.get("llama.cpp", {}).get("total_tok_s")
    base_s, base_b = single["inflight"]["decode_tok_s"], batched["inflight"]["total_tok_s"]
    for name, row in single.items():
        b = batched[name]
        wb = row.get("weight_bytes_per_token")
        same = "" if ref_tokens is None else f"{_leading_agreement(row['tokens'], ref_tokens)}/{n}"
        print(
            f" {name:<17} | {row['decode_tok_s']:12.1f} | {base_s / row['decode_tok_s']:10.2f} | "
            f"{row['prefill_ms']:10.1f} | {b['total_tok_s']:13.1f} | {base_b / b['total_tok_s']:10.2f} | "
            f"{'' if wb is None else f'{wb / 2**20:17.1f}'} | {same:27} | "
            + (
                ""
                if cpp_s is None
                else f"{row['decode_tok_s'] / cpp_s:.2f}x / {b['total_tok_s'] / cpp_b:.2f}x"
            )
        )
    load1 = os.getloadavg()
    print(f"load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end ({os.cpu_count()} CPUs)")
    out = args.out or str(
        Path(__file__).resolve().parent.parent
        / "docs"
        / "bench"
        / f"gguf-native-gemma3-{cpu_tag(cpu_info()['model'])}-cpu.json"
    )
    with open(out, "w") as f:
        json.dump(
            {
                "header": cpu_header(),
                "cpu_info": cpu_info(),
                "model": str(path.name),
                "prompt_tokens": len(ids),
                "new_tokens": n,
                "threads": args.threads,
                "repeats": args.repeats,
                "llama_cpp_python": llama_version,
                "load_average": {"start": load0, "end": load1},
                "results": rows,
            },
            f,
            indent=2,
        )
    print(f"wrote {out}")


BATCHED_CASE = "a"

if __name__ == "__main__":
    main()
