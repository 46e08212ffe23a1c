"""The layer split checked against the load it serves.

The split is chosen at load (`-ts`, free memory, or the probe of `pyllama.runtime.placement.balance`), before any
request: neither free memory nor a probe of decode steps sees the mix of prompts and generations
the server then gets, nor the host work that shares the local device's cores. Once the server has
served under load, the devices' own busy clocks say how the stages actually compare: every
CHECK_ENV seconds (default 60, 0: off) with pipeline groups over a split, the busy time of each
device over that interval goes through `balance.advise_split`, the output layer counted on the
last device as its weight bytes in blocks' worth times the share of the interval's computed rows
that were sampled (prompt tokens pass every block but reach the output layer once per prompt),
and one INFO line says whether the split is balanced or which `-ts` would even the stages out, e.g.

    split check over the last 60 s: RPC0 7 blocks busy 77%, CPU 5 blocks + output busy 74%: balanced

A line is logged after the first loaded interval and then whenever the advice changes. When the
server chose the split itself (no `-ts`, no `-ngl`), it applies the advice: every group stops
between steps, the blocks that change device move there with their weights and every group's KV
cache (`Engine.move_layers`; the sequences under way go on where they were), and the groups go
on. The line then says so, with the time the move took:

    split check over the last 60 s: RPC0 6 blocks busy 62%, CPU 6 blocks + output busy 91%: moved to -ts 7,5 (slowest stage modelled 91% -> 78%) in 140 ms

A split already served is not moved back to (two splits within the noise of each other would
otherwise take turns), nor is one whose move failed (a device without the room: the split stays,
said at WARNING). A split given with `-ts` is the user's and stays; the line then says which `-ts`
would even the stages out at the next start. An interval counts as loaded when the devices
computed for at least LOADED of it in all (idle stretches would only add noise). A device that
does not report its busy time (an rpc server without DEVICE_BUSY) turns the check off, said once
at INFO.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Sequence

from ..runtime.placement.balance import SplitAdvice, advise_split
from ..util.settings import current
from .pipeline_stats import StepLog
from ..util.threads import Thread

log = logging.getLogger("pyllama.server")

CHECK_ENV = "PYLLAMA_SPLIT_CHECK_S"
DEFAULT_CHECK_S = 60.0
LOADED = 0.5


def check_interval() -> float:
    """Seconds between checks from CHECK_ENV (0: off)."""
    return current().split.check_s


def describe_advice(names: Sequence[str], counts: Sequence[int], busy: Sequence[float], interval_s: float,
                    advice: SplitAdvice, moved_s: Optional[float] = None, served_before: bool = False) -> str:
    """The log line for one check (see the module docstring): the advice, or with `moved_s` the
    move made (in that many seconds)."""
    last = len(names) - 1
    parts = [f"{name} {n} blocks{' + output' if i == last else ''} busy {b:.0%}"
             for i, (name, n, b) in enumerate(zip(names, counts, busy))]
    head = f"split check over the last {interval_s:.0f} s: {', '.join(parts)}: "
    if list(advice.counts) == list(counts):
        return head + "balanced"
    ts = ",".join(str(n) for n in advice.counts)
    modelled = f"slowest stage modelled {advice.busiest_now:.0%} -> {advice.busiest_then:.0%}"
    if moved_s is not None:
        return head + f"moved to -ts {ts} ({modelled}) in {moved_s * 1e3:.0f} ms"
    if served_before:
        return head + f"-ts {ts} would even the stages out ({modelled}); it was served before, so the split stays"
    return head + f"-ts {ts} would even the stages out ({modelled}); it applies at the next start"


class SplitCheck:
    """Every `interval_s`, the devices' busy totals from `snapshot()` (a PipelineStats snapshot:
    `t_us` and per device `busy_total_s`, None when not measured) and the groups' rows computed
    and sampled (their step logs) compared with the last check's. `out_blocks`: the output
    layer's cost per sampled row in blocks' worth per row (`balance.output_blocks`). `caps(counts)`:
    the most blocks each device could hold with `counts` in place (None: no limit). `move(counts)`,
    when the split may change: moves the blocks there (raises, leaving the split, when it cannot)."""

    def __init__(self, snapshot: Callable[[], dict], logs: Sequence[StepLog], names: Sequence[str],
                 counts: Sequence[int], out_blocks: float, interval_s: float,
                 caps: Optional[Callable[[Sequence[int]], Sequence[Optional[int]]]] = None,
                 move: Optional[Callable[[list[int]], None]] = None) -> None:
        self.snapshot, self.logs = snapshot, list(logs)
        self.names, self.counts, self.out_blocks = list(names), list(counts), out_blocks
        self._caps = caps
        self.caps = None if caps is None else list(caps(self.counts))
        self.move = move
        self.served: set[tuple[int, ...]] = {tuple(self.counts)}  # splits served (or failed to move to)
        self.interval_s = interval_s
        # (t_us, busy totals, rows computed, rows sampled) at the last check
        self._last: Optional[tuple[int, list[float], int, int]] = None
        self._advised: Optional[list[int]] = None
        self._stop = threading.Event()
        self._thread = Thread(target=self._run, name="split-check", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if not self.check():
                    return
            except Exception as exc:  # noqa: BLE001 - a check that fails must not take the server down
                log.debug("split check: %s", exc)

    def check(self) -> bool:
        """One check; logs when there is something to say. False when the check cannot go on."""
        snap = self.snapshot()
        devices = {d["name"]: d for d in snap["devices"]}
        totals = [devices[n]["busy_total_s"] if n in devices else None for n in self.names]
        if any(t is None for t in totals):
            missing = [n for n, t in zip(self.names, totals) if t is None]
            log.info("split check off: no busy time from %s", ", ".join(missing))
            return False
        t_us = int(snap["t_us"])
        rows, sampled = sum(lg.rows_total for lg in self.logs), sum(lg.tokens_total for lg in self.logs)
        last, self._last = self._last, (t_us, totals, rows, sampled)
        if last is None or t_us <= last[0] or rows <= last[2]:
            return True
        span_s = (t_us - last[0]) / 1e6
        busy = [max(0.0, (t - t0) / span_s) for t, t0 in zip(totals, last[1])]
        if sum(busy) < LOADED:
            return True
        # the output layer computes only the rows that are sampled, the blocks every row: its
        # weight in the last device's work is its cost per row times the share of rows it sees
        share = min(1.0, (sampled - last[3]) / (rows - last[2]))
        advice = advise_split(self.names, busy, self.counts, self.out_blocks * share, caps=self.caps)
        if advice is None or advice.counts == self._advised:
            return True
        self._advised = list(advice.counts)
        target = list(advice.counts)
        served = tuple(target) in self.served
        if self.move is None or target == self.counts or served:
            log.info("%s", describe_advice(self.names, self.counts, busy, span_s, advice,
                                           served_before=self.move is not None and served))
            return True
        self.served.add(tuple(target))
        t0 = time.perf_counter()
        try:
            self.move(target)
        except Exception as exc:  # noqa: BLE001 - the split stays as it was
            log.warning("split check: moving to -ts %s failed, the split stays: %s",
                        ",".join(str(n) for n in target), exc)
            return True
        log.info("%s", describe_advice(self.names, self.counts, busy, span_s, advice, time.perf_counter() - t0))
        self.counts = target
        self.caps = None if self._caps is None else list(self._caps(target))
        self._last = None  # the next interval starts with the new split, and its outcome is logged
        self._advised = None
        return True
