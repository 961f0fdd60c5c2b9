"""Speculative decoding in the executor: draft tokens before the forward, verification after it.

One step, for a generation request that drafts (docs/architecture.md, "Speculative decoding"):

1. :meth:`Speculator.plan`, before scheduling: ``k`` placeholder draft tokens on the request (its
   adaptive draft length, capped by ``max_seq_len`` and by the tokens it may still generate), so
   the capacity scheduler counts ``1 + k`` KV tokens for it and the micro-batch scheduler ``1 + k``
   tokens of its budget.
2. :meth:`Speculator.fill`, after scheduling: the drafter replaces the placeholders of the
   scheduled requests with real drafts (possibly fewer, possibly none); the others lose theirs.
3. The KV cache grows by ``1 + k``; the request runs as one causal row of ``1 + k`` tokens (its
   newest token, then the drafts) and every position gets logits.
4. :meth:`Speculator.row_states`: row ``j`` is sampled with the request's state extended by the
   first ``j`` drafts (penalties, ``min_tokens`` and the keyed random draw see the history they
   would see without speculation). :meth:`Speculator.verify`: the tokens are kept while each equals
   the draft it replaces; the first that differs (or the one after the last draft) is the model's
   own token. Greedy and seeded requests therefore produce exactly the tokens they would produce
   without speculation. A draft model's sampled drafts go through the rejection rule instead
   (accept with ``min(1, p/q)``, else a draw from ``max(p - q, 0)``), which keeps the target's
   distribution exactly.
5. The executor appends the kept tokens one by one with stop checks, then rewinds the KV cache by
   the drafts that were not kept (:meth:`Speculator.after_verify`).

A request whose drafts keep failing stops paying for them. Each request keeps an estimate ``a`` of
the probability that a draft token is accepted (decayed counts of verified draft positions, one trial
per position up to the first rejection). Its draft length is the ``k`` that maximises the expected
gain, ``a + a^2 + ... + a^k`` accepted tokens, less the cost of the longer row in decode steps
(:class:`DraftCost`, per device: on a CPU the GEMMs are compute-bound and a drafting row costs well
above one decode step; on a GPU nearly the same; :class:`MeasuredCost` replaces it by the engine's
own iteration times for a request running alone); no gain, no drafts. While a request does not
draft, a cheap drafter (n-gram, prediction) still proposes, for free, and the proposal is checked
against the token the model then produces, so the estimate follows the text and drafting resumes
when the text turns repetitive; a draft model is instead probed again after a pause that doubles
each time.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from inflight.executor.draft_cost import DRAFT_COSTS, DraftCost, MeasuredCost, best_draft_len

logger = logging.getLogger("inflight")

# Seconds between two log lines of the acceptance statistics.
LOG_EVERY_S = 10.0
# The draft length of a request with a prediction when the engine has no speculative config.
PREDICTION_MAX_DRAFT_LEN = 8
# A draft model whose drafts are not worth it is probed again after 1, 2, 4, ... steps, at most this many.
MAX_BACKOFF_STEPS = 32
# The acceptance estimate's prior (successes, trials): optimistic, so a request drafts from its first
# step (a failure brings it below break-even at once); and the decay of the old counts at each new
# observation (about the last 10 count). Even odds and a longer memory measured worse on both task
# sets of benchmarks/bench_speculative.py.
PRIOR = (2.0, 3.0)
DECAY = 0.9


@dataclass
class Draft:
    """A drafter's proposal for one request: the tokens, and for a sampled draft model the
    distributions they were drawn from (``[len(tokens), vocab]``, rejection sampling)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


@dataclass
class SpecState:
    """A request's speculative bookkeeping (``ExecutorRequest.py_spec``)."""

    draft_len: int  # the most drafts this request carries in a step
    # Decayed counts of verified draft positions: accepted, and trials (positions up to the first
    # rejection). Their ratio estimates the probability that a draft token is accepted.
    successes: float = PRIOR[0]
    trials: float = PRIOR[1]
    skip: int = 0  # draft model: steps left without drafting (backoff)
    backoff: int = 1  # the next backoff's length
    # A cheap drafter's proposal while not drafting: (tokens generated then, the proposal).
    shadow: tuple[int, list[int]] | None = None

    @property
    def acceptance(self) -> float:
        return self.successes / self.trials

    def observe(self, accepted: int, trials: int) -> None:
        self.successes = self.successes * DECAY + accepted
        self.trials = self.trials * DECAY + trials

    prediction: np.ndarray | None = None  # the tokens of OpenAI's predicted output
    prediction_cursor: int = 0  # where in the prediction the output is believed to be
    prompt: np.ndarray | None = None  # the original prompt, as int64 (cached for the n-gram search)
    draft_probs: torch.Tensor | None = None  # this step's draft distributions (rejection sampling)
    num_drafted: int = 0  # draft tokens scored, over the request's life
    num_accepted: int = 0  # of those, kept

    def history(self, req) -> np.ndarray:
        """Prompt + generated tokens (the n-gram search space)."""
        if self.prompt is None:
            self.prompt = np.asarray(req.get_tokens(0, req.orig_prompt_len), dtype=np.int64)
        out = req.py_sampling_state.output_token_ids_array()
        return np.concatenate([self.prompt, out]) if out.size else self.prompt


def ngram_match(
    history: np.ndarray,
    corpus: np.ndarray | None,
    n_min: int,
    n_max: int,
    k: int,
    cursor: int | None = None,
) -> tuple[np.ndarray, int]:
    """Prompt lookup: the longest suffix of ``history`` (``n_max`` down to ``n_min`` tokens) found in
    ``corpus`` (``history`` itself when None, the suffix's own place excluded) with a token after it;
    returns up to ``k`` tokens that followed the match, and where they start in ``corpus`` (-1: no
    match). Among matches of one length: the most recent in ``history``; in another corpus, the first
    at or after ``cursor`` (else the last before it)."""
    own = corpus is None
    corpus = history if own else corpus
    L, C = len(history), len(corpus)
    for n in range(min(n_max, L - (1 if own else 0)), n_min - 1, -1):
        # Starts i with i + n < C (a token follows); in history itself that also excludes i = L - n.
        end = C - n
        if end <= 0:
            continue
        suffix = history[L - n :]
        cand = np.flatnonzero(corpus[n - 1 : n - 1 + end] == suffix[-1])
        for j in range(1, n):
            if cand.size == 0:
                break
            cand = cand[corpus[cand + n - 1 - j] == suffix[n - 1 - j]]
        if cand.size == 0:
            continue
        if own or cursor is None:
            i = int(cand[-1])
        else:
            after = cand[cand + n >= cursor]
            i = int(after[0]) if after.size else int(cand[-1])
        start = i + n
        return corpus[start : start + k], start
    return corpus[:0], -1


class Drafter(abc.ABC):
    """Proposes draft tokens for scheduled generation requests."""

    name: str = "abstract"
    # Proposing costs next to nothing (no model): proposals are also made, and checked, while the
    # request does not draft (the acceptance estimate keeps learning).
    cheap: bool = False

    @abc.abstractmethod
    def propose(self, requests: Sequence, max_lens: Sequence[int]) -> list[Draft]:
        """Up to ``max_lens[i]`` tokens for ``requests[i]`` (fewer, or none, allowed)."""

    def after_verify(self, request, num_drafted: int, num_accepted: int) -> None:
        """The request kept ``num_accepted`` of its ``num_drafted`` drafts (and one token more)."""

    def free(self, request) -> None:
        """The request finished or was paused: drop what is held for it."""

    def reset(self, requests: Sequence) -> None:
        """A proposal for ``requests`` failed midway: forget what it held for them (they start afresh)."""
        for req in requests:
            self.free(req)

    def shutdown(self) -> None:
        """Releases memory."""


class NgramDrafter(Drafter):
    """Prompt lookup (vLLM's ``ngram`` method): the request's last ``prompt_lookup_max`` ..
    ``prompt_lookup_min`` tokens found earlier in its prompt or output propose what followed them."""

    name = "ngram"
    cheap = True

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max

    def propose(self, requests: Sequence, max_lens: Sequence[int]) -> list[Draft]:
        out = []
        for req, k in zip(requests, max_lens):
            tokens, _ = ngram_match(req.py_spec.history(req), None, self.n_min, self.n_max, k)
            out.append(Draft(tokens.tolist()))
        return out


class PredictionDrafter(Drafter):
    """OpenAI's predicted outputs: drafts from the request's predicted text. Before any output, the
    prediction's beginning; then what follows the output's last tokens in the prediction."""

    name = "prediction"
    cheap = True

    def __init__(self, n_min: int = 1, n_max: int = 8) -> None:
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, requests: Sequence, max_lens: Sequence[int]) -> list[Draft]:
        out = []
        for req, k in zip(requests, max_lens):
            spec = req.py_spec
            pred = spec.prediction
            if req.py_sampling_state.num_generated == 0 and spec.prediction_cursor == 0:
                tokens, start = pred[:k], 0
            else:
                tokens, start = ngram_match(
                    spec.history(req), pred, self.n_min, self.n_max, k, spec.prediction_cursor
                )
            if start >= 0:
                spec.prediction_cursor = start
            out.append(Draft(tokens.tolist()))
        return out

    def after_verify(self, request, num_drafted: int, num_accepted: int) -> None:
        spec = request.py_spec
        spec.prediction_cursor += num_accepted + 1  # the kept drafts and the model's own token


@dataclass
class SpecStats:
    """Counters of one iteration, and running totals (the Prometheus counters)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_requests_with_drafts: int = 0
    total_draft_tokens: int = 0
    total_accepted_tokens: int = 0
    total_drafting_steps: int = 0  # (request, step) pairs that carried drafts
    _logged: tuple[int, int, int] = (0, 0, 0)
    _last_log: float = field(default_factory=time.monotonic)

    def begin_step(self) -> None:
        self.num_draft_tokens = self.num_accepted_tokens = self.num_requests_with_drafts = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_requests_with_drafts += 1
        self.total_draft_tokens += drafted
        self.total_accepted_tokens += accepted
        self.total_drafting_steps += 1

    def entry(self) -> dict[str, int]:
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_requests_with_drafts": self.num_requests_with_drafts,
            "num_draft_tokens_total": self.total_draft_tokens,
            "num_accepted_tokens_total": self.total_accepted_tokens,
        }

    def maybe_log(self, force: bool = False) -> None:
        """Every ``LOG_EVERY_S`` while drafting: the mean acceptance length and rate since the last line."""
        now = time.monotonic()
        if not force and now - self._last_log < LOG_EVERY_S:
            return
        d0, a0, s0 = self._logged
        drafted = self.total_draft_tokens - d0
        accepted = self.total_accepted_tokens - a0
        steps = self.total_drafting_steps - s0
        self._last_log = now
        if steps == 0:
            return
        self._logged = (self.total_draft_tokens, self.total_accepted_tokens, self.total_drafting_steps)
        logger.info(
            "speculative decoding: mean acceptance length %.2f tokens per drafting step, acceptance rate "
            "%.1f%% (%d of %d draft tokens, %d drafting steps)",
            1 + accepted / steps,
            100 * accepted / max(drafted, 1),
            accepted,
            drafted,
            steps,
        )


class Speculator:
    """The executor's side of speculative decoding: plans, fills and verifies the drafts of each step.

    ``drafter``: the engine's drafter (None: only requests with a prediction draft); ``max_draft_len``:
    the most drafts one request carries in a step.
    """

    def __init__(
        self, drafter: Drafter | None, max_draft_len: int, cost: DraftCost = DRAFT_COSTS["cpu"]
    ) -> None:
        self.drafter = drafter
        self.max_draft_len = max_draft_len
        self.cost = MeasuredCost(cost)
        self._batch = 1  # generating requests this step (the cost model's batch)
        self.prediction = PredictionDrafter()
        self.stats = SpecStats()

    # ------------------------------------------------------------------ before the forward
    def _spec(self, req) -> SpecState:
        spec = getattr(req, "py_spec", None)
        if spec is None:
            spec = req.py_spec = SpecState(draft_len=self.max_draft_len)
        return spec

    def _drafter_of(self, req) -> Drafter | None:
        params = req.py_sampling_state.params
        if not params.speculative or params.use_beam_search:
            return None  # beam requests never draft
        if getattr(req, "py_prediction", None) is not None:
            return self.prediction
        return self.drafter

    def plan(self, active, max_seq_len: int, exclude: set[int] | frozenset[int] = frozenset()) -> None:
        """Placeholder drafts on the generating requests that draft this step (see the module doc)."""
        self.stats.begin_step()
        self._batch = sum(
            1
            for r in active
            if r.request_id not in exclude and r.is_generation_in_progress_state and not r.py_done
        )
        for req in active:
            if req.request_id in exclude:
                continue  # in a launched micro-batch: its drafts are verified when it lands
            k = 0
            if not req.py_done and req.is_generation_in_progress_state:
                k = self._budget(req, max_seq_len)
            if k:
                req.draft_tokens = [0] * k
            elif req.has_draft_tokens:
                req.draft_tokens = []

    def _budget(self, req, max_seq_len: int) -> int:
        drafter = self._drafter_of(req)
        if drafter is None:
            return 0
        spec = self._spec(req)
        if spec.prediction is None and getattr(req, "py_prediction", None) is not None:
            spec.prediction = np.asarray(req.py_prediction, dtype=np.int64)
            spec.draft_len = max(spec.draft_len, PREDICTION_MAX_DRAFT_LEN)
        # Positions num_tokens - 1 .. num_tokens - 1 + k are written: all below max_seq_len; and no
        # draft past the last token the request may still generate.
        remaining = req.py_max_new_tokens - req.py_num_output_tokens
        cap = max(0, min(spec.draft_len, max_seq_len - req.num_tokens, remaining - 1))
        if not drafter.cheap:  # a draft model: paused after drafts that did not pay
            if spec.skip > 0:
                spec.skip -= 1
                return 0
            return best_draft_len(spec.acceptance, cap, self.cost, self._batch)
        self._check_shadow(req, spec)
        k = best_draft_len(spec.acceptance, cap, self.cost, self._batch)
        if cap and not k:
            # Not worth a draft now: propose anyway (for free) and learn from what comes next.
            proposal = drafter.propose([req], [1])[0].tokens
            spec.shadow = (req.py_sampling_state.num_generated, proposal) if proposal else None
        return k

    @staticmethod
    def _check_shadow(req, spec: SpecState) -> None:
        """Scores last step's free proposal against the token the model produced instead."""
        if spec.shadow is None:
            return
        at, tokens = spec.shadow
        spec.shadow = None
        out = req.py_sampling_state.output_token_ids_array()
        if len(out) > at:
            spec.observe(int(out[at] == tokens[0]), 1)

    def fill(self, generation_requests: Sequence) -> None:
        """The drafters' tokens in place of the placeholders of the scheduled generation requests."""
        groups: dict[int, tuple[Drafter, list, list[int]]] = {}
        for req in generation_requests:
            k = req.num_draft_tokens
            if k == 0:
                continue
            drafter = self._drafter_of(req)
            if drafter is None:
                req.draft_tokens = []
                continue
            group = groups.setdefault(id(drafter), (drafter, [], []))
            group[1].append(req)
            group[2].append(k)
        for drafter, reqs, ks in groups.values():
            try:
                drafts = drafter.propose(reqs, ks)
            except Exception:  # drafts are optional: the step runs without them
                logger.exception("the %s drafter failed; this step decodes without drafts", drafter.name)
                drafts = [Draft([]) for _ in reqs]
                drafter.reset(reqs)
            for req, draft in zip(reqs, drafts):
                tokens = draft.tokens[: req.num_draft_tokens]
                req.draft_tokens = tokens
                req.py_spec.draft_probs = (
                    draft.probs[: len(tokens)] if draft.probs is not None and tokens else None
                )

    # ------------------------------------------------------------------ after the forward
    @staticmethod
    def row_states(inputs) -> list:
        """One sampling state per logits row: row j of a drafting request sees its first j drafts."""
        if inputs.num_rows is None:
            return [r.py_sampling_state for r in inputs.sampled_requests]
        states = []
        for req, n in zip(inputs.sampled_requests, inputs.num_rows):
            state = req.py_sampling_state
            if n == 1:
                states.append(state)
                continue
            drafts = req.draft_tokens
            states.append(state)
            plain = state.params.greedy and not state.params.has_penalties and not state.needs_min_tokens_mask
            for j in range(1, n):
                # A plain greedy row's token depends on its logits alone: no view needed.
                states.append(
                    state if plain and state.params.logprobs is None else state.extended(drafts[:j])
                )
        return states

    def verify(self, logits: torch.Tensor, inputs, output, sampler, states: Sequence) -> None:
        """Sets ``output.num_kept`` (tokens to append per sampled request) and, for sampled draft-model
        drafts, the rejection rule's tokens in ``output.token_ids``."""
        if inputs.num_rows is None:
            return
        tokens = output.token_ids.tolist()
        kept = []
        row = 0
        for req, n in zip(inputs.sampled_requests, inputs.num_rows):
            if n == 1:
                kept.append(1)
                row += 1
                continue
            drafts = req.draft_tokens
            spec = req.py_spec
            if spec.draft_probs is not None and not req.py_sampling_state.params.greedy:
                kept.append(self._reject(logits, row, n, drafts, spec, output, sampler, states, req))
            else:
                a = 0
                while a < n - 1 and tokens[row + a] == drafts[a]:
                    a += 1
                kept.append(a + 1)
            row += n
        output.num_kept = kept

    @staticmethod
    def _reject(logits, row, n, drafts, spec, output, sampler, states, req) -> int:
        """The standard rejection rule over one request's rows (a sampled draft model); returns how
        many tokens are kept and writes them to ``output.token_ids[row:]``."""
        rows = slice(row, row + n)
        processed = sampler.process_logits(logits[rows], states[rows])
        p = torch.softmax(processed.float(), dim=-1)
        q = spec.draft_probs.to(p.device, torch.float32)
        vocab = q.shape[1]
        p = p[:, :vocab]
        state = req.py_sampling_state
        # The request's own key: a seeded request decides the same way every run.
        gen = torch.Generator().manual_seed((state.rng_seed * 1_000_003 + state.num_generated) % 2**63)
        uniforms = torch.rand(n, generator=gen)
        out = output.token_ids
        kept = n
        for j in range(n - 1):
            d = drafts[j]
            pd, qd = float(p[j, d]), float(q[j, d])
            if qd > 0 and float(uniforms[j]) * qd <= pd:
                out[row + j] = d
                continue
            residual = (p[j] - q[j]).clamp_min_(0)
            total = float(residual.sum())
            dist = residual / total if total > 0 else p[j]
            out[row + j] = int(torch.multinomial(dist, 1, generator=gen))
            kept = j + 1
            break
        else:
            out[row + n - 1] = int(torch.multinomial(p[n - 1], 1, generator=gen))  # the bonus token
        for j in range(kept):
            Speculator._fix_logprob(output, logits, row + j)
        return kept

    @staticmethod
    def _fix_logprob(output, logits, row: int) -> None:
        if output.logprobs is not None:
            tok = int(output.token_ids[row])
            output.logprobs[row] = torch.log_softmax(logits[row].float(), dim=-1)[tok]

    def after_verify(self, req, num_drafted: int, num_accepted: int) -> None:
        """Stats and the adaptive draft length; the drafter catches up."""
        spec = req.py_spec
        spec.num_drafted += num_drafted
        spec.num_accepted += num_accepted
        spec.draft_probs = None
        self.stats.add(num_drafted, num_accepted)
        # One trial per draft position up to the first rejection.
        spec.observe(num_accepted, num_accepted + (num_accepted < num_drafted))
        drafter = self._drafter_of(req)
        if drafter is not None and not drafter.cheap:
            if best_draft_len(spec.acceptance, spec.draft_len, self.cost, self._batch) == 0:
                spec.skip = spec.backoff
                spec.backoff = min(spec.backoff * 2, MAX_BACKOFF_STEPS)
                spec.successes, spec.trials = PRIOR  # the probe after the pause starts afresh
            else:
                spec.backoff = 1
        if drafter is not None:
            drafter.after_verify(req, num_drafted, num_accepted)

    def observe_step(self, batch, seconds: float) -> None:
        """One iteration's time, for the measured cost: only a step of one generating request."""
        if len(batch.context_requests) or len(batch.generation_requests) != 1 or seconds <= 0:
            return
        self.cost.observe(batch.generation_requests[0].num_draft_tokens, seconds)

    def free(self, req) -> None:
        if self.drafter is not None:
            self.drafter.free(req)

    def shutdown(self) -> None:
        self.stats.maybe_log(force=True)
        if self.drafter is not None:
            self.drafter.shutdown()
