"""Load generator for an OpenAI-compatible server (inflight's, or any other): ``inflight bench serve``.

Sends ``--num-prompts`` streaming requests (random token-id prompts of ``--input-len`` tokens for
/v1/completions, random words for chat; ``--output-len`` tokens each with ``ignore_eos``) at
``--request-rate`` requests/s (Poisson or fixed arrivals; inf = all at once), at most
``--max-concurrency`` at a time, and reports TTFT, TPOT (time per output token after the first),
ITL (inter-token latency: the gaps between streamed chunks) and E2E latency (mean, p50, p90, p99),
plus request and token throughput. Several rates (``--request-rates 2 4 8``) give one run each;
``--out`` writes JSON, ``--plot`` a PNG of latency against request rate.

    inflight bench serve --url http://127.0.0.1:8000 --request-rates 2 4 8 --num-prompts 200 \\
        --input-len 128 --output-len 64 --out results.json --plot latency.png
    python benchmarks/serving.py --url ... (same arguments)

This module owns the command: :func:`add_parser` mounts ``bench serve`` on ``inflight``'s
subcommands, :func:`add_arguments` gives its options and :func:`run` runs it. httpx (the ``bench``
extra) and matplotlib (``--plot``) are imported only when a run needs them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from inflight.serve.bench_report import RequestResult, plot, print_summary, summarize
from inflight.serve.extras import BENCH_MODULES, require_extra

_WORD_TEXT = (
    "the of and to in is was for on are with as at be by this had not but from or have an they which one you "
    "were all we her she there been if more when will would who so no time out up about into than them can "
    "only other new some could these two may first then do any like my now over such our man me even most "
    "made after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three"
)
_WORDS = _WORD_TEXT.split()


@dataclass
class BenchRequest:
    payload: dict
    prompt_len: int
    output_len: int


# ---------------------------------------------------------------------------------------------- requests


def _lengths(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    if ratio <= 0:
        return [mean] * n
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_requests(args, model: str, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    ins = _lengths(args.input_len, args.range_ratio, args.num_prompts, rng)
    outs = _lengths(args.output_len, args.range_ratio, args.num_prompts, rng)
    low = min(10, vocab_size - 1)
    reqs = []
    for n_in, n_out in zip(ins, outs):
        payload: dict[str, Any] = {
            "model": model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        if not args.no_ignore_eos:
            payload["ignore_eos"] = True
        if args.endpoint.endswith("/chat/completions"):
            payload["messages"] = [
                {"role": "user", "content": " ".join(rng.choice(_WORDS) for _ in range(n_in))}
            ]
            payload["max_completion_tokens"] = n_out
        else:
            payload["prompt"] = [rng.randrange(low, vocab_size) for _ in range(n_in)]
            payload["max_tokens"] = n_out
        reqs.append(BenchRequest(payload, n_in, n_out))
    return reqs


async def send_one(client, url: str, req: BenchRequest) -> RequestResult:
    res = RequestResult(prompt_len=req.prompt_len)
    res.start = t0 = time.perf_counter()
    last = None
    counted = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=req.payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = obj["error"].get("message", str(obj["error"]))
                    return res
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                    if obj["usage"].get("prompt_tokens"):
                        res.prompt_len = obj["usage"]["prompt_tokens"]
                n = 0
                for choice in obj.get("choices") or []:
                    if "token_ids" in choice and choice["token_ids"] is not None:
                        n += len(choice["token_ids"])
                    elif choice.get("text") or (choice.get("delta") or {}).get("content"):
                        n += 1  # servers without token ids: one chunk ~ one token
                if n == 0:
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
                counted += n
    except Exception as exc:  # noqa: BLE001  (reported per request)
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e = time.perf_counter() - t0
    res.output_tokens = usage_tokens if usage_tokens is not None else counted
    res.ok = last is not None
    if not res.ok:
        res.error = "no tokens were streamed"
    return res


async def run_rate(
    client,
    url: str,
    reqs: list[BenchRequest],
    rate: float,
    arrival: str,
    max_concurrency: int | None,
    seed: int,
) -> tuple[list[RequestResult], float]:
    """All requests at ``rate`` requests/s; returns the results and the wall time."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(req: BenchRequest) -> RequestResult:
        if sem is None:
            return await send_one(client, url, req)
        async with sem:
            return await send_one(client, url, req)

    t0 = time.perf_counter()
    tasks = []
    for i, req in enumerate(reqs):
        tasks.append(asyncio.ensure_future(limited(req)))
        if i + 1 < len(reqs) and math.isfinite(rate) and rate > 0:
            await asyncio.sleep(rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate)
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- driver


async def _main(args) -> dict:
    import httpx

    base = args.url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30.0), limits=limits) as client:
        resp = await client.get(base + "/v1/models")
        resp.raise_for_status()
        data = resp.json().get("data") or []
        model = args.model or (data[0]["id"] if data else None)
        if model is None:
            raise ValueError("the server lists no model: pass --model")
        entry = next((d for d in data if d.get("id") == model), {})
        vocab = args.vocab_size or entry.get("vocab_size") or 1000
        reqs = make_requests(args, model, vocab)
        rates = args.request_rates or [args.request_rate if args.request_rate is not None else float("inf")]
        runs = []
        for rate in rates:
            results, duration = await run_rate(
                client, base + args.endpoint, reqs, rate, args.arrival, args.max_concurrency, args.seed
            )
            summary = summarize(results, duration, rate)
            print_summary(summary)
            runs.append(summary)
    config = {k: v for k, v in vars(args).items() if k != "func" and not callable(v)}
    config["model"] = model
    return {"config": config, "runs": runs}


def run(args) -> int:
    """``inflight bench serve``: runs every rate, prints, writes --out and --plot; 1 if nothing completed."""
    require_extra(BENCH_MODULES, "bench")
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    for rate in args.request_rates or ([args.request_rate] if args.request_rate is not None else []):
        if not rate > 0:
            raise ValueError(f"request rates must be > 0 (inf: all at once), got {rate}")
    report = asyncio.run(_main(args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"wrote {args.out}")
    if args.plot:
        plot(report["runs"], args.plot)
        print(f"wrote {args.plot}")
    return 0 if any(r["completed"] for r in report["runs"]) else 1


# ---------------------------------------------------------------------------------------------- arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``inflight bench serve`` (also of ``python -m inflight.serve.bench``)."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument(
        "--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions")
    )
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument(
        "--request-rate", type=float, default=None, help="requests per second (inf: all at once; default inf)"
    )
    rate.add_argument(
        "--request-rates",
        type=float,
        nargs="+",
        default=None,
        help="several rates, one run each (the plot shows latency against rate)",
    )
    p.add_argument(
        "--arrival",
        choices=("poisson", "fixed"),
        default="poisson",
        help="inter-arrival times: exponential (poisson) or constant (fixed)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (mean when --range-ratio > 0)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (mean when --range-ratio > 0)")
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="sample lengths uniformly in [len*(1-r), len*(1+r)] (default 0: fixed lengths)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="token ids of the random prompts are drawn below this (default: the server's vocab_size "
        "from /v1/models, else 1000)",
    )
    p.add_argument(
        "--no-ignore-eos", action="store_true", help="let requests stop at EOS (lengths then vary)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG plot of latency against request rate here")
    p.set_defaults(func=run)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Mounts ``bench`` (with its one benchmark, ``serve``) on a command's subparsers."""
    p = subparsers.add_parser("bench", help="benchmarks (bench serve: load-test a running server)")
    sub = p.add_subparsers(dest="bench_command", required=True)
    s = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)",
        description="Streams requests to a running server at a given rate and reports latencies.",
    )
    add_arguments(s)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"bench serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
