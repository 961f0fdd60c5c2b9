"""LLM.generate against transformers, and the offline API around it (stats, text, stop strings,
seeded sampling, custom schedulers, shutdown, models without a tokenizer).

Every greedy comparison is like for like: fp32, one unpadded prompt at a time in transformers with
``eos_token_id=None``, ``ignore_eos=True`` here (neither masks EOS, both keep going after it).
"""

from __future__ import annotations

import pytest
from llm_utils import (
    LLM_MAX_NEW,
    LLM_PARENT_IDX,
    LLM_PROMPTS,
    LLM_TPB,
    TIMEOUT,
    assert_kv_idle,
    greedy,
    hf_generate,
    hf_greedy,
    wait_idle,
)
from model_utils import ARCHS

from inflight.batch_manager import CapacitySchedulerPolicy, LlmRequestState
from inflight.executor.scheduler import (
    BindMicroBatchScheduler,
    CapacityScheduler,
    RequestScheduler,
    SimpleScheduler,
)
from inflight.llm_args import KvCacheConfig, SchedulerConfig
from inflight.outputs import RequestOutput
from inflight.sampling_params import SamplingParams


def _tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_same(got: list[list[int]], want: list[list[int]], prompts=LLM_PROMPTS) -> None:
    bad = [(i, len(p), g, w) for i, (p, g, w) in enumerate(zip(prompts, got, want)) if g != w]
    assert not bad, "differs from transformers (prompt index, prompt length, got, want):\n" + "\n".join(
        map(str, bad)
    )


# ---- token-identical to transformers ------------------------------------------------------------

MODES = {
    # The CPU default (overlap off), no reuse: the plain path.
    "plain": {
        "disable_overlap_scheduler": True,
        "kv_cache_config": KvCacheConfig(max_tokens=4096, tokens_per_block=LLM_TPB, enable_block_reuse=False),
    },
    "overlap": {"disable_overlap_scheduler": False},
    # Prompts of 33, 40 and 57 tokens need 2-3 chunks of at most 32 tokens (whole blocks of 8).
    "chunked": {"enable_chunked_prefill": True, "max_num_tokens": 32},
    "chunked-overlap": {
        "enable_chunked_prefill": True,
        "max_num_tokens": 32,
        "disable_overlap_scheduler": False,
    },
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(make_llm, hf_greedy_refs, arch, mode):
    want = hf_greedy_refs(arch)
    llm = make_llm(arch, **MODES[mode])
    outs = llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)
    assert len(outs) == len(LLM_PROMPTS)
    for o, p in zip(outs, LLM_PROMPTS):
        assert o.finished and o.prompt_token_ids == p
        assert o.outputs[0].finish_reason == "length"
    _assert_same(_tokens(outs), want)
    if mode.startswith("chunked"):
        # Chunking really happened: no step ran more than 32 tokens, and the 57-token prompt exists.
        assert max(s["num_tokens"] for s in llm.get_stats()) <= 32
        assert max(len(p) for p in LLM_PROMPTS) > 32
    assert_kv_idle(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_block_reuse(make_llm, hf_greedy_refs, arch, overlap):
    want = hf_greedy_refs(arch)
    llm = make_llm(
        arch,
        disable_overlap_scheduler=not overlap,
        kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=LLM_TPB, enable_block_reuse=True),
    )
    parents = [LLM_PROMPTS[i] for i in LLM_PARENT_IDX]
    first = llm.generate(parents, greedy(), use_tqdm=False)
    _assert_same(_tokens(first), [want[i] for i in LLM_PARENT_IDX], parents)
    reused_before = llm.get_stats()[-1]["kv_cache_stats"]["reused_blocks"]
    # All ten: exact repeats (a 16-token prompt whose every block is cached), and prompts that extend
    # a cached prefix by a partial block or more.
    second = llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)
    _assert_same(_tokens(second), want)
    kv = llm.get_stats()[-1]["kv_cache_stats"]
    assert kv["reused_blocks"] > reused_before, kv
    assert kv["cache_hit_rate"] > 0, kv
    assert_kv_idle(llm)


@pytest.mark.parametrize("reuse", [False, True], ids=["noreuse", "reuse"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_preemption(make_llm, hf_greedy_refs, arch, overlap, reuse):
    """MAX_UTILIZATION over a pool far too small for the batch: requests are paused (their KV freed,
    or kept in the reuse tree) and recomputed later, and the tokens are still exactly transformers'."""
    want = hf_greedy_refs(arch)
    llm = make_llm(
        arch,
        disable_overlap_scheduler=not overlap,
        kv_cache_config=KvCacheConfig(
            max_tokens=24 * LLM_TPB, tokens_per_block=LLM_TPB, enable_block_reuse=reuse
        ),
        scheduler_config=SchedulerConfig(capacity_scheduler_policy="MAX_UTILIZATION"),
    )
    outs = llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)
    _assert_same(_tokens(outs), want)
    stats = llm.get_stats()
    assert sum(s["num_paused_requests"] for s in stats) > 0, "no request was paused: the test proves nothing"
    assert sum(o.metrics.get("num_preemptions", 0) for o in outs) > 0
    assert_kv_idle(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_max_tokens_none_stops_at_max_seq_len(make_llm, hf_greedy_refs, overlap):
    want = hf_greedy_refs("llama")
    llm = make_llm(max_seq_len=32, disable_overlap_scheduler=not overlap)
    params = SamplingParams(temperature=0, ignore_eos=True)  # max_tokens=None
    outs = llm.generate([LLM_PROMPTS[0], LLM_PROMPTS[2]], params, use_tqdm=False)
    for o, i in zip(outs, (0, 2)):
        n = 32 - len(LLM_PROMPTS[i])  # 12 and 31 tokens
        c = o.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == n
        assert c.token_ids[:LLM_MAX_NEW] == want[i][:n]
    assert_kv_idle(llm)


def test_kv_pool_starts_zeroed(make_llm):
    """Attention gathers whole blocks (and pads to the longest sequence), so a slot that was never
    written is read and multiplied by a zero weight: it must hold zeros, never NaN/Inf garbage
    (a small CPU pool from recycled heap memory once made greedy outputs depend on the heap)."""
    import torch

    llm = make_llm(kv_cache_config=KvCacheConfig(max_tokens=24 * LLM_TPB, tokens_per_block=LLM_TPB))
    pool = llm.executor.kv_cache_manager.pool
    assert pool.numel() > 0 and torch.count_nonzero(pool) == 0


def test_generate_with_progress_bar(make_llm, hf_greedy_refs, capsys):
    """The default generate() (a tqdm bar) returns the same outputs, in prompt order."""
    llm = make_llm()
    outs = llm.generate(LLM_PROMPTS, greedy())
    _assert_same(_tokens(outs), hf_greedy_refs("llama"))
    assert [o.prompt_token_ids for o in outs] == LLM_PROMPTS
    assert "Processed prompts" in capsys.readouterr().err


# ---- statistics ---------------------------------------------------------------------------------

STAT_KEYS = {
    "iter",
    "num_scheduled_requests",
    "num_context_requests",
    "num_generation_requests",
    "num_paused_requests",
    "num_tokens",
    "kv_cache_stats",
}
KV_KEYS = {"used_num_blocks", "free_num_blocks", "cache_hit_rate", "max_num_blocks", "reused_blocks"}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_get_stats(make_llm, overlap):
    llm = make_llm(
        disable_overlap_scheduler=not overlap,
        kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=LLM_TPB, enable_block_reuse=False),
    )
    assert llm.get_stats() == []
    outs = llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)
    # Read at once: the entry of the iteration that finished the last request is already there, and
    # it was taken after that request's blocks were freed.
    stats = llm.get_stats()
    assert isinstance(stats, list) and stats and all(isinstance(s, dict) for s in stats)
    last = stats[-1]["kv_cache_stats"]
    assert last["used_num_blocks"] == 0, last
    for s in stats:
        assert s.keys() >= STAT_KEYS, s.keys()
        assert s["kv_cache_stats"].keys() >= KV_KEYS, s["kv_cache_stats"].keys()
        assert s["num_scheduled_requests"] == s["num_context_requests"] + s["num_generation_requests"]
        kv = s["kv_cache_stats"]
        assert kv["used_num_blocks"] + kv["free_num_blocks"] == kv["max_num_blocks"] == 4096 // LLM_TPB
        assert 0.0 <= kv["cache_hit_rate"] <= 1.0
    iters = [s["iter"] for s in stats]
    assert iters == list(range(iters[0], iters[0] + len(iters))), "not oldest first, or a gap"
    # Every prompt ran as one context (no chunking, no pauses).
    assert sum(s["num_context_requests"] for s in stats) == len(LLM_PROMPTS)
    assert sum(s["num_paused_requests"] for s in stats) == 0
    n_prompt = sum(len(p) for p in LLM_PROMPTS)
    n_decode = sum(len(o.outputs[0].token_ids) - 1 for o in outs)  # the first token comes from the context
    total = sum(s["num_tokens"] for s in stats)
    if overlap:
        # A request is scheduled once more before its stop is seen (that token is discarded).
        assert n_prompt + n_decode <= total <= n_prompt + n_decode + len(LLM_PROMPTS)
    else:
        assert total == n_prompt + n_decode
    assert any(s["kv_cache_stats"]["used_num_blocks"] > 0 for s in stats)


# ---- text, EOS, stop tokens, stop strings ---------------------------------------------------------

TEXT_PROMPT = "Hello world"


def _is_plain(piece: str) -> bool:
    return bool(piece) and all(32 <= ord(c) < 127 for c in piece)


@pytest.fixture(scope="module")
def text_ref(tiny_model_dir):
    """transformers' greedy continuation (32 tokens) of TEXT_PROMPT on the llama model, its prompt
    ids, and the tokenizer."""
    from transformers import AutoTokenizer

    path = tiny_model_dir("llama")
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok.encode(TEXT_PROMPT)
    return ids, hf_greedy(path, [ids], 32)[0], tok


def test_string_prompt_and_text(make_llm, text_ref):
    ids, ref, tok = text_ref
    llm = make_llm()
    out = llm.generate(TEXT_PROMPT, greedy(32), use_tqdm=False)
    assert isinstance(out, RequestOutput)  # one prompt in, one output out
    assert out.prompt == TEXT_PROMPT and out.prompt_token_ids == ids
    c = out.outputs[0]
    assert c.token_ids == ref
    assert c.text == tok.decode(ref, skip_special_tokens=True) and c.text
    # A list of one string is a list.
    outs = llm.generate([TEXT_PROMPT], greedy(32), use_tqdm=False)
    assert isinstance(outs, list) and outs[0].outputs[0].token_ids == ref


def _first_plain_token(ref: list[int], tok, start: int = 2) -> int:
    """Index of the first output token from ``start`` on that decodes to plain ASCII text and does
    not occur earlier in the output."""
    for i in range(start, len(ref)):
        if ref[i] not in ref[:i] and ref[i] > 5 and _is_plain(tok.decode([ref[i]])):
            return i
    pytest.fail(f"no usable token in the reference output {ref}")


def test_eos_in_token_ids_not_in_text(make_llm, tiny_model_dir, text_ref):
    """The tiny model's EOS is made a (non-special) token it greedily emits at step k: generation
    stops there, token_ids end with it, text excludes it; ignore_eos keeps going and does not mask
    it; min_tokens masks it, exactly like transformers' min_new_tokens."""
    ids, ref, tok = text_ref
    k = _first_plain_token(ref, tok)
    eos = ref[k]
    path = tiny_model_dir("llama", eos_token_id=eos)  # same weights (same seed), another EOS
    llm = make_llm(model=path)
    c = llm.generate(ids, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False).outputs[0]
    assert c.finish_reason == "stop"
    assert c.token_ids == ref[: k + 1] and c.token_ids[-1] == eos
    assert c.text == tok.decode(ref[:k], skip_special_tokens=True)
    assert not c.text.endswith(tok.decode([eos]))

    c = llm.generate(ids, greedy(32), use_tqdm=False).outputs[0]  # ignore_eos
    assert c.token_ids == ref and c.finish_reason == "length"
    assert c.token_ids.count(eos) >= 1

    # min_tokens vs transformers' min_new_tokens (both mask EOS until then, both stop on it after).
    from model_utils import load_hf_reference

    m = k + 3
    want = hf_generate(load_hf_reference(path), ids, max_new_tokens=32, min_new_tokens=m, eos_token_id=eos)
    c = llm.generate(ids, SamplingParams(temperature=0, max_tokens=32, min_tokens=m), use_tqdm=False).outputs[
        0
    ]
    assert c.token_ids == want
    assert eos not in c.token_ids[:m]
    assert c.token_ids[:k] == ref[:k] and c.token_ids[k] != eos


def test_stop_token_ids(make_llm, text_ref):
    ids, ref, tok = text_ref
    k = _first_plain_token(ref, tok)
    llm = make_llm()
    c = llm.generate(
        ids, SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[ref[k]]), use_tqdm=False
    ).outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == ref[k]
    assert c.token_ids == ref[: k + 1]
    assert c.text == tok.decode(ref[:k], skip_special_tokens=True)
    assert_kv_idle(llm)


def _split_stop(ref: list[int], tok) -> tuple[str, int]:
    """A two-character stop string made of the last character of output token i and the first of
    token i + 1, occurring nowhere earlier in the text; returns it and i + 1."""
    pieces = [tok.decode([t]) for t in ref]
    for i in range(1, len(ref) - 1):
        a, b = pieces[i], pieces[i + 1]
        if not (_is_plain(a) and _is_plain(b)):
            continue
        stop = a[-1] + b[0]
        head = tok.decode(ref[: i + 1], skip_special_tokens=True)
        full = tok.decode(ref, skip_special_tokens=True)
        if full.startswith(head) and full.find(stop) == len(head) - 1:
            return stop, i + 1
    pytest.fail(f"no usable token boundary in {pieces}")


@pytest.mark.parametrize("streaming", [False, True], ids=["offline", "streaming"])
def test_stop_string_split_across_tokens(make_llm, text_ref, streaming):
    import asyncio

    _, ref, tok = text_ref
    stop, j = _split_stop(ref, tok)
    full = tok.decode(ref, skip_special_tokens=True)
    at = full.find(stop)
    llm = make_llm()

    def run(params):
        if not streaming:
            return llm.generate(TEXT_PROMPT, params, use_tqdm=False), None

        async def consume():
            h = llm.generate_async(TEXT_PROMPT, params, streaming=True)
            return [o async for o in h]

        items = asyncio.run(asyncio.wait_for(consume(), TIMEOUT))
        return items[-1], items

    for include in (False, True):
        params = SamplingParams(
            temperature=0,
            max_tokens=32,
            ignore_eos=True,
            stop=["never-there", stop],
            include_stop_str_in_output=include,
        )
        out, items = run(params)
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == (full[: at + len(stop)] if include else full[:at])
        # Generation stopped at the token that completed the stop string.
        assert c.token_ids == ref[: j + 1]
        if items is not None:
            assert "".join(o.outputs[0].text_diff for o in items) == c.text, "streamed deltas != final text"
            for o in items:
                assert c.text.startswith(o.outputs[0].text), "a streamed text was taken back later"
            assert sum(o.finished for o in items) == 1 and items[-1].finished
    assert_kv_idle(llm)


def test_stop_string_within_one_token(make_llm, text_ref):
    _, ref, tok = text_ref
    k = _first_plain_token(ref, tok)
    piece = tok.decode([ref[k]])
    full = tok.decode(ref, skip_special_tokens=True)
    llm = make_llm()
    c = llm.generate(
        TEXT_PROMPT, SamplingParams(temperature=0, max_tokens=32, stop=piece), use_tqdm=False
    ).outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == piece
    assert c.text == full[: full.find(piece)]
    assert piece not in c.text


# ---- seeded sampling and n ----------------------------------------------------------------------


def _sample(seed, n=1, max_tokens=16):
    return SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=max_tokens, ignore_eos=True)


def test_seeded_sampling_is_reproducible_across_batches(make_llm):
    p = LLM_PROMPTS[0]
    llm = make_llm()
    alone = llm.generate(p, _sample(7), use_tqdm=False).outputs[0].token_ids
    assert len(alone) == 16
    # The same request in a batch with unseeded, differently seeded and greedy neighbours, placed
    # elsewhere in the batch.
    mixed = llm.generate(
        [LLM_PROMPTS[3], LLM_PROMPTS[1], p, LLM_PROMPTS[8], p],
        [SamplingParams(temperature=1.0, max_tokens=20), _sample(8), _sample(7), greedy(5), _sample(9)],
        use_tqdm=False,
    )
    assert mixed[2].outputs[0].token_ids == alone
    assert mixed[4].outputs[0].token_ids != alone, "different seeds gave the same tokens"
    # And on another engine whose batches look different again (chunked, overlap, while other
    # requests are half-way through).
    other = make_llm(enable_chunked_prefill=True, max_num_tokens=16, disable_overlap_scheduler=False)
    busy = [other.generate_async(q, SamplingParams(temperature=0.8, max_tokens=30)) for q in LLM_PROMPTS[5:9]]
    h = other.generate_async(p, _sample(7))
    assert h.result(timeout=TIMEOUT).outputs[0].token_ids == alone
    for b in busy:
        assert b.result(timeout=TIMEOUT).outputs[0].finish_reason in ("length", "stop")
    assert llm.generate(p, _sample(8), use_tqdm=False).outputs[0].token_ids != alone


def test_n_outputs(make_llm):
    llm = make_llm()
    out = llm.generate(LLM_PROMPTS[1], _sample(11, n=3), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "n samples are all identical"
    again = llm.generate(LLM_PROMPTS[1], _sample(11, n=3), use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_kv_idle(llm)


def test_n_with_greedy_is_rejected():
    with pytest.raises(ValueError, match=r"\bn\b"):
        SamplingParams(n=2, temperature=0.0)
    with pytest.raises(ValueError, match=r"\bn\b"):
        SamplingParams(n=3, temperature=1e-7)


# ---- custom schedulers --------------------------------------------------------------------------


class _RecordingCapacity(CapacityScheduler):
    """Everything unfinished fits (the pool is large); records each call."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def schedule_request(self, active_requests):
        self.calls.append([r.request_id for r in active_requests])
        return [r for r in active_requests if r.state != LlmRequestState.GENERATION_COMPLETE], []


def test_user_scheduler_instance_is_used(make_llm, hf_greedy_refs):
    cap = _RecordingCapacity()
    sched = SimpleScheduler(cap, BindMicroBatchScheduler(max_batch_size=3, max_num_tokens=64))
    llm = make_llm(scheduler=sched)
    assert llm.executor.scheduler is sched
    outs = llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)
    _assert_same(_tokens(outs), hf_greedy_refs("llama"))
    assert cap.calls, "the user's capacity scheduler was never called"
    seen = {rid for call in cap.calls for rid in call}
    assert seen == {o.request_id for o in outs}
    stats = llm.get_stats()
    # Its micro-batch limit of 3 was honoured (the default would run all ten at once).
    assert max(s["num_scheduled_requests"] for s in stats) == 3
    assert_kv_idle(llm)


def test_user_scheduler_factory_and_bad_scheduler(make_llm):
    from inflight.executor.scheduler import BindCapacityScheduler

    made = {}

    def factory(*, kv_cache_manager, max_batch_size, max_num_tokens):
        made.update(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens)
        return SimpleScheduler(
            BindCapacityScheduler(
                max_batch_size, kv_cache_manager, CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
            ),
            BindMicroBatchScheduler(2, max_num_tokens),
        )

    llm = make_llm(scheduler=factory, max_batch_size=5, max_num_tokens=100)
    assert made == {"max_batch_size": 5, "max_num_tokens": 100}
    assert isinstance(llm.executor.scheduler, RequestScheduler)
    llm.generate(LLM_PROMPTS[:4], greedy(4), use_tqdm=False)
    assert max(s["num_scheduled_requests"] for s in llm.get_stats()) == 2
    with pytest.raises(ValueError, match="scheduler"):
        make_llm(scheduler=42)
    with pytest.raises(ValueError, match="scheduler"):
        make_llm(scheduler=lambda **kw: "not a scheduler")


# ---- lifetime -----------------------------------------------------------------------------------


def test_shutdown_finishes_running_requests_then_refuses(make_llm, hf_greedy_refs):
    import threading

    llm = make_llm()
    handles = [llm.generate_async(p, greedy()) for p in LLM_PROMPTS[:4]]
    t = threading.Thread(target=llm.shutdown, daemon=True)
    t.start()
    t.join(TIMEOUT)
    assert not t.is_alive(), "shutdown() hung"
    want = hf_greedy_refs("llama")
    for i, h in enumerate(handles):
        assert h.result(timeout=TIMEOUT).outputs[0].token_ids == want[i]
    with pytest.raises(RuntimeError):
        llm.generate(LLM_PROMPTS[0], greedy(), use_tqdm=False)
    with pytest.raises(RuntimeError):
        llm.generate_async(LLM_PROMPTS[0], greedy())
    llm.shutdown()  # a second shutdown is a no-op


def test_context_manager(tiny_model_dir):
    from inflight.llm import LLM

    with LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        kv_cache_config=KvCacheConfig(max_tokens=1024, tokens_per_block=LLM_TPB),
    ) as llm:
        out = llm.generate(LLM_PROMPTS[2], greedy(3), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 3
    with pytest.raises(RuntimeError):
        llm.generate(LLM_PROMPTS[2], greedy(3), use_tqdm=False)
    assert not llm.executor.is_alive


# ---- a model directory without tokenizer files --------------------------------------------------


def test_model_without_tokenizer(make_llm, tiny_model_dir, hf_greedy_refs):
    llm = make_llm(model=tiny_model_dir("llama", with_tokenizer=False))
    assert llm.tokenizer is None
    outs = llm.generate(LLM_PROMPTS[:3], greedy(), use_tqdm=False)
    _assert_same(_tokens(outs), hf_greedy_refs("llama")[:3], LLM_PROMPTS[:3])  # same weights, same seed
    for o in outs:
        assert o.outputs[0].text == "" and o.prompt is None
    stats_before = len(llm.get_stats())
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("Hello world", greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate_async("Hello world", greedy())
    # A list with one string in it fails as a whole: nothing of it runs.
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([LLM_PROMPTS[0], "Hello"], greedy(), use_tqdm=False)
    wait_idle(llm)
    assert len(llm.get_stats()) == stats_before
    out = llm.generate_async(LLM_PROMPTS[1], greedy(4), streaming=False).result(timeout=TIMEOUT)
    assert out.outputs[0].token_ids == hf_greedy_refs("llama")[1][:4]
