"""The rank math of tensor and pipeline parallelism (Mapping) and the shard slicing rules without
processes, and the process groups on real gloo ranks (spawned processes on this machine)."""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inflight.parallel import Mapping, destroy_process_groups, init_process_groups
from inflight.parallel import distributed as distributed_module
from inflight.parallel.sharding import (
    AttentionShard,
    column_shard,
    head_rows,
    padded_vocab_size,
    row_range,
    row_shard,
    vocab_shard,
)

# ---------------------------------------------------------------------------------------- the math


def test_tp2_pp2_rank_math_and_groups():
    grid = [Mapping(world_size=4, rank=r, tp_size=2, pp_size=2) for r in range(4)]
    assert [(m.tp_rank, m.pp_rank) for m in grid] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [m.tp_group for m in grid] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [m.pp_group for m in grid] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert grid[0].tp_groups() == [(0, 1), (2, 3)] and grid[3].pp_groups() == [(0, 2), (1, 3)]
    assert [(m.prev_pp_rank, m.next_pp_rank) for m in grid] == [(None, 2), (None, 3), (0, None), (1, None)]
    assert [(m.is_first_pp_rank, m.is_last_pp_rank) for m in grid] == [(True, False)] * 2 + [
        (False, True)
    ] * 2


@pytest.mark.parametrize("tp,pp", [(1, 1), (4, 1), (1, 4), (2, 3), (3, 2), (4, 2)])
def test_groups_partition_the_ranks(tp, pp):
    m = Mapping(world_size=tp * pp, rank=0, tp_size=tp, pp_size=pp)
    for groups, size in ((m.tp_groups(), tp), (m.pp_groups(), pp)):
        assert sorted(r for g in groups for r in g) == list(range(tp * pp))
        assert all(len(g) == size for g in groups)
    for r in range(tp * pp):
        mr = m.for_rank(r)
        assert mr.rank in mr.tp_group and mr.rank in mr.pp_group
        assert set(mr.tp_group) & set(mr.pp_group) == {r}  # one shared rank: itself
        assert mr.tp_group[mr.tp_rank] == r and mr.pp_group[mr.pp_rank] == r


@pytest.mark.parametrize(
    "num_layers,pp,want",
    [(4, 1, [4]), (4, 2, [2, 2]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]), (8, 3, [3, 3, 2]), (3, 3, [1, 1, 1])],
)
def test_layer_split_is_even_first_stages_longer(num_layers, pp, want):
    ranges = [Mapping(world_size=pp, rank=p, pp_size=pp).layer_range(num_layers) for p in range(pp)]
    assert [len(r) for r in ranges] == want
    assert [i for r in ranges for i in r] == list(range(num_layers))  # contiguous, in order, no gaps


def test_mapping_errors_name_the_sizes():
    with pytest.raises(ValueError, match=r"world_size=4 must equal .* = 2 x 1 = 2"):
        Mapping(world_size=4, rank=0, tp_size=2, pp_size=1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        Mapping(world_size=2, rank=2, tp_size=2)
    with pytest.raises(ValueError, match=r"tp_size must be an int >= 1, got 0"):
        Mapping(world_size=1, tp_size=0)
    with pytest.raises(ValueError, match=r"pp_size must be an int >= 1, got True"):
        Mapping(pp_size=True)
    with pytest.raises(ValueError, match=r"num_hidden_layers=2 is fewer than pipeline_parallel_size=3"):
        Mapping(world_size=3, rank=0, pp_size=3).layer_range(2)


def test_a_single_process_never_touches_torch_distributed(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.distributed was called for tp = pp = 1")

    for name in ("init_process_group", "new_group", "is_initialized", "destroy_process_group"):
        monkeypatch.setattr(distributed_module.dist, name, refuse)
    groups = init_process_groups(Mapping())
    assert not groups.initialized and groups.tp is None and groups.control is None
    destroy_process_groups(groups)


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds > 0, got 0"):
        init_process_groups(Mapping(), timeout=0)


# ------------------------------------------------------------------------------ real gloo ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, tp: int, pp: int, url: str, results) -> None:
    torch.set_num_threads(1)
    groups = init_process_groups(
        Mapping(world_size=world, rank=rank, tp_size=tp, pp_size=pp), init_method=url, timeout=60
    )
    try:
        out = {}
        for name in ("tp", "pp", "control"):
            # Each rank contributes 2**rank: the sum names exactly the members of the group.
            x = torch.tensor([float(2**rank)])
            dist.all_reduce(x, group=getattr(groups, name))
            out[name] = int(x.item())
        results.put((rank, out))
    finally:
        destroy_process_groups(groups)


def test_groups_on_four_gloo_ranks():
    world, tp, pp = 4, 2, 2
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    url = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(
        _worker, args=(world, tp, pp, url, results), nprocs=world, join=True, start_method="spawn"
    )
    got = dict(results.get(timeout=30) for _ in range(world))
    for rank in range(world):
        m = Mapping(world_size=world, rank=rank, tp_size=tp, pp_size=pp)
        want = {
            "tp": sum(2**r for r in m.tp_group),
            "pp": sum(2**r for r in m.pp_group),
            "control": 2**world - 1,
        }
        assert got[rank] == want, (rank, got[rank], want)


def test_a_missing_rank_fails_within_the_timeout_and_a_later_engine_still_starts(tmp_path):
    """Rank 0 of 2 alone: joining must fail after the explicit timeout, not hang (torch's default
    would wait 30 minutes). The failed attempt leaves nothing behind: a tensor-parallel engine started
    next in this process still meets its freshly started ranks."""
    from model_utils import make_tiny_model

    from inflight import LLM, SamplingParams

    url = f"tcp://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0/2 .* failed within timeout=2 s"):
        init_process_groups(Mapping(world_size=2, rank=0, tp_size=2), init_method=url, timeout=2)
    assert time.monotonic() - t0 < 30
    assert not dist.is_initialized()
    path = make_tiny_model(tmp_path, with_tokenizer=False, num_attention_heads=4, num_key_value_heads=2)
    with LLM(str(path), dtype="float32", tensor_parallel_size=2, parallel_timeout=30) as llm:
        out = llm.generate([3, 4, 5], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4


# ------------------------------------------------------------------------ shard slicing, no processes


@pytest.mark.parametrize(
    "heads,kv,tp,want",
    [
        # (num_heads, num_kv_heads, q_start, kv_start) per rank
        (4, 2, 2, [(2, 1, 0, 0), (2, 1, 2, 1)]),
        (4, 1, 2, [(2, 1, 0, 0), (2, 1, 2, 0)]),  # one KV head, replicated on both ranks
        (8, 2, 4, [(2, 1, 0, 0), (2, 1, 2, 0), (2, 1, 4, 1), (2, 1, 6, 1)]),  # each KV head on 2 ranks
        (8, 8, 4, [(2, 2, 0, 0), (2, 2, 2, 2), (2, 2, 4, 4), (2, 2, 6, 6)]),
    ],
)
def test_attention_shards_split_heads_and_replicate_kv(heads, kv, tp, want):
    got = [AttentionShard.of(heads, kv, r, tp) for r in range(tp)]
    assert [(s.num_heads, s.num_kv_heads, s.q_start, s.kv_start) for s in got] == want
    for s in got:  # every query head still sees its own KV head (GQA grouping is kept)
        group = heads // kv
        kv_heads = range(s.kv_start, s.kv_start + s.num_kv_heads)
        assert all(q // group in kv_heads for q in range(s.q_start, s.q_start + s.num_heads))


def test_shard_errors_name_the_parameter_and_sizes():
    with pytest.raises(ValueError, match=r"num_attention_heads=9 is not divisible by tensor_parallel_size=2"):
        AttentionShard.of(9, 3, 0, 2)
    with pytest.raises(ValueError, match=r"num_key_value_heads=6 is not divisible by tensor_parallel_size=4"):
        AttentionShard.of(12, 6, 0, 4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 is not divisible by num_key_value_heads=3"):
        AttentionShard.of(12, 3, 0, 4)
    with pytest.raises(ValueError, match=r"intermediate_size=10 is not divisible by tensor_parallel_size=4"):
        column_shard(torch.zeros(10, 4), 0, 4, name="intermediate_size")
    with pytest.raises(
        ValueError, match=r"in_features=64 split over tensor_parallel_size=4 gives 16 .* groups of 32"
    ):
        row_range(64, 0, 4, group_size=32)


@pytest.mark.parametrize("vocab,tp", [(128, 2), (130, 2), (130, 4), (7, 3)])
def test_vocab_parallel_head_is_padded_and_gathers_to_the_full_logits(vocab, tp):
    g = torch.Generator().manual_seed(vocab * tp)
    w = torch.randn(vocab, 16, generator=g)
    x = torch.randn(3, 16, generator=g)
    padded = padded_vocab_size(vocab, tp)
    assert padded % tp == 0 and vocab <= padded < vocab + tp
    parts = [x @ vocab_shard(w, r, tp).T for r in range(tp)]
    logits = torch.cat(parts, dim=-1)  # the gather where sampling happens
    assert logits.shape == (3, padded)
    torch.testing.assert_close(logits[:, :vocab], x @ w.T)
    assert torch.all(logits[:, vocab:] == 0)  # padding rows are zero (the sampler never sees them)


def test_column_then_row_parallel_mlp_equals_the_unsharded_one():
    """gate/up column-parallel (each source sliced before the fusion), down row-parallel with its bias on
    rank 0 only: the sum of the ranks' partial outputs is the unsharded MLP (fp32)."""
    g = torch.Generator().manual_seed(0)
    hidden, inter, tp = 16, 24, 2
    gate, up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
    down, bias = torch.randn(hidden, inter, generator=g), torch.randn(hidden, generator=g)
    x = torch.randn(5, hidden, generator=g)

    def mlp(gate_w, up_w, down_w, down_b):
        fused = torch.cat([gate_w, up_w])  # the fused gate/up projection
        gu = x @ fused.T
        a, b = gu.split(gate_w.shape[0], dim=-1)
        out = (torch.nn.functional.silu(a) * b) @ down_w.T
        return out if down_b is None else out + down_b

    want = mlp(gate, up, down, bias)
    partial = [
        mlp(
            column_shard(gate, r, tp, name="intermediate_size"),
            column_shard(up, r, tp, name="intermediate_size"),
            row_shard(down, r, tp, name="intermediate_size"),
            bias if r == 0 else None,
        )
        for r in range(tp)
    ]
    torch.testing.assert_close(sum(partial), want)  # the all-reduce
    # Slicing the fused tensor instead of each source would mix gate and up rows on rank 0:
    wrong = column_shard(torch.cat([gate, up]), 0, tp)
    assert not torch.equal(wrong, torch.cat([column_shard(gate, 0, tp), column_shard(up, 0, tp)]))


def test_attention_projections_shard_by_heads():
    """q/k/v sliced by the rank's heads (KV replicated with 1 KV head), o_proj row-parallel: the ranks'
    partial outputs sum to the unsharded attention output (here with a fixed per-head mixing)."""
    g = torch.Generator().manual_seed(1)
    hidden, heads, kv, head_dim, tp = 16, 4, 1, 4, 2
    q_w = torch.randn(heads * head_dim, hidden, generator=g)
    v_w = torch.randn(kv * head_dim, hidden, generator=g)
    o_w = torch.randn(hidden, heads * head_dim, generator=g)
    x = torch.randn(3, hidden, generator=g)

    def attend(q_w, v_w, o_w, n_heads, n_kv):
        # A stand-in for attention that keeps the head structure: each query head takes its group's V.
        q = (x @ q_w.T).view(3, n_heads, head_dim)
        v = (x @ v_w.T).view(3, n_kv, head_dim).repeat_interleave(n_heads // n_kv, dim=1)
        return (torch.tanh(q) * v).reshape(3, -1) @ o_w.T

    want = attend(q_w, v_w, o_w, heads, kv)
    total = 0
    for r in range(tp):
        s = AttentionShard.of(heads, kv, r, tp)
        lo, hi = s.q_start * head_dim, (s.q_start + s.num_heads) * head_dim
        total = total + attend(
            head_rows(q_w, s.q_start, s.num_heads, head_dim),
            head_rows(v_w, s.kv_start, s.num_kv_heads, head_dim),
            o_w[:, lo:hi],
            s.num_heads,
            s.num_kv_heads,
        )
    torch.testing.assert_close(total, want)
