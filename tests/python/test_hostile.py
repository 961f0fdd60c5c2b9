"""Hostile input: no request may slow, fail or starve another. One regression test per failure found
by fuzzing and load-testing the server (a poison sampling value failing its whole batch, unbounded
and quadratic ``n``, lone surrogates, metrics stuck after disconnects, a long prefill freezing every
stream, a stalled engine that /health called healthy)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from llm_utils import LLM_PROMPTS, assert_kv_idle, greedy, wait_until

import inflight.request_handle as request_handle
from inflight.executor import sampler as sampler_module
from inflight.sampling_params import SamplingParams

TIMEOUT = 60


# ---------------------------------------------------------------------------------------------- the engine


def test_a_row_the_sampler_fails_on_fails_alone(make_llm, hf_greedy_refs, monkeypatch):
    """A value the sampling kernel refuses (here forced past validation) fails its request only; the
    4 requests batched with it get exactly their tokens."""
    want = hf_greedy_refs("llama")
    create = sampler_module.SamplingState.create

    def poisoned(params, *args, **kwargs):
        state = create(params, *args, **kwargs)
        if params.seed == 12345:  # top_p 0: the kernel rejects the row, mid-step
            state.fused_params = (1.0, 0, 0.0, 0.0)
        return state

    monkeypatch.setattr(sampler_module.SamplingState, "create", poisoned)
    llm = make_llm(max_batch_size=8)
    poison = llm.generate_async(LLM_PROMPTS[0], SamplingParams(max_tokens=8, temperature=1.0, seed=12345))
    normal = [llm.generate_async(LLM_PROMPTS[i], greedy()) for i in range(4)]
    failed = poison.result(TIMEOUT).outputs[0]
    assert failed.finish_reason == "error" and "top_p" in failed.error, failed
    for i, h in enumerate(normal):
        assert h.result(TIMEOUT).outputs[0].token_ids == want[i]
    assert_kv_idle(llm)


def test_n_is_bounded_and_linear(make_llm, monkeypatch):
    llm = make_llm(max_n=64, max_batch_size=64)
    with pytest.raises(ValueError, match=r"n must be <= max_n=64, got 65"):
        llm.generate_async(LLM_PROMPTS[0], SamplingParams(n=65, temperature=1.0, max_tokens=2))
    with pytest.raises(ValueError, match=r"max_request_tokens"):
        make_llm(max_request_tokens=100).generate_async(
            LLM_PROMPTS[0], SamplingParams(n=4, temperature=1.0, max_tokens=30)
        )
    # n at the limit: the outputs built per step grow with n, not n^2 (counted, not timed).
    built = [0]
    real = request_handle.CompletionOutput

    def counting(*args, **kwargs):
        built[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(request_handle, "CompletionOutput", counting)
    n, max_tokens = 64, 6
    handle = llm.generate_async(
        LLM_PROMPTS[1],
        SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True),
        streaming=True,
    )
    out = handle.result(TIMEOUT)
    assert len(out.outputs) == n and all(len(c.token_ids) == max_tokens for c in out.outputs)
    # One output of n sequences per step (max_tokens steps), plus the final one: 2 per token each.
    assert built[0] <= n * (max_tokens + 2), built[0]


def test_logprobs_are_bounded_by_max_logprobs(make_llm):
    llm = make_llm()
    with pytest.raises(ValueError, match=r"logprobs must be <= max_logprobs=20, got 21"):
        llm.generate_async(LLM_PROMPTS[0], SamplingParams(logprobs=21, max_tokens=2))
    # A bound above the vocabulary: a request asking for more gets the whole vocabulary, no error.
    vocab = llm.model_config.vocab_size
    llm = make_llm(max_logprobs=vocab + 10)
    out = llm.generate(LLM_PROMPTS[0], greedy(max_tokens=2, logprobs=vocab + 10)).outputs[0]
    assert out.finish_reason == "length" and [len(e) for e in out.logprobs] == [vocab, vocab]


def test_cancelling_many_children_is_one_pass(make_llm):
    llm = make_llm(max_n=128, max_batch_size=4)
    handle = llm.generate_async(
        LLM_PROMPTS[0], SamplingParams(n=128, temperature=1.0, max_tokens=200, ignore_eos=True)
    )
    wait_until(lambda: any(s["num_scheduled_requests"] for s in llm.get_stats()), what="the request to start")
    t0 = time.perf_counter()
    handle.abort()
    out = handle.result(TIMEOUT)
    assert {c.finish_reason for c in out.outputs} == {"cancelled"}
    assert time.perf_counter() - t0 < 10
    assert_kv_idle(llm)


def test_prompt_size_is_checked_before_tokenising(make_llm):
    llm = make_llm(max_prompt_bytes=1000)
    with pytest.raises(ValueError, match=r"prompt is more than max_prompt_bytes=1000 bytes"):
        llm.generate_async("x" * 1001, greedy())
    with pytest.raises(ValueError, match=r"prompt is more than max_prompt_bytes=1000"):
        llm.generate_async("é" * 501, greedy())  # 1002 bytes of UTF-8 in 501 characters
    with pytest.raises(ValueError, match=r"prompt is not valid Unicode.*surrogate"):
        llm.generate_async("lone \ud800", greedy())
    with pytest.raises(ValueError, match=r"messages is not valid Unicode.*surrogate"):
        llm.chat([{"role": "user", "content": "lone \udfff"}], greedy())
    assert llm.generate("x" * 100, greedy(2), use_tqdm=False).outputs[0].token_ids


def test_stall_seconds_tells_the_truth(make_llm, monkeypatch):
    llm = make_llm()
    assert llm.stall_seconds == 0.0  # idle
    engine = llm.executor.model_engine
    forward = engine.forward
    gate = threading.Event()

    def stuck(inputs):
        gate.wait(TIMEOUT)
        return forward(inputs)

    monkeypatch.setattr(engine, "forward", stuck)
    handle = llm.generate_async(LLM_PROMPTS[0], greedy(2))
    wait_until(lambda: llm.stall_seconds > 0.3, what="the stall to show")
    gate.set()
    handle.result(TIMEOUT)
    wait_until(lambda: llm.stall_seconds == 0.0, what="the engine to be idle again")


# ---------------------------------------------------------------------------------------------- the server

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from serve_utils import LiveServer, tiny_server_llm  # noqa: E402  (needs the serve extras)


@pytest.fixture(scope="module")
def llm_module(tiny_model_dir):
    engine = tiny_server_llm(tiny_model_dir("llama"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(llm_module):
    srv = LiveServer(llm_module, stall_timeout=1.0)
    yield srv
    srv.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return server.http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    "field,value",
    [("top_p", 1e-300), ("temperature", 3.5e38), ("repetition_penalty", 1e-300), ("min_p", 1e-45)],
)
def test_a_poison_value_is_a_400_and_the_stream_beside_it_completes(server, field, value):
    with server.http.stream(
        "POST",
        "/v1/completions",
        json={"prompt": [1, 2, 3], "max_tokens": 24, "ignore_eos": True, "stream": True},
    ) as stream:
        resp = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 8, field: value})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == field
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
    server.wait_idle()


def test_n_over_the_limit_is_a_400_at_once(server):
    t0 = time.perf_counter()
    resp = _post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1, "n": 100000})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n", resp.text
    assert "max_n=128" in resp.json()["error"]["message"]
    assert time.perf_counter() - t0 < 5
    assert server.http.get("/health").status_code == 200


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", '{"prompt": "lone \\ud800", "max_tokens": 4}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "lone \\udc00"], "max_tokens": 4}', "prompt"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "lone \\ud800"}], "max_tokens": 4}',
            "messages",
        ),
    ],
)
def test_lone_surrogates_are_a_400(server, path, body, param):
    resp = server.http.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_metrics_return_to_zero_after_disconnects_without_a_new_request(server, slow_engine_module):
    streams = []
    for i in range(50):
        cm = server.http.stream(
            "POST",
            "/v1/completions",
            json={"prompt": [5 + i % 7, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True},
        )
        resp = cm.__enter__()
        next(resp.iter_lines())  # the stream started
        streams.append(cm)
    for cm in streams:
        cm.__exit__(None, None, None)  # the client goes away
    deadline = time.monotonic() + 2.0
    while True:
        m = server.metrics()
        busy = (
            m["inflight:num_requests_running"],
            m["inflight:num_requests_waiting"],
            m.get("inflight:kv_cache_used_blocks", 0.0),
        )
        if busy == (0.0, 0.0, 0.0):
            break
        assert time.monotonic() < deadline, f"metrics still show running/waiting/KV blocks {busy}"
        time.sleep(0.05)
    server.wait_idle()


def test_health_turns_503_while_the_engine_is_stalled(server, llm_module, monkeypatch):
    engine = llm_module.executor.model_engine
    forward = engine.forward
    gate = threading.Event()

    def stuck(inputs):
        gate.wait(TIMEOUT)
        return forward(inputs)

    monkeypatch.setattr(engine, "forward", stuck)
    try:
        with server.http.stream(
            "POST", "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": True}
        ):
            wait_until(lambda: server.http.get("/health").status_code == 503, TIMEOUT, "/health to say 503")
            assert server.http.get("/health").json()["error"]["code"] == "engine_stalled"
            gate.set()
    finally:
        gate.set()
    wait_until(lambda: server.http.get("/health").status_code == 200, TIMEOUT, "/health to recover")
    server.wait_idle()


@pytest.fixture
def slow_engine_module(llm_module, monkeypatch):
    """Each engine step takes at least 10 ms, so 400-token streams are still running when cut."""
    engine = llm_module.executor.model_engine
    forward = engine.forward

    def slow(inputs):
        time.sleep(0.01)
        return forward(inputs)

    monkeypatch.setattr(engine, "forward", slow)
    yield


def test_a_long_prefill_does_not_freeze_a_stream(make_llm):
    """With chunked prefill (inflight serve's default), a long prompt is prefilled one budget-sized
    chunk per step, and a running stream gets a token in every one of those steps: no step holds
    more than max_num_tokens, and none runs a chunk without the stream's decode. (The wall-clock
    stall this bounds is measured in benchmarks/bench_stall.py.)"""
    budget = 64
    llm = make_llm(enable_chunked_prefill=True, max_num_tokens=budget, max_batch_size=4)
    stream = llm.generate_async(LLM_PROMPTS[0], greedy(120), streaming=True)
    wait_until(
        lambda: any(s["num_generation_requests"] for s in llm.get_stats()), what="the stream to decode"
    )
    first = llm.get_stats()[-1]["iter"]
    long = llm.generate_async([5 + i % 200 for i in range(400)], greedy(1))
    long.result(TIMEOUT)
    steps = [s for s in llm.get_stats() if s["iter"] > first and s["num_context_requests"]]
    assert len(steps) >= 400 // budget, steps  # the prompt took several steps
    for s in steps:
        assert s["num_tokens"] <= budget, s
        assert s["num_generation_requests"] >= 1, f"a prefill step without the stream's decode: {s}"
    stream.result(TIMEOUT)
