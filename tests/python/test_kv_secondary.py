"""The KV cache manager's secondary level and swap: the C++ manager against its twin.

Random traces of KV operations (sequences with requests, so that prompts are looked up and stored;
tokens, drafts, rewinds, forks, suspends, resumes, removals) run on both managers with the same
arguments; after every operation both must report the same result (or error, type and message),
block ids, levels, token counts, free counts, stats, transfers and copies, and pass
check_integrity. The scheduler-level lockstep of test_twins.py is also run with a secondary pool.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import numpy as np
import pytest
import test_twins
from hypothesis import given, settings
from hypothesis import strategies as st

import inflight.batch_manager as bm
from inflight.batch_manager import KvTransferKind, LlmRequest, LlmRequestState
from inflight.batch_manager import reference as ref

SECONDARY_STAT_NAMES = (
    "max_num_secondary_blocks",
    "free_num_secondary_blocks",
    "used_num_secondary_blocks",
    "reusable_num_secondary_blocks",
    "offloaded_blocks",
    "onboarded_blocks",
    "secondary_reused_blocks",
    "secondary_hit_rate",
)
ALL_STAT_NAMES = test_twins.STAT_NAMES + SECONDARY_STAT_NAMES


def _op_trace(seed: int, steps: int = 500) -> list[tuple]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3) for _ in range(rng.randint(2, 6))] for _ in range(3)]
    ops: list[tuple] = []
    live: list[int] = []
    next_id = 0
    for _ in range(steps):
        roll = rng.random()
        if not live or roll < 0.2:
            prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randint(1, 4))]
            ops.append(("add", next_id, prompt, rng.choice([0, 10, 35, 35, 50, 90])))
            live.append(next_id)
            next_id += 1
        elif roll < 0.32:
            ops.append(("add_token", rng.choice(live)))
        elif roll < 0.4:
            ops.append(("add_tokens", rng.choice(live), rng.randint(0, 4)))
        elif roll < 0.44:
            ops.append(("rewind", rng.choice(live), rng.randint(0, 3)))
        elif roll < 0.48:
            src = rng.choice(live)
            ops.append(("fork", next_id, src))
            live.append(next_id)
            next_id += 1
        elif roll < 0.6:
            ops.append(("suspend", rng.choice(live + [10**6])))  # sometimes an unknown id
        elif roll < 0.74:
            ops.append(("resume", rng.choice(live)))
        elif roll < 0.77:
            ops.append(("copy_block_tables", rng.choice(live)))
        else:
            rid = rng.choice(live)
            live.remove(rid)
            ops.append(("remove", rid, rng.random() < 0.8))
    return ops


def _export(kv) -> tuple[list, ...]:
    """export_secondary_blocks() as lists (the C++ returns NumPy arrays, as the twin does)."""
    return tuple(np.asarray(a).tolist() for a in kv.export_secondary_blocks())


def _run(module, ops: list[tuple], num_blocks: int, num_secondary: int, min_priority: int, kv=None) -> list:
    if kv is None:
        kv = module.KVCacheManager(num_blocks, 2, 24, True, num_secondary, min_priority)
    requests: dict[int, LlmRequest] = {}
    seen = []
    for op in ops:
        kind, rid = op[0], op[1]
        try:
            if kind == "add":
                req = LlmRequest(rid, 8, op[2], kv_retention_priority=op[3])
                requests[rid] = req
                kv.add_sequence(rid, len(op[2]), 1, req)
                req.move_to_next_context_chunk()
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                kv.store_context_blocks(req)
            elif kind == "add_token":
                kv.add_token(rid)
            elif kind == "add_tokens":
                kv.add_tokens(rid, op[2])
            elif kind == "rewind":
                kv.rewind(rid, op[2])
            elif kind == "fork":
                kv.fork_sequence(op[2], rid)
            elif kind == "suspend":
                kv.suspend_sequence(rid)
            elif kind == "resume":
                kv.resume_sequence(rid)
            elif kind == "copy_block_tables":
                kv.copy_block_tables([rid], np.zeros((1, kv.max_blocks_per_seq), np.int32))
            else:
                kv.remove_sequence(rid, requests.get(rid) if op[2] else None)
            result = "ok"
        except (ValueError, RuntimeError) as exc:
            result = f"{type(exc).__name__}: {exc}"
        kv.check_integrity()
        stats = kv.get_kv_cache_stats()
        ids = kv.get_block_ids(rid) if kv.has_sequence(rid) else None
        seen.append(
            (
                op,
                result,
                ids,
                [kv.get_block_level(b) for b in ids] if ids is not None else None,
                kv.get_num_tokens(rid) if kv.has_sequence(rid) else None,
                kv.is_suspended(rid),
                kv.get_needed_blocks_to_resume(rid) if kv.has_sequence(rid) else None,
                kv.get_needed_secondary_blocks_to_suspend(rid) if kv.has_sequence(rid) else None,
                kv.num_free_blocks,
                kv.num_free_secondary_blocks,
                kv.num_used_secondary_blocks,
                kv.num_suspended_sequences,
                {name: getattr(stats, name) for name in ALL_STAT_NAMES},
                kv.take_transfers(),
                kv.take_block_copies(),
                _export(kv),
            )
        )
    return seen


CONFIGS = [  # (num_blocks, num_secondary_blocks, secondary_offload_min_priority)
    (16, 0, 30),
    (16, 2, 30),
    (16, 6, 30),
    (12, 16, 0),
    (20, 8, 50),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seed", range(4))
def test_secondary_traces_agree(config: tuple[int, int, int], seed: int) -> None:
    """Every decision of the two-level manager (ids, levels, transfers, errors, stats) is the same in
    C++ and in the twin, operation by operation."""
    ops = _op_trace(seed)
    cpp, twin = _run(bm, ops, *config), _run(ref, ops, *config)
    for a, b in zip(cpp, twin, strict=True):
        assert a == b, f"C++ {a}\n!= twin {b}"


def test_the_traces_exercise_every_path() -> None:
    """Across the traces above: offloads on eviction, onboards of prefix hits, suspends and resumes
    (and failures of both), copy-on-writes, suspended sequences rejecting other calls, and non-empty
    exports of the secondary level."""
    kinds: dict[str, int] = {}
    for config in CONFIGS[1:]:
        for seed in range(4):
            for row in _run(bm, _op_trace(seed), *config):
                op, result, transfers, copies, exported = row[0], row[1], row[-3], row[-2], row[-1]
                for kind, src, dst in transfers:
                    key = "offload" if kind == KvTransferKind.OFFLOAD else "onboard"
                    kinds[key] = kinds.get(key, 0) + 1
                    assert (src < config[0]) == (kind == KvTransferKind.OFFLOAD)
                    assert (dst < config[0]) == (kind == KvTransferKind.ONBOARD)
                label = op[0] + ("" if result == "ok" else ":" + result.split(":")[0])
                kinds[label] = kinds.get(label, 0) + 1
                if "is suspended" in result:
                    kinds["rejected_suspended"] = kinds.get("rejected_suspended", 0) + 1
                if copies:
                    kinds["copy"] = kinds.get("copy", 0) + 1
                if exported[0]:
                    kinds["exported"] = kinds.get("exported", 0) + 1
                kinds["secondary_hits"] = max(
                    kinds.get("secondary_hits", 0), row[-4]["secondary_reused_blocks"]
                )
    keys = (
        "offload",
        "onboard",
        "suspend",
        "resume",
        "copy",
        "rejected_suspended",
        "secondary_hits",
        "exported",
    )
    for key in keys:
        assert kinds.get(key, 0) >= 5, (key, kinds)
    assert kinds.get("resume:RuntimeError", 0) + kinds.get("suspend:RuntimeError", 0) >= 5, kinds


def test_zero_secondary_blocks_is_the_one_level_manager() -> None:
    """num_secondary_blocks=0 gives, operation by operation, what the four-argument manager gives,
    and never a transfer."""
    ops = [op for op in _op_trace(7) if op[0] not in ("suspend", "resume")]
    for module in (bm, ref):
        two_level = _run(module, ops, 10, 0, 30)
        assert two_level == _run(_one_level(module), ops, 10, 0, 30)
        assert all(row[-3] == [] and row[-1] == ([], [], [], []) for row in two_level)


def _one_level(module):
    """A stand-in module whose KVCacheManager is built as before the secondary level existed."""
    original = module.KVCacheManager

    class OneLevel:
        @staticmethod
        def KVCacheManager(num_blocks, tokens_per_block, max_seq_len, reuse, *_):
            return original(num_blocks, tokens_per_block, max_seq_len, reuse)

    return OneLevel


def test_transfer_order_is_executable() -> None:
    """Replaying the transfers in order on a model of the block contents reproduces, for every live
    sequence, the contents it was given (C++ and twin alike)."""
    for module in (bm, ref):
        for seed in range(3):
            rng = random.Random(seed)
            kv = module.KVCacheManager(9, 2, 24, True, 5, 0)
            memory: dict[int, tuple[int, int]] = {}  # block -> (request, block index) it holds
            tokens_of: dict[int, tuple[int, ...]] = {}
            live: list[int] = []
            for step in range(400):
                roll = rng.random()
                if not live or roll < 0.35:
                    rid = step
                    prompt = [1, 2, 3, 4][: rng.randint(1, 4)]
                    prompt += [rng.randrange(2) for _ in range(rng.randint(1, 5))]
                    req = LlmRequest(rid, 8, prompt)
                    try:
                        kv.add_sequence(rid, len(prompt), 1, req)
                    except RuntimeError:
                        continue
                    req.move_to_next_context_chunk()
                    req.state = LlmRequestState.GENERATION_IN_PROGRESS
                    kv.store_context_blocks(req)
                    hits = req.prepopulated_prompt_len // 2
                    _execute(kv, memory)
                    tokens_of[rid] = tuple(prompt)
                    for i, block in enumerate(kv.get_block_ids(rid)):
                        if i >= hits:
                            memory[block] = (rid, i)
                    live.append(rid)
                elif roll < 0.6:
                    rid = rng.choice(live)
                    try:
                        (kv.resume_sequence if kv.is_suspended(rid) else kv.suspend_sequence)(rid)
                    except RuntimeError:
                        pass
                    _execute(kv, memory)
                else:
                    rid = rng.choice(live)
                    live.remove(rid)
                    kv.remove_sequence(rid)
                kv.check_integrity()
                for rid in live:
                    for i, block in enumerate(kv.get_block_ids(rid)):
                        owner, index = memory[block]
                        assert index == i
                        # A hit block was written by a request with the same prefix.
                        end = 2 * (i + 1)
                        assert owner == rid or tokens_of[owner][:end] == tokens_of[rid][:end]


def _execute(kv, memory: dict[int, tuple[int, int]]) -> None:
    for _kind, src, dst in kv.take_transfers():
        memory[dst] = memory[src]
    assert kv.take_block_copies() == []


def test_twin_secondary_errors_match() -> None:
    for module in (bm, ref):
        with pytest.raises(ValueError, match=r"num_secondary_blocks must be in \[0, "):
            module.KVCacheManager(4, 2, 16, True, -1)
        with pytest.raises(
            ValueError, match=r"secondary_offload_min_priority must be in \[0, 100\], got 101"
        ):
            module.KVCacheManager(4, 2, 16, True, 1, 101)
        kv = module.KVCacheManager(4, 2, 16, True, 2)
        with pytest.raises(ValueError, match=r"get_block_level: block_id must be in \[0, 5\]"):
            kv.get_block_level(6)
        for call in ("suspend_sequence", "resume_sequence", "get_needed_blocks_to_resume"):
            with pytest.raises(ValueError, match=rf"{call}: request_id 3 is not in the KV cache manager"):
                getattr(kv, call)(3)
        kv.add_sequence(1, 5)
        with pytest.raises(RuntimeError, match=r"need 3, free 2"):
            kv.suspend_sequence(1)
        with pytest.raises(ValueError, match=r"resume_sequence: request_id 1 is not suspended"):
            kv.resume_sequence(1)
        assert kv.is_suspended(1) is False and kv.is_suspended(99) is False
        assert module.KVCacheManager(4, 2, 16).secondary_offload_min_priority == 30


# ---- the scheduler-level lockstep of test_twins.py, with a secondary pool ------------------------


@settings(max_examples=15, **test_twins.TRACE_SETTINGS)
@given(
    config=test_twins.trace_configs, num_secondary=st.integers(1, 16), min_priority=st.sampled_from([0, 30])
)
def test_lockstep_traces_with_a_secondary_pool(config, num_secondary: int, min_priority: int) -> None:
    """The executor-loop traces of test_twins (reuse forced on), every KV manager built with a
    secondary pool: C++ and twins agree step by step, the new stats included."""
    config = dataclasses.replace(config, enable_block_reuse=True)
    with pytest.MonkeyPatch.context() as mp:
        for table, module in ((test_twins.CPP, bm), (test_twins.TWIN, ref)):
            mp.setitem(
                table,
                "kv",
                functools.partial(
                    module.KVCacheManager,
                    num_secondary_blocks=num_secondary,
                    secondary_offload_min_priority=min_priority,
                ),
            )
        mp.setattr(test_twins, "STAT_NAMES", ALL_STAT_NAMES)
        test_twins.run_lockstep(test_twins.build_trace(config), test_twins.COMPOSITIONS["all_twins"])


def test_bound_secondary_api() -> None:
    """The bound surface: defaults, read-only properties, the transfer tuples and the stats dict."""
    kv = bm.KVCacheManager(4, 2, 16, enable_block_reuse=True, num_secondary_blocks=2)
    assert (kv.num_secondary_blocks, kv.num_free_secondary_blocks, kv.num_used_secondary_blocks) == (2, 2, 0)
    assert kv.secondary_offload_min_priority == bm.DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY == 30
    assert (kv.get_block_level(3), kv.get_block_level(4)) == (bm.PRIMARY_LEVEL, bm.SECONDARY_LEVEL)
    with pytest.raises(AttributeError):
        kv.num_secondary_blocks = 3
    assert bm.KVCacheManager(4, 2, 16).num_secondary_blocks == 0
    kv.add_sequence(1, 4)
    kv.suspend_sequence(1)
    assert kv.take_transfers() == [(KvTransferKind.OFFLOAD, 0, 4), (KvTransferKind.OFFLOAD, 1, 5)]
    assert kv.take_transfers() == []
    stats = kv.get_kv_cache_stats().to_dict()
    assert {name: stats[name] for name in SECONDARY_STAT_NAMES} == {
        "max_num_secondary_blocks": 2,
        "free_num_secondary_blocks": 0,
        "used_num_secondary_blocks": 2,
        "reusable_num_secondary_blocks": 0,
        "offloaded_blocks": 2,
        "onboarded_blocks": 0,
        "secondary_reused_blocks": 0,
        "secondary_hit_rate": 0.0,
    }
    assert "offloaded_blocks=2" in repr(kv.get_kv_cache_stats())
    kv.add_sequence(2, 1)
    with pytest.raises(RuntimeError, match=r"suspend_sequence: not enough free secondary KV blocks"):
        kv.suspend_sequence(2)


# ---- persistence: export_secondary_blocks / import_secondary_blocks ------------------------------


def _drain(kv, ops: list[tuple]) -> None:
    """Removes every sequence the trace left (as an engine's shutdown does)."""
    for rid in {op[1] for op in ops}:
        if kv.has_sequence(rid):
            kv.remove_sequence(rid)
    kv.take_transfers()
    kv.take_block_copies()


@pytest.mark.parametrize("config", CONFIGS[1:])
@pytest.mark.parametrize("seed", range(3))
def test_export_import_agree_and_the_adopted_managers_run_alike(
    config: tuple[int, int, int], seed: int
) -> None:
    """A trace, then its export adopted by fresh managers (a restart): C++ and twin export the same
    list (the per-step exports are compared in test_secondary_traces_agree), the adopted managers pass
    check_integrity, export it again unchanged, and then run a second trace with the same decisions,
    prefix hits on the adopted blocks included."""
    num_blocks, num_secondary, min_priority = config
    ops = _op_trace(seed, 300)
    exports, adopted, flushed = [], [], []
    for module in (bm, ref):
        kv = module.KVCacheManager(num_blocks, 2, 24, True, num_secondary, min_priority)
        _run(module, ops, *config, kv=kv)
        _drain(kv, ops)
        flushed.append((kv.offload_reusable_blocks(), kv.take_transfers()))
        kv.check_integrity()
        exports.append(_export(kv))
        fresh = module.KVCacheManager(num_blocks, 2, 24, True, num_secondary, min_priority)
        block_ids, parents, priorities, tokens = (
            np.asarray(a, np.int32) for a in kv.export_secondary_blocks()
        )
        fresh.import_secondary_blocks(block_ids, parents, priorities, tokens.reshape(len(block_ids), 2))
        fresh.check_integrity()
        assert _export(fresh) == exports[-1]
        adopted.append(fresh)
    assert flushed[0] == flushed[1]
    assert exports[0] == exports[1]
    assert len(exports[0][0]) > 0, "the trace left nothing in the secondary level to export"
    # The second trace continues the id space, so its requests never collide with the first's.
    second = [
        (op[0], op[1] + 10_000, *op[2:]) if op[0] != "fork" else (op[0], op[1] + 10_000, op[2] + 10_000)
        for op in _op_trace(seed + 100, 300)
    ]
    cpp = _run(bm, second, *config, kv=adopted[0])
    twin = _run(ref, second, *config, kv=adopted[1])
    for a, b in zip(cpp, twin, strict=True):
        assert a == b, f"C++ {a}\n!= twin {b}"
    assert adopted[0].get_kv_cache_stats().secondary_reused_blocks > 0 or num_secondary < 6


IMPORT_ERRORS = [  # (edit of the good list, message fragment)
    (lambda b: b[1].pop(), "parents has 2 entries and priorities 3; both must have block_ids' 3"),
    (lambda b: b[3].pop(), r"tokens has 4 entries, expected 6 \(block_ids' 3 x tokens_per_block 2\)"),
    (
        lambda b: b[3].__setitem__(slice(None), [[5, 6, 0], [3, 4, 0], [1, 2, 0]]),
        r"tokens must have tokens_per_block 2 columns, got 3$",
    ),
    (
        lambda b: b[0].__setitem__(1, 3),
        r"block_ids\[1\] = 3 is not a secondary block id \(must be in \[4, 9\]\)",
    ),
    (lambda b: b[0].__setitem__(2, 4), r"block_ids\[2\] = 4 is listed twice \(also block_ids\[0\]\)"),
    (lambda b: b[2].__setitem__(0, -1), r"priorities\[0\] must be in \[0, 100\], got -1"),
    (lambda b: b[1].__setitem__(0, 9), r"parents\[0\] = 9 is not a listed block"),
    (lambda b: b[1].__setitem__(2, 4), r"block_ids\[0\] = 4: its chain of parents has a cycle"),
    (
        lambda b: (b[1].__setitem__(1, -1), b[3].__setitem__(1, [1, 2])),
        r"block_ids\[1\] = 5 and block_ids\[2\] = 6 hold the same key",
    ),
]


@pytest.mark.parametrize("edit,message", IMPORT_ERRORS)
def test_twin_import_errors_match(edit, message: str) -> None:
    """Each malformed import is the same ValueError in C++ and the twin, and changes nothing: the
    manager then adopts the good list."""
    for module in (bm, ref):
        kv = module.KVCacheManager(4, 2, 16, True, 6)
        lists = [[4, 5, 6], [5, 6, -1], [35, 35, 35], [[5, 6], [3, 4], [1, 2]]]
        edit(lists)
        arrays = [np.asarray(a, np.int32) for a in lists[:3]]
        tokens = np.asarray(lists[3], np.int32)
        with pytest.raises(ValueError, match=message):
            kv.import_secondary_blocks(*arrays, tokens)
        kv.check_integrity()
        assert _export(kv) == ([], [], [], [])
        kv.import_secondary_blocks(
            np.asarray([4, 5, 6], np.int32),
            np.asarray([5, 6, -1], np.int32),
            np.asarray([35, 35, 35], np.int32),
            np.asarray([[5, 6], [3, 4], [1, 2]], np.int32),
        )
        kv.check_integrity()
        assert _export(kv) == ([4, 5, 6], [5, 6, -1], [35, 35, 35], [[5, 6], [3, 4], [1, 2]])
        with pytest.raises(ValueError, match=r"the manager is not fresh \(0 sequences, 3 cached blocks"):
            kv.import_secondary_blocks(
                *(np.asarray(a, np.int32) for a in ([4], [-1], [35])), np.zeros((1, 2), np.int32)
            )
        with pytest.raises(ValueError, match=r"block reuse is disabled"):
            module.KVCacheManager(4, 2, 16, False, 6).import_secondary_blocks(
                *(np.asarray(a, np.int32) for a in ([4], [-1], [35])), np.zeros((1, 2), np.int32)
            )


def test_adopted_prefix_is_onboarded_in_both() -> None:
    """After an import, a prompt that starts with the adopted prefix onboards its blocks (root first)."""
    for module in (bm, ref):
        kv = module.KVCacheManager(4, 2, 16, True, 6)
        kv.import_secondary_blocks(
            np.asarray([4, 5, 6], np.int32),
            np.asarray([5, 6, -1], np.int32),
            np.asarray([35, 35, 35], np.int32),
            np.asarray([[5, 6], [3, 4], [1, 2]], np.int32),
        )
        req = LlmRequest(1, 4, [1, 2, 3, 4, 5, 6, 7, 8])
        kv.add_sequence(1, 8, 1, req)
        assert req.prepopulated_prompt_len == 6
        assert kv.take_transfers() == [
            (KvTransferKind.ONBOARD, 6, 0),
            (KvTransferKind.ONBOARD, 5, 1),
            (KvTransferKind.ONBOARD, 4, 2),
        ]
        assert kv.get_kv_cache_stats().secondary_reused_blocks == 3
        kv.check_integrity()
