"""Per-request sampling options, with vLLM / TensorRT-LLM names, validated once on construction.

`SamplingParams` is the boundary: every field is type- and range-checked here, with a `ValueError`
naming the field, the value and the allowed range, so the sampler and the executor can trust it.
Unknown keywords are a `TypeError` naming them (the dataclass ``__init__``), never silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Temperatures below this are greedy (as in vLLM): dividing logits by a tiny temperature gives a
# one-hot distribution anyway, and by a denormal one overflows to inf and NaN probabilities.
SAMPLING_EPS = 1e-5

# The sampler and its kernels compute in float32. A value must keep its meaning there: no underflow to
# zero or into the subnormals (which the kernels may flush to zero: top_p 1e-300 would become 0 and
# be refused by the kernel mid-step, failing every request batched with it), no overflow to inf.
FLOAT32_MIN_NORMAL = 2.0**-126  # 1.1754943508222875e-38
# The largest temperature whose reciprocal (the CPU kernel multiplies by 1 / T) is a normal float32.
MAX_TEMPERATURE = 2.0**126  # 8.507059173023462e37
# Penalized logits (logit / penalty, logit * penalty) stay finite in float32 for any logit a model
# produces (|logit| < 1e30) within this range.
MIN_REPETITION_PENALTY = 1e-6
MAX_REPETITION_PENALTY = 1e6


def _check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None, *, what: str) -> int:
    # bool is an Integral, but `max_tokens=True` is a bug in the caller, not the number 1.
    # ValueError, not TypeError: the API promises ValueError for every bad argument (docs/api.md).
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int {what}, got {value!r}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def _check_float(name: str, value: Any, ok: Any, *, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number {what}, got {value!r}")
    as_float = float(value)
    # NaN fails every comparison, so it would slip through a plain range check.
    if not math.isfinite(as_float) or not ok(as_float):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return as_float


def _check_float32(name: str, value: float, *, what: str) -> float:
    """``value`` (already range-checked) survives the float32 conversion: finite, and 0 or normal."""
    if value != 0.0 and not FLOAT32_MIN_NORMAL <= abs(value) <= MAX_FLOAT32:
        raise ValueError(f"{name} must be {what} and representable as a normal float32, got {value!r}")
    return value


MAX_FLOAT32 = 3.4028234663852886e38


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Structured output (TensorRT-LLM's names): exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text); the output is a JSON value it validates;
    - ``json_object=True``: any JSON object;
    - ``regex``: the output full-matches the regular expression;
    - ``choice``: the output is one of these strings;
    - ``grammar``: an EBNF grammar (llama.cpp's GBNF: ``root ::= ...``); the output derives from it.

    ``whitespace_flexible`` (JSON only, default False): allow free whitespace between JSON tokens;
    off, the JSON is compact and a model cannot loop on newlines inside it.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object is True:
            given.append("json_object")
        elif self.json_object is not False:
            raise ValueError(f"guided_decoding.json_object must be a bool, got {self.json_object!r}")
        if len(given) != 1:
            raise ValueError(
                "guided_decoding must set exactly one of json, json_object, regex, choice, grammar; "
                f"got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(
                f"guided_decoding.json must be a JSON schema (dict or str), got {type(self.json).__name__}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"guided_decoding.{name} must be a non-empty str, got {value!r}")
        if self.choice is not None:
            if (
                isinstance(self.choice, str)
                or not all(isinstance(c, str) and c for c in self.choice)
                or not self.choice
            ):
                raise ValueError(
                    f"guided_decoding.choice must be a list of non-empty str, got {self.choice!r}"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.whitespace_flexible, bool):
            raise ValueError(
                f"guided_decoding.whitespace_flexible must be a bool, got {self.whitespace_flexible!r}"
            )

    def kind(self) -> tuple[str, Any]:
        """(the field set, its value)."""
        if self.json_object:
            return "json_object", True
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, name)
            if value is not None:
                return name, value
        raise AssertionError("unreachable: validated in __post_init__")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output tokens (names and ranges as in vLLM / TensorRT-LLM).

    Fields, with their allowed values:

    - ``max_tokens`` (int >= 1, or None: until a stop condition or ``max_seq_len``).
    - ``min_tokens`` (int >= 0, <= ``max_tokens``): EOS and ``stop_token_ids`` are masked until this
      many tokens were generated (EOS is not masked under ``ignore_eos``, where it stops nothing).
    - ``ignore_eos``: EOS does not stop generation; it can still be sampled.
    - ``temperature`` (>= 0; below 1e-5 means greedy), ``top_k`` (0 or -1: all tokens, else >= 1;
      -1 is stored as 0), ``top_p`` in (0, 1], ``min_p`` in [0, 1].
    - ``repetition_penalty`` (> 0), ``presence_penalty`` and ``frequency_penalty`` in [-2, 2].
    - ``seed`` (0 <= seed < 2**63, or None): a seeded request draws from its own generator, so its
      tokens do not depend on the rest of the batch.
    - ``stop`` (str or list of non-empty str) and ``stop_token_ids`` (list of int >= 0), both stored
      as tuples; ``include_stop_str_in_output``.
    - ``logprobs`` (None, or N >= 0 top log-probabilities per token; 0: only the sampled token's; the LLM bounds N
      by ``max_logprobs``, 20 by default).
    - ``prompt_logprobs`` (None, or N >= 0, vLLM's): the log-probability of every prompt token after
      the first given the tokens before it, with the top N at each position (0: the prompt token's
      only), from the model's raw logits; ``RequestOutput.prompt_logprobs`` holds them (None first).
      A request that asks for them computes its whole prompt (no prefix reuse) and pays the LM head
      at every prompt position. Bounded by ``max_logprobs`` like ``logprobs``.
    - ``n`` (>= 1; n > 1 needs random sampling, temperature > 0), ``skip_special_tokens``,
      ``detokenize``.
    - ``speculative`` (default True): False keeps this request out of speculative decoding (no draft
      tokens), for requests where drafting cannot pay.
    - ``guided_decoding`` (:class:`GuidedDecodingParams`, or None): structured output — a JSON schema,
      any JSON object, a regex, a choice or an EBNF grammar the output must follow (a token mask per
      step; the request ends on EOS once the grammar is complete).
    - ``logits_processors`` (list of callables ``fn(output_token_ids: list[int], logits: Tensor[V]) ->
      Tensor[V]``, vLLM's offline form): applied in order to the request's logits row each step, after
      a grammar's mask and before penalties and the draw. Python per row and step: slower than the
      built-in knobs. An exception in one fails that request only.
    - ``use_beam_search`` (TensorRT-LLM's name), ``best_of`` (the beam width K, >= ``n``; None: ``n``),
      ``length_penalty`` (a finished beam scores ``sum(logprobs) / length ** length_penalty``) and
      ``early_stopping`` (True: stop once K beams finished; False: once no running beam can beat the
      worst finished one at its current length; ``"never"``: at the best length it could reach):
      beam search with transformers' rules (``generate(num_beams=K, do_sample=False)``); the ``n``
      best finished beams are returned, best first. The temperature (when not greedy) divides the
      logits first; ``min_tokens``, ``repetition_penalty`` (on the log-probabilities, as transformers
      applies it), ``stop_token_ids``, ``ignore_eos`` and ``logprobs`` apply; the random-sampling
      knobs, penalties of presence and frequency, stop strings, guided decoding, logits processors
      and predictions cannot be combined with it (``ValueError`` naming them).
    - ``prediction`` (str, or None): OpenAI's predicted output — text the output is expected to
      repeat largely (an edit of a given document); its tokens are offered as draft tokens, with or
      without a speculative engine. Never changes the output, only the speed.
    """

    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # Accepts a str or a sequence of str; stored as a tuple (hashable, and one shape to consume).
    stop: str | Sequence[str] | None = None
    # Accepts any sequence of ints; stored as a tuple.
    stop_token_ids: Sequence[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    detokenize: bool = True
    speculative: bool = True
    prediction: str | None = None
    guided_decoding: GuidedDecodingParams | None = None
    # Accepts any sequence of callables; stored as a tuple.
    logits_processors: Sequence[Any] | None = None
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        # Frozen: normalized values go in through object.__setattr__, once, here.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.max_tokens is not None:
            put("max_tokens", _check_int("max_tokens", self.max_tokens, 1, what=">= 1 (or None)"))
        put("min_tokens", _check_int("min_tokens", self.min_tokens, 0, what=">= 0"))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "detokenize",
            "speculative",
            "use_beam_search",
        ):
            put(name, _check_bool(name, getattr(self, name)))

        put(
            "temperature",
            _check_float(
                "temperature",
                self.temperature,
                lambda v: 0 <= v <= MAX_TEMPERATURE,
                what=f"in [0, {MAX_TEMPERATURE:.4g}]",
            ),
        )
        top_k = _check_int("top_k", self.top_k, what="-1 or 0 (all tokens) or >= 1")
        if top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (all tokens) or >= 1, got {top_k!r}")
        put("top_k", max(top_k, 0))
        put(
            "top_p",
            _check_float32(
                "top_p",
                _check_float("top_p", self.top_p, lambda v: 0 < v <= 1, what="in (0, 1]"),
                what="in (0, 1]",
            ),
        )
        put(
            "min_p",
            _check_float32(
                "min_p",
                _check_float("min_p", self.min_p, lambda v: 0 <= v <= 1, what="in [0, 1]"),
                what="in [0, 1]",
            ),
        )
        rep_range = f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]"
        put(
            "repetition_penalty",
            _check_float(
                "repetition_penalty",
                self.repetition_penalty,
                lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
                what=rep_range,
            ),
        )
        for name in ("presence_penalty", "frequency_penalty"):
            put(name, _check_float(name, getattr(self, name), lambda v: -2 <= v <= 2, what="in [-2, 2]"))

        if self.seed is not None:
            put("seed", _check_int("seed", self.seed, 0, 2**63 - 1, what="in [0, 2**63)"))

        put("stop", self._normalize_stop(self.stop))
        put("stop_token_ids", self._normalize_stop_token_ids(self.stop_token_ids))

        if self.logprobs is not None:
            put(
                "logprobs",
                _check_int("logprobs", self.logprobs, 0, what=">= 0 (or None)"),
            )
        if self.prompt_logprobs is not None:
            put(
                "prompt_logprobs",
                _check_int("prompt_logprobs", self.prompt_logprobs, 0, what=">= 0 (or None)"),
            )
        put("n", _check_int("n", self.n, 1, what=">= 1"))
        procs = () if self.logits_processors is None else self.logits_processors
        if (
            isinstance(procs, (str, bytes))
            or not isinstance(procs, Sequence)
            or not all(callable(f) for f in procs)
        ):
            raise ValueError(
                "logits_processors must be a list of callables fn(output_token_ids, logits) -> logits, "
                f"got {self.logits_processors!r}"
            )
        put("logits_processors", tuple(procs))
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise ValueError(
                f"guided_decoding must be a GuidedDecodingParams or None, got {type(self.guided_decoding).__name__}"
            )
        if self.prediction is not None and not isinstance(self.prediction, str):
            raise ValueError(
                f"prediction must be a str (the predicted output) or None, got {self.prediction!r}"
            )
        self._check_beam_search(put)
        if self.n > 1 and self.temperature < SAMPLING_EPS and not self.use_beam_search:
            # n identical greedy sequences are never what the caller meant (vLLM refuses it too).
            raise ValueError(
                f"n must be 1 with greedy sampling (temperature {self.temperature!r} < {SAMPLING_EPS}), "
                f"got {self.n!r}"
            )

    # With use_beam_search: fields that must keep these values (they belong to random sampling, or to
    # features beam search does not combine with).
    _NOT_WITH_BEAMS = (
        ("top_k", 0),
        ("top_p", 1.0),
        ("min_p", 0.0),
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("stop", ()),
        ("guided_decoding", None),
        ("logits_processors", ()),
        ("prediction", None),
    )

    def _check_beam_search(self, put) -> None:
        if self.best_of is not None:
            put("best_of", _check_int("best_of", self.best_of, 1, what=">= 1 (or None: n)"))
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of!r}")
        put(
            "length_penalty",
            _check_float(
                "length_penalty", self.length_penalty, lambda v: -1e3 <= v <= 1e3, what="in [-1000, 1000]"
            ),
        )
        if not (
            self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never"
        ):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if not self.use_beam_search:
            if self.best_of is not None and self.best_of != self.n:
                raise ValueError(
                    f"best_of must equal n ({self.n}) without use_beam_search=True (best_of > n is the "
                    f"beam width of beam search), got {self.best_of!r}"
                )
            return
        for name, default in self._NOT_WITH_BEAMS:
            if getattr(self, name) != default:
                raise ValueError(
                    f"{name} cannot be combined with use_beam_search=True, got {getattr(self, name)!r}"
                )

    @property
    def beam_width(self) -> int:
        """Beams kept per step: ``best_of`` (or ``n``) with beam search, else 1."""
        if not self.use_beam_search:
            return 1
        return self.best_of if self.best_of is not None else self.n

    @staticmethod
    def _normalize_stop(stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        items = (stop,) if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
            raise ValueError(f"stop must be a non-empty str or a list of non-empty str, got {stop!r}")
        return tuple(items)

    @staticmethod
    def _normalize_stop_token_ids(ids: Any) -> tuple[int, ...]:
        if ids is None:
            return ()
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise ValueError(f"stop_token_ids must be a list of int >= 0, got {ids!r}")
        return tuple(int(t) for t in ids)

    @property
    def greedy(self) -> bool:
        """Whether the token is the argmax of the (penalized) logits: temperature ~0 or top_k == 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied, validated again (an unknown field is a TypeError)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's parameters of :meth:`inflight.LLM.beam_search`: ``beam_width`` beams (all returned),
    ``max_tokens`` new tokens at most, ``ignore_eos``, ``temperature`` (0: the raw logits),
    ``length_penalty`` (the exponent of the generated length that divides a finished beam's summed
    log-probability), and ``early_stopping`` (transformers' True / False / "never")."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, 1, what=">= 1")
        _check_int("max_tokens", self.max_tokens, 1, what=">= 1")
        self.sampling_params()  # the other fields are checked there

    def sampling_params(self) -> SamplingParams:
        """The equivalent :class:`SamplingParams` (use_beam_search, best_of = n = beam_width)."""
        return SamplingParams(
            use_beam_search=True,
            best_of=self.beam_width,
            n=self.beam_width,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )
