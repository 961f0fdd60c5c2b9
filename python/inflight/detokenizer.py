"""Incremental detokenization: the text of a growing token sequence at a cost per step that does not
grow with the sequence.

Decoding the whole output again after every new token costs O(n) per step, O(n^2) per stream (a
4,000-token stream re-decodes 8 million tokens). :class:`IncrementalDetokenizer` decodes only a window:
the tokens since the last emitted text plus a few before them (the *prefix*), and emits what the new
tokens add to the prefix's text. The prefix is there because a token's text can depend on its left
neighbour (byte-level BPE splits a UTF-8 character across tokens; SentencePiece drops the leading
space of the first token of a decode), so a window that starts at the new token would decode it
differently than the whole sequence does.

Text is held back, and emitted later, while the window's text ends in U+FFFD (the new token ended in
the middle of a UTF-8 character) or is not longer than the prefix's (the token added nothing yet,
e.g. a skipped special token). For the tokenizers this project runs (byte-level BPE; SentencePiece
without ``clean_up_tokenization_spaces``) the concatenated text equals one decode of the whole
sequence; ``tests/python/test_detokenizer.py`` checks that on random sequences.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IncrementalDetokenizer"]

# Tokens of already-emitted text decoded again in front of the new ones: enough left context for the
# merges and UTF-8 sequences of real tokenizers (a character is at most 4 bytes, one per token).
PREFIX_TOKENS = 6


class IncrementalDetokenizer:
    """Feed every new token with :meth:`add`; :attr:`text` is everything decoded so far.

    ``tokenizer``: anything with ``decode(ids, skip_special_tokens=...)``.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # the window starts here
        self._read_offset = 0  # tokens before this have been turned into text
        self.text = ""

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Appends tokens; returns the text they complete (possibly "", see the module doc)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset) if self._read_offset else ""
        window_text = self._decode(self._prefix_offset)
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        new_text = window_text[len(prefix_text) :]
        self.text += new_text
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - PREFIX_TOKENS, 0)
        return new_text

    def flush(self) -> str:
        """At the end of the sequence: the held-back text too (an incomplete character as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset) if self._read_offset else ""
        window_text = self._decode(self._prefix_offset)
        new_text = window_text[len(prefix_text) :] if window_text.startswith(prefix_text) else ""
        self.text += new_text
        self._read_offset = len(self._ids)
        return new_text
