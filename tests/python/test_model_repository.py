"""``inflight serve --model-repository``: a repository of three tiny models (one broken) served through
Triton's clients — the index, explicit load / unload / reload (with a changed config, and a failing
one that keeps the old engine), unload during a stream, dynamic batching from the config, Triton's
metrics counted exactly, and the OpenAI and KServe routes on the same model side by side."""

from __future__ import annotations

import gc
import json
import threading
import time
import weakref

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
import httpx  # noqa: E402
from llm_utils import wait_until  # noqa: E402
from serve_utils import LiveServer, parse_metrics  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from inflight import KvCacheConfig, SamplingParams  # noqa: E402
from inflight.llm_args import LlmArgs  # noqa: E402

ALPHA_PBTXT = """
name: "alpha"
backend: "tensorrtllm"
max_batch_size: 8
model_transaction_policy { decoupled: true }
parameters { key: "model" value { string_value: "%s" } }
parameters { key: "max_tokens_in_paged_kv_cache" value { string_value: "2048" } }
parameters { key: "enable_kv_cache_reuse" value { string_value: "true" } }
parameters { key: "batch_scheduler_policy" value { string_value: "guaranteed_no_evict" } }
parameters { key: "enable_chunked_context" value { string_value: "${enable_chunked_context}" } }
parameters { key: "gpt_model_type" value { string_value: "inflight_fused_batching" } }
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    root = tmp_path_factory.mktemp("repository")
    (root / "alpha").mkdir()
    (root / "alpha" / "config.pbtxt").write_text(ALPHA_PBTXT % model)
    (root / "beta").mkdir()
    (root / "beta" / "config.json").write_text(
        json.dumps(
            {
                "max_batch_size": 2,
                "parameters": {"model": model, "max_tokens_in_paged_kv_cache": 2048},
                "dynamic_batching": {
                    "max_queue_delay_microseconds": 1000,
                    "default_queue_policy": {"max_queue_size": 1},
                },
            }
        )
    )
    (root / "broken").mkdir()
    (root / "broken" / "config.pbtxt").write_text(
        'parameters { key: "model" value { string_value: "/nonexistent/model" } }'
    )
    return root, model


@pytest.fixture(scope="module")
def server(repo):
    from inflight.serve.app import build_models_app
    from inflight.serve.repository import ModelRepository

    root, model = repo
    base = LlmArgs(model=model, dtype="float32", kv_cache_config=KvCacheConfig(tokens_per_block=8))
    repository = ModelRepository(str(root), base, control_mode="explicit", version="test")
    repository.load_at_startup(["alpha"])
    srv = LiveServer(None, app=build_models_app(repository), grpc=True)
    srv.repository = repository
    yield srv
    srv.stop()
    repository.close()


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(repo):
    from inflight import LLM

    engine = LLM(repo[1], dtype="float32", kv_cache_config=KvCacheConfig(max_tokens=1024, tokens_per_block=8))
    yield engine
    engine.shutdown()


def greedy(llm, prompt: str, n: int) -> str:
    return llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0), use_tqdm=False).outputs[0].text


def inputs(prompt: str, max_tokens: int) -> list:
    text = httpclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[prompt.encode()]], dtype=object))
    mt = httpclient.InferInput("max_tokens", [1, 1], "INT32")
    mt.set_data_from_numpy(np.full((1, 1), max_tokens, dtype=np.int32))
    exclude = httpclient.InferInput("exclude_input_in_output", [1, 1], "BOOL")
    exclude.set_data_from_numpy(np.array([[True]]))
    return [text, mt, exclude]


def text_of(result) -> str:
    return result.as_numpy("text_output")[0][0].decode()


def states(client) -> dict[str, dict]:
    return {m["name"]: m for m in client.get_model_repository_index()}


def test_index_and_startup(client, server):
    index = states(client)
    assert set(index) == {"alpha", "beta", "broken"}
    assert index["alpha"]["state"] == "READY" and index["alpha"]["version"] == "1"
    assert index["beta"]["state"] == "UNAVAILABLE" and index["beta"]["reason"] == "unloaded"
    assert client.is_server_ready()  # only alpha was asked for at start-up
    assert client.is_model_ready("alpha") and not client.is_model_ready("beta")
    # The TensorRT-LLM backend's parameters reached the engine; the template and the unknown key did not.
    llm = server.repository.lookup("alpha").llm
    assert llm.args.max_batch_size == 8
    assert llm.args.kv_cache_config.max_tokens == 2048
    assert llm.args.kv_cache_config.memory_share == pytest.approx(1 / 3)
    assert llm.args.enable_chunked_prefill is False
    with pytest.raises(InferenceServerException, match="'beta' has no available versions"):
        client.infer("beta", inputs("Hello", 2))


def test_load_infer_and_failed_load(client, server, reference):
    client.load_model("beta")
    assert states(client)["beta"]["state"] == "READY"
    for model in ("alpha", "beta"):
        assert text_of(client.infer(model, inputs("Hello world, this is", 6))) == greedy(
            reference, "Hello world, this is", 6
        )
    config = client.get_model_config("beta")
    assert config["max_batch_size"] == 2
    assert config["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 1
    with pytest.raises(InferenceServerException, match="failed to load 'broken'") as info:
        client.load_model("broken")
    entry = states(client)["broken"]
    assert entry["state"] == "UNAVAILABLE"
    assert "failed to load" in entry["reason"] and "/nonexistent/model" in entry["reason"]
    assert "/nonexistent/model" in str(info.value)
    with pytest.raises(InferenceServerException, match="no such model"):
        client.load_model("gamma")
    assert client.is_model_ready("alpha") and client.is_model_ready("beta")


def test_grpc_repository_rpcs(server):
    g = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        index = {m.name: m for m in g.get_model_repository_index().models}
        assert index["alpha"].state == "READY" and index["broken"].state == "UNAVAILABLE"
        with pytest.raises(InferenceServerException, match="failed to load 'broken'"):
            g.load_model("broken")
        assert g.is_model_ready("alpha")
    finally:
        g.close()


def test_openai_and_kserve_side_by_side(server, client, reference):
    prompt = "The quick brown fox"
    want = greedy(reference, prompt, 8)
    results = {}

    def openai_call():
        results["openai"] = server.client().completions.create(
            model="alpha", prompt=prompt, max_tokens=8, temperature=0.0
        )

    def kserve_call():
        results["kserve"] = text_of(client.infer("alpha", inputs(prompt, 8)))

    thread = threading.Thread(target=openai_call)  # (tritonclient.http stays on its own thread: gevent)
    thread.start()
    kserve_call()
    thread.join(60)
    assert results["openai"].choices[0].text == want and results["openai"].model == "alpha"
    assert results["kserve"] == want
    # An OpenAI request for a model that is not loaded names the served ones.
    resp = server.http.post("/v1/completions", json={"model": "broken", "prompt": "x", "max_tokens": 1})
    assert resp.status_code == 404 and "'alpha'" in resp.json()["error"]["message"]
    ids = {m["id"] for m in server.http.get("/v1/models").json()["data"]}
    assert {"alpha", "beta"} <= ids and "broken" not in ids


def test_triton_metrics_exact(server, client):
    def nv():
        return {k: v for k, v in parse_metrics(server.http).items() if k.startswith("nv_")}

    key = "{model=alpha,version=1}"
    before = nv()
    n = 3
    for i in range(n):
        client.infer("alpha", inputs(f"count {i}", 3))
    with pytest.raises(InferenceServerException):
        client.infer("alpha", inputs("bad", 0))  # max_tokens 0: refused
    wait_until(lambda: server.repository.lookup("alpha").in_flight == 0, 30, "alpha idle")
    after = nv()

    def delta(name: str, labels: str = key) -> float:
        return after.get(name + labels, 0.0) - before.get(name + labels, 0.0)

    assert delta("nv_inference_request_success_total") == n
    assert delta("nv_inference_request_failure_total", "{model=alpha,reason=OTHER,version=1}") == 1
    assert delta("nv_inference_request_failure_total", "{model=alpha,reason=REJECTED,version=1}") == 0
    assert delta("nv_inference_count_total") == n
    assert delta("nv_inference_exec_count_total") == n
    assert delta("nv_inference_request_duration_us_total") > 0
    assert delta("nv_inference_compute_infer_duration_us_total") > 0
    assert delta("nv_inference_queue_duration_us_total") >= 0
    assert after["nv_inference_pending_request_count" + key] == 0
    state = server.repository.lookup("alpha")
    kv = state.llm.get_stats()[-1]["kv_cache_stats"]
    blocks = {
        t: after[f"nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type={t},model=alpha,version=1}}"]
        for t in ("max", "free", "used", "tokens_per", "fraction")
    }
    assert blocks["max"] == kv["max_num_blocks"] == 2048 // 8
    assert blocks["tokens_per"] == 8
    assert blocks["used"] + blocks["free"] <= blocks["max"]
    req = {
        t: after[f"nv_trt_llm_request_metrics{{model=alpha,request_type={t},version=1}}"]
        for t in ("active", "max", "scheduled", "context", "waiting")
    }
    assert req["max"] == state.max_active_requests() == 2 * 8  # the engine's active list: 2 x max_batch_size
    assert req["active"] == 0 and req["waiting"] == 0
    # gRPC ModelStatistics reads the same counts.
    g = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        stats = g.get_inference_statistics("alpha", as_json=True)["model_stats"][0]
    finally:
        g.close()
    assert (
        int(stats["inference_stats"]["success"]["count"]) == after["nv_inference_request_success_total" + key]
    )
    # The inflight: series carry the model's name.
    labelled = parse_metrics(server.http)
    assert labelled["inflight:kv_cache_total_blocks{model_name=alpha}"] == 2048 // 8


def test_dynamic_batching_queue_bound(server, client):
    """beta: max_batch_size 2 (the batcher releases 2 rows at a time) and a queue of 1. With the two
    rows held (as two running requests would), one request waits in the queue and the next is refused
    with Triton's message; once the rows are free the waiting one completes."""
    import asyncio

    beta = server.repository.lookup("beta")
    assert beta.batcher is not None and beta.batcher.capacity == 2
    loop = server.server._loop
    hold = asyncio.run_coroutine_threadsafe(beta.batcher.acquire(2), loop).result(10)
    result: list = []

    def waiting():
        body = {"text_input": "queued", "max_tokens": 4}
        result.append(httpx.post(f"{server.url}/v2/models/beta/generate", json=body, timeout=60))

    thread = threading.Thread(target=waiting)
    thread.start()
    try:
        wait_until(lambda: beta.queued() == 1, 30, "one request in beta's queue")
        assert parse_metrics(server.http)["nv_inference_pending_request_count{model=beta,version=1}"] == 1
        refused = httpx.post(
            f"{server.url}/v2/models/beta/generate", json={"text_input": "x", "max_tokens": 2}
        )
        assert refused.status_code == 503 and refused.json() == {"error": "Exceeds maximum queue size"}
        g = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            with pytest.raises(InferenceServerException, match="Exceeds maximum queue size") as info:
                g.infer(
                    "beta", [_grpc_input("text_input", "BYTES", b"y"), _grpc_input("max_tokens", "INT32", 2)]
                )
            assert info.value.status() == "StatusCode.UNAVAILABLE"
        finally:
            g.close()
    finally:
        loop.call_soon_threadsafe(beta.batcher.release, hold)
        thread.join(60)
    assert result[0].status_code == 200, result[0].text
    for model in ("alpha", "beta"):  # neither has priority levels
        resp = httpx.post(
            f"{server.url}/v2/models/{model}/generate",
            json={"text_input": "x", "max_tokens": 2, "parameters": {"priority": 1}},
        )
        assert resp.status_code == 400
        assert resp.json() == {
            "error": "parameter 'priority' needs priority_levels in the model's dynamic_batching"
        }
    m = parse_metrics(server.http)
    assert m["nv_inference_request_failure_total{model=beta,reason=REJECTED,version=1}"] == 2


def _grpc_input(name: str, dtype: str, value):
    inp = grpcclient.InferInput(name, [1, 1], dtype)
    arr = np.array([[value]], dtype=object if dtype == "BYTES" else np.int32)
    inp.set_data_from_numpy(arr)
    return inp


def test_reload_with_changed_config_fails_no_request(server, client, repo):
    """Requests keep going to alpha while it is reloaded with a changed config (and once with a broken
    one, which keeps the old engine): none fails, and the new config is served."""
    old = server.repository.lookup("alpha")
    stop = threading.Event()
    failures: list = []
    done = [0]

    def traffic():
        c = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
        try:
            while not stop.is_set():
                try:
                    c.infer("alpha", inputs("steady traffic", 4))
                    done[0] += 1
                except Exception as exc:  # noqa: BLE001
                    failures.append(exc)
        finally:
            c.close()

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        wait_until(lambda: done[0] >= 2, 60, "traffic flowing")
        bad = json.dumps({"parameters": {"model": "/nonexistent/other"}})
        with pytest.raises(InferenceServerException, match="failed to load 'alpha'"):
            client.load_model("alpha", config=bad)
        assert server.repository.lookup("alpha") is old  # the old engine kept serving
        new_config = json.dumps(
            {"max_batch_size": 4, "parameters": {"model": repo[1], "max_tokens_in_paged_kv_cache": "1024"}}
        )
        client.load_model("alpha", config=new_config)
        count = done[0]
        wait_until(lambda: done[0] >= count + 2, 60, "traffic on the reloaded engine")
    finally:
        stop.set()
        thread.join(60)
    assert failures == []
    new = server.repository.lookup("alpha")
    assert new is not old and new.llm.args.max_batch_size == 4
    assert client.get_model_config("alpha")["max_batch_size"] == 4
    wait_until(lambda: old.llm is None, 30, "the replaced engine shut down")


def test_unload_during_a_stream(server, client, reference):
    """The stream in flight completes; new requests are refused at once; the engine is freed."""
    state = server.repository.lookup("beta")
    engine = weakref.ref(state.llm)
    prompt = "Streaming through an unload"
    want = greedy(reference, prompt, 40)
    events: list[dict] = []
    first = threading.Event()

    def stream():
        body = {"text_input": prompt, "max_tokens": 40, "exclude_input_in_output": True}
        with httpx.stream(
            "POST", f"{server.url}/v2/models/beta/generate_stream", json=body, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    first.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(60)
    client.unload_model("beta")
    assert states(client)["beta"]["state"] in ("UNLOADING", "UNAVAILABLE")
    with pytest.raises(InferenceServerException, match="'beta' has no available versions"):
        client.infer("beta", inputs("after unload", 2))
    thread.join(120)
    assert all("error" not in e for e in events), events
    assert "".join(e["text_output"] for e in events) == want
    wait_until(lambda: states(client)["beta"]["state"] == "UNAVAILABLE", 30, "beta unloaded")
    assert states(client)["beta"]["reason"] == "unloaded"
    del state
    deadline = time.monotonic() + 30
    while engine() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    assert engine() is None, "the unloaded engine is still referenced"
    assert client.is_model_ready("alpha")  # the other model serves on
