"""A mixture-of-experts layer's experts on the CPU: 4-bit experts in one C++ call (MoeExperts) vs the same
layers called one expert at a time from Python vs dense experts (torch's F.grouped_mm), in one run.

The layer is Qwen3-30B-A3B's by default (hidden 2048, 128 experts of intermediate 768, top-8, random
weights and router; --hidden / --experts / --inter / --top-k change it). The experts are W4A16 (group
32, asymmetric: a GGUF Q4_1 file's layout) for gate_up and W8A16 (group 32: Q8_0) for down, as a
Q4_K_M file mixes them; the dense row holds the same weights dequantised, in fp32 or bf16 (--dtype).
Each row times ``SparseMoeBlock.forward`` (routing, sorting, the experts, the weighted sum) for T tokens
(decode: 1; a batch of decodes: 4, 16; a prefill chunk: 64), median of --repeats timed calls after a
warm-up, the systems interleaved per repeat in a rotating order (the routed experts' weights stay
warm in the cache for whichever system runs right after another 4-bit one). The Python row is the fused row's own block with its
C++ group switched off (the fallback path), so both run the same kernels on the same rows.

    python benchmarks/bench_moe_experts.py [--tokens 1 4 16 64] [--repeats 20] [--dtype float32]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import cpu_header

from inflight.layers.quantized_linear import W4A16Linear, W8A16Linear
from inflight.models.moe import SparseMoeBlock
from inflight.quantization import dequantize_w4, dequantize_w8, quantize_w4, quantize_w8


def _config(args) -> SimpleNamespace:
    return SimpleNamespace(
        moe_intermediate_size=args.inter,
        model_type="qwen3_moe",
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        hidden_size=args.hidden,
    )


def build(args, dtype: torch.dtype) -> tuple[SparseMoeBlock, SparseMoeBlock]:
    """(the block with 4-/8-bit experts, the block with the same weights dense)."""
    cfg = _config(args)
    h, i, e = args.hidden, args.inter, args.experts
    w4 = partial(W4A16Linear, group_size=32)
    w8 = partial(W8A16Linear, group_size=32)
    quant = SparseMoeBlock(cfg, dtype, "cpu", expert_layers=(w4, w8))
    dense = SparseMoeBlock(cfg, dtype, "cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router = torch.randn(e, h, generator=gen) * 0.05
        quant.router.copy_(router)
        dense.router.copy_(router)
        for x in range(e):
            gate_up = torch.randn(2 * i, h, generator=gen) * 0.02
            down = torch.randn(h, i, generator=gen) * 0.02
            q, s, o = quantize_w4(gate_up, 32, False)
            for name, t in (("qweight", q), ("scales", s), ("offsets", o)):
                quant.expert_gate_up[x].load_shard(0, name, t[:i])
                quant.expert_gate_up[x].load_shard(1, name, t[i:])
            dense.experts_gate_up[x].copy_(dequantize_w4(q, s, o, 32))
            q8, s8 = quantize_w8(down, 32)
            quant.expert_down[x].load_shard(0, "qweight", q8)
            quant.expert_down[x].load_shard(0, "scales", s8)
            dense.experts_down[x].copy_(dequantize_w8(q8, s8, 32))
    return quant, dense


def time_call(fn, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.repeats < 1 or min(args.tokens) < 1 or args.top_k > args.experts:
        p.error("--repeats and --tokens must be >= 1, --top-k <= --experts")
    dtype = getattr(torch, args.dtype)
    header = cpu_header()
    print(header, flush=True)
    print(
        f"layer: hidden {args.hidden}, {args.experts} experts x intermediate {args.inter}, top-{args.top_k}, "
        f"{args.dtype} activations",
        flush=True,
    )
    quant, dense = build(args, dtype)
    rows = []
    for t in args.tokens:
        x = torch.randn(t, args.hidden, generator=torch.Generator().manual_seed(t)).to(dtype)

        def python_loop(block=quant, x=x):
            saved = block._fused_experts
            block._fused_experts = lambda: None  # the per-expert Python fallback of the same block
            try:
                return block(x)
            finally:
                block._fused_experts = saved

        systems = {"4-bit, one C++ call": lambda x=x: quant(x), "4-bit, per expert in Python": python_loop}
        systems[f"dense {args.dtype}, F.grouped_mm"] = lambda x=x: dense(x)
        with torch.no_grad():
            times: dict[str, list[float]] = {k: [] for k in systems}
            names = list(systems)
            for r in range(args.repeats):  # interleaved, the order rotated: drift and warm caches alike
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    times[name].extend(time_call(systems[name], 1))
            ref = quant(x)
            assert torch.allclose(python_loop(), ref, atol=1e-5), "the two 4-bit paths disagree"
        base = statistics.median(times["4-bit, one C++ call"])
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append({"tokens": t, "system": name, "us": med * 1e6, "vs_fused": med / base})
    print("\n| tokens | system | µs per layer call | time vs one C++ call |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['system']} | {r['us']:.0f} | {r['vs_fused']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
