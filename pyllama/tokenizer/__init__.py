"""Tokenizers built from GGUF `tokenizer.ggml.*` metadata, ids-exact with llama.cpp, and
incremental detokenization for streaming."""
from __future__ import annotations

from typing import Any

from ..util.errors import ModelFileError
from .base import KEY_MODEL, Tokenizer
from .detok import IncrementalDetokenizer

__all__ = ["Tokenizer", "load_tokenizer", "IncrementalDetokenizer"]


def load_tokenizer(metadata: dict[str, Any], source: str = "model") -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes; `source` (e.g. the file path) prefixes errors."""
    kind = metadata.get(KEY_MODEL)
    if kind is None:
        raise ModelFileError(f"{source}: metadata key '{KEY_MODEL}' is missing")
    if kind == "llama":
        from .spm import SPMTokenizer
        return SPMTokenizer(metadata, source)
    if kind in ("gpt2", "gemma4", "whitespace"):
        from .bpe import BPETokenizer
        return BPETokenizer(metadata, source, kind)
    if kind == "bert":
        from .wpm import WPMTokenizer
        return WPMTokenizer(metadata, source)
    if kind == "t5":
        from .ugm import UGMTokenizer
        return UGMTokenizer(metadata, source)
    raise ModelFileError(f"{source}: metadata key '{KEY_MODEL}' is {kind!r}; supported: 'llama' (SPM), "
                         "'gpt2', 'gemma4' and 'whitespace' (BPE), 'bert' (WPM), 't5' (UGM)")
