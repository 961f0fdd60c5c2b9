"""The CPU kernels' thread pool (csrc/kernels/cpu/thread_pool.h) under concurrent callers and fork.

Kernels from several Python threads at once share one pool: the first caller gets the workers, the
others run their work inline. Results must not depend on which happened.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch
from torch.utils.dlpack import to_dlpack

from inflight import _C
from inflight.ops.gemm import W4A16Weight, dense_gemm
from inflight.quantization.w4a16 import quantize_w4


def _weights():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=gen)
    x = torch.randn(16, 576, generator=gen)
    qweight, scales, offsets = quantize_w4(w, 32, False, torch.float16)
    return w, x, W4A16Weight(qweight, scales, offsets, 32)


@pytest.mark.parametrize("invariant", [True, False])
def test_concurrent_callers_get_the_same_results(invariant):
    w, x, packed = _weights()
    torch.set_num_threads(2)
    before = _C.batch_invariant()
    _C.set_batch_invariant(invariant)
    if invariant:
        # Batch-invariant kernels (the default): every row count's result is the first rows of the
        # 16-row result, whichever caller got the workers.
        full_q, full_d = packed(x).clone(), dense_gemm(x, w).clone()
        want_q = {rows: full_q[:rows] for rows in range(1, 17)}
        want_d = {rows: full_d[:rows] for rows in range(1, 17)}
    else:
        # The previous strategies depend on the row count (1 row streams the weights through W4Dot,
        # 2+ rows take the batched tiles): one caller's result per row count, before any concurrency.
        want_q = {rows: packed(x[:rows]).clone() for rows in range(1, 17)}
        want_d = {rows: dense_gemm(x[:rows], w).clone() for rows in range(1, 17)}
    errors: list[str] = []

    def worker(k: int) -> None:
        for i in range(200):
            rows = 1 + (i + k) % 16
            if not torch.equal(packed(x[:rows]), want_q[rows]):
                errors.append(f"thread {k} iteration {i}: w4a16 differs")
            if not torch.equal(dense_gemm(x[:rows], w), want_d[rows]):
                errors.append(f"thread {k} iteration {i}: dense differs")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    _C.set_batch_invariant(before)
    assert not any(t.is_alive() for t in threads), "a kernel call hung"
    assert errors == []


def _child(queue, want) -> None:
    # torch's own OpenMP pool is not fork-safe: keep torch single-threaded here and ask the kernel for
    # two threads directly, so only inflight's pool is exercised.
    torch.set_num_threads(1)
    _w, x, packed = _weights()
    out = torch.empty(16, 1536)
    packed._w.gemm(to_dlpack(x), to_dlpack(out), 2)
    queue.put(bool(torch.equal(out, want)))


def test_forked_child_can_run_kernels():
    _w, x, packed = _weights()
    torch.set_num_threads(2)
    want = packed(x)  # the parent's pool has started its workers
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, want))
    proc.start()
    proc.join(timeout=120)
    if proc.is_alive():
        proc.kill()
        raise AssertionError("the forked child hung in a kernel call")
    assert proc.exitcode == 0
    assert queue.get(timeout=5) is True
