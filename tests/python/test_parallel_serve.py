"""``inflight serve --tensor-parallel-size 2``: a completion equals the tp=1 engine's, and a follower
killed mid-stream ends the open SSE stream with an error chunk and turns ``/health`` to 503. The
server runs as a subprocess; every wait is bounded."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import psutil
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_serve_process import TIMEOUT, _free_port, _wait_healthy  # noqa: E402

from inflight import LLM, KvCacheConfig, SamplingParams  # noqa: E402


def _follower_of(server: subprocess.Popen) -> psutil.Process:
    for p in psutil.Process(server.pid).children(recursive=True):
        if "inflight.executor.follower" in " ".join(p.cmdline()):
            return p
    raise AssertionError("the server has no follower process")


def test_serve_tp2_completion_equals_tp1_and_a_dead_rank_ends_the_stream(tiny_model_dir, tmp_path):
    model = str(tiny_model_dir("llama"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "inflight.serve.server",
        model,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--kv-cache-max-tokens",
        "4096",
        "--served-model-name",
        "tiny",
        "--tensor-parallel-size",
        "2",
        "--disable-access-log",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(url, proc, log)
        body = {
            "model": "tiny",
            "prompt": "hello world",
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        }
        got = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT).json()
        with LLM(model, dtype="float32", kv_cache_config=KvCacheConfig(max_tokens=4096)) as ref:
            want = ref.generate("hello world", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        assert got["choices"][0]["text"] == want.outputs[0].text, (got, want.outputs[0])

        streaming = threading.Event()
        lines: list[str] = []

        def stream():
            req = {
                "model": "tiny",
                "prompt": [5, 6, 7],
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", url + "/v1/completions", json=req, timeout=TIMEOUT) as resp:
                for line in resp.iter_lines():
                    if line:
                        lines.append(line)
                        streaming.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert streaming.wait(TIMEOUT), "nothing streamed"
        _follower_of(proc).kill()
        t.join(10)
        assert not t.is_alive(), "the stream did not end after the rank died"
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][len("data: ") :])["error"]
        assert "rank 1" in error["message"], error
        deadline = time.monotonic() + 5
        while httpx.get(url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health did not turn 503"
            time.sleep(0.05)
        refused = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert refused.status_code == 503, refused.text
    finally:
        proc.kill()
        proc.wait(TIMEOUT)
