"""Incremental detokenization: each step decodes a window of a few tokens, not the whole output.

Decoding all of a sequence's output ids at every step costs O(length) per token (303 ms per step at
2,048 tokens); this keeps two offsets into the output instead (the scheme of `tokenizers`'
`DecodeStream` and vLLM's detokenizer). `prefix_offset..read_offset` is the window already turned into
text; a new token is decoded together with that window, and the text beyond the window's own decoding
is the new text. The window gives the decoder the context it needs at the start (a SentencePiece
decoder strips the leading space of the first token it sees: decoding the new token alone would lose
the space that follows earlier text). New text is withheld while it ends in U+FFFD, i.e. while the
bytes so far end inside a multi-byte UTF-8 character that the next token completes; `finish()` then
releases what is still withheld, so the final text equals a full decode of the output ids, invalid
bytes included (shown as U+FFFD, as the full decode shows them).

Only the Rust tokenizer's own decode is windowed. A Hugging Face tokenizer that post-processes the
decoded text of the whole sequence (`clean_up_tokenization_spaces`) cannot be windowed exactly, and a
tokenizer without a Rust backend has no cheap decode: for those `Detokenizer` decodes the whole output
(the old way, still correct).
"""

from __future__ import annotations

from collections.abc import Callable


class Detokenizer:
    """One sequence's text, grown by `step` (one token at a time) and completed by `finish`."""

    __slots__ = ("_decode", "_full", "_start", "_prefix_offset", "_read_offset", "_prefix_text", "text")

    def __init__(self, decode: Callable[[list[int]], str], start: int = 0, windowed: bool = True) -> None:
        """`start`: index of the first output token in the id lists `step` will be given (a sequence's
        prompt length: the sequence's own token list is passed, never copied)."""
        self._decode = decode
        self._full = not windowed
        self._start = start
        self._prefix_offset = start  # where the decoding window starts
        self._read_offset = start  # tokens before this are text already
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self.text = ""

    def step(self, ids: list[int], end: int) -> str:
        """Account for the output ids `ids[start:end]`; returns the new text (empty while a character is
        incomplete). `self.text` is the text so far."""
        if self._full:
            text = self._decode(ids[self._start : end])
            if text.endswith("\ufffd"):
                return ""
            new, self.text = text[len(self.text):], text
            return new
        window = self._decode(ids[self._prefix_offset : end])
        if len(window) <= len(self._prefix_text) or window.endswith("\ufffd"):
            return ""
        new = window[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._prefix_text = self._decode(ids[self._prefix_offset : end])
        self.text += new
        return new

    def finish(self, ids: list[int], end: int) -> str:
        """The text still withheld once `ids[start:end]` is the whole output (an incomplete character at the
        end becomes U+FFFD, as in a full decode)."""
        if self._full:
            text = self._decode(ids[self._start : end])
            new, self.text = text[len(self.text):], text
            return new
        if end <= self._read_offset:
            return ""
        window = self._decode(ids[self._prefix_offset : end])
        new = window[len(self._prefix_text):]
        self._read_offset = end
        self.text += new
        return new
