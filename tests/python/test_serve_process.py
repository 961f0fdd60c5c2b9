"""`python -m inflight.serve.server` as a subprocess: SIGTERM drains (the streaming request finishes,
new requests get 503, the process exits 0), and the CLI parsers. Every wait is bounded."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

TIMEOUT = 90

# The real entry point, with each engine step slowed to >= 10 ms so that a 300-token request is still
# streaming (>= 3 s) while the test sends SIGTERM and new requests.
_SLOW_MAIN = """
import sys, time
from inflight.executor.model_engine import ModelEngine
_forward = ModelEngine.forward
def _slow(self, *a, **k):
    time.sleep(0.01)
    return _forward(self, *a, **k)
ModelEngine.forward = _slow
from inflight.serve.server import main
sys.exit(main(sys.argv[1:]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the server did not become healthy:\n{log.read_text()[-3000:]}")


def test_sigterm_drains_and_exits_0(tiny_model_dir, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    cmd = [
        sys.executable,
        "-c",
        _SLOW_MAIN,
        str(tiny_model_dir("llama")),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--kv-cache-max-tokens",
        "2048",
        "--tokens-per-block",
        "8",
        "--served-model-name",
        "tiny",
        "--drain-timeout",
        "60",
        "--disable-access-log",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(url, proc, log)
        first_token = threading.Event()
        result: dict = {}

        def stream():
            body = {
                "model": "tiny",
                "prompt": [5, 6, 7],
                "max_tokens": 300,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            try:
                lines = []
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as resp:
                    result["status"] = resp.status_code
                    for line in resp.iter_lines():
                        if line:
                            lines.append(line)
                            first_token.set()
                result["lines"] = lines
            except Exception as exc:  # noqa: BLE001  (reported by the assertions below)
                result["error"] = repr(exc)
            finally:
                first_token.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert first_token.wait(TIMEOUT), "no token streamed"
        assert "error" not in result, result
        proc.send_signal(signal.SIGTERM)

        # new requests are refused with 503 while the stream drains
        deadline = time.monotonic() + 10
        refused = None
        while time.monotonic() < deadline:
            resp = httpx.post(
                url + "/v1/completions", json={"model": "tiny", "prompt": [5], "max_tokens": 1}, timeout=10
            )
            if resp.status_code == 503:
                refused = resp
                break
            time.sleep(0.05)
        assert refused is not None, "no request was refused after SIGTERM"
        assert refused.json()["error"]["code"] == "server_draining"
        assert httpx.get(url + "/health", timeout=10).status_code == 503

        t.join(TIMEOUT)
        assert not t.is_alive(), "the stream did not finish"
        assert "error" not in result, result
        lines = result["lines"]
        assert lines[-1] == "data: [DONE]"
        usage = json.loads(lines[-2][len("data: ") :])["usage"]
        assert usage["completion_tokens"] == 300
        assert proc.wait(TIMEOUT) == 0, log.read_text()[-3000:]
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert "draining" in text and "server stopped" in text, text[-3000:]


def test_cli_parsers():
    import argparse

    from inflight.serve import bench, server

    parser = argparse.ArgumentParser(prog="inflight")
    sub = parser.add_subparsers(dest="command", required=True)
    server.add_parser(sub)
    bench.add_parser(sub)
    args = parser.parse_args(
        [
            "serve",
            "some/model",
            "--port",
            "9000",
            "--max-batch-size",
            "8",
            "--enable-chunked-prefill",
            "--capacity-scheduler-policy",
            "MAX_UTILIZATION",
            "--kv-cache-free-memory-fraction",
            "0.5",
            "--tokens-per-block",
            "16",
            "--dtype",
            "bfloat16",
            "--quantization",
            "gguf",
        ]
    )
    assert (args.model, args.port, args.max_batch_size, args.enable_chunked_prefill) == (
        "some/model",
        9000,
        8,
        True,
    )
    assert args.capacity_scheduler_policy == "MAX_UTILIZATION" and args.tokens_per_block == 16
    assert args.host == "127.0.0.1" and args.max_queue_size == 1024
    assert (args.dtype, args.quantization) == ("bfloat16", "gguf")
    args = parser.parse_args(
        [
            "bench",
            "serve",
            "--url",
            "http://x:1",
            "--request-rates",
            "2",
            "4",
            "8",
            "--max-concurrency",
            "4",
            "--num-prompts",
            "10",
            "--arrival",
            "fixed",
        ]
    )
    assert args.request_rates == [2, 4, 8] and args.arrival == "fixed" and callable(args.func)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "serve", "--request-rate", "2", "--request-rates", "4"])


def test_serve_engine_options_are_llm_args():
    """Every engine option of `inflight serve` is an LlmArgs field, read back by LlmArgs.from_cli."""
    import argparse

    from inflight.batch_manager import CapacitySchedulerPolicy
    from inflight.llm_args import LlmArgs
    from inflight.serve import server

    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    # serve's defaults are LlmArgs' except where a public server needs others (SERVE_DEFAULTS).
    assert LlmArgs.from_cli(parser.parse_args([]), model="m") == LlmArgs(model="m", **server.SERVE_DEFAULTS)
    assert server.SERVE_DEFAULTS["enable_chunked_prefill"] is True
    # The serving token budget follows the machine: vLLM's 2048 with CUDA, 256 on a CPU.
    assert server.SERVE_DEFAULTS["max_num_tokens"] == (2048 if torch.cuda.is_available() else 256)
    assert (
        LlmArgs.from_cli(parser.parse_args(["--no-enable-chunked-prefill"]), model="m").enable_chunked_prefill
        is False
    )
    args = parser.parse_args(
        [
            "m",
            "--disable-block-reuse",
            "--tokens-per-block",
            "16",
            "--kv-cache-max-tokens",
            "512",
            "--capacity-scheduler-policy",
            "max_utilization",
            "--max-num-tokens",
            "64",
            "--disable-overlap-scheduler",
            "--seed",
            "7",
            "--device",
            "cpu",
        ]
    )
    la = LlmArgs.from_cli(args, model=args.model)
    kv = la.kv_cache_config
    assert (kv.enable_block_reuse, kv.tokens_per_block, kv.max_tokens) == (False, 16, 512)
    assert la.scheduler_config.capacity_scheduler_policy == CapacitySchedulerPolicy.MAX_UTILIZATION
    assert (la.max_num_tokens, la.disable_overlap_scheduler, la.seed, la.device) == (64, True, 7, "cpu")
    assert la.to_kwargs()["kv_cache_config"] is kv and la.to_kwargs()["model"] == "m"


def test_serve_refuses_bad_arguments(tiny_model_dir):
    cmd = [
        sys.executable,
        "-m",
        "inflight.serve.server",
        str(tiny_model_dir("llama")),
        "--capacity-scheduler-policy",
        "NOPE",
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 2
    assert "capacity_scheduler_policy" in proc.stderr


def test_model_repository_command(tiny_model_dir, tmp_path):
    """`inflight serve --model-repository DIR` (control mode none): every model loads at start-up, a
    broken one is UNAVAILABLE with its reason and keeps the server not ready, the KV split is logged,
    load/unload are refused in this mode, the OpenAI routes serve by model name, SIGTERM exits 0."""
    pytest.importorskip("tritonclient.grpc")
    model = str(tiny_model_dir("llama"))
    root = tmp_path / "repo"
    (root / "alpha").mkdir(parents=True)
    (root / "alpha" / "config.pbtxt").write_text(
        f'max_batch_size: 4\nparameters {{ key: "model" value {{ string_value: "{model}" }} }}\n'
        'parameters { key: "max_tokens_in_paged_kv_cache" value { string_value: "1024" } }\n'
    )
    (root / "broken").mkdir()
    (root / "broken" / "config.pbtxt").write_text("max_batch_size: not-a-number\n")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "inflight.serve.server",
        "--model-repository",
        str(root),
        "--port",
        str(port),
        "--grpc-port",
        "-1",
        "--dtype",
        "float32",
        "--tokens-per-block",
        "8",
        "--disable-access-log",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(url, proc, log)
        index = {m["name"]: m for m in httpx.post(url + "/v2/repository/index", timeout=10).json()}
        assert index["alpha"]["state"] == "READY"
        assert index["broken"]["state"] == "UNAVAILABLE" and "max_batch_size" in index["broken"]["reason"]
        assert httpx.get(url + "/v2/health/ready", timeout=10).status_code == 400  # broken at start-up
        assert httpx.get(url + "/v2/models/alpha/ready", timeout=10).status_code == 200
        load = httpx.post(url + "/v2/repository/models/alpha/load", timeout=10)
        assert load.status_code == 400 and "--model-control-mode none" in load.json()["error"]
        resp = httpx.post(
            url + "/v1/completions", json={"model": "alpha", "prompt": [5, 6], "max_tokens": 3}, timeout=30
        )
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert "KV memory split equally: each engine takes 1/2" in text, text[-3000:]
    assert "x 0.5 (this engine's share of the machine)" in text, text[-3000:]
    assert "model 'broken' failed to load" in text and "server stopped" in text


def test_model_repository_arguments(tiny_model_dir, tmp_path):
    base = [sys.executable, "-m", "inflight.serve.server"]
    for extra, message in (
        (["--load-model", "a"], "need --model-repository"),
        (["--model-repository", str(tmp_path / "missing")], "is not a directory"),
        (["--model-repository", str(tmp_path), str(tiny_model_dir("llama"))], "give no MODEL"),
        (["--model-repository", str(tmp_path), "--load-model", "a"], "needs --model-control-mode explicit"),
    ):
        proc = subprocess.run(base + extra, check=False, capture_output=True, text=True, timeout=TIMEOUT)
        assert proc.returncode == 2 and message in proc.stderr, (extra, proc.stderr[-2000:])
