"""When a device computed: the record behind the live pipeline view (pyllama.server.pipeline_stats)
and behind the rpc server's DEVICE_BUSY reply.

A backend holds one `BusyClock` and brackets each graph computation with `begin`/`end`. Several
threads may compute on one device at once (pipeline groups): the clock keeps the union of their
spans, so a device is busy while at least one of them runs, never "200 % busy". Times are
microseconds of this host's monotonic clock (the trace's time base, `pyllama.obs.trace.now`), so the
spans line up with a trace of the same run.

Cost: two clock reads and two short lock holds per graph, a few hundred nanoseconds against the
milliseconds a graph takes. Memory is bounded: the last MAX_SPANS spans (enough for many seconds
of steps); the running total is kept exactly since start.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Optional

from .trace import now as now_us  # the trace's time base: spans line up with a trace of the run

MAX_SPANS = 16384


class BusyClock:
    """The busy spans of one device (merged across threads) and their running total."""

    __slots__ = ("_lock", "_active", "_since", "_total_us", "_spans")

    def __init__(self, max_spans: int = MAX_SPANS) -> None:
        self._lock = threading.Lock()
        self._active = 0          # computations running now
        self._since = 0           # when the device last went from idle to busy (valid while _active)
        self._total_us = 0        # busy time of the finished spans
        self._spans: deque[tuple[int, int]] = deque(maxlen=max_spans)

    def begin(self) -> int:
        """A computation starts; returns its start time (pass it to `end`)."""
        t = now_us()
        with self._lock:
            if self._active == 0:
                self._since = t
            self._active += 1
        return t

    def end(self, t0: int = 0) -> None:
        """A computation ended (whether it succeeded or raised)."""
        t = now_us()
        with self._lock:
            if self._active <= 0:  # an end without a begin: ignore rather than corrupt the total
                return
            self._active -= 1
            if self._active == 0:
                start = self._since
                self._total_us += t - start
                spans = self._spans
                if spans and spans[-1][1] >= start:  # touching the previous span: one span
                    s0, _ = spans.pop()
                    spans.append((s0, t))
                else:
                    spans.append((start, t))

    def total_us(self, at: Optional[int] = None) -> int:
        """Busy microseconds since the clock was made, a running computation included up to `at`."""
        at = now_us() if at is None else at
        with self._lock:
            return self._total_us + (max(0, at - self._since) if self._active else 0)

    def spans(self, since_us: int = 0, at: Optional[int] = None, limit: int = MAX_SPANS) -> list[tuple[int, int]]:
        """The busy spans that end after `since_us`, oldest first, at most `limit` (the newest); a
        computation still running counts as a span ending at `at` (default: now)."""
        at = now_us() if at is None else at
        out: list[tuple[int, int]] = []
        with self._lock:
            if self._active and limit > 0:
                out.append((self._since, max(at, self._since)))
            for span in reversed(self._spans):  # spans end in time order: the newest last
                if span[1] <= since_us or len(out) >= limit:
                    break
                out.append(span)
        out.reverse()
        return out
