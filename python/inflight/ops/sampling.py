"""Fused CPU sampling: temperature, top-k, top-p, min-p and one counter-based draw per row.

Row ``i``'s token depends only on its logits, its parameters and its RNG key
``(seeds[i], steps[i])``: the uniform it draws with is a pure function of the key (splitmix64,
:func:`sampling_uniform`), and the row is reduced in fixed blocks whatever the thread count or the
batch around it. Masks as :func:`inflight.ops.reference.sampling.apply_temperature_top_k_top_p_min_p`; the
draw is an inverse CDF in token-id order. The plain-torch twin is
:func:`inflight.ops.reference.sampling.sample`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from inflight import _C

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

ColumnLike = torch.Tensor | np.ndarray | Sequence[float] | Sequence[int]


def _column(name: str, value: ColumnLike, dtype: np.dtype, rows: int) -> np.ndarray:
    # numpy views cross into C++ several times faster than torch tensors (buffer protocol, not
    # DLPack), which matters at a few microseconds per sampling step.
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {value.device}")
        t = value.detach()
        value = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    a = np.ascontiguousarray(value, dtype=dtype)
    if a.ndim != 1 or a.shape[0] != rows:
        raise ValueError(f"{name} must be a [{rows}] array (one entry per logits row), got shape {a.shape}")
    return a


def _seeds(value: ColumnLike, rows: int) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"seeds must be on the CPU, got {value.device}")
        value = value.detach().numpy()
    a = np.asarray(value)
    if a.dtype == np.int64:
        a = a.view(np.uint64)  # the same 64 bits: a seed is a key, not a number
    return _column("seeds", a, np.uint64, rows)


def sample(
    logits: torch.Tensor,
    temperature: ColumnLike,
    top_k: ColumnLike,
    top_p: ColumnLike,
    min_p: ColumnLike,
    seeds: ColumnLike,
    steps: ColumnLike,
    out: torch.Tensor | None = None,
    *,
    num_threads: int | None = None,
) -> torch.Tensor:
    """One token per row of ``logits`` ``[N, V]`` (float32; bfloat16 / float16 read as is).

    Per-row ``[N]`` parameters: ``temperature`` (0: greedy, the argmax, first index on ties),
    ``top_k`` (0: all), ``top_p`` in (0, 1] (1: all), ``min_p`` in [0, 1] (0: all), ``seeds``
    (uint64, or int64 taken as its bits) and ``steps`` (int64 >= 0). ``out``: an int64 ``[N]``
    tensor to write into, or None. ``num_threads`` defaults to ``torch.get_num_threads()``.
    Returns ``out``.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D tensor [N, V], got {getattr(logits, 'shape', type(logits))}")
    if logits.device.type != "cpu":
        raise ValueError(f"logits must be on the CPU, got {logits.device}")
    rows, vocab = logits.shape
    if vocab < 1:
        raise ValueError("logits must have at least one column, got 0")
    if rows == 0:
        return out if out is not None else torch.empty(0, dtype=torch.int64)
    if logits.dtype not in _LOGIT_DTYPES:
        logits = logits.float()
    if vocab > 1 and logits.stride(1) != 1:
        logits = logits.contiguous()
    if rows > 1 and logits.stride(0) < 0:
        logits = logits.contiguous()
    if out is None:
        out = torch.empty(rows, dtype=torch.int64)
    elif (
        out.dtype != torch.int64
        or out.shape != (rows,)
        or not out.is_contiguous()
        or out.device.type != "cpu"
    ):
        raise ValueError(
            f"out must be a contiguous int64 CPU tensor of shape ({rows},), "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    _C.sample(
        logits.detach().numpy() if logits.dtype == torch.float32 else logits.detach(),
        _column("temperature", temperature, np.float32, rows),
        _column("top_k", top_k, np.int32, rows),
        _column("top_p", top_p, np.float32, rows),
        _column("min_p", min_p, np.float32, rows),
        _seeds(seeds, rows),
        _column("steps", steps, np.int64, rows),
        out.numpy(),
        torch.get_num_threads() if num_threads is None else int(num_threads),
    )
    return out


def sampling_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) that :func:`sample` draws with for the key ``(seed, step)``."""
    return _C.sampling_uniform(seed, step)


__all__ = ["sample", "sampling_uniform"]
