"""The KServe v2 routes (Triton's HTTP API) through Triton's own client, `tritonclient.http`, and raw
HTTP for the generate extension: the served model's text equals LLM.generate's."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpclient = pytest.importorskip("tritonclient.http")
from serve_utils import LiveServer, tiny_server_llm  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from inflight import SamplingParams  # noqa: E402

MODEL = "tiny"
PROMPTS = ["Hello world, this is", "The quick brown fox"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = tiny_server_llm(tiny_model_dir("llama"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(llm):
    srv = LiveServer(llm, name=MODEL)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    yield c
    c.close()


def greedy(llm, prompt: str, n: int, **kwargs) -> str:
    params = SamplingParams(max_tokens=n, temperature=0.0, **kwargs)
    return llm.generate(prompt, params, use_tqdm=False).outputs[0].text


def infer_inputs(prompts: list[str], max_tokens: int, binary: bool = True, **extra) -> list:
    """text_input [B, 1] and max_tokens [B, 1], plus optional inputs of the same batch."""
    b = len(prompts)
    text = httpclient.InferInput("text_input", [b, 1], "BYTES")
    text.set_data_from_numpy(np.array([[p.encode()] for p in prompts], dtype=object), binary_data=binary)
    mt = httpclient.InferInput("max_tokens", [b, 1], "INT32")
    mt.set_data_from_numpy(np.full((b, 1), max_tokens, dtype=np.int32), binary_data=binary)
    out = [text, mt]
    for name, (dtype, value) in extra.items():
        arr = np.full((b, 1), value, dtype=dtype)
        inp = httpclient.InferInput(
            name,
            [b, 1],
            {np.int32: "INT32", np.float32: "FP32", np.bool_: "BOOL", np.uint64: "UINT64"}[dtype],
        )
        inp.set_data_from_numpy(arr, binary_data=binary)
        out.append(inp)
    return out


def text_outputs(result) -> list[list[str]]:
    return [
        [t.decode() if isinstance(t, bytes) else t for t in row] for row in result.as_numpy("text_output")
    ]


def test_probes_metadata_and_config(client, server):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
    assert not client.is_model_ready("nope")
    meta = client.get_server_metadata()
    assert meta["name"] == "inflight" and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata(MODEL)
    assert model["name"] == MODEL and model["versions"] == ["1"]
    inputs = {i["name"]: i["datatype"] for i in model["inputs"]}
    assert inputs["text_input"] == "BYTES" and inputs["max_tokens"] == "INT32"
    assert [o["name"] for o in model["outputs"]] == ["text_output", "cum_log_probs", "output_log_probs"]
    config = client.get_model_config(MODEL)
    assert config["name"] == MODEL and config["max_batch_size"] == server.llm.args.max_batch_size
    assert config["model_transaction_policy"]["decoupled"] is True
    assert {i["name"]: i["optional"] for i in config["input"]}["stream"] is True
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("nope")
    with pytest.raises(InferenceServerException, match="version 7 is not found"):
        client.get_model_metadata(MODEL, "7")
    assert server.http.get("/v2/health/live").status_code == 200


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_equals_the_llm_api(client, llm, binary):
    """A 2-row request: both rows in order, each the prompt then LLM.generate's greedy text (the
    TensorRT-LLM backend's default); with exclude_input_in_output only the new text."""
    outputs = [httpclient.InferRequestedOutput("text_output", binary_data=binary)]
    res = client.infer(MODEL, infer_inputs(PROMPTS, 8, binary), outputs=outputs, request_id="r-1")
    assert res.get_response()["id"] == "r-1"
    want = [greedy(llm, p, 8) for p in PROMPTS]
    assert text_outputs(res) == [[p + w] for p, w in zip(PROMPTS, want)]
    res = client.infer(MODEL, infer_inputs(PROMPTS, 8, binary, exclude_input_in_output=(np.bool_, True)))
    assert text_outputs(res) == [[w] for w in want]


def test_infer_log_probs_and_sampling_inputs(client, llm):
    inputs = infer_inputs(
        PROMPTS[:1], 6, True, return_log_probs=(np.bool_, True), exclude_input_in_output=(np.bool_, True)
    )
    res = client.infer(MODEL, inputs)
    lps = res.as_numpy("output_log_probs")
    cum = res.as_numpy("cum_log_probs")
    assert lps.shape == (1, 1, 6) and cum.shape == (1, 1)
    assert float(cum[0, 0]) == pytest.approx(float(lps[0, 0].sum()), abs=1e-4) and cum[0, 0] < 0
    ref = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0, logprobs=0), use_tqdm=False)
    comp = ref.outputs[0]
    assert float(cum[0, 0]) == pytest.approx(comp.cumulative_logprob, abs=1e-4)
    # Seeded sampling (top_k set): the same text as the LLM API with those values.
    inputs = infer_inputs(
        PROMPTS[:1],
        8,
        True,
        top_k=(np.int32, 5),
        temperature=(np.float32, 0.9),
        random_seed=(np.uint64, 11),
        exclude_input_in_output=(np.bool_, True),
    )
    got = text_outputs(client.infer(MODEL, inputs))[0][0]
    want = llm.generate(
        PROMPTS[0],
        SamplingParams(max_tokens=8, top_k=5, temperature=np.float32(0.9).item(), seed=11),
        use_tqdm=False,
    )
    assert got == want.outputs[0].text


def test_beam_width_returns_every_beam(client, llm):
    res = client.infer(
        MODEL,
        infer_inputs(
            PROMPTS[:1], 6, True, beam_width=(np.int32, 3), exclude_input_in_output=(np.bool_, True)
        ),
    )
    got = text_outputs(res)[0]
    ref = llm.generate(
        PROMPTS[0], SamplingParams(use_beam_search=True, best_of=3, n=3, max_tokens=6), use_tqdm=False
    )
    assert got == [c.text for c in ref.outputs]


def test_invalid_requests_name_the_problem(client, server):
    cases = [
        ("nope", infer_inputs(PROMPTS[:1], 4), "Request for unknown model: 'nope' is not found"),
        (
            MODEL,
            infer_inputs(PROMPTS[:1], 4, frobnicate=(np.int32, 1)),
            "unexpected inference input 'frobnicate'",
        ),
        (
            MODEL,
            infer_inputs(PROMPTS[:1], 4, top_k=(np.float32, 1.0)),
            "unexpected datatype TYPE_FP32 for inference input 'top_k'",
        ),
        (
            MODEL,
            infer_inputs(PROMPTS[:1], 4, random_seed=(np.uint64, 2**63)),
            "input 'random_seed' must be in",
        ),
        (MODEL, infer_inputs(PROMPTS[:1], 0), "max_tokens"),
        (MODEL, infer_inputs(PROMPTS[:1], 4, stream=(np.bool_, True)), "input 'stream'"),
    ]
    for model, inputs, needle in cases:
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, inputs)
        assert needle in str(info.value), (needle, str(info.value))
    with pytest.raises(InferenceServerException, match="unexpected inference output 'logits'"):
        client.infer(MODEL, infer_inputs(PROMPTS[:1], 4), outputs=[httpclient.InferRequestedOutput("logits")])
    only_text = infer_inputs(PROMPTS[:1], 4)[:1]
    with pytest.raises(InferenceServerException, match="expected input 'max_tokens' is missing"):
        client.infer(MODEL, only_text)
    r = server.http.post(f"/v2/models/{MODEL}/infer", content=b"{not json")
    assert r.status_code == 400 and "failed to parse the request JSON" in r.json()["error"]
    r = server.http.post(
        f"/v2/models/{MODEL}/infer",
        json={"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["a", "b"]}]},
    )
    assert r.status_code == 400 and "holds 1 elements, but 2 were given" in r.json()["error"]
    server.wait_idle()


def test_generate_both_body_forms(server, llm):
    want = greedy(llm, PROMPTS[0], 8)
    flat = server.http.post(f"/v2/models/{MODEL}/generate", json={"text_input": PROMPTS[0], "max_tokens": 8})
    assert flat.status_code == 200, flat.text
    assert flat.json() == {"model_name": MODEL, "model_version": "1", "text_output": PROMPTS[0] + want}
    oip = server.http.post(
        f"/v2/models/{MODEL}/generate",
        json={"text_input": PROMPTS[0], "parameters": {"max_tokens": 8, "exclude_input_in_output": True}},
    )
    assert oip.json()["text_output"] == want
    stop = server.http.post(
        f"/v2/models/{MODEL}/generate",
        json={
            "text_input": PROMPTS[0],
            "max_tokens": 8,
            "stop_words": [want[2:5]],
            "exclude_input_in_output": True,
        },
    )
    assert stop.json()["text_output"] == greedy(llm, PROMPTS[0], 8, stop=[want[2:5]])
    for body, needle in [
        (b"[1]", "must be a JSON object"),
        (b"{", "failed to parse the request JSON"),
        (json.dumps({"text_input": "x"}).encode(), "expected input 'max_tokens' is missing"),
        (
            json.dumps({"text_input": "x", "max_tokens": "8"}).encode(),
            "input 'max_tokens' must be an integer",
        ),
        (
            json.dumps({"text_input": "x", "max_tokens": 2, "parameters": {"max_tokens": 3}}).encode(),
            "both at the top level",
        ),
        (
            json.dumps({"text_input": "x", "max_tokens": 2, "logit_bias": {}}).encode(),
            "unexpected inference input 'logit_bias'",
        ),
    ]:
        r = server.http.post(f"/v2/models/{MODEL}/generate", content=body)
        assert r.status_code == 400 and needle in r.json()["error"], (needle, r.text)
    server.wait_idle()


def test_generate_stream_concatenates_to_the_text(server, llm):
    want = greedy(llm, PROMPTS[1], 12)
    with server.http.stream(
        "POST", f"/v2/models/{MODEL}/generate_stream", json={"text_input": PROMPTS[1], "max_tokens": 12}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert len(events) >= 2
    assert "".join(e["text_output"] for e in events) == want
    assert all(e["model_name"] == MODEL for e in events)
    server.wait_idle()


def test_bad_words_and_end_id(server, llm):
    tok = llm.tokenizer
    plain = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False).outputs[0]
    # A generated token that is a word of its own (clean text that encodes back to that one token).
    t = next(
        t
        for t in plain.token_ids
        if tok.decode([t]).strip().isalpha() and tok.encode(tok.decode([t]), add_special_tokens=False) == [t]
    )
    word = tok.decode([t])

    def never_t(output_ids, logits):  # the reference: that token masked at every step
        logits[t] = float("-inf")
        return logits

    want = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, logits_processors=[never_t]), use_tqdm=False
    )
    r = server.http.post(
        f"/v2/models/{MODEL}/generate",
        json={
            "text_input": PROMPTS[0],
            "max_tokens": 8,
            "bad_words": [word],
            "exclude_input_in_output": True,
        },
    )
    assert r.json()["text_output"] == want.outputs[0].text != plain.text
    # A word of several tokens is banned only where the output already ends with its first tokens.
    from inflight.serve.kserve_llm import _bad_words_processor

    two = tok.decode(plain.token_ids[:2])
    seq = tok.encode(two, add_special_tokens=False)
    ban = _bad_words_processor(tok, [two])
    logits = ban(
        list(seq[:-1]), np.zeros(tok.vocab_size if hasattr(tok, "vocab_size") else 400, dtype=np.float32)
    )
    assert logits[seq[-1]] == -np.inf and np.isfinite(np.delete(logits, seq[-1])).all()
    assert np.isfinite(ban([seq[-1]] * 3, np.zeros_like(logits))).all()
    # end_id replaces EOS: generation stops at that token (kept in the tokens, not in the text).
    four = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False
    ).outputs[0]
    r = server.http.post(
        f"/v2/models/{MODEL}/generate",
        json={
            "text_input": PROMPTS[0],
            "max_tokens": 4,
            "end_id": four.token_ids[1],
            "exclude_input_in_output": True,
        },
    )
    assert r.json()["text_output"] == tok.decode(four.token_ids[:1], skip_special_tokens=True)
    server.wait_idle()


def test_openai_and_kserve_routes_side_by_side(server, client, llm):
    """The same model under the same name on both APIs, in the same process."""
    oa = server.client().completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    ks = client.infer(MODEL, infer_inputs(PROMPTS[1:], 6, True, exclude_input_in_output=(np.bool_, True)))
    assert text_outputs(ks) == [[oa.choices[0].text]]
    server.wait_idle()


# ---------------------------------------------------------------------------------------------- gRPC

grpcclient = pytest.importorskip("tritonclient.grpc")


@pytest.fixture(scope="module")
def grpc_server(llm):
    srv = LiveServer(llm, name=MODEL, grpc=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def gclient(grpc_server):
    c = grpcclient.InferenceServerClient(grpc_server.grpc_url)
    yield c
    c.close()


def grpc_inputs(prompts: list[str], max_tokens: int, **extra) -> list:
    b = len(prompts)
    text = grpcclient.InferInput("text_input", [b, 1], "BYTES")
    text.set_data_from_numpy(np.array([[p.encode()] for p in prompts], dtype=object))
    mt = grpcclient.InferInput("max_tokens", [b, 1], "INT32")
    mt.set_data_from_numpy(np.full((b, 1), max_tokens, dtype=np.int32))
    out = [text, mt]
    for name, (dtype, value) in extra.items():
        inp = grpcclient.InferInput(name, [b, 1], {np.int32: "INT32", np.bool_: "BOOL"}[dtype])
        inp.set_data_from_numpy(np.full((b, 1), value, dtype=dtype))
        out.append(inp)
    return out


def test_grpc_probes_metadata_config_and_repository(gclient):
    assert gclient.is_server_live() and gclient.is_server_ready()
    assert gclient.is_model_ready(MODEL) and not gclient.is_model_ready("nope")
    assert gclient.get_server_metadata().name == "inflight"
    meta = gclient.get_model_metadata(MODEL)
    assert meta.name == MODEL and [i.name for i in meta.inputs][:2] == ["text_input", "max_tokens"]
    config = gclient.get_model_config(MODEL, as_json=True)["config"]
    assert config["name"] == MODEL and config["model_transaction_policy"]["decoupled"] is True
    assert {i["name"]: i["data_type"] for i in config["input"]}["max_tokens"] == "TYPE_INT32"
    index = gclient.get_model_repository_index(as_json=True)
    assert [m["name"] for m in index["models"]] == [MODEL] and index["models"][0]["state"] == "READY"
    with pytest.raises(InferenceServerException, match="explicit model load is not allowed"):
        gclient.load_model(MODEL)
    with pytest.raises(InferenceServerException, match="unknown model"):
        gclient.get_model_metadata("nope")


def test_grpc_infer_equals_the_llm_api_and_counts(gclient, llm):
    before = gclient.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
    res = gclient.infer(MODEL, grpc_inputs(PROMPTS, 8), request_id="g-1")
    assert res.get_response().id == "g-1"
    want = [greedy(llm, p, 8) for p in PROMPTS]
    assert text_outputs(res) == [[p + w] for p, w in zip(PROMPTS, want)]
    with pytest.raises(InferenceServerException, match="unexpected inference input 'frobnicate'"):
        gclient.infer(MODEL, grpc_inputs(PROMPTS[:1], 4, frobnicate=(np.int32, 1)))
    after = gclient.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
    assert int(after.get("inference_count", 0)) == int(before.get("inference_count", 0)) + 2
    assert (
        int(after["inference_stats"]["fail"].get("count", 0))
        == int(before["inference_stats"]["fail"].get("count", 0)) + 1
    )


def test_grpc_stream_deltas_final_flag_and_an_error_on_the_stream(gclient, llm):
    import queue

    want = greedy(llm, PROMPTS[1], 12)
    got: queue.Queue = queue.Queue()
    gclient.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        gclient.async_stream_infer("nope", grpc_inputs(PROMPTS[1:], 4), request_id="bad")
        gclient.async_stream_infer(
            MODEL,
            grpc_inputs(PROMPTS[1:], 12, stream=(np.bool_, True), exclude_input_in_output=(np.bool_, True)),
            request_id="good",
        )
        texts, finals, errors = [], [], []
        while not finals or not finals[-1]:
            result, error = got.get(timeout=60)
            if error is not None:
                errors.append(str(error))
                continue
            resp = result.get_response()
            assert resp.id == "good"
            texts.append(result.as_numpy("text_output")[0, 0].decode())
            finals.append(resp.parameters["triton_final_response"].bool_param)
    finally:
        gclient.stop_stream()
    assert len(texts) >= 2 and "".join(texts) == want
    assert finals == [False] * (len(finals) - 1) + [True]
    assert len(errors) == 1 and "unknown model" in errors[0]
