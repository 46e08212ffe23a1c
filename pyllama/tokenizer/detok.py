"""Streaming detokenization: text out as tokens arrive, never half a character."""
from __future__ import annotations

from .base import Tokenizer


def _incomplete_tail(buf: bytes) -> int:
    """Length of a trailing UTF-8 sequence that is still a valid prefix of a character and could
    complete with more bytes; 0 if the buffer ends on a boundary or the tail can never complete."""
    n = len(buf)
    for k in range(1, min(4, n + 1)):
        b = buf[n - k]
        if 0x80 <= b <= 0xBF:
            continue  # continuation byte: keep looking for the lead byte
        if 0xC2 <= b <= 0xDF:
            need = 2
        elif 0xE0 <= b <= 0xEF:
            need = 3
        elif 0xF0 <= b <= 0xF4:
            need = 4
        else:
            return 0  # ASCII or a byte that never starts a character
        if k >= need:
            return 0  # the sequence is already complete (or over-long: invalid either way)
        if k > 1:
            # the second byte's range depends on the lead (no overlongs, surrogates, > U+10FFFF)
            lo, hi = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(b, (0x80, 0xBF))
            if not lo <= buf[n - k + 1] <= hi:
                return 0
        return k
    return 0


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, holding back bytes of a character not yet complete.

    Concatenating every `feed` result and `flush()` gives `bytes.decode('utf-8', 'replace')` of
    all the tokens' bytes. With `strip_leading_space=True` the first piece loses one leading space
    when the tokenizer adds a space prefix, so the stream equals `tokenizer.decode(ids)`; leave it
    off for generated text, which continues a prompt and keeps its spaces (as llama-server does).
    """

    def __init__(self, tokenizer: Tokenizer, *, strip_leading_space: bool = False, special: bool = False):
        self.tokenizer = tokenizer
        self._special = special  # control tokens render as their text (llama-server's --special)
        self._pending = b""
        self._strip = strip_leading_space and tokenizer.add_space_prefix
        self._first = True

    def feed(self, token_id: int) -> str:
        """Text completed by this token (possibly '')."""
        piece = self.tokenizer.token_bytes(token_id, self._special)
        if self._first:
            self._first = False
            if self._strip and piece[:1] == b" ":
                piece = piece[1:]
        if not piece:
            return ""
        buf = self._pending + piece
        k = _incomplete_tail(buf)
        if k:
            self._pending = buf[-k:]
            buf = buf[:-k]
        else:
            self._pending = b""
        return buf.decode("utf-8", errors="replace")

    def flush(self) -> str:
        """Whatever is held back, with U+FFFD for an unfinished character; resets the hold."""
        buf, self._pending = self._pending, b""
        return buf.decode("utf-8", errors="replace")
