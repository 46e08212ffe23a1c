"""PYLLAMA_PIPE_PROF=1: where each pipeline group's time goes, printed every 5 s per group
(PYLLAMA_PIPE_PROF_MS changes the period).

Per group: waiting for its lock, pre-decode (placing tasks, building the batch), decode submit,
synchronize, post-decode; per generated token: sampling, detokenizing, stop-string handling,
result send, and for constrained rows waiting for and applying their token masks. Each group
counts only its own work (its own object, touched only by its thread).
"""
from __future__ import annotations

import sys
import threading
import time

from ..util.settings import current
from ..util.threads import Thread


def enabled() -> bool:
    return current().obs.pipe_prof


def period_s() -> float:
    """PYLLAMA_PIPE_PROF_MS in seconds (at least 0.05)."""
    return max(current().obs.pipe_prof_s, 0.05)


PHASES = ("lock_wait", "pre_decode", "submit", "synchronize", "post_decode")
PER_TOKEN = ("sampling", "detokenize", "stop_strings", "result_send", "mask_wait", "mask_apply")


class GroupProfile:
    def __init__(self, group: int):
        self.group = group
        self._lock = threading.Lock()  # the printer reads while the decode thread adds
        self._reset()

    def _reset(self) -> None:
        self.t = dict.fromkeys(PHASES + PER_TOKEN, 0.0)
        self.steps = 0
        self.tokens = 0

    def add(self, steps: int = 0, tokens: int = 0, **seconds: float) -> None:
        with self._lock:
            self.steps += steps
            self.tokens += tokens
            for k, v in seconds.items():
                self.t[k] += v

    def take(self) -> str:
        with self._lock:
            t, steps, tokens = self.t, self.steps, self.tokens
            self._reset()
        ms = ", ".join(f"{k} {t[k] * 1e3 / max(steps, 1):.2f}" for k in PHASES)
        us = ", ".join(f"{k} {t[k] * 1e6 / max(tokens, 1):.1f}" for k in PER_TOKEN)
        return f"pipe prof group {self.group}: {steps} steps, {tokens} tokens; ms/step: {ms}; us/token: {us}"


_profiles: list[GroupProfile] = []
_started = False
_start_lock = threading.Lock()


def profile_for(group: int) -> GroupProfile:
    """The profile of a group; starts the printer on first use."""
    global _started
    prof = GroupProfile(group)
    with _start_lock:
        _profiles.append(prof)
        if not _started:
            period = period_s()
            _started = True
            Thread(target=_print_loop, args=(period,), name="pipe-prof", daemon=True).start()
    return prof


def _print_loop(period: float) -> None:
    while True:
        time.sleep(period)
        for prof in list(_profiles):
            print(prof.take(), file=sys.stderr, flush=True)
