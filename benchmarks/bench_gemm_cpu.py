"""W4A16 / W8A16 / W8A8 CPU GEMMs vs torch ``F.linear`` (fp32 and bf16 weights) at SmolLM2-135M shapes.

Each row is one projection shape and batch size, all variants in the same run, with the ratio of
torch fp32 to the quantised layer. Variants go through the same objects the model uses (the layers'
prepared-weight path, including the binding's per-call cost):

- ``torch fp32`` / ``torch bf16``: ``F.linear`` with fp32 / bf16 weights and activations;
- ``w4 fp32x`` / ``w4 bf16x``: W4A16 weights (group 32, asymmetric: GGUF Q4_1's layout) with fp32 /
  bf16 activations (W8A16, group 32, for the 576 x 49152 LM head);
- ``w8a8 fp32x``: W8A8 (SmoothQuant's kernel: int8 weights per output channel, fp32 activations
  quantised per token to int8 inside the call, int32 sums; no smoothing vector here);
  ``q/w8a8`` is the best weight-only variant's time over it.

``--cache hot`` reuses one weight (it stays in L2/L3: kernel throughput); ``--cache cold`` (default)
cycles through enough copies to exceed the L3 cache, as a decode step does (every layer's weights
stream from memory once per token). ``--model-gemms`` times every projection of one SmolLM2 decode
step through the loaded model's modules, and ``--e2e`` single-stream decode tok/s through the LLM API:
native Q4 weights (bf16 or fp32 activations) vs the dequantised bf16 / fp32 models.

    python benchmarks/bench_gemm_cpu.py [--batches 1 4 16] [--cache cold|hot|both] [--model-gemms] [--e2e]
                                        [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from inflight.ops.gemm import W4A16Weight, W8A8Weight, W8A16Weight
from inflight.quantization import quantize_w4, quantize_w8

# (name, K = in_features, N = out_features, kind); the last is the tied LM head (Q8_0 in the GGUF).
SHAPES = [
    ("q/o_proj 576x576", 576, 576, "w4"),
    ("gate/up 576x1536", 576, 1536, "w4"),
    ("down 1536x576", 1536, 576, "w4"),
    ("qkv fused 576x960", 576, 960, "w4"),
    ("gate_up fused 576x3072", 576, 3072, "w4"),
    ("lm_head 576x49152", 576, 49152, "w8"),
]
GROUP = 32
COLD_BYTES = 96 << 20  # per variant: well past the 32 MiB L3


def _time(fn, iters: int, repeats: int) -> float:
    """Per-call time in microseconds: the 25th percentile of iters * repeats timed calls.

    A low percentile of single calls, not a mean: on a shared 2-core machine one descheduled OpenMP
    thread stalls a parallel region for a whole time slice (~4-8 ms), which would swamp a mean.
    """
    fn()
    samples = []
    for _ in range(iters * repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 4] * 1e6


def _cycle(items):
    """A function returning the items in turn, forever (cold-cache runs: each call uses the next copy)."""
    return itertools.cycle(items).__next__


def bench_shape(k: int, n: int, kind: str, batches: list[int], cache: str, repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.05
    if kind == "w4":
        qweight, scales, offsets = quantize_w4(w, GROUP, symmetric=False)
        qbytes = qweight.numel() + 2 * scales.numel() * 2

        def make_q():
            return W4A16Weight(qweight.clone(), scales.clone(), offsets.clone(), GROUP)
    else:
        qweight, scales = quantize_w8(w, GROUP)
        qbytes = qweight.numel() + scales.numel() * 2

        def make_q():
            return W8A16Weight(qweight.clone(), scales.clone(), GROUP)

    def copies(nbytes: int) -> int:
        return 1 if cache == "hot" else max(1, -(-COLD_BYTES // nbytes))

    w8_scales = w.abs().amax(dim=1) / 127
    w8_q = torch.round(w / w8_scales[:, None]).clamp(-127, 127).to(torch.int8)
    wa8 = [W8A8Weight(w8_q, w8_scales) for _ in range(copies(w8_q.numel()))]
    w32 = [w.clone() for _ in range(copies(w.numel() * 4))]
    w16 = [w.to(torch.bfloat16) for _ in range(copies(w.numel() * 2))]
    wq = [make_q() for _ in range(copies(qbytes))]
    rows = []
    for m in batches:
        x32 = torch.randn(m, k, generator=gen)
        x16 = x32.to(torch.bfloat16)
        iters = max(3, min(100, int(1e8 / (n * k * max(m, 4)))))
        n32, n16, nq, na8 = _cycle(w32), _cycle(w16), _cycle(wq), _cycle(wa8)
        t = {
            "torch fp32": _time(lambda: F.linear(x32, n32()), iters, repeats),
            "torch bf16": _time(lambda: F.linear(x16, n16()), iters, repeats),
            f"{kind} fp32x": _time(lambda: nq()(x32), iters, repeats),
            f"{kind} bf16x": _time(lambda: nq()(x16), iters, repeats),
            "w8a8 fp32x": _time(lambda: na8()(x32), iters, repeats),
        }
        rows.append({"k": k, "n": n, "m": m, "kind": kind, "cache": cache, "us": t})
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'shape':<24}{'cache':>6}{'M':>4}{'torch fp32':>12}{'torch bf16':>12}{'q fp32x':>10}{'q bf16x':>10}"
        f"{'fp32/q':>9}{'bf16/q':>9}{'w8a8':>9}{'q/w8a8':>8}   (us; q = w4, or w8 for the head)"
    )
    names = {(s[1], s[2]): s[0] for s in SHAPES}
    for r in rows:
        t = r["us"]
        q32, q16 = t[f"{r['kind']} fp32x"], t[f"{r['kind']} bf16x"]
        best_q = min(q32, q16)
        print(
            f"{names[(r['k'], r['n'])]:<24}{r['cache']:>6}{r['m']:>4}{t['torch fp32']:>12.1f}{t['torch bf16']:>12.1f}"
            f"{q32:>10.1f}{q16:>10.1f}{t['torch fp32'] / best_q:>8.2f}x{t['torch bf16'] / best_q:>8.2f}x"
            f"{t['w8a8 fp32x']:>9.1f}{best_q / t['w8a8 fp32x']:>7.2f}x"
        )


# (label, dtype, quantization): "gguf" keeps the file's 4-bit weights, dtype being the activation dtype.
_MODEL_VARIANTS = [
    ("q4 native, bf16 act", torch.bfloat16, "gguf"),
    ("q4 native, fp32 act", torch.float32, "gguf"),
    ("dequantised bf16", torch.bfloat16, None),
    ("dequantised fp32", torch.float32, None),
]


def bench_model_gemms(batches: list[int], passes: int) -> dict[str, dict[int, float]]:
    """Milliseconds of every projection of one SmolLM2 decode step (30 layers x qkv, o, gate_up, down,
    plus the LM head) through the loaded model's own modules: the part of a step this work changes."""
    from inflight.models.loader import load_model

    results: dict[str, dict[int, float]] = {}
    for label, dtype, quantization in _MODEL_VARIANTS:
        net = load_model(
            "smollm2",
            dtype=dtype,
            device=torch.device("cpu"),
            attention_backend="torch",
            max_seq_len=256,
            quantization=quantization,
        ).model
        c = net.config
        head = net.embedding if net.embedding is not None else (lambda h: F.linear(h, net.lm_head))
        results[label] = {}
        for m in batches:
            xd = torch.randn(m, c.hidden_size).to(net.dtype)
            xf = torch.randn(m, c.intermediate_size).to(net.dtype)

            def step():
                for layer in net.layers:
                    layer.qkv_proj(xd)
                    layer.o_proj(xd)
                    layer.gate_up_proj(xd)
                    layer.down_proj(xf)
                head(xd)

            with torch.no_grad():
                results[label][m] = _time(step, passes, 1) / 1e3
        print(
            f"  {label:<22} " + "  ".join(f"M={m}: {results[label][m]:6.2f} ms" for m in batches), flush=True
        )
        net = head = None  # free this variant before loading the next
    return results


def bench_e2e(new_tokens: int, repeats: int) -> dict[str, float]:
    """Single-stream greedy decode tok/s of SmolLM2: (t(1 + new_tokens) - t(1)) / new_tokens."""
    from inflight import LLM, KvCacheConfig, SamplingParams

    results = {}
    for label, dtype, quantization in _MODEL_VARIANTS:
        with LLM(
            "smollm2", dtype=dtype, quantization=quantization, kv_cache_config=KvCacheConfig(max_tokens=2048)
        ) as llm:
            prompt = llm.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": "Write a short story about a robot "
                        "who learns to paint, with a beginning, a middle and an end.",
                    }
                ]
            )

            def run(n: int) -> float:
                t0 = time.perf_counter()
                llm.generate(
                    [prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False
                )
                return time.perf_counter() - t0

            run(4)
            best = 0.0
            for _ in range(repeats):
                best = max(best, new_tokens / (run(new_tokens + 1) - run(1)))
            results[label] = best
            print(f"  {label:<22} {best:7.1f} tok/s", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--cache", choices=["cold", "hot", "both"], default="cold")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--model-gemms",
        action="store_true",
        help="also all projections of one SmolLM2 decode step, per model variant (loads it 4 times)",
    )
    ap.add_argument(
        "--e2e", action="store_true", help="also SmolLM2 end-to-end decode tok/s (loads it 4 times)"
    )
    ap.add_argument("--e2e-tokens", type=int, default=128)
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args()

    from inflight.ops import describe_cpu

    print(f"CPU: {describe_cpu()}; threads: {torch.get_num_threads()}, torch {torch.__version__}")
    rows = []
    caches = ["cold", "hot"] if args.cache == "both" else [args.cache]
    for cache in caches:
        for _, k, n, kind in SHAPES:
            rows.extend(bench_shape(k, n, kind, args.batches, cache, args.repeats))
    print_table(rows)
    result = {"threads": torch.get_num_threads(), "gemm": rows}
    if args.model_gemms:
        print("SmolLM2-135M: all projections of one decode step (210 linears + LM head), 25th percentile:")
        result["model_gemms_ms"] = bench_model_gemms(args.batches, 20)
    if args.e2e:
        print("SmolLM2-135M single-stream decode:")
        result["e2e_decode_tok_s"] = bench_e2e(args.e2e_tokens, 3)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
