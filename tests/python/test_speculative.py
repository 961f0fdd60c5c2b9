"""Speculative decoding end to end: the n-gram, prediction and draft-model drafters, verification,
the KV rewind, adaptive draft lengths, configuration errors and stats.

The reference for every greedy output is the same request without speculation (and transformers,
for the shared prompts of llm_utils); seeded sampling must match token for token; the draft model's
rejection sampling must keep the target's distribution (a chi-square test against the exact
distribution computed with transformers).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from llm_utils import LLM_MAX_NEW, LLM_PROMPTS, LLM_TPB, greedy

from inflight import KvCacheConfig, SamplingParams, SchedulerConfig, SpeculativeConfig
from inflight.executor.draft_cost import DRAFT_COSTS, DraftCost, MeasuredCost, best_draft_len
from inflight.executor.speculative import ngram_match

NGRAM = SpeculativeConfig(method="ngram", max_draft_len=4)
# Prompts that repeat themselves: n-gram drafts get accepted (random tiny models also loop).
REPEATING = [p * 3 for p in LLM_PROMPTS[:3]] + [LLM_PROMPTS[3][:10] * 4]


def _ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _spec_totals(llm) -> dict:
    return llm.get_stats()[-1]["spec_decode"]


def _assert_kv_clean(llm) -> None:
    kv = llm.executor.kv_cache_manager.impl
    kv.check_integrity()
    assert kv.num_sequences == 0
    assert kv.num_used_blocks == 0


# ---------------------------------------------------------------------------------------------- n-gram


def test_ngram_match_prefers_the_longest_suffix_then_the_latest_place():
    h = np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7], dtype=np.int64)
    # Suffix (6, 7) occurs at 1 and 5; the latest (5) proposes 9, 2, ...
    tokens, start = ngram_match(h, None, 1, 4, 3)
    assert tokens.tolist() == [9, 2, 6] and start == 7
    # A longer suffix wins over a later short one: (1, 6, 7) ... here (8, 1, 6, 7)? no -- (2, 6, 7) is
    # not earlier, so the search falls back to length 2.
    h2 = np.array([3, 6, 7, 4, 4, 9, 6, 7, 5, 3, 6, 7], dtype=np.int64)
    tokens, _ = ngram_match(h2, None, 1, 4, 2)
    assert tokens.tolist() == [4, 4]  # (3, 6, 7) matched at 0, not (6, 7) at 6
    # No match at all, and a minimum length that cannot be met.
    assert ngram_match(np.array([1, 2, 3]), None, 1, 4, 4)[1] == -1
    assert ngram_match(np.array([1, 2, 1]), None, 2, 4, 4)[1] == -1
    # k caps the proposal; the proposal never runs past the end.
    assert ngram_match(np.array([1, 2, 3, 1]), None, 1, 1, 9)[0].tolist() == [2, 3, 1]


def test_ngram_match_in_another_corpus_follows_the_cursor():
    corpus = np.array([1, 2, 3, 9, 1, 2, 4, 8], dtype=np.int64)
    h = np.array([7, 1, 2], dtype=np.int64)
    assert ngram_match(h, corpus, 1, 4, 2, cursor=0)[0].tolist() == [3, 9]
    assert ngram_match(h, corpus, 1, 4, 2, cursor=5)[0].tolist() == [4, 8]
    assert ngram_match(h, corpus, 1, 4, 2, cursor=8)[0].tolist() == [4, 8]  # none after: the last


def test_the_draft_length_maximises_the_expected_gain():
    cost = DraftCost(first=0.5, per_token=0.15, tile=8, batch_row=0.4, batch_draft=0.25)
    assert cost.of(0) == 0 and cost.of(1) == 0.5 and cost.of(3) == pytest.approx(0.8)
    assert cost.of(8) == pytest.approx(0.5 + 0.15 * 7 + 0.5)  # 9 rows: a second tile
    assert cost.of(2, batch=8) == pytest.approx(2 * 0.25 * 8 / (1 + 0.4 * 7))
    # Brute force over k of sum(a^j) - cost: the same choice.
    for a in (0.0, 0.3, 0.5, 0.51, 0.7, 0.8, 0.95, 1.0):
        for cap in (0, 1, 4, 8, 12):
            for batch in (1, 2, 8, 64):
                values = [sum(a**j for j in range(1, k + 1)) - cost.of(k, batch) for k in range(cap + 1)]
                best = max(range(cap + 1), key=lambda k: (values[k] > 1e-12, values[k], -k))
                assert best_draft_len(a, cap, cost, batch) == (best if values[best] > 1e-12 else 0)
    cpu = DRAFT_COSTS["cpu"]
    assert best_draft_len(0.4, 8, cpu) == 0  # below the CPU's break-even: no drafts
    assert best_draft_len(0.9, 4, cpu) == 4
    assert best_draft_len(0.9, 8, cpu) == 7  # 9 rows would start a second tile
    assert (
        best_draft_len(0.55, 4, cpu, batch=16) == 0 < best_draft_len(0.55, 4, DRAFT_COSTS["cuda"], batch=16)
    )


def test_the_measured_cost_replaces_the_model_once_sampled():
    static = DRAFT_COSTS["cpu"]
    cost = MeasuredCost(static)
    for _ in range(MeasuredCost.MIN_SAMPLES - 1):
        cost.observe(0, 0.010)
        cost.observe(4, 0.012)
    assert cost.of(4) == static.of(4)  # too few samples: the model
    cost.observe(0, 0.010)
    cost.observe(4, 0.012)
    assert cost.of(4) == pytest.approx(0.2)  # 12 ms against 10 ms
    assert cost.of(3) == static.of(3) and cost.of(4, batch=4) == static.of(4, batch=4)
    # The cheaper measured rows make drafting pay where the model said it would not.
    assert best_draft_len(0.4, 4, static) == 0 < best_draft_len(0.4, 4, cost)
    for _ in range(200):  # the average follows a change
        cost.observe(4, 0.030)
    assert cost.of(4) == pytest.approx(2.0, rel=0.05)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
def test_ngram_greedy_matches_transformers_and_no_speculation(make_llm, hf_greedy_refs, chunked):
    kwargs = {"enable_chunked_prefill": True, "max_num_tokens": 16} if chunked else {}
    llm = make_llm(speculative_config=NGRAM, **kwargs)
    # Parents first, so that the reuse of their blocks is exercised by the children.
    outs = _ids(llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False))
    assert outs == hf_greedy_refs("llama")
    rep = _ids(llm.generate(REPEATING, greedy(48), use_tqdm=False))
    totals = _spec_totals(llm)
    assert totals["num_accepted_tokens_total"] > 0, "no draft was ever accepted: the test shows nothing"
    assert totals["num_accepted_tokens_total"] <= totals["num_draft_tokens_total"]
    kv_hits = llm.get_stats()[-1]["kv_cache_stats"]["cache_hit_rate"]
    assert kv_hits > 0  # prefix reuse took part
    _assert_kv_clean(llm)
    base = make_llm(**kwargs)
    assert rep == _ids(base.generate(REPEATING, greedy(48), use_tqdm=False))


def test_ngram_greedy_with_preemption_is_unchanged(make_llm):
    """A pool of 12 blocks x 8 tokens for 4 requests of ~40 tokens each: requests are paused and
    recomputed, drafts and all."""
    kv = KvCacheConfig(max_tokens=12 * LLM_TPB, tokens_per_block=LLM_TPB, enable_block_reuse=False)
    sched = SchedulerConfig(capacity_scheduler_policy="MAX_UTILIZATION")
    prompts = [p[:12] * 2 for p in (LLM_PROMPTS[0], LLM_PROMPTS[3], LLM_PROMPTS[8], LLM_PROMPTS[1] * 2)]
    base = make_llm(kv_cache_config=kv, scheduler_config=sched)
    ref = _ids(base.generate(prompts, greedy(40), use_tqdm=False))
    assert sum(s["num_paused_requests"] for s in base.get_stats()) > 0, (
        "no preemption: the test shows nothing"
    )
    llm = make_llm(kv_cache_config=kv, scheduler_config=sched, speculative_config=NGRAM)
    assert _ids(llm.generate(prompts, greedy(40), use_tqdm=False)) == ref
    assert sum(s["num_paused_requests"] for s in llm.get_stats()) > 0
    assert _spec_totals(llm)["num_draft_tokens_total"] > 0
    _assert_kv_clean(llm)


def test_seeded_sampling_is_the_same_with_and_without_speculation(make_llm):
    """Sampled rows are verified with the request's own keyed draw at each position: the n-gram
    drafter's drafts, and a prediction of the very output (so that drafts get accepted: random tiny
    models rarely repeat themselves when sampling), change no token."""
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_tokens=40, ignore_eos=True)
        for i in range(len(REPEATING))
    ]
    # A penalised and a min_tokens row: the per-position states must see the drafts as history.
    params[0] = params[0].replace(repetition_penalty=1.3, frequency_penalty=0.4)
    params[1] = params[1].replace(temperature=0.0, presence_penalty=0.5, min_tokens=30, ignore_eos=False)
    base = make_llm()
    ref = base.generate(REPEATING, params, use_tqdm=False)
    llm = make_llm(speculative_config=NGRAM)
    assert _ids(llm.generate(REPEATING, params, use_tqdm=False)) == _ids(ref)
    assert _spec_totals(llm)["num_draft_tokens_total"] > 0
    predicted = [p.replace(prediction=r.outputs[0].text) for p, r in zip(params, ref)]
    assert _ids(llm.generate(REPEATING, predicted, use_tqdm=False)) == _ids(ref)
    assert _spec_totals(llm)["num_accepted_tokens_total"] > 40


def test_logprobs_are_those_of_the_run_without_speculation(make_llm):
    p = greedy(30, logprobs=2)
    base = make_llm().generate(REPEATING[:2], p, use_tqdm=False)
    spec = make_llm(speculative_config=NGRAM).generate(REPEATING[:2], p, use_tqdm=False)
    for a, b in zip(base, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t] == pytest.approx(lb[t], abs=1e-4)


def test_opt_out_and_adaptive_backoff(make_llm):
    llm = make_llm(speculative_config=NGRAM)
    llm.generate(REPEATING, greedy(40, speculative=False), use_tqdm=False)
    assert _spec_totals(llm)["num_draft_tokens_total"] == 0
    # Random prompts with nothing to look up: drafts fail and the requests stop drafting for a while.
    out = llm.generate(LLM_PROMPTS, greedy(60), use_tqdm=False)
    stats = llm.get_stats()
    drafting_steps = sum(s["spec_decode"]["num_requests_with_drafts"] for s in stats)
    request_steps = sum(s["num_generation_requests"] for s in stats)
    assert drafting_steps < request_steps, "every step drafted: nothing adapted"
    assert all(len(o.outputs[0].token_ids) == 60 for o in out)


# ---------------------------------------------------------------------------------------------- stops


@pytest.fixture
def echo_draft_llm(make_llm, tiny_model_dir):
    """An engine whose draft model is the target itself: every greedy draft is accepted, so each step
    appends 1 + k tokens and stops fall inside the accepted drafts."""

    def make(**kwargs):
        cfg = SpeculativeConfig(
            method="draft_model", draft_model=str(tiny_model_dir("llama")), max_draft_len=4
        )
        return make_llm(speculative_config=cfg, **kwargs)

    return make


def test_stop_token_and_stop_string_inside_accepted_drafts(make_llm, echo_draft_llm):
    prompt = LLM_PROMPTS[0]
    base = make_llm()
    full = base.generate(prompt, greedy(20), use_tqdm=False).outputs[0]
    llm = echo_draft_llm()
    # Position 2 is produced by the first speculative step (positions 1-5): inside its drafts.
    stop_tok = full.token_ids[2]
    first = full.token_ids.index(stop_tok)
    out = llm.generate(prompt, greedy(20, stop_token_ids=[stop_tok]), use_tqdm=False).outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # A stop string that ends inside the drafts' text: the same text and tokens as without drafts.
    text = full.text
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    if not stop.strip():
        stop = text[1:3]
    want = base.generate(prompt, greedy(20, stop=[stop]), use_tqdm=False).outputs[0]
    got = llm.generate(prompt, greedy(20, stop=[stop]), use_tqdm=False).outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert want.finish_reason == "stop"
    totals = _spec_totals(llm)
    assert totals["num_accepted_tokens_total"] == totals["num_draft_tokens_total"] > 0
    _assert_kv_clean(llm)


def test_eos_inside_accepted_drafts(make_llm, tiny_model_dir):
    """The same weights with EOS set to a token the model produces at position 3 (inside the first
    speculative step's accepted drafts, with the model as its own draft): the output ends there."""
    ref = make_llm().generate(LLM_PROMPTS[0], greedy(20), use_tqdm=False).outputs[0].token_ids
    eos = ref[3]
    path = tiny_model_dir("llama", with_tokenizer=False, eos_token_id=eos)
    cfg = SpeculativeConfig(method="draft_model", draft_model=str(path), max_draft_len=4)
    llm = make_llm(model=path, speculative_config=cfg)
    out = llm.generate(LLM_PROMPTS[0], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False).outputs[
        0
    ]
    assert out.token_ids == ref[: ref.index(eos) + 1]
    assert out.finish_reason == "stop"
    assert _spec_totals(llm)["num_accepted_tokens_total"] > 0
    _assert_kv_clean(llm)


@pytest.mark.parametrize("max_tokens", [1, 2, 6, 7, 13])
def test_max_tokens_and_max_seq_len_cap_the_drafts(make_llm, echo_draft_llm, max_tokens):
    prompt = LLM_PROMPTS[1]
    ref = make_llm().generate(prompt, greedy(max_tokens), use_tqdm=False).outputs[0].token_ids
    llm = echo_draft_llm(max_seq_len=len(prompt) + 9)
    out = llm.generate(prompt, greedy(min(max_tokens, 9)), use_tqdm=False).outputs[0]
    assert out.token_ids == ref[:9]
    assert out.finish_reason == "length"
    _assert_kv_clean(llm)


# ---------------------------------------------------------------------------------------------- draft model


def test_draft_model_greedy_is_unchanged_with_a_weak_and_a_perfect_draft(
    make_llm, tiny_model_dir, hf_greedy_refs
):
    weak = tiny_model_dir("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    perfect = tiny_model_dir("llama")
    for path in (weak, perfect):
        cfg = SpeculativeConfig(method="draft_model", draft_model=str(path), max_draft_len=3)
        llm = make_llm(speculative_config=cfg, enable_chunked_prefill=True, max_num_tokens=24)
        assert _ids(llm.generate(LLM_PROMPTS, greedy(), use_tqdm=False)) == hf_greedy_refs("llama")
        totals = _spec_totals(llm)
        assert totals["num_draft_tokens_total"] > 0
        if path == perfect:
            assert totals["num_accepted_tokens_total"] == totals["num_draft_tokens_total"]
        _assert_kv_clean(llm)
        draft_kv = llm.executor.speculator.drafter.kv.impl
        draft_kv.check_integrity()
        assert draft_kv.num_sequences == 0


def _wilson_hilferty_chi2(df: int, z: float = 3.09) -> float:
    """The chi-square critical value at one-sided normal quantile z (3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_draft_model_rejection_sampling_keeps_the_target_distribution(make_llm, tiny_model_dir):
    """Tokens 2 and 3 of a sampled request come out of the rejection rule (token 1 comes from the
    prefill). Their empirical distribution over 1600 seeded requests must fit the exact marginal
    distribution of the target, computed with transformers over every possible earlier token."""
    from model_utils import load_hf_reference

    vocab = 48
    target = tiny_model_dir("llama", with_tokenizer=False, vocab_size=vocab, init_std=0.05)
    draft = tiny_model_dir(
        "llama", with_tokenizer=False, vocab_size=vocab, num_hidden_layers=1, seed=5, init_std=0.3
    )
    prompt = [3, 17, 9, 30, 22]
    temp = 1.0
    hf = load_hf_reference(target, torch.float32)
    with torch.no_grad():
        p0 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temp, -1).double()
        seqs = torch.tensor([[*prompt, t] for t in range(vocab)])
        p1_given = torch.softmax(hf(seqs).logits[:, -1] / temp, -1).double()  # [t0, t1]
        p1 = p0 @ p1_given
        seqs2 = torch.tensor([[*prompt, a, b] for a in range(vocab) for b in range(vocab)])
        p2_given = torch.softmax(hf(seqs2).logits[:, -1] / temp, -1).double().view(vocab, vocab, vocab)
        p2 = torch.einsum("a,ab,abc->c", p0, p1_given, p2_given)
    dhf = load_hf_reference(draft, torch.float32)
    with torch.no_grad():
        q1_given = torch.softmax(dhf(seqs).logits[:, -1] / temp, -1).double()
    n = 1600
    cfg = SpeculativeConfig(method="draft_model", draft_model=str(draft), max_draft_len=2)
    llm = make_llm(model=target, speculative_config=cfg, max_batch_size=256)
    params = [
        SamplingParams(temperature=temp, seed=1000 + i, max_tokens=3, ignore_eos=True) for i in range(n)
    ]
    toks = np.array(_ids(llm.generate([prompt] * n, params, use_tqdm=False)))
    totals = _spec_totals(llm)
    assert 0 < totals["num_accepted_tokens_total"] < totals["num_draft_tokens_total"], totals

    def chi2(samples: np.ndarray, expected_p: torch.Tensor) -> tuple[float, float]:
        counts = np.bincount(samples, minlength=vocab).astype(np.float64)
        exp = expected_p.numpy() * len(samples)
        keep = exp >= 5  # pool the rare tokens into one bin
        obs, ex = counts[keep], exp[keep]
        if (~keep).any():
            obs, ex = np.append(obs, counts[~keep].sum()), np.append(ex, exp[~keep].sum())
        stat = float(((obs - ex) ** 2 / ex).sum())
        return stat, _wilson_hilferty_chi2(len(ex) - 1)

    for pos, exact in ((1, p1), (2, p2)):
        stat, crit = chi2(toks[:, pos], exact)
        assert stat < crit, (
            f"token {pos + 1}: chi-square {stat:.1f} >= {crit:.1f}: not the target's distribution"
        )
    # The test can fail: the draft's own distribution for token 2 is far from the target's.
    q1 = p0 @ q1_given
    power = float(n * (((q1 - p1) ** 2) / p1).sum())
    assert power > 2 * _wilson_hilferty_chi2(vocab - 1), "the draft is too close to the target to tell"


# ---------------------------------------------------------------------------------------------- prediction


def test_prediction_drafts_from_the_predicted_text(make_llm):
    llm = make_llm()  # no speculative config: a prediction drafts anyway
    prompt = LLM_PROMPTS[3]
    ref = llm.generate(prompt, greedy(40), use_tqdm=False).outputs[0]
    before = _spec_totals(llm)["num_accepted_tokens_total"]
    out = llm.generate(prompt, greedy(40, prediction=ref.text), use_tqdm=False).outputs[0]
    assert out.token_ids == ref.token_ids
    totals = _spec_totals(llm)
    # The tiny tokenizer's round trip through text may merge tokens differently: most are accepted.
    assert totals["num_accepted_tokens_total"] - before > 20
    # A wrong prediction changes nothing either.
    wrong = llm.generate(prompt, greedy(40, prediction="zzzz qqqq " * 10), use_tqdm=False).outputs[0]
    assert wrong.token_ids == ref.token_ids
    _assert_kv_clean(llm)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"method": "ngram", "max_draft_len": -1},
            "SpeculativeConfig.max_draft_len must be an integer in [1, 32]",
        ),
        ({"method": "ngram", "max_draft_len": 0}, "SpeculativeConfig.max_draft_len"),
        ({"method": "draft_model"}, "SpeculativeConfig.draft_model is required"),
        ({"method": "beam"}, "SpeculativeConfig.method must be None or one of"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min must be <="),
        ({"method": "ngram", "draft_model": "x"}, "draft_model must be None with method='ngram'"),
    ],
)
def test_bad_configurations_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig(**kwargs)


def test_a_draft_model_with_another_vocabulary_is_refused(make_llm, tiny_model_dir):
    other = tiny_model_dir("llama", with_tokenizer=False, vocab_size=256)
    cfg = SpeculativeConfig(draft_model=str(other))
    assert cfg.method == "draft_model"
    with pytest.raises(ValueError, match="vocabulary of 256 tokens, the target model 384"):
        make_llm(speculative_config=cfg)


def test_sampling_params_fields_are_checked():
    with pytest.raises(ValueError, match="speculative must be a bool"):
        SamplingParams(speculative=1)
    with pytest.raises(ValueError, match="prediction must be a str"):
        SamplingParams(prediction=[1, 2])


def test_a_failing_drafter_costs_the_drafts_only(make_llm, tiny_model_dir, monkeypatch):
    from inflight.executor.draft_model import DraftModelDrafter

    cfg = SpeculativeConfig(method="draft_model", draft_model=str(tiny_model_dir("llama")), max_draft_len=3)
    llm = make_llm(speculative_config=cfg)
    want = _ids(make_llm().generate(LLM_PROMPTS[:4], greedy(), use_tqdm=False))
    calls = {"n": 0}
    real = DraftModelDrafter.propose

    def flaky(self, requests, max_lens):
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("draft model out of memory")
        return real(self, requests, max_lens)

    monkeypatch.setattr(DraftModelDrafter, "propose", flaky)
    assert _ids(llm.generate(LLM_PROMPTS[:4], greedy(), use_tqdm=False)) == want
    assert calls["n"] > 2 and llm.is_alive
    assert _spec_totals(llm)["num_accepted_tokens_total"] > 0
    _assert_kv_clean(llm)
    assert llm.executor.speculator.drafter.kv.impl.num_sequences == 0


def test_stats_entries(make_llm):
    llm = make_llm(speculative_config=NGRAM)
    llm.generate(REPEATING[:2], greedy(LLM_MAX_NEW), use_tqdm=False)
    entries = [s["spec_decode"] for s in llm.get_stats()]
    assert set(entries[-1]) == {
        "num_draft_tokens",
        "num_accepted_tokens",
        "num_requests_with_drafts",
        "num_draft_tokens_total",
        "num_accepted_tokens_total",
    }
    assert sum(e["num_draft_tokens"] for e in entries) == entries[-1]["num_draft_tokens_total"]
    assert sum(e["num_accepted_tokens"] for e in entries) == entries[-1]["num_accepted_tokens_total"]
    assert all(e["num_accepted_tokens"] <= e["num_draft_tokens"] for e in entries)


# ---------------------------------------------------------------------------------------------- server, CLI


def test_cli_flags_build_the_speculative_config():
    import argparse

    from inflight.llm_args import LlmArgs, add_cli_arguments

    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = LlmArgs.from_cli(
        parser.parse_args(
            ["--speculative-method", "ngram", "--max-draft-len", "6", "--prompt-lookup-max", "3"]
        ),
        model="m",
    )
    assert args.speculative_config == SpeculativeConfig(method="ngram", max_draft_len=6, prompt_lookup_max=3)
    args = LlmArgs.from_cli(parser.parse_args(["--draft-model", "/x/draft"]), model="m")
    assert (
        args.speculative_config.method == "draft_model" and args.speculative_config.draft_model == "/x/draft"
    )
    assert not LlmArgs.from_cli(parser.parse_args([]), model="m").speculative_config.enabled
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-method", "medusa"])


def test_server_prediction_usage_and_metrics(tiny_model_dir):
    from serve_utils import LiveServer

    from inflight import LLM

    llm = LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        kv_cache_config=KvCacheConfig(max_tokens=8192, tokens_per_block=LLM_TPB),
        speculative_config=NGRAM,
    )
    server = LiveServer(llm)
    try:
        client = server.client()
        messages = [{"role": "user", "content": "hello there"}]
        extra = {"ignore_eos": True}
        ref = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=30, temperature=0, extra_body=extra
        )
        assert (
            ref.usage.completion_tokens_details is None
            or not ref.usage.completion_tokens_details.accepted_prediction_tokens
        )
        text = ref.choices[0].message.content
        got = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=30,
            temperature=0,
            prediction={"type": "content", "content": text},
            extra_body=extra,
        )
        assert got.choices[0].message.content == text
        details = got.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0  # random tokens re-encode loosely from text
        assert details.rejected_prediction_tokens >= 0
        # The streamed form reports the same usage; content given as text parts.
        stream = list(
            client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=30,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                prediction={"type": "content", "content": [{"type": "text", "text": text}]},
                extra_body=extra,
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
        # (How many drafts a step carries follows measured step times: the counts may differ a little.)
        streamed = stream[-1].usage.completion_tokens_details
        assert streamed.accepted_prediction_tokens > 0 and streamed.rejected_prediction_tokens >= 0
        # Completions accept it too.
        comp = server.http.post(
            "/v1/completions",
            json={"prompt": "abc", "max_tokens": 8, "prediction": {"type": "content", "content": "x y z"}},
        )
        assert comp.status_code == 200 and "completion_tokens_details" in comp.json()["usage"]
        for bad in (
            {"type": "text", "content": "x"},
            {"type": "content", "content": [{"type": "image"}]},
            "x",
        ):
            resp = server.http.post(
                "/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "prediction": bad}
            )
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["param"] == "prediction"
        server.wait_idle()
        m = server.metrics()
        assert (
            m["inflight:spec_decode_num_draft_tokens_total"]
            >= m["inflight:spec_decode_num_accepted_tokens_total"]
        )
        assert m["inflight:spec_decode_num_accepted_tokens_total"] >= (
            details.accepted_prediction_tokens + streamed.accepted_prediction_tokens
        )
    finally:
        server.stop()
        llm.shutdown()
