"""A live server for the HTTP tests: build_app + uvicorn on a pre-bound 127.0.0.1 socket, on a thread."""

from __future__ import annotations

import socket
import threading

import httpx
import openai
from llm_utils import assert_kv_idle, wait_until
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT = 60


def tiny_server_llm(model_dir):
    """The engine the HTTP tests serve: the tiny llama, fp32, an 8192-token pool of 8-token blocks."""
    from inflight import LLM, KvCacheConfig

    return LLM(model_dir, dtype="float32", kv_cache_config=KvCacheConfig(max_tokens=8192, tokens_per_block=8))


class LiveServer:
    """build_app + uvicorn on a pre-bound 127.0.0.1 socket, run on a daemon thread."""

    def __init__(
        self, llm, name: str = "tiny", max_queue_size: int = 1024, grpc: bool = False, app=None, **app_kwargs
    ):
        """Serves ``llm`` as ``name``, or (``llm`` None) a ready-made ``app`` (a model repository's)."""
        from inflight.serve.app import build_app
        from inflight.serve.server import make_server

        self.llm = llm
        self.app = app if app is not None else build_app(llm, name, max_queue_size, **app_kwargs)
        self.state = getattr(self.app.state, "server", None)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = make_server(
            self.app, "127.0.0.1", 0, log_level="warning", access_log=False, grpc_port=0 if grpc else None
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), TIMEOUT, "the server to start")
        assert self.server.started, "the server did not start"
        self.http = httpx.Client(base_url=self.url, timeout=TIMEOUT)
        self.grpc_url = f"127.0.0.1:{self.server.grpc_port}" if grpc else None

    def stop(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "the server did not stop"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)

    def metrics(self, drop: tuple[str, ...] = ("model_name",)) -> dict[str, float]:
        """Every sample of /metrics as {"name{label=value,...}": value}, without the labels in ``drop``
        (by default the ``model_name`` of the ``inflight:`` series: this server has one model)."""
        return parse_metrics(self.http, drop)

    def wait_idle(self) -> None:
        wait_until(lambda: self.state.in_flight == 0, TIMEOUT, "no request in flight")
        assert_kv_idle(self.llm)


def parse_metrics(http: httpx.Client, drop: tuple[str, ...] = ()) -> dict[str, float]:
    """GET /metrics parsed with prometheus-client's parser: {"name{label=value,...}": value}."""
    resp = http.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le" and k not in drop)
            key = s.name + (f"{{{labels}}}" if labels else "")
            if "le" in s.labels:
                key += f"[le={s.labels['le']}]"
            out[key] = s.value
    return out
