"""Streaming detokenization cost: one long stream (default 4,000 tokens, SmolLM2's tokenizer), a
response per token, as ``LLM.generate_async(..., streaming=True)`` delivers them.

Two measurements, each with its baseline in the same run:

  handle  the request handle alone (no model): the installed package's ``RequestHandle`` fed one
          response per token, against the full re-decode that the handle did before the incremental
          detokenizer (``tokenizer.decode(all ids)`` per response, the same stop-string and hold-back
          work). Reports total and per-token microseconds, early and late in the stream.
  e2e     (--e2e) a real stream from ``LLM("smollm2")``, greedy, EOS ignored: tok/s of each quarter of
          the stream as the client sees it. The package decides what this measures, so run it under
          each version (``--python``: more interpreters, e.g. a venv with the previous commit
          installed, each run in its own process, alternating, ``--repeats`` times).

    python benchmarks/bench_detokenizer.py [--tokens 4000] [--e2e] [--python /path/to/other/python ...]
        [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import pydoc_data.topics
import statistics
import subprocess
import sys
import time


def _tokenizer():
    from inflight.models.gguf_loader import resolve_known_model
    from inflight.models.gguf_tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(resolve_known_model("smollm2"))


def _token_stream(tok, n: int) -> list[int]:
    text = "\n".join(pydoc_data.topics.topics.values())  # English prose and code, no download
    ids = tok.encode(text)
    if len(ids) < n:
        raise ValueError(f"the text has only {len(ids)} tokens, fewer than --tokens {n}")
    return ids[:n]


class _Response:
    """A response of the executor (the fields a handle reads)."""

    def __init__(self, request_id, token, n, finished):
        self.request_id = request_id
        self.new_token_ids = [token]
        self.num_output_tokens = n
        self.finished = finished
        self.finish_reason = "length" if finished else None
        self.stop_reason = None
        self.new_logprobs = None
        self.cumulative_logprob = None
        self.error = None
        self.metrics = {}


class _FullRedecode:
    """The handle's text work before the incremental detokenizer: decode every token so far, again,
    on every response (then the same stable-text slicing)."""

    def __init__(self, tok):
        self.tok = tok
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0

    def on_response(self, resp) -> str:
        self.ids.extend(resp.new_token_ids)
        self.text = self.tok.decode(self.ids, skip_special_tokens=True)
        stable = self.text.rstrip("\ufffd")
        diff, self.sent = stable[self.sent :], len(stable)
        return diff


def _make_handle(tok, prompt_ids):
    """The installed package's handle, through whichever constructor this version has."""
    from inflight import SamplingParams

    params = SamplingParams(max_tokens=10**6, temperature=0.0)
    try:
        from inflight.request_handle import RequestHandle

        handle = RequestHandle([0], None, prompt_ids, params, True, tok, lambda ids: None)
        handle.on_response = lambda resp: handle.on_responses([resp])
        return handle, "handle.on_responses"
    except ImportError:  # before the split: the handle lived in inflight.llm and took the LLM
        from inflight.llm import RequestHandle

        class _Child:
            request_id = 0

        class _Llm:
            class executor:
                @staticmethod
                def cancel_request(rid):
                    pass

        handle = RequestHandle(_Llm(), [_Child()], None, prompt_ids, params, True, tok)
        handle.on_response = handle._on_response
        return handle, "handle._on_response"


def bench_handle(tok, ids: list[int]) -> dict:
    def run(consumer) -> list[float]:
        times = []
        for i, t in enumerate(ids):
            resp = _Response(0, t, i + 1, i + 1 == len(ids))
            t0 = time.perf_counter()
            consumer.on_response(resp)
            times.append(time.perf_counter() - t0)
        return times

    handle, how = _make_handle(tok, ids[:8])
    new = run(handle)
    text = handle.result(timeout=0).outputs[0].text
    old = run(_FullRedecode(tok))
    assert text == tok.decode(ids, skip_special_tokens=True), "the handle's text differs from one decode"
    q = len(ids) // 4

    def summary(times):
        return {
            "total_ms": sum(times) * 1e3,
            "first_quarter_us_per_token": statistics.mean(times[:q]) * 1e6,
            "last_quarter_us_per_token": statistics.mean(times[-q:]) * 1e6,
        }

    return {
        "tokens": len(ids),
        "package_handle": how,
        "installed": summary(new),
        "full_redecode": summary(old),
        "speedup_total": sum(old) / sum(new),
    }


async def _stream(llm, prompt, n: int) -> list[float]:
    from inflight import SamplingParams

    stamps = []
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    async for out in llm.generate_async(prompt, params, streaming=True):
        stamps.extend([time.perf_counter()] * len(out.outputs[0].token_ids_diff))
    return stamps


def bench_e2e(n: int) -> dict:
    import inflight
    from inflight import LLM, KvCacheConfig

    with LLM("smollm2", max_seq_len=n + 64, kv_cache_config=KvCacheConfig(max_tokens=n + 64)) as llm:
        prompt = llm.apply_chat_template([{"role": "user", "content": "Write a very long story."}])
        asyncio.run(_stream(llm, prompt, 16))  # warm-up
        stamps = asyncio.run(_stream(llm, prompt, n))
    q = n // 4
    quarters = [q / (stamps[(i + 1) * q - 1] - stamps[i * q]) for i in range(4)]
    return {
        "inflight": getattr(inflight, "__file__", "?"),
        "tokens": len(stamps),
        "tok_per_s_by_quarter": quarters,
        "total_s": stamps[-1] - stamps[0],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--e2e", action="store_true", help="also stream from LLM('smollm2') (~1 minute per run)")
    p.add_argument("--python", nargs="*", default=[], help="other interpreters to run the e2e case under")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--e2e-only", action="store_true", help=argparse.SUPPRESS)  # a child run
    args = p.parse_args()
    if args.e2e_only:
        print(json.dumps(bench_e2e(args.tokens)))
        return 0
    with open("/proc/cpuinfo") as f:
        cpu = next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
            platform.processor(),
        )
    tok = _tokenizer()
    report = {"cpu": cpu, "handle": bench_handle(tok, _token_stream(tok, args.tokens))}
    h = report["handle"]
    print(f"CPU: {cpu}\n{args.tokens}-token stream, one response per token (the handle alone):")
    print(f"  {'':<28} {'total ms':>10} {'us/token, 1st quarter':>22} {'us/token, last quarter':>23}")
    for name in ("installed", "full_redecode"):
        s = h[name]
        print(
            f"  {name:<28} {s['total_ms']:>10.1f} {s['first_quarter_us_per_token']:>22.1f} "
            f"{s['last_quarter_us_per_token']:>23.1f}"
        )
    print(f"  full re-decode / installed: {h['speedup_total']:.1f}x")
    if args.e2e:
        runs = []
        for _ in range(args.repeats):
            for py in [sys.executable, *args.python]:
                out = subprocess.run(
                    [py, __file__, "--e2e-only", "--tokens", str(args.tokens)],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                run = json.loads(out.strip().splitlines()[-1])
                run["python"] = py
                runs.append(run)
                qs = " / ".join(f"{v:.0f}" for v in run["tok_per_s_by_quarter"])
                print(f"  e2e {py}: tok/s by quarter {qs}  ({run['inflight']})")
        report["e2e"] = runs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
