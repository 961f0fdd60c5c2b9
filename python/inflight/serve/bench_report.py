"""The results of ``inflight bench serve`` (:mod:`inflight.serve.bench`): one :class:`RequestResult`
per request, their statistics for one request rate and backend (:func:`summarize`: TTFT, TPOT, ITL
and E2E percentiles, throughput), the printed summary and the plot of latency against request rate
(matplotlib, imported only for ``--plot``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """One request's outcome (times in seconds; ``itl``: the gaps between its streamed chunks)."""

    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    start: float = 0.0
    itl: list[float] = field(default_factory=list)


def _percentiles(values: list[float], scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    xs = sorted(values)

    def pct(p: float) -> float:  # linear interpolation (numpy's default)
        k = (len(xs) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {
        "mean": sum(xs) / len(xs) * scale,
        "p50": pct(50) * scale,
        "p90": pct(90) * scale,
        "p99": pct(99) * scale,
    }


def summarize(results: list[RequestResult], duration: float, rate: float, backend: str = "openai") -> dict:
    """One run's statistics (latencies in ms); ``backend`` names the protocol it was sent over."""
    ok = [r for r in results if r.ok]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    in_tok = sum(r.prompt_len for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error[:200]] = errors.get(r.error[:200], 0) + 1
    return {
        "backend": backend,
        "request_rate": rate if math.isfinite(rate) else "inf",
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "input_token_throughput": in_tok / duration if duration > 0 else 0.0,
        "output_token_throughput": out_tok / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else 0.0,
        "ttft_ms": _percentiles([r.ttft for r in ok]),
        "tpot_ms": _percentiles(tpots),
        "itl_ms": _percentiles([x for r in ok for x in r.itl]),
        "e2e_ms": _percentiles([r.e2e for r in ok]),
    }


def print_summary(s: dict) -> None:
    print(f"\n==== {s['backend']}: request rate {s['request_rate']} req/s ====")
    print(f"  completed {s['completed']}, failed {s['failed']}, duration {s['duration_s']:.2f} s")
    for err, n in s["errors"].items():
        print(f"  error x{n}: {err}")
    print(f"  request throughput  {s['request_throughput']:.2f} req/s")
    print(
        f"  output tokens/s     {s['output_token_throughput']:.1f}   (total tokens/s "
        f"{s['total_token_throughput']:.1f})"
    )
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        v = s[key]
        print(
            f"  {name:<5} ms  mean {v['mean']:9.2f}  p50 {v['p50']:9.2f}  p90 {v['p90']:9.2f}  p99 {v['p99']:9.2f}"
        )


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["request_rate"] if r["request_rate"] != "inf" else r["request_throughput"] for r in runs]
    order = sorted(range(len(runs)), key=lambda i: xs[i])
    xs = [xs[i] for i in order]
    runs = [runs[i] for i in order]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, keys in ((axes[0], ("ttft_ms", "e2e_ms")), (axes[1], ("tpot_ms", "itl_ms"))):
        for key in keys:
            for p, style in (("p50", "-o"), ("p99", "--s")):
                ax.plot(xs, [r[key][p] for r in runs], style, label=f"{key[:-3].upper()} {p}")
        ax.set_xlabel("request rate (req/s; 'inf' runs at their achieved rate)")
        ax.set_ylabel("latency (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_title("time to first token / end to end")
    axes[1].set_title("time per output token / inter-token latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
