#!/usr/bin/env python3
"""Per-thread CPU time, run-queue wait and preemptions of running processes over an interval.

    python bench/thread_stats.py --pid SERVER_PID --pid RPC_PID -- python bench/bench_users.py ...
    python bench/thread_stats.py --pid SERVER_PID --seconds 10

Reads Linux's per-thread scheduler counters (/proc/PID/task/TID/schedstat: time on a CPU, time
runnable but waiting for one; /proc/PID/task/TID/status: voluntary and involuntary context
switches) before and after the command (or the interval) and prints, per thread that ran, its
name (pyllama names its threads: decode-0, tasks, rpc-exec-N (one per connection), kernel-pool, ...), CPU time,
run-queue wait, wait as a share of the time it wanted a CPU, and how often it was preempted
(involuntary switches) or blocked (voluntary). Where two processes of a split share cores, a
compute thread's run-queue wait and preemptions are the time-slicing that stretches its stage
(docs/pipeline-groups.md, "Thread priority"). A last line gives the whole machine's shares over
the same interval from /proc/stat: busy, idle (no thread of any process wanted a core: with two
processes of a split on these cores, the time their chain left them waiting) and stolen by the
hypervisor (time this machine's virtual CPUs did not get; compare runs only when it is low). Talks
to the programs through /proc only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence


@dataclass
class ThreadCounters:
    pid: int
    tid: int
    name: str
    run_ns: int        # time on a CPU
    wait_ns: int       # time runnable, waiting for a CPU
    voluntary: int     # context switches where the thread blocked
    involuntary: int   # context switches where it was preempted


@dataclass
class ThreadRow:
    pid: int
    tid: int
    name: str
    cpu_ms: float
    wait_ms: float
    wait_pct: float    # wait / (cpu + wait)
    involuntary: int
    voluntary: int


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:  # the thread ended between the listing and the read
        return None


def read_thread(pid: int, tid: int) -> Optional[ThreadCounters]:
    """One thread's counters, or None when it is gone."""
    base = f"/proc/{pid}/task/{tid}"
    sched, status, comm = _read(f"{base}/schedstat"), _read(f"{base}/status"), _read(f"{base}/comm")
    if sched is None or status is None or comm is None:
        return None
    run_ns, wait_ns = (int(x) for x in sched.split()[:2])
    switches = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            switches[key] = int(value)
    return ThreadCounters(pid, tid, comm.strip(), run_ns, wait_ns, switches.get("voluntary_ctxt_switches", 0),
                          switches.get("nonvoluntary_ctxt_switches", 0))


class ProcessGone(RuntimeError):
    """A watched process is not there (any more)."""


def snapshot(pids: Sequence[int]) -> dict[tuple[int, int], ThreadCounters]:
    """Every thread's counters of the given processes, keyed by (pid, tid)."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError as exc:
            raise ProcessGone(f"no process {pid}: {exc.strerror}") from None
        for tid in tids:
            c = read_thread(pid, int(tid))
            if c is not None:
                out[(pid, int(tid))] = c
    return out


def read_cpu_times(text: Optional[str] = None) -> list[int]:
    """The machine's CPU times from /proc/stat's `cpu` line (all CPUs, in clock ticks): user,
    nice, system, idle, iowait, irq, softirq, steal."""
    if text is None:
        text = _read("/proc/stat") or ""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            times = [int(v) for v in parts[1:9]]
            return times + [0] * (8 - len(times))  # older kernels have no steal column
    raise ProcessGone("no cpu line in /proc/stat")


def machine_shares(before: Sequence[int], after: Sequence[int]) -> Optional[dict[str, float]]:
    """Percent of all CPUs' time between two read_cpu_times: busy (user, nice, system, irq,
    softirq), idle (idle and iowait) and stolen (steal); None when no clock tick (10 ms on most
    kernels) passed in between."""
    d = [b - a for a, b in zip(before, after)]
    user, nice, system, idle, iowait, irq, softirq, steal = d[:8]
    total = sum(d[:8])
    if total <= 0:
        return None
    return {"busy": 100.0 * (user + nice + system + irq + softirq) / total,
            "idle": 100.0 * (idle + iowait) / total, "stolen": 100.0 * steal / total}


def format_machine(shares: Optional[dict[str, float]]) -> str:
    if shares is None:
        return "machine (/proc/stat, all CPUs): too short an interval to count"
    return (f"machine (/proc/stat, all CPUs): busy {shares['busy']:.1f}%, idle {shares['idle']:.1f}%, "
            f"stolen {shares['stolen']:.1f}%")


def difference(before: dict, after: dict, min_cpu_ms: float = 1.0) -> list[ThreadRow]:
    """Per-thread change between two snapshots (threads started in between count from zero),
    threads with less than `min_cpu_ms` of CPU time left out; processes in the snapshot's order,
    each one's busiest thread first."""
    rows = []
    for key, b in after.items():
        a = before.get(key) or ThreadCounters(b.pid, b.tid, b.name, 0, 0, 0, 0)
        cpu, wait = (b.run_ns - a.run_ns) / 1e6, (b.wait_ns - a.wait_ns) / 1e6
        if cpu < min_cpu_ms:
            continue
        rows.append(ThreadRow(b.pid, b.tid, b.name, cpu, wait, 100.0 * wait / (cpu + wait) if cpu + wait else 0.0,
                              b.involuntary - a.involuntary, b.voluntary - a.voluntary))
    order = {pid: i for i, pid in enumerate(dict.fromkeys(pid for pid, _ in after))}
    rows.sort(key=lambda r: (order[r.pid], -r.cpu_ms))
    return rows


def format_rows(rows: Sequence[ThreadRow], wall_s: float, labels: Optional[dict[int, str]] = None) -> str:
    """The table (one line per thread, a total per process), over `wall_s` seconds."""
    labels = labels or {}
    lines = [f"over {wall_s:.2f} s (CPU and wait in ms; wait % of the time the thread wanted a CPU)",
             f"{'process':<12} {'thread':<16} {'cpu':>8} {'cpu %':>6} {'wait':>8} {'wait %':>6} "
             f"{'preempted':>9} {'blocked':>8}"]
    for pid in dict.fromkeys(r.pid for r in rows):
        mine = [r for r in rows if r.pid == pid]
        proc = labels.get(pid, str(pid))
        for r in mine:
            lines.append(f"{proc:<12} {r.name:<16} {r.cpu_ms:8.0f} {r.cpu_ms / wall_s / 10:6.1f} {r.wait_ms:8.0f} "
                         f"{r.wait_pct:6.1f} {r.involuntary:9d} {r.voluntary:8d}")
        cpu, wait = sum(r.cpu_ms for r in mine), sum(r.wait_ms for r in mine)
        lines.append(f"{proc:<12} {'(all)':<16} {cpu:8.0f} {cpu / wall_s / 10:6.1f} {wait:8.0f} "
                     f"{100.0 * wait / (cpu + wait) if cpu + wait else 0.0:6.1f} "
                     f"{sum(r.involuntary for r in mine):9d} {sum(r.voluntary for r in mine):8d}")
    return "\n".join(lines)


def split_command(argv: Optional[Sequence[str]]) -> tuple[list[str], list[str]]:
    """(this tool's arguments, the command after `--`) of argv (default: sys.argv[1:])."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv, command = split_command(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Everything after -- is the command to measure across (e.g. a load generator).")
    ap.add_argument("--pid", type=int, action="append", required=True, help="a process to watch (repeat for several)")
    ap.add_argument("--label", action="append", default=[], help="a name for each --pid, in order (default: the pid)")
    ap.add_argument("--seconds", type=float, help="measure over this many seconds (without a command)")
    ap.add_argument("--min-cpu-ms", type=float, default=1.0, help="leave out threads with less CPU time (default 1)")
    ap.add_argument("--json", metavar="OUT", help="also write the rows and the interval as JSON")
    a = ap.parse_args(argv)
    if bool(command) == (a.seconds is not None):
        ap.error("give either --seconds or a command after --")
    if a.seconds is not None and a.seconds <= 0:
        ap.error("--seconds must be positive")
    if len(a.label) > len(a.pid):
        ap.error("more --label than --pid")
    if not sys.platform.startswith("linux"):
        ap.error("reads Linux's /proc")
    labels = dict(zip(a.pid, a.label))
    try:
        before = snapshot(a.pid)
        cpu0 = read_cpu_times()
        t0 = time.monotonic()
        rc = 0
        if command:
            rc = subprocess.run(command).returncode
        else:
            time.sleep(a.seconds)
        wall = time.monotonic() - t0
        rows = difference(before, snapshot(a.pid), a.min_cpu_ms)
        shares = machine_shares(cpu0, read_cpu_times())
    except ProcessGone as exc:
        print(f"thread_stats: {exc}", file=sys.stderr)
        return 1
    print(format_rows(rows, wall, labels))
    print(format_machine(shares))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"wall_s": wall, "labels": {str(k): v for k, v in labels.items()},
                       "threads": [asdict(r) for r in rows], "machine": shares, "command_rc": rc}, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
