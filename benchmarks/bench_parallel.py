"""Parallelism on one machine: tp=1 on all cores against tp=2 (and pp=2) with the same cores split
between two ranks, in the same run, on a random-weight Llama large enough that compute dominates.

Measures single-stream decode (one 61-token prompt, 128 new tokens) and batched throughput (case (a)
of throughput.py: 16 prompts of 16-200 tokens x 128 new tokens), the tp=2 / tp=1 ratio, and rank 0's
time per step in communication (the step-plan broadcast, and the all-reduces plus the logits gather).
Also prints the bytes each step sends, the input of the projection in docs/architecture.md.

    python benchmarks/bench_parallel.py [--configs tp2 pp2] [--layers 12] [--hidden 1024] [--json out.json]

INFLIGHT_TP_TRANSPORT=gloo measures the TP collectives over torch.distributed's gloo instead of
shared memory (the path between hosts).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch


def make_model(path: Path, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(str(path))
    return path


def cases(seed: int = 0) -> tuple[list[int], list[tuple[list[int], int]]]:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, 30000) for _ in range(n)]

    return prompt(61), [(prompt(rng.randint(16, 200)), 128) for _ in range(16)]


def run(llm, reqs) -> tuple[float, int, list]:
    from inflight import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n == sum(m for _, m in reqs)
    return dt, n, outs


def comm(llm) -> dict[str, float]:
    model = llm.executor.model_engine.model
    return model.comm_stats() if hasattr(model, "comm_stats") else {}


def measure(path: Path, tp: int, pp: int, single: list[int], batch: list) -> dict:
    from inflight import LLM, KvCacheConfig

    with LLM(
        str(path),
        dtype="bfloat16",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        kv_cache_config=KvCacheConfig(max_tokens=16384),
    ) as llm:
        run(llm, [(single, 8)])  # warm-up
        out: dict = {"tp": tp, "pp": pp, "threads_per_rank": torch.get_num_threads()}
        for name, reqs in (("single", [(single, 128)]), ("batched", batch)):
            before = comm(llm)
            dt, n, outs = run(llm, reqs)
            after = comm(llm)
            row = {"seconds": dt, "tokens": n, "tok_s": n / dt}
            if name == "single":  # decode only: after the first token
                m = outs[0].metrics
                row["decode_tok_s"] = (n - 1) / (m["e2e_latency"] - m["ttft"])
            if after:
                steps = after["steps"] - before["steps"]
                row["steps"] = steps
                row["broadcast_ms_per_step"] = 1e3 * (after["broadcast_s"] - before["broadcast_s"]) / steps
                row["collectives_ms_per_step"] = (
                    1e3 * (after["collectives_s"] - before["collectives_s"]) / steps
                )
                row["step_ms"] = 1e3 * dt / steps
                row["pipe_wait_ms_per_step"] = 1e3 * (after["pipe_wait_s"] - before["pipe_wait_s"]) / steps
            out[name] = row
        out["tokens"] = [o.outputs[0].token_ids for o in outs]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["tp2", "pp2"], help="tpN / ppN / tpNxppM")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from inflight import _C

    with open("/proc/cpuinfo") as f:
        name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    info = f"{name}, {torch.get_num_threads()} threads, kernels {_C.cpu_isa()}"
    print(f"CPU: {info}")
    single, batch = cases()
    configs = [_parse(c) for c in args.configs]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(
            Path(tmp) / "llama", args.hidden, args.layers, args.heads, args.kv_heads, args.vocab
        )
        base = measure(path, 1, 1, single, batch)
        for tp, pp in configs:
            results[f"tp={tp} pp={pp}"] = measure(path, tp, pp, single, batch)
    want = base.pop("tokens")
    head_dim = args.hidden // args.heads
    print(
        f"\nrandom Llama: hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV heads of {head_dim}, "
        f"{args.layers} layers, vocab {args.vocab}, bf16; TP data over {_transport()}\n"
    )
    print(
        "| config | measure | tok/s | tp=1 tok/s | ratio | rank 0 per step: channel + collectives "
        "(+ waiting for the last stage) |"
    )
    print("|---|---|---|---|---|---|")
    for label, par in results.items():
        same = par.pop("tokens") == want
        for name, key in (("single", "decode_tok_s"), ("batched", "tok_s")):
            a, b = base[name][key], par[name][key]
            c = par[name]
            print(
                f"| {label} | {name} {'decode' if name == 'single' else 'case (a)'} | {b:.1f} | {a:.1f} | "
                f"{b / a:.2f}x | {c['broadcast_ms_per_step']:.2f} + {c['collectives_ms_per_step']:.2f} ms"
                + (f" (+ {c['pipe_wait_ms_per_step']:.1f})" if c["pipe_wait_ms_per_step"] else "")
                + f" of {c['step_ms']:.1f} ms |"
            )
        print(f"| {label} | greedy tokens of the batch equal to tp=1 | {same} | | | |")
    # What a decode step of B rows sends (bf16): 2 all-reduces per layer of B x hidden, one gather of
    # B x vocab fp32 logits, and the plan (a few int64 per row).
    b = 16
    ar = b * args.hidden * 2
    print(
        f"\nper decode step of {b} rows: {2 * args.layers} all-reduces of {ar} B, a logits gather of "
        f"{b * args.vocab * 4} B, a plan broadcast of ~{8 * (8 + b * 8)} B"
    )
    if args.json:
        args.json.write_text(json.dumps({"cpu": str(info), "tp=1 pp=1": base, **results}, indent=1))


def _parse(text: str) -> tuple[int, int]:
    tp = pp = 1
    for part in text.lower().split("x"):
        if part.startswith("tp"):
            tp = int(part[2:])
        elif part.startswith("pp"):
            pp = int(part[2:])
        else:
            raise SystemExit(f"--configs: expected tpN, ppN or tpNxppM, got {text!r}")
    return tp, pp


def _transport() -> str:
    import os

    return os.environ.get("INFLIGHT_TP_TRANSPORT", "auto (shared memory on one host)")


if __name__ == "__main__":
    main()
