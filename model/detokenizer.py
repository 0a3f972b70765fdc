"""Incremental detokenization: generated tokens in, text out, only ever whole UTF-8 characters.

A token can end in the middle of a character (an emoji split over byte tokens, a CJK character split
by BPE). llama-server (tools/server, `process_token`) appends each token's bytes to the generated text
and sends what is new only when the text does not end in a cut-off character (`validate_utf8`, which
looks at the last four bytes); otherwise the token's bytes wait for the next one. We do the same, so
chunks and logprob entries line up with llama-server's. Bytes that are invalid in themselves (not a
truncated tail) are released and become U+FFFD, as llama-server's JSON writer makes them; `flush` at
the end of a generation releases a truncated tail the same way.
"""

from __future__ import annotations

from typing import Protocol


class _Pieces(Protocol):
    def token_to_piece(self, token: int, special: bool) -> bytes: ...


def complete_utf8_len(data: bytes) -> int:
    """llama-server's validate_utf8: the length of `data` without a multi-byte character cut off at its
    end (if the last four bytes hold the lead byte of a character whose bytes have not all arrived)."""
    n = len(data)
    for i in range(1, min(4, n) + 1):
        c = data[n - i]
        if (c & 0xE0) == 0xC0:
            if i < 2:
                return n - i
        elif (c & 0xF0) == 0xE0:
            if i < 3:
                return n - i
        elif (c & 0xF8) == 0xF0 and i < 4:
            return n - i
    return n


def complete_utf8_text(data: bytes) -> str:
    """A logprob entry's `token`: llama-server's `txt.resize(validate_utf8(txt))`, the character cut off at
    the end dropped; what is left invalid becomes U+FFFD."""
    return data[:complete_utf8_len(data)].decode("utf-8", "replace")


class IncrementalDetokenizer:
    """Feed tokens with `push`; each call returns the text released by that token ("" while held).

    `special=True` renders control tokens (llama-server's `special` option); by default they add no text.
    """

    def __init__(self, tokenizer: _Pieces, special: bool = False):
        self._tokenizer = tokenizer
        self._special = special
        self._pending = bytearray()

    @property
    def pending_bytes(self) -> bytes:
        """Bytes received but not yet released (an incomplete character at the end)."""
        return bytes(self._pending)

    def push(self, token: int) -> str:
        return self.push_bytes(self._tokenizer.token_to_piece(token, self._special))

    def push_bytes(self, piece: bytes) -> str:
        self._pending += piece
        if complete_utf8_len(self._pending) < len(self._pending):
            return ""
        return self._release()

    def flush(self) -> str:
        """End of generation: release whatever is held; a cut-off character becomes U+FFFD."""
        return self._release()

    def _release(self) -> str:
        text = self._pending.decode("utf-8", "replace")
        self._pending.clear()
        return text
