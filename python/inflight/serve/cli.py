"""Command-line parsers of ``inflight serve`` and ``inflight bench serve``.

Wired into ``inflight.cli`` with::

    from inflight.serve.cli import add_bench_parser, add_serve_parser
    add_serve_parser(sub)
    add_bench_parser(sub)

Nothing here imports FastAPI, uvicorn or httpx until a command runs, so ``inflight --help`` works
without the ``serve`` / ``bench`` extras.
"""

from __future__ import annotations

import argparse
import importlib.util

_CAPACITY_POLICIES = "GUARANTEED_NO_EVICT (default), MAX_UTILIZATION, STATIC_BATCH"
_CHUNKING_POLICIES = "FIRST_COME_FIRST_SERVED (default), EQUAL_PROGRESS"


def _need(modules: tuple[str, ...], extra: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} not installed: pip install \"inflight-llm[{extra}]\"")


def cmd_serve(args) -> int:
    _need(("fastapi", "uvicorn", "prometheus_client"), "serve")
    if args.model is None:
        args.model = args.model_flag or "smollm2"
    elif args.model_flag is not None and args.model_flag != args.model:
        raise ValueError(f"the model is given twice: {args.model!r} and --model {args.model_flag!r}")
    from inflight.serve.server import run_server

    return run_server(args)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``inflight serve`` (also used by ``python -m inflight.serve.server``)."""
    p.add_argument("model", nargs="?", default=None,
                   help="a Hugging Face model directory, a .gguf file, or a known name (default: smollm2)")
    p.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: the model argument as given; a directory's base "
                        "name is accepted too)")
    net = p.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument("--max-queue-size", type=int, default=1024,
                     help="most requests in flight (running or waiting); more get 503 at once (default 1024)")
    net.add_argument("--drain-timeout", type=float, default=30.0,
                     help="on SIGTERM, seconds to let requests in flight finish before cancelling them (default 30)")
    net.add_argument("--disable-access-log", action="store_true", help="no log line per HTTP request")
    net.add_argument("--uvicorn-log-level", default="info",
                     choices=("critical", "error", "warning", "info", "debug", "trace"))
    eng = p.add_argument_group("engine")
    eng.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    eng.add_argument("--quantization", default=None, choices=["auto", "gguf", "none"],
                     help="GGUF 4-bit weights: auto (native with --dtype auto on a CPU, else dequantised), gguf "
                          "(always native; --dtype is the activation dtype), none (always dequantised)")
    eng.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: CUDA when available)")
    eng.add_argument("--max-seq-len", type=int, default=None, help="prompt + output limit (default: the model's)")
    eng.add_argument("--max-batch-size", type=int, default=256)
    eng.add_argument("--max-num-tokens", type=int, default=8192, help="most tokens in one forward")
    eng.add_argument("--kv-cache-free-memory-fraction", type=float, default=0.9,
                     help="fraction of the memory free after the weights given to the KV cache (TensorRT-LLM's "
                          "meaning; default 0.9)")
    eng.add_argument("--kv-cache-max-tokens", type=int, default=None, help="cap the KV pool (tokens)")
    eng.add_argument("--tokens-per-block", type=int, default=32, help="KV cache block size in tokens (power of 2)")
    eng.add_argument("--disable-block-reuse", action="store_true", help="no prefix caching")
    eng.add_argument("--enable-chunked-prefill", action="store_true", help="split long prompts over several steps")
    eng.add_argument("--capacity-scheduler-policy", default="GUARANTEED_NO_EVICT", help=_CAPACITY_POLICIES)
    eng.add_argument("--context-chunking-policy", default="FIRST_COME_FIRST_SERVED", help=_CHUNKING_POLICIES)
    eng.add_argument("--disable-overlap-scheduler", action="store_true")
    eng.add_argument("--seed", type=int, default=0, help="seed of requests without their own")
    eng.add_argument("--log-iteration-stats", type=int, default=0, metavar="N",
                     help="log engine stats every N iterations (0: off)")
    p.set_defaults(func=cmd_serve)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)",
                              description="Serve a model over an OpenAI-compatible HTTP API.")
    add_serve_arguments(p)
    return p


# ---------------------------------------------------------------------------------------------- bench


def _load_serving_benchmark():
    """The load generator (inflight.serve.bench; benchmarks/serving.py runs the same code)."""
    from inflight.serve import bench

    return bench


def cmd_bench_serve(args) -> int:
    _need(("httpx",), "bench")
    return _load_serving_benchmark().run(args)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmarks (bench serve: load-test a running server)")
    sub = p.add_subparsers(dest="bench_command", required=True)
    s = sub.add_parser("serve", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)",
                       description="Streams requests to a running server at a given rate and reports latencies.")
    add_bench_serve_arguments(s)
    s.set_defaults(func=cmd_bench_serve)
    return p


def add_bench_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--request-rate", type=float, default=None,
                      help="requests per second (inf: all at once; default inf)")
    rate.add_argument("--request-rates", type=float, nargs="+", default=None,
                      help="several rates, one run each (the plot shows latency against rate)")
    p.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson",
                   help="inter-arrival times: exponential (poisson) or constant (fixed)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (mean when --range-ratio > 0)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (mean when --range-ratio > 0)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="sample lengths uniformly in [len*(1-r), len*(1+r)] (default 0: fixed lengths)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids of the random prompts are drawn below this (default: the server's vocab_size "
                        "from /v1/models, else 1000)")
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (lengths then vary)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG plot of latency against request rate here")
