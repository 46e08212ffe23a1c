"""Unigram tokenizer (`tokenizer.ggml.model == 't5'`), llama.cpp's `llm_tokenizer_ugm`.

Normalization follows llama.cpp: user-defined tokens are kept verbatim, other text goes through
the SentencePiece precompiled character map (`tokenizer.ggml.precompiled_charsmap`, applied by
the `tokenizers` library's `Precompiled` normalizer), then spaces become U+2581 with llama.cpp's
prefix and merging rules. The best segmentation (Viterbi over piece scores, unknown characters at
the lowest score minus 10, consecutive unknowns fused) runs in the `tokenizers` Unigram model.
"""
from __future__ import annotations

import re
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers

from .base import TT_NORMAL, TT_UNUSED, TT_USER_DEFINED, Tokenizer

SPACE = "\u2581"
KEY_CHARSMAP = "tokenizer.ggml.precompiled_charsmap"
KEY_REMOVE_EXTRA_WS = "tokenizer.ggml.remove_extra_whitespaces"


class UGMTokenizer(Tokenizer):
    """llama.cpp's `llm_tokenizer_ugm` (T5-style SentencePiece unigram)."""

    model = "t5"
    _default_ids = {"eos_id": 1, "unk_id": 2, "pad_id": 0}
    _default_add_space_prefix = True

    def __init__(self, metadata: dict[str, Any], source: str = "model"):
        self.source = source
        self.remove_extra_ws = self._bool(metadata, KEY_REMOVE_EXTRA_WS, False)
        super().__init__(metadata, source)
        self.add_eos = self._bool(metadata, "tokenizer.ggml.add_eos_token", True)
        if self.add_eos and self.eos_id is None:
            raise self._error("tokenizer.ggml.eos_token_id", "is missing but the tokenizer adds an EOS token")
        charsmap = metadata.get(KEY_CHARSMAP)
        self._norm = None
        if charsmap is not None:
            if not isinstance(charsmap, list) or len(charsmap) < 4:
                raise self._error(KEY_CHARSMAP, "must be an array of bytes")
            self._norm = normalizers.Precompiled(bytes(b & 0xFF for b in charsmap))
        user = sorted((t for t, tt in zip(self._texts, self._types) if tt == TT_USER_DEFINED), key=len, reverse=True)
        self._user_re = re.compile("(" + "|".join(map(re.escape, user)) + ")") if user else None
        # only normal, user-defined and unused pieces can be matched; the others get texts no
        # normalized input contains (a noncharacter and the id), keeping the ids in place
        pieces = []
        for i, (t, tt) in enumerate(zip(self._texts, self._types)):
            if tt in (TT_NORMAL, TT_UNUSED):
                pieces.append((t, self._scores[i]))
            elif tt == TT_USER_DEFINED:
                pieces.append((t, 0.0))
            else:
                pieces.append((f"\ufdd0{i}\ufdd0", 0.0))
        self._hf = HFTokenizer(models.Unigram(pieces, unk_id=self.unk_id, byte_fallback=False))

    def _normal_piece(self, text: str) -> bytes:
        return text.replace(SPACE, " ").encode("utf-8")

    def normalize(self, text: str) -> str:
        """llama.cpp's UGM normalization of one raw-text fragment."""
        parts = self._user_re.split(text) if self._user_re else [text]
        chars = []
        for k, p in enumerate(parts):
            if not p:
                continue
            if k % 2 == 0 and self._norm is not None:
                p = self._norm.normalize_str(p)
            chars.append(p)
        out = []
        in_word = False
        prepended = False
        for c in "".join(chars):
            if c != " ":
                if not in_word:
                    in_word = True
                    if (self.add_space_prefix and not prepended) or self.remove_extra_ws:
                        out.append(SPACE)
                        prepended = True
                out.append(c)
            else:
                in_word = False
                if not self.remove_extra_ws:
                    out.append(SPACE)
        return "".join(out)

    def _encode_text(self, text: str, prev_special: bool, out: list[int]) -> None:
        norm = self.normalize(text)
        if norm:
            out.extend(self._hf.encode_batch([norm], add_special_tokens=False)[0].ids)
