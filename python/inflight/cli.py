"""The `inflight` command: `inflight generate ...`, `inflight quantize ...` (more join as they land)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="a Hugging Face model directory, a .gguf file, or a known name (default: smollm2)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--quantization", default=None, choices=["auto", "gguf", "none"],
                   help="GGUF 4-bit weights: auto (native with --dtype auto on a CPU, else dequantised), gguf "
                        "(always native; --dtype is the activation dtype), none (always dequantised)")
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-max-tokens", type=int, default=None, help="cap the KV pool (tokens)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def _make_llm(args):
    from inflight import LLM, KvCacheConfig

    kv = KvCacheConfig(max_tokens=args.kv_cache_max_tokens)
    return LLM(args.model, dtype=args.dtype, max_seq_len=args.max_seq_len, max_batch_size=args.max_batch_size,
               max_num_tokens=args.max_num_tokens, kv_cache_config=kv, quantization=args.quantization)


def cmd_generate(args) -> int:
    from inflight import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop=args.stop)
    llm = _make_llm(args)
    try:
        tok = llm.tokenizer
        use_chat = not args.no_chat and tok is not None and getattr(tok, "chat_template", None)
        if use_chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            prompt = llm.apply_chat_template(messages)
        elif tok is None:
            prompt = [int(t) for t in args.prompt.split()]  # a model without tokenizer: token ids
        else:
            prompt = args.prompt
        return asyncio.run(_stream(llm, prompt, params, tok is not None))
    finally:
        llm.shutdown()


async def _stream(llm, prompt, params, has_tokenizer: bool) -> int:
    t0 = time.perf_counter()
    first = None
    handle = llm.generate_async(prompt, params, streaming=True)
    out = None
    async for out in handle:
        if first is None:
            first = time.perf_counter()
        piece = out.outputs[0].text_diff if has_tokenizer else " ".join(map(str, out.outputs[0].token_ids_diff))
        sys.stdout.write(piece)
        sys.stdout.flush()
    end = time.perf_counter()
    comp = out.outputs[0]
    n = len(comp.token_ids)
    decode = (n - 1) / (end - first) if n > 1 and first is not None else float("nan")
    sys.stdout.write("\n")
    print(f"[{n} tokens in {end - t0:.2f} s: {n / (end - t0):.1f} tok/s overall, {decode:.1f} tok/s decode, "
          f"time to first token {(first - t0) * 1e3 if first else float('nan'):.0f} ms, "
          f"prompt {len(out.prompt_token_ids)} tokens, finish_reason={comp.finish_reason}]", file=sys.stderr)
    if comp.finish_reason == "error":
        print(f"error: {comp.error}", file=sys.stderr)
        return 1
    return 0


def cmd_quantize(args) -> int:
    from inflight.quantization import quantize_checkpoint

    t0 = time.perf_counter()
    out = quantize_checkpoint(args.model, args.out, group_size=args.group_size, symmetric=args.symmetric)
    print(f"wrote W4A16 (group {args.group_size}, {'symmetric' if args.symmetric else 'asymmetric'}) "
          f"checkpoint to {out} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inflight", description="inflight: an LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    _add_engine_args(g)
    _sampling_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--system", default=None, help="system message (chat models)")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=cmd_generate)
    q = sub.add_parser("quantize", help="round-to-nearest W4A16 of a Hugging Face model directory")
    q.add_argument("--model", required=True, help="a Hugging Face model directory (safetensors)")
    q.add_argument("--out", required=True, help="output directory (loadable with LLM(model=OUT))")
    q.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128))
    q.add_argument("--symmetric", action="store_true", help="w = scale * (q - 8) instead of scale * q + offset")
    q.set_defaults(func=cmd_quantize)
    from inflight.serve.cli import add_bench_parser, add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"inflight: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
