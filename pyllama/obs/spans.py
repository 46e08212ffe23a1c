"""Busy spans as interval arithmetic: the one busy/idle computation the live pipeline view
(server/pipeline_stats.py) and the trace tools (trace_tools/merge.py) share. numpy only."""
from __future__ import annotations

from typing import Any

import numpy as np

Intervals = tuple[np.ndarray, np.ndarray]  # sorted, disjoint (starts, ends), int64


def union(starts: Any, ends: Any) -> Intervals:
    """The spans merged into sorted disjoint intervals (touching ones joined, empty ones
    dropped): the time during which at least one of them was open."""
    s, e = np.asarray(starts, np.int64).ravel(), np.asarray(ends, np.int64).ravel()
    s, e = s[e > s], e[e > s]
    if len(s) == 0:
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    first = np.r_[True, s[1:] > reach[:-1]]
    last = np.r_[first[1:], True]
    return s[first], reach[last]


def covered(iv: Intervals, w0: int, w1: int) -> int:
    """Length of [w0, w1) that disjoint intervals cover."""
    s, e = iv
    return int(np.clip(np.minimum(e, w1) - np.maximum(s, w0), 0, None).sum())
