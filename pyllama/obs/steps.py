"""Every decode step of a pipeline group, kept for the live pipeline view (/pipeline/stats)."""
from __future__ import annotations

from collections import deque

MAX_STEPS = 8192        # steps kept per group (at 1000 steps/s, 8 s of them)


class StepLog:
    """The decode steps of one pipeline group: (start_us, end_us, n_tokens, n_sampled) each, the
    newest last. Appended by the group's thread only (a deque append is atomic), read by anyone."""

    __slots__ = ("steps", "n_total", "tokens_total", "rows_total")

    def __init__(self) -> None:
        self.steps: deque[tuple[int, int, int, int]] = deque(maxlen=MAX_STEPS)
        self.n_total = 0         # steps since start
        self.tokens_total = 0    # tokens sampled since start
        self.rows_total = 0      # tokens computed since start (prompt tokens and decode rows)

    def add(self, t0_us: int, t1_us: int, n_tokens: int, n_sampled: int) -> None:
        self.steps.append((t0_us, t1_us, n_tokens, n_sampled))
        self.n_total += 1
        self.tokens_total += n_sampled
        self.rows_total += n_tokens

    def since(self, t_us: int) -> list[tuple[int, int, int, int]]:
        """The steps that ended after t_us, oldest first."""
        out = []
        # copied in one C call first: iterating the deque itself while the group's thread appends
        # would raise "deque mutated during iteration"
        for s in reversed(tuple(self.steps)):
            if s[1] <= t_us:
                break
            out.append(s)
        out.reverse()
        return out
