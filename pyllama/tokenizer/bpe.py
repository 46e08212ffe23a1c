"""Byte-pair-encoding tokenizers (`tokenizer.ggml.model` 'gpt2', 'gemma4', 'whitespace').

The merge loop runs in the HF `tokenizers` library (Rust): its BPE model is built from the GGUF
vocabulary and merges, behind the pre-tokenizer regexes llama.cpp uses for `tokenizer.ggml.pre`
(pretok.py) and, for GPT-2 style vocabularies, the byte-level mapping. Merging is the same as
llama.cpp's (lowest rank first, ties leftmost).
"""
from __future__ import annotations

import logging
import re
from typing import Any

from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from .base import KEY_MERGES, KEY_PRE, Tokenizer
from .pretok import PRE_TOKENIZERS, PreTokenizer
from ..models.default_vocab import bytes_to_unicode  # GPT-2's byte map, shared with the test vocabulary

log = logging.getLogger(__name__)

SPACE = "\u2581"  # U+2581, the visible space of SentencePiece-style vocabularies
KEY_LOWERCASE = "tokenizer.ggml.normalizer.lowercase"
_NEWLINE_RUNS = re.compile(r"(\n+)")


BYTE_ENCODER = bytes_to_unicode()
BYTE_DECODER = {c: b for b, c in BYTE_ENCODER.items()}
# str.translate + latin-1 turns a byte-level string into its bytes in C; tokens with other
# characters take the slow path
_TO_LATIN1 = {ord(c): b for c, b in BYTE_DECODER.items()}
_NOT_BYTE_LEVEL = re.compile("[^" + re.escape("".join(BYTE_DECODER)) + "]")


class BPETokenizer(Tokenizer):
    """llama.cpp's `llm_tokenizer_bpe` and its byte-level and SPM-style (Gemma 4) variants."""

    model = "gpt2"

    def __init__(self, metadata: dict[str, Any], source: str = "model", kind: str = "gpt2"):
        self.source = source
        self.model = kind
        pre = "gemma4" if kind == "gemma4" else metadata.get(KEY_PRE)  # llama.cpp forces it for this model
        if pre is not None and not isinstance(pre, str):
            raise self._error(KEY_PRE, f"must be a string, not {pre!r}")
        if pre is None or pre == "":
            # llama.cpp's behaviour for old conversions: its 'default' regexes, with a warning
            log.warning("%s: metadata key '%s' is missing; using the 'default' pre-tokenizer; "
                        "ids may differ from the model's own tokenizer", source, KEY_PRE)
            pre = "default"
        rules = PRE_TOKENIZERS.get(pre)
        if rules is None:
            raise self._error(KEY_PRE, f"is {pre!r}, an unknown pre-tokenizer (llama.cpp's names are known; "
                                       f"choose one with --override-kv {KEY_PRE}=str:NAME)")
        self.pre = pre
        self.rules: PreTokenizer = rules
        self._ignore_merges = rules.ignore_merges
        self._default_add_bos = rules.add_bos
        self._byte_level = rules.byte_level
        self._lowercase = kind == "whitespace" and self._bool(metadata, KEY_LOWERCASE, rules.lowercase)
        super().__init__(metadata, source)
        if rules.force_add_bos and not self.add_bos:
            log.warning("%s: adding BOS although tokenizer.ggml.add_bos_token is false, as llama.cpp does for "
                        "the %r pre-tokenizer", source, pre)
            if self.bos_id is None:
                raise self._error("tokenizer.ggml.bos_token_id", "is missing but the tokenizer adds a BOS token")
            self.add_bos = True
        self._hf = self._build_hf(metadata)

    def _build_hf(self, metadata: dict[str, Any]) -> HFTokenizer:
        merges = metadata.get(KEY_MERGES)
        if merges is None:
            raise self._error(KEY_MERGES, f"is missing (a '{self.model}' tokenizer needs its BPE merges)")
        if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
            raise self._error(KEY_MERGES, "must be an array of strings")
        vocab = self._token_to_id
        pairs = []
        seen = set()
        for m in merges:
            sp = m.find(" ", 1)  # as llama.cpp: a pair's first part may itself start with a space
            if sp < 0:
                continue
            a, b = m[:sp], m[sp + 1:]
            # HF refuses merges outside the vocabulary; they could only yield byte tokens anyway.
            # Duplicates keep their first rank, as llama.cpp's map does.
            if (a, b) in seen or a not in vocab or b not in vocab or a + b not in vocab:
                continue
            seen.add((a, b))
            pairs.append((a, b))
        # without the byte map, characters outside the vocabulary fall back to <0xXX> tokens
        model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=self._ignore_merges,
                           fuse_unk=False, byte_fallback=not self._byte_level)
        hf = HFTokenizer(model)
        regexes = self.rules.regexes
        if self.rules.newline_words:
            regexes = ()  # the only split (newline runs) is done in _encode_text
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        if self._byte_level:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        if steps:
            hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
        return hf

    def _normal_piece(self, text: str) -> bytes:
        if not self._byte_level:
            return (text.replace(SPACE, " ") if self.rules.escape_spaces else text).encode("utf-8")
        if _NOT_BYTE_LEVEL.search(text) is None:
            return text.translate(_TO_LATIN1).encode("latin-1")
        # not byte-level text (llama.cpp writes an [UNK_BYTE_...] marker): keep the characters
        return b"".join(bytes([BYTE_DECODER[c]]) if c in BYTE_DECODER else c.encode("utf-8") for c in text)

    def _byte_piece(self, token_id: int) -> bytes:
        t = self._texts[token_id]
        if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            try:
                return bytes([int(t[3:5], 16)])
            except ValueError:
                pass
        return self._normal_piece(t)

    def _encode_text(self, text: str, prev_special: bool, out: list[int]) -> None:
        # encode_batch releases the GIL while it works (encode holds it for the whole text), so a
        # large text tokenized on a worker thread does not stall the event loop
        if self.model == "whitespace":
            # llama.cpp's whitespace model: words between whitespace, each tokenized on its own
            words = (text.lower() if self._lowercase else text).split()
            for enc in self._hf.encode_batch(words, add_special_tokens=False) if words else ():
                out.extend(enc.ids)
            return
        if self.rules.escape_spaces:
            text = text.replace(" ", SPACE)
        if not self.rules.newline_words:
            out.extend(self._hf.encode_batch([text], add_special_tokens=False)[0].ids)
            return
        # Gemma 4: newline runs and the text between them are the words; a newline run that is a
        # token is that token, anything else is merged
        parts = [p for p in _NEWLINE_RUNS.split(text) if p]
        todo = [p for p in parts if p[0] != "\n" or p not in self._token_to_id]
        encoded = iter(self._hf.encode_batch(todo, add_special_tokens=False)) if todo else iter(())
        for p in parts:
            tid = self._token_to_id.get(p) if p[0] == "\n" else None
            out.extend([tid] if tid is not None else next(encoded).ids)
