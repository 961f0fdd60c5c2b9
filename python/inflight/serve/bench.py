"""Load generator for an OpenAI-compatible or KServe v2 server (inflight's, or any other):
``inflight bench serve``.

Sends ``--num-prompts`` streaming requests of ``--input-len`` prompt tokens and ``--output-len``
output tokens at ``--request-rate`` requests/s (Poisson or fixed arrivals; inf = all at once), at most
``--max-concurrency`` at a time, and reports TTFT, TPOT (time per output token after the first),
ITL (inter-token latency: the gaps between streamed chunks) and E2E latency (mean, p50, p90, p99),
plus request and token throughput. Several rates (``--request-rates 2 4 8``) give one run each;
``--out`` writes JSON, ``--plot`` a PNG of latency against request rate.

``--backend`` picks the protocol:

* ``openai`` (default): ``--endpoint`` /v1/completions (random token-id prompts, or random words with
  ``--word-prompts``) or /v1/chat/completions (random words); ``ignore_eos`` forces the length.
* ``kserve-http``: Triton's generate extension, one ``POST /v2/models/{m}/generate_stream`` (SSE) per
  request, with the TensorRT-LLM backend's inputs.
* ``kserve-grpc``: Triton's ``ModelStreamInfer`` at ``--grpc-url`` (tritonclient.grpc.aio), one
  stream per request.

The KServe interface takes text, so both KServe backends send random words (the same words, for the
same seed, as chat and ``--word-prompts``; ``--input-len`` then counts words, and the prompt token
counts reported for them are those word counts: the client has no tokenizer). They force the
output length the TensorRT-LLM way, ``min_length = max_tokens``, and count ``--output-len`` tokens
for a request that streamed to its end; with ``--no-ignore-eos`` they count one token per streamed
piece of text instead (servers may merge tokens into one piece, so that undercounts).

    inflight bench serve --url http://127.0.0.1:8000 --request-rates 2 4 8 --num-prompts 200 \\
        --input-len 128 --output-len 64 --out results.json --plot latency.png
    inflight bench serve --backend kserve-grpc --grpc-url 127.0.0.1:8001 --model smollm2 ...
    python benchmarks/serving.py --url ... (same arguments)

This module owns the command: :func:`add_parser` mounts ``bench serve`` on ``inflight``'s
subcommands, :func:`add_arguments` gives its options and :func:`run` runs it. httpx (the ``bench``
extra), tritonclient (``kserve-grpc``) and matplotlib (``--plot``) are imported only when a run needs
them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from inflight.serve.bench_report import RequestResult, plot, print_summary, summarize
from inflight.serve.extras import BENCH_MODULES, require_extra

BACKENDS = ("openai", "kserve-http", "kserve-grpc")

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
    """One request: its body (OpenAI JSON, or the KServe inputs by name) and its lengths."""

    payload: dict
    prompt_len: int
    output_len: int


Sender = Callable[[BenchRequest], Awaitable[RequestResult]]


# ---------------------------------------------------------------------------------------------- requests


def _lengths(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    if ratio <= 0:
        return [mean] * n
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _word_prompt(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def kserve_payload(text: str, output_len: int, force_len: bool) -> dict[str, Any]:
    """The TensorRT-LLM backend's inputs of one streamed request: greedy (neither top_k nor top_p),
    only the new text back, and ``min_length = max_tokens`` when the length is forced."""
    fields: dict[str, Any] = {
        "text_input": text,
        "max_tokens": output_len,
        "stream": True,
        "exclude_input_in_output": True,
    }
    if force_len:
        fields["min_length"] = output_len
    return fields


def make_requests(args, model: str, vocab_size: int) -> list[BenchRequest]:
    """The requests of every run. Word prompts draw the same words for the same seed whatever the
    backend, so that the backends can be compared on equal prompts."""
    rng = random.Random(args.seed)
    ins = _lengths(args.input_len, args.range_ratio, args.num_prompts, rng)
    outs = _lengths(args.output_len, args.range_ratio, args.num_prompts, rng)
    low = min(10, vocab_size - 1)
    reqs = []
    for n_in, n_out in zip(ins, outs):
        if args.backend != "openai":
            payload = kserve_payload(_word_prompt(n_in, rng), n_out, not args.no_ignore_eos)
            reqs.append(BenchRequest(payload, n_in, n_out))
            continue
        payload = {
            "model": model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        if not args.no_ignore_eos:
            payload["ignore_eos"] = True
        if args.endpoint.endswith("/chat/completions"):
            payload["messages"] = [{"role": "user", "content": _word_prompt(n_in, rng)}]
            payload["max_completion_tokens"] = n_out
        else:
            if args.word_prompts:
                payload["prompt"] = _word_prompt(n_in, rng)
            else:
                payload["prompt"] = [rng.randrange(low, vocab_size) for _ in range(n_in)]
            payload["max_tokens"] = n_out
        reqs.append(BenchRequest(payload, n_in, n_out))
    return reqs


class _Clock:
    """Times one request's streamed pieces: TTFT at the first, ITL between the next ones."""

    def __init__(self, res: RequestResult):
        self.res = res
        self.last: float | None = None
        self.pieces = 0
        res.start = time.perf_counter()

    def piece(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.res.ttft = now - self.res.start
        else:
            self.res.itl.append(now - self.last)
        self.last = now
        self.pieces += 1

    def finish(self, output_tokens: int) -> RequestResult:
        """Ends a request that streamed to its end (ok when it streamed something)."""
        res = self.res
        res.e2e = time.perf_counter() - res.start
        res.output_tokens = output_tokens
        res.ok = self.last is not None
        if not res.ok:
            res.error = "no tokens were streamed"
        return res


def _error_text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


async def _sse_events(client, url: str, payload: dict, res: RequestResult) -> AsyncIterator[Any]:
    """The JSON of each ``data:`` event of a streamed POST (up to ``[DONE]``); a refused request sets
    ``res.error`` and yields nothing."""
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            res.error = f"HTTP {resp.status_code}: {body[:300]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


async def send_one(client, url: str, req: BenchRequest) -> RequestResult:
    """One streamed OpenAI request; output tokens from its usage chunk (else counted per chunk)."""
    res = RequestResult(prompt_len=req.prompt_len)
    clock = _Clock(res)
    counted = 0
    usage_tokens = None
    try:
        async with contextlib.aclosing(_sse_events(client, url, req.payload, res)) as events:
            async for obj in events:
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
                if n:
                    clock.piece()
                    counted += n
    except Exception as exc:  # noqa: BLE001  (reported per request)
        res.error = _error_text(exc)
        return res
    if res.error:
        return res
    return clock.finish(usage_tokens if usage_tokens is not None else counted)


def _kserve_tokens(req: BenchRequest, pieces: int) -> int:
    """The output tokens of a KServe request that streamed to its end: ``min_length`` forces
    ``output_len`` (the interface returns no token counts); otherwise one per streamed piece."""
    return req.output_len if "min_length" in req.payload else pieces


async def send_kserve_http(client, url: str, req: BenchRequest) -> RequestResult:
    """One ``generate_stream`` request: a piece per event with new ``text_output``."""
    res = RequestResult(prompt_len=req.prompt_len)
    clock = _Clock(res)
    try:
        async with contextlib.aclosing(_sse_events(client, url, req.payload, res)) as events:
            async for obj in events:
                if "error" in obj:
                    res.error = str(obj["error"])
                    return res
                if obj.get("text_output"):
                    clock.piece()
    except Exception as exc:  # noqa: BLE001  (reported per request)
        res.error = _error_text(exc)
        return res
    if res.error:
        return res
    return clock.finish(_kserve_tokens(req, clock.pieces))


# KServe datatype and numpy dtype of each python type of a kserve_payload field.
_GRPC_TYPES = {str: ("BYTES", "object"), bool: ("BOOL", "bool"), int: ("INT32", "int32")}


def grpc_inputs(fields: dict[str, Any]) -> list:
    """The KServe inputs of :func:`kserve_payload` as tritonclient gRPC tensors of shape [1, 1]."""
    import numpy as np
    from tritonclient.grpc import InferInput

    tensors = []
    for name, value in fields.items():
        datatype, dtype = _GRPC_TYPES[type(value)]
        tensor = InferInput(name, [1, 1], datatype)
        tensor.set_data_from_numpy(
            np.array([[value.encode() if isinstance(value, str) else value]], dtype=dtype)
        )
        tensors.append(tensor)
    return tensors


async def send_kserve_grpc(client, model: str, req: BenchRequest) -> RequestResult:
    """One request on its own ``ModelStreamInfer`` stream: a piece per response with new
    ``text_output``; done at the response flagged ``triton_final_response``.

    One stream per request (all on the client's one channel, multiplexed by HTTP/2) rather than one
    shared stream: each request then has its own flow of responses, as each OpenAI or generate_stream
    request has its own HTTP response, and no request's responses wait behind another's in a shared
    stream's single queue, on the server or in the client."""
    from tritonclient.grpc import InferRequestedOutput

    res = RequestResult(prompt_len=req.prompt_len)
    clock = _Clock(res)

    async def one_request():  # ends after one: the client half-closes, the server ends the stream
        yield {
            "model_name": model,
            "inputs": grpc_inputs(req.payload),
            "outputs": [InferRequestedOutput("text_output")],
        }

    done: RequestResult | None = None
    try:
        # Read to the stream's end (the server ends it after the final response): a call dropped
        # before its status arrives would be cancelled.
        async for result, error in client.stream_infer(one_request()):
            if done is not None:
                continue
            if error is not None:
                res.error = str(error)
                return res
            text = result.as_numpy("text_output")
            if text is not None and text.size and text.reshape(-1)[0]:
                clock.piece()
            params = result.get_response().parameters
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                done = clock.finish(_kserve_tokens(req, clock.pieces))
    except Exception as exc:  # noqa: BLE001  (reported per request)
        res.error = _error_text(exc)
        return res
    if done is None:
        res.error = "the stream ended without a final response"
        return res
    return done


async def run_rate(
    send: Sender,
    reqs: list[BenchRequest],
    rate: float,
    arrival: str,
    max_concurrency: int | None,
    seed: int,
) -> tuple[list[RequestResult], float]:
    """All requests through ``send`` at ``rate`` requests/s; returns the results and the wall time."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(req: BenchRequest) -> RequestResult:
        if sem is None:
            return await send(req)
        async with sem:
            return await send(req)

    t0 = time.perf_counter()
    tasks = []
    for i, req in enumerate(reqs):
        tasks.append(asyncio.ensure_future(limited(req)))
        if i + 1 < len(reqs) and math.isfinite(rate) and rate > 0:
            await asyncio.sleep(rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate)
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- driver


def grpc_url(args) -> str:
    """``--grpc-url``, else the host of ``--url`` on Triton's gRPC port 8001."""
    return args.grpc_url or f"{urlsplit(args.url).hostname or '127.0.0.1'}:8001"


async def _model_entry(client, base: str, model: str | None) -> tuple[str, dict]:
    """The model to benchmark (``--model``, else the first of /v1/models) and its /v1/models entry
    (empty when not listed)."""
    resp = await client.get(base + "/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    model = model or (data[0]["id"] if data else None)
    if model is None:
        raise ValueError("the server lists no model: pass --model")
    return model, next((d for d in data if d.get("id") == model), {})


@contextlib.asynccontextmanager
async def open_sender(args, client, model: str) -> AsyncIterator[Sender]:
    """The request sender of ``args.backend`` (after checking that a KServe model is ready)."""
    base = args.url.rstrip("/")
    if args.backend == "openai":
        yield functools.partial(send_one, client, base + args.endpoint)
    elif args.backend == "kserve-http":
        resp = await client.get(f"{base}/v2/models/{model}/ready")
        if resp.status_code != 200:
            raise ValueError(f"GET /v2/models/{model}/ready answered {resp.status_code}: {resp.text[:200]}")
        yield functools.partial(send_kserve_http, client, f"{base}/v2/models/{model}/generate_stream")
    else:
        from tritonclient.grpc.aio import InferenceServerClient

        grpc = InferenceServerClient(grpc_url(args))
        try:
            if not await grpc.is_model_ready(model):
                raise ValueError(f"model '{model}' is not ready on the gRPC server {grpc_url(args)}")
            yield functools.partial(send_kserve_grpc, grpc, model)
        finally:
            await grpc.close()


async def run_async(args) -> dict:
    """Every rate of ``args`` over ``args.backend``, each summary printed; returns the report
    (``config`` and ``runs``, as ``--out`` writes it)."""
    import httpx

    base = args.url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30.0), limits=limits) as client:
        if args.backend == "openai" or args.model is None:
            model, entry = await _model_entry(client, base, args.model)
        else:  # a KServe server need not serve /v1/models (inflight's serves both)
            model, entry = args.model, {}
        vocab = args.vocab_size or entry.get("vocab_size") or 1000
        reqs = make_requests(args, model, vocab)
        rates = args.request_rates or [args.request_rate if args.request_rate is not None else float("inf")]
        runs = []
        async with open_sender(args, client, model) as send:
            for rate in rates:
                results, duration = await run_rate(
                    send, reqs, rate, args.arrival, args.max_concurrency, args.seed
                )
                summary = summarize(results, duration, rate, args.backend)
                print_summary(summary)
                runs.append(summary)
    config = {k: v for k, v in vars(args).items() if k != "func" and not callable(v)}
    config["model"] = model
    return {"config": config, "runs": runs}


def check_args(args) -> None:
    """ValueError for arguments out of range or a backend whose client is not installed."""
    require_extra(BENCH_MODULES, "bench")
    if args.backend == "kserve-grpc" and any(
        importlib.util.find_spec(m) is None for m in ("tritonclient", "grpc")
    ):
        raise ValueError(
            '--backend kserve-grpc needs tritonclient\'s gRPC client: pip install "tritonclient[grpc]"'
        )
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


def run(args) -> int:
    """``inflight bench serve``: runs every rate, prints, writes --out and --plot; 1 if nothing completed."""
    check_args(args)
    report = asyncio.run(run_async(args))
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
        "--backend",
        choices=BACKENDS,
        default="openai",
        help="openai: --endpoint; kserve-http: POST /v2/models/{m}/generate_stream (SSE); kserve-grpc: "
        "Triton's ModelStreamInfer at --grpc-url (default openai)",
    )
    p.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=("/v1/completions", "/v1/chat/completions"),
        help="the OpenAI route (--backend openai)",
    )
    p.add_argument(
        "--grpc-url",
        default=None,
        help="host:port of the gRPC server (--backend kserve-grpc; default: the host of --url, port 8001)",
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
    p.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="prompt tokens, or words for word prompts (mean when --range-ratio > 0)",
    )
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
        "--word-prompts",
        action="store_true",
        help="/v1/completions prompts of random words (the prompts of chat and the KServe backends) "
        "instead of random token ids",
    )
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests stop at EOS (lengths then vary; KServe: no min_length)",
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
        help="load-test an OpenAI-compatible or KServe v2 server (TTFT, TPOT, ITL, throughput)",
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
