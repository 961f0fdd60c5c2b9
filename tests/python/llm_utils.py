"""Shared data and helpers of the LLM API tests (test_llm_*.py); fixtures are in conftest.py."""

from __future__ import annotations

import random
import time

LLM_MAX_NEW = 24
LLM_TPB = 8  # tokens per block in every LLM test: small pools, many block boundaries
TIMEOUT = 60  # seconds; every wait in these tests is bounded so that a bug cannot hang the suite


def _llm_prompts(vocab: int = 384) -> list[list[int]]:
    """Ten prompts of mixed lengths (1 .. 57 tokens, several on block boundaries of 8), three of
    which share whole blocks with earlier ones (for block reuse): [5] shares 2 blocks with [0], [6]
    shares 4 with [3], [7] starts with all of [4] (16 tokens, exactly 2 blocks)."""
    rng = random.Random(1234)

    def rand(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    a, b, c, d, e, f, g = rand(20), rand(9), rand(1), rand(33), rand(16), rand(57), rand(3)
    return [a, b, c, d, e, a[:16] + rand(5), d[:32] + rand(8), e + rand(3), f, g]


LLM_PROMPTS = _llm_prompts()
# The prompts that extend no other one: run first, they seed the reuse tree for [5], [6], [7].
LLM_PARENT_IDX = [0, 1, 2, 3, 4, 8, 9]


def hf_greedy(path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy ``generate`` of each prompt, one unpadded prompt at a time, fp32, never
    stopping on EOS (like ``ignore_eos=True``, which does not mask EOS either; transformers'
    ``min_new_tokens`` would mask it, so it is not used)."""
    import torch
    from model_utils import load_hf_reference

    hf = load_hf_reference(path, torch.float32)
    out = [hf_generate(hf, p, max_new_tokens=max_new, eos_token_id=None) for p in prompts]
    for toks in out:
        assert len(toks) == max_new, "transformers stopped early: the reference is not like-for-like"
    return out


def hf_generate(hf, prompt: list[int], **kwargs) -> list[int]:
    """The new tokens of transformers' greedy ``generate`` for one unpadded prompt."""
    import torch

    ids = torch.tensor([prompt])
    # One intra-op thread: on a busy 2-core machine transformers' many tiny ops otherwise spend most
    # of their time waking the thread pool (~30x slower). The results do not depend on it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            gen = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **kwargs
            )
    finally:
        torch.set_num_threads(threads)
    return gen[0, len(prompt) :].tolist()


def greedy(max_tokens: int = LLM_MAX_NEW, **kw):
    from inflight.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def wait_until(pred, timeout: float = TIMEOUT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def wait_idle(llm, timeout: float = TIMEOUT) -> None:
    """Waits until the executor holds no request (active, waiting, or a step in flight)."""
    wait_until(lambda: llm.executor.is_idle, timeout, "the executor to become idle")


def assert_kv_idle(llm) -> None:
    """Once the executor is idle: no KV block is used, and the manager's books balance."""
    wait_idle(llm)
    impl = llm.executor.kv_cache_manager.impl
    impl.check_integrity()
    assert impl.num_used_blocks == 0
    assert impl.num_sequences == 0
    stats = impl.get_kv_cache_stats().to_dict()
    assert stats["used_num_blocks"] == 0, stats
