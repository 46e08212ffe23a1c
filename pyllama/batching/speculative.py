"""Speculative decoding: a generating sequence proposes the tokens it expects next (a draft), its
next step computes them after its sampled token, and each row's logits are sampled in turn: the
tokens that match the draft are kept, so one step can yield several tokens.

A `Drafter` proposes the drafts: a draft model (draft_model.py), or the sequence's own history
as llama-server's n-gram drafts read it: `ngram-simple` copies the tokens that followed the last
earlier occurrence of its last n tokens; `ngram-mod` follows a hash table of the n-grams seen (the
token that last followed each) from its last n tokens, one token at a time. `SpecControl` decides
where drafting pays. Verification samples each row with
the sequence's own sampler and compares, as llama-server does: a row is sampled exactly as a
plain decode step would sample it (the same sampler state, one draw per token), so greedy and
seeded output is the same with and without drafts, as long as each row's logits are the same,
which the CPU kernels promise for steps of at most `EXACT_ROWS` rows (the scheduler keeps drafts
within that bound).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .sampling import BatchSampler
from .slot import Slot

SPEC_TYPES = ("none", "ngram-simple", "ngram-mod")


@dataclass(frozen=True)
class SpecConfig:
    """The server's speculative decoding settings (llama-server's --spec-* flags and defaults)."""
    kind: str = "none"          # "none", "ngram-simple" or "ngram-mod"
    ngram_n: int = 12           # --spec-ngram-simple-size-n: the n-gram looked up in the history
    ngram_m: int = 48           # --spec-ngram-simple-size-m: at most this many tokens that followed it
    mod_n_match: int = 24       # --spec-ngram-mod-n-match: the n-gram hashed
    mod_n_min: int = 48         # --spec-ngram-mod-n-min: a shorter ngram-mod draft is dropped
    mod_n_max: int = 64         # --spec-ngram-mod-n-max
    n_max: int = -1             # --spec-draft-n-max: a cap on any draft (-1: none)
    n_min: int = 0              # --spec-draft-n-min: a shorter draft is not verified

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def validate(self) -> None:
        if self.kind not in SPEC_TYPES:
            raise ValueError(f"speculative type {self.kind!r}: one of {', '.join(SPEC_TYPES)}")
        if min(self.ngram_n, self.ngram_m, self.mod_n_match, self.mod_n_max) < 1:
            raise ValueError("n-gram sizes must be at least 1")
        if self.n_min < 0 or self.mod_n_min < 0:
            raise ValueError("a minimum draft must be >= 0")


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


class Drafter:
    """What proposes drafts: before a step is planned, `draft` sets the generating slots' drafts
    (the scheduler then trims them to the step's room); after it, `accepted` learns how much of
    a slot's draft was kept."""

    def draft(self, slots: list[Slot]) -> None:
        raise NotImplementedError

    def accepted(self, slot: Slot, n_drafted: int, n_accepted: int) -> None:
        pass

    # measured seconds per token of catching up with a slot's tokens (a draft model; 0: unknown or free)
    catch_up_s_per_token = 0.0

    def behind(self, slot: Slot) -> int:
        """Tokens drafting for `slot` would first have to catch up with (0: none)."""
        return 0

    def close(self) -> None:
        pass


def draft_limit(slot: Slot, n_max: int, n_min: int) -> tuple[int, int]:
    """(most, fewest) draft tokens worth verifying for `slot`: its room (Slot.draft_room), the
    request's speculative.n_max / n_min and the server's; (0, 0) where it must not draft (a grammar
    or a thinking budget decides tokens a draft cannot know)."""
    task = slot.task
    if task is None or slot.constraint is not None or slot.lazy is not None or slot.thinking is not None or not task.spec_n_max:
        return 0, 0
    limit = slot.draft_room()
    if task.spec_n_max > 0:
        limit = min(limit, task.spec_n_max)
    if n_max >= 0:
        limit = min(limit, n_max)
    fewest = max(task.spec_n_min, n_min, 1)
    return (limit, fewest) if limit >= fewest else (0, 0)


class NgramDrafter(Drafter):
    """Drafts from each sequence's own tokens (ngram-simple or ngram-mod)."""

    def __init__(self, config: SpecConfig):
        config.validate()
        self.config = config
        self.table = NgramModTable(config.mod_n_match) if config.kind == "ngram-mod" else None
        self._mod: dict[int, _ModSeq] = {}  # slot id -> its request's record

    def draft(self, slots: list[Slot]) -> None:
        for slot in slots:
            slot.draft = self.propose(slot)

    def propose(self, slot: Slot) -> list[int]:
        cfg = self.config
        limit, fewest = draft_limit(slot, cfg.n_max, cfg.n_min)
        if not limit:
            return []
        task = slot.task
        assert task is not None
        history = np.asarray(slot.cache_tokens, dtype=np.int32)
        if self.table is not None:
            draft = self._mod_draft(slot, task.id, history)
        else:
            draft = ngram_simple_draft(history, slot.next_token, cfg.ngram_n, cfg.ngram_m)
        draft = draft[:limit]
        return draft if len(draft) >= fewest else []

    def _mod_draft(self, slot: Slot, task_id: int, history: np.ndarray) -> list[int]:
        table, cfg = self.table, self.config
        assert table is not None
        n = table.n
        seq = self._mod.get(slot.id)
        if seq is None or seq.task_id != task_id:  # a new request: its prompt's n-grams go in first
            seq = self._mod[slot.id] = _ModSeq(task_id)
            prompt = np.asarray(slot.prompt, dtype=np.int32)
            if len(prompt) >= n:
                table.add_all(prompt, 0, len(prompt) - n)
                seq.i_last = len(prompt) - n
                if table.used > 0.25 * table.entries.shape[0]:
                    table.reset()
        cur = len(history)
        if cur < n:
            return []
        if seq.i_last + 32 < cur:  # the generated tokens' n-grams, in chunks
            table.add_all(history, seq.i_last, cur - n)
            seq.i_last = cur - n
        draft = table.draft(history[cur - n + 1:].tolist() + [slot.next_token], cfg.mod_n_max)
        return draft if len(draft) >= cfg.mod_n_min else []

    def accepted(self, slot: Slot, n_drafted: int, n_accepted: int) -> None:
        """ngram-mod: five drafts in a row of which under a quarter was accepted empty the table
        (llama.cpp's rule), as its entries then mislead more than they help."""
        seq = self._mod.get(slot.id)
        if self.table is None or seq is None or n_drafted <= 0:
            return
        if n_accepted < 0.25 * n_drafted:
            seq.n_low += 1
            if seq.n_low >= 5:
                self.table.reset()
                seq.n_low = 0
                seq.i_last = 0
        else:
            seq.n_low = 0


def verify(slot: Slot, logits: np.ndarray, sampler: BatchSampler,
           emit: Callable[[Slot, int, float, np.ndarray, np.ndarray, Optional[np.ndarray]], bool],
           raw_probs: bool) -> int:
    """Samples a drafted slot's rows in turn (row j: the logits after its sampled token and the
    first j drafted ones), emitting each token, until one differs from the draft or the request
    ends. Accepted draft tokens join the slot's cached tokens (their K/V were computed by the
    step); the caller frees the cells of the rest. `emit` sends one token and says whether the
    request goes on. Returns the draft tokens accepted."""
    draft = slot.draft
    slot.draft = []
    slot.n_draft_total += len(draft)
    accepted = 0
    for j in range(len(draft) + 1):
        row = logits[j:j + 1]
        raw = row[0].copy() if raw_probs else None
        res = sampler.sample(row, [slot.sampler])
        token = int(res.ids[0])
        hit = j < len(draft) and token == draft[j]
        if hit:
            accepted += 1
            slot.n_draft_accepted += 1  # before emitting: the request's last event reports it
        if not emit(slot, token, float(res.probs[0]), res.top_ids[0], res.top_probs[0], raw) or not hit:
            break
        slot.cache_tokens.append(token)
    return accepted


class SpecControl:
    """Whether drafting pays, measured: a sequence whose drafts are mostly rejected stops drafting
    for a while, and a group compares the rate of its steps (tokens emitted per second, drafting
    time included) with and without drafts at each count of generating sequences, drafting only
    where drafted steps are faster. A step yields 1 to draft + 1 tokens, so each rate is a decayed
    sum of tokens over a decayed sum of seconds, judged once both modes have MIN_SAMPLES steps;
    then a step at that count goes the other way now and then, to keep both current: after
    PROBE_EVERY steps, twice as many after each probe that did not change the choice (up to
    PROBE_MAX)."""

    SEQ_JUDGE = 24         # drafted tokens before a sequence's acceptance is judged
    SEQ_LOW = 0.1          # accepted per drafted token under which it pauses
    SEQ_PAUSE = 16         # steps it then goes without drafts
    MIN_SAMPLES = 8
    EXPLORE_TOKENS = 512   # catching up allowed in a step while the rates at its count are unknown
    PROBE_EVERY = 32
    PROBE_MAX = 512
    DECAY = 0.95           # weight of the past in the running sums, per step

    def __init__(self) -> None:
        self._sums: dict[tuple[int, bool], list[float]] = {}  # (generating, drafted) -> [tokens, seconds, steps]
        self._steps: dict[int, int] = {}         # steps since the last probe, per count of generating
        self._interval: dict[int, int] = {}      # steps between probes
        self._last_choice: dict[int, bool] = {}  # the choice at the last probe

    def slot_wants(self, slot: Slot) -> bool:
        if slot.spec_pause > 0:
            slot.spec_pause -= 1
            return False
        return True

    def verified(self, slot: Slot, drafted: int, accepted: int) -> None:
        slot.spec_window_drafted += drafted
        slot.spec_window_accepted += accepted
        if slot.spec_window_drafted >= self.SEQ_JUDGE:
            if slot.spec_window_accepted < self.SEQ_LOW * slot.spec_window_drafted:
                slot.spec_pause = self.SEQ_PAUSE
            slot.spec_window_drafted = slot.spec_window_accepted = 0

    def affordable(self, slots: list[Slot], n_generating: int, drafter: "Drafter") -> list[Slot]:
        """The slots worth drafting for, given what the drafter must first catch up with for each
        (a draft model's cache behind the slot's tokens: a new prompt, steps it did not draft).
        Where the rates at this count are measured: those whose catching up costs less than the
        measured saving per token over the tokens they may still generate. Before that, at most
        EXPLORE_TOKENS of catching up in all, the slots furthest ahead first: the tail of a busy
        load (long histories, few tokens left) is never caught up just to be measured."""
        need = [(drafter.behind(slot), slot) for slot in slots]
        if not any(b for b, _ in need):
            return slots
        with_d, without = self.rate(n_generating, True), self.rate(n_generating, False)
        if with_d is None or without is None or not drafter.catch_up_s_per_token:
            out, total = [], 0
            for b, slot in sorted(need, key=lambda x: x[0]):
                if total + b > self.EXPLORE_TOKENS:
                    break
                total += b
                out.append(slot)
            return out
        saving = (1.0 / without - 1.0 / with_d) * n_generating  # seconds per token of a slot's
        out = []
        for b, slot in need:
            task = slot.task
            left = slot.draft_room() + 1 if task is None or task.n_predict < 0 else task.n_predict - slot.n_decoded
            if b * drafter.catch_up_s_per_token < left * saving:
                out.append(slot)
        return out

    def rate(self, n_generating: int, drafted: bool) -> Optional[float]:
        """Tokens per second of the steps in that mode, None before MIN_SAMPLES of them."""
        tokens, seconds, steps = self._sums.get((n_generating, drafted), (0.0, 0.0, 0))
        return tokens / seconds if steps >= self.MIN_SAMPLES and seconds > 0 else None

    def step_drafts(self, n_generating: int) -> bool:
        """Whether this step, with n_generating sequences, drafts."""
        with_d, without = self.rate(n_generating, True), self.rate(n_generating, False)
        if with_d is None:
            return True
        if without is None:
            return False
        better = with_d >= without
        k = self._steps.get(n_generating, 0) + 1
        self._steps[n_generating] = k
        interval = self._interval.get(n_generating, self.PROBE_EVERY)
        if k < interval:
            return better
        # a probe of the other mode; while probes confirm the choice they come half as often (a
        # draft model's probe costs it the catching up of all the steps it missed)
        self._steps[n_generating] = 0
        same = self._last_choice.get(n_generating, better) == better
        self._interval[n_generating] = min(interval * 2, self.PROBE_MAX) if same else self.PROBE_EVERY
        self._last_choice[n_generating] = better
        return not better

    def step_done(self, n_generating: int, drafted: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        sums = self._sums.setdefault((n_generating, drafted), [0.0, 0.0, 0])
        sums[0] = self.DECAY * sums[0] + tokens
        sums[1] = self.DECAY * sums[1] + seconds
        sums[2] += 1
