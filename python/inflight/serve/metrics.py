"""Prometheus metrics of the server (``GET /metrics``): the ``inflight:`` series (vLLM's style, each
labelled ``model_name``) and Triton's (``nv_inference_*`` per model and version, and the TensorRT-LLM
backend's ``nv_trt_llm_*`` engine gauges).

``inflight:`` counters and histograms are updated as requests of any route finish; ``nv_inference_*``
count the requests of the KServe routes (HTTP and gRPC), as Triton would, from each model's
:class:`TritonStats` (which also answers gRPC ModelStatistics). The engine gauges are read from each
served model's ``llm.get_stats()[-1]`` at scrape time. Each app has its own registry, so several apps
can live in one process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)


def _last_stats(llm) -> dict[str, Any]:
    stats = llm.get_stats() if llm is not None else []
    return stats[-1] if stats else {}


class _EngineCollector:
    """The ``inflight:`` gauges of every served model, read at scrape time."""

    def __init__(self, models: Callable[[], Iterable[Any]]):
        self._models = models

    def describe(self):
        return []  # nothing at registration (the models may not exist yet); names are fixed anyway

    def collect(self):
        families: dict[str, GaugeMetricFamily] = {}
        spec_families: dict[str, CounterMetricFamily] = {}

        def gauge(name: str, doc: str, model: str, value: float) -> None:
            fam = families.get(name)
            if fam is None:
                fam = families[name] = GaugeMetricFamily(f"inflight:{name}", doc, labels=["model_name"])
            fam.add_metric([model], float(value))

        for state in self._models():
            m = state.model_name
            last = _last_stats(state.llm)
            kv = last.get("kv_cache_stats", {}) or {}
            max_blocks = kv.get("max_num_blocks", 0) or 0
            used = kv.get("used_num_blocks", 0) or 0
            gauge(
                "num_requests_running",
                "Requests in the engine's active batch.",
                m,
                last.get("num_active_requests", 0),
            )
            gauge(
                "num_requests_waiting",
                "Requests queued in the engine, not yet admitted.",
                m,
                last.get("num_waiting_requests", 0),
            )
            gauge(
                "num_requests_in_flight",
                "HTTP requests accepted by the server and not finished.",
                m,
                state.in_flight,
            )
            gauge(
                "kv_cache_usage_perc",
                "Fraction of KV cache blocks in use (0-1).",
                m,
                used / max_blocks if max_blocks else 0.0,
            )
            gauge("kv_cache_used_blocks", "KV cache blocks in use.", m, used)
            gauge("kv_cache_free_blocks", "KV cache blocks free.", m, kv.get("free_num_blocks", 0) or 0)
            gauge("kv_cache_total_blocks", "KV cache blocks in the pool.", m, max_blocks)
            gauge(
                "kv_cache_reusable_blocks",
                "Free KV cache blocks still holding a cached prefix (reused on a prefix hit).",
                m,
                kv.get("reusable_num_blocks", 0) or 0,
            )
            gauge(
                "prefix_cache_hit_rate",
                "Fraction of looked-up KV blocks found in the prefix cache (0-1).",
                m,
                kv.get("cache_hit_rate", 0.0) or 0.0,
            )
            spec = last.get("spec_decode")
            if spec is not None:  # speculative decoding (the engine's running totals)
                for name, doc, key in (
                    (
                        "spec_decode_num_draft_tokens",
                        "Draft tokens scored by the model (speculative decoding).",
                        "num_draft_tokens_total",
                    ),
                    (
                        "spec_decode_num_accepted_tokens",
                        "Draft tokens accepted (kept in the output).",
                        "num_accepted_tokens_total",
                    ),
                ):
                    fam = spec_families.get(name)
                    if fam is None:
                        fam = spec_families[name] = CounterMetricFamily(
                            f"inflight:{name}", doc, labels=["model_name"]
                        )
                    fam.add_metric([m], float(spec.get(key, 0)))
        yield from families.values()
        yield from spec_families.values()


class TritonStats:
    """One model's request statistics as Triton keeps them (the KServe routes' requests): successes
    and failures with their durations, inferences (rows) and executions, queue and compute time.
    Updated from the event loop and read by the scrape thread (a lock keeps a snapshot whole)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.success_count = 0
        self.success_ns = 0
        self.failure: dict[str, int] = {}  # by reason: REJECTED, CANCELED, BACKEND, OTHER
        self.fail_ns = 0
        self.inference_count = 0
        self.execution_count = 0
        self.queue_ns = 0
        self.compute_ns = 0
        self.last_inference_ms = 0

    @property
    def fail_count(self) -> int:
        return sum(self.failure.values())

    def record_success(
        self, t0_ns: int, rows: int, queue_s: float, compute_s: float, executions: int = 1
    ) -> None:
        """A request that answered: ``t0_ns`` its arrival (``time.monotonic_ns``), ``rows`` its batch
        size, ``queue_s`` / ``compute_s`` its time waiting (batcher and engine queue) and computing;
        ``executions`` 0 when the dynamic batcher counted its batch's execution already."""
        with self._lock:
            self.success_count += 1
            self.success_ns += time.monotonic_ns() - t0_ns
            self.inference_count += rows
            self.execution_count += executions
            self.queue_ns += int(queue_s * 1e9)
            self.compute_ns += int(compute_s * 1e9)
            self.last_inference_ms = int(time.time() * 1000)

    def record_execution(self, requests: int) -> None:
        """The dynamic batcher released one batch (of ``requests`` requests) to the engine."""
        with self._lock:
            self.execution_count += 1

    def record_failure(self, t0_ns: int, reason: str) -> None:
        with self._lock:
            self.failure[reason] = self.failure.get(reason, 0) + 1
            self.fail_ns += time.monotonic_ns() - t0_ns
            self.last_inference_ms = int(time.time() * 1000)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "success": self.success_count,
                "success_ns": self.success_ns,
                "failure": dict(self.failure),
                "fail_ns": self.fail_ns,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "queue_ns": self.queue_ns,
                "compute_ns": self.compute_ns,
                "last_inference_ms": self.last_inference_ms,
            }


_FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


class _TritonCollector:
    """Triton's series: ``nv_inference_*`` per model and version, ``nv_trt_llm_*`` engine gauges."""

    def __init__(self, models: Callable[[], Iterable[Any]]):
        self._models = models

    def describe(self):
        return []  # nothing at registration (the models may not exist yet); names are fixed anyway

    def collect(self):
        mv = ["model", "version"]

        def counter(name: str, doc: str, labels=mv) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=labels)

        success = counter(
            "nv_inference_request_success", "Number of successful inference requests, all batch sizes"
        )
        failure = counter(
            "nv_inference_request_failure",
            "Number of failed inference requests, all batch sizes",
            [*mv, "reason"],
        )
        count = counter("nv_inference_count", "Number of inferences performed (the rows of every request)")
        execs = counter("nv_inference_exec_count", "Number of model executions performed")
        duration = counter(
            "nv_inference_request_duration_us", "Cumulative inference request duration in microseconds"
        )
        queue = counter(
            "nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds"
        )
        compute = counter(
            "nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds"
        )
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
            labels=mv,
        )
        requests = GaugeMetricFamily(
            "nv_trt_llm_request_metrics", "TRT LLM request metrics", labels=[*mv, "request_type"]
        )
        blocks = GaugeMetricFamily(
            "nv_trt_llm_kv_cache_block_metrics",
            "TRT LLM KV cache block metrics",
            labels=[*mv, "kv_cache_block_type"],
        )
        for state in self._models():
            key = [state.model_name, state.model_version]
            s = state.triton.snapshot()
            success.add_metric(key, s["success"])
            for reason in _FAILURE_REASONS:
                failure.add_metric([*key, reason], s["failure"].get(reason, 0))
            count.add_metric(key, s["inference_count"])
            execs.add_metric(key, s["execution_count"])
            duration.add_metric(key, (s["success_ns"] + s["fail_ns"]) // 1000)
            queue.add_metric(key, s["queue_ns"] // 1000)
            compute.add_metric(key, s["compute_ns"] // 1000)
            last = _last_stats(state.llm)
            waiting = last.get("num_waiting_requests", 0)
            pending.add_metric(key, state.queued() + waiting)
            for kind, value in (
                ("active", last.get("num_active_requests", 0)),
                ("max", state.max_active_requests()),
                ("scheduled", last.get("num_scheduled_requests", 0)),
                ("context", last.get("num_context_requests", 0)),
                ("waiting", waiting),
            ):
                requests.add_metric([*key, kind], value)
            kv = last.get("kv_cache_stats", {}) or {}
            total = kv.get("max_num_blocks", 0) or 0
            used = kv.get("used_num_blocks", 0) or 0
            for kind, value in (
                ("max", total),
                ("free", kv.get("free_num_blocks", 0) or 0),
                ("used", used),
                ("tokens_per", kv.get("tokens_per_block", 0) or 0),
                ("fraction", used / total if total else 0.0),
            ):
                blocks.add_metric([*key, kind], value)
        yield from (success, failure, count, execs, duration, queue, compute, pending, requests, blocks)


class ModelMetrics:
    """The ``inflight:`` counters and histograms of one model (children of :class:`ServerMetrics`)."""

    def __init__(self, metrics: ServerMetrics, model: str):
        self.prompt_tokens = metrics.prompt_tokens.labels(model_name=model)
        self.generation_tokens = metrics.generation_tokens.labels(model_name=model)
        self._success = metrics.request_success
        self._model = model
        self.request_aborted = metrics.request_aborted.labels(model_name=model)
        self.request_failure = metrics.request_failure.labels(model_name=model)
        self.num_preemptions = metrics.num_preemptions.labels(model_name=model)
        self.ttft = metrics.ttft.labels(model_name=model)
        self.tpot = metrics.tpot.labels(model_name=model)
        self.e2e = metrics.e2e.labels(model_name=model)
        self.queue_time = metrics.queue_time.labels(model_name=model)

    def record_finished(self, output, num_prompt_tokens: int, num_generated: int) -> None:
        """One finished request (a RequestOutput whose outputs all finished)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated)
        reasons = [c.finish_reason for c in output.outputs]
        if "error" in reasons:
            self.request_failure.inc()
        elif "cancelled" in reasons:
            self.request_aborted.inc()
        else:
            self._success.labels(model_name=self._model, finished_reason=reasons[0] or "unknown").inc()
        m = output.metrics or {}
        if "ttft" in m:
            self.ttft.observe(m["ttft"])
        if "e2e_latency" in m:
            self.e2e.observe(m["e2e_latency"])
            n = max((len(c.token_ids) for c in output.outputs), default=0)
            if "ttft" in m and n > 1:
                self.tpot.observe(max(m["e2e_latency"] - m["ttft"], 0.0) / (n - 1))
        if "queue_time" in m:
            self.queue_time.observe(m["queue_time"])
        if m.get("num_preemptions"):
            self.num_preemptions.inc(m["num_preemptions"])

    def record_aborted(self, num_prompt_tokens: int, num_generated: int) -> None:
        """A request given up before its final output arrived (the client went away)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated)
        self.request_aborted.inc()


class ServerMetrics:
    """The app's registry. ``models()`` gives the served models' states (``model_name``, ``model_version``,
    ``llm``, ``in_flight``, ``triton``, ``queued()``, ``max_active_requests()``) at scrape time;
    :meth:`for_model` the per-model recorders; ``request_rejected`` counts requests refused before a
    model took them."""

    def __init__(self, models: Callable[[], Iterable[Any]]):
        # No `*_created` timestamp series next to every counter (process-wide; vLLM does the same).
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        m = ["model_name"]
        self.prompt_tokens = Counter(
            "inflight:prompt_tokens", "Prompt tokens of finished requests.", m, registry=r
        )
        self.generation_tokens = Counter(
            "inflight:generation_tokens", "Generated tokens of finished requests.", m, registry=r
        )
        self.request_success = Counter(
            "inflight:request_success",
            "Requests that finished normally.",
            [*m, "finished_reason"],
            registry=r,
        )
        self.request_aborted = Counter(
            "inflight:request_aborted",
            "Requests cancelled before finishing (client disconnect, shutdown).",
            m,
            registry=r,
        )
        self.request_failure = Counter(
            "inflight:request_failure", "Requests that failed in the engine.", m, registry=r
        )
        self.request_rejected = Counter(
            "inflight:request_rejected",
            "Requests refused before reaching the engine, by reason.",
            ["reason"],
            registry=r,
        )
        self.num_preemptions = Counter(
            "inflight:num_preemptions", "Preemptions of finished requests.", m, registry=r
        )
        self.ttft = Histogram(
            "inflight:time_to_first_token_seconds",
            "Time to first token (arrival to first token).",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "inflight:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            m,
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "inflight:e2e_request_latency_seconds",
            "End-to-end request latency in the engine.",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "inflight:request_queue_time_seconds",
            "Time from arrival to first scheduling.",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(models))
        r.register(_TritonCollector(models))

    def for_model(self, model: str) -> ModelMetrics:
        return ModelMetrics(self, model)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
