"""GPT-2 style byte-level BPE tokenizer (`tokenizer.ggml.model == 'gpt2'`).

The merge loop runs in the HF `tokenizers` library (Rust): its BPE model is built from the GGUF
vocabulary and merges, behind the pre-tokenizer regexes llama.cpp uses for `tokenizer.ggml.pre`
and a byte-level mapping. Merging is the same as llama.cpp's (lowest rank first, ties leftmost).
"""
from __future__ import annotations

import logging
import re
from typing import Any

from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from .base import KEY_MERGES, KEY_PRE, Tokenizer
from ..models.default_vocab import bytes_to_unicode  # GPT-2's byte map, shared with the test vocabulary

log = logging.getLogger(__name__)

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# pre name -> (regexes applied one after another, each splitting the pieces of the previous one;
#              ignore_merges: a whole word found in the vocabulary is one token; default add_bos)
_GPT2 = ((GPT2_REGEX,), False, False)
_LLAMA3 = ((LLAMA3_REGEX,), True, True)
_QWEN2 = ((QWEN2_REGEX,), False, False)
_STARCODER = ((r"\p{N}", GPT2_REGEX), False, False)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    # llama.cpp's own 'default' is a four-regex chain; GPT-2's regex is the sane choice here
    "default": _GPT2, "gpt-2": _GPT2, "gpt2": _GPT2, "phi-2": _GPT2, "roberta-bpe": _GPT2,
    "mpt": _GPT2, "olmo": _GPT2, "jais": _GPT2, "gigachat": _GPT2,
    "jina-es": _GPT2, "jina-de": _GPT2, "jina-v1-en": _GPT2,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "falcon3": _LLAMA3, "pixtral": _LLAMA3,
    "dbrx": ((LLAMA3_REGEX,), False, False), "smaug-bpe": ((LLAMA3_REGEX,), False, False),
    "qwen2": _QWEN2, "stablelm2": _QWEN2, "megrez": _QWEN2,
    "starcoder": _STARCODER, "refact": _STARCODER, "command-r": _STARCODER, "smollm": _STARCODER,
    "codeshell": _STARCODER, "exaone": _STARCODER, "minerva-7b": _STARCODER,
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", GPT2_REGEX, r"[0-9][0-9][0-9]"), False, False),
}


BYTE_ENCODER = bytes_to_unicode()
BYTE_DECODER = {c: b for b, c in BYTE_ENCODER.items()}
# str.translate + latin-1 turns a byte-level string into its bytes in C; tokens with other
# characters take the slow path
_TO_LATIN1 = {ord(c): b for c, b in BYTE_DECODER.items()}
_NOT_BYTE_LEVEL = re.compile("[^" + re.escape("".join(BYTE_DECODER)) + "]")


class BPETokenizer(Tokenizer):
    """llama.cpp's `llm_tokenizer_bpe` (byte-level BPE)."""

    model = "gpt2"

    def __init__(self, metadata: dict[str, Any], source: str = "model"):
        self.source = source
        pre = metadata.get(KEY_PRE)
        if pre is not None and not isinstance(pre, str):
            raise self._error(KEY_PRE, f"must be a string, not {pre!r}")
        if pre is None:
            log.warning("%s: metadata key '%s' is missing; using GPT-2's pre-tokenizer; "
                        "ids may differ from the model's own tokenizer", source, KEY_PRE)
        elif pre not in PRE_TOKENIZERS:
            log.warning("%s: unknown pre-tokenizer %r (metadata key '%s'); using GPT-2's; "
                        "ids may differ from the model's own tokenizer", source, pre, KEY_PRE)
        self.pre = pre or "default"
        self._regexes, self._ignore_merges, self._default_add_bos = PRE_TOKENIZERS.get(pre or "", _GPT2)
        super().__init__(metadata, source)
        self._hf = self._build_hf(metadata)

    def _build_hf(self, metadata: dict[str, Any]) -> HFTokenizer:
        merges = metadata.get(KEY_MERGES)
        if merges is None:
            raise self._error(KEY_MERGES, "is missing (a 'gpt2' tokenizer needs its BPE merges)")
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
        model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=self._ignore_merges,
                           fuse_unk=False, byte_fallback=False)
        hf = HFTokenizer(model)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in self._regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return hf

    def _normal_piece(self, text: str) -> bytes:
        if _NOT_BYTE_LEVEL.search(text) is None:
            return text.translate(_TO_LATIN1).encode("latin-1")
        # not byte-level text (llama.cpp writes an [UNK_BYTE_...] marker): keep the characters
        return b"".join(bytes([BYTE_DECODER[c]]) if c in BYTE_DECODER else c.encode("utf-8") for c in text)

    def _encode_text(self, text: str, prev_special: bool, out: list[int]) -> None:
        # encode_batch releases the GIL while it works (encode holds it for the whole text), so a
        # large text tokenized on a worker thread does not stall the event loop
        out.extend(self._hf.encode_batch([text], add_special_tokens=False)[0].ids)
