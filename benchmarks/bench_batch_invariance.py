"""What batch invariance costs: the engine with batch-invariant CPU kernels (the default) against the
previous, row-count-dependent strategies (``_C.set_batch_invariant(False)``: bf16 panels, W4Dot / tiles
by row count, int8 group sums for one row only, decode attention split by the batch's work, torch's
GEMM for large dense prefills), in one process, alternating round by round on one loaded model.

Per model: single-stream decode tok/s (one prompt), batched decode tok/s (``--batch`` prompts of
mixed lengths), and the time of a ``--prompt-len``-token prefill. Decode rates are
``(new_tokens - 1) / (t(new_tokens) - t(1))`` (the prefill and first token subtracted); prefix reuse
is off, so every round computes its prefill. Medians over ``--rounds``; ratio = invariant / previous
(time: > 1 means invariance costs; tok/s: < 1 means it costs).

    python benchmarks/bench_batch_invariance.py [--model smollm2] [--configs q4,bf16] [--rounds 5]
        [--new-tokens 64] [--prompt-len 512] [--batch 16] [--json out.json]

``q4``: the model as it loads by default (SmolLM2's Q4_1 GGUF: native 4-bit kernels, fp32 model,
activation_quantization "auto": int16 activations into the GEMMs on an AVX512-VNNI CPU, whose A16
GEMM is batch-invariant in both modes); ``q4-fp32act``: the same with fp32 activations into the GEMMs
(``activation_quantization="none"``: the float kernels, whose strategies the mode switches);
``q4-bf16``: the same 4-bit weights with bf16 activations (``dtype="bfloat16", quantization="gguf",
activation_quantization="none"``); ``bf16``: dequantised to bf16 (dense bf16 GEMMs); ``fp32``:
dequantised to fp32.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from bench_common import cpu_header

from inflight import _C
from inflight.llm import LLM
from inflight.llm_args import KvCacheConfig
from inflight.ops import cpu_info
from inflight.sampling_params import SamplingParams

CONFIGS = {
    "q4": {},
    "q4-fp32act": {"activation_quantization": "none"},
    "q4-bf16": {"dtype": "bfloat16", "quantization": "gguf", "activation_quantization": "none"},
    "bf16": {"dtype": "bfloat16", "quantization": "none"},
    "fp32": {"dtype": "float32", "quantization": "none"},
}


def _prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def _time(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return dt


def _measure(llm: LLM, args, vocab: int, round_: int) -> dict[str, float]:
    # Fresh token ids every round (reuse is off anyway): nothing is served from a cache.
    single = _prompts(1, 32, 10 * round_, vocab)
    rng = random.Random(round_)
    batch = [p[: rng.randrange(8, 97)] for p in _prompts(args.batch, 96, 10 * round_ + 1, vocab)]
    long = _prompts(1, args.prompt_len, 10 * round_ + 2, vocab)
    n = args.new_tokens
    s1, sn = _time(llm, single, 1), _time(llm, single, n)
    b1, bn = _time(llm, batch, 1), _time(llm, batch, n)
    return {
        "single_decode_tok_s": (n - 1) / max(sn - s1, 1e-9),
        "batched_decode_tok_s": args.batch * (n - 1) / max(bn - b1, 1e-9),
        "prefill_s": _time(llm, long, 1),
    }


def run_config(name: str, args) -> dict:
    kw = CONFIGS[name]
    llm = LLM(
        args.model,
        kv_cache_config=KvCacheConfig(enable_block_reuse=False),
        max_num_tokens=max(args.prompt_len, 256),
        **kw,
    )
    try:
        vocab = llm.model_config.vocab_size
        results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for mode in (True, False):  # warm-up, both modes (weights imported, pages touched)
            _C.set_batch_invariant(mode)
            _time(llm, _prompts(2, 16, 99, vocab), 4)
        for r in range(args.rounds):
            for mode in (True, False) if r % 2 == 0 else (False, True):
                _C.set_batch_invariant(mode)
                results[mode].append(_measure(llm, args, vocab, r))
    finally:
        _C.set_batch_invariant(True)
        llm.shutdown()
    out = {}
    for key in results[True][0]:
        inv = statistics.median(m[key] for m in results[True])
        old = statistics.median(m[key] for m in results[False])
        out[key] = {"invariant": inv, "previous": old, "ratio": inv / old}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--configs", default="q4,bf16", help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    header = cpu_header()
    print(header)
    report = {"cpu": cpu_info(), "header": header, "args": vars(args), "results": {}}
    for name in args.configs.split(","):
        res = run_config(name, args)
        report["results"][name] = res
        print(f"\n{args.model} [{name}]  (invariant / previous, median of {args.rounds})")
        for key, v in res.items():
            print(f"  {key:22s} {v['invariant']:10.3f} {v['previous']:10.3f}   ratio {v['ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
