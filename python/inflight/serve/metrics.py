"""Prometheus metrics of the server (``GET /metrics``), names prefixed ``inflight:`` (vLLM's style).

Counters and histograms are updated as requests finish; the engine gauges (running and waiting
requests, KV cache usage and blocks, prefix-cache hit rate) are read from ``llm.get_stats()[-1]`` at
scrape time. Each server has its own registry, so several apps can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable
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


class _EngineCollector:
    """Gauges read at scrape time."""

    def __init__(self, llm, in_flight: Callable[[], int]):
        self._llm = llm
        self._in_flight = in_flight

    def collect(self):
        stats = self._llm.get_stats() if self._llm is not None else []
        last: dict[str, Any] = stats[-1] if stats else {}
        kv = last.get("kv_cache_stats", {}) or {}
        max_blocks = kv.get("max_num_blocks", 0) or 0
        used = kv.get("used_num_blocks", 0) or 0

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"inflight:{name}", doc, value=float(value))

        yield gauge(
            "num_requests_running",
            "Requests in the engine's active batch.",
            last.get("num_active_requests", 0),
        )
        yield gauge(
            "num_requests_waiting",
            "Requests queued in the engine, not yet admitted.",
            last.get("num_waiting_requests", 0),
        )
        yield gauge(
            "num_requests_in_flight",
            "HTTP requests accepted by the server and not finished.",
            self._in_flight(),
        )
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (0-1).",
            used / max_blocks if max_blocks else 0.0,
        )
        yield gauge("kv_cache_used_blocks", "KV cache blocks in use.", used)
        yield gauge("kv_cache_free_blocks", "KV cache blocks free.", kv.get("free_num_blocks", 0) or 0)
        yield gauge("kv_cache_total_blocks", "KV cache blocks in the pool.", max_blocks)
        yield gauge(
            "kv_cache_reusable_blocks",
            "Free KV cache blocks still holding a cached prefix (reused on a prefix hit).",
            kv.get("reusable_num_blocks", 0) or 0,
        )
        yield gauge(
            "prefix_cache_hit_rate",
            "Fraction of looked-up KV blocks found in the prefix cache (0-1).",
            kv.get("cache_hit_rate", 0.0) or 0.0,
        )
        spec = last.get("spec_decode")
        if spec is not None:  # speculative decoding (the engine's running totals)
            yield CounterMetricFamily(
                "inflight:spec_decode_num_draft_tokens",
                "Draft tokens scored by the model (speculative decoding).",
                value=float(spec.get("num_draft_tokens_total", 0)),
            )
            yield CounterMetricFamily(
                "inflight:spec_decode_num_accepted_tokens",
                "Draft tokens accepted (kept in the output).",
                value=float(spec.get("num_accepted_tokens_total", 0)),
            )


class ServerMetrics:
    def __init__(self, llm, in_flight: Callable[[], int]):
        # No `*_created` timestamp series next to every counter (process-wide; vLLM does the same).
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prompt_tokens = Counter(
            "inflight:prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "inflight:generation_tokens", "Generated tokens of finished requests.", registry=r
        )
        self.request_success = Counter(
            "inflight:request_success", "Requests that finished normally.", ["finished_reason"], registry=r
        )
        self.request_aborted = Counter(
            "inflight:request_aborted",
            "Requests cancelled before finishing (client disconnect, shutdown).",
            registry=r,
        )
        self.request_failure = Counter(
            "inflight:request_failure", "Requests that failed in the engine.", registry=r
        )
        self.request_rejected = Counter(
            "inflight:request_rejected",
            "Requests refused before reaching the engine, by reason.",
            ["reason"],
            registry=r,
        )
        self.num_preemptions = Counter(
            "inflight:num_preemptions", "Preemptions of finished requests.", registry=r
        )
        self.ttft = Histogram(
            "inflight:time_to_first_token_seconds",
            "Time to first token (arrival to first token).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "inflight:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "inflight:e2e_request_latency_seconds",
            "End-to-end request latency in the engine.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "inflight:request_queue_time_seconds",
            "Time from arrival to first scheduling.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(llm, in_flight))

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
            self.request_success.labels(finished_reason=reasons[0] or "unknown").inc()
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

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
