"""The ``inflight`` command: ``inflight generate``, ``inflight quantize``, ``inflight perplexity``,
``inflight serve`` and ``inflight bench serve``.

``generate`` and ``quantize`` are defined here; ``perplexity``, ``serve`` and ``bench`` are mounted
from :mod:`inflight.perplexity`, :mod:`inflight.serve.server` and :mod:`inflight.serve.bench`, which own their arguments and their
command functions. The engine options of ``generate`` and ``serve`` are the fields of
:class:`~inflight.llm_args.LlmArgs` (:func:`~inflight.llm_args.add_cli_arguments`), so an engine
argument added there reaches both commands. Imports flow one way, this module -> ``inflight.serve``
-> ``inflight.llm``; FastAPI, uvicorn and httpx are imported only when ``serve`` / ``bench`` run, so
``inflight --help`` works without those extras.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from inflight import perplexity
from inflight.llm import LLM
from inflight.llm_args import LlmArgs, add_cli_arguments
from inflight.models.config import ModelConfig
from inflight.quantization import GROUP_SIZES, quantize_checkpoint, quantize_smoothquant
from inflight.sampling_params import SamplingParams
from inflight.serve import bench, server

# ---------------------------------------------------------------------------------------------- generate


def _add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    # No --seed here: the engine's --seed (LlmArgs.seed) seeds the one request, which has none of its own.


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    g = subparsers.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    g.add_argument(
        "--model",
        default="smollm2",
        help="a Hugging Face model directory, a .gguf file, or a known name (default: smollm2)",
    )
    g.add_argument("--prompt", required=True)
    g.add_argument("--system", default=None, help="system message (chat models)")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    _add_sampling_arguments(g)
    add_cli_arguments(g, "engine")
    g.set_defaults(func=cmd_generate)
    return g


def cmd_generate(args) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
    )
    llm = LLM(**LlmArgs.from_cli(args, model=args.model).to_kwargs())
    try:
        tok = llm.tokenizer
        use_chat = not args.no_chat and tok is not None and getattr(tok, "chat_template", None)
        if use_chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": args.prompt})
            prompt = llm.apply_chat_template(messages)
        elif tok is None:
            prompt = [int(t) for t in args.prompt.split()]  # a model without tokenizer: token ids
        else:
            prompt = args.prompt
        return asyncio.run(_stream(llm, prompt, params, tok is not None))
    finally:
        llm.shutdown()


async def _stream(llm: LLM, prompt, params: SamplingParams, has_tokenizer: bool) -> int:
    t0 = time.perf_counter()
    first = None
    handle = llm.generate_async(prompt, params, streaming=True)
    out = None
    async for out in handle:
        if first is None:
            first = time.perf_counter()
        piece = (
            out.outputs[0].text_diff if has_tokenizer else " ".join(map(str, out.outputs[0].token_ids_diff))
        )
        sys.stdout.write(piece)
        sys.stdout.flush()
    end = time.perf_counter()
    comp = out.outputs[0]
    n = len(comp.token_ids)
    decode = (n - 1) / (end - first) if n > 1 and first is not None else float("nan")
    sys.stdout.write("\n")
    print(
        f"[{n} tokens in {end - t0:.2f} s: {n / (end - t0):.1f} tok/s overall, {decode:.1f} tok/s decode, "
        f"time to first token {(first - t0) * 1e3 if first else float('nan'):.0f} ms, "
        f"prompt {len(out.prompt_token_ids)} tokens, finish_reason={comp.finish_reason}]",
        file=sys.stderr,
    )
    if comp.finish_reason == "error":
        print(f"error: {comp.error}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------- quantize


def add_quantize_parser(subparsers) -> argparse.ArgumentParser:
    q = subparsers.add_parser(
        "quantize", help="W4A16 (round-to-nearest) or SmoothQuant W8A8 copy of a Hugging Face model directory"
    )
    q.add_argument("--model", required=True, help="a Hugging Face model directory (safetensors)")
    q.add_argument("--out", required=True, help="output directory (loadable with LLM(model=OUT))")
    q.add_argument("--method", choices=("w4a16", "smoothquant"), default="w4a16")
    q.add_argument("--alpha", type=float, default=0.5, help="smoothquant: migration strength in [0, 1]")
    q.add_argument("--calib-file", default=None, help="smoothquant: calibration text (UTF-8), required")
    q.add_argument("--calib-tokens", type=int, default=2048, help="smoothquant: tokens of it to use")
    q.add_argument("--group-size", type=int, default=128, choices=GROUP_SIZES)
    q.add_argument(
        "--symmetric", action="store_true", help="w = scale * (q - 8) instead of scale * q + offset"
    )
    q.set_defaults(func=cmd_quantize)
    return q


def cmd_quantize(args) -> int:
    # The quantization package knows tensor names, not models: whether the runtime supports the
    # checkpoint's architecture is checked here, before anything is written.
    try:
        config = ModelConfig.from_hf_dir(args.model)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    if config.num_experts:
        raise ValueError(
            f"{config.architecture} is a mixture-of-experts model (num_experts={config.num_experts}): "
            "inflight quantize does not support its expert weights"
        )
    t0 = time.perf_counter()
    if args.method == "smoothquant":
        if not args.calib_file:
            raise ValueError("--method smoothquant needs --calib-file FILE (calibration text)")
        with open(args.calib_file, encoding="utf-8") as f:
            text = f.read()
        out = quantize_smoothquant(
            args.model, args.out, text, alpha=args.alpha, calib_tokens=args.calib_tokens
        )
        print(
            f"wrote W8A8 (SmoothQuant, alpha {args.alpha}) checkpoint to {out} in "
            f"{time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
        return 0
    out = quantize_checkpoint(args.model, args.out, group_size=args.group_size, symmetric=args.symmetric)
    kind = "symmetric" if args.symmetric else "asymmetric"
    print(
        f"wrote W4A16 (group {args.group_size}, {kind}) checkpoint to {out} in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    return 0


# ---------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description="inflight: an LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_quantize_parser(sub)
    perplexity.add_parser(sub)
    server.add_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"inflight: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
