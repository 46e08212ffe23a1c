"""WordPiece tokenizer (`tokenizer.ggml.model == 'bert'`), llama.cpp's `llm_tokenizer_wpm`.

The text is normalized BERT-style (NFD and accent marks dropped when stripping accents,
lowercase, control characters dropped) and cut at whitespace, with every punctuation mark, ASCII
symbol and CJK ideograph a word of its own. Each word, behind a U+2581 marker, is then covered by
the longest vocabulary tokens from left to right; a word that cannot be covered is one [UNK].
GGUF BERT vocabularies spell word-initial pieces with that marker and continuation pieces bare
(the converter drops WordPiece's '##').
"""
from __future__ import annotations

import unicodedata
from typing import Any

from .base import Tokenizer

SPACE = "\u2581"
KEY_LOWERCASE = "tokenizer.ggml.normalizer.lowercase"
KEY_STRIP_ACCENTS = "tokenizer.ggml.normalizer.strip_accents"

# Unicode White_Space (llama.cpp's is_whitespace), not str.isspace(), which adds U+001C..U+001F
_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                         0x202F, 0x205F, 0x3000])
# CJK ideograph blocks BERT isolates (the upper bound of the extension C..E block follows HF's code)
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


# ASCII text (most requests) is normalized by str methods instead of character by character:
# control characters go, whitespace stays a separator, every punctuation mark and symbol (all of
# ASCII's are categories P or S) becomes a word of its own; NFD and the lowercase mapping change
# no other ASCII character.
_ASCII_WORDS = {cp: None for cp in (*range(0x00, 0x09), *range(0x0E, 0x20), 0x7F)}
_ASCII_WORDS.update({cp: f" {chr(cp)} " for cp in range(0x21, 0x7F) if not chr(cp).isalnum()})


def _is_cjk(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _CJK)


def _lower(c: str) -> str:
    """The simple (one character) lowercase mapping, as llama.cpp's table has it."""
    low = c.lower()
    return low if len(low) == 1 else low[0]


class WPMTokenizer(Tokenizer):
    """llama.cpp's `llm_tokenizer_wpm` (BERT WordPiece)."""

    model = "bert"
    _default_ids = {"bos_id": 101, "unk_id": 100, "sep_id": 102, "pad_id": 0, "mask_id": 103}
    _default_add_bos = True

    def __init__(self, metadata: dict[str, Any], source: str = "model"):
        self.source = source
        self.lowercase = self._bool(metadata, KEY_LOWERCASE, True)
        self.strip_accents = self._bool(metadata, KEY_STRIP_ACCENTS, self.lowercase)
        super().__init__(metadata, source)
        self._max_len = max(len(t) for t in self._texts)

    def _normal_piece(self, text: str) -> bytes:
        return text.replace(SPACE, " ").encode("utf-8")

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """As the base class, except that llama.cpp frames a WPM text with [CLS] ... [SEP] whenever
        add_special is set, whatever add_bos_token says."""
        out = super().encode(text, add_special=False, parse_special=parse_special)
        if add_special:
            if self.bos_id is not None:
                out.insert(0, self.bos_id)
            if self.sep_id is not None:
                out.append(self.sep_id)
        return out

    def words(self, text: str) -> list[str]:
        """The normalized words of `text` (llama.cpp's WPM preprocess)."""
        if text.isascii():
            text = text.translate(_ASCII_WORDS)
            return (text.lower() if self.lowercase else text).split()
        if self.strip_accents:
            text = unicodedata.normalize("NFD", text)
        words: list[str] = []
        cur: list[str] = []
        for c in text:
            cp = ord(c)
            if cp in _WHITESPACE:
                if cur:
                    words.append("".join(cur))
                    cur = []
                continue
            cat = unicodedata.category(c)
            if cp == 0 or cp == 0xFFFD or cat[0] == "C":
                continue
            if self.strip_accents and cat[0] == "M":
                continue
            s = _lower(c) if self.lowercase else c
            if cat[0] == "P" or (cp < 0x7F and cat[0] == "S") or _is_cjk(cp):
                if cur:
                    words.append("".join(cur))
                    cur = []
                words.append(s)
            else:
                cur.append(s)
        if cur:
            words.append("".join(cur))
        return words

    def _encode_text(self, text: str, prev_special: bool, out: list[int]) -> None:
        get = self._token_to_id.get
        for word in self.words(text):
            w = SPACE + word
            n = len(w)
            start = len(out)
            i = 0
            while i < n:
                for j in range(min(n, i + self._max_len), i, -1):
                    tid = get(w[i:j])
                    if tid is not None:
                        out.append(tid)
                        i = j
                        break
                else:  # no piece fits here: the whole word is unknown
                    del out[start:]
                    break
            if len(out) == start and self.unk_id is not None:
                out.append(self.unk_id)
