"""The OpenAI-compatible server, in-process (uvicorn on a background thread, 127.0.0.1, a port of its
own): the real `openai` client, token-id prompts, invalid requests, 200 concurrent streams, client
disconnects, engine failures, admission (queue full, draining, dead engine), /metrics, and the
load generator. Every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from serve_utils import TIMEOUT, LiveServer, tiny_server_llm  # noqa: E402

MODEL = "tiny"


# ---------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = tiny_server_llm(tiny_model_dir("llama"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(llm):
    srv = LiveServer(llm)
    yield srv
    srv.stop()


@pytest.fixture
def slow_engine(llm, monkeypatch):
    """Each engine step takes at least 10 ms (so that a request of a few hundred tokens is still
    running when the test acts on it)."""
    engine = llm.executor.model_engine
    forward = engine.forward

    def slow(*args, **kwargs):
        time.sleep(0.01)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine, "forward", slow)
    yield


def sse_events(lines) -> list:
    """The JSON objects of an SSE stream, then the literal "[DONE]" (asserted to end it)."""
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---------------------------------------------------------------------------------------------- basics


def test_health_version_models(server):
    assert server.http.get("/health").status_code == 200
    from inflight import __version__

    assert server.http.get("/version").json() == {"version": __version__}
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == server.llm.max_seq_len


def test_completions_stream_equals_non_stream(server):
    client = server.client()
    kw = {
        "model": MODEL,
        "prompt": "Hello world! How are you",
        "max_tokens": 12,
        "temperature": 0.9,
        "seed": 7,
    }
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens == len(choice.token_ids) >= 1
    assert full.usage.prompt_tokens == len(server.llm.tokenizer.encode(kw["prompt"]))
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert text == choice.text
    assert ids == choice.token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert sum(1 for c in chunks if c.choices) > 1, "not streamed token by token"


def test_chat_stream_equals_non_stream(server):
    client = server.client()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital?"},
    ]
    kw = {"model": MODEL, "messages": messages, "max_completion_tokens": 10, "temperature": 0.8, "seed": 11}
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    expect_ids = server.llm.apply_chat_template(messages)
    assert full.usage.prompt_tokens == len(expect_ids) and full.prompt_token_ids == expect_ids
    assert full.usage.completion_tokens == len(choice.token_ids)

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason
    ]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # content as a list of text parts is the same conversation
    parts = [
        {
            **m,
            "content": [
                {"type": "text", "text": m["content"][:4]},
                {"type": "text", "text": m["content"][4:]},
            ],
        }
        for m in messages
    ]
    same = client.chat.completions.create(**{**kw, "messages": parts})
    assert same.prompt_token_ids == expect_ids and same.choices[0].message.content == choice.message.content
    # without include_usage no usage chunk
    plain = list(client.chat.completions.create(**kw, stream=True))
    assert all(c.choices for c in plain)


def test_greedy_matches_the_llm_api(server):
    """The server's greedy tokens are the offline LLM API's, for token-id and text prompts."""
    from inflight import SamplingParams

    llm = server.llm
    ids = [5, 17, 99, 200, 3, 42]
    want = llm.generate(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    out = server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].token_ids == want.outputs[0].token_ids
    assert out.choices[0].text == want.outputs[0].text
    assert out.choices[0].prompt_token_ids == ids


def test_prompt_lists_and_n(server):
    client = server.client()
    batch = client.completions.create(
        model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.prompt_token_ids for c in batch.choices] == [[5, 6, 7], [8, 9]]
    assert batch.usage.prompt_tokens == 5 and batch.usage.completion_tokens == 6

    texts = client.completions.create(
        model=MODEL,
        prompt=["Hello", "The capital"],
        n=2,
        max_tokens=4,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in texts.choices) == [0, 1, 2, 3]
    assert texts.usage.completion_tokens == 16
    # the same request streamed gives the same choices
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=["Hello", "The capital"],
            n=2,
            max_tokens=4,
            seed=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    streamed: dict[int, list[int]] = {}
    for c in chunks:
        for ch in c.choices:
            streamed.setdefault(ch.index, []).extend(ch.token_ids)
    assert streamed == {c.index: c.token_ids for c in texts.choices}


def test_beam_search_completions(server):
    """use_beam_search with best_of beams and the n best returned, as the LLM API gives them."""
    from inflight import SamplingParams

    client = server.client()
    prompt = [5, 6, 7, 8, 9]
    body = {"use_beam_search": True, "best_of": 3, "length_penalty": 0.5, "ignore_eos": True}
    out = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=6, extra_body=body)
    assert [c.index for c in out.choices] == [0, 1]
    ref = server.llm.generate(
        prompt,
        SamplingParams(
            use_beam_search=True, best_of=3, n=2, max_tokens=6, length_penalty=0.5, ignore_eos=True
        ),
        use_tqdm=False,
    )
    assert [c.token_ids for c in out.choices] == [c.token_ids for c in ref.outputs]
    assert [c.text for c in out.choices] == [c.text for c in ref.outputs]
    assert out.usage.completion_tokens == 12
    server.wait_idle()


def test_stop_logprobs_and_vllm_fields(server):
    client = server.client()
    base = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    if len(text) >= 4:  # a stop string taken from the greedy output cuts it there
        stop = text[2:4]
        cut = client.completions.create(
            model=MODEL,
            prompt="Hello world",
            max_tokens=12,
            temperature=0,
            stop=[stop],
            extra_body={"ignore_eos": True},
        )
        assert cut.choices[0].text == text[: text.find(stop)]
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].stop_reason == stop

    out = client.completions.create(
        model=MODEL,
        prompt=[5, 6, 7],
        max_tokens=5,
        logprobs=3,
        seed=1,
        extra_body={
            "top_k": 50,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "ignore_eos": True,
        },
        presence_penalty=0.5,
        frequency_penalty=0.5,
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(t) <= 4 for t in lp.top_logprobs)

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        seed=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2
        assert (
            item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob >= item.logprob - 1e-6
            or item.logprob >= item.top_logprobs[1].logprob
        )
    greedy = (
        client.completions.create(
            model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .token_ids
    )
    stop_ids = client.completions.create(
        model=MODEL,
        prompt=[5, 6, 7],
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [greedy[1]], "ignore_eos": True},
    )
    choice = stop_ids.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == greedy[1]
    assert choice.token_ids == greedy[: greedy.index(greedy[1]) + 1]


# ---------------------------------------------------------------------------------------------- errors

LONG = "The capital of France is Paris. " * 120  # far more than 512 tokens

_C = "/v1/completions"
_CHAT = "/v1/chat/completions"
_P = {"model": MODEL, "prompt": "Hello"}
_M = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

INVALID = [
    # (id, endpoint, body (dict, or bytes sent raw), status, param, a substring of the message)
    ("temperature-negative", _C, {**_P, "temperature": -1}, 400, "temperature", "temperature"),
    ("temperature-string", _C, {**_P, "temperature": "0.5"}, 400, "temperature", "number"),
    ("top_p>1", _C, {**_P, "top_p": 1.5}, 400, "top_p", "top_p must be in (0, 1]"),
    ("max_tokens-negative", _C, {**_P, "max_tokens": -5}, 400, "max_tokens", "max_tokens"),
    ("max_tokens-string", _C, {**_P, "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ("max_tokens-float", _C, {**_P, "max_tokens": 3.5}, 400, "max_tokens", "integer"),
    ("stream-not-bool", _C, {**_P, "stream": "yes"}, 400, "stream", "boolean"),
    ("n-with-greedy", _C, {**_P, "n": 2, "temperature": 0}, 400, "n", "greedy"),
    (
        "logprobs-too-large",
        _C,
        {**_P, "logprobs": 50},
        400,
        "logprobs",
        "logprobs must be <= max_logprobs=20",
    ),
    ("echo", _C, {**_P, "echo": True}, 400, "echo", "echo is not supported"),
    ("suffix", _C, {**_P, "suffix": "x"}, 400, "suffix", "suffix"),
    ("best_of", _C, {**_P, "best_of": 3}, 400, "best_of", "best_of"),
    (
        "beams-stream",
        _C,
        {**_P, "use_beam_search": True, "best_of": 2, "stream": True},
        400,
        "use_beam_search",
        "stream",
    ),
    ("beams-top_p", _C, {**_P, "use_beam_search": True, "top_p": 0.5}, 400, "top_p", "cannot be combined"),
    ("beams-width", _C, {**_P, "use_beam_search": True, "best_of": 9}, 400, "best_of", "max_beam_width=8"),
    ("beams-n>best_of", _C, {**_P, "use_beam_search": True, "best_of": 2, "n": 3}, 400, "best_of", ">= n"),
    ("logit_bias", _C, {**_P, "logit_bias": {"5": 10}}, 400, "logit_bias", "logit_bias"),
    ("unknown-field", _C, {**_P, "frobnicate": 1}, 400, "frobnicate", "frobnicate"),
    ("prompt-too-long", _C, {**_P, "prompt": LONG}, 400, "prompt", "maximum context length"),
    (
        "prompt+max_tokens-too-long",
        _C,
        {**_P, "prompt": [5] * 500, "max_tokens": 100},
        400,
        "max_tokens",
        "maximum context length",
    ),
    ("malformed-json", _C, b'{"model": "tiny", "prompt": ', 400, None, "malformed JSON"),
    ("body-not-object", _C, b"[1, 2, 3]", 400, None, "JSON object"),
    ("prompt-missing", _C, {"model": MODEL}, 400, "prompt", "prompt is required"),
    ("prompt-empty", _C, {**_P, "prompt": []}, 400, "prompt", "prompt must not be empty"),
    ("prompt-mixed", _C, {**_P, "prompt": [1, "a"]}, 400, "prompt", "prompt must be"),
    ("prompt-id-out-of-vocab", _C, {**_P, "prompt": [5, 99999]}, 400, "prompt", "vocabulary"),
    ("stop_token_ids-negative", _C, {**_P, "stop_token_ids": [-1]}, 400, "stop_token_ids", "stop_token_ids"),
    ("presence_penalty", _C, {**_P, "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
    ("seed-negative", _C, {**_P, "seed": -1}, 400, "seed", "seed"),
    ("min_tokens>max_tokens", _C, {**_P, "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens", "min_tokens"),
    (
        "stream_options-without-stream",
        _C,
        {**_P, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "stream",
    ),
    (
        "stream_options-bad-type",
        _C,
        {**_P, "stream": True, "stream_options": {"include_usage": "yes"}},
        400,
        "stream_options.include_usage",
        "boolean",
    ),
    ("unknown-model", _C, {**_P, "model": "gpt-17"}, 404, "model", "gpt-17"),
    ("chat-messages-empty", _CHAT, {**_M, "messages": []}, 400, "messages", "messages"),
    ("chat-messages-missing", _CHAT, {"model": MODEL}, 400, "messages", "messages is required"),
    (
        "chat-content-int",
        _CHAT,
        {**_M, "messages": [{"role": "user", "content": 5}]},
        400,
        "messages",
        "content",
    ),
    (
        "chat-tools",
        _CHAT,
        {**_M, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
        "tools",
    ),
    (
        "chat-response_format",
        _CHAT,
        {**_M, "response_format": {"type": "xml"}},
        400,
        "response_format",
        "response_format must be",
    ),
    (
        "chat-bad-json-schema",
        _CHAT,
        {
            **_M,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objectx"}},
            },
        },
        400,
        "response_format",
        "guided_decoding.json is not valid",
    ),
    (
        "chat-two-guided-fields",
        _CHAT,
        {**_M, "guided_regex": "a+", "guided_choice": ["a"]},
        400,
        "guided_regex",
        "at most one",
    ),
    ("chat-bad-guided-regex", _CHAT, {**_M, "guided_regex": "[a-"}, 400, "guided_regex", "not valid"),
    ("chat-top_logprobs-without-logprobs", _CHAT, {**_M, "top_logprobs": 3}, 400, "top_logprobs", "logprobs"),
    (
        "chat-top_logprobs-too-large",
        _CHAT,
        {**_M, "logprobs": True, "top_logprobs": 30},
        400,
        "top_logprobs",
        "top_logprobs must be <= max_logprobs=20, got 30",
    ),
    ("chat-logprobs-int", _CHAT, {**_M, "logprobs": 2}, 400, "logprobs", "boolean"),
    (
        "chat-max_completion_tokens-zero",
        _CHAT,
        {**_M, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "max_completion_tokens",
    ),
    (
        "chat-too-long",
        _CHAT,
        {**_M, "messages": [{"role": "user", "content": LONG}]},
        400,
        "messages",
        "maximum context length",
    ),
    ("chat-unknown-model", _CHAT, {**_M, "model": "nope"}, 404, "model", "nope"),
]


def test_invalid_requests(server):
    assert len(INVALID) >= 15
    failures = []
    for name, path, body, status, param, needle in INVALID:
        if isinstance(body, bytes):
            resp = server.http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            resp = server.http.post(path, json=body)
        try:
            err = resp.json()["error"]
            assert resp.status_code == status, resp.status_code
            assert set(err) == {"message", "type", "param", "code"}
            assert err["param"] == param, err
            assert needle in err["message"], err["message"]
            if "maximum context length" in needle:
                assert err["code"] == "context_length_exceeded"
            if status == 404:
                assert err["code"] == "model_not_found"
        except (AssertionError, KeyError, ValueError) as exc:
            failures.append(f"{name}: {exc!r}: {resp.status_code} {resp.text[:300]}")
    assert not failures, "\n".join(failures)
    # still serving, and nothing leaked
    ok = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")
    server.wait_idle()
    m = server.metrics()
    assert m["inflight:request_rejected_total{reason=context_length_exceeded}"] >= 3


def test_unknown_route_and_method(server):
    resp = server.http.get("/v1/nothing")
    assert resp.status_code == 404 and "message" in resp.json()["error"]
    resp = server.http.get("/v1/completions")
    assert resp.status_code == 405 and "message" in resp.json()["error"]


def test_no_tokenizer_serves_token_ids_only(tiny_model_dir):
    from inflight import LLM, KvCacheConfig

    llm = LLM(
        tiny_model_dir("llama", with_tokenizer=False),
        dtype="float32",
        kv_cache_config=KvCacheConfig(max_tokens=1024, tokens_per_block=8),
    )
    srv = LiveServer(llm)
    try:
        resp = srv.http.post(
            _C,
            json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        )
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["text"] == "" and len(choice["token_ids"]) == 4
        assert choice["prompt_token_ids"] == [5, 6, 7]
        events = sse_events(
            srv.http.post(
                _C,
                json={
                    "model": MODEL,
                    "prompt": [5, 6, 7],
                    "max_tokens": 4,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                },
            ).iter_lines()
        )
        assert events[-1] == "[DONE]"
        assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == choice["token_ids"]
        for body, param in (
            ({"model": MODEL, "prompt": "hello"}, "prompt"),
            ({"model": MODEL, "prompt": [5, 6], "stop": ["x"]}, "stop"),
        ):
            resp = srv.http.post(_C, json=body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
        resp = srv.http.post(_CHAT, json=_M)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "messages" and "messages" in resp.json()["error"]["message"]
    finally:
        srv.stop()
        llm.shutdown()


# ---------------------------------------------------------------------------------------------- load


def test_200_concurrent_streams(server):
    n_req, max_tokens = 200, 8
    before = server.metrics()

    async def one(client: httpx.AsyncClient, i: int):
        body = {
            "model": MODEL,
            "prompt": [5 + i % 50, 6, 7, 8 + i % 7],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.7,
            "seed": i,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            lines = [line async for line in resp.aiter_lines()]
        return sse_events(lines)

    async def main():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(n_req))), 120)

    streams = asyncio.run(main())
    for events in streams:
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
        ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
        assert len(ids) == max_tokens
        assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == [
            "length"
        ]
    server.wait_idle()
    after = server.metrics()
    assert after["inflight:kv_cache_used_blocks"] == 0
    assert after["inflight:num_requests_in_flight"] == 0
    assert (
        after["inflight:request_success_total{finished_reason=length}"]
        - before.get("inflight:request_success_total{finished_reason=length}", 0)
        == n_req
    )
    assert (
        after["inflight:generation_tokens_total"] - before["inflight:generation_tokens_total"]
        == n_req * max_tokens
    )


# ---------------------------------------------------------------------------------------------- cancellation


def test_disconnect_mid_stream_aborts(server, slow_engine):
    before = server.metrics()
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True, "stream": True}
    with server.http.stream("POST", _C, json=body) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 3:
                    break
    # the client closed the connection: the request is cancelled long before its 480 tokens (>= 4.8 s)
    t0 = time.monotonic()
    server.wait_idle()
    assert time.monotonic() - t0 < 3.5, "the request ran on after the client left"
    after = server.metrics()
    assert after["inflight:request_aborted_total"] - before["inflight:request_aborted_total"] == 1
    assert after["inflight:generation_tokens_total"] - before["inflight:generation_tokens_total"] < 480


def test_disconnect_while_waiting_non_streaming_aborts(server, slow_engine):
    before = server.metrics()
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + _C, json=body, timeout=httpx.Timeout(TIMEOUT, read=0.5))
    t0 = time.monotonic()
    server.wait_idle()
    assert time.monotonic() - t0 < 3.5, "the request ran on after the client left"
    after = server.metrics()
    assert after["inflight:request_aborted_total"] - before["inflight:request_aborted_total"] == 1


def test_engine_failure_is_500_and_an_error_chunk(server, monkeypatch):
    engine = server.llm.executor.model_engine
    forward = engine.forward
    failures = {"left": 0}

    def flaky(*args, **kwargs):
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("injected forward failure")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine, "forward", flaky)
    before = server.metrics()
    failures["left"] = 1
    resp = server.http.post(_C, json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4})
    assert resp.status_code == 500, resp.text
    err = resp.json()["error"]
    assert err["type"] == "server_error" and "injected forward failure" in err["message"]

    failures["left"] = 1
    events = sse_events(
        server.http.post(
            _C, json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "stream": True}
        ).iter_lines()
    )
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and "injected forward failure" in events[-2]["error"]["message"]

    ok = server.http.post(_C, json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4})
    assert ok.status_code == 200
    after = server.metrics()
    assert after["inflight:request_failure_total"] - before["inflight:request_failure_total"] == 2
    server.wait_idle()


# ---------------------------------------------------------------------------------------------- admission


def test_queue_full_then_recovers(server, slow_engine):
    server.state.max_queue_size = 1
    try:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "stream": True}
        with server.http.stream("POST", _C, json=body) as resp:
            assert resp.status_code == 200
            busy = server.http.post(_C, json={"model": MODEL, "prompt": [5], "max_tokens": 2})
            assert busy.status_code == 503, busy.text
            assert busy.json()["error"]["code"] == "queue_full" and "Retry-After" in busy.headers
            events = sse_events(resp.iter_lines())
        assert events[-1] == "[DONE]"
        server.wait_idle()
        assert server.http.post(_C, json={"model": MODEL, "prompt": [5], "max_tokens": 2}).status_code == 200
    finally:
        server.state.max_queue_size = 1024


def test_draining_and_dead_engine_503(server, monkeypatch):
    server.state.draining = True
    try:
        assert server.http.get("/health").status_code == 503
        resp = server.http.post(_C, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "server_draining"
    finally:
        server.state.draining = False
    assert server.http.get("/health").status_code == 200

    from inflight.executor.py_executor import PyExecutor

    with monkeypatch.context() as m:
        m.setattr(PyExecutor, "is_alive", property(lambda self: False))
        assert server.http.get("/health").status_code == 503
        resp = server.http.post(_CHAT, json=_M)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead"
    assert server.http.get("/health").status_code == 200


# ---------------------------------------------------------------------------------------------- metrics


def test_metrics_parse_and_count_requests(server):
    server.wait_idle()
    before = server.metrics()
    client = server.client()
    usages = []
    for i in range(3):
        usages.append(
            client.completions.create(
                model=MODEL, prompt=f"Hello {i}", max_tokens=3 + i, extra_body={"ignore_eos": True}
            ).usage
        )
    usages.append(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            extra_body={"ignore_eos": True},
        ).usage
    )
    stream = list(
        client.completions.create(
            model=MODEL,
            prompt=[5, 6],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    usages.append(stream[-1].usage)
    server.wait_idle()
    after = server.metrics()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    # inflight's series and Triton's (nv_inference_*, nv_trt_llm_*), nothing else
    assert all(k.startswith(("inflight:", "nv_inference_", "nv_trt_llm_")) for k in after)
    assert all(k.endswith("{model_name=tiny}") for k in server.metrics(drop=()) if k.startswith("inflight:g"))
    assert delta("inflight:request_success_total{finished_reason=length}") == 5
    assert delta("inflight:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("inflight:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    for hist in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "time_per_output_token_seconds",
    ):
        assert delta(f"inflight:{hist}_count") == 5, hist
        assert after[f"inflight:{hist}_sum"] >= before.get(f"inflight:{hist}_sum", 0.0)
    for gauge in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hit_rate",
        "kv_cache_used_blocks",
        "kv_cache_free_blocks",
    ):
        assert f"inflight:{gauge}" in after
    assert after["inflight:kv_cache_usage_perc"] == 0.0
    assert after["inflight:kv_cache_total_blocks"] == 1024
    assert "inflight:num_preemptions_total" in after


# ---------------------------------------------------------------------------------------------- bench


def test_bench_serve(server, tmp_path):
    pytest.importorskip("matplotlib")
    from inflight.serve import bench

    out, png = tmp_path / "results.json", tmp_path / "latency.png"
    args = bench.build_parser().parse_args(
        [
            "--url",
            server.url,
            "--request-rates",
            "50",
            "200",
            "--num-prompts",
            "6",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--range-ratio",
            "0.5",
            "--max-concurrency",
            "4",
            "--out",
            str(out),
            "--plot",
            str(png),
        ]
    )
    with contextlib.redirect_stdout(None):
        assert bench.run(args) == 0
    report = json.loads(out.read_text())
    assert [r["request_rate"] for r in report["runs"]] == [50, 200]
    for run in report["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["ttft_ms"]["p50"] > 0 and run["e2e_ms"]["p99"] >= run["ttft_ms"]["p50"]
        assert run["request_throughput"] > 0 and run["output_token_throughput"] > 0
    assert png.stat().st_size > 1000
    chat_args = bench.build_parser().parse_args(
        [
            "--url",
            server.url,
            "--endpoint",
            "/v1/chat/completions",
            "--num-prompts",
            "3",
            "--input-len",
            "5",
            "--output-len",
            "3",
        ]
    )
    with contextlib.redirect_stdout(None):
        assert bench.run(chat_args) == 0
    server.wait_idle()


def test_prompt_logprobs_on_both_endpoints(server, llm):
    from inflight import SamplingParams

    prompt = [5, 6, 7, 8, 9]
    resp = server.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1},
    )
    assert resp.status_code == 200, resp.text
    plp = resp.json()["choices"][0]["prompt_logprobs"]
    want = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert len(plp) == len(prompt) and plp[0] is None
    for entry, ref, tok in zip(plp[1:], want.prompt_logprobs[1:], prompt[1:]):
        assert next(iter(entry)) == str(tok) and 1 <= len(entry) <= 2
        assert entry[str(tok)]["logprob"] == pytest.approx(ref[tok], abs=1e-5)
        assert isinstance(entry[str(tok)]["decoded_token"], str)
    chat = server.http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "prompt_logprobs": 0,
        },
    )
    assert chat.status_code == 200, chat.text
    ids = chat.json()["prompt_token_ids"]
    assert len(chat.json()["choices"][0]["prompt_logprobs"]) == len(ids)
    # Refused by name: a negative value and one above max_logprobs.
    for bad in (-1, 10**6):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": bad}
        r = server.http.post("/v1/completions", json=body)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "prompt_logprobs"
        assert str(bad) in r.json()["error"]["message"]


def _streamed(server, path: str, body: dict) -> list:
    with server.http.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_streamed_prompt_logprobs_come_in_the_first_chunk(server):
    """stream=true with prompt_logprobs: each choice's first chunk carries the prompt's log-probabilities,
    equal to those of the same request not streamed; no later chunk repeats them."""
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 4, "seed": 3, "n": 2, "prompt_logprobs": 2}
    whole = server.http.post(_C, json=body)
    assert whole.status_code == 200, whole.text
    want = {c["index"]: c["prompt_logprobs"] for c in whole.json()["choices"]}
    assert len(want) == 4 and all(len(want[i]) == len(prompts[i // 2]) for i in want)
    chunks = _streamed(server, _C, body)
    got: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if "prompt_logprobs" in choice:
                assert choice["index"] not in got, "prompt_logprobs sent twice for a choice"
                got[choice["index"]] = choice["prompt_logprobs"]
            else:
                assert choice["index"] in got, "a choice's chunk came before its prompt_logprobs"
    assert got.keys() == want.keys()
    for i, plp in got.items():
        assert plp[0] is None and want[i][0] is None
        for entry, ref in zip(plp[1:], want[i][1:]):
            assert list(entry) == list(ref)
            for tok in entry:
                assert entry[tok]["logprob"] == pytest.approx(ref[tok]["logprob"], abs=1e-5)
                assert entry[tok]["decoded_token"] == ref[tok]["decoded_token"]
    # Without prompt_logprobs no chunk has the field.
    plain = _streamed(server, _C, {k: v for k, v in body.items() if k != "prompt_logprobs"})
    assert not any("prompt_logprobs" in c for chunk in plain for c in chunk["choices"])


def test_streamed_chat_prompt_logprobs(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0,
        "prompt_logprobs": 1,
    }
    whole = server.http.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    want = whole.json()["choices"][0]["prompt_logprobs"]
    assert len(want) == len(whole.json()["prompt_token_ids"])
    chunks = _streamed(server, "/v1/chat/completions", body)
    with_plp = [c for chunk in chunks for c in chunk["choices"] if "prompt_logprobs" in c]
    deltas = [c for chunk in chunks for c in chunk["choices"] if "role" not in c["delta"]]
    assert len(with_plp) == 1 and deltas[0] is with_plp[0]  # the first chunk after the role chunk
    got = with_plp[0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want)
    for entry, ref in zip(got[1:], want[1:]):
        assert list(entry) == list(ref)
        for tok in entry:
            assert entry[tok]["logprob"] == pytest.approx(ref[tok]["logprob"], abs=1e-5)
