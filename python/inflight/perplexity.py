"""Perplexity of a model over a text, through the engine (``inflight perplexity``).

What it computes, as llama.cpp's ``llama-perplexity`` does: the text is tokenised once (no special
tokens) and cut into windows of ``context`` tokens, back to back; in each window the first token is
replaced by BOS (when the model has one), and only the second half of the window is scored, so that
every scored token sees at least ``context / 2`` tokens before it. A token's negative log-likelihood
is ``-log p(token | the window's tokens before it)`` under the model's raw distribution; the
perplexity is ``exp`` of their mean over every scored token of every window.

It runs through the engine itself: each window is one request with
``SamplingParams(prompt_logprobs=0, max_tokens=1)``, all submitted at once, so the windows are
batched by the schedulers, chunked by ``max_num_tokens``, and computed by the kernels of the
engine's configuration (``dtype``, ``quantization``, ``kv_cache_config.dtype``) — the number
measures the precision the engine really runs.

The default text ships with Python itself: the standard library's English help texts
(``pydoc_data.topics``, about 465,000 characters), so no download is needed.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from inflight.llm import LLM
from inflight.llm_args import LlmArgs, add_cli_arguments
from inflight.sampling_params import SamplingParams

DEFAULT_CONTEXT = 512


def default_text() -> str:
    """The standard library's pydoc topics (English help texts), in a fixed order."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[name] for name in sorted(topics.topics))


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    nll_stderr: float  # standard error of that mean
    num_scored_tokens: int
    num_windows: int
    context: int
    num_text_tokens: int
    seconds: float
    window_nll: list[float] = field(default_factory=list)  # mean NLL of each window

    @property
    def perplexity_stderr(self) -> float:
        """The perplexity's standard error (first order: exp(nll) x the NLL's standard error)."""
        return self.perplexity * self.nll_stderr

    def to_dict(self) -> dict:
        d = asdict(self)
        d["perplexity_stderr"] = self.perplexity_stderr
        return d


def windows(token_ids: list[int], context: int, bos_token_id: int | None) -> list[list[int]]:
    """Back-to-back windows of ``context`` tokens (a shorter tail is dropped); the first token of
    each is BOS when the model has one."""
    out = []
    for start in range(0, len(token_ids) - context + 1, context):
        w = list(token_ids[start : start + context])
        if bos_token_id is not None:
            w[0] = bos_token_id
        out.append(w)
    return out


def perplexity(
    llm: LLM,
    text: str | None = None,
    *,
    token_ids: list[int] | None = None,
    context: int | None = None,
    max_windows: int | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """The perplexity of ``llm``'s model over ``text`` (default: :func:`default_text`) or over
    ``token_ids`` (already tokenised). ``context``: window length (default 512, capped by the
    engine's ``max_seq_len - 1``); ``max_windows``: score only the first N windows."""
    limit = llm.max_seq_len - 1  # room for the one output token each request asks for
    context = min(context or DEFAULT_CONTEXT, limit)
    if context < 4:
        raise ValueError(f"context must be >= 4 tokens (and <= max_seq_len - 1 = {limit}), got {context}")
    if token_ids is None:
        if llm.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token_ids instead of a text")
        token_ids = list(
            llm.tokenizer.encode(text if text is not None else default_text(), add_special_tokens=False)
        )
    bos = getattr(llm.tokenizer, "bos_token_id", None) if llm.tokenizer is not None else None
    chunks = windows(token_ids, context, bos)
    if max_windows is not None:
        chunks = chunks[:max_windows]
    if not chunks:
        raise ValueError(
            f"the text has {len(token_ids)} tokens, fewer than one window of context={context} tokens"
        )
    first = context // 2  # scored: the tokens at positions first + 1 .. context - 1 of each window
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    t0 = time.perf_counter()
    handles = [llm.generate_async(w, params) for w in chunks]
    nlls: list[float] = []
    window_nll: list[float] = []
    bar = tqdm(total=len(handles), desc="perplexity", unit="window", disable=not progress, dynamic_ncols=True)
    try:
        for w, handle in zip(chunks, handles):
            out = handle.result()
            err = out.outputs[0].error
            if err is not None:
                raise RuntimeError(f"a perplexity window failed: {err}")
            lps = out.prompt_logprobs
            scored = [-lps[j][w[j]] for j in range(first + 1, context)]
            nlls.extend(scored)
            window_nll.append(sum(scored) / len(scored))
            bar.update(1)
            bar.set_postfix(ppl=f"{math.exp(sum(nlls) / len(nlls)):.4f}")
    finally:
        bar.close()
        for h in handles:  # an error above: the rest are not waited for
            if not h.done:
                h.abort()
    n = len(nlls)
    mean = sum(nlls) / n
    var = sum((x - mean) ** 2 for x in nlls) / max(n - 1, 1)
    return PerplexityResult(
        perplexity=math.exp(mean),
        nll=mean,
        nll_stderr=math.sqrt(var / n),
        num_scored_tokens=n,
        num_windows=len(chunks),
        context=context,
        num_text_tokens=len(token_ids),
        seconds=time.perf_counter() - t0,
        window_nll=window_nll,
    )


# ---------------------------------------------------------------------------------------------- CLI


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "perplexity",
        help="perplexity of a model over a text (llama-perplexity's windows), through the engine",
    )
    p.add_argument("model", nargs="?", default="smollm2", help="a model directory, .gguf file or known name")
    p.add_argument("--file", default=None, help="a UTF-8 text file (default: Python's pydoc topics)")
    p.add_argument(
        "--context", type=int, default=DEFAULT_CONTEXT, help="window length in tokens (default 512)"
    )
    p.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    p.add_argument("--json", default=None, help="also write the result to this JSON file")
    add_cli_arguments(p, "engine")
    p.set_defaults(func=cmd_perplexity)
    return p


def cmd_perplexity(args) -> int:
    text = Path(args.file).read_text(encoding="utf-8") if args.file else None
    llm = LLM(**LlmArgs.from_cli(args, model=args.model).to_kwargs())
    try:
        res = perplexity(llm, text, context=args.context, max_windows=args.max_windows)
    finally:
        llm.shutdown()
    print(
        f"perplexity {res.perplexity:.4f} +/- {res.perplexity_stderr:.4f} (NLL {res.nll:.5f} nats/token) over "
        f"{res.num_scored_tokens} scored tokens in {res.num_windows} windows of {res.context} tokens, "
        f"{res.seconds:.1f} s ({res.num_windows * res.context / res.seconds:.0f} tokens/s)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res.to_dict(), indent=1) + "\n")
    return 0
