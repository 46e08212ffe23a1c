"""llama-server's `ngram-cache` drafts (lookup decoding) and its lookup cache files (`-lcs`, `-lcd`).

An n-gram cache counts, for each n-gram of 1 to 4 tokens, the tokens that followed it. A draft
grows one token at a time from the sequence's last tokens: the sequence's own cache (its tokens so
far) is asked first with lax thresholds, then the dynamic cache (`-lcd`, earlier generations) with
strict ones, the longest n-gram first; a candidate must have been seen often enough and take a
large enough share of what followed. A static cache (`-lcs`, bigrams of a large corpus) weighs the
candidates and, where neither of the others knows the n-gram, proposes on its own. Drafts are at
most 8 tokens, as llama-server's.

The file layout is llama.cpp's (`common_ngram_cache_save`): records of the n-gram as 4 int32
(-1 past its length), an int32 count of following tokens, then that many (int32 token, int32
count) pairs, little-endian, to the end of the file. `python -m pyllama.batching.lookup_cache`
writes one from text files.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import numpy as np

from ..util.errors import PyllamaError

NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2
N_DRAFT = 8
NULL = -1

# by n-gram length 1..4: the fewest observations and the least share (percent) a candidate needs
_LAX = ((2, 66), (2, 50), (1, 50), (1, 50))
_STRICT = ((4, 75), (3, 66), (2, 66), (2, 66))

Ngram = tuple[int, ...]
Counts = dict[int, int]


class NgramCounts:
    """An n-gram cache in memory: n-gram (a tuple of 1..4 tokens) -> {following token: count}."""

    def __init__(self) -> None:
        self.parts: dict[Ngram, Counts] = {}

    def get(self, ngram: Ngram) -> Optional[Counts]:
        return self.parts.get(ngram)

    def update(self, tokens: Sequence[int], start: int, lo: int = NGRAM_MIN, hi: int = NGRAM_MAX) -> None:
        """Counts the tokens at positions start.. of `tokens` after each n-gram (lo..hi tokens) that
        ends just before them (n-grams reaching back before `start` included)."""
        parts = self.parts
        for size in range(lo, hi + 1):
            for i in range(max(start, size), len(tokens)):
                ngram = tuple(tokens[i - size:i])
                part = parts.get(ngram)
                if part is None:
                    parts[ngram] = {tokens[i]: 1}
                else:
                    part[tokens[i]] = part.get(tokens[i], 0) + 1

    def __len__(self) -> int:
        return len(self.parts)

    def save(self, path: str) -> None:
        chunks = []
        for ngram, part in self.parts.items():
            head = np.full(5, NULL, dtype="<i4")
            head[:len(ngram)] = ngram
            head[4] = len(part)
            chunks.append(head.tobytes())
            chunks.append(np.array(list(part.items()), dtype="<i4").tobytes())
        with open(path, "wb") as f:
            f.write(b"".join(chunks))

    @classmethod
    def load(cls, path: str, n_vocab: int) -> "NgramCounts":
        """Reads a lookup cache file, checked whole: one error naming the file and the byte where
        a record is cut short or holds an impossible value."""
        try:
            data = np.fromfile(path, dtype="<i4")
            size = os.path.getsize(path)
        except OSError as exc:
            raise PyllamaError(f"lookup cache {path}: {exc.strerror or exc}") from None
        if size % 4:
            raise PyllamaError(f"lookup cache {path}: {size} bytes is not a whole number of int32 values")
        out = cls()
        i, total = 0, len(data)
        while i < total:
            where = f"lookup cache {path}: the record at byte {4 * i}"
            if i + 5 > total:
                raise PyllamaError(f"{where} is cut short")
            head = data[i:i + 5]
            length = int(np.count_nonzero(head[:4] != NULL))
            if length == 0 or (head[length:4] != NULL).any() or ((head[:length] < 0) | (head[:length] >= n_vocab)).any():
                raise PyllamaError(f"{where}: its n-gram {head[:4].tolist()} is not 1..4 tokens of the model's "
                                   f"{n_vocab} followed by -1")
            count = int(head[4])
            if count <= 0 or i + 5 + 2 * count > total:
                raise PyllamaError(f"{where}: {count} following tokens "
                                   f"{'is not positive' if count <= 0 else 'run past the end of the file'}")
            pairs = data[i + 5:i + 5 + 2 * count].reshape(count, 2)
            if ((pairs[:, 0] < 0) | (pairs[:, 0] >= n_vocab) | (pairs[:, 1] <= 0)).any():
                raise PyllamaError(f"{where}: a following token outside the vocabulary or a count under 1")
            ngram = tuple(int(t) for t in head[:length])
            if ngram in out.parts:
                raise PyllamaError(f"{where}: n-gram {list(ngram)} appears twice")
            out.parts[ngram] = {int(t): int(c) for t, c in pairs}
            i += 5 + 2 * count
        return out


def _from_primary(cache: NgramCounts, ngrams: list[Ngram], static: Counts, limits) -> int:
    """The token `cache` proposes after the longest of `ngrams` that passes its limits, its counts
    weighed by the static cache's (a token the static cache never saw after them weighs 1/100)."""
    for size in range(len(ngrams), 0, -1):
        part = cache.get(ngrams[size - 1])
        if part is None:
            continue
        best, best_score, best_count, total = NULL, 0, 0, 0
        for token, count in part.items():
            score = count * (100 * static[token] if token in static else 1)
            if score > best_score:
                best, best_score, best_count = token, score, count
            total += count
        least, percent = limits[size - 1]
        if total >= least and 100 * best_count >= percent * total:
            return best
    return NULL


def _from_static(static: Optional[Counts]) -> int:
    if not static:
        return NULL
    best, best_count = max(static.items(), key=lambda kv: kv[1])
    total = sum(static.values())
    least, percent = _LAX[NGRAM_STATIC - 1]
    if total < least or 100 * best_count < percent * total:
        return NULL
    return best


def cache_draft(tokens: Sequence[int], n_draft: int, context: NgramCounts, dynamic: Optional[NgramCounts],
                static: Optional[NgramCounts]) -> list[int]:
    """Up to n_draft tokens after `tokens` (the sequence with its sampled token last)."""
    if len(tokens) < NGRAM_STATIC:
        return []
    seq = list(tokens[-NGRAM_MAX:])
    draft: list[int] = []
    empty: Counts = {}
    while len(draft) < n_draft:
        bigram = tuple(seq[-NGRAM_STATIC:])
        static_part = (static.get(bigram) if static is not None else None) or empty
        ngrams = [tuple(seq[-size:]) for size in range(NGRAM_MIN, min(NGRAM_MAX, len(seq)) + 1)]
        token = _from_primary(context, ngrams, static_part, _LAX)
        if token == NULL and dynamic is not None:
            token = _from_primary(dynamic, ngrams, static_part, _STRICT)
        if token == NULL:
            token = _from_static(static_part)
        if token == NULL:
            break
        draft.append(token)
        seq.append(token)
    return draft


def main(argv: Optional[list[str]] = None) -> int:
    """Writes a lookup cache from text files, tokenized with a model's tokenizer: `--static`
    counts bigrams only (for -lcs), else 1- to 4-grams (for -lcd)."""
    p = argparse.ArgumentParser(prog="python -m pyllama.batching.lookup_cache",
                                description="write an n-gram lookup cache (llama.cpp's file layout) from text files")
    p.add_argument("-m", "--model", required=True, help="the GGUF model whose tokenizer reads the text")
    p.add_argument("-f", "--file", action="append", required=True, help="a text file (repeatable)")
    p.add_argument("-o", "--out", required=True, help="the cache file to write")
    p.add_argument("--static", action="store_true", help="bigrams only, as a static cache (-lcs) holds")
    args = p.parse_args(argv)
    from ..models.gguf_file import read_metadata  # noqa: PLC0415 - only this command needs a model
    from ..tokenizer import load_tokenizer  # noqa: PLC0415
    try:
        tok = load_tokenizer(read_metadata(args.model), source=args.model)
        counts = NgramCounts()
        lo, hi = (NGRAM_STATIC, NGRAM_STATIC) if args.static else (NGRAM_MIN, NGRAM_MAX)
        for path in args.file:
            with open(path, encoding="utf-8") as f:
                tokens = tok.encode(f.read(), add_special=False)
            counts.update(tokens, 0, lo, hi)
        counts.save(args.out)
    except (PyllamaError, OSError, UnicodeDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{args.out}: {len(counts)} n-grams")
    return 0


if __name__ == "__main__":
    sys.exit(main())
