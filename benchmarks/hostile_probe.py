"""Hostile requests against a running OpenAI-compatible server, one probe per failure an outside tester
found in `inflight serve` (see docs/api.md, "Errors"), each reported as what the server did:

  poison     {"top_p": 1e-300} (a value float32 turns into 0) beside a running stream: the poison
             request's status, and whether the stream beside it still completed
  huge_n     {"n": 100000, "max_tokens": 1}: the status and how long the answer took
  surrogate  a prompt with a lone surrogate (\\ud800): the status (a 500 is a crash)
  metrics    50 streams cut by their clients: the running/waiting gauges of /metrics 2 s later
  stall      a stream's longest gap between tokens while an 8,000-token prompt prefills (skipped when
             the model's context is shorter)
  schema     /openapi.json: the documented statuses of /v1/completions, whether `prompt` is typed,
             whether max_tokens=2.0 is accepted

    python benchmarks/hostile_probe.py --url http://127.0.0.1:8000 [--probes NAME ...] [--json out.json]

A server that huge_n wedges fails every probe after it: against such a server, run huge_n last
(``--probes poison surrogate metrics stall schema huge_n``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time

import httpx

TIMEOUT = 120


def _stream(client: httpx.Client, body: dict, stamps: list[float], done: dict) -> None:
    """Streams a completion, stamping each chunk; ``done["ok"]``: it ended with [DONE] after a chunk
    that was not an error."""
    previous = ""
    try:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    stamps.append(time.perf_counter())
                    if line == "data: [DONE]":
                        done["ok"] = '"error"' not in previous
                    previous = line
    except httpx.HTTPError as exc:
        done["error"] = repr(exc)


def probe_poison(client: httpx.Client) -> dict:
    stamps: list[float] = []
    done: dict = {}
    t = threading.Thread(
        target=_stream,
        args=(client, {"prompt": [1, 2, 3], "max_tokens": 64, "ignore_eos": True}, stamps, done),
    )
    t.start()
    while len(stamps) < 3 and t.is_alive():
        time.sleep(0.01)
    resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "top_p": 1e-300})
    t.join(TIMEOUT)
    return {"poison_status": resp.status_code, "stream_beside_completed": bool(done.get("ok"))}


def probe_huge_n(client: httpx.Client) -> dict:
    t0 = time.perf_counter()
    try:
        resp = client.post(
            "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 1, "n": 100000}, timeout=20
        )
        status = resp.status_code
    except httpx.TimeoutException:
        status = "timeout (20 s)"
    took = time.perf_counter() - t0
    health = client.get("/health").status_code
    return {"status": status, "seconds": round(took, 2), "health_after": health}


def probe_surrogate(client: httpx.Client) -> dict:
    resp = client.post(
        "/v1/completions",
        content='{"prompt": "lone \\ud800", "max_tokens": 4}',
        headers={"content-type": "application/json"},
    )
    return {"status": resp.status_code}


def _gauges(client: httpx.Client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_used_blocks"):
            if line.startswith(f"inflight:{name} "):
                out[name] = float(line.split()[1])
    return out


def probe_metrics(client: httpx.Client, url: str) -> dict:
    streams = []
    for i in range(50):
        c = httpx.Client(base_url=url, timeout=TIMEOUT)
        cm = c.stream(
            "POST",
            "/v1/completions",
            json={"prompt": [5 + i % 7, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True},
        )
        resp = cm.__enter__()
        next(resp.iter_lines())
        streams.append((c, cm))
    for c, cm in streams:
        cm.__exit__(None, None, None)
        c.close()
    time.sleep(2.0)
    return _gauges(client)


def probe_stall(client: httpx.Client, prompt_tokens: int = 8000) -> dict:
    max_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
    if max_len <= prompt_tokens + 1:
        return {"skipped": f"max_model_len {max_len} < {prompt_tokens + 1}"}
    stamps: list[float] = []
    done: dict = {}
    t = threading.Thread(
        target=_stream,
        args=(client, {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True}, stamps, done),
    )
    t.start()
    while len(stamps) < 10 and t.is_alive():
        time.sleep(0.01)
    t_long = time.perf_counter()
    resp = client.post(
        "/v1/completions", json={"prompt": [200 + i % 40000 for i in range(prompt_tokens)], "max_tokens": 1}
    )
    t.join(TIMEOUT)
    gaps = [b - a for a, b in itertools.pairwise(stamps) if b >= t_long]
    return {"long_prompt_status": resp.status_code, "max_stall_s": round(max(gaps), 2) if gaps else None}


def probe_schema(client: httpx.Client) -> dict:
    schema = client.get("/openapi.json").json()
    op = schema["paths"]["/v1/completions"]["post"]
    body = op["requestBody"]["content"]["application/json"]["schema"]
    ref = body.get("$ref", "").rsplit("/", 1)[-1]
    prompt = schema["components"]["schemas"][ref]["properties"]["prompt"]
    resp = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2.0})
    return {
        "documented_statuses": sorted(op["responses"]),
        "prompt_typed": "anyOf" in prompt or "type" in prompt,
        "max_tokens_2.0_status": resp.status_code,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--json", default=None)
    probes = {
        "poison": probe_poison,
        "huge_n": probe_huge_n,
        "surrogate": probe_surrogate,
        "metrics": lambda c: probe_metrics(c, args.url),
        "stall": probe_stall,
        "schema": probe_schema,
    }
    p.add_argument("--probes", nargs="+", choices=list(probes), default=list(probes), help="in this order")
    args = p.parse_args()
    client = httpx.Client(base_url=args.url, timeout=TIMEOUT)
    report = {}
    for name in args.probes:
        fn = probes[name]
        try:
            report[name] = fn(client)
        except Exception as exc:  # noqa: BLE001  (a probe that breaks the server is a finding too)
            report[name] = {"probe_failed": repr(exc)}
        print(f"{name:<10} {json.dumps(report[name])}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
