"""The fused C++ layer stack over a float KV cache of another dtype than the model's (a bf16 cache under
the default fp32 model): q, k and v are converted to the cache's dtype, attention runs in it and its
output is converted back, as the Python layers' native backend does. Before, such a cache sent every
step to the Python layers (slower than an fp32 cache; benchmarks/kv_int8_quality.py --speed)."""

from __future__ import annotations

import copy

import pytest
import torch
from model_utils import PagedKV, make_tiny_model
from test_fused_layers import _GEMMA3_HD256, _STEPS, _assert_steps_match, _load, _run_steps

from inflight.layers.fused_cpu import FusedCpuLayers


@pytest.mark.parametrize(
    "model_dtype, cache_dtype",
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float32),
    ],
    ids=str,
)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_float_cache_of_another_dtype_runs_fused(tmp_path, arch, model_dtype, cache_dtype):
    """A float cache of another dtype than the model's (a bf16 cache under the default fp32 model) runs
    in the fused stack: q, k and v converted to the cache's dtype, attention in it, the output back, as
    the Python layers' native backend does, so both write the same cache and give the same logits."""
    overrides = _GEMMA3_HD256 if arch == "gemma3" else {}
    model = _load(make_tiny_model(tmp_path, arch, with_tokenizer=False, **overrides), model_dtype)
    kv_fused = PagedKV.for_model(model, num_blocks=64, tokens_per_block=4, dtype=cache_dtype)
    kv_ref = copy.deepcopy(kv_fused)
    got = _run_steps(model, kv_fused, _STEPS)
    fused = model.fused_layers()
    assert isinstance(fused, FusedCpuLayers)
    assert fused.accepts(kv_fused.kv_caches, model_dtype, 5)  # the fused path really ran
    model._fused = False
    want = _run_steps(model, kv_ref, _STEPS)
    # Gemma's GELU is written twice (libm's tanh against torch's): the fp32 hidden states differ in the
    # last bits, which a 16-bit cache can round one step apart; then the 16-bit tolerance.
    lossy = arch == "gemma3" and cache_dtype != torch.float32
    _assert_steps_match(got, want, torch.bfloat16 if lossy else model_dtype)
    for layer, (a, b) in enumerate(zip(kv_fused.kv_caches, kv_ref.kv_caches)):
        assert a.dtype == cache_dtype
        torch.testing.assert_close(
            a.float(), b.float(), rtol=1e-2, atol=1e-2, msg=lambda m, layer=layer: f"layer {layer}: {m}"
        )


def test_fused_stack_refuses_mixed_float_caches(tmp_path):
    model = _load(make_tiny_model(tmp_path, "llama", with_tokenizer=False), torch.float32)
    fused = FusedCpuLayers.build(model)
    caches = PagedKV.for_model(model, num_blocks=4, tokens_per_block=4, dtype=torch.bfloat16).kv_caches
    caches[1] = caches[1].float()
    assert not fused.accepts(caches, torch.float32, 5)
    with pytest.raises(
        TypeError, match=r"kv_caches\[1\] must have the dtype of kv_caches\[0\] \(bfloat16\), got float32"
    ):
        fused._stack.set_kv_caches(caches, None, None, None)
