"""llama-server's ngram-map-k / ngram-map-k4v maps and ngram-cache lookup drafts: the incremental
maps against a brute-force search over the whole history, the lookup cache files in llama.cpp's
layout (and every way one can be broken), and the draft rules (thresholds, the static weighing)."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from pyllama.batching.lookup_cache import NgramCounts, cache_draft
from pyllama.batching.ngram_map import MAX_VALUES, NgramMap
from pyllama.util.errors import PyllamaError

pytestmark = pytest.mark.unit


class BruteMap:
    """The maps' rules over the whole history at every call: the key's latest occurrence starting in
    1 .. size - n - m - 1; key-only drafts what followed it, cut to the key's last acceptance; k4v
    counts the first 4 distinct m-grams after its occurrences, drafts the most frequent once the key
    matched min_hits times and the m-gram is at least twice as frequent as the others together."""

    def __init__(self, n: int, m: int, key_only: bool, min_hits: int):
        self.n, self.m, self.key_only, self.min_hits = n, m, key_only, min_hits
        self.hits: dict[tuple, int] = {}
        self.accepted: dict[tuple, int] = {}   # (key, value start or None) -> last acceptance
        self.last = None

    def draft(self, h: list[int], sampled: int) -> list[int]:
        n, m = self.n, self.m
        self.last = None
        if len(h) < 2 * n + m:
            return []
        key = tuple(h[len(h) - n + 1:]) + (sampled,)
        where = [j for j in range(1, len(h) - n - m) if tuple(h[j:j + n]) == key]
        if not where:
            return []
        self.hits[key] = self.hits.get(key, 0) + 1
        if self.key_only:
            self.last = (key, None)
            return h[where[-1] + n:where[-1] + n + min(m, self.accepted.get(self.last, m))]
        if self.hits[key] < self.min_hits:
            return []
        values: list[list] = []  # [start, count]
        for j in where:
            gram = h[j + n:j + n + m]
            for v in values:
                if h[v[0]:v[0] + m] == gram:
                    v[1] += 1
                    break
            else:
                if len(values) < MAX_VALUES:
                    values.append([j + n, 1])
        best = max(range(len(values)), key=lambda i: (values[i][1], -i))
        others = sum(v[1] for i, v in enumerate(values) if i != best)
        if others and values[best][1] < 2 * others:
            return []
        self.last = (key, values[best][0])
        return h[values[best][0]:values[best][0] + min(m, self.accepted.get(self.last, m))]

    def accept(self, n_accepted: int) -> None:
        if self.last is not None:
            self.accepted[self.last] = n_accepted


@pytest.mark.parametrize("key_only", [True, False])
def test_ngram_map_matches_a_brute_force_search(key_only):
    rng = np.random.default_rng(1 if key_only else 2)
    drafted = 0
    for trial in range(60):
        n, m = int(rng.integers(1, 4)), int(rng.integers(1, 6))
        min_hits = int(rng.integers(1, 3))
        vocab = int(rng.integers(2, 5))
        tokens = rng.integers(0, vocab, 40).tolist()
        ours, ref = NgramMap(n, m, key_only, min_hits), BruteMap(n, m, key_only, min_hits)
        for _ in range(60):
            sampled = int(rng.integers(0, vocab))
            got, want = ours.draft(tokens, sampled), ref.draft(tokens, sampled)
            assert got == want, (trial, len(tokens))
            drafted += bool(got)
            tokens.append(sampled)
            if got:  # as a step would: keep some of the draft and report it
                kept = int(rng.integers(0, len(got) + 1))
                ours.accepted(kept)
                ref.accept(kept)
                tokens.extend(got[:kept])
    assert drafted > 100  # the cases exercise drafts, not only refusals


def test_key_only_draft_is_cut_to_its_last_acceptance():
    nmap = NgramMap(2, 4, key_only=True)
    h = [9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1]
    assert nmap.draft(h, 2) == [3, 4, 5, 6]
    nmap.accepted(1)
    assert nmap.draft(h, 2) == [3]         # the same key drafts only what it had accepted
    assert nmap.draft(h[:7], 2) == []      # shorter than 2n + m


def test_k4v_drafts_only_a_clearly_most_frequent_value():
    nmap = NgramMap(1, 1, key_only=False, min_hits=1)
    # after 5: 6, 7, 6, 7 -> 6 is not twice as frequent as 7
    assert nmap.draft([0, 5, 6, 5, 7, 5, 6, 5, 7, 0, 0], 5) == []
    nmap = NgramMap(1, 1, key_only=False, min_hits=1)
    assert nmap.draft([0, 5, 6, 5, 6, 5, 7, 0, 0], 5) == [6]   # 2 against 1: twice as frequent
    nmap = NgramMap(1, 1, key_only=False, min_hits=2)
    history = [0, 5, 6, 5, 6, 5, 7, 0, 0]
    assert nmap.draft(history, 5) == []     # the key's first match: under min_hits
    assert nmap.draft(history, 5) == [6]


def _record(ngram: list[int], pairs: list[tuple[int, int]]) -> bytes:
    """One record as llama.cpp's common_ngram_cache_save writes it."""
    padded = ngram + [-1] * (4 - len(ngram))
    out = struct.pack("<4ii", *padded, len(pairs))
    for token, count in pairs:
        out += struct.pack("<ii", token, count)
    return out


def test_lookup_cache_file_layout(tmp_path):
    path = tmp_path / "c.bin"
    path.write_bytes(_record([1, 2], [(3, 5), (4, 1)]) + _record([7], [(8, 2)]) + _record([1, 2, 3, 4], [(0, 9)]))
    cache = NgramCounts.load(str(path), n_vocab=10)
    assert cache.parts == {(1, 2): {3: 5, 4: 1}, (7,): {8: 2}, (1, 2, 3, 4): {0: 9}}
    again = tmp_path / "d.bin"
    cache.save(str(again))
    assert again.read_bytes() == path.read_bytes()


@pytest.mark.parametrize("data,fragment", [
    (_record([1], [(2, 1)])[:12], "cut short"),
    (_record([1], [(2, 1)])[:-4], "past the end"),
    (_record([1], [(2, 1)]) + b"\x00\x00", "whole number of int32"),
    (_record([1], [(2, 1)]) + _record([1], [(3, 1)]), "appears twice"),
    (_record([-1], [(2, 1)]), "is not 1..4 tokens"),
    (_record([1, -1, 2], [(2, 1)]), "is not 1..4 tokens"),
    (_record([10], [(2, 1)]), "is not 1..4 tokens"),
    (_record([1], [(10, 1)]), "outside the vocabulary"),
    (_record([1], [(2, 0)]), "count under 1"),
    (struct.pack("<4ii", 1, -1, -1, -1, 0), "is not positive"),
    (struct.pack("<4ii", 1, -1, -1, -1, 3) + struct.pack("<ii", 2, 1), "past the end"),
])
def test_a_broken_lookup_cache_is_one_error(tmp_path, data, fragment):
    path = tmp_path / "bad.bin"
    path.write_bytes(data)
    with pytest.raises(PyllamaError, match="bad.bin") as err:
        NgramCounts.load(str(path), n_vocab=10)
    assert fragment in str(err.value)
    with pytest.raises(PyllamaError, match="missing.bin"):
        NgramCounts.load(str(tmp_path / "missing.bin"), n_vocab=10)


def test_counts_span_the_earlier_tokens():
    cache = NgramCounts()
    tokens = [1, 2, 3, 1, 2]
    cache.update(tokens, 0)
    cache.update(tokens + [3], 5)  # the new token's n-grams reach back into the earlier ones
    assert cache.get((1, 2)) == {3: 2}
    assert cache.get((3, 1, 2)) == {3: 1}
    assert cache.get((2,)) == {3: 2}


def test_cache_draft_follows_the_context():
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    context = NgramCounts()
    context.update(tokens, 0)
    assert cache_draft(tokens, 5, context, None, None) == [3, 1, 2, 3, 1]
    assert cache_draft(tokens, 2, context, None, None) == [3, 1]
    assert cache_draft([2], 5, context, None, None) == []   # shorter than a bigram


def test_cache_draft_thresholds_and_static_weights():
    empty = NgramCounts()
    dynamic = NgramCounts()
    dynamic.parts[(9,)] = {10: 4}
    assert cache_draft([0, 9], 1, empty, dynamic, None) == [10]       # 4 seen, all 10: strict limits pass
    dynamic.parts[(9,)] = {10: 3}
    assert cache_draft([0, 9], 1, empty, dynamic, None) == []         # 3 < the 4 a 1-gram needs there
    static = NgramCounts()
    static.parts[(8, 9)] = {10: 2, 11: 1}
    assert cache_draft([8, 9], 1, empty, None, static) == [10]        # the static cache alone: 2 of 3
    static.parts[(8, 9)] = {10: 1, 11: 1, 12: 1}
    assert cache_draft([8, 9], 1, empty, None, static) == []          # a third: under the half a bigram needs
    # the context's tie between 5 and 6 after (4,) is broken by what the static cache saw after (3, 4)
    context = NgramCounts()
    context.parts[(4,)] = {5: 2, 6: 2}
    static.parts[(3, 4)] = {6: 3}
    assert cache_draft([3, 4], 1, context, None, static) == [6]
