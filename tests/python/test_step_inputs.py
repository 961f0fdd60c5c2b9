"""The per-step host inputs, against plain loops: build_metadata's slots, cumulative lengths and block
tables (numpy arithmetic since they moved off torch ops), and the sampler's CPU argmax (numpy) against
torch.argmax on ties, NaN and infinities."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inflight.executor.model_engine import build_metadata
from inflight.executor.resource_manager import KVCacheResourceManager
from inflight.executor.sampler import argmax_rows


@pytest.mark.parametrize("lens", [[1], [1, 1, 1], [7, 1, 3], [33, 1]], ids=str)
def test_metadata_matches_a_plain_computation(lens):
    tpb = 4
    rm = KVCacheResourceManager.allocate(1, 1, 8, 40, tpb, 64, torch.float32, torch.device("cpu"), False)
    kv = rm.impl
    # Sequences of different lengths so that their block tables differ (fragmented by a removal).
    totals = [len(lens) * 2 + 5 * i + n for i, n in enumerate(lens)]
    kv.add_sequence(99, 9, 1, None)
    for rid, total in enumerate(totals):
        kv.add_sequence(rid, total, 1, None)
    kv.remove_sequence(99)
    positions, kv_lens, logits = [], [], []
    for total, n in zip(totals, lens):
        positions += list(range(total - n, total))
        kv_lens.append(total)
        logits.append(len(positions) - 1)
    tables = np.zeros((8, kv.max_blocks_per_seq), dtype=np.int32)
    ids = list(range(len(lens)))
    md = build_metadata(rm, ids, tables, positions, lens, kv_lens, logits, 1, torch.device("cpu"))
    want_slots = []
    for rid, total, n in zip(ids, totals, lens):
        blocks = kv.get_block_ids(rid)
        want_slots += [blocks[p // tpb] * tpb + p % tpb for p in range(total - n, total)]
    assert md.slot_mapping.tolist() == want_slots and md.slot_mapping.dtype == torch.int64
    assert md.cu_seqlens.tolist() == [0, *np.cumsum(lens).tolist()] and md.cu_seqlens.dtype == torch.int32
    assert md.seq_lens.tolist() == lens and md.kv_lens.tolist() == kv_lens
    assert md.positions.tolist() == positions and md.logits_indices.tolist() == logits
    for rid in ids:
        blocks = kv.get_block_ids(rid)
        assert md.block_tables[rid, : len(blocks)].tolist() == blocks
    # The step's tables are its own: the next step rewrites the shared host buffer.
    before = md.block_tables.clone()
    tables[:] = -7
    assert torch.equal(md.block_tables, before)
    for rid in ids:
        kv.remove_sequence(rid)
    kv.check_integrity()
    rm.shutdown()


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_cpu_argmax_is_torch_argmax(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 49152, generator=gen)
    x[0, 7] = x[0, 9000] = 1e4  # a tie: the first
    if rows > 1:
        x[1, 5], x[1, 50] = float("nan"), float("nan")  # NaN wins, the first
        x[2, :] = float("-inf")
        x[2, 11] = float("-inf")
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))
    # Not float32 or not contiguous: torch's own.
    assert torch.equal(argmax_rows(x.to(torch.bfloat16)), x.to(torch.bfloat16).argmax(dim=-1))
    assert torch.equal(argmax_rows(x[:, ::2]), x[:, ::2].argmax(dim=-1))
