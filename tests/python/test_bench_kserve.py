"""`inflight bench serve --backend openai|kserve-http|kserve-grpc` against a live server on the tiny
llama: every request completes with its forced length, timed, and the server's generated-token
counter agrees with what the load generator counts for the KServe backends (which cannot see tokens)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("tritonclient.grpc")
from serve_utils import LiveServer, tiny_server_llm

from inflight.serve import bench
from inflight.serve.bench_report import summarize

MODEL = "tiny"
N, INPUT_LEN, OUTPUT_LEN = 4, 12, 6


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    llm = tiny_server_llm(tiny_model_dir("llama"))
    srv = LiveServer(llm, name=MODEL, grpc=True)
    yield srv
    srv.stop()
    llm.shutdown()


def bench_args(server, backend: str, *extra: str):
    return bench.build_parser().parse_args(
        [
            "--url",
            server.url,
            "--grpc-url",
            server.grpc_url,
            "--backend",
            backend,
            "--num-prompts",
            str(N),
            "--input-len",
            str(INPUT_LEN),
            "--output-len",
            str(OUTPUT_LEN),
            *extra,
        ]
    )


def generated_tokens(server) -> float:
    """The server's generated-token counter, summed over its labels."""
    return sum(v for k, v in server.metrics().items() if k.startswith("inflight:generation_tokens_total"))


async def one_run(args) -> list:
    import httpx

    async with httpx.AsyncClient(timeout=60) as client, bench.open_sender(args, client, MODEL) as send:
        results, _ = await bench.run_rate(
            send, bench.make_requests(args, MODEL, 384), float("inf"), "poisson", None, 0
        )
    return results


@pytest.mark.parametrize("backend", bench.BACKENDS)
def test_every_backend_streams_forced_lengths(server, backend):
    args = bench_args(server, backend, "--word-prompts")
    before = generated_tokens(server)
    results = asyncio.run(one_run(args))
    server.wait_idle()
    assert [r.error for r in results] == [""] * N
    assert all(r.ok and r.output_tokens == OUTPUT_LEN for r in results)
    assert all(0 < r.ttft <= r.e2e and r.itl and all(x >= 0 for x in r.itl) for r in results)
    # What the KServe backends count (they trust min_length) is what the server generated.
    assert generated_tokens(server) - before == N * OUTPUT_LEN
    s = summarize(results, 1.0, float("inf"), backend)
    assert s["backend"] == backend and s["completed"] == N and s["total_output_tokens"] == N * OUTPUT_LEN


def test_backends_send_the_same_word_prompts(server):
    prompts = {
        b: [
            r.payload.get("text_input", r.payload.get("prompt"))
            for r in bench.make_requests(bench_args(server, b, "--word-prompts"), MODEL, 384)
        ]
        for b in bench.BACKENDS
    }
    assert prompts["openai"] == prompts["kserve-http"] == prompts["kserve-grpc"]
    assert all(isinstance(p, str) and len(p.split()) == INPUT_LEN for p in prompts["openai"])

    def first(backend: str, *extra: str) -> dict:
        return bench.make_requests(bench_args(server, backend, *extra), MODEL, 384)[0].payload

    forced = first("kserve-http")
    assert forced["min_length"] == forced["max_tokens"] == OUTPUT_LEN and forced["exclude_input_in_output"]
    assert "min_length" not in first("kserve-grpc", "--no-ignore-eos")


@pytest.mark.parametrize("backend", ["kserve-http", "kserve-grpc"])
def test_the_command_reports_the_backend(server, backend, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench.run(bench_args(server, backend, "--model", MODEL, "--out", str(out))) == 0
    assert f"==== {backend}: request rate inf req/s" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["config"]["backend"] == backend and report["config"]["model"] == MODEL
    (run,) = report["runs"]
    assert run["backend"] == backend and run["completed"] == N and run["failed"] == 0
    assert run["total_output_tokens"] == N * OUTPUT_LEN
    assert run["ttft_ms"]["p50"] > 0 and math.isfinite(run["itl_ms"]["p50"])
    server.wait_idle()


@pytest.mark.parametrize("backend", ["kserve-http", "kserve-grpc"])
def test_a_refused_kserve_request_is_a_failed_request(server, backend):
    args = bench_args(server, backend, "--output-len", "100000")
    with contextlib.redirect_stdout(None):
        results = asyncio.run(one_run(args))
    assert not any(r.ok for r in results) and all(r.error for r in results)
    server.wait_idle()
