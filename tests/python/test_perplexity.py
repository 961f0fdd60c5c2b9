"""SamplingParams.prompt_logprobs and the perplexity tool, against transformers' log-softmax."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch
from model_utils import load_hf_reference

from inflight import SamplingParams
from inflight.cli import main as cli_main
from inflight.llm import RequestError
from inflight.perplexity import perplexity, windows

PROMPT_A = [(7 * i + 3) % 380 + 3 for i in range(45)]
PROMPT_B = [(11 * i + 5) % 380 + 3 for i in range(29)]


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return load_hf_reference(tiny_model_dir("llama"))


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_prompt_logprobs_match_transformers(make_llm, hf, overlap):
    # Chunked prefill in 16-token chunks: the scored positions span chunks and batch neighbours.
    llm = make_llm(max_num_tokens=16, enable_chunked_prefill=True, disable_overlap_scheduler=not overlap)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    outs = llm.generate([PROMPT_A, PROMPT_B], params, use_tqdm=False)
    for prompt, out in zip([PROMPT_A, PROMPT_B], outs):
        ref = _hf_logprobs(hf, prompt)
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        for p in range(len(prompt) - 1):
            entry = lps[p + 1]
            tok = prompt[p + 1]
            assert next(iter(entry)) == tok  # the prompt's own token first
            assert entry[tok] == pytest.approx(ref[p, tok].item(), abs=2e-5)
            values, ids = ref[p].topk(2)
            for tid, val in zip(ids.tolist(), values.tolist()):
                assert entry[tid] == pytest.approx(val, abs=2e-5)
            assert len(entry) <= 3
        # Generation is untouched by scoring the prompt.
        plain = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
        assert plain.prompt_logprobs is None


def test_prompt_logprobs_ignore_the_prefix_cache(make_llm, hf):
    llm = make_llm()
    first = llm.generate([PROMPT_A], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    assert first[0].prompt_logprobs is None
    # PROMPT_A's blocks are cached now; a request with prompt_logprobs computes them all again.
    out = llm.generate(
        [PROMPT_A], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False
    )
    ref = _hf_logprobs(hf, PROMPT_A)
    got = [out[0].prompt_logprobs[p + 1][PROMPT_A[p + 1]] for p in range(len(PROMPT_A) - 1)]
    want = [ref[p, PROMPT_A[p + 1]].item() for p in range(len(PROMPT_A) - 1)]
    assert got == pytest.approx(want, abs=2e-5)
    assert all(len(e) == 1 for e in out[0].prompt_logprobs[1:])


def test_prompt_logprobs_with_n_and_streaming(make_llm):
    llm = make_llm()
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=3, n=2, prompt_logprobs=0)
    out = llm.generate([PROMPT_B], params, use_tqdm=False)[0]
    assert len(out.outputs) == 2 and len(out.prompt_logprobs) == len(PROMPT_B)

    async def stream():
        outs = []
        async for o in llm.generate_async(
            PROMPT_B, SamplingParams(max_tokens=4, prompt_logprobs=1), streaming=True
        ):
            outs.append(o)
        return outs

    outs = asyncio.run(stream())
    assert all(o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(PROMPT_B) for o in outs)
    streamed = [e[t] for e, t in zip(outs[-1].prompt_logprobs[1:], PROMPT_B[1:])]
    assert streamed == pytest.approx([e[t] for e, t in zip(out.prompt_logprobs[1:], PROMPT_B[1:])], abs=2e-5)
    assert all(len(e) <= 2 for e in outs[-1].prompt_logprobs[1:])


def test_prompt_logprobs_bad_values(make_llm):
    with pytest.raises(ValueError, match=r"prompt_logprobs must be >= 0 \(or None\), got -1"):
        SamplingParams(prompt_logprobs=-1)
    llm = make_llm(max_logprobs=5)
    with pytest.raises(RequestError, match="prompt_logprobs must be <= max_logprobs=5, got 6") as info:
        llm.generate([PROMPT_A], SamplingParams(max_tokens=1, prompt_logprobs=6), use_tqdm=False)
    assert info.value.param == "prompt_logprobs"
    # The engine keeps serving.
    assert llm.generate([PROMPT_A], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].length == 2


def _direct_perplexity(hf, token_ids: list[int], context: int, bos: int | None) -> tuple[float, int]:
    """llama-perplexity's rule computed with transformers: back-to-back windows, BOS first, the
    second half scored."""
    nll, n = 0.0, 0
    for start in range(0, len(token_ids) - context + 1, context):
        w = list(token_ids[start : start + context])
        if bos is not None:
            w[0] = bos
        lp = _hf_logprobs(hf, w)
        for j in range(context // 2, context - 1):
            nll -= lp[j, w[j + 1]].item()
            n += 1
    return math.exp(nll / n), n


def test_perplexity_equals_a_direct_transformers_computation(make_llm, hf):
    tokens = [(13 * i * i + 7 * i + 5) % 380 + 3 for i in range(200)]
    llm = make_llm(max_num_tokens=64, enable_chunked_prefill=True)
    res = perplexity(llm, token_ids=tokens, context=48, progress=False)
    want, n = _direct_perplexity(hf, tokens, 48, llm.tokenizer.bos_token_id)
    assert res.num_windows == 4 and res.num_scored_tokens == n == 4 * 23
    assert res.perplexity == pytest.approx(want, rel=1e-5)
    assert math.exp(sum(res.window_nll) / len(res.window_nll)) == pytest.approx(res.perplexity, rel=1e-9)
    assert res.nll_stderr > 0
    assert windows(tokens, 48, None)[1] == tokens[48:96]


def test_perplexity_cli_on_a_text_file(tiny_model_dir, hf, tmp_path):
    from transformers import AutoTokenizer

    path = tiny_model_dir("llama")
    text = "the quick brown fox jumps over the lazy dog and the cat sat on the mat. " * 12
    (tmp_path / "t.txt").write_text(text)
    rc = cli_main(
        [
            "perplexity",
            str(path),
            "--file",
            str(tmp_path / "t.txt"),
            "--context",
            "32",
            "--max-windows",
            "3",
            "--json",
            str(tmp_path / "ppl.json"),
            "--dtype",
            "float32",
            "--kv-cache-max-tokens",
            "2048",
        ]
    )
    assert rc == 0
    got = json.loads((tmp_path / "ppl.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok.encode(text, add_special_tokens=False)[: 3 * 32]
    want, n = _direct_perplexity(hf, ids, 32, tok.bos_token_id)
    assert got["num_windows"] == 3 and got["num_scored_tokens"] == n
    assert got["perplexity"] == pytest.approx(want, rel=1e-5)


def test_perplexity_rejects_a_text_shorter_than_a_window(make_llm):
    llm = make_llm()
    with pytest.raises(ValueError, match="fewer than one window of context=64"):
        perplexity(llm, token_ids=list(range(3, 40)), context=64, progress=False)
