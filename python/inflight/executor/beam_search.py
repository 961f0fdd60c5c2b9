"""Beam search for one request, with the rules of transformers' ``generate(num_beams=K, do_sample=False)``.

Each step takes the logits of the request's K running beams (one row at the first step: the
prompt's last position, standing for K identical beams of which only the first counts) and:

1. log-softmax (after the temperature, when one is set), then the processors: ``min_tokens`` masks the
   stop ids, ``repetition_penalty`` scales the log-probabilities of every token in the beam's prompt
   and output (multiplied when negative, divided otherwise — transformers applies it there);
2. adds each beam's running score and keeps the top ``max(2, 1 + number of stop ids) * K``
   candidates over all beams x vocabulary;
3. a candidate that ends in a stop id (EOS unless ``ignore_eos``, or a ``stop_token_ids`` entry) or
   reaches the length limit is finished: it can join the K finished hypotheses, scored
   ``sum(logprobs) / generated_length ** length_penalty``, only when ranked within the first K
   candidates, and only while the early-stop heuristic still allows an improvement;
4. the K best unfinished candidates are the next running beams;
5. the search ends when no running beam can still improve the finished set (``early_stopping``
   False / ``"never"``), when K hypotheses finished (True), or when every candidate finished.

The arithmetic (float32 tensors, the 1e9 penalties, ``torch.topk`` on the same shapes) follows
transformers step for step, so the kept beams and their scores are the same for the same logits.

The executor keeps one KV sequence per running beam (:meth:`KVCacheResourceManager.reorder_beams`):
after a step, beam i's sequence is a fork of its parent's, which shares every block and copies only
a partly filled last block on its next write (copy-on-write in the C++ KV manager).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.sampling_params import SAMPLING_EPS, SamplingParams

# transformers' stand-in for minus infinity in beam scores.
_NEG = -1.0e9


@dataclass
class BeamHypothesis:
    """A returned beam: its generated tokens (a final stop token included), the log-probability of each
    under the processed distribution (when asked), their sum and the length-penalised score."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    logprobs: list[dict[int, float]] | None
    finish_reason: str  # "stop" (ended on a stop id) | "length"
    stop_reason: int | None = None  # the stop_token_ids entry that ended it


class BeamSearch:
    """One request's beam state (``ExecutorRequest.py_beam``).

    ``seq_ids`` are the KV sequences of the running beams, beam 0 first: the request's own id (so
    the capacity planner sees the blocks its beams hold), then ids from ``new_seq_id``.
    """

    def __init__(
        self,
        params: SamplingParams,
        request_id: int,
        prompt_token_ids: list[int],
        eos_token_ids: tuple[int, ...],
        max_new_tokens: int,
        max_seq_len: int,
    ):
        self.params = params
        self.width = params.beam_width
        self.num_return = params.n
        self.prompt = list(prompt_token_ids)
        self.eos_token_ids = tuple(eos_token_ids)
        self.stop_ids = tuple(
            dict.fromkeys(params.stop_token_ids + (() if params.ignore_eos else eos_token_ids))
        )
        # transformers keeps (1 + number of EOS ids) x K candidates, at least 2K.
        self.num_candidates = max(2, 1 + len(self.stop_ids)) * self.width
        self.max_new = max(1, min(max_new_tokens, max_seq_len - len(self.prompt)))
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.num_logprobs = params.logprobs
        k = self.width
        self.running: list[list[int]] = [[] for _ in range(k)]
        self.running_logprobs: list[list[dict[int, float]]] = [[] for _ in range(k)]
        self.running_scores = torch.zeros((1, k), dtype=torch.float32)
        self.running_scores[:, 1:] = _NEG
        self.finished: list[BeamHypothesis | None] = [None] * k
        self.finished_scores = torch.full((1, k), _NEG, dtype=torch.float32)
        self.is_finished = torch.zeros((1, k), dtype=torch.bool)
        self.heuristic_unsatisfied = torch.ones((1, 1), dtype=torch.bool)
        self.top_mask = torch.cat(
            (torch.ones(k, dtype=torch.bool), torch.zeros(self.num_candidates - k, dtype=torch.bool))
        )
        self.num_generated = 0
        self.done = False
        self.seq_ids: list[int] = [request_id]
        # Parents of the new running beams after a step (indices into the previous ones), for the KV.
        self.parents: list[int] = []

    def restarted(self) -> BeamSearch:
        """A fresh search of the same request from its prompt (the executor's last resort when its KV
        has to go: ``PyExecutor._restart_beams``)."""
        return BeamSearch(
            self.params,
            self.seq_ids[0],
            self.prompt,
            self.eos_token_ids,
            self.max_new,
            len(self.prompt) + self.max_new,
        )

    @property
    def last_tokens(self) -> list[int]:
        """The input token of each running beam's next row."""
        return [beam[-1] for beam in self.running]

    @property
    def best_token(self) -> int:
        return self.running[0][-1]

    # ------------------------------------------------------------------ one step
    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        logits = logits.to(torch.float32)
        if p.temperature >= SAMPLING_EPS and p.temperature != 1.0:
            logits = logits / p.temperature
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
        if p.repetition_penalty != 1.0:
            rows = []
            for b in range(log_probs.shape[0]):
                ids = torch.tensor(self.prompt + self.running[b], dtype=torch.int64).view(1, -1)
                row = log_probs[b : b + 1]
                score = torch.gather(row, 1, ids)
                score = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
                rows.append(row.scatter(1, ids, score))
            log_probs = torch.cat(rows)
        if self.num_generated < p.min_tokens:
            masked = list(p.stop_token_ids + (() if p.ignore_eos else self.eos_token_ids))
            if masked:
                log_probs[:, masked] = -float("inf")
        return log_probs

    def step(self, logits: torch.Tensor) -> None:
        """Advances the search by one token with the running beams' logits (``[K, V]``, or ``[1, V]``
        at the first step); sets ``parents`` and ``done``."""
        k = self.width
        if logits.shape[0] == 1 and k > 1:
            logits = logits.expand(k, -1)  # the first step: K copies of the prompt
        if logits.shape[0] != k:
            raise ValueError(f"beam search: expected {k} logits rows, got {logits.shape[0]}")
        vocab = logits.shape[-1]
        log_probs = self._log_probs(logits)
        accumulated = (log_probs + self.running_scores.view(k, 1)).reshape(1, -1)
        top_lp, top_idx = torch.topk(accumulated, k=self.num_candidates)
        parent = (top_idx // vocab)[0].tolist()
        token = (top_idx % vocab)[0].tolist()
        length_hit = self.num_generated + 1 >= self.max_new
        hits = torch.tensor([[length_hit or t in self.stop_ids for t in token]], dtype=torch.bool)

        entries = None
        if self.num_logprobs is not None:
            entries = self._entries(log_probs, parent, token)

        def candidate(c: int) -> tuple[list[int], list[dict[int, float]]]:
            b = parent[c]
            lps = self.running_logprobs[b] + [entries[c]] if entries is not None else []
            return self.running[b] + [token[c]], lps

        # The running beams of the next step: the best candidates that did not finish.
        running_lp = top_lp + hits.to(torch.float32) * _NEG
        nxt = torch.topk(running_lp, k=k)[1][0].tolist()

        # The finished set: merged with the candidates that just finished within the first K.
        did_finish = hits & self.top_mask[None, :]
        gen_len = self.num_generated + 1
        fin_lp = top_lp / (gen_len**self.length_penalty)
        full = torch.all(self.is_finished, dim=-1, keepdim=True) & (self.early_stopping is True)
        fin_lp += full.to(torch.float32) * _NEG
        fin_lp += (~self.heuristic_unsatisfied).to(torch.float32) * _NEG
        fin_lp += (~did_finish) * _NEG
        merged_scores = torch.cat((self.finished_scores, fin_lp), dim=1)
        merged_finished = torch.cat((self.is_finished, did_finish), dim=1)
        keep = torch.topk(merged_scores, k=k)[1][0].tolist()
        new_finished: list[BeamHypothesis | None] = []
        for m in keep:
            if m < k:
                new_finished.append(self.finished[m])
                continue
            c = m - k
            if not bool(did_finish[0, c]):
                new_finished.append(None)  # an empty slot (its score stays ~ -1e9)
                continue
            ids, lps = candidate(c)
            last = ids[-1]
            stopped = last in self.stop_ids
            new_finished.append(
                BeamHypothesis(
                    ids,
                    float(top_lp[0, c]),
                    float(fin_lp[0, c]),
                    lps if entries is not None else None,
                    "stop" if stopped else "length",
                    last if stopped and last in self.params.stop_token_ids else None,
                )
            )
        keep_t = torch.tensor([keep])
        self.finished_scores = torch.gather(merged_scores, 1, keep_t)
        self.is_finished = torch.gather(merged_finished, 1, keep_t)
        self.finished = new_finished

        self.parents = [parent[c] for c in nxt]
        new_running = [candidate(c) for c in nxt]
        self.running = [ids for ids, _ in new_running]
        self.running_logprobs = [lps for _, lps in new_running]
        self.running_scores = torch.gather(running_lp, 1, torch.tensor([nxt]))
        self.num_generated += 1

        # Can a running beam still beat the worst finished one?
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_new
        else:
            best_len = self.num_generated
        best_possible = self.running_scores[:, :1] / (best_len**self.length_penalty)
        worst = torch.where(self.is_finished, torch.min(self.finished_scores, dim=1, keepdim=True)[0], _NEG)
        self.heuristic_unsatisfied = self.heuristic_unsatisfied & torch.any(
            best_possible > worst, dim=-1, keepdim=True
        )
        improvement_possible = bool(torch.any(self.heuristic_unsatisfied))
        open_beam = not (bool(torch.all(self.is_finished)) and self.early_stopping is True)
        continuations = not bool(torch.all(hits))
        self.done = not (improvement_possible and open_beam and continuations)

    def _entries(
        self, log_probs: torch.Tensor, parent: list[int], token: list[int]
    ) -> list[dict[int, float]]:
        """Each candidate's logprobs entry: its token, then the top ``logprobs`` of its beam's row."""
        n = self.num_logprobs
        top = torch.topk(log_probs, k=n, dim=-1) if n else None
        out = []
        for b, t in zip(parent, token):
            entry = {t: float(log_probs[b, t])}
            if top is not None:
                for v, i in zip(top.values[b].tolist(), top.indices[b].tolist()):
                    entry.setdefault(i, v)
            out.append(entry)
        return out

    # ------------------------------------------------------------------ results
    def results(self) -> list[BeamHypothesis]:
        """The ``n`` best beams, best first: the finished hypotheses, then (a search cut short, e.g.
        cancelled) the running beams by their running score."""
        out = [h for h in self.finished if h is not None]
        if len(out) < self.num_return and self.num_generated:
            scores = self.running_scores[0].tolist()
            for b in range(self.width):
                if len(out) >= self.num_return or scores[b] <= _NEG / 2:
                    break
                n = len(self.running[b])
                out.append(
                    BeamHypothesis(
                        list(self.running[b]),
                        scores[b],
                        scores[b] / (n**self.length_penalty),
                        list(self.running_logprobs[b]) if self.num_logprobs is not None else None,
                        "length",
                    )
                )
        return out[: self.num_return]
