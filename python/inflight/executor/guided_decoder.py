"""Structured output (guided decoding): a grammar per request, a token mask per step.

A request with ``SamplingParams(guided_decoding=GuidedDecodingParams(...))`` carries a
:class:`GrammarMatcher`. Each step, before penalties, filters and the draw, its logits row is masked
to the tokens the grammar allows next (EOS only where the grammar may end, and nothing but EOS once
it is complete); each token it keeps advances the matcher. So a guided request ends as any other: on
EOS (finish reason "stop") or at ``max_tokens`` ("length", its text a prefix of a valid output).
With draft tokens (speculative decoding), the row of each draft position gets the mask after the
drafts before it (:meth:`GrammarMatcher.fill_masks`: a trial advance, then a rollback).

The backend (:class:`GrammarBackend`) is llguidance by default (``pip install "inflight-llm[structured]"``),
or xgrammar (``guided_decoding_backend="xgrammar"``, ``pip install xgrammar``): JSON schemas, regular
expressions, choices, EBNF grammars (llama.cpp's GBNF) and "any JSON object" with either.
JSON allows no free whitespace by default (``whitespace_flexible=False``): a model that keeps emitting
newlines inside a JSON value — the most reported failure of guided JSON — cannot.

Compilation runs on a worker thread of :class:`GuidedDecoder`, with an LRU cache keyed by the
grammar (a repeated schema compiles once: each request then gets a copy of the compiled matcher);
the executor keeps a request out of the active list until its grammar is compiled, and a compile
error fails that request alone. Validation (is the schema / regex / grammar well formed?) is cheap
and runs in ``LLM.generate`` itself, so that a bad grammar is a ``ValueError`` (a 400 on the server)
before anything is queued.
"""

from __future__ import annotations

import abc
import collections
import concurrent.futures
import json
import logging
import threading
from typing import Any

import torch

from inflight.sampling_params import GuidedDecodingParams

logger = logging.getLogger("inflight")

__all__ = [
    "GrammarBackend",
    "GrammarMatcher",
    "GuidedDecoder",
    "LLGuidanceBackend",
    "XGrammarBackend",
    "apply_masks",
    "make_backend",
]


class GrammarMatcher(abc.ABC):
    """One request's grammar state."""

    @abc.abstractmethod
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into ``bitmask[row]`` (int32 words, bit t of word t // 32)."""

    @abc.abstractmethod
    def accept(self, token: int) -> bool:
        """Advances by ``token``; False when the grammar does not allow it."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens."""

    @abc.abstractmethod
    def try_accept(self, token: int) -> bool:
        """Advances by ``token`` when the grammar allows it (True); else changes nothing (False)."""

    def fill_masks(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Speculative decoding: rows ``row .. row + len(drafts)`` get the masks after 0, 1, ...
        ``len(drafts)`` of the draft tokens (the matcher is rolled back afterwards). After a draft the
        grammar refuses, the rows allow everything: verification stops before them (the refused draft
        never equals the masked target token)."""
        self.fill_mask(bitmask, row)
        consumed = 0
        for j, tok in enumerate(drafts, start=1):
            if consumed == j - 1 and not self.is_terminated() and self.try_accept(tok):
                consumed += 1
                self.fill_mask(bitmask, row + j)
            else:
                bitmask[row + j] = -1
        if consumed:
            self.rollback(consumed)

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete: nothing more may follow."""

    @abc.abstractmethod
    def error(self) -> str | None:
        """Why the matcher failed, if it did."""


class GrammarBackend(abc.ABC):
    """Compiles :class:`GuidedDecodingParams` into matchers for one tokenizer."""

    name = "?"

    @abc.abstractmethod
    def validate(self, params: GuidedDecodingParams) -> str | None:
        """None when ``params`` describe a well-formed grammar, else the reason (cheap: no tokenizer)."""

    @abc.abstractmethod
    def compile(self, params: GuidedDecodingParams) -> Any:
        """The compiled grammar (raises ValueError with the reason on failure)."""

    @abc.abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher of a compiled grammar."""


def grammar_key(params: GuidedDecodingParams) -> str:
    """A cache key: the one field set and its value, canonically serialised."""
    kind, value = params.kind()
    if kind == "json" and not isinstance(value, str):
        value = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return f"{kind}:{params.whitespace_flexible}:{json.dumps(value, sort_keys=True)}"


# ---------------------------------------------------------------------------------------------- llguidance


def _only(bitmask: torch.Tensor, row: int, tokens) -> None:
    """``bitmask[row]`` allows ``tokens`` and nothing else."""
    bitmask[row] = 0
    for t in tokens:
        bitmask[row, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)


class _LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher, eos_token_ids: tuple[int, ...]) -> None:
        self._m = matcher
        self._eos = eos_token_ids

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        if self._m.is_error():
            bitmask[row] = -1  # the request fails on its next token (accept refuses it)
            return
        if self._m.is_stopped():
            # The grammar is complete: only EOS may follow (the request then ends as any other, its
            # EOS in token_ids, not in the text).
            _only(bitmask, row, self._eos)
            return
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def accept(self, token: int) -> bool:
        if self._m.is_stopped():
            return int(token) in self._eos
        return bool(self._m.consume_token(int(token)))

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(int(num_tokens))

    def try_accept(self, token: int) -> bool:
        # try_consume_tokens stops at a refused token without putting the matcher in error.
        return self._m.try_consume_tokens([int(token)]) == 1

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class LLGuidanceBackend(GrammarBackend):
    """llguidance over a Hugging Face fast tokenizer (its token table is built once, lazily: ~1 s
    for a large vocabulary)."""

    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        try:
            import llguidance  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "structured output needs llguidance: pip install 'inflight-llm[structured]'"
            ) from exc
        self._hf = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self._vocab_size, eos_token=self._eos or None
                )
            return self._tokenizer

    @staticmethod
    def grammar(params: GuidedDecodingParams) -> str:
        """The llguidance grammar of ``params`` (raises ValueError for a malformed one)."""
        import llguidance

        kind, value = params.kind()
        defaults = {"whitespace_flexible": params.whitespace_flexible}
        try:
            if kind == "json":
                schema = json.loads(value) if isinstance(value, str) else value
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=defaults)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(value)
            if kind == "choice":
                return llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in value)
                )
            from llguidance.gbnf_to_lark import gbnf_to_lark

            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(value))
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001  (llguidance raises several types for bad input)
            raise ValueError(str(exc)) from None

    def validate(self, params: GuidedDecodingParams) -> str | None:
        import llguidance

        try:
            grammar = self.grammar(params)
        except ValueError as exc:
            return str(exc)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        return "; ".join(messages) if is_error else None

    def compile(self, params: GuidedDecodingParams) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self._ll_tokenizer(), self.grammar(params), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return _LLGuidanceMatcher(compiled.deep_copy(), tuple(self._eos))


# ---------------------------------------------------------------------------------------------- xgrammar


class _XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher, eos_token_ids: tuple[int, ...]) -> None:
        self._m = matcher
        self._eos = eos_token_ids
        self._error: str | None = None

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._error is not None:
            bitmask[row] = -1  # the request fails on its next token (accept refuses it)
            return
        if self._m.is_terminated():
            _only(bitmask, row, self._eos)
            return
        # xgrammar writes into a CPU int32 tensor of the full row width.
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        if self._m.is_terminated():
            return int(token) in self._eos
        if self._m.accept_token(int(token)):
            return True
        self._error = f"token {int(token)} is not allowed by the grammar here"
        return False

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(int(num_tokens))

    def try_accept(self, token: int) -> bool:
        # accept_token leaves the matcher unchanged when it refuses a token.
        return not self._m.is_terminated() and bool(self._m.accept_token(int(token)))

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def error(self) -> str | None:
        return self._error


class XGrammarBackend(GrammarBackend):
    """xgrammar over a Hugging Face tokenizer (optional: ``pip install xgrammar``)."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        try:
            import xgrammar
        except ImportError as exc:
            raise ImportError(
                "guided_decoding_backend='xgrammar' needs xgrammar: pip install xgrammar"
            ) from exc
        self._eos = tuple(eos_token_ids)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(self._eos) or None
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    @staticmethod
    def _grammar(params: GuidedDecodingParams):
        """The xgrammar Grammar of ``params`` (raises ValueError for a malformed one)."""
        import xgrammar

        kind, value = params.kind()
        # The schema as written (strict_mode off: unlisted properties are allowed unless the schema
        # says otherwise, as JSON Schema defines); compact JSON unless whitespace_flexible.
        style = {"any_whitespace": params.whitespace_flexible, "strict_mode": False}
        if not params.whitespace_flexible:
            style["separators"] = (",", ":")
        try:
            if kind in ("json", "json_object"):
                if kind == "json":
                    text = value if isinstance(value, str) else json.dumps(value)
                else:
                    text = '{"type": "object"}'
                grammar = xgrammar.Grammar.from_json_schema(text, **style)
                # xgrammar (0.2.9) writes a string with minLength / maxLength as a repetition of
                # [^"\\\r\n], which lets raw control characters (U+0000..U+001F) in: not JSON.
                # The same class without them, as its unbounded strings have it.
                ebnf = str(grammar)
                loose = r"[^\"\\\r\n]"
                if loose in ebnf:
                    grammar = xgrammar.Grammar.from_ebnf(ebnf.replace(loose, r"[^\0-\x1f\"\\]"))
                return grammar
            if kind == "regex":
                return xgrammar.Grammar.from_regex(value)
            if kind == "choice":
                return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in value))
            return xgrammar.Grammar.from_ebnf(value)
        except Exception as exc:  # noqa: BLE001  (xgrammar raises RuntimeError and others for bad input)
            raise ValueError(str(exc)) from None

    def validate(self, params: GuidedDecodingParams) -> str | None:
        try:
            self._grammar(params)
        except ValueError as exc:
            return str(exc)
        return None

    def compile(self, params: GuidedDecodingParams) -> Any:
        return self._compiler.compile_grammar(self._grammar(params))

    def matcher(self, compiled: Any) -> GrammarMatcher:
        import xgrammar

        return _XGrammarMatcher(
            xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=False), self._eos
        )


BACKENDS = {"llguidance": LLGuidanceBackend, "xgrammar": XGrammarBackend}


def make_backend(name: str, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> GrammarBackend:
    """The grammar backend called ``name`` (ImportError when its package is not installed)."""
    if name not in BACKENDS:
        raise ValueError(f"guided_decoding_backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name](tokenizer, vocab_size, eos_token_ids)


# ---------------------------------------------------------------------------------------------- the decoder


class GuidedDecoder:
    """Compiles grammars on a worker thread (LRU cache of ``cache_size`` compiled grammars) and masks
    logits. Used by the executor; thread-safe for one executor thread plus the worker."""

    def __init__(self, backend: GrammarBackend, cache_size: int = 64) -> None:
        self.backend = backend
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="inflight-grammar")
        self.num_compiled = 0
        self.num_cache_hits = 0

    def _compile(self, params: GuidedDecodingParams) -> Any:
        key = grammar_key(params)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return self._cache[key]
        compiled = self.backend.compile(params)
        with self._lock:
            self._cache[key] = compiled
            self.num_compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def start(self, params: GuidedDecodingParams) -> concurrent.futures.Future:
        """A future of a fresh :class:`GrammarMatcher` for ``params`` (or of the compile error)."""

        def job():
            return self.backend.matcher(self._compile(params))

        return self._pool.submit(job)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def apply_masks(logits: torch.Tensor, rows: list[tuple[int, GrammarMatcher, list[int]]]) -> torch.Tensor:
    """``logits`` with the disallowed tokens of each ``(row, matcher, drafts)`` at -inf: row ``row``
    after the tokens so far, and with drafts the next ``len(drafts)`` rows after each draft prefix (a
    copy; the other rows untouched). Tokens past the tokenizer's vocabulary are disallowed too."""
    n, vocab = logits.shape
    bitmask = torch.full((n, (vocab + 31) // 32), -1, dtype=torch.int32)  # every bit set: all allowed
    for row, matcher, drafts in rows:
        if drafts:
            matcher.fill_masks(bitmask, row, drafts)
        else:
            matcher.fill_mask(bitmask, row)
    out = logits.float().clone() if logits.device.type == "cpu" else logits.clone()
    try:
        import llguidance.torch
    except ImportError:  # another backend alone: unpack the bits here
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().view(n, -1)[:, :vocab]
        out.masked_fill_(~allowed.to(out.device), float("-inf"))
        return out
    llguidance.torch.apply_token_bitmask_inplace(out, bitmask.to(out.device))
    return out
