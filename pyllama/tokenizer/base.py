"""What SPM and BPE tokenizers share: the vocabulary read from GGUF metadata, special tokens,
special-token partitioning of the input, end-of-generation ids and token -> bytes.

Behaviour follows llama.cpp's `llama_vocab` (src/llama-vocab.cpp) so that ids match it exactly.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from ..util.errors import ModelFileError

log = logging.getLogger(__name__)

# tokenizer.ggml.token_type values (llama_token_type)
TT_UNDEFINED, TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 0, 1, 2, 3, 4, 5, 6

K = "tokenizer.ggml."
KEY_MODEL = K + "model"
KEY_PRE = K + "pre"
KEY_TOKENS = K + "tokens"
KEY_SCORES = K + "scores"
KEY_TYPES = K + "token_type"
KEY_MERGES = K + "merges"
KEY_ADD_BOS = K + "add_bos_token"
KEY_ADD_EOS = K + "add_eos_token"
KEY_ADD_SPACE_PREFIX = K + "add_space_prefix"

# metadata key -> attribute; later entries for the same attribute (deprecated names) win, as in llama.cpp
_SPECIAL_ID_KEYS = (
    ("bos_token_id", "bos_id"), ("eos_token_id", "eos_id"), ("eot_token_id", "eot_id"),
    ("eom_token_id", "eom_id"), ("unknown_token_id", "unk_id"), ("seperator_token_id", "sep_id"),
    ("padding_token_id", "pad_id"), ("mask_token_id", "mask_id"),
    ("fim_pre_token_id", "fim_pre_id"), ("fim_suf_token_id", "fim_suf_id"), ("fim_mid_token_id", "fim_mid_id"),
    ("fim_pad_token_id", "fim_pad_id"), ("fim_rep_token_id", "fim_rep_id"), ("fim_sep_token_id", "fim_sep_id"),
    ("prefix_token_id", "fim_pre_id"), ("suffix_token_id", "fim_suf_id"), ("middle_token_id", "fim_mid_id"),
)

# llama.cpp finds these special tokens by their text when the metadata does not name them,
# and forces every token it finds this way to be a control token.
_AUTO_DETECT = {
    "eot_id": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
               "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom_id": ("<|eom_id|>",),
    "fim_pre_id": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>"),
    "fim_suf_id": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>"),
    "fim_mid_id": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>"),
    "fim_pad_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "fim_rep_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep_id": ("<|file_sep|>", "<file_sep>"),
}
# tokens whose text alone makes them end generation (llama.cpp's special_eog_ids heuristics)
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
))


class Tokenizer:
    """A tokenizer built from GGUF `tokenizer.ggml.*` metadata (use `load_tokenizer`)."""

    model: str = ""
    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool

    # per-model defaults (llama.cpp's, where they exist in the vocabulary)
    _default_ids: dict[str, int] = {}
    _default_add_bos = False
    _default_add_space_prefix = False

    def __init__(self, metadata: dict[str, Any], source: str = "model"):
        self.source = source
        tokens = metadata.get(KEY_TOKENS)
        if tokens is None:
            raise self._error(KEY_TOKENS, "is missing")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise self._error(KEY_TOKENS, "must be a non-empty array of strings")
        n = len(tokens)
        self.n_vocab = n
        # llama.cpp renames empty tokens so every token has a distinct, non-empty text
        self._texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._scores = self._float_array(metadata, KEY_SCORES, n)
        types = metadata.get(KEY_TYPES)
        if types is None:
            self._types = [TT_NORMAL] * n
        else:
            if not isinstance(types, list) or len(types) != n or not all(isinstance(t, int) for t in types):
                raise self._error(KEY_TYPES, f"must be an array of {n} integers (one per token)")
            self._types = [t if TT_NORMAL <= t <= TT_BYTE else TT_UNDEFINED for t in types]
        # duplicates: the last id wins, as in llama.cpp's token_to_id map
        self._token_to_id = {t: i for i, t in enumerate(self._texts)}

        self.add_bos = self._bool(metadata, KEY_ADD_BOS, self._default_add_bos)
        self.add_eos = self._bool(metadata, KEY_ADD_EOS, False)
        self.add_space_prefix = self._bool(metadata, KEY_ADD_SPACE_PREFIX, self._default_add_space_prefix)
        self._read_special_ids(metadata)
        if self.add_bos and self.bos_id is None:
            raise self._error(K + "bos_token_id", "is missing but the tokenizer adds a BOS token")
        if self.add_eos and self.eos_id is None:
            raise self._error(K + "eos_token_id", "is missing but the tokenizer adds an EOS token")

        # partition order: longest UTF-8 text first (llama.cpp's cache_special_tokens)
        special = [i for i, t in enumerate(self._types) if t in (TT_CONTROL, TT_USER_DEFINED, TT_UNKNOWN)]
        special.sort(key=lambda i: (-len(self._texts[i].encode("utf-8")), i))
        self._special_all = [(self._texts[i], i) for i in special]
        # user-defined tokens are split out even when parse_special is off (llama.cpp / HF added tokens)
        self._special_user = [(s, i) for s, i in self._special_all if self._types[i] == TT_USER_DEFINED]
        self._pieces = self._build_pieces()
        self._pieces_special: Optional[list[bytes]] = None  # built on first use (token_bytes)

    # ---- metadata helpers -------------------------------------------------------------------

    def _error(self, key: str, what: str) -> ModelFileError:
        return ModelFileError(f"{self.source}: metadata key '{key}' {what}")

    def _bool(self, md: dict[str, Any], key: str, default: bool) -> bool:
        v = md.get(key, default)
        if not isinstance(v, bool):
            raise self._error(key, f"must be a boolean, not {v!r}")
        return v

    def _float_array(self, md: dict[str, Any], key: str, n: int) -> list[float]:
        v = md.get(key)
        if v is None:
            return [0.0] * n
        if not isinstance(v, list) or len(v) != n or not all(isinstance(x, (int, float)) for x in v):
            raise self._error(key, f"must be an array of {n} numbers (one per token)")
        return [float(x) for x in v]

    def _read_special_ids(self, md: dict[str, Any]) -> None:
        n = self.n_vocab
        ids: dict[str, int | None] = {attr: None for _, attr in _SPECIAL_ID_KEYS}
        for attr, default in self._default_ids.items():
            if default < n:
                ids[attr] = default
        for suffix, attr in _SPECIAL_ID_KEYS:
            key = K + suffix
            if key not in md:
                continue
            v = md[key]
            if isinstance(v, bool) or not isinstance(v, int):
                raise self._error(key, f"must be a token id, not {v!r}")
            if not 0 <= v < n:
                raise self._error(key, f"is {v}, out of range for a vocabulary of {n} tokens")
            ids[attr] = v
        # first listed text present wins (llama.cpp walks an unordered map: any candidate may win there)
        for attr, texts in _AUTO_DETECT.items():
            if ids[attr] is not None:
                continue
            for text in texts:
                tid = self._token_to_id.get(text)
                if tid is not None:
                    ids[attr] = tid
                    self._force_control(tid)
                    break
        eog = {ids[a] for a in ("fim_pad_id", "fim_rep_id", "fim_sep_id") if ids[a] is not None}
        for text in _EOG_TEXTS:
            tid = self._token_to_id.get(text)
            if tid is not None:
                eog.add(tid)
                self._force_control(tid)
        for attr in ("eos_id", "eot_id", "eom_id"):
            if ids[attr] is not None:
                eog.add(ids[attr])
        self._eog = frozenset(eog)
        for attr, v in ids.items():
            setattr(self, attr, v)

    def _force_control(self, tid: int) -> None:
        if self._types[tid] != TT_CONTROL:
            log.debug("%s: token %d %r looks like a control token; treating it as one", self.source, tid,
                      self._texts[tid])
            self._types[tid] = TT_CONTROL

    # ---- public API ---------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`, exactly as llama.cpp's `llama_tokenize` gives them.

        add_special: prepend BOS / append EOS as the model asks (add_bos / add_eos).
        parse_special: text of control tokens becomes their ids; otherwise it is plain text.
        User-defined tokens are always matched, as llama.cpp does.
        """
        text = _valid_text(text)
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]
        if text:
            prev_special = True
            for frag in self._partition(text, parse_special):
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                else:
                    self._encode_text(frag, prev_special, out)
                    prev_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The bytes this token stands for in generated text (b'' for control/unknown/unused tokens;
        with `special`, a control token's own text, as llama.cpp renders it with special=true)."""
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} out of range (vocabulary of {self.n_vocab})")
        if special:
            if self._pieces_special is None:
                self._pieces_special = [t.encode("utf-8") if tt == TT_CONTROL else p
                                        for t, tt, p in zip(self._texts, self._types, self._pieces)]
            return self._pieces_special[token_id]
        return self._pieces[token_id]

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD), as llama.cpp's `llama_detokenize`."""
        data = b"".join([self.token_bytes(i) for i in ids])
        # add_space_prefix put a space before the text; llama.cpp strips it from the first piece only
        if self.add_space_prefix and ids and self._pieces[ids[0]][:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def is_eog(self, token_id: int) -> bool:
        """Whether this token ends generation (EOS, EOT, EOM and llama.cpp's text heuristics)."""
        return token_id in self._eog

    @property
    def eog_ids(self) -> frozenset[int]:
        return self._eog

    def token_text(self, token_id: int) -> str:
        """The vocabulary string of a token."""
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} out of range (vocabulary of {self.n_vocab})")
        return self._texts[token_id]

    def token_type(self, token_id: int) -> int:
        """The token's type (TT_* constants), after llama.cpp's control-token overrides."""
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} out of range (vocabulary of {self.n_vocab})")
        return self._types[token_id]

    def token_to_id(self, text: str) -> int | None:
        """The id whose vocabulary string is `text`, if any."""
        return self._token_to_id.get(text)

    # ---- internals ----------------------------------------------------------------------------

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split `text` on special-token texts, longest token first, as llama.cpp's
        tokenizer_st_partition: each token splits the raw fragments left by the longer ones."""
        frags: list[str | int] = [text]
        for s, tid in (self._special_all if parse_special else self._special_user):
            if s not in text:  # cheap reject: every fragment is a substring of text
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or s not in f:
                    out.append(f)
                    continue
                parts = f.split(s)
                if parts[0]:
                    out.append(parts[0])
                for p in parts[1:]:
                    out.append(tid)
                    if p:
                        out.append(p)
            frags = out
        return frags

    def _encode_text(self, text: str, prev_special: bool, out: list[int]) -> None:
        raise NotImplementedError

    def _normal_piece(self, text: str) -> bytes:
        raise NotImplementedError

    def _byte_piece(self, token_id: int) -> bytes:
        return b""

    def _build_pieces(self) -> list[bytes]:
        pieces = []
        for i, (t, tt) in enumerate(zip(self._texts, self._types)):
            if tt == TT_NORMAL:
                pieces.append(self._normal_piece(t))
            elif tt == TT_USER_DEFINED:
                pieces.append(t.encode("utf-8"))
            elif tt == TT_BYTE:
                pieces.append(self._byte_piece(i))
            else:  # control, unknown, unused, undefined: nothing in generated text (llama.cpp, special=false)
                pieces.append(b"")
        return pieces


def _valid_text(text: str) -> str:
    """`text` with lone surrogates (possible from JSON escapes) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)
