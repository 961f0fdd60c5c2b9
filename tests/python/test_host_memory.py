"""Host memory after loading (inflight.utils.host_memory): a fast tokenizer's Python copies of its
vocabulary and merges are dropped without changing what it does, and freed heap goes back to the OS."""

from __future__ import annotations

import logging

import pytest

from inflight.utils import host_memory


def _gemma_tokenizer():
    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "▁": 4, "h": 5, "e": 6, "l": 7, "o": 8}
    vocab.update({"he": 9, "ll": 10, "hell": 11, "hello": 12, "▁hello": 13, "▁h": 14})
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("▁", "hello"), ("▁", "h")]
    return GemmaTokenizer(vocab=vocab, merges=merges)


def test_dropping_the_build_tables_keeps_the_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = _gemma_tokenizer()
    texts = ["hello hello", "hello", "oh hell", "<bos>hello<eos>"]
    before = [tok.encode(t) for t in texts]
    decoded = [tok.decode(ids) for ids in before]
    vocab = tok.get_vocab()
    assert tok._vocab and tok._merges  # what transformers keeps (the reason for this helper)
    assert host_memory.drop_tokenizer_build_tables(tok) == 15 + 6
    assert tok._vocab == {} and tok._merges == []
    assert [tok.encode(t) for t in texts] == before
    assert [tok.decode(ids) for ids in before] == decoded and decoded[0] == "hello hello"
    assert tok.get_vocab() == vocab
    tok.save_pretrained(str(tmp_path))  # saving reads the backend, not the dropped copies
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert [again.encode(t) for t in texts] == before and again.get_vocab() == vocab
    assert host_memory.drop_tokenizer_build_tables(tok) == 0
    assert host_memory.drop_tokenizer_build_tables(None) == 0
    assert host_memory.drop_tokenizer_build_tables(object()) == 0


@pytest.mark.skipif(host_memory._malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_release_free_heap_gives_freed_heap_back():
    """~200 MiB of small allocations (in the heap, below malloc's mmap threshold), nine in ten freed
    with every tenth kept so the heap's top stays in use and free() cannot shrink it by itself."""
    blocks = [bytearray(2048) for _ in range(100_000)]
    for b in blocks:
        b[0] = 1  # touched: resident
    kept = blocks[::10]
    del blocks
    freed = host_memory.release_free_heap()
    assert freed is not None and freed > 100, freed
    assert len(kept) == 10_000 and host_memory.resident_mib() > 0


def test_load_model_logs_the_heap_it_returns(tiny_model_dir, caplog):
    from inflight.models.loader import load_model

    path = tiny_model_dir("llama")
    with caplog.at_level(logging.INFO, logger="inflight"):
        loaded = load_model(path, dtype="float32")
    assert loaded.tokenizer is not None
    if host_memory._malloc_trim() is not None:
        assert any("MiB of freed heap to the OS after loading" in r.message for r in caplog.records)
