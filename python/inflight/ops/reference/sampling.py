"""Plain-torch twin of :func:`inflight.ops.sampling.sample`.

The masks are :func:`apply_temperature_top_k_top_p_min_p` (a stable sort of the whole row), which the
executor's sampler also uses on devices without the fused kernel; the draw is an inverse CDF, in token-id order and float64, over
``exp(x - max)`` of the kept tokens, at ``u * total`` with the same uniform ``u`` as the kernel
(splitmix64 of the key ``(seed, step)``, here in numpy). For the same key the twin and the kernel
pick the same token, except where ``u`` lands within float rounding of a CDF or mask boundary.
"""

from __future__ import annotations

import numpy as np
import torch

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (wrapping arithmetic), as csrc/kernels/cpu/sampling.h."""
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z + _GAMMA
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def sampling_uniform(seeds: np.ndarray | torch.Tensor, steps: np.ndarray | torch.Tensor) -> np.ndarray:
    """float64 uniforms in [0, 1): the top 53 bits of ``splitmix64(splitmix64(seed) ^ step)``."""
    seeds = _as_uint64(seeds)
    steps = _as_uint64(steps)
    h = splitmix64(splitmix64(seeds) ^ steps)
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _as_uint64(v: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu()
        v = v.view(torch.uint64) if v.dtype == torch.int64 else v.to(torch.uint64)
        return v.numpy().reshape(-1)
    a = np.asarray(v)
    return a.view(np.uint64).reshape(-1) if a.dtype == np.int64 else a.astype(np.uint64).reshape(-1)


def apply_temperature_top_k_top_p_min_p(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (-inf), batched with per-row ``[N]`` tensors.

    ``top_k`` 0 keeps all tokens; ``top_p`` 1 and ``min_p`` 0 are no-ops (pass None when no row
    uses a filter, to skip its sort or softmax). Rows must not be greedy (temperature > 0).
    Among equal logits the lower token id ranks first (a stable sort), as ``torch.argmax``.
    """
    x = logits / temperature.to(logits.dtype).unsqueeze(1)
    vocab = x.shape[1]
    if top_k is not None or top_p is not None:
        vals, order = x.sort(dim=-1, descending=True, stable=True)
        drop = torch.zeros_like(vals, dtype=torch.bool)
        if top_k is not None:
            k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp_max(vocab)
            drop |= torch.arange(vocab, device=x.device).unsqueeze(0) >= k.unsqueeze(1)
            vals = vals.masked_fill(drop, float("-inf"))
        if top_p is not None:
            probs = torch.softmax(vals, dim=-1)
            # Mass strictly before each token: it is kept while that is short of top_p, so the first
            # (most likely) token always stays. top_p == 1 keeps everything even when rounding
            # makes the cumulative sum reach 1 early.
            cum = probs.cumsum(dim=-1)
            before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
            p = top_p.to(vals.dtype).unsqueeze(1)
            drop |= (before >= p) & (p < 1.0)
            vals = vals.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, vals)
    if min_p is not None:
        probs = torch.softmax(x, dim=-1)
        # Relative to the largest probability, so it does not matter that top-k/top-p above did
        # not renormalize: the ratio p_i / p_max is the same before and after.
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.dtype).unsqueeze(1)
        x = x.masked_fill(probs < threshold, float("-inf"))
    return x


def kept_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """float32 ``logits / T`` with -inf where the filters drop a token (rows must not be greedy)."""
    return apply_temperature_top_k_top_p_min_p(
        logits.float(),
        temperature=torch.as_tensor(temperature, dtype=torch.float32),
        top_k=torch.as_tensor(top_k, dtype=torch.int32),
        top_p=torch.as_tensor(top_p, dtype=torch.float32),
        min_p=torch.as_tensor(min_p, dtype=torch.float32),
    )


def inverse_cdf(x: torch.Tensor, u: np.ndarray) -> torch.Tensor:
    """Per row of ``x`` (-inf: dropped), the first id whose cumulative ``exp(x - max)`` exceeds ``u`` of the total."""
    x64 = x.double()
    e = torch.exp(x64 - x64.amax(dim=-1, keepdim=True))
    cdf = e.cumsum(dim=-1)
    target = torch.from_numpy(np.asarray(u, dtype=np.float64)).unsqueeze(1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total can round up to the total: the last kept token.
    positions = torch.arange(x.shape[1]).expand_as(e)
    last = torch.where(e > 0, positions, torch.zeros_like(positions)).amax(dim=-1)
    return torch.minimum(tokens, last)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same interface and semantics as :func:`inflight.ops.sampling.sample`."""
    x = logits.float()
    rows = x.shape[0]
    temperature = torch.as_tensor(temperature, dtype=torch.float32).reshape(rows)
    l_max = x.amax(dim=-1) if x.shape[1] else torch.zeros(rows)
    # Greedy as in the kernel: T <= 0, or no finite maximum / x = l / T overflowing.
    greedy = (temperature <= 0) | ~torch.isfinite(l_max)
    greedy |= ~torch.isfinite(l_max / temperature) | ~torch.isfinite(l_max * (1.0 / temperature))
    tokens = x.argmax(dim=-1)
    rows_s = torch.nonzero(~greedy).flatten()
    if rows_s.numel():
        kept = kept_logits(
            x[rows_s],
            temperature[rows_s],
            torch.as_tensor(top_k, dtype=torch.int32).reshape(rows)[rows_s],
            torch.as_tensor(top_p, dtype=torch.float32).reshape(rows)[rows_s],
            torch.as_tensor(min_p, dtype=torch.float32).reshape(rows)[rows_s],
        )
        idx = rows_s.numpy()
        u = sampling_uniform(_as_uint64(seeds)[idx], _as_uint64(steps)[idx])
        tokens[rows_s] = inverse_cdf(kept, u)
    if out is None:
        return tokens
    out.copy_(tokens)
    return out


__all__ = [
    "apply_temperature_top_k_top_p_min_p",
    "inverse_cdf",
    "kept_logits",
    "sample",
    "sampling_uniform",
    "splitmix64",
]
