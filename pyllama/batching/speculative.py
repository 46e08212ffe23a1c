"""Speculative decoding: a generating sequence proposes the tokens it expects next (a draft), its
next step computes them after its sampled token, and each row's logits are sampled in turn: the
tokens that match the draft are kept, so one step can yield several tokens.

The draft comes from the sequence's own history (llama-server's `ngram-simple`: the tokens that
followed the last earlier occurrence of its last n tokens). Verification samples each row with
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

SPEC_TYPES = ("none", "ngram-simple")


@dataclass(frozen=True)
class SpecConfig:
    """The server's speculative decoding settings (llama-server's --spec-* flags)."""
    kind: str = "none"          # "none" or "ngram-simple"
    ngram_n: int = 12           # --spec-ngram-simple-size-n: the n-gram looked up in the history
    ngram_m: int = 48           # --spec-ngram-simple-size-m: at most this many tokens that followed it
    n_max: int = -1             # --spec-draft-n-max for n-gram drafts: a cap below ngram_m (-1: none)
    n_min: int = 0              # --spec-draft-n-min: a shorter draft is not verified

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def validate(self) -> None:
        if self.kind not in SPEC_TYPES:
            raise ValueError(f"speculative type {self.kind!r}: one of {', '.join(SPEC_TYPES)}")
        if self.ngram_n < 1 or self.ngram_m < 1:
            raise ValueError(f"n-gram sizes must be at least 1 (n = {self.ngram_n}, m = {self.ngram_m})")
        if self.n_min < 0:
            raise ValueError(f"the minimum draft must be >= 0, got {self.n_min}")


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


class Drafter:
    """Proposes each generating sequence's draft before a step is planned (the scheduler then
    trims it to the step's room)."""

    def __init__(self, config: SpecConfig):
        config.validate()
        self.config = config

    def propose(self, slot: Slot) -> list[int]:
        task = slot.task
        if task is None or slot.constraint is not None or slot.thinking is not None or not task.spec_n_max:
            return []  # a grammar or a thinking budget decides tokens the draft cannot know
        cfg = self.config
        limit = slot.draft_room()
        if task.spec_n_max > 0:
            limit = min(limit, task.spec_n_max)
        if cfg.n_max >= 0:
            limit = min(limit, cfg.n_max)
        if limit <= 0 or limit < max(task.spec_n_min, cfg.n_min, 1):
            return []
        draft = ngram_simple_draft(np.asarray(slot.cache_tokens, dtype=np.int32), slot.next_token,
                                   cfg.ngram_n, cfg.ngram_m)[:limit]
        return draft if len(draft) >= max(task.spec_n_min, cfg.n_min, 1) else []


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
