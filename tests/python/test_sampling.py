"""SamplingParams validation and the batched Sampler, against plain per-row reference code."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from inflight.executor.sampler import Sampler, SamplerOutput, SamplingState
from inflight.sampling_params import SamplingParams

V = 50
EOS = 7

# Chi-square critical values at alpha = 1e-3 by degrees of freedom. The draws use fixed seeds, so
# the tests are deterministic; the bound only says a correct sampler passes for almost any seed.
CHI2_CRIT_1E3 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46}


def state(prompt=(), output=(), eos=(EOS,), vocab=V, **kw) -> SamplingState:
    s = SamplingState.create(SamplingParams(**kw), vocab, list(prompt), eos)
    s.extend(output)
    return s


def fixed_logits(n: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    expected = probs.double() * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "draws outside the support"
    return (((counts.double() - expected) ** 2)[keep] / expected[keep]).sum().item()


# ---------------------------------------------------------------------------------------------
# Plain reference code: one row at a time, Python loops, float64.
# ---------------------------------------------------------------------------------------------


def ref_penalties(row, prompt, output, rep, freq, pres):
    out = row.double().clone()
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        v = out[t].item()
        if t in seen:
            v = v / rep if v > 0 else v * rep
        c = list(output).count(t)
        v -= freq * c
        v -= pres * (1 if c > 0 else 0)
        out[t] = v
    return out


def ref_filters(row, temperature, top_k, top_p, min_p):
    x = row.double() / temperature
    vocab = len(x)
    order = sorted(range(vocab), key=lambda t: (-x[t].item(), t))
    kept = order[:top_k] if top_k > 0 else order
    if top_p < 1:
        z = torch.tensor([x[t].item() for t in kept], dtype=torch.float64)
        p = torch.softmax(z, 0).tolist()
        new, mass = [], 0.0
        for t, pt in zip(kept, p):
            if mass >= top_p:
                break
            new.append(t)
            mass += pt
        kept = new
    if min_p > 0:
        z = torch.tensor([x[t].item() for t in kept], dtype=torch.float64)
        p = torch.softmax(z, 0)
        kept = [t for t, pt in zip(kept, p.tolist()) if pt >= min_p * p.max().item()]
    out = torch.full_like(x, -math.inf)
    for t in kept:
        out[t] = x[t]
    return out


# ---------------------------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------------------------


def test_params_defaults_and_normalization():
    p = SamplingParams()
    assert p.max_tokens is None and p.min_tokens == 0 and p.temperature == 1.0 and p.top_k == 0
    assert p.stop == () and p.stop_token_ids == () and p.logprobs is None and p.n == 1
    assert not p.greedy and not p.has_penalties
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=2).temperature == 2.0 and isinstance(
        SamplingParams(temperature=2).temperature, float
    )
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5
    hash(SamplingParams(stop=["x"], stop_token_ids=[1]))  # frozen and normalized: hashable


def test_params_frozen_replace_and_unknown_field():
    p = SamplingParams(temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
    q = p.replace(top_p=0.9)
    assert q.top_p == 0.9 and q.temperature == 0.5 and p.top_p == 1.0
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        p.replace(top_p=1.5)
    with pytest.raises(TypeError, match="num_beams"):
        SamplingParams(num_beams=2)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"best_of must equal n \(1\) without use_beam_search"):
        SamplingParams(best_of=2)


BAD_PARAMS = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.5),
    ("max_tokens", "3"),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("min_tokens", 1.0),
    ("ignore_eos", 1),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "0.7"),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3),
    ("frequency_penalty", -2.5),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.5),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", 3),
    ("include_stop_str_in_output", "yes"),
    ("logprobs", -1),
    ("logprobs", True),
    ("logprobs", 2.0),
    ("n", 0),
    ("n", 1.5),
    ("skip_special_tokens", None),
    ("detokenize", 0),
]


@pytest.mark.parametrize(("name", "value"), BAD_PARAMS, ids=[f"{n}={v!r}" for n, v in BAD_PARAMS])
def test_params_rejects_bad_values(name, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{name: value})
    msg = str(err.value)
    assert msg.startswith(name + " must be"), msg
    assert msg.endswith(f"got {value!r}"), msg


def test_params_errors_name_the_allowed_range():
    cases = {
        "top_p must be in (0, 1], got 1.5": {"top_p": 1.5},
        "min_p must be in [0, 1], got -0.5": {"min_p": -0.5},
        "temperature must be in [0, 8.507e+37], got -1.0": {"temperature": -1.0},
        "presence_penalty must be in [-2, 2], got 2.5": {"presence_penalty": 2.5},
        "repetition_penalty must be in [1e-06, 1e+06], got 0.0": {"repetition_penalty": 0.0},
        "logprobs must be >= 0 (or None), got -1": {"logprobs": -1},
        "max_tokens must be an int >= 1 (or None), got 2.5": {"max_tokens": 2.5},
        "min_tokens must be <= max_tokens (3), got 4": {"max_tokens": 3, "min_tokens": 4},
    }
    for message, kw in cases.items():
        with pytest.raises(ValueError) as err:
            SamplingParams(**kw)
        assert str(err.value) == message


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("top_p", 1e-300),  # becomes 0 in float32: the kernel would refuse it mid-step
        ("top_p", 1e-40),  # a float32 subnormal, which kernels may flush to zero
        ("min_p", 1e-42),
        ("temperature", 3.5e38),  # becomes inf in float32
        ("temperature", 1e38),  # its reciprocal is a float32 subnormal
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 1e300),
    ],
)
def test_params_rejects_what_float32_cannot_hold(name, value):
    """The sampler computes in float32: a value that under- or overflows there is refused here,
    naming the field, instead of failing the step it lands in."""
    with pytest.raises(ValueError) as err:
        SamplingParams(**{name: value})
    msg = str(err.value)
    assert msg.startswith(f"{name} must be") and msg.endswith(f"got {value!r}"), msg
    # The smallest normal float32 and the largest allowed temperature still work.
    SamplingParams(top_p=2.0**-126, min_p=2.0**-126, temperature=2.0**126, repetition_penalty=1e-6)


def test_params_rejects_n_with_greedy():
    with pytest.raises(ValueError, match=r"^n must be 1 with greedy sampling .*got 2$"):
        SamplingParams(n=2, temperature=0.0)
    assert SamplingParams(n=3, temperature=0.8).n == 3


def test_state_rejects_ids_outside_vocab():
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 50\).*\[50\]"):
        state(stop_token_ids=[3, 50])
    with pytest.raises(ValueError, match="eos_token_ids"):
        state(eos=(99,))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        state(prompt=[1, 60], repetition_penalty=1.2)


# ---------------------------------------------------------------------------------------------
# Greedy and the fast path
# ---------------------------------------------------------------------------------------------


def test_greedy_is_argmax_exactly_including_ties():
    logits = fixed_logits(17, 97)
    logits[3, [5, 40, 90]] = 100.0  # ties: the first index wins, as torch.argmax
    states = [state(vocab=97, temperature=0.0) for _ in range(17)]
    states[5] = state(vocab=97, top_k=1, temperature=0.7)  # top_k == 1 is greedy too
    out = Sampler(97).sample(logits, states)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids[3] == 5 and out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_slow_path_matches_fast_path_and_ignores_padding():
    logits = fixed_logits(4, 64)
    logits[:, 50:] = 1e4  # embedding padding beyond the vocabulary is never sampled
    fast = Sampler(V).sample(logits, [state(temperature=0.0) for _ in range(4)])
    # logprobs leaves the fast path; the tokens must not change.
    slow = Sampler(V).sample(logits, [state(temperature=0.0, logprobs=0, eos=()) for _ in range(4)])
    assert torch.equal(fast.token_ids, logits[:, :V].argmax(-1))
    assert torch.equal(slow.token_ids, fast.token_ids)


def test_sampler_does_not_modify_logits():
    logits = fixed_logits(3)
    before = logits.clone()
    states = [
        state(prompt=[1, 2], output=[3], repetition_penalty=1.5, frequency_penalty=0.5, temperature=0.0),
        state(min_tokens=4, temperature=0.7, top_p=0.8, seed=3),
        state(top_k=5, min_p=0.1, logprobs=3),
    ]
    Sampler(V).sample(logits, states)
    assert torch.equal(logits, before)


def test_bf16_logits():
    logits = fixed_logits(3).to(torch.bfloat16)
    out = Sampler(V).sample(logits, [state(temperature=0.0, logprobs=2) for _ in range(3)])
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    assert out.logprobs.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Penalties and min_tokens
# ---------------------------------------------------------------------------------------------


def test_penalties_match_per_row_formula():
    logits = fixed_logits(6)
    rows = [
        {"prompt": [1, 2, 2, 30], "output": [2, 5, 5, 5, 40], "repetition_penalty": 1.3},
        {"prompt": [9], "output": [9, 9, 11], "frequency_penalty": 0.7},
        {"prompt": [4], "output": [3, 3, 12], "presence_penalty": -1.5},
        {
            "prompt": [],
            "output": [0, 49, 49],
            "repetition_penalty": 0.6,
            "frequency_penalty": -0.4,
            "presence_penalty": 1.1,
        },
        {"prompt": [8, 8], "output": [], "repetition_penalty": 2.0, "presence_penalty": 2.0},  # no output yet
        {"prompt": [1], "output": [1, 2]},  # no penalties: untouched, mixed into a penalized batch
    ]
    states = [state(**r, temperature=0.0) for r in rows]
    got = Sampler(V).process_logits(logits, states)
    for i, r in enumerate(rows):
        want = ref_penalties(
            logits[i],
            r["prompt"],
            r["output"],
            r.get("repetition_penalty", 1.0),
            r.get("frequency_penalty", 0.0),
            r.get("presence_penalty", 0.0),
        )
        torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-5)
    assert torch.equal(got[5], logits[5])
    # The greedy token is the argmax of the penalized logits.
    assert torch.equal(Sampler(V).sample(logits, states).token_ids, got.argmax(-1))


def test_penalty_counts_follow_appends():
    s = state(prompt=[], frequency_penalty=1.0, temperature=0.0)
    logits = torch.zeros(1, V)
    logits[0, 10] = 2.5
    sampler = Sampler(V)
    tokens = []
    for _ in range(6):
        t = sampler.sample(logits, [s]).token_ids.item()
        tokens.append(t)
        s.append(t)
    # 10 leads until penalized below 0 by three uses: 2.5 -> 1.5 -> 0.5 -> -0.5, then token 0.
    assert tokens[:4] == [10, 10, 10, 0]
    assert s.output_token_ids == tokens and s.num_generated == 6
    s.extend(range(40))  # the buffer grows past its initial size
    assert s.output_token_ids == tokens + list(range(40))


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, V)
    logits[:, EOS] = 10.0
    logits[:, 20] = 9.0
    logits[:, 21] = 8.0
    states = [
        state(min_tokens=2, temperature=0.0),
        state(min_tokens=2, temperature=0.0, stop_token_ids=[20]),
        state(min_tokens=2, temperature=0.0, stop_token_ids=[20], ignore_eos=True),
        state(min_tokens=0, temperature=0.0, stop_token_ids=[20]),
    ]
    sampler = Sampler(V)
    steps = []
    for _ in range(3):
        x = sampler.process_logits(logits, states)
        steps.append(sampler.sample(logits, states).token_ids.tolist())
        for i, s in enumerate(states):
            masked = set(torch.nonzero(torch.isinf(x[i])).flatten().tolist())
            pending = s.num_generated < s.params.min_tokens
            want = set()
            if pending:
                want = set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else {EOS})
            assert masked == want, (i, s.num_generated)
        for s, t in zip(states, steps[-1]):
            s.append(t)
    # ignore_eos: EOS stops nothing, so min_tokens does not mask it and it can be sampled.
    assert steps == [[20, 21, EOS, EOS], [20, 21, EOS, EOS], [EOS, EOS, EOS, EOS]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_min_tokens_rows_equal_the_masked_argmax(dtype):
    # The all-greedy fast path argmaxes the raw logits and redoes only the rows whose argmax is a
    # masked id: each row must equal the argmax of the fully processed (masked) logits, ties included.
    g = torch.Generator().manual_seed(5)
    sampler = Sampler(V)
    for trial in range(40):
        n = 6
        logits = (torch.randint(-3, 4, (n, V), generator=g).float()).to(dtype)  # many ties
        hot = torch.randint(0, n, (3,), generator=g).tolist()
        logits[hot, EOS] = 9.0  # some rows want EOS while it is masked
        logits[hot[0], 20] = 9.0  # a tie between a masked id and a stop id
        states = [
            state(min_tokens=3, temperature=0.0, stop_token_ids=[20]),
            state(min_tokens=3, temperature=0.0),
            state(min_tokens=0, temperature=0.0),
            state(min_tokens=3, temperature=0.0, ignore_eos=True, stop_token_ids=[20, 21]),
            state(min_tokens=1, temperature=0.0, output=[3]),  # reached: nothing masked
            state(min_tokens=3, temperature=0.0, output=[3, 4]),
        ]
        want = sampler.process_logits(logits, states).argmax(dim=-1)
        got = sampler.sample(logits, states).token_ids
        assert got.tolist() == want.tolist(), trial
        for s, t in zip(states, got.tolist()):
            if s.needs_min_tokens_mask:
                assert t not in s.min_tokens_mask_ids


# ---------------------------------------------------------------------------------------------
# Temperature, top-k, top-p, min-p
# ---------------------------------------------------------------------------------------------

FILTER_ROWS = [
    {"temperature": 1.0},
    {"temperature": 0.5, "top_k": 5},
    {"temperature": 1.7, "top_p": 0.6},
    {"temperature": 1.0, "top_p": 0.93, "top_k": 12},
    {"temperature": 0.8, "min_p": 0.05},
    {"temperature": 1.2, "top_k": 20, "top_p": 0.75, "min_p": 0.02},
    {"temperature": 1.0, "top_p": 1e-6},  # keeps exactly the most likely token
    {"temperature": 2.0, "top_k": V},
    {"temperature": 1.0, "min_p": 1.0},  # only the most likely token(s)
    {"temperature": 0.0, "top_k": 3, "top_p": 0.5},  # greedy: filters do not apply, argmax unaffected
]


def test_filters_match_naive_sorting_reference():
    logits = fixed_logits(len(FILTER_ROWS), seed=1)
    states = [state(**r) for r in FILTER_ROWS]
    got = Sampler(V).process_logits(logits, states)
    for i, r in enumerate(FILTER_ROWS):
        if r["temperature"] == 0.0:
            assert torch.equal(got[i], logits[i])
            continue
        want = ref_filters(
            logits[i], r["temperature"], r.get("top_k", 0), r.get("top_p", 1.0), r.get("min_p", 0.0)
        )
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), (i, r)
        finite = ~torch.isinf(want)
        torch.testing.assert_close(got[i][finite].double(), want[finite], rtol=1e-6, atol=1e-6)
    assert (~torch.isinf(got[6])).sum() == 1 and (~torch.isinf(got[8])).sum() == 1
    # Rows are independent of their neighbours: each alone gives the same processed logits.
    for i in range(len(FILTER_ROWS)):
        alone = Sampler(V).process_logits(logits[i : i + 1], [states[i]])
        assert torch.equal(alone[0], got[i])


def test_filters_exact_boundaries_and_ties():
    # Uniform over 8: every probability is exactly 1/8 in float32, so the boundaries are exact.
    # top_p .5 keeps the smallest set reaching .5: four tokens (mass before the fifth is .5).
    # After top-k 2 each survivor has .5, so top_p .5 keeps one. Among equal logits the lower id
    # ranks first, as torch.argmax.
    logits = torch.zeros(4, 8)
    states = [
        state(vocab=8, eos=(), top_p=0.5),
        state(vocab=8, eos=(), top_k=3),
        state(vocab=8, eos=(), top_p=0.5, top_k=2),
        state(vocab=8, eos=(), min_p=1.0),
    ]
    kept = ~torch.isinf(Sampler(8).process_logits(logits, states))
    assert [torch.nonzero(r).flatten().tolist() for r in kept] == [
        [0, 1, 2, 3],
        [0, 1, 2],
        [0],
        list(range(8)),
    ]


def test_filters_random_batches_against_reference():
    g = torch.Generator().manual_seed(7)
    for trial in range(4):
        n = 9
        logits = torch.randn(n, V, generator=g) * 2
        rows = []
        for _ in range(n):
            rows.append(
                {
                    "temperature": float(torch.rand(1, generator=g) * 1.5 + 0.1),
                    "top_k": int(torch.randint(0, 30, (1,), generator=g)),
                    "top_p": float(torch.rand(1, generator=g) * 0.9 + 0.1),
                    "min_p": float(torch.rand(1, generator=g) * 0.2),
                }
            )
        got = Sampler(V).process_logits(logits, [state(**r) for r in rows])
        for i, r in enumerate(rows):
            if r["top_k"] == 1:  # greedy: the token is the argmax of the unfiltered logits
                assert torch.equal(got[i], logits[i])
                continue
            want = ref_filters(logits[i], r["temperature"], r["top_k"], r["top_p"], r["min_p"])
            assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), (trial, i, r)


# ---------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax():
    logits = fixed_logits(4, seed=2)
    states = [
        state(temperature=0.0, logprobs=0),
        state(temperature=0.7, top_k=4, repetition_penalty=1.5, prompt=[1], logprobs=5, seed=1),
        state(temperature=0.0),  # asked for nothing; still gets its sampled logprob
        state(temperature=1.3, logprobs=2, seed=2),
    ]
    out = Sampler(V).sample(logits, states)
    ref = torch.log_softmax(logits.double(), dim=-1)
    want = ref.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs.double(), want, rtol=1e-5, atol=1e-5)
    assert out.num_top_logprobs == [0, 5, 0, 2]
    values, ids = out.top_logprobs
    assert values.shape == ids.shape == (4, 5)
    ref_vals, ref_ids = ref.topk(5, dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(values.double(), ref_vals, rtol=1e-5, atol=1e-5)


def test_logprobs_zero_gives_no_top_list():
    out = Sampler(V).sample(fixed_logits(2), [state(temperature=0.0, logprobs=0), state(temperature=0.0)])
    assert isinstance(out, SamplerOutput)
    assert out.logprobs is not None and out.top_logprobs is None and out.num_top_logprobs == [0, 0]


# ---------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------


def run_sequence(batch_builder, steps=25):
    """Tokens of the row built with seed 1234 over `steps` steps, with the batch around it."""
    sampler = Sampler(V)
    states, target = batch_builder()
    tokens = []
    for step in range(steps):
        logits = fixed_logits(len(states), seed=100 + step)
        # The target row sees the same logits whatever its position: tie them to the step only.
        logits[target] = fixed_logits(1, seed=1000 + step)[0] / 3
        out = sampler.sample(logits, states).token_ids.tolist()
        tokens.append(out[target])
        for s, t in zip(states, out):
            s.append(t)
    return tokens


def seeded(seed=1234, **kw):
    return state(seed=seed, temperature=1.0, frequency_penalty=0.3, top_p=0.95, **kw)


def test_seeded_sequence_independent_of_batch():
    alone = run_sequence(lambda: ([seeded()], 0))
    torch.manual_seed(0)
    mixed1 = run_sequence(lambda: ([state(), seeded(), state(temperature=0.0), seeded(seed=5)], 1))
    torch.manual_seed(99)  # the shared generator's state does not matter either
    mixed2 = run_sequence(
        lambda: ([seeded(seed=7, top_k=3), state(top_p=0.5), state(min_p=0.3), seeded()], 3)
    )
    assert alone == mixed1 == mixed2
    assert len(set(alone)) > 5  # it is sampling, not stuck on one token
    other = run_sequence(lambda: ([seeded(seed=4321)], 0))
    assert other != alone


def test_unseeded_rows_follow_torch_manual_seed():
    logits = fixed_logits(8)
    states = [state() for _ in range(8)]
    torch.manual_seed(3)
    a = Sampler(V).sample(logits, states).token_ids
    torch.manual_seed(3)
    b = Sampler(V).sample(logits, states).token_ids
    assert torch.equal(a, b)


def test_seeded_sequence_independent_of_batch_large_vocab():
    # A real vocabulary: alone, one row is split over threads; in a batch, each thread owns rows.
    vocab = 49152

    def run(batch_builder, steps=8):
        sampler = Sampler(vocab)
        states, target = batch_builder()
        tokens = []
        for step in range(steps):
            logits = torch.randn(len(states), vocab, generator=torch.Generator().manual_seed(step)) * 4
            logits[target] = torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step)) * 2
            out = sampler.sample(logits, states).token_ids.tolist()
            tokens.append(out[target])
            for st, t in zip(states, out):
                st.append(t)
        return tokens

    def target():
        return state(vocab=vocab, eos=(), seed=77, temperature=0.9, top_k=40, top_p=0.9)

    alone = run(lambda: ([target()], 0))
    batched = run(
        lambda: (
            [state(vocab=vocab, eos=()), state(vocab=vocab, eos=(), temperature=0.0), target()]
            + [state(vocab=vocab, eos=(), top_p=0.5, repetition_penalty=1.2) for _ in range(5)],
            2,
        )
    )
    assert alone == batched
    assert len(set(alone)) > 3


def test_unseeded_requests_reproducible_under_manual_seed():
    def run(manual_seed):
        torch.manual_seed(manual_seed)
        states = [state(top_p=0.9) for _ in range(6)]  # keys drawn here, once per request
        sampler = Sampler(V)
        seq = []
        for step in range(10):
            out = sampler.sample(fixed_logits(6, seed=step), states).token_ids.tolist()
            seq.append(out)
            for st, t in zip(states, out):
                st.append(t)
        return seq

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_same_key_same_token():
    # The draw is keyed by (rng_seed, num_generated): sampling again before appending repeats it.
    s = state(seed=3)
    logits = fixed_logits(1)
    first = Sampler(V).sample(logits, [s]).token_ids.item()
    assert all(Sampler(V).sample(logits, [s]).token_ids.item() == first for _ in range(5))
    s.append(first)
    assert len({Sampler(V).sample(logits, [s]).token_ids.item() for _ in range(3)}) == 1


def test_cpu_draw_is_the_twin_on_penalized_logits():
    from inflight.ops.reference import sampling as twin

    logits = fixed_logits(len(FILTER_ROWS), seed=3)
    states = [state(**r, output=[1, 2, 2], frequency_penalty=0.5) for r in FILTER_ROWS]
    states[0] = state(min_tokens=5, temperature=1.3)  # EOS masked this step
    got = Sampler(V).sample(logits, states).token_ids
    x = Sampler(V)._penalize(logits, states, copy=True)
    fused = torch.tensor([s.fused_params for s in states], dtype=torch.float64)
    want = twin.sample(
        x,
        fused[:, 0].float(),
        fused[:, 1].int(),
        fused[:, 2].float(),
        fused[:, 3].float(),
        torch.tensor([s.rng_seed for s in states]),
        torch.tensor([s.num_generated for s in states]),
    )
    assert torch.equal(got, want)
    assert got[0] != EOS


# ---------------------------------------------------------------------------------------------
# Distributions
# ---------------------------------------------------------------------------------------------

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03], dtype=torch.float64)
DRAWS = 20_000


def draw_counts(n_vocab_probs, draws=DRAWS, seed=0, **kw):
    logits = n_vocab_probs.log().float().expand(draws, -1).contiguous()
    # One request per draw: each draws with its own key (a seed from the default generator, step 0).
    torch.manual_seed(seed)
    params = SamplingParams(**kw)
    states = [SamplingState.create(params, len(n_vocab_probs), [], ()) for _ in range(draws)]
    tokens = Sampler(len(n_vocab_probs)).sample(logits, states).token_ids
    return torch.bincount(tokens, minlength=len(n_vocab_probs))


def test_temperature_one_matches_distribution():
    counts = draw_counts(PROBS)
    assert chi2(counts, PROBS) < CHI2_CRIT_1E3[len(PROBS) - 1]
    # And a wrong distribution is rejected by the same bound (the test has power).
    uniform = torch.full_like(PROBS, 1 / len(PROBS))
    assert chi2(counts, uniform) > 10 * CHI2_CRIT_1E3[len(PROBS) - 1]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scaling(temperature):
    expected = PROBS ** (1 / temperature)
    expected /= expected.sum()
    counts = draw_counts(PROBS, temperature=temperature, seed=1)
    assert chi2(counts, expected) < CHI2_CRIT_1E3[len(PROBS) - 1]
    assert chi2(counts, PROBS) > 10 * CHI2_CRIT_1E3[len(PROBS) - 1]


def test_top_p_restricts_support_exactly():
    # Mass before each token: 0, .4, .65, .8: top_p .6 keeps {0, 1}; top_p .66 keeps {0, 1, 2}.
    for top_p, support in ((0.6, 2), (0.66, 3)):
        counts = draw_counts(PROBS, top_p=top_p, seed=2)
        expected = torch.zeros_like(PROBS)
        expected[:support] = PROBS[:support] / PROBS[:support].sum()
        assert (counts[support:] == 0).all() and (counts[:support] > 0).all()
        assert chi2(counts, expected) < CHI2_CRIT_1E3[support - 1]


def test_top_k_and_min_p_restrict_support():
    counts = draw_counts(PROBS, top_k=3, seed=3)
    expected = torch.zeros_like(PROBS)
    expected[:3] = PROBS[:3] / PROBS[:3].sum()
    assert chi2(counts, expected) < CHI2_CRIT_1E3[2]
    # min_p .3: threshold .12 keeps {.4, .25, .15}.
    counts = draw_counts(PROBS, min_p=0.3, seed=4)
    assert chi2(counts, expected) < CHI2_CRIT_1E3[2]


def test_seeded_row_draws_match_distribution():
    # One seeded request, one step at a time: its draws over steps follow the distribution.
    s = state(vocab=len(PROBS), eos=(), seed=2024)
    logits = PROBS.log().float().unsqueeze(0)
    sampler = Sampler(len(PROBS))
    draws = 4000
    tokens = []
    for _ in range(draws):
        tokens.append(sampler.sample(logits, [s]).token_ids.item())
        s.append(tokens[-1])
    counts = torch.bincount(torch.tensor(tokens), minlength=len(PROBS))
    assert chi2(counts, PROBS) < CHI2_CRIT_1E3[len(PROBS) - 1]


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): the same decisions on the device as on the CPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_matches_cpu_decisions():
    dev = torch.device("cuda")
    logits = fixed_logits(len(FILTER_ROWS), seed=1)
    cpu_states = [state(**r) for r in FILTER_ROWS]
    cuda_states = [SamplingState.create(SamplingParams(**r), V, [], (EOS,), device=dev) for r in FILTER_ROWS]
    cpu = Sampler(V).process_logits(logits, cpu_states)
    gpu = Sampler(V).process_logits(logits.to(dev), cuda_states).cpu()
    assert torch.equal(torch.isinf(cpu), torch.isinf(gpu))
    pen = [
        state(
            prompt=[1, 2],
            output=[2, 3, 3],
            repetition_penalty=1.4,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            temperature=0.0,
            min_tokens=9,
            logprobs=4,
        )
    ]
    pen_gpu = [SamplingState.create(pen[0].params, V, [1, 2], (EOS,), device=dev)]
    pen_gpu[0].extend([2, 3, 3])
    out_cpu = Sampler(V).sample(logits[:1], pen)
    out_gpu = Sampler(V).sample(logits[:1].to(dev), pen_gpu)
    assert torch.equal(out_cpu.token_ids, out_gpu.token_ids.cpu())
    torch.testing.assert_close(out_cpu.logprobs, out_gpu.logprobs.cpu())
    # Seeded rows on the device: the same tokens alone and in a batch.
    s_alone = SamplingState.create(SamplingParams(seed=11, top_p=0.9), V, [], (EOS,), device=dev)
    batch = [
        SamplingState.create(SamplingParams(), V, [], (EOS,), device=dev),
        SamplingState.create(SamplingParams(seed=11, top_p=0.9), V, [], (EOS,), device=dev),
    ]
    for step in range(10):
        row = fixed_logits(1, seed=step).to(dev)
        a = Sampler(V).sample(row, [s_alone]).token_ids.item()
        b = Sampler(V).sample(torch.cat([fixed_logits(1, seed=50 + step).to(dev), row]), batch).token_ids[1]
        assert a == b.item()


def test_logits_processors_apply_in_order_and_fail_alone(make_llm):
    import torch as _torch

    from inflight import SamplingParams as _SP

    llm = make_llm()
    seen = []

    def only_even(history, logits):
        seen.append(len(history))
        out = _torch.full_like(logits, float("-inf"))
        out[::2] = logits[::2]
        return out

    def prefer_ten(history, logits):
        out = logits.clone()
        out[10] = out.max() + 5.0 if len(history) % 2 == 0 else out[10]
        return out

    def boom(history, logits):
        raise RuntimeError("no")

    prompt = [5, 6, 7, 8]
    good = _SP(max_tokens=6, temperature=0.0, logits_processors=[only_even, prefer_ten])
    bad = _SP(max_tokens=6, temperature=0.0, logits_processors=[boom])
    plain = _SP(max_tokens=6, temperature=0.0)
    outs = llm.generate([prompt, prompt, prompt], [good, bad, plain], use_tqdm=False)
    toks = outs[0].outputs[0].token_ids
    assert all(t % 2 == 0 for t in toks) and toks[0] == 10 and toks[2] == 10
    assert seen[:3] == [0, 1, 2]
    assert (
        outs[1].outputs[0].finish_reason == "error" and "logits processor failed" in outs[1].outputs[0].error
    )
    alone = llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == alone
    with pytest.raises(ValueError, match="logits_processors must be a list of callables"):
        _SP(logits_processors=[1])
