"""llama-server's n-gram drafts: a generating sequence drafts from its own tokens (and, for
`ngram-cache`, from lookup cache files), with no draft model.

- `ngram-simple` copies the tokens that followed the last earlier occurrence of its last n tokens;
- `ngram-map-k` / `ngram-map-k4v` keep a map of the sequence's n-grams and what followed them
  (ngram_map.py);
- `ngram-mod` follows a hash table of the n-grams seen (the token that last followed each) from
  its last n tokens, one token at a time;
- `ngram-cache` grows a draft from counts of what followed each 1- to 4-gram (lookup_cache.py).

With several types, each sequence takes the draft of the first type (in llama-server's order,
speculative.NGRAM_TYPES) that proposes one, and that type learns how much of it was accepted.
"""
from __future__ import annotations

import functools
from typing import Callable, Generic, Optional, TypeVar

import numpy as np

from .lookup_cache import N_DRAFT, NgramCounts, cache_draft
from .ngram_map import NgramMap
from .slot import Slot
from .speculative import Drafter, SpecConfig, draft_limit


def ngram_simple_draft(history: np.ndarray, last: int, n: int, m: int) -> list[int]:
    """llama-server's ngram-simple draft: the history's last n - 1 tokens and `last` (the sampled
    token, not yet in the history) form the pattern; its latest earlier occurrence that starts
    after position 0 and ends before the history's last token gives the (at most m) tokens that
    followed it, when at least n did."""
    size = int(history.shape[0])
    if size <= n + m + 1:
        return []
    pattern = np.empty(n, dtype=history.dtype)
    pattern[:n - 1] = history[size - n + 1:]
    pattern[n - 1] = last
    # windows starting at 1 .. size - n - 1 (llama.cpp searches backwards over these)
    windows = np.lib.stride_tricks.sliding_window_view(history[:size - 1], n)[1:size - n]
    hits = np.flatnonzero((windows == pattern).all(axis=1))
    if hits.size == 0:
        return []
    pos = int(hits[-1]) + 1
    take = min(m, size - (pos + n))
    if take < n:
        return []
    return history[pos + n:pos + n + take].tolist()


_MUL = 6364136223846793005
_MASK = (1 << 64) - 1


class NgramModTable:
    """llama-server's ngram-mod table: a hash of each n-gram (the polynomial of its tokens with
    llama.cpp's multiplier, mod 2^64, mod the table's size) gives the token that last followed it;
    EMPTY (-1) where none did. Fixed size: 4 Mi entries, as llama.cpp's."""

    EMPTY = -1

    def __init__(self, n: int, size: int = 4 * 1024 * 1024):
        self.n = n
        self.entries = np.full(size, self.EMPTY, dtype=np.int32)
        self.used = 0
        self._pow = pow(_MUL, n - 1, 1 << 64)  # the weight of a window's first token, for rolling

    def reset(self) -> None:
        self.entries.fill(self.EMPTY)
        self.used = 0

    def add_all(self, tokens: np.ndarray, start: int, stop: int) -> None:
        """Adds the n-grams starting at start..stop-1 of `tokens`, each followed by the token after
        it (in order: a later n-gram with the same hash wins, as llama.cpp's loop)."""
        if stop <= start:
            return
        t = tokens.astype(np.uint64)
        h = np.zeros(stop - start, dtype=np.uint64)
        mul = np.uint64(_MUL)
        with np.errstate(over="ignore"):
            for i in range(self.n):
                h = h * mul + t[start + i:stop + i]
        idx = (h % np.uint64(self.entries.shape[0])).astype(np.int64)
        values = tokens[start + self.n:stop + self.n]
        # the last write of each index wins
        last, first = np.unique(idx[::-1], return_index=True)
        chosen = values[::-1][first]
        self.used += int((self.entries[last] == self.EMPTY).sum())
        self.entries[last] = chosen

    def draft(self, key: list[int], n_max: int) -> list[int]:
        """Follows the table from `key` (n tokens): each token found extends the key by one."""
        size = self.entries.shape[0]
        h = 0
        for tok in key:
            h = (h * _MUL + tok) & _MASK
        window = list(key)
        out: list[int] = []
        for _ in range(n_max):
            token = int(self.entries[h % size])
            if token == self.EMPTY:
                break
            out.append(token)
            h = ((h - window[len(out) - 1] * self._pow) * _MUL + token) & _MASK
            window.append(token)
        return out


class _ModSeq:
    """ngram-mod's record of one request: where its n-grams were added up to, and its streak of
    poorly accepted drafts."""
    __slots__ = ("task_id", "i_last", "n_low")

    def __init__(self, task_id: int) -> None:
        self.task_id = task_id
        self.i_last = 0
        self.n_low = 0


class _Proposer:
    """One n-gram type's drafts. `propose` is given the slot, its tokens and the most it may draft."""

    def propose(self, slot: Slot, history: list[int], limit: int) -> list[int]:
        raise NotImplementedError

    def accepted(self, slot: Slot, n_drafted: int, n_accepted: int) -> None:
        pass


T = TypeVar("T")


class _PerRequest(Generic[T]):
    """State kept per slot for its current request (a new request in the slot starts afresh)."""

    def __init__(self, make: Callable[[Slot], T]):
        self._make = make
        self._state: dict[int, tuple[int, T]] = {}

    def get(self, slot: Slot) -> T:
        task = slot.task
        assert task is not None
        kept = self._state.get(slot.id)
        if kept is None or kept[0] != task.id:
            kept = self._state[slot.id] = (task.id, self._make(slot))
        return kept[1]

    def peek(self, slot: Slot) -> Optional[T]:
        kept = self._state.get(slot.id)
        return kept[1] if kept is not None else None


class _Simple(_Proposer):
    def __init__(self, n: int, m: int):
        self.n, self.m = n, m

    def propose(self, slot: Slot, history: list[int], limit: int) -> list[int]:
        return ngram_simple_draft(np.asarray(history, dtype=np.int32), slot.next_token, self.n, self.m)


class _Map(_Proposer):
    def __init__(self, n: int, m: int, key_only: bool, min_hits: int):
        self.maps: _PerRequest[NgramMap] = _PerRequest(lambda slot: NgramMap(n, m, key_only, min_hits))

    def propose(self, slot: Slot, history: list[int], limit: int) -> list[int]:
        return self.maps.get(slot).draft(history, slot.next_token)

    def accepted(self, slot: Slot, n_drafted: int, n_accepted: int) -> None:
        nmap = self.maps.peek(slot)
        if nmap is not None:
            nmap.accepted(n_accepted)


class _Mod(_Proposer):
    """ngram-mod: one table for every sequence of the group, as llama-server shares one."""

    def __init__(self, n_match: int, n_min: int, n_max: int):
        self.table = NgramModTable(n_match)
        self.n_min, self.n_max = n_min, n_max
        self.seqs: _PerRequest[_ModSeq] = _PerRequest(self._begin)

    def _begin(self, slot: Slot) -> "_ModSeq":
        # a new request: its prompt's n-grams go in first
        table = self.table
        seq = _ModSeq(slot.task.id if slot.task is not None else -1)
        prompt = np.asarray(slot.prompt, dtype=np.int32)
        if len(prompt) >= table.n:
            table.add_all(prompt, 0, len(prompt) - table.n)
            seq.i_last = len(prompt) - table.n
            if table.used > 0.25 * table.entries.shape[0]:
                table.reset()
        return seq

    def propose(self, slot: Slot, history: list[int], limit: int) -> list[int]:
        table = self.table
        seq = self.seqs.get(slot)
        n = table.n
        cur = len(history)
        if cur < n:
            return []
        if seq.i_last + 32 < cur:  # the generated tokens' n-grams, in chunks
            table.add_all(np.asarray(history, dtype=np.int32), seq.i_last, cur - n)
            seq.i_last = cur - n
        draft = table.draft(history[cur - n + 1:] + [slot.next_token], self.n_max)
        return draft if len(draft) >= self.n_min else []

    def accepted(self, slot: Slot, n_drafted: int, n_accepted: int) -> None:
        """Five drafts in a row of which under a quarter was accepted empty the table (llama.cpp's
        rule), as its entries then mislead more than they help."""
        seq = self.seqs.peek(slot)
        if seq is None or n_drafted <= 0:
            return
        if n_accepted < 0.25 * n_drafted:
            seq.n_low += 1
            if seq.n_low >= 5:
                self.table.reset()
                seq.n_low = 0
                seq.i_last = 0
        else:
            seq.n_low = 0


class _CacheState:
    __slots__ = ("context", "counted")

    def __init__(self) -> None:
        self.context = NgramCounts()
        self.counted = 0


class _Cache(_Proposer):
    """ngram-cache: the sequence's own counts, with the lookup cache files (shared, read only)."""

    def __init__(self, static: Optional[NgramCounts], dynamic: Optional[NgramCounts]):
        self.static, self.dynamic = static, dynamic
        self.states: _PerRequest[_CacheState] = _PerRequest(lambda slot: _CacheState())

    def propose(self, slot: Slot, history: list[int], limit: int) -> list[int]:
        state = self.states.get(slot)
        tokens = history + [slot.next_token]
        state.context.update(tokens, state.counted)
        state.counted = len(tokens)
        return cache_draft(tokens, min(N_DRAFT, limit), state.context, self.dynamic,
                           self.static)


@functools.lru_cache(maxsize=4)
def _lookup_file(path: str, n_vocab: int) -> NgramCounts:
    """A lookup cache file, read once for every pipeline group's drafter (they only read it)."""
    return NgramCounts.load(path, n_vocab)


def make_proposer(kind: str, config: SpecConfig, n_vocab: int) -> _Proposer:
    if kind == "ngram-simple":
        return _Simple(config.ngram_n, config.ngram_m)
    if kind in ("ngram-map-k", "ngram-map-k4v"):
        sizes = config.map_k if kind == "ngram-map-k" else config.map_k4v
        return _Map(sizes.n, sizes.m, kind == "ngram-map-k", sizes.min_hits)
    if kind == "ngram-mod":
        return _Mod(config.mod_n_match, config.mod_n_min, config.mod_n_max)
    if kind == "ngram-cache":
        static = _lookup_file(config.lookup_static, n_vocab) if config.lookup_static else None
        dynamic = _lookup_file(config.lookup_dynamic, n_vocab) if config.lookup_dynamic else None
        return _Cache(static, dynamic)
    raise ValueError(f"speculative type {kind!r}")


class NgramDrafter(Drafter):
    """Drafts from each sequence's own tokens, by the configured n-gram types in turn."""

    def __init__(self, config: SpecConfig, n_vocab: int):
        config.validate()
        self.config = config
        self.proposers = [make_proposer(kind, config, n_vocab) for kind in config.kinds]
        self._drafted_by: dict[int, _Proposer] = {}  # slot id -> the type of its last draft

    def draft(self, slots: list[Slot], afford: Optional[Callable[[list[Slot]], list[Slot]]] = None) -> None:
        for slot in slots:
            slot.draft = self.propose(slot)

    def propose(self, slot: Slot) -> list[int]:
        self._drafted_by.pop(slot.id, None)
        cfg = self.config
        limit, fewest = draft_limit(slot, cfg.n_max, cfg.n_min)
        if not limit:
            return []
        history = slot.cache_tokens
        for proposer in self.proposers:
            draft = proposer.propose(slot, history, limit)
            if draft:  # the first type with a draft wins, as llama-server's; cut to the room
                self._drafted_by[slot.id] = proposer
                draft = draft[:limit]
                return draft if len(draft) >= fewest else []
        return []

    def accepted(self, slot: Slot, n_drafted: int, n_accepted: int) -> None:
        proposer = self._drafted_by.pop(slot.id, None)
        if proposer is not None:
            proposer.accepted(slot, n_drafted, n_accepted)


def spec_summary(config: SpecConfig) -> str:
    """The n-gram types and their sizes, for the log."""
    sizes = {"ngram-simple": f"n = {config.ngram_n}, m = {config.ngram_m}",
             "ngram-map-k": f"n = {config.map_k.n}, m = {config.map_k.m}",
             "ngram-map-k4v": f"n = {config.map_k4v.n}, m = {config.map_k4v.m}, min hits {config.map_k4v.min_hits}",
             "ngram-mod": f"n_match = {config.mod_n_match}, n_min = {config.mod_n_min}, n_max = {config.mod_n_max}",
             "ngram-cache": ", ".join(f"{flag} {path}" for flag, path in (("-lcs", config.lookup_static),
                                                                         ("-lcd", config.lookup_dynamic)) if path)
             or "no lookup files"}
    return "; ".join(f"{kind} ({sizes[kind]})" for kind in config.kinds)
