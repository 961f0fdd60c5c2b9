"""`inflight generate` end to end in a subprocess, on a tiny model with a tokenizer and chat template."""

from __future__ import annotations

import subprocess
import sys

import pytest
from model_utils import make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("cli"), "llama", with_tokenizer=True)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inflight", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_streams_text_and_prints_a_summary(tiny_dir):
    proc = _run(
        "generate",
        "--model",
        str(tiny_dir),
        "--prompt",
        "hello world",
        "--max-tokens",
        "12",
        "--dtype",
        "float32",
        "--kv-cache-max-tokens",
        "1024",
    )
    assert proc.returncode == 0, proc.stderr
    summary = [line for line in proc.stderr.splitlines() if "tok/s" in line]
    assert summary, proc.stderr
    assert "tokens in" in summary[-1] and "finish_reason=" in summary[-1]
    n = int(summary[-1].split("[", 1)[1].split()[0])
    assert 1 <= n <= 12
    assert proc.stdout.strip() != "" or n == 1  # the streamed text reached the terminal


def test_generate_greedy_matches_the_python_api(tiny_dir):
    from inflight import LLM, KvCacheConfig, SamplingParams

    args = [
        "generate",
        "--model",
        str(tiny_dir),
        "--prompt",
        "abc",
        "--max-tokens",
        "8",
        "--dtype",
        "float32",
        "--kv-cache-max-tokens",
        "1024",
        "--no-chat",
    ]
    proc = _run(*args)
    assert proc.returncode == 0, proc.stderr
    with LLM(str(tiny_dir), dtype="float32", kv_cache_config=KvCacheConfig(max_tokens=1024)) as llm:
        expected = (
            llm.generate("abc", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False).outputs[0].text
        )
    assert proc.stdout.rstrip("\n") == expected


def test_generate_reports_bad_arguments_clearly(tiny_dir):
    proc = _run("generate", "--model", str(tiny_dir), "--prompt", "x", "--temperature", "-1")
    assert proc.returncode == 2
    assert "temperature" in proc.stderr and "-1" in proc.stderr
    proc = _run("generate", "--model", "/nonexistent/model", "--prompt", "x")
    assert proc.returncode == 2 and "/nonexistent/model" in proc.stderr
