"""PYLLAMA_RPC_STATS=1: command counts and bytes per command type, printed every
PYLLAMA_RPC_STATS_MS milliseconds (default 5000) and at exit, with the average per decode step."""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections import defaultdict

from ..util.env import env_number
from ..util.errors import PyllamaError
from ..util.threads import Thread

enabled = os.environ.get("PYLLAMA_RPC_STATS", "") not in ("", "0")


def period_s() -> float:
    """PYLLAMA_RPC_STATS_MS in seconds (at least 0.1); a value that is not a whole number of
    milliseconds is a PyllamaError naming the variable."""
    ms = env_number("PYLLAMA_RPC_STATS_MS", 5000, int, lambda v: v > 0, "a number of milliseconds", PyllamaError)
    return max(ms, 100) / 1000
_lock = threading.Lock()
_counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # name -> [count, bytes out, bytes in]
_steps = 0
_printer: threading.Thread | None = None


def record(name: str, bytes_out: int, bytes_in: int, count: int = 1) -> None:
    with _lock:
        c = _counts[name]
        c[0] += count
        c[1] += bytes_out
        c[2] += bytes_in
    _ensure_printer()


def on_step() -> None:
    """One decode step (micro-batches included) of any context."""
    global _steps
    with _lock:
        _steps += 1


def snapshot() -> tuple[dict[str, tuple[int, int, int]], int]:
    with _lock:
        return {k: tuple(v) for k, v in _counts.items()}, _steps  # type: ignore[misc]


def reset() -> None:
    global _steps
    with _lock:
        _counts.clear()
        _steps = 0


def format_stats(counts: dict[str, tuple[int, int, int]], steps: int) -> str:
    lines = [f"rpc stats: {steps} decode steps"]
    for name in sorted(counts):
        n, out, inn = counts[name]
        per = f", {n / steps:.2f}/step" if steps else ""
        lines.append(f"  {name:<16} {n:>8} cmds {out:>14} B out {inn:>14} B in{per}")
    total = sum(c[0] for c in counts.values())
    if steps:
        lines.append(f"  {'total':<16} {total:>8} cmds, {total / steps:.2f} per decode step")
    return "\n".join(lines)


def _ensure_printer() -> None:
    global _printer
    if _printer is not None:
        return
    with _lock:
        if _printer is not None:
            return
        period = period_s()

        def run() -> None:
            while True:
                time.sleep(period)
                if enabled:
                    print(format_stats(*snapshot()), file=sys.stderr, flush=True)

        _printer = Thread(target=run, name="rpc-stats", daemon=True)
        _printer.start()
        atexit.register(_print_final)


def _print_final() -> None:
    if enabled:
        print(format_stats(*snapshot()), file=sys.stderr, flush=True)
