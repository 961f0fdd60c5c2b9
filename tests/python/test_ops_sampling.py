"""The fused CPU sampling op against its plain-torch twin, on every ISA this CPU has.

Exact where the logic is exact: greedy rows are torch.argmax, and for the same (seed, step) the op
and the twin pick the same token. The only allowed difference is a draw within float rounding of a
CDF or mask boundary (the kernel sums in another order, with a polynomial exp): a mismatch must be
what the twin itself draws for a uniform or a top_p / min_p within 1e-5 of the given one, and such
mismatches must be rare. Distributions are checked by chi-square at alpha 1e-3 over 20k draws
keyed by many (seed, step) pairs.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from inflight.ops import sampling as native
from inflight.ops.reference import sampling as reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Chi-square critical values at alpha = 1e-3 by degrees of freedom.
CHI2_CRIT_1E3 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46}
PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03], dtype=torch.float64)
DRAWS = 20_000


def random_params(n: int, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A mix of greedy, plain, top-k (incl. 1 and >= V), top-p, min-p and combined rows."""
    kind = torch.randint(0, 8, (n,), generator=gen)
    temperature = torch.rand(n, generator=gen) * 1.8 + 0.1
    temperature[kind == 0] = 0.0
    top_k = torch.zeros(n, dtype=torch.int32)
    top_p = torch.ones(n)
    min_p = torch.zeros(n)
    k_rows = (kind == 2) | (kind == 5) | (kind == 7)
    top_k[k_rows] = torch.randint(
        1, max(2, min(vocab + 3, 200)), (int(k_rows.sum()),), generator=gen, dtype=torch.int32
    )
    p_rows = (kind == 3) | (kind == 5) | (kind == 7)
    top_p[p_rows] = torch.rand(int(p_rows.sum()), generator=gen) * 0.98 + 0.01
    m_rows = (kind == 4) | (kind == 6) | (kind == 7)
    min_p[m_rows] = torch.rand(int(m_rows.sum()), generator=gen) * 0.3
    return {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "seeds": torch.randint(0, 2**63 - 1, (n,), generator=gen),
        "steps": torch.randint(0, 10_000, (n,), generator=gen),
    }


def explained_by_rounding(row: torch.Tensor, p: dict[str, torch.Tensor], i: int, token: int) -> bool:
    """Whether the twin draws `token` for row i with its uniform, top_p or min_p moved by <= 1e-5."""
    u = float(reference.sampling_uniform(p["seeds"][i : i + 1], p["steps"][i : i + 1])[0])
    top_p, min_p = float(p["top_p"][i]), float(p["min_p"][i])
    for du, dp, dm in itertools.product((0.0, -1e-5, 1e-5), repeat=3):
        kept = reference.kept_logits(
            row.unsqueeze(0),
            p["temperature"][i : i + 1],
            p["top_k"][i : i + 1],
            torch.tensor([min(1.0, max(1e-9, top_p + dp)) if top_p < 1 else 1.0]),
            torch.tensor([min(1.0, max(0.0, min_p + dm)) if min_p > 0 else 0.0]),
        )
        if int(reference.inverse_cdf(kept, np.array([min(max(u + du, 0.0), 1 - 2**-53)]))[0]) == token:
            return True
    return False


def assert_matches_twin(logits: torch.Tensor, p: dict[str, torch.Tensor], max_rounding: int = 2) -> None:
    got = native.sample(logits, **p)
    want = reference.sample(logits, **p)
    assert got.dtype == torch.int64 and got.shape == (logits.shape[0],)
    bad = torch.nonzero(got != want).flatten().tolist()
    greedy = p["temperature"] <= 0
    for i in bad:
        assert not greedy[i], f"greedy row {i}: {int(got[i])} != argmax {int(want[i])}"
        assert explained_by_rounding(logits[i].float(), p, i, int(got[i])), (
            f"row {i}: op {int(got[i])}, twin {int(want[i])}, params "
            f"{ {k: v[i].item() for k, v in p.items()} }"
        )
    assert len(bad) <= max_rounding, f"{len(bad)} rounding-level mismatches in {logits.shape[0]} rows"


# ---------------------------------------------------------------------------------------------
# The RNG
# ---------------------------------------------------------------------------------------------


def test_uniform_matches_numpy_twin():
    keys = [(0, 0), (1, 0), (0, 1), (2**64 - 1, 2**63 - 1), (2**63, 5), (12345, 678), (2**32, 2**32)]
    seeds = np.array([k[0] for k in keys], dtype=np.uint64)
    steps = np.array([k[1] for k in keys], dtype=np.uint64)
    twin = reference.sampling_uniform(seeds, steps)
    for (seed, step), u in zip(keys, twin):
        assert native.sampling_uniform(seed, step) == u
        assert 0.0 <= u < 1.0


def test_uniforms_are_uniform_over_keys():
    gen = np.random.default_rng(0)
    seeds = gen.integers(0, 2**63, 10_000, dtype=np.int64)
    for steps in (np.zeros(10_000, dtype=np.int64), np.arange(10_000, dtype=np.int64)):
        u = reference.sampling_uniform(seeds if steps.any() else np.arange(10_000), steps)
        counts = np.bincount((u * 20).astype(int), minlength=20)
        expected = len(u) / 20
        assert ((counts - expected) ** 2 / expected).sum() < 43.8  # chi-square, 19 dof, alpha 1e-3


# ---------------------------------------------------------------------------------------------
# Against the twin
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 17, 97, 1025, 4097, 49152])
def test_matches_twin_random_logits(isa, vocab):
    gen = torch.Generator().manual_seed(vocab)
    n = 61
    scale = torch.rand(n, 1, generator=gen) * 6 + 0.2  # flat to peaked
    logits = torch.randn(n, vocab, generator=gen) * scale
    assert_matches_twin(logits, random_params(n, vocab, gen))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_matches_twin_half_precision_logits(isa, dtype):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(40, 5000, generator=gen) * 3).to(dtype)
    assert_matches_twin(logits, random_params(40, 5000, gen))


def test_matches_twin_llm_like_logits(isa):
    # A bulk of low logits and a head of plausible tokens, as real next-token distributions.
    gen = torch.Generator().manual_seed(2)
    n, vocab = 48, 49152
    logits = torch.randn(n, vocab, generator=gen) * 2
    head = torch.randint(0, vocab, (n, 40), generator=gen)
    logits.scatter_(1, head, 8 + torch.randn(n, 40, generator=gen) * 3)
    assert_matches_twin(logits, random_params(n, vocab, gen))


def test_matches_twin_fixed_logits(isa):
    v = 4096 + 37  # two blocks
    rows = [
        torch.zeros(v),  # uniform: every top-p boundary is exact
        torch.arange(v, dtype=torch.float32) % 7,  # many exact ties
        torch.full((v,), float("-inf")).index_fill_(0, torch.tensor([5, 4100]), 1.0),  # two live tokens
        torch.linspace(-50, 50, v),  # one token dominates
        torch.where(torch.arange(v) % 2 == 0, 0.0, float("-inf")),
    ]
    logits = torch.stack(rows)
    for t, k, p_, mp in [
        (1.0, 0, 1.0, 0.0),
        (1.0, 3, 1.0, 0.0),
        (0.7, 0, 0.5, 0.0),
        (1.3, 10, 0.9, 0.1),
        (1.0, 0, 1.0, 1.0),
        (2.0, 4133, 1.0, 0.0),
        (1.0, 1, 1.0, 0.0),
    ]:
        n = len(rows)
        p = {
            "temperature": torch.full((n,), t),
            "top_k": torch.full((n,), k, dtype=torch.int32),
            "top_p": torch.full((n,), p_),
            "min_p": torch.full((n,), mp),
            "seeds": torch.arange(n) * 7919,
            "steps": torch.arange(n) + 3,
        }
        assert_matches_twin(logits, p, max_rounding=0)


def test_exact_boundaries_on_uniform_rows(isa):
    # 8 equal logits: probabilities are exactly 1/8, so top-p .5 keeps ids 0-3 (mass before the
    # fifth is exactly .5), top-k 3 keeps 0-2, min-p 1 keeps all 8. Many keys: the support is exact.
    n = 4000
    logits = torch.zeros(1, 8).expand(n, 8)
    keys = {"seeds": torch.arange(n), "steps": torch.zeros(n, dtype=torch.int64)}
    for k, p_, support in ((0, 0.5, 4), (3, 1.0, 3), (2, 0.5, 1), (0, 1.0, 8)):
        tokens = native.sample(
            logits,
            torch.ones(n),
            torch.full((n,), k, dtype=torch.int32),
            torch.full((n,), p_),
            torch.zeros(n),
            **keys,
        )
        counts = torch.bincount(tokens, minlength=8)
        assert (counts[support:] == 0).all() and (counts[:support] > 0).all(), (k, p_, counts)


# ---------------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_greedy_rows_are_argmax_first_index(isa, dtype):
    gen = torch.Generator().manual_seed(3)
    n, v = 13, 3 * 4096 + 5
    logits = torch.randn(n, v, generator=gen).to(dtype)
    logits[1, [7, 4096 + 3, 9000]] = 50.0  # ties across blocks: the first wins
    logits[2, [v - 1]] = 50.0  # the very last id
    logits[3, :] = -3.0  # all equal: id 0
    logits[4, 1:] = float("-inf")
    p = {
        "temperature": torch.zeros(n),
        "top_k": torch.zeros(n, dtype=torch.int32),
        "top_p": torch.ones(n),
        "min_p": torch.zeros(n),
        "seeds": torch.arange(n),
        "steps": torch.zeros(n, dtype=torch.int64),
    }
    got = native.sample(logits, **p)
    assert torch.equal(got, logits.float().argmax(dim=-1))
    assert got[1] == 7 and got[2] == v - 1 and got[3] == 0 and got[4] == 0


def test_top_k_one_is_the_argmax(isa):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 777, generator=gen)
    n = 9
    got = native.sample(
        logits,
        torch.full((n,), 0.8),
        torch.ones(n, dtype=torch.int32),
        torch.ones(n),
        torch.zeros(n),
        torch.arange(n),
        torch.zeros(n, dtype=torch.int64),
    )
    assert torch.equal(got, logits.argmax(dim=-1))


# ---------------------------------------------------------------------------------------------
# Distributions: many (seed, step) keys
# ---------------------------------------------------------------------------------------------

V_STAT = 9000  # three blocks; the 6 live tokens are spread over them
LIVE = torch.tensor([17, 4095, 4096, 6000, 8191, 8999])


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    expected = probs.double() * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "draws outside the support"
    return (((counts.double() - expected) ** 2)[keep] / expected[keep]).sum().item()


def draw_counts(
    *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, fill=float("-inf"), key="seeds", dtype=None
):
    row = torch.full((V_STAT,), fill)
    row[LIVE] = PROBS.log().float()
    logits = row.expand(DRAWS, V_STAT)  # one row, stride 0: no copy
    if dtype is not None:
        logits = logits.to(dtype)
    n = DRAWS
    if key == "seeds":  # many requests at one step
        seeds, steps = (
            torch.randint(0, 2**63 - 1, (n,), generator=torch.Generator().manual_seed(10)),
            torch.zeros(n, dtype=torch.int64),
        )
    else:  # one request over many steps
        seeds, steps = torch.full((n,), 424242), torch.arange(n)
    tokens = native.sample(
        logits,
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.int32),
        torch.full((n,), top_p),
        torch.full((n,), min_p),
        seeds,
        steps,
    )
    counts = torch.bincount(tokens, minlength=V_STAT)
    assert counts.sum() == n
    outside = counts.clone()
    outside[LIVE] = 0
    assert outside.sum() == 0, "a token outside the live set"
    return counts[LIVE]


@pytest.mark.parametrize("key", ["seeds", "steps"])
def test_distribution_temperature_one(isa, key):
    counts = draw_counts(key=key)
    assert chi2(counts, PROBS) < CHI2_CRIT_1E3[5]
    uniform = torch.full_like(PROBS, 1 / 6)
    assert chi2(counts, uniform) > 10 * CHI2_CRIT_1E3[5]  # the test has power


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_distribution_temperature_scaling(isa, temperature):
    expected = PROBS ** (1 / temperature)
    expected /= expected.sum()
    counts = draw_counts(temperature=temperature)
    assert chi2(counts, expected) < CHI2_CRIT_1E3[5]
    assert chi2(counts, PROBS) > 10 * CHI2_CRIT_1E3[5]


def test_distribution_top_k(isa):
    counts = draw_counts(top_k=3, fill=-30.0)  # finite filler: top-k must skip 8994 near-zero tokens
    expected = torch.zeros_like(PROBS)
    expected[:3] = PROBS[:3] / PROBS[:3].sum()
    assert chi2(counts, expected) < CHI2_CRIT_1E3[2]


@pytest.mark.parametrize(("top_p", "support"), [(0.6, 2), (0.66, 3), (0.85, 4)])
def test_distribution_top_p_support_exact(isa, top_p, support):
    # Mass before each token: 0, .4, .65, .8, .9, .97: top_p .6 keeps 2, .66 keeps 3, .85 keeps 4.
    counts = draw_counts(top_p=top_p)
    assert (counts[support:] == 0).all() and (counts[:support] > 0).all()
    expected = torch.zeros_like(PROBS)
    expected[:support] = PROBS[:support] / PROBS[:support].sum()
    assert chi2(counts, expected) < CHI2_CRIT_1E3[max(support - 1, 1)]


def test_distribution_min_p(isa):
    # min_p .3: threshold .12 keeps {.4, .25, .15}.
    counts = draw_counts(min_p=0.3)
    expected = torch.zeros_like(PROBS)
    expected[:3] = PROBS[:3] / PROBS[:3].sum()
    assert chi2(counts, expected) < CHI2_CRIT_1E3[2]


def test_distribution_bf16_logits(isa):
    row = PROBS.log().float().to(torch.bfloat16).double().exp()
    counts = draw_counts(dtype=torch.bfloat16)
    assert chi2(counts, row / row.sum()) < CHI2_CRIT_1E3[5]


# ---------------------------------------------------------------------------------------------
# Determinism: a row's token depends on its logits, parameters and key only
# ---------------------------------------------------------------------------------------------


def test_independent_of_batch_threads_and_layout(isa):
    gen = torch.Generator().manual_seed(5)
    n, v = 6, 150_000  # large rows: with few of them the op splits each row over threads
    logits = torch.randn(n, v, generator=gen) * 3
    p = random_params(n, v, gen)
    p["temperature"] = torch.where(p["temperature"] > 0, p["temperature"], torch.tensor(1.0))
    ref = native.sample(logits, **p, num_threads=1)
    for threads in (2, 3, 8):
        assert torch.equal(native.sample(logits, **p, num_threads=threads), ref)
    for i in range(n):  # alone, several threads on one row
        alone = native.sample(logits[i : i + 1], **{k: t[i : i + 1] for k, t in p.items()}, num_threads=4)
        assert alone.item() == ref[i].item()
    order = torch.randperm(n, generator=gen)
    shuffled = native.sample(logits[order], **{k: t[order] for k, t in p.items()}, num_threads=2)
    assert torch.equal(shuffled, ref[order])


def test_keys_change_the_draw(isa):
    logits = torch.zeros(1, 1000).expand(64, 1000)
    ones = {
        "temperature": torch.ones(64),
        "top_k": torch.zeros(64, dtype=torch.int32),
        "top_p": torch.ones(64),
        "min_p": torch.zeros(64),
    }
    by_seed = native.sample(logits, **ones, seeds=torch.arange(64), steps=torch.zeros(64, dtype=torch.int64))
    by_step = native.sample(logits, **ones, seeds=torch.zeros(64, dtype=torch.int64), steps=torch.arange(64))
    same = native.sample(logits, **ones, seeds=torch.full((64,), 3), steps=torch.full((64,), 5))
    assert len(set(by_seed.tolist())) > 50 and len(set(by_step.tolist())) > 50
    assert len(set(same.tolist())) == 1


# ---------------------------------------------------------------------------------------------
# Layouts, special values, the boundary
# ---------------------------------------------------------------------------------------------


def test_strided_and_broadcast_rows(isa):
    gen = torch.Generator().manual_seed(6)
    padded = torch.randn(7, 1100, generator=gen)
    view = padded[:, :1000]  # row stride 1100, as a model's padded vocabulary
    p = random_params(7, 1000, gen)
    assert torch.equal(native.sample(view, **p), native.sample(view.contiguous(), **p))
    transposed = torch.randn(1000, 7, generator=gen).t()  # column stride != 1: copied first
    assert torch.equal(native.sample(transposed, **p), native.sample(transposed.contiguous(), **p))
    row = torch.randn(1, 1000, generator=gen)
    assert torch.equal(native.sample(row.expand(7, 1000), **p), native.sample(row.repeat(7, 1), **p))


def test_out_argument_and_numpy_inputs(isa):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 300, generator=gen)
    p = random_params(5, 300, gen)
    out = torch.full((5,), -1, dtype=torch.int64)
    assert native.sample(logits, **p, out=out) is out
    assert torch.equal(out, native.sample(logits, **{k: v.numpy() for k, v in p.items()}))
    as_lists = {k: v.tolist() for k, v in p.items()}
    assert torch.equal(out, native.sample(logits, **as_lists))


def test_degenerate_rows_give_valid_ids(isa):
    v = 64
    logits = torch.randn(5, v)
    logits[0] = float("-inf")  # nothing to draw from: the argmax convention, id 0
    logits[1, 9] = float("inf")  # an infinite logit: greedy on it
    logits[2] = float("nan")
    logits[3, ::2] = float("nan")
    n = 5
    got = native.sample(
        logits,
        torch.ones(n),
        torch.zeros(n, dtype=torch.int32),
        torch.ones(n),
        torch.zeros(n),
        torch.arange(n),
        torch.zeros(n, dtype=torch.int64),
    )
    assert ((got >= 0) & (got < v)).all()
    assert got[0] == 0 and got[1] == 9
    assert got[3] % 2 == 1  # NaN logits are never drawn while finite ones remain
    empty = native.sample(
        torch.zeros(0, v),
        torch.zeros(0),
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(0),
        torch.zeros(0),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
    )
    assert empty.shape == (0,)


def test_tiny_temperature_is_greedy_not_nan(isa):
    logits = torch.randn(3, 500) * 10
    n = 3
    got = native.sample(
        logits,
        torch.full((n,), 1e-38),
        torch.zeros(n, dtype=torch.int32),
        torch.ones(n),
        torch.zeros(n),
        torch.arange(n),
        torch.zeros(n, dtype=torch.int64),
    )
    assert torch.equal(got, logits.argmax(-1))


BAD = [
    ("temperature", torch.tensor([-0.5, 1.0]), r"temperature\[0\] must be finite and >= 0"),
    ("temperature", torch.tensor([1.0, float("nan")]), r"temperature\[1\] must be finite and >= 0"),
    ("top_p", torch.tensor([0.0, 1.0]), r"top_p\[0\] must be in \(0, 1\]"),
    ("top_p", torch.tensor([1.0, 1.5]), r"top_p\[1\] must be in \(0, 1\]"),
    ("min_p", torch.tensor([-0.1, 0.0]), r"min_p\[0\] must be in \[0, 1\]"),
    ("steps", torch.tensor([0, -1]), r"steps\[1\] must be >= 0"),
    ("top_k", torch.tensor([1, 2, 3], dtype=torch.int32), r"top_k must be a \[2\] array"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_rejects_bad_arguments(name, value, message):
    p = {
        "temperature": torch.ones(2),
        "top_k": torch.zeros(2, dtype=torch.int32),
        "top_p": torch.ones(2),
        "min_p": torch.zeros(2),
        "seeds": torch.arange(2),
        "steps": torch.zeros(2, dtype=torch.int64),
    }
    p[name] = value
    with pytest.raises(ValueError, match=message):
        native.sample(torch.zeros(2, 10), **p)


def test_rejects_bad_logits_and_out():
    p = {
        "temperature": torch.ones(2),
        "top_k": torch.zeros(2, dtype=torch.int32),
        "top_p": torch.ones(2),
        "min_p": torch.zeros(2),
        "seeds": torch.arange(2),
        "steps": torch.zeros(2, dtype=torch.int64),
    }
    with pytest.raises(ValueError, match="2-D"):
        native.sample(torch.zeros(10), **p)
    with pytest.raises(ValueError, match="at least one column"):
        native.sample(torch.zeros(2, 0), **p)
    with pytest.raises(ValueError, match="out must be"):
        native.sample(torch.zeros(2, 10), **p, out=torch.zeros(2, dtype=torch.int32))
    # Other dtypes are read as float32.
    assert native.sample(torch.zeros(2, 10, dtype=torch.float64), **p).shape == (2,)
