"""KServe v2 routes against the OpenAI route: the same server, the same prompts, three protocols.

Starts one ``inflight serve`` (SmolLM2-135M by default, without prefix caching) with its HTTP and
gRPC ports, warms it up, then loads it through the three backends of ``inflight bench serve``
(:mod:`inflight.serve.bench`): ``openai`` (/v1/completions, ``ignore_eos``), ``kserve-http``
(``generate_stream``, SSE) and ``kserve-grpc`` (``ModelStreamInfer``), the KServe ones with
``min_length = max_tokens``. The default rates are 1 and 4 req/s and inf (all at once): at a rate
the server sustains, throughput follows the arrivals and the protocols differ in latency; at inf,
throughput is the server's capacity through each protocol.

Each rate runs in ``--rounds`` short rounds of about ``--round-seconds`` (``--inf-prompts``
requests at inf); a round runs the three backends back to back on the same random-word prompts at
the same Poisson arrival times, the order rotated from one round to the next. A backend's results
at a rate pool its rounds (throughput: all its tokens over all its rounds' time). Short alternating
rounds spread whatever else the machine runs over the three backends alike; the table says what
share of the CPU other processes took during each backend's rounds, and the server's CPU time per
output token (what a protocol costs the server; less sensitive to such contention than wall time).
The KServe backends cannot see tokens; each round checks that the server's
``inflight:generation_tokens`` counter grew by the tokens the load generator counted.

Prints the CPU, each pooled summary and a table (rate, backend, req/s, output tok/s, TTFT and ITL
p50/p99, output tok/s as a ratio of openai's at the same rate, server CPU per output token, other
processes' CPU share), and writes it all as JSON (docs/bench/kserve-serving-<cpu>-cpu.json by
default).

    python benchmarks/bench_kserve.py [--model smollm2] [--rates 1 4 inf] [--rounds 6]
        [--round-seconds 8] [--inf-prompts 24] [--input-len 64] [--output-len 32] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_common import cpu_header, cpu_tag

from inflight.ops import cpu_info
from inflight.serve import bench
from inflight.serve.bench_report import RequestResult, print_summary, summarize

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lscpu_model() -> str:
    """lscpu's "Model name" (else /proc/cpuinfo's "model name")."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        names = re.findall(r"^Model name:\s*(.+)$", out, re.M)
    except (OSError, subprocess.CalledProcessError):
        names = []
    if not names:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    return names[0].strip() if names else "unknown"


def generated_tokens(url: str) -> float:
    """The server's ``inflight:generation_tokens`` counter, summed over its labels."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("inflight:generation_tokens_total")
    )


def cpu_seconds(server_pid: int) -> tuple[float, float, float]:
    """Busy CPU seconds so far of the whole machine, of the server and of this process (the load
    generator): over a round, the first less the others is what other processes took."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    with open(f"/proc/{server_pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    t = os.times()
    server = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return (user + nice + system + irq + softirq + steal) / tick, server, t.user + t.system


def start_server(model: str, port: int, grpc_port: int, log) -> subprocess.Popen:
    """``inflight serve MODEL`` with HTTP on ``port`` and gRPC on ``grpc_port`` (started before the
    HTTP server, so up once /health answers), without prefix caching: every backend sends the same
    prompts, and none may find them cached."""
    cmd = [
        sys.executable,
        "-m",
        "inflight.serve.server",
        model,
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
        "--disable-access-log",
        "--uvicorn-log-level",
        "warning",
        "--disable-block-reuse",
    ]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            log.seek(0)
            raise RuntimeError(f"the server did not start:\n{log.read().decode(errors='replace')[-3000:]}")
        time.sleep(0.5)


class Bench:
    """Rounds of one backend at one rate against the running server."""

    def __init__(self, url: str, grpc_url: str, server_pid: int, model: str, args):
        self.url = url
        self.grpc_url = grpc_url
        self.server_pid = server_pid
        self.model = model
        self.args = args

    def bench_args(self, backend: str, num_prompts: int, seed: int) -> argparse.Namespace:
        argv = ["--url", self.url, "--grpc-url", self.grpc_url, "--backend", backend, "--model", self.model]
        argv += ["--word-prompts", "--num-prompts", str(num_prompts), "--seed", str(seed)]
        argv += ["--input-len", str(self.args.input_len), "--output-len", str(self.args.output_len)]
        return bench.build_parser().parse_args(argv)

    async def _send_all(self, bargs, rate: float) -> tuple[list[RequestResult], float]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with (
            httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client,
            bench.open_sender(bargs, client, self.model) as send,
        ):
            reqs = bench.make_requests(bargs, self.model, 1000)  # word prompts: no vocabulary needed
            return await bench.run_rate(send, reqs, rate, "poisson", None, bargs.seed)

    def round(self, backend: str, rate: float, num_prompts: int, seed: int) -> dict:
        """One round: its results, wall time, the server's generated tokens and other processes' CPU."""
        before = generated_tokens(self.url)
        busy0, server0, client0 = cpu_seconds(self.server_pid)
        results, duration = asyncio.run(self._send_all(self.bench_args(backend, num_prompts, seed), rate))
        busy1, server1, client1 = cpu_seconds(self.server_pid)
        generated = generated_tokens(self.url) - before
        counted = sum(r.output_tokens for r in results if r.ok)
        if generated != counted:
            print(
                f"WARNING: {backend} at {rate} req/s: the server generated {generated:.0f} tokens, "
                f"the load generator counted {counted}"
            )
        return {
            "results": results,
            "duration_s": duration,
            "server_generation_tokens": generated,
            "server_cpu_s": server1 - server0,
            "client_cpu_s": client1 - client0,
            "other_processes_cpu_s": max(0.0, (busy1 - busy0) - (server1 - server0) - (client1 - client0)),
        }


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'rate':>5} | {'backend':<11} | {'req/s':>6} | {'out tok/s':>9} | {'TTFT p50':>8} | {'TTFT p99':>8} | "
        f"{'ITL p50':>7} | {'ITL p99':>7} | {'vs openai':>9} | {'srv CPU/tok':>11} | {'other CPU':>9}"
    )
    print(head)
    print("-" * len(head))
    base = {r["request_rate"]: r["output_token_throughput"] for r in rows if r["backend"] == "openai"}
    for r in rows:
        ratio = (
            r["output_token_throughput"] / base[r["request_rate"]]
            if base.get(r["request_rate"])
            else math.nan
        )
        other = r["other_processes_cpu_s"] / (r["duration_s"] * (os.cpu_count() or 1))
        per_token = r["server_cpu_s"] * 1e3 / max(1, r["total_output_tokens"])
        print(
            f"{r['request_rate']!s:>5} | {r['backend']:<11} | {r['request_throughput']:6.2f} | "
            f"{r['output_token_throughput']:9.1f} | {r['ttft_ms']['p50']:8.1f} | {r['ttft_ms']['p99']:8.1f} | "
            f"{r['itl_ms']['p50']:7.1f} | {r['itl_ms']['p99']:7.1f} | {ratio:9.3f} | {per_token:8.2f} ms | {other:9.0%}"
        )
    print(
        "(times in ms; ITL: gaps between streamed pieces; vs openai: output tok/s over openai's at that "
        "rate; srv CPU/tok: the server's CPU time per output token; other CPU: the share of the machine's "
        "CPU time that other processes took)"
    )
    done = [r for r in rows if r["backend"] == "openai" and r["completed"]]
    if done:
        per = sum(r["total_input_tokens"] for r in done) / sum(r["completed"] for r in done)
        print(
            f"(the prompts, the same words for every backend, are {per:.1f} tokens on average: openai usage)"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0, float("inf")])
    p.add_argument("--rounds", type=int, default=6, help="rounds per rate (each runs every backend once)")
    p.add_argument("--round-seconds", type=float, default=8.0, help="a round at rate r sends ceil(r x this)")
    p.add_argument("--inf-prompts", type=int, default=24, help="requests of a round at rate inf")
    p.add_argument("--warmup-prompts", type=int, default=8, help="unmeasured requests per backend first")
    p.add_argument("--input-len", type=int, default=64, help="prompt words (~1 token each for these words)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default: docs/bench/kserve-serving-<cpu>-cpu.json")
    args = p.parse_args()

    cpu = lscpu_model()
    out = Path(args.out) if args.out else ROOT / "docs" / "bench" / f"kserve-serving-{cpu_tag(cpu)}-cpu.json"
    print(f"lscpu: {cpu}")
    print(cpu_header())
    print(f"cpu_info: {cpu_info()}")
    port, grpc_port = _free_port(), _free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    pooled: dict[tuple[float, str], list[dict]] = {}
    rounds_log: list[dict] = []
    with tempfile.TemporaryFile() as log:
        server = start_server(args.model, port, grpc_port, log)
        try:
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            b = Bench(url, f"127.0.0.1:{grpc_port}", server.pid, model, args)
            print(f"{model} served in {time.monotonic() - t0:.0f} s; warming up")
            for backend in bench.BACKENDS:
                b.round(backend, math.inf, args.warmup_prompts, args.seed + args.rounds)  # other prompts
            for rate in args.rates:
                n = args.inf_prompts if math.isinf(rate) else max(1, math.ceil(rate * args.round_seconds))
                for i in range(args.rounds):
                    k = i % len(bench.BACKENDS)
                    for backend in bench.BACKENDS[k:] + bench.BACKENDS[:k]:
                        r = b.round(backend, rate, n, args.seed + i)
                        pooled.setdefault((rate, backend), []).append(r)
                        ok = [x for x in r["results"] if x.ok]
                        rounds_log.append(
                            {
                                "request_rate": rate if math.isfinite(rate) else "inf",
                                "round": i,
                                "backend": backend,
                                "duration_s": r["duration_s"],
                                "output_token_throughput": sum(x.output_tokens for x in ok) / r["duration_s"],
                                "failed": len(r["results"]) - len(ok),
                                "server_cpu_s": r["server_cpu_s"],
                                "client_cpu_s": r["client_cpu_s"],
                                "other_processes_cpu_s": r["other_processes_cpu_s"],
                            }
                        )
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    rows = []
    for (rate, backend), rs in pooled.items():
        s = summarize([x for r in rs for x in r["results"]], sum(r["duration_s"] for r in rs), rate, backend)
        s["rounds"] = len(rs)
        for key in ("server_generation_tokens", "server_cpu_s", "client_cpu_s", "other_processes_cpu_s"):
            s[key] = sum(r[key] for r in rs)
        rows.append(s)
    rows.sort(key=lambda r: (args.rates.index(float(r["request_rate"])), bench.BACKENDS.index(r["backend"])))
    for s in rows:
        print_summary(s)
    print(
        f"\n{model}, {args.rounds} rounds per rate, {args.input_len} prompt words, {args.output_len} output "
        f"tokens; {time.monotonic() - t0:.0f} s in all\n"
    )
    print_table(rows)
    result = {
        "cpu": cpu,
        "header": cpu_header(),
        "cpu_info": cpu_info(),
        "model": model,
        "config": {**vars(args), "rates": [r if math.isfinite(r) else "inf" for r in args.rates]},
        "runs": rows,
        "rounds": rounds_log,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
