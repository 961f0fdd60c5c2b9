"""vLLM's ``POST /tokenize`` and ``/detokenize`` (the ids the completion endpoints would use, checked against
the tokenizer and against what /v1/completions reports), and the request-body limit (413 before a large body
is read, for a declared length and for a chunked body; the server keeps serving)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")

from serve_utils import LiveServer, tiny_server_llm  # noqa: E402

MODEL = "tiny"
LIMIT = 4096  # bytes: the test server's body limit


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = tiny_server_llm(tiny_model_dir("llama"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(llm):
    srv = LiveServer(llm, max_request_bytes=LIMIT)
    yield srv
    srv.stop()


def test_tokenize_a_prompt_as_completions_does(server, llm):
    text = "Hello world! How are you"
    resp = server.http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    want = llm.tokenizer.encode(text)
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] == llm.max_seq_len
    assert body["token_strs"] == llm.tokenizer.convert_ids_to_tokens(want)
    done = server.http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == body["count"] and done["choices"][0]["prompt_token_ids"] == want
    bare = server.http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == llm.tokenizer.encode(text, add_special_tokens=False)
    assert bare["token_strs"] is None


def test_tokenize_messages_as_chat_does(server, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    body = server.http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert body["tokens"] == llm.apply_chat_template(messages) and body["count"] == len(body["tokens"])
    chat = server.http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}
    )
    assert chat.json()["prompt_token_ids"] == body["tokens"]
    no_prompt = server.http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert no_prompt.json()["tokens"] == llm.apply_chat_template(messages, add_generation_prompt=False)


def test_detokenize_round_trip(server, llm):
    ids = llm.tokenizer.encode("The quick brown fox")
    resp = server.http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"prompt": llm.tokenizer.decode(ids)}
    assert server.http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    "path,body,param,needle",
    [
        ("/tokenize", {"model": MODEL}, "prompt", "exactly one of prompt and messages"),
        (
            "/tokenize",
            {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
            "prompt",
            "exactly one",
        ),
        ("/tokenize", {"prompt": 5}, "prompt", "prompt"),
        ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus", "unrecognized field"),
        ("/tokenize", {"messages": "hi"}, "messages", "messages"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True},
            "add_special_tokens",
            "only false",
        ),
        ("/tokenize", {"model": "other", "prompt": "a"}, "model", "other"),
        (
            "/detokenize",
            {"tokens": [1, 2, 10**6]},
            "tokens[2]",
            "tokens[2] = 1000000 is outside the vocabulary",
        ),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]", "outside the vocabulary"),
        ("/detokenize", {"tokens": "1 2"}, "tokens", "list of integer token ids"),
        ("/detokenize", {}, "tokens", "tokens is required"),
    ],
)
def test_bad_tokenize_requests_are_400_naming_the_field(server, path, body, param, needle):
    resp = server.http.post(path, json=body)
    err = resp.json()["error"]
    assert resp.status_code in (400, 404), resp.text
    assert err["param"] == param and needle in err["message"], err


def test_too_long_a_prompt_is_refused_by_name(server, llm):
    text = "word " * (llm.max_prompt_bytes // 5 + 10)
    big = LiveServer(llm, name=MODEL)  # the default body limit (64 MiB): the prompt-size check answers
    try:
        resp = big.http.post("/tokenize", json={"prompt": text})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text
        assert str(llm.max_prompt_bytes) in resp.json()["error"]["message"]
    finally:
        big.stop()


def test_bodies_over_the_limit_get_413_and_the_server_keeps_serving(server):
    big = {"model": MODEL, "prompt": "x" * (2 * LIMIT), "max_tokens": 1}
    for path in ("/v1/completions", "/tokenize", "/v2/models/tiny/infer"):
        resp = server.http.post(path, json=big)
        assert resp.status_code == 413, (path, resp.status_code, resp.text[:200])
        err = resp.json()["error"]
        assert err["code"] == "request_too_large" and str(LIMIT) in err["message"], err

    def chunks():  # no Content-Length: the body is counted as it arrives
        yield b'{"prompt": "'
        for _ in range(4 * LIMIT // 512):
            yield b"y" * 512
        yield b'"}'

    resp = server.http.post("/tokenize", content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large", resp.text
    assert "exceeds" in resp.json()["error"]["message"]
    small = server.http.post("/tokenize", json={"prompt": "y" * (LIMIT // 2)})
    assert small.status_code == 200
    ok = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    rejected = server.metrics()
    assert rejected["inflight:request_rejected_total{reason=request_too_large}"] >= 4


def test_body_limit_values(llm):
    from inflight.serve.limits import BodyLimit

    with pytest.raises(ValueError, match="max_bytes must be >= 1"):
        BodyLimit(None, max_bytes=0)
    unlimited = LiveServer(llm, name=MODEL, max_request_bytes=None)
    try:
        resp = unlimited.http.post("/tokenize", json={"prompt": "z" * (2 * LIMIT)})
        assert resp.status_code == 200
    finally:
        unlimited.stop()


def test_grpc_messages_over_the_limit_are_refused(llm):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    np = pytest.importorskip("numpy")
    srv = LiveServer(llm, name=MODEL, grpc=True, max_request_bytes=LIMIT)
    client = grpcclient.InferenceServerClient(srv.grpc_url)

    def inputs(text: str) -> list:
        t = grpcclient.InferInput("text_input", [1, 1], "BYTES")
        t.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
        m = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
        m.set_data_from_numpy(np.array([[2]], dtype=np.int32))
        return [t, m]

    try:
        with pytest.raises(InferenceServerException, match="RESOURCE_EXHAUSTED|larger than max"):
            client.infer(MODEL, inputs("x" * (2 * LIMIT)))
        assert client.infer(MODEL, inputs("Hello")).as_numpy("text_output") is not None
    finally:
        client.close()
        srv.stop()
