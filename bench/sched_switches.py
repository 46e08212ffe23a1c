#!/usr/bin/env python3
"""Who takes the cores from the compute threads: the kernel's context switches over an interval.

    python bench/sched_switches.py --pid SERVER_PID --label server --pid RPC_PID --label rpc --seconds 5
    python bench/sched_switches.py --pid SERVER_PID -- python bench/bench_users.py ...

Records every context switch and wake-up on all CPUs (`perf record -e sched:sched_switch -e
sched:sched_wakeup -a`; Linux, perf and root, or a perf_event_paranoid that allows it) for the
interval or across the command, then prints:

- each thread's share of all the cores' time, and the cores' idle share;
- how often each compute thread (`--compute`, by default pyllama's `decode-N`, `rpc-exec-*` and
  `kernel-pool`) was preempted, and by which thread (the one that took its core, by name; a
  thread of a `--pid` process other than a compute thread as `<label>:<name>`, so that the
  servers' event loops, which keep the process's name, can be told apart);
- how long a compute thread waited for a core after it was preempted and after it woke up
  (median, 90th percentile, total).

`bench/thread_stats.py` counts the same preemptions per thread from /proc without perf; this says
who caused them and what they cost (docs/pipeline-groups.md, "Thread priority").
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from thread_stats import split_command  # noqa: E402

DEFAULT_COMPUTE = r"^(decode-\d+|rpc-exec-.*|kernel-pool)$"
_SWITCH = re.compile(r"\[(\d+)\]\s+([\d.]+): sched:sched_switch: prev_comm=(.*?) prev_pid=(\d+) prev_prio=-?\d+ "
                     r"prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)")
_WAKEUP = re.compile(r"\[(\d+)\]\s+([\d.]+): sched:sched_wakeup: comm=(.*?) pid=(\d+) prio=-?\d+ "
                     r"target_cpu=(\d+)")
IDLE = "(idle)"


class PerfError(RuntimeError):
    """perf is missing or could not record the scheduler's events; the message says why."""


@dataclass
class Report:
    span_s: float = 0.0
    n_cpus: int = 0
    cpu_s: dict = field(default_factory=dict)          # label -> seconds on a CPU (IDLE: idle time)
    preempted: dict = field(default_factory=dict)      # compute label -> {preempting label: count}
    waits: dict = field(default_factory=dict)          # compute label -> {"preempted"|"woken": [seconds]}


def parse(lines: Iterable[str], compute: str = DEFAULT_COMPUTE,
          labels: Optional[dict[int, str]] = None) -> Report:
    """A Report from `perf script` output of sched_switch and sched_wakeup events. `labels` maps a
    thread id to the label of its process (threads of unknown processes keep their name)."""
    comp = re.compile(compute)
    labels = labels or {}

    def label(comm: str, tid: int) -> str:
        if tid == 0:
            return IDLE
        proc = labels.get(tid)
        if proc is None:
            return comm
        return f"{proc}:{comm}" if not comp.match(comm) else comm

    switched_in: dict[str, float] = {}           # cpu -> when its current thread was switched in
    pending: dict[int, tuple[float, str]] = {}   # compute tid -> (runnable since, why)
    cpu_s: Counter = Counter()
    preempted: dict = defaultdict(Counter)
    waits: dict = defaultdict(lambda: defaultdict(list))
    cpus: set[str] = set()
    t_first = t_last = None
    for line in lines:
        m = _SWITCH.search(line)
        if m:
            cpu, t, pcomm, ppid, state, ncomm, npid = m.groups()
            t, ppid, npid = float(t), int(ppid), int(npid)
            cpus.add(cpu)
            t_first = t if t_first is None else t_first
            t_last = t
            prev, nxt = label(pcomm, ppid), label(ncomm, npid)
            if cpu in switched_in:
                # the thread leaving the core, by its name now: a thread names itself after it
                # first ran, and a switch-in may be missing from the record
                cpu_s[prev] += t - switched_in[cpu]
            switched_in[cpu] = t
            if state.startswith("R") and comp.match(pcomm) and ppid:
                preempted[prev][nxt] += 1
                pending[ppid] = (t, "preempted")
            if npid in pending:
                since, why = pending.pop(npid)
                waits[nxt][why].append(t - since)
            continue
        m = _WAKEUP.search(line)
        if m:
            _, t, comm, tid, _ = m.groups()
            if comp.match(comm):
                pending[int(tid)] = (float(t), "woken")
    span = (t_last - t_first) if t_first is not None else 0.0
    return Report(span_s=span, n_cpus=len(cpus), cpu_s=dict(cpu_s),
                  preempted={k: dict(v) for k, v in preempted.items()},
                  waits={k: {w: list(v) for w, v in d.items()} for k, d in waits.items()})


def format_report(r: Report, top: int = 12) -> str:
    total = r.span_s * max(r.n_cpus, 1)
    if total <= 0:
        return "no context switches recorded"
    lines = [f"over {r.span_s:.2f} s on {r.n_cpus} CPU(s); share of all the cores' time:"]
    for name, s in sorted(r.cpu_s.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {name:<28}{s:8.3f} s {100 * s / total:6.1f}%")
    n_all = sum(sum(by.values()) for by in r.preempted.values())
    lines.append(f"compute threads preempted {n_all} times")
    for comp_name, by in sorted(r.preempted.items()):
        n = sum(by.values())
        lines.append(f"  {comp_name} {n}: " + ", ".join(f"{who} {k}" for who, k in
                                                      sorted(by.items(), key=lambda kv: -kv[1])[:6]))
    lines.append("waits for a core (ms): after a preemption / after a wake-up, median p90 total")
    for comp_name, w in sorted(r.waits.items()):
        parts = []
        for why in ("preempted", "woken"):
            v = sorted(w.get(why, []))
            if v:
                parts.append(f"{why} n={len(v)} {1e3 * statistics.median(v):.3f} "
                             f"{1e3 * v[min(len(v) - 1, int(0.9 * len(v)))]:.3f} {1e3 * sum(v):.1f}")
        lines.append(f"  {comp_name:<16}" + "; ".join(parts))
    return "\n".join(lines)


def thread_labels(pids: Sequence[int], names: Sequence[str], gone_ok: bool = False) -> dict[int, str]:
    """Thread id -> the label of its process, for the threads each pid has now (a process that is
    not running is an error, or skipped with gone_ok)."""
    out: dict[int, str] = {}
    for i, pid in enumerate(pids):
        lab = names[i] if i < len(names) else str(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            if gone_ok:
                continue
            raise PerfError(f"process {pid} is not running") from None
        for tid in tids:
            out[int(tid)] = lab
    return out


def _perf() -> str:
    perf = shutil.which("perf")
    if perf is None:
        raise PerfError("perf is not installed (Debian: apt-get install linux-perf)")
    return perf


def perf_script(data: str) -> list[str]:
    """The events of a perf.data file as `perf script` prints them."""
    p = subprocess.run([_perf(), "script", "-i", data], capture_output=True, text=True)
    if p.returncode != 0:
        why = p.stderr.strip().splitlines()
        raise PerfError(f"perf script failed{': ' + why[-1] if why else ''}")
    return p.stdout.splitlines()


def record(out: str, seconds: Optional[float], command: Sequence[str]) -> int:
    """Runs perf record over `seconds` or `command`; returns the command's exit status."""
    perf = _perf()
    if not os.path.isdir("/sys/kernel/tracing/events") and os.geteuid() == 0:
        # the tracepoints live in tracefs, which a fresh machine may not have mounted
        subprocess.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"], capture_output=True)
    target = list(command) if command else ["sleep", str(seconds)]
    p = subprocess.run([perf, "record", "-q", "-e", "sched:sched_switch", "-e", "sched:sched_wakeup", "-a",
                        "-o", out, "--", *target], stderr=subprocess.PIPE, text=True)
    if not os.path.exists(out) or os.path.getsize(out) == 0:
        why = (p.stderr or "").strip().splitlines()
        raise PerfError("perf could not record the scheduler's events"
                        + (f": {why[-1]}" if why else " (root or kernel.perf_event_paranoid <= -1 needed)"))
    return p.returncode


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv, command = split_command(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Everything after -- is the command to record across.")
    ap.add_argument("--pid", type=int, action="append", default=[], help="a process whose threads to label")
    ap.add_argument("--label", action="append", default=[], help="a name for each --pid, in order")
    ap.add_argument("--seconds", type=float, help="record over this many seconds (without a command)")
    ap.add_argument("--compute", default=DEFAULT_COMPUTE, help=f"regex of compute thread names ({DEFAULT_COMPUTE})")
    ap.add_argument("--perf-script", metavar="FILE", help="analyse this `perf script` output instead of recording")
    ap.add_argument("--json", metavar="OUT", help="also write the report as JSON")
    a = ap.parse_args(argv)
    if a.perf_script is None and bool(command) == (a.seconds is not None):
        ap.error("give either --seconds or a command after -- (or --perf-script FILE)")
    if a.seconds is not None and a.seconds <= 0:
        ap.error("--seconds must be positive")
    if len(a.label) > len(a.pid):
        ap.error("more --label than --pid")
    try:
        re.compile(a.compute)
    except re.error as exc:
        ap.error(f"--compute: {exc}")
    rc = 0
    try:
        labels = thread_labels(a.pid, a.label)
        if a.perf_script is not None:
            with open(a.perf_script, encoding="utf-8", errors="replace") as f:
                report = parse(f, a.compute, labels)
        else:
            with tempfile.TemporaryDirectory() as d:
                data = os.path.join(d, "perf.data")
                rc = record(data, a.seconds, command)
                # threads started while recording (a process that ended meanwhile keeps its labels)
                labels.update(thread_labels(a.pid, a.label, gone_ok=True))
                report = parse(perf_script(data), a.compute, labels)
    except (PerfError, OSError) as exc:
        print(f"sched_switches: {exc}", file=sys.stderr)
        return 1
    print(format_report(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"span_s": report.span_s, "n_cpus": report.n_cpus, "cpu_s": report.cpu_s,
                       "preempted": report.preempted,
                       "waits": report.waits, "command_rc": rc}, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
