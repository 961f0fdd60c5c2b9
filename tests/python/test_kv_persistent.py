"""A KV prefix cache that survives an engine restart (KvCacheConfig.host_cache_path, docs/batch-manager.md
§3.10), on tiny random Llamas: an engine serves a 1,000-token prefix, evicts it into the disk tier and
shuts down; a new engine on the same file adopts the tier, and its first request with that prefix onboards
the blocks, prefills only the tail and gives the tokens of a fresh engine without a tier (fp32 and int8 KV).
A file that does not belong (truncated, a flipped byte, bad magic, another model with weights of the same
shape, another block size, KV dtype or tier size) is refused with a warning naming why and rebuilt, the
output still right. The file format is tested on the resource manager alone: exact bytes adopted, a block
written after the last save dropped with the blocks below it, the periodic save. The accounting
(export / import) is tested in test_kv_secondary.py (C++ and twin) and tests/cpp/test_kv_cache_persist.cpp.
"""

from __future__ import annotations

import json
import logging
import os
import random

import numpy as np
import pytest
import torch
from llm_utils import assert_kv_idle, greedy

from inflight.batch_manager import LlmRequest, LlmRequestState
from inflight.executor import kv_secondary_pool, resource_manager
from inflight.executor.kv_secondary_pool import MAGIC, header_bytes
from inflight.executor.py_executor_creator import checkpoint_files, model_identity, weights_digest
from inflight.executor.resource_manager import KVCacheResourceManager
from inflight.executor.scheduler import ScheduledRequests
from inflight.llm_args import KvCacheConfig

PREFIX_TPB = 32
POOL_TOKENS = 1280  # 40 blocks: the 1,000-token prefix (31 full blocks) and one other prompt at most
TIER_BLOCKS = 100
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    from model_utils import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("long"), "llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def foreign_model(tmp_path_factory):
    """The same architecture and shapes (and directory name) as long_model, other weights."""
    from model_utils import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("foreign"), "llama", seed=1, max_position_embeddings=2048)


def _block_bytes(model_dir, dtype: str, tpb: int = PREFIX_TPB) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_head = head_dim + 4 if dtype == "int8" else 4 * head_dim  # int8: codes + one fp32 scale
    return tpb * 2 * cfg["num_hidden_layers"] * heads * per_head


def _prompts() -> list[list[int]]:
    """A 1,000-token prefix with a suffix, two unrelated 1,000-token prompts that evict it from the
    primary pool, and the prefix again with another suffix (the request after the restart)."""
    rng = random.Random(11)

    def rand(n: int) -> list[int]:
        return [rng.randrange(3, 384) for _ in range(n)]

    prefix = rand(1000)
    return [prefix + rand(3), rand(1000), rand(1000), prefix + rand(4)]


def _kv_config(model_dir, path, dtype="auto", tpb=PREFIX_TPB, tier_blocks=TIER_BLOCKS, **kw) -> KvCacheConfig:
    block = _block_bytes(model_dir, dtype, tpb)
    if path is None:
        return KvCacheConfig(
            tokens_per_block=tpb, max_tokens=kw.pop("max_tokens", POOL_TOKENS), dtype=dtype, **kw
        )
    return KvCacheConfig(
        tokens_per_block=tpb,
        max_tokens=kw.pop("max_tokens", POOL_TOKENS),
        dtype=dtype,
        host_cache_size=tier_blocks * block + block // 2,  # a part block is not counted
        host_cache_path=str(path),
        **kw,
    )


def _serve(llm, prompts):
    """One prompt at a time: (tokens per prompt, context tokens scheduled per prompt)."""
    outs = [llm.generate([p], greedy(NEW_TOKENS), use_tqdm=False)[0] for p in prompts]
    chunks = {e["id"]: sum(n for _, n in e["chunks"]) for e in llm.executor.timelines.snapshot()}
    return [o.outputs[0].token_ids for o in outs], [chunks[o.request_id] for o in outs]


def _stats(llm) -> dict:
    return llm.executor.kv_cache_manager.get_kv_cache_stats()


def _first_engine(make_llm, model_dir, path, dtype="auto", **kw):
    """Engine 1: the prefix, then two prompts that evict it into the tier; shut down (the index saved)."""
    llm = make_llm(model=model_dir, kv_cache_config=_kv_config(model_dir, path, dtype, **kw))
    _, prefilled = _serve(llm, _prompts()[:3])
    assert prefilled == [len(p) for p in _prompts()[:3]]
    stats = _stats(llm)
    assert stats["offloaded_blocks"] >= 31 and stats["reusable_num_secondary_blocks"] >= 31, stats
    llm.shutdown()
    with open(path, "rb") as f:
        assert f.read(len(MAGIC)) == MAGIC
    return stats


def _reference(make_llm, model_dir, dtype="auto"):
    """The last prompt in a fresh engine without a tier (recomputed) and, for int8 KV, after its prefix
    in the same engine with a pool big enough to keep it (a primary-pool hit: the KV bytes reused)."""
    prompts = _prompts()
    fresh = make_llm(model=model_dir, kv_cache_config=_kv_config(model_dir, None, dtype, max_tokens=4096))
    recomputed, prefilled = _serve(fresh, [prompts[3]])
    assert prefilled == [len(prompts[3])]
    kept, _ = _serve(fresh, [prompts[0], prompts[3]])
    fresh.shutdown()
    return recomputed[0], kept[1]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_restarted_engine_adopts_the_tier(make_llm, long_model, tmp_path, caplog, kv_dtype):
    path = tmp_path / "kv-tier.bin"
    recomputed, kept = _reference(make_llm, long_model, kv_dtype)
    _first_engine(make_llm, long_model, path, kv_dtype)

    with caplog.at_level(logging.INFO, logger="inflight"):
        llm = make_llm(model=long_model, kv_cache_config=_kv_config(long_model, path, kv_dtype))
    adopted = [r.getMessage() for r in caplog.records if "adopted" in r.getMessage()]
    assert len(adopted) == 1 and "cached blocks" in adopted[0], adopted
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "KV tier" in r.getMessage()]
    before = _stats(llm)
    assert before["reusable_num_secondary_blocks"] >= 31 and before["onboarded_blocks"] == 0, before

    prompt = _prompts()[3]
    toks, prefilled = _serve(llm, [prompt])
    # The first request after the restart: its 31 prefix blocks come from the disk tier.
    assert prefilled == [len(prompt) - 31 * PREFIX_TPB]
    after = _stats(llm)
    assert after["secondary_reused_blocks"] == 31 and after["onboarded_blocks"] == 31, after
    assert toks[0] == kept
    if kv_dtype == "auto":  # fp32 KV: also what recomputing the prefix gives
        assert toks[0] == recomputed
    assert_kv_idle(llm)
    llm.shutdown()

    # And again: the second engine saved its tier too, so a third engine adopts it.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="inflight"):
        third = make_llm(model=long_model, kv_cache_config=_kv_config(long_model, path, kv_dtype))
    assert any("adopted" in r.getMessage() for r in caplog.records)
    toks3, prefilled3 = _serve(third, [prompt])
    assert toks3[0] == kept
    # The prefix was in the second engine's primary pool at its shutdown (onboarded there): the
    # shutdown moved it into the tier, so the third engine serves it from the file again.
    assert prefilled3 == [len(prompt) - 31 * PREFIX_TPB]


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _meta_len(path) -> int:
    with open(path, "rb") as f:
        fixed = f.read(48)
    return int.from_bytes(fixed[24:32], "little")


CORRUPTIONS = {
    # name: (edit of the file, the second engine's config changes, the warning's fragment)
    "truncated": (lambda p: os.truncate(p, os.path.getsize(p) - 4096), {}, "truncated"),
    "bad_magic": (lambda p: _flip(p, 3), {}, "bad magic"),
    "flipped_index_byte": (lambda p: _flip(p, 80 + _meta_len(p) + 7), {}, "checksum mismatch"),
    "flipped_meta_byte": (lambda p: _flip(p, 90), {}, "checksum mismatch"),
    "block_size": (None, {"tpb": 16}, "another layout (file_bytes"),
    "kv_dtype": (None, {"dtype": "int8"}, "another layout ("),
    "tier_size": (None, {"tier_blocks": TIER_BLOCKS - 10}, "num_blocks: file 100, this engine 90"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_a_file_that_does_not_belong_is_rebuilt(make_llm, long_model, tmp_path, caplog, case):
    edit, changes, fragment = CORRUPTIONS[case]
    path = tmp_path / "kv-tier.bin"
    _first_engine(make_llm, long_model, path)
    if edit is not None:
        edit(path)
    dtype = changes.get("dtype", "auto")
    recomputed, kept = _reference(make_llm, long_model, dtype)
    config = _kv_config(
        long_model, path, dtype, changes.get("tpb", PREFIX_TPB), changes.get("tier_blocks", TIER_BLOCKS)
    )
    with caplog.at_level(logging.INFO, logger="inflight"):
        llm = make_llm(model=long_model, kv_cache_config=config)
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "not adopted" in r.getMessage()
    ]
    assert len(warnings) == 1 and fragment in warnings[0], warnings
    assert not any(
        "adopted" in r.getMessage() and "not adopted" not in r.getMessage() for r in caplog.records
    )
    assert _stats(llm)["reusable_num_secondary_blocks"] == 0
    assert os.path.getsize(path) == llm.executor.kv_cache_manager.secondary.nbytes  # rebuilt to this layout
    prompt = _prompts()[3]
    toks, prefilled = _serve(llm, [prompt])
    assert prefilled == [len(prompt)]  # nothing adopted: recomputed
    assert toks[0] == (recomputed if dtype == "auto" else kept)
    # Rebuilt: the next engine of this configuration adopts what this one cached (the prefix was
    # evicted by nothing, so it is served from the primary pool's copy or the tier).
    _serve(llm, _prompts()[1:3])  # evict the prefix into the tier
    llm.shutdown()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="inflight"):
        again = make_llm(model=long_model, kv_cache_config=config)
    assert any("adopted" in r.getMessage() and "not adopted" not in r.getMessage() for r in caplog.records)
    assert _stats(again)["reusable_num_secondary_blocks"] > 0


def test_int8_keys_of_another_rotation_are_refused(make_llm, long_model, tmp_path, caplog, monkeypatch):
    """An INT8 tier written without key rotation (``INFLIGHT_KV_KEY_ROTATION=0``) holds codes of
    unrotated keys: an engine that rotates does not adopt them (nor the reverse), and names why."""
    path = tmp_path / "kv-tier.bin"
    monkeypatch.setenv("INFLIGHT_KV_KEY_ROTATION", "0")
    _first_engine(make_llm, long_model, path, "int8")
    monkeypatch.setenv("INFLIGHT_KV_KEY_ROTATION", "1")
    with caplog.at_level(logging.INFO, logger="inflight"):
        llm = make_llm(model=long_model, kv_cache_config=_kv_config(long_model, path, "int8"))
    warnings = [r.getMessage() for r in caplog.records if "not adopted" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "another layout (kv_encoding: file {'int8_key_rotation': 'off'}, this engine " in warnings[0]
    assert "'hadamard-v1'" in warnings[0], warnings
    assert _stats(llm)["reusable_num_secondary_blocks"] == 0


def test_a_foreign_model_of_the_same_shape_is_refused(make_llm, long_model, foreign_model, tmp_path, caplog):
    """Another checkpoint with weights of the same shapes, in a directory of the same name: the weights'
    digest tells them apart, and the foreign engine recomputes (its own tokens, not the prefix's KV of
    the first model)."""
    assert long_model.name == foreign_model.name
    path = tmp_path / "kv-tier.bin"
    _first_engine(make_llm, long_model, path)
    recomputed, _ = _reference(make_llm, foreign_model)
    with caplog.at_level(logging.INFO, logger="inflight"):
        llm = make_llm(model=foreign_model, kv_cache_config=_kv_config(foreign_model, path))
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "not adopted" in r.getMessage()
    ]
    assert len(warnings) == 1 and "another model (weights_sha256: file" in warnings[0], warnings
    toks, prefilled = _serve(llm, [_prompts()[3]])
    assert prefilled == [len(_prompts()[3])]
    assert toks[0] == recomputed


def test_a_flipped_block_byte_drops_that_block_and_those_below(make_llm, long_model, tmp_path, caplog):
    """A byte of one cached block's KV changed after the save: the header is intact, so the tier is
    adopted, but that block's digest fails: it and every block chained below it are dropped (warned),
    the blocks above it are still served, and the output is the recomputed one."""
    path = tmp_path / "kv-tier.bin"
    _first_engine(make_llm, long_model, path)
    recomputed, _ = _reference(make_llm, long_model)
    # The prefix's 11th block: found through the index (slot, parent, priority, digest, tokens arrays).
    with open(path, "rb") as f:
        fixed = f.read(48)
    meta_len = int.from_bytes(fixed[24:32], "little")
    entries = int.from_bytes(fixed[32:40], "little")
    with open(path, "rb") as f:
        f.seek(80 + meta_len)
        raw = f.read(entries * (44 + 4 * PREFIX_TPB))
    slots = np.frombuffer(raw[: 4 * entries], np.int32)
    parents = np.frombuffer(raw[4 * entries : 8 * entries], np.int32)
    tokens = np.frombuffer(raw[(44) * entries :], np.int32).reshape(entries, PREFIX_TPB)
    prefix = _prompts()[3]
    by_slot = {int(s): i for i, s in enumerate(slots)}
    # Walk the prefix's chain from its first block.
    chain, parent = [], -1
    for b in range(31):
        want = prefix[b * PREFIX_TPB : (b + 1) * PREFIX_TPB]
        match = [i for i in range(entries) if parents[i] == parent and tokens[i].tolist() == want]
        assert len(match) == 1, (b, match)
        chain.append(int(slots[match[0]]))
        parent = chain[-1]
    assert len(by_slot) == entries
    first_tensor = header_bytes(TIER_BLOCKS, PREFIX_TPB)
    _flip(path, first_tensor + chain[10] * _block_bytes(long_model, "auto") + 123)

    with caplog.at_level(logging.INFO, logger="inflight"):
        llm = make_llm(model=long_model, kv_cache_config=_kv_config(long_model, path))
    dropped = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "dropped" in r.getMessage()
    ]
    assert len(dropped) == 1 and "21 of" in dropped[0], dropped  # block 10 and the 20 below it
    toks, prefilled = _serve(llm, [prefix])
    assert prefilled == [len(prefix) - 10 * PREFIX_TPB]  # the 10 blocks above the flipped one
    assert toks[0] == recomputed


# ---- the file format on the resource manager alone ---------------------------------------------------

IDENTITY = {"model": "unit", "weights_sha256": "0" * 64}


def _manager(path, identity=IDENTITY, num_secondary=6, dtype=torch.float32):
    return KVCacheResourceManager.allocate(
        2, 2, 4, 4, 4, 64, dtype, torch.device("cpu"), True, num_secondary, str(path), identity
    )


def _store(rm, rid: int, tokens: list[int]) -> None:
    req = LlmRequest(rid, 4, tokens)
    rm.impl.add_sequence(rid, len(tokens), 1, req)
    req.move_to_next_context_chunk()
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    rm.impl.store_context_blocks(req)
    rm.prepare_resources(ScheduledRequests())  # executes the transfers


def _fill_pool_with_noise(rm, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = [rm.pool] if rm.scales is None else [rm.pool, rm.scales]
    for t in tensors:
        t.copy_((100 * torch.rand(t.shape, generator=gen)).to(t.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.float8_e4m3fn], ids=str)
def test_saved_blocks_come_back_bit_for_bit(tmp_path, dtype):
    path = tmp_path / "tier.bin"
    rm = _manager(path, dtype=dtype)
    tensors = lambda m: [m.pool] if m.scales is None else [m.pool, m.scales]  # noqa: E731
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks cached
    req = LlmRequest(1, 4, prompt)
    rm.impl.add_sequence(1, 13, 1, req)
    blocks = rm.impl.get_block_ids(1)
    gen = torch.Generator().manual_seed(3)
    for t in tensors(rm):
        t.copy_((100 * torch.rand(t.shape, generator=gen)).to(t.dtype))
    want = [[t[:, :, b].clone() for t in tensors(rm)] for b in blocks[:3]]
    req.move_to_next_context_chunk()
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    rm.impl.store_context_blocks(req)
    rm.impl.remove_sequence(1, req)
    rm.impl.add_sequence(2, 16, 1, None)  # takes all 4 primary blocks: the 3 cached ones offloaded
    rm.prepare_resources(ScheduledRequests())
    rm.impl.remove_sequence(2)
    assert rm.impl.get_kv_cache_stats().reusable_num_secondary_blocks == 3
    rm.shutdown()

    again = _manager(path, dtype=dtype)
    assert again.secondary.adopted is not None and len(again.secondary.adopted) == 3
    again.impl.check_integrity()
    for t in tensors(again):
        t.zero_()
    probe = LlmRequest(3, 4, prompt)
    again.impl.add_sequence(3, 13, 1, probe)
    assert probe.prepopulated_prompt_len == 12
    again.prepare_resources(ScheduledRequests())  # the onboards
    for b, w in zip(again.impl.get_block_ids(3)[:3], want):
        for t, expect in zip(tensors(again), w):
            assert torch.equal(t[:, :, b], expect)
    again.shutdown()


def test_a_slot_written_after_the_last_save_is_not_trusted(tmp_path, caplog):
    """The engine saved, then reused a slot of the tier for other contents and died without saving:
    the next engine drops that block (its digest fails) and every block below it, adopts the rest."""
    path = tmp_path / "tier.bin"
    rm = _manager(path, num_secondary=3)
    _fill_pool_with_noise(rm, 5)
    prompt = list(range(30, 43))  # blocks k1 <- k2 <- k3
    req = LlmRequest(1, 4, prompt)
    rm.impl.add_sequence(1, 13, 1, req)
    req.move_to_next_context_chunk()
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    rm.impl.store_context_blocks(req)
    rm.impl.remove_sequence(1, req)
    rm.impl.add_sequence(2, 16, 1, None)  # all three offloaded: the tier is full
    rm.prepare_resources(ScheduledRequests())
    rm.impl.remove_sequence(2)
    rm.save_secondary()
    ids, parents, _, _ = rm.impl.export_secondary_blocks()
    slot_of_parent = {int(p): int(b) - 4 for b, p in zip(ids, parents)}  # parent id -> its child's slot
    root = int(ids[list(parents).index(-1)])
    middle = slot_of_parent[root] + 4
    # Then the engine wrote other contents into k2's slot (as a later offload would) and died: no
    # shutdown, no save.
    _fill_pool_with_noise(rm, 6)
    rm.secondary.offload([rm.pool], 0, middle - 4)
    rm.secondary._buf.flush()
    rm.secondary = None  # as if the process died: shutdown() will not save
    rm.pool = None

    with caplog.at_level(logging.WARNING, logger="inflight"):
        again = _manager(path, num_secondary=3)
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and "2 of 3 cached blocks dropped" in dropped[0], dropped  # k2 and k3
    adopted = again.secondary.adopted
    assert adopted is not None and adopted.slots.tolist() == [root - 4]
    again.impl.check_integrity()
    probe = LlmRequest(4, 4, prompt)
    again.impl.add_sequence(4, 13, 1, probe)
    assert probe.prepopulated_prompt_len == 4  # k1 only
    again.shutdown()


def test_the_index_is_saved_periodically_after_offloads(tmp_path, monkeypatch):
    """With the interval at 0 every step with an offload writes the index: an engine that dies without
    a shutdown leaves its tier adoptable."""
    monkeypatch.setattr(resource_manager, "TIER_SAVE_INTERVAL_S", 0.0)
    path = tmp_path / "tier.bin"
    rm = _manager(path)
    _fill_pool_with_noise(rm, 7)
    prompt = list(range(50, 59))  # 2 full blocks cached
    req = LlmRequest(1, 4, prompt)
    rm.impl.add_sequence(1, 9, 1, req)
    req.move_to_next_context_chunk()
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    rm.impl.store_context_blocks(req)
    rm.impl.remove_sequence(1, req)
    rm.impl.add_sequence(2, 16, 1, None)
    rm.prepare_resources(ScheduledRequests())  # the offloads, then the save
    rm.secondary = None  # dies
    again = _manager(path)
    assert again.secondary.adopted is not None and len(again.secondary.adopted) == 2
    again.shutdown()


def test_identity_and_layout_mismatches_at_the_pool(tmp_path, caplog):
    path = tmp_path / "tier.bin"
    rm = _manager(path)
    rm.shutdown()
    for kwargs, fragment in (
        ({"identity": {**IDENTITY, "weights_sha256": "1" * 64}}, "another model (weights_sha256: file '000"),
        ({"num_secondary": 5}, "another layout ("),
        ({"dtype": torch.bfloat16}, "another layout (file_bytes"),
        ({"dtype": torch.float8_e4m3fn}, "another layout ("),  # the KV dtype is in the layout's tensors
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="inflight"):
            other = _manager(path, **kwargs)
        assert any(fragment in r.getMessage() for r in caplog.records), [
            r.getMessage() for r in caplog.records
        ]
        assert other.secondary.adopted is None
        other.shutdown()  # rebuilt: the file now has the other configuration's header
        rm2 = _manager(path, **kwargs)
        assert rm2.secondary.rejected is None and rm2.secondary.adopted is not None
        rm2.shutdown()
        _manager(path).shutdown()  # back to the first configuration (rebuilt again)


def test_a_tier_without_reuse_or_identity_is_not_persistent(tmp_path):
    path = tmp_path / "tier.bin"
    rm = KVCacheResourceManager.allocate(
        2, 2, 4, 4, 4, 64, torch.float32, torch.device("cpu"), False, 6, str(path), IDENTITY
    )
    assert not rm.secondary.persistent
    assert os.path.getsize(path) == rm.secondary.nbytes  # no header region: the tensors only
    rm.shutdown()
    rm = KVCacheResourceManager.allocate(
        2, 2, 4, 4, 4, 64, torch.float32, torch.device("cpu"), True, 6, str(path)
    )
    assert not rm.secondary.persistent
    rm.shutdown()


def test_model_identity_digests_every_byte(long_model, foreign_model, tmp_path):
    """The weights' digest covers the files' contents: the same shapes with other weights differ, and a
    one-byte change in the middle of a copy (size and name kept) changes it."""
    a, b = (
        model_identity(str(long_model), torch.float32, None, "tp=1 pp=1"),
        model_identity(str(foreign_model), torch.float32, None, "tp=1 pp=1"),
    )
    assert a["model"] == b["model"] and a["weights_bytes"] == b["weights_bytes"]
    assert a["weights_sha256"] != b["weights_sha256"]
    files = checkpoint_files(str(long_model))
    assert [f.name for f in files][0] == "config.json" and any(f.suffix == ".safetensors" for f in files)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in files:
        (copy / f.name).write_bytes(f.read_bytes())
    copied = [copy / f.name for f in files]
    assert weights_digest(copied) == a["weights_sha256"]
    big = copied[-1]
    data = bytearray(big.read_bytes())
    data[len(data) // 2] ^= 1
    big.write_bytes(bytes(data))
    assert weights_digest(copied) != a["weights_sha256"]
    assert checkpoint_files(str(tmp_path / "missing")) == []


def test_pool_module_constants():
    assert kv_secondary_pool.FORMAT_VERSION == 1 and len(MAGIC) == 16
    assert header_bytes(100, 32) % 4096 == 0


def test_two_engines_cannot_share_a_tier_file(tmp_path):
    """The file is locked while a pool maps it: a second manager on it is refused by name; after the
    first shuts down the file is free again."""
    path = tmp_path / "tier.bin"
    rm = _manager(path)
    with pytest.raises(ValueError, match=r"host_cache_path=.* is in use by another engine"):
        _manager(path)
    rm.shutdown()
    _manager(path).shutdown()
