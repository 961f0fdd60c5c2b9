"""What draft tokens cost, and how many pay: the cost model behind speculative decoding's draft length.

A request with an estimate ``a`` of the chance that a draft token is accepted drafts the ``k`` that
maximises ``a + a^2 + ... + a^k`` (the expected accepted tokens) less the cost of the longer row, in
the request's decode steps (:func:`best_draft_len`). :class:`DraftCost` is the static model per device
(:data:`DRAFT_COSTS`); :class:`MeasuredCost` replaces it by the engine's own iteration times for a
request running alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftCost:
    """What ``k`` draft tokens of one request cost, in that request's decode steps.

    Alone (a batch of one): ``first`` for going from one token to two (the one-row kernels give way to
    the batched ones), ``per_token`` for each token after that, and ``first`` once more past ``tile``
    tokens (the CPU kernels' register tile of x rows: a second tile dequantises every weight again).
    In a batch of ``b`` decodes a step takes about ``1 + batch_row * (b - 1)`` one-token steps, a draft
    row adds ``batch_draft`` of one, and it delays every request of the batch: each draft token costs
    ``batch_draft * b / (1 + batch_row * (b - 1))`` of a request's share of the step."""

    first: float
    per_token: float
    tile: int | None = None
    batch_row: float = 0.0
    batch_draft: float = 0.0

    def of(self, k: int, batch: int = 1) -> float:
        if k == 0:
            return 0.0
        if batch > 1:
            return k * self.batch_draft * batch / (1 + self.batch_row * (batch - 1))
        extra = self.first if self.tile is not None and 1 + k > self.tile else 0.0
        return self.first + self.per_token * (k - 1) + extra


# Measured on SmolLM2-135M (4-bit weights, fp32 activations), Xeon with AVX-512, 2 threads: a 2-token
# row costs 1.5x a decode step, each further token ~0.15x more, 9 tokens well over 3x; 8 decodes take
# ~3.7 one-token steps, and a draft row in such a batch ~0.25 of one. On a GPU a small-batch decode is
# bound by reading the weights: extra rows are nearly free.
DRAFT_COSTS = {
    "cpu": DraftCost(0.5, 0.15, tile=8, batch_row=0.39, batch_draft=0.25),
    "cuda": DraftCost(0.05, 0.02, batch_row=0.02, batch_draft=0.02),
}


class MeasuredCost:
    """:class:`DraftCost` corrected by what this engine measures: the iteration time of steps with a
    single generating request (and no context), by its number of drafts. Once a draft length and the
    plain decode both have ``MIN_SAMPLES`` steps, that length's cost alone is their measured ratio
    (less one); the rest (other lengths, batches) keeps the static model. So the choice follows the
    CPU it runs on; outputs never depend on it."""

    MIN_SAMPLES = 4
    EMA = 0.1  # weight of a new sample

    def __init__(self, static: DraftCost) -> None:
        self.static = static
        self._times: dict[int, float] = {}
        self._counts: dict[int, int] = {}

    def observe(self, k: int, seconds: float) -> None:
        n = self._counts.get(k, 0)
        old = self._times.get(k, seconds)
        # A plain mean for the first samples, then an exponential moving average.
        w = 1.0 / (n + 1) if n < 1 / self.EMA else self.EMA
        self._times[k] = old + w * (seconds - old)
        self._counts[k] = n + 1

    def measured(self, k: int) -> float | None:
        if min(self._counts.get(k, 0), self._counts.get(0, 0)) < self.MIN_SAMPLES:
            return None
        return max(self._times[k] / self._times[0] - 1.0, 0.0)

    def of(self, k: int, batch: int = 1) -> float:
        if k and batch == 1:
            m = self.measured(k)
            if m is not None:
                return m
        return self.static.of(k, batch)


def best_draft_len(acceptance: float, cap: int, cost: DraftCost | MeasuredCost, batch: int = 1) -> int:
    """The k in [0, cap] of the largest expected gain ``sum_j acceptance^j - cost.of(k, batch)`` (0:
    none), for a request among ``batch`` decodes."""
    best_k, best, gain, p = 0, 0.0, 0.0, 1.0
    for k in range(1, cap + 1):
        p *= acceptance
        gain += p
        value = gain - cost.of(k, batch)
        if value > best:
            best_k, best = k, value
    return best_k
