"""The bound batch-manager classes: the public contract, identity, subclassing, bad arguments."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from inflight.batch_manager import (
    CapacityScheduler,
    CapacitySchedulerPolicy,
    ContextChunkingConfig,
    ContextChunkingPolicy,
    FinishReason,
    KVCacheManager,
    KvCacheStats,
    LlmRequest,
    LlmRequestState,
    MicroBatchScheduler,
    RequestList,
    SequenceSlotManager,
)


def test_public_contract_as_written():
    req = LlmRequest(request_id=0, max_new_tokens=80, input_tokens=list(range(10)), priority=0.5)
    assert req.state == LlmRequestState.CONTEXT_INIT
    assert (
        req.context_current_position,
        req.context_chunk_size,
        req.prepopulated_prompt_len,
        req.prompt_len,
    ) == (0, 10, 0, 10)
    req.set_context_chunk_size(20)
    assert req.context_chunk_size == 10  # clamped to what remains
    assert req.is_first_context_chunk and req.is_last_context_chunk
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    assert req.state == LlmRequestState.GENERATION_IN_PROGRESS
    req.state = LlmRequestState.CONTEXT_INIT
    req.add_new_token(7)
    assert req.num_generated_tokens == 1 and req.get_tokens()[-1] == 7
    req.move_to_next_context_chunk()
    assert req.context_current_position == 10 and req.context_chunk_size == 0
    req.pause(max_input_len=1000)
    assert (req.prompt_len, req.max_new_tokens, req.num_generated_tokens) == (11, 79, 0)
    assert req.state == LlmRequestState.CONTEXT_INIT and req.context_current_position == 0
    req.draft_tokens = [1, 2, 3]
    assert req.draft_tokens == [1, 2, 3] and req.num_draft_tokens == 3

    kv = KVCacheManager(num_blocks=20, tokens_per_block=10, max_seq_len=90, enable_block_reuse=False)
    kv.add_sequence(req.request_id, req.prompt_len, 1, req)
    kv.add_token(req.request_id)
    assert kv.get_block_ids(req.request_id) == [0, 1]
    assert kv.num_free_blocks == 18
    kv.check_integrity()
    st = kv.get_kv_cache_stats()
    assert isinstance(st, KvCacheStats)
    assert (st.used_num_blocks, st.reused_blocks, st.max_num_blocks, st.tokens_per_block) == (2, 0, 20, 10)
    out = np.full((2, kv.max_blocks_per_seq), -1, dtype=np.int32)
    kv.copy_block_tables([req.request_id], out)
    assert out[0].tolist() == [0, 1] + [0] * (kv.max_blocks_per_seq - 2)
    assert out[1].tolist() == [-1] * kv.max_blocks_per_seq  # rows past the batch untouched
    kv.remove_sequence(req.request_id, req)
    kv.store_context_blocks  # noqa: B018 (exists; exercised in the reuse tests)
    assert kv.num_free_blocks == 20

    active = [LlmRequest(i, 8, list(range(15))) for i in range(3)]
    cap = CapacityScheduler(max_num_requests=2, policy=CapacitySchedulerPolicy.MAX_UTILIZATION)
    fitting, paused = cap.schedule(active, kv)
    assert [r.request_id for r in fitting] == [0, 1] and len(paused) == 0
    assert fitting[0] is active[0] and fitting[1] is active[1]
    mb = MicroBatchScheduler(
        ContextChunkingConfig(ContextChunkingPolicy.EQUAL_PROGRESS, chunk_unit_size=20),
        max_context_length=None,
    )
    context, generation = mb.schedule(
        fitting, inflight_request_ids=set(), max_batch_size=4, max_num_tokens=100
    )
    assert [r.request_id for r in context] == [0, 1] and len(generation) == 0
    assert context[0] is active[0]
    MicroBatchScheduler(None, max_context_length=None)

    slots = SequenceSlotManager(max_num_slots=4, max_idle_seconds=180.0)
    assert slots.get_sequence_slot(True, req.request_id) == 0
    slots.free_sequence_slot(req.request_id)
    assert slots.num_free_slots == 4


def test_enums_are_ordered_and_named():
    S = LlmRequestState
    assert (
        S.ENCODER_INIT
        < S.CONTEXT_INIT
        < S.GENERATION_IN_PROGRESS
        < S.GENERATION_TO_COMPLETE
        < S.GENERATION_COMPLETE
    )
    assert [
        int(s) for s in (S.ENCODER_INIT, S.CONTEXT_INIT, S.GENERATION_IN_PROGRESS, S.GENERATION_COMPLETE)
    ] == [1, 10, 13, 20]
    assert set(FinishReason.__members__) == {
        "NOT_FINISHED",
        "END_ID",
        "STOP_WORDS",
        "LENGTH",
        "TIMED_OUT",
        "CANCELLED",
    }
    assert set(CapacitySchedulerPolicy.__members__) == {
        "MAX_UTILIZATION",
        "GUARANTEED_NO_EVICT",
        "STATIC_BATCH",
    }


class PyRequest(LlmRequest):
    def __init__(self, *args, sampling=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.py_sampling = sampling
        self.py_output = []


def test_python_subclass_goes_through_cpp_schedulers_unchanged():
    kv = KVCacheManager(64, 8, 256)
    reqs = [PyRequest(i, 4, list(range(5 + i)), sampling={"temperature": i}) for i in range(6)]
    reqs[2].py_output.append("x")
    cap = CapacityScheduler(4, CapacitySchedulerPolicy.GUARANTEED_NO_EVICT)
    mb = MicroBatchScheduler()
    for active in (reqs, RequestList(reqs), tuple(reqs)):
        fitting, _ = cap.schedule(active, kv)
        ctx, _gen = mb.schedule(fitting, set(), 8, None)
        assert [r.request_id for r in ctx] == [0, 1, 2, 3]
        for r in ctx:
            assert type(r) is PyRequest and r is reqs[r.request_id]
            assert r.py_sampling == {"temperature": r.request_id}
        assert ctx[2].py_output == ["x"]


def test_request_list_behaves_like_a_list_of_the_same_objects():
    reqs = [PyRequest(i, 4, [1, 2, 3], priority=p) for i, p in enumerate([0.5, 0.9, 0.5, 0.1, 0.9])]
    lst = RequestList()
    for r in reqs:
        lst.insert_by_priority(r)
    assert lst.request_ids() == [1, 4, 0, 2, 3]  # descending priority, FIFO within equal
    assert len(lst) == 5 and lst[0] is reqs[1] and lst[-1] is reqs[3]
    assert [r.request_id for r in lst] == [1, 4, 0, 2, 3]
    assert reqs[0] in lst
    lst.remove(reqs[0])
    assert reqs[0] not in lst
    lst.remove_ids({1, 3})
    assert lst.request_ids() == [4, 2]
    assert (lst + RequestList([reqs[0]])).request_ids() == [4, 2, 0]
    assert lst.pop(0) is reqs[4] and lst.request_ids() == [2]
    with pytest.raises(IndexError):
        lst[5]
    with pytest.raises(TypeError, match="LlmRequest"):
        lst.append("not a request")
    with pytest.raises(TypeError, match="LlmRequest"):
        CapacityScheduler(2).schedule([reqs[0], 3], None)


def test_request_list_keeps_requests_alive_and_is_collectable():
    r = PyRequest(0, 4, [1, 2])
    lst = RequestList([r])
    ref = weakref.ref(r)
    del r
    gc.collect()
    assert ref() is not None and lst[0].py_output == []
    lst[0].py_list = lst  # a cycle through the C++ list must still be collected
    del lst
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: LlmRequest(0, 10, []), "input_tokens"),
        (lambda: LlmRequest(0, -1, [1]), "max_new_tokens.*-1"),
        (lambda: LlmRequest(0, 10, [1], priority=1.5), "priority.*1.5"),
        (lambda: LlmRequest(0, 10, [1], beam_width=0), "beam_width.*0"),
        (lambda: KVCacheManager(0, 10, 90), "num_blocks.*0"),
        (lambda: KVCacheManager(-3, 10, 90), "num_blocks.*-3"),
        (lambda: KVCacheManager(10, 0, 90), "tokens_per_block.*0"),
        (lambda: KVCacheManager(10, 10, 0), "max_seq_len.*0"),
        (lambda: CapacityScheduler(0), "max_num_requests.*0"),
        (lambda: ContextChunkingConfig(ContextChunkingPolicy.EQUAL_PROGRESS, 0), "chunk_unit_size.*0"),
        (lambda: MicroBatchScheduler(None, 0), "max_context_length.*0"),
        (lambda: SequenceSlotManager(0), "max_num_slots.*0"),
        (lambda: SequenceSlotManager(2, -1.0), "max_idle_seconds"),
    ],
)
def test_bad_constructor_arguments_name_argument_and_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_kv_operations_raise_and_change_nothing():
    kv = KVCacheManager(num_blocks=4, tokens_per_block=10, max_seq_len=30)
    a = LlmRequest(1, 5, list(range(12)))
    kv.add_sequence(1, a.prompt_len, 1, a)
    with pytest.raises(ValueError, match="request_id 1"):
        kv.add_sequence(1, a.prompt_len, 1, a)  # twice
    with pytest.raises(ValueError, match="request_id 99"):
        kv.add_token(99)
    with pytest.raises(ValueError, match="request_id 99"):
        kv.remove_sequence(99)
    with pytest.raises(ValueError, match="request_id 99"):
        kv.get_block_ids(99)
    with pytest.raises(ValueError, match=r"input_length.*\[1, 30\].*got 31"):
        kv.add_sequence(2, 31, 1)  # longer than max_seq_len
    with pytest.raises(ValueError, match="input_length.*0"):
        kv.add_sequence(2, 0, 1)
    with pytest.raises(RuntimeError, match="need 3.*free 2"):
        kv.add_sequence(2, 25, 1)  # needs 3 blocks, 2 free
    assert kv.num_free_blocks == 2 and not kv.has_sequence(2)
    kv.check_integrity()
    out = np.zeros((1, 2), dtype=np.int64)
    with pytest.raises(TypeError):
        kv.copy_block_tables([1], out)  # wrong dtype is refused, never silently copied
    with pytest.raises(TypeError):
        kv.copy_block_tables([1], np.zeros((4, 3), dtype=np.int32)[:, ::2])  # not contiguous
    with pytest.raises(ValueError):
        kv.copy_block_tables([1], np.zeros((1, 1), dtype=np.int32))  # 2 blocks do not fit 1 column


def test_bad_policy_and_scheduler_arguments():
    with pytest.raises(ValueError, match="7"):
        CapacityScheduler(2, CapacitySchedulerPolicy(7))
    with pytest.raises(TypeError):
        CapacityScheduler(2, "MAX_UTILIZATION")  # the bound class takes the enum
    mb = MicroBatchScheduler()
    with pytest.raises(ValueError, match="max_batch_size.*0"):
        mb.schedule([], set(), 0, None)
    with pytest.raises(ValueError, match="max_num_tokens.*0"):
        mb.schedule([], set(), 4, 0)
    with pytest.raises(ValueError, match="max_context_length"):
        MicroBatchScheduler(None, 5).schedule([LlmRequest(0, 4, list(range(8)))], set(), 4, None)
    r = LlmRequest(0, 4, list(range(8)))
    with pytest.raises(ValueError):
        r.set_context_chunk_size(-1)
    with pytest.raises(ValueError):
        r.set_prepopulated_prompt_len(8)


def test_reuse_through_bindings():
    kv = KVCacheManager(num_blocks=10, tokens_per_block=4, max_seq_len=64, enable_block_reuse=True)
    a = LlmRequest(0, 4, list(range(10)))
    kv.add_sequence(0, a.prompt_len, 1, a)
    a.set_context_chunk_size(a.prompt_len)
    a.move_to_next_context_chunk()
    a.state = LlmRequestState.GENERATION_IN_PROGRESS
    kv.store_context_blocks(a)
    b = LlmRequest(1, 4, list(range(9)) + [42])
    kv.add_sequence(1, b.prompt_len, 1, b)
    assert b.prepopulated_prompt_len == 8 and b.context_current_position == 8
    assert b.context_chunk_size == 2 and b.is_first_context_chunk
    assert kv.get_block_ids(1)[:2] == kv.get_block_ids(0)[:2]
    st = kv.get_kv_cache_stats()
    assert st.reused_blocks == 2 and st.cache_hit_rate == pytest.approx(2 / (2 + 1 + 3))
    kv.check_integrity()
