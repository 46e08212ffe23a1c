"""llama-server's `ngram-map-k` and `ngram-map-k4v` drafts: a map, per sequence, from each n-gram of
its tokens to where it occurred, and for each n-gram that recurs the m-grams that followed it.

- `ngram-map-k` (key only): the key (the last n - 1 tokens and the sampled one) found earlier in
  the sequence drafts the m tokens that followed its latest occurrence, cut to as many as were
  accepted the last time that key drafted (a key whose follower was wrong stops drafting long
  tails).
- `ngram-map-k4v` (key and up to 4 values): the m-grams that followed the key's occurrences are
  counted (the first 4 distinct ones); once the key has occurred `min_hits` times, the most
  frequent m-gram is drafted if it is at least twice as frequent as the others together.

As llama.cpp: the key is looked for among occurrences starting after position 0 whose m-gram
lies wholly before the sequence's last token, and nothing is drafted before the sequence has
2n + m tokens. Unlike llama.cpp's k4v, which drafts the tokens after the key's latest occurrence
whichever value won, the winning value's own tokens are drafted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

MAX_VALUES = 4          # m-grams counted per key (llama.cpp's COMMON_NGRAM_MAX_VALUES)
MAX_COUNT = 16380       # counts saturate here (llama.cpp's COMMON_NGRAM_MAX_VALUE_COUNT)


@dataclass
class _Value:
    start: int          # where this m-gram starts in the sequence
    count: int = 0
    n_accepted: int = 0  # tokens accepted when it last drafted (starts at m)


@dataclass
class _Key:
    hits: int = 0
    counted: int = 0    # occurrences whose following m-gram is counted
    values: list[_Value] = field(default_factory=list)


class NgramMap:
    """One sequence's map. `draft` proposes after a step; `accepted` records how much of the last
    proposal was kept."""

    def __init__(self, n: int, m: int, key_only: bool, min_hits: int = 1):
        self.n, self.m, self.key_only, self.min_hits = n, m, key_only, min_hits
        self._where: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its start positions, ascending
        self._indexed = 1   # the next start position to index (position 0 is never a match)
        self._keys: dict[tuple[int, ...], _Key] = {}
        self._last: Optional[_Value] = None  # the value that drafted last

    def draft(self, history: Sequence[int], sampled: int) -> list[int]:
        """The draft after `history` (the sequence's tokens) and its `sampled` next token."""
        self._last = None
        n, m = self.n, self.m
        size = len(history)
        if size < 2 * n + m:
            return []
        last_start = size - n - m - 1  # the latest start whose m-gram ends before the last token
        for j in range(self._indexed, last_start + 1):
            self._where.setdefault(tuple(history[j:j + n]), []).append(j)
        self._indexed = max(self._indexed, last_start + 1)
        key = tuple(history[size - n + 1:]) + (int(sampled),)
        where = self._where.get(key)
        if not where:
            return []
        stats = self._keys.get(key)
        if stats is None:
            stats = self._keys[key] = _Key()
        stats.hits = min(stats.hits + 1, MAX_COUNT)
        if self.key_only:
            if not stats.values:
                stats.values.append(_Value(0, 0, m))
            value = stats.values[0]
            value.start = where[-1] + n
        else:
            if stats.hits < self.min_hits:
                return []
            self._count(stats, history, where)
            best = max(range(len(stats.values)), key=lambda v: (stats.values[v].count, -v))
            value = stats.values[best]
            others = sum(v.count for i, v in enumerate(stats.values) if i != best)
            if others and value.count < 2 * others:
                return []  # no m-gram clearly the most frequent
        self._last = value
        take = min(m, value.n_accepted)
        return [int(t) for t in history[value.start:value.start + take]]

    def _count(self, stats: _Key, history: Sequence[int], where: list[int]) -> None:
        n, m = self.n, self.m
        for pos in where[stats.counted:]:
            start = pos + n
            gram = history[start:start + m]
            for value in stats.values:
                if history[value.start:value.start + m] == gram:
                    value.count = min(value.count + 1, MAX_COUNT)
                    break
            else:
                if len(stats.values) < MAX_VALUES:
                    stats.values.append(_Value(start, 1, m))
        stats.counted = len(where)

    def accepted(self, n_accepted: int) -> None:
        if self._last is not None:
            self._last.n_accepted = n_accepted
            self._last = None
