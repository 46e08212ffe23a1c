"""Prompt cache in host memory (`--cache-ram`): the KV rows of prompts that slots gave up.

A slot holds one cached prompt; when it takes a request that shares little with it, the old prompt
would be lost and computed again when its conversation comes back. Instead its tokens and KV rows
(`Context.read_seq`) go here, and a request whose prompt shares a longer prefix with an entry than
with its slot's own cache starts from that entry (`Context.write_seq`). One cache serves every
pipeline group: the rows are host bytes in the cache's types, the same for every group's context.
Entries go least recently used first once the total passes the limit.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from .slot import common_prefix

# A loss shorter than one KV block is cheaper to compute again than to copy out and back.
MIN_TOKENS = 16

Rows = list[tuple[np.ndarray, np.ndarray]]


@dataclass
class Entry:
    tokens: list[int]
    rows: Rows
    nbytes: int
    used: int = field(default=0)


def _key(tokens: Sequence[int]) -> bytes:
    """Entries are found by their first MIN_TOKENS tokens: a prompt sharing fewer with an entry
    would not load it (see MIN_TOKENS), so no lookup needs to look past its own bucket."""
    return np.asarray(tokens[:MIN_TOKENS], dtype=np.int64).tobytes()


def _starts(longer: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(longer) >= len(prefix) and common_prefix(longer, prefix) == len(prefix)


class PromptCache:
    def __init__(self, limit_bytes: int):
        """limit_bytes < 0: no limit."""
        self.limit = limit_bytes
        self._buckets: dict[bytes, list[Entry]] = {}
        self.nbytes = 0
        self._clock = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._buckets.values())

    def covers(self, tokens: Sequence[int]) -> bool:
        """Whether an entry already holds these tokens (as its own or a longer prompt's prefix)."""
        with self._lock:
            return any(_starts(e.tokens, tokens) for e in self._buckets.get(_key(tokens), ()))

    def save(self, tokens: Sequence[int], rows: Rows) -> bool:
        """Keeps `rows` (one K and one V array per layer, a row per token) for `tokens` (at least
        MIN_TOKENS), replacing entries whose prompts are prefixes of it. False when it does not fit
        the limit at all."""
        tokens = list(tokens)
        nbytes = sum(k.nbytes + v.nbytes for k, v in rows)
        if len(tokens) < MIN_TOKENS or 0 <= self.limit < nbytes:
            return False
        key = _key(tokens)
        with self._lock:
            for e in [e for e in self._buckets.get(key, ()) if _starts(tokens, e.tokens)]:
                self._drop(key, e)
            self._clock += 1
            self._buckets.setdefault(key, []).append(Entry(tokens, rows, nbytes, self._clock))
            self.nbytes += nbytes
            if 0 <= self.limit < self.nbytes:
                for k, e in sorted(((k, e) for k, b in self._buckets.items() for e in b), key=lambda ke: ke[1].used):
                    if self.nbytes <= self.limit:
                        break
                    self._drop(k, e)
        return True

    def _drop(self, key: bytes, entry: Entry) -> None:
        bucket = self._buckets[key]
        bucket.remove(entry)
        if not bucket:
            del self._buckets[key]
        self.nbytes -= entry.nbytes

    def best(self, prompt: Sequence[int]) -> tuple[Optional[Entry], int]:
        """The entry sharing the longest prefix with `prompt`, and that length (marked as used);
        (None, 0) when none shares MIN_TOKENS."""
        with self._lock:
            best, n = None, 0
            for e in self._buckets.get(_key(prompt), ()):
                m = common_prefix(e.tokens, prompt)
                if m > n:
                    best, n = e, m
            if best is None or n < MIN_TOKENS:
                return None, 0
            self._clock += 1
            best.used = self._clock
            return best, n
