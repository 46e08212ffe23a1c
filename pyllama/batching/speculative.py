"""Speculative decoding: a generating sequence proposes the tokens it expects next (a draft), its
next step computes them after its sampled token, and each row's logits are sampled in turn: the
tokens that match the draft are kept, so one step can yield several tokens.

A `Drafter` proposes the drafts: a draft model (draft_model.py), the sequence's own history as
llama-server's n-gram drafts read it (ngram_drafts.py), or both, the n-grams asked first
(`ChainDrafter`). `SpecControl` decides where drafting pays. Verification samples each row with
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

# llama-server's n-gram types, in the order it asks them for a draft (the first with one wins)
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
SPEC_TYPES = ("none",) + NGRAM_TYPES


@dataclass(frozen=True)
class NgramMapSizes:
    """--spec-ngram-map-k[4v]-size-n / -size-m / -min-hits (and ngram-simple's, which has no
    use for min_hits)."""
    n: int = 12
    m: int = 48
    min_hits: int = 1


@dataclass(frozen=True)
class SpecConfig:
    """The server's n-gram draft settings (llama-server's --spec-* flags and defaults)."""
    kinds: tuple[str, ...] = ()  # the n-gram types used, in NGRAM_TYPES' order
    ngram_n: int = 12           # --spec-ngram-simple-size-n: the n-gram looked up in the history
    ngram_m: int = 48           # --spec-ngram-simple-size-m: at most this many tokens that followed it
    map_k: NgramMapSizes = NgramMapSizes()
    map_k4v: NgramMapSizes = NgramMapSizes()
    mod_n_match: int = 24       # --spec-ngram-mod-n-match: the n-gram hashed
    mod_n_min: int = 48         # --spec-ngram-mod-n-min: a shorter ngram-mod draft is dropped
    mod_n_max: int = 64         # --spec-ngram-mod-n-max
    lookup_static: str = ""     # -lcs: a static lookup cache for ngram-cache
    lookup_dynamic: str = ""    # -lcd: a dynamic lookup cache for ngram-cache
    n_max: int = -1             # --spec-draft-n-max: a cap on any draft (-1: none)
    n_min: int = 0              # --spec-draft-n-min: a shorter draft is not verified

    @property
    def enabled(self) -> bool:
        return bool(self.kinds)

    @property
    def kind(self) -> str:
        """The types as llama-server lists them ("none" without any)."""
        return ",".join(self.kinds) or "none"

    def validate(self) -> None:
        for kind in self.kinds:
            if kind not in NGRAM_TYPES:
                raise ValueError(f"speculative type {kind!r}: one of {', '.join(SPEC_TYPES)}")
        sizes = (self.ngram_n, self.ngram_m, self.mod_n_match, self.mod_n_max, self.map_k.n, self.map_k.m,
                 self.map_k4v.n, self.map_k4v.m)
        if min(sizes) < 1:
            raise ValueError("n-gram sizes must be at least 1")
        if min(self.map_k.min_hits, self.map_k4v.min_hits) < 1:
            raise ValueError("ngram min hits must be at least 1")
        if self.n_min < 0 or self.mod_n_min < 0:
            raise ValueError("a minimum draft must be >= 0")


class Drafter:
    """What proposes drafts: before a step is planned, `draft` sets the generating slots' drafts
    (the scheduler then trims them to the step's room); after it, `accepted` learns how much of
    a slot's draft was kept."""

    def draft(self, slots: list[Slot], afford: Optional[Callable[[list[Slot]], list[Slot]]] = None) -> None:
        """Sets the drafts of `slots`; a drafter that must first catch up with a slot's tokens drafts
        only for those `afford` keeps (SpecControl.affordable)."""
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


class ChainDrafter(Drafter):
    """n-gram drafts first, then a draft model for the slots none of them drafted for (llama-server's
    order of types: the draft model last)."""

    def __init__(self, ngrams: Drafter, model: Drafter):
        self.ngrams, self.model = ngrams, model
        self._by_model: set[int] = set()  # slots the model drafted for this step

    @property
    def catch_up_s_per_token(self) -> float:  # type: ignore[override]
        return self.model.catch_up_s_per_token

    def draft(self, slots: list[Slot], afford: Optional[Callable[[list[Slot]], list[Slot]]] = None) -> None:
        self.ngrams.draft(slots)
        rest = [slot for slot in slots if not slot.draft]
        self.model.draft(rest, afford)
        self._by_model = {slot.id for slot in rest if slot.draft}

    def accepted(self, slot: Slot, n_drafted: int, n_accepted: int) -> None:
        (self.model if slot.id in self._by_model else self.ngrams).accepted(slot, n_drafted, n_accepted)

    def behind(self, slot: Slot) -> int:
        return self.model.behind(slot)

    def close(self) -> None:
        self.ngrams.close()
        self.model.close()


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
