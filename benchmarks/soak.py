"""Soak: does `inflight serve` keep its memory flat under hostile, mixed traffic?

Starts `inflight serve` (SmolLM2-135M by default) in a child process with a small KV pool, warms it up
until the pool has been touched, then runs a mix for --minutes: long prompts (a few thousand tokens),
large n, streams, streams the client abandons after a few tokens, chat requests, and requests the
server must refuse. The server's RSS (VmRSS of /proc/PID/status) is sampled every few seconds; the
KV pool is allocated lazily, so the warm-up fills it first and what grows afterwards is the server's
own memory. Pass: the RSS at the end is within --tolerance (20 %) of the RSS after warm-up.

Writes the samples as JSON and the RSS curve as a PNG (matplotlib).

    python benchmarks/soak.py [--minutes 20] [--model smollm2] [--concurrency 8] [--out soak.json]
        [--plot soak.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time

import httpx


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(client: httpx.AsyncClient, rng: random.Random, vocab: int, counts: dict[str, int]) -> None:
    kind = rng.choice(["long", "large_n", "stream", "abandon", "chat", "refused"])
    ids = [rng.randrange(100, vocab) for _ in range(rng.randint(8, 64))]
    try:
        if kind == "long":
            body = {
                "prompt": [rng.randrange(100, vocab) for _ in range(rng.randint(1500, 3500))],
                "max_tokens": 8,
            }
            await client.post("/v1/completions", json=body)
        elif kind == "large_n":
            await client.post(
                "/v1/completions", json={"prompt": ids, "max_tokens": 12, "n": 48, "temperature": 1.0}
            )
        elif kind in ("stream", "abandon"):
            body = {"prompt": ids, "max_tokens": 64, "stream": True, "ignore_eos": True}
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                seen = 0
                async for line in resp.aiter_lines():
                    seen += line.startswith("data: ")
                    if kind == "abandon" and seen >= 3:
                        break  # the client goes away mid-stream
        elif kind == "chat":
            msgs = [
                {
                    "role": "user",
                    "content": "Tell me about "
                    + " ".join(rng.choice(["cats", "rain", "maps"]) for _ in range(20)),
                }
            ]
            await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 24})
        else:
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "n": 100000})
        counts[kind] = counts.get(kind, 0) + 1
    except httpx.HTTPError:
        counts["http_error"] = counts.get("http_error", 0) + 1


async def _traffic(url: str, seconds: float, concurrency: int, vocab: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def worker(i: int) -> None:
            r = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                await _one(client, r, vocab, counts)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    del rng
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--warmup-minutes", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--kv-cache-max-tokens", type=int, default=16384)
    p.add_argument("--sample-seconds", type=float, default=5.0)
    p.add_argument("--tolerance", type=float, default=0.20)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "inflight.serve.server",
        args.model,
        "--port",
        str(port),
        "--disable-access-log",
        "--uvicorn-log-level",
        "warning",
        "--kv-cache-max-tokens",
        str(args.kv_cache_max_tokens),
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: list[tuple[float, float, str]] = []
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {server.stderr.read()[-2000:]}")
            time.sleep(0.5)
        vocab = httpx.get(url + "/v1/models").json()["data"][0]["vocab_size"]
        t0 = time.monotonic()
        stop = [False]

        def sample(phase: str) -> None:
            samples.append((time.monotonic() - t0, _rss_mib(server.pid), phase))

        async def run_phase(phase: str, minutes: float, seed: int) -> dict[str, int]:
            async def sampler() -> None:
                while not stop[0]:
                    sample(phase)
                    await asyncio.sleep(args.sample_seconds)

            task = asyncio.ensure_future(sampler())
            try:
                return await _traffic(url, minutes * 60, args.concurrency, vocab, seed)
            finally:
                stop[0] = True
                await task
                stop[0] = False

        warm = asyncio.run(run_phase("warm-up", args.warmup_minutes, 1))
        time.sleep(2)
        sample("after warm-up")
        base = samples[-1][1]
        soak = asyncio.run(run_phase("soak", args.minutes, 2))
        time.sleep(2)
        sample("end")
        end = samples[-1][1]
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    growth = end / base - 1
    with open("/proc/cpuinfo") as f:
        cpu = next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
            platform.processor(),
        )
    ok = growth <= args.tolerance
    print(
        f"CPU: {cpu}; {args.model}, {args.minutes:g} min soak after {args.warmup_minutes:g} min warm-up, "
        f"concurrency {args.concurrency}"
    )
    print(f"requests: warm-up {warm}, soak {soak}")
    print(
        f"RSS after warm-up {base:.0f} MiB, at the end {end:.0f} MiB ({growth:+.1%}; max "
        f"{max(s[1] for s in samples):.0f} MiB): {'within' if ok else 'OVER'} {args.tolerance:.0%}"
    )
    report = {
        "cpu": cpu,
        "model": args.model,
        "minutes": args.minutes,
        "rss_after_warmup_mib": base,
        "rss_end_mib": end,
        "growth": growth,
        "ok": ok,
        "requests": {"warm-up": warm, "soak": soak},
        "samples": samples,
        "pid_env": {"MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX")},
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot([s[0] / 60 for s in samples], [s[1] for s in samples], lw=1.5)
        ax.axhline(base, color="grey", ls="--", lw=1, label=f"after warm-up ({base:.0f} MiB)")
        ax.axhline(base * (1 + args.tolerance), color="red", ls=":", lw=1, label=f"+{args.tolerance:.0%}")
        ax.axvline(args.warmup_minutes, color="grey", lw=0.8)
        ax.set_xlabel("minutes")
        ax.set_ylabel("server RSS (MiB)")
        ax.set_title(f"inflight serve {args.model}: RSS under mixed hostile traffic ({cpu})", fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
