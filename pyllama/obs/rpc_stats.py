"""Command counts and bytes per command type, with the decode steps they served: always counted
(a lock and three additions per command), printed with PYLLAMA_RPC_STATS=1 every
PYLLAMA_RPC_STATS_MS milliseconds (default 5000) and at exit, with the average per decode step."""
from __future__ import annotations

import atexit
import sys
import threading
import time
from collections import defaultdict

from ..util.settings import current
from ..util.threads import Thread


def enabled() -> bool:
    return current().obs.rpc_stats


def period_s() -> float:
    """PYLLAMA_RPC_STATS_MS in seconds (at least 0.1)."""
    return max(current().obs.rpc_stats_s, 0.1)

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
    if _printer is not None or not enabled():
        return
    with _lock:
        if _printer is not None:
            return
        period = period_s()

        def run() -> None:
            while True:
                time.sleep(period)
                print(format_stats(*snapshot()), file=sys.stderr, flush=True)

        _printer = Thread(target=run, name="rpc-stats", daemon=True)
        _printer.start()
        atexit.register(_print_final)


def _print_final() -> None:
    if enabled():
        print(format_stats(*snapshot()), file=sys.stderr, flush=True)
