"""Beam search (SamplingParams.use_beam_search, LLM.beam_search) against transformers'
``generate(num_beams=K, do_sample=False)``: the same beams, in the same order, with the same scores,
on the tiny random Llama (fp32), through the whole engine (forked KV sequences, copy-on-write blocks,
the C++ capacity planner)."""

from __future__ import annotations

import pytest
import torch
from llm_utils import LLM_PROMPTS, LLM_TPB, TIMEOUT, assert_kv_idle, wait_until
from model_utils import load_hf_reference

from inflight import LLM, KvCacheConfig, SchedulerConfig
from inflight.llm import RequestError
from inflight.sampling_params import BeamSearchParams, GuidedDecodingParams, SamplingParams

MAX_NEW = 10


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return load_hf_reference(tiny_model_dir("llama"), torch.float32)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=LLM_TPB),
    )
    yield engine
    engine.shutdown()


def hf_beams(hf, prompt, k, n, max_new=MAX_NEW, **kwargs) -> list[tuple[list[int], float]]:
    """transformers' n best beams of K: (generated tokens up to and including a stop id, score)."""
    ids = torch.tensor([prompt])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny ops: much faster on one thread, same results
    try:
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                num_beams=k,
                num_return_sequences=n,
                max_new_tokens=max_new,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_scores=True,
                **kwargs,
            )
    finally:
        torch.set_num_threads(threads)
    eos = kwargs.get("eos_token_id")
    beams = []
    for seq, score in zip(out.sequences, out.sequences_scores):
        toks = seq[len(prompt) :].tolist()
        if eos is not None and eos in toks:  # padded after the stop id
            toks = toks[: toks.index(eos) + 1]
        beams.append((toks, float(score)))
    return beams


def beam_params(k, n, max_new=MAX_NEW, **kwargs) -> SamplingParams:
    return SamplingParams(use_beam_search=True, best_of=k, n=n, max_tokens=max_new, **kwargs)


def scores(out, length_penalty) -> list[float]:
    return [c.cumulative_logprob / len(c.token_ids) ** length_penalty for c in out.outputs]


@pytest.fixture(scope="module")
def stop_id(hf):
    """A token that beams of the tiny model often produce early: as EOS, it ends many beams."""
    counts: dict[int, int] = {}
    for p in LLM_PROMPTS[:4]:
        for toks, _ in hf_beams(hf, p, 4, 4, eos_token_id=None):
            for t in toks[1:6]:
                counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.get)


@pytest.mark.parametrize(
    "k,n,length_penalty,early_stopping",
    [(4, 4, 1.0, False), (2, 1, 0.5, True), (3, 2, 2.0, "never"), (4, 2, -0.5, "never"), (5, 3, 0.0, False)],
)
def test_beams_equal_transformers(llm, hf, k, n, length_penalty, early_stopping):
    """No stop id: every beam runs to max_tokens; the kept beams, their order and scores match."""
    for prompt in LLM_PROMPTS[:4]:
        ref = hf_beams(
            hf, prompt, k, n, length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=None
        )
        params = beam_params(
            k, n, length_penalty=length_penalty, early_stopping=early_stopping, ignore_eos=True
        )
        out = llm.generate(prompt, params, use_tqdm=False)
        assert [c.token_ids for c in out.outputs] == [t for t, _ in ref]
        assert scores(out, length_penalty) == pytest.approx([s for _, s in ref], rel=1e-6, abs=1e-5)
        assert all(c.finish_reason == "length" for c in out.outputs)
    assert_kv_idle(llm)


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("k,n", [(2, 2), (4, 2)])
def test_beams_with_a_stop_id_equal_transformers(llm, hf, stop_id, k, n, length_penalty, early_stopping):
    """A frequent stop id: beams finish at different lengths, so the finished set, the length
    penalty and each early-stopping mode decide the result, exactly as in transformers."""
    ended = 0
    for prompt in LLM_PROMPTS[:4]:
        ref = hf_beams(
            hf,
            prompt,
            k,
            n,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=stop_id,
        )
        params = beam_params(
            k,
            n,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            stop_token_ids=[stop_id],
            ignore_eos=True,
        )
        out = llm.generate(prompt, params, use_tqdm=False)
        assert [c.token_ids for c in out.outputs] == [t for t, _ in ref]
        assert scores(out, length_penalty) == pytest.approx([s for _, s in ref], rel=1e-6, abs=1e-5)
        for c in out.outputs:
            if c.token_ids[-1] == stop_id:
                ended += 1
                assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert ended > 0, "no beam met the stop id: the test would not cover finished hypotheses"


@pytest.mark.parametrize("min_tokens", [2, 5])
def test_min_tokens_equals_transformers(llm, hf, stop_id, min_tokens):
    for prompt in LLM_PROMPTS[:4]:
        ref = hf_beams(hf, prompt, 3, 3, eos_token_id=stop_id, min_new_tokens=min_tokens)
        params = beam_params(3, 3, stop_token_ids=[stop_id], ignore_eos=True, min_tokens=min_tokens)
        out = llm.generate(prompt, params, use_tqdm=False)
        assert [c.token_ids for c in out.outputs] == [t for t, _ in ref]
        assert all(len(c.token_ids) > min_tokens for c in out.outputs)


def test_scripted_logits_give_the_beams_worked_out_by_hand():
    """K=2 over a vocabulary of 3 (token 2 ends a beam), 3 tokens at most, the next-token
    probabilities fixed per history. Worked by hand:

    step 1: [0] 0.5, [1] 0.4, [2] 0.1 -> running [0], [1]; [2] ranks third of the 2K candidates
            and so does not finish.
    step 2: after [0]: 0.15 / 0.05 / 0.8, after [1]: 0.9 / 0.05 / 0.05 -> candidates [0,2] (ln .5 + ln .8),
            [1,0], [0,0], [0,1]: [0,2] finishes (first), [1,0] and [0,0] run on.
    step 3 (the length limit: every candidate finishes): after [1,0]: 0.25 / 0.15 / 0.6, after [0,0]:
            0.1 / 0.1 / 0.8 -> the first two candidates, [1,0,2] and [1,0,0], finish.
    With length_penalty 1, [0,2] (-0.916 / 2) beats [1,0,2] (-1.533 / 3); with 2.0 the longer wins
    (-0.229 vs -0.170)."""
    import math

    from inflight.executor.beam_search import BeamSearch

    probs = {
        (): [0.5, 0.4, 0.1],
        (0,): [0.15, 0.05, 0.8],
        (1,): [0.9, 0.05, 0.05],
        (1, 0): [0.25, 0.15, 0.6],
        (0, 0): [0.1, 0.1, 0.8],
    }
    a = math.log(0.5) + math.log(0.8)  # [0, 2]
    b = math.log(0.4) + math.log(0.9) + math.log(0.6)  # [1, 0, 2]
    for lp, want in [
        (1.0, [([0, 2], a / 2), ([1, 0, 2], b / 3)]),
        (2.0, [([1, 0, 2], b / 9), ([0, 2], a / 4)]),
    ]:
        params = SamplingParams(
            use_beam_search=True,
            best_of=2,
            n=2,
            max_tokens=3,
            length_penalty=lp,
            ignore_eos=True,
            stop_token_ids=[2],
        )
        search = BeamSearch(params, 0, [7], (), 3, 100)
        rows = [()]
        while not search.done:
            search.step(torch.log(torch.tensor([probs[h] for h in rows])))
            rows = [tuple(r) for r in search.running]
        got = [(h.token_ids, h.score) for h in search.results()]
        assert [g[0] for g in got] == [w[0] for w in want]
        assert [g[1] for g in got] == pytest.approx([w[1] for w in want], abs=1e-6)
        assert all(h.finish_reason == "stop" and h.stop_reason == 2 for h in search.results())
        assert search.results()[0].cumulative_logprob == pytest.approx(
            a if want[0][0] == [0, 2] else b, abs=1e-6
        )


def test_chunked_prefill_gives_the_same_beams(llm, make_llm, stop_id):
    chunked = make_llm(enable_chunked_prefill=True, max_num_tokens=16)
    params = beam_params(4, 2, stop_token_ids=[stop_id], ignore_eos=True)
    prompts = [LLM_PROMPTS[3], LLM_PROMPTS[8], LLM_PROMPTS[0]]  # 33, 57 and 20 tokens: several chunks
    a = chunked.generate(prompts, params, use_tqdm=False)
    b = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    assert_kv_idle(chunked)


def test_repetition_penalty_equals_transformers(llm, hf):
    for prompt in LLM_PROMPTS[:3]:
        ref = hf_beams(hf, prompt, 3, 2, repetition_penalty=1.7, eos_token_id=None)
        out = llm.generate(prompt, beam_params(3, 2, repetition_penalty=1.7, ignore_eos=True), use_tqdm=False)
        assert [c.token_ids for c in out.outputs] == [t for t, _ in ref]


def test_logprobs_sum_to_the_cumulative_logprob(llm):
    out = llm.generate(LLM_PROMPTS[0], beam_params(4, 3, logprobs=2, ignore_eos=True), use_tqdm=False)
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry and 2 <= len(entry) <= 3
            assert max(entry.values()) <= 0.0
        assert sum(e[t] for t, e in zip(c.token_ids, c.logprobs)) == pytest.approx(
            c.cumulative_logprob, abs=1e-3
        )
    cums = [c.cumulative_logprob for c in out.outputs]
    assert cums == sorted(cums, reverse=True)  # length penalty 1 and equal lengths: best first


def test_beams_batched_with_other_requests(llm, hf_greedy_refs):
    """Beam requests share steps with greedy and sampled requests: the greedy ones keep transformers'
    tokens, the beam ones equal what they give alone, seeded sampling is unchanged."""
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    seeded = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=7)
    beams = beam_params(4, 2, ignore_eos=True)
    alone_beam = [llm.generate(p, beams, use_tqdm=False) for p in LLM_PROMPTS[:3]]
    alone_seeded = llm.generate(LLM_PROMPTS[4], seeded, use_tqdm=False)
    prompts = LLM_PROMPTS[:3] + LLM_PROMPTS[:3] + [LLM_PROMPTS[4]]
    params = [beams] * 3 + [greedy] * 3 + [seeded]
    outs = llm.generate(prompts, params, use_tqdm=False)
    refs = hf_greedy_refs("llama")
    for i in range(3):
        assert [c.token_ids for c in outs[i].outputs] == [c.token_ids for c in alone_beam[i].outputs]
        assert outs[3 + i].outputs[0].token_ids == refs[i]
    assert outs[6].outputs[0].token_ids == alone_seeded.outputs[0].token_ids
    assert_kv_idle(llm)


def test_overlap_mode_gives_the_same_beams(make_llm):
    overlap = make_llm(disable_overlap_scheduler=False)
    plain = make_llm(disable_overlap_scheduler=True)
    params = [beam_params(3, 3, ignore_eos=True), SamplingParams(max_tokens=12, temperature=0.0)] * 2
    prompts = [LLM_PROMPTS[0], LLM_PROMPTS[1], LLM_PROMPTS[3], LLM_PROMPTS[8]]
    a = overlap.generate(prompts, params, use_tqdm=False)
    b = plain.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    assert_kv_idle(overlap)


def test_beams_share_prompt_blocks_and_copy_the_partial_one(llm, monkeypatch):
    """The beams of a 20-token prompt (blocks of 8) share its two full blocks; its partial third block
    is copied once per other beam on the first decode step, and later copies only replace the last
    block of a beam whose parent is shared."""
    kv = llm.executor.kv_cache_manager
    copies: list[list[tuple[int, int]]] = []
    tables: list[list[list[int]]] = []
    real_copy = kv.copy_blocks
    real_prepare = kv.prepare_resources

    def record_copy(pairs):
        copies.append(list(pairs))
        real_copy(pairs)

    def record_prepare(batch):
        real_prepare(batch)
        for req in batch.generation_requests:
            if req.py_beam is not None:
                tables.append([kv.impl.get_block_ids(s) for s in req.py_beam.seq_ids])

    monkeypatch.setattr(kv, "copy_blocks", record_copy)
    monkeypatch.setattr(kv, "prepare_resources", record_prepare)
    prompt = LLM_PROMPTS[0]
    assert len(prompt) == 20
    llm.generate(prompt, beam_params(4, 4, ignore_eos=True), use_tqdm=False)
    first = tables[0]
    assert len(first) == 4
    assert all(t[:2] == first[0][:2] for t in first)  # the full prompt blocks: shared
    assert len({t[2] for t in first}) == 4  # the partial one: a copy per beam
    nonempty = [c for c in copies if c]
    # The first decode step copied the prompt's partial block (one source) for the three other beams.
    (src,) = {s for s, _ in nonempty[0]}
    assert len(nonempty[0]) == 3
    assert {src} | {d for _, d in nonempty[0]} == {t[2] for t in first}
    kv.impl.check_integrity()
    assert_kv_idle(llm)


def test_many_beam_requests_in_a_small_pool_all_finish(make_llm):
    """GUARANTEED_NO_EVICT with K beams per request (the planner reserves each request's beams, the
    copies of its partial prompt block included): a pool that holds a few at a time runs them all,
    nothing fails, nothing waits forever."""
    small = make_llm(kv_cache_config=KvCacheConfig(max_tokens=40 * LLM_TPB, tokens_per_block=LLM_TPB))
    params = beam_params(4, 1, max_new=12, ignore_eos=True)
    prompts = [LLM_PROMPTS[i % 5] for i in range(12)]
    outs = small.generate(prompts, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 12 for o in outs)
    alone = small.generate(prompts[:5], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:5]] == [o.outputs[0].token_ids for o in alone]
    assert_kv_idle(small)


def test_prompt_logprobs_with_beams(llm):
    plain = llm.generate(LLM_PROMPTS[1], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    beams = llm.generate(LLM_PROMPTS[1], beam_params(2, 1, prompt_logprobs=1), use_tqdm=False)
    assert beams.prompt_logprobs is not None and len(beams.prompt_logprobs) == len(LLM_PROMPTS[1])
    for a, b in zip(plain.prompt_logprobs[1:], beams.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)


def test_llm_beam_search_api(llm, hf):
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.beam_search([LLM_PROMPTS[0], LLM_PROMPTS[1]], params)
    assert len(outs) == 2
    for prompt, out in zip(LLM_PROMPTS[:2], outs):
        ref = hf_beams(hf, prompt, 3, 3, eos_token_id=None)
        assert len(out.sequences) == 3
        assert [s.tokens for s in out.sequences] == [prompt + t for t, _ in ref]
        assert all(isinstance(s.text, str) and s.cum_logprob < 0 for s in out.sequences)
    with pytest.raises(ValueError, match="beam_width must be >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)


def test_cancel_returns_the_beams_so_far_and_frees_the_kv(llm):
    stats = llm.get_stats()
    last_iter = stats[-1]["iter"] if stats else -1
    handle = llm.generate_async(LLM_PROMPTS[3], beam_params(4, 2, max_new=400, ignore_eos=True))
    # Abort as soon as an iteration has run it (a fixed sleep let a fast CPU finish all 400 steps).
    wait_until(
        lambda: any(s["iter"] > last_iter and s["num_scheduled_requests"] for s in llm.get_stats()),
        what="the beam request to run",
    )
    handle.abort()
    out = handle.result(timeout=TIMEOUT)
    assert all(c.finish_reason == "cancelled" for c in out.outputs)
    assert len(out.outputs) == 2
    assert_kv_idle(llm)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"best_of": 2, "n": 3}, r"best_of must be >= n \(3\), got 2"),
        ({"top_p": 0.9}, "top_p cannot be combined with use_beam_search=True, got 0.9"),
        ({"top_k": 5}, "top_k cannot be combined with use_beam_search"),
        ({"stop": "x"}, "stop cannot be combined with use_beam_search"),
        ({"presence_penalty": 0.5}, "presence_penalty cannot be combined"),
        ({"guided_decoding": GuidedDecodingParams(regex="a+")}, "guided_decoding cannot be combined"),
        ({"early_stopping": "sometimes"}, "early_stopping must be True, False or 'never', got 'sometimes'"),
        ({"length_penalty": float("nan")}, r"length_penalty must be in \[-1000, 1000\], got nan"),
    ],
)
def test_invalid_beam_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(use_beam_search=True, **kwargs)


def test_requests_the_engine_cannot_run_are_refused(llm, make_llm):
    with pytest.raises(RequestError, match="best_of .* must be <= max_beam_width=8, got 9") as e:
        llm.generate(LLM_PROMPTS[0], beam_params(9, 1), use_tqdm=False)
    assert e.value.param == "best_of"
    with pytest.raises(RequestError, match="use_beam_search cannot stream"):
        llm.generate_async(LLM_PROMPTS[0], beam_params(2, 1), streaming=True)
    small = make_llm(kv_cache_config=KvCacheConfig(max_tokens=128 * LLM_TPB, tokens_per_block=LLM_TPB))
    # 20 + 200 tokens: 2 shared blocks + 26 per beam; 4 beams fit in 128 blocks, 8 do not.
    out = small.generate(LLM_PROMPTS[0], beam_params(4, 1, max_new=200, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 200
    with pytest.raises(RequestError, match="needs 210 KV blocks of 8 tokens, more than the pool's 128"):
        small.generate(LLM_PROMPTS[0], beam_params(8, 1, max_new=200), use_tqdm=False)
    maxu = make_llm(scheduler_config=SchedulerConfig("max_utilization"))  # recompute preemption
    with pytest.raises(
        RequestError, match="MAX_UTILIZATION needs SchedulerConfig\\(preemption_mode='swap'\\)"
    ):
        maxu.generate(LLM_PROMPTS[0], beam_params(2, 1), use_tqdm=False)
    # Nothing of the refused requests reached the engine; it still serves.
    out = llm.generate(LLM_PROMPTS[0], beam_params(2, 2, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs) == 2
    assert_kv_idle(llm)
