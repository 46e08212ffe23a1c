"""bench/sched_switches.py: who preempts the compute threads, from the kernel's context switches."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

import sched_switches as ss  # noqa: E402


def switch(cpu: int, t: float, prev: tuple[str, int], state: str, nxt: tuple[str, int]) -> str:
    """A `perf script` line of sched_switch, as perf prints it."""
    return (f"{prev[0]:>16} {prev[1]:>6} [{cpu:03d}] {t:12.6f}: sched:sched_switch: prev_comm={prev[0]} "
            f"prev_pid={prev[1]} prev_prio=120 prev_state={state} ==> next_comm={nxt[0]} next_pid={nxt[1]} "
            f"next_prio=120")


def wakeup(cpu: int, t: float, who: tuple[str, int], target: int) -> str:
    return (f"{'python':>16} {10:>6} [{cpu:03d}] {t:12.6f}: sched:sched_wakeup: comm={who[0]} pid={who[1]} "
            f"prio=120 target_cpu={target:03d}")


IDLE, DEC, EXE = ("swapper/0", 0), ("decode-0", 11), ("rpc-exec-CPU", 21)
SRV_LOOP, RPC_LOOP = ("python", 10), ("python", 20)  # the two processes' main threads (event loops)
LABELS = {10: "server", 11: "server", 20: "rpc", 21: "rpc"}
LINES = [
    switch(0, 1.000, IDLE, "R", DEC),
    switch(1, 1.000, ("swapper/1", 0), "R", EXE),
    switch(0, 1.010, DEC, "R", RPC_LOOP),        # the rpc server's loop takes decode-0's core
    switch(0, 1.0102, RPC_LOOP, "S", DEC),       # ... for 0.2 ms
    switch(1, 1.020, EXE, "S", ("swapper/1", 0)),
    wakeup(0, 1.025, EXE, 1),
    switch(1, 1.0251, ("swapper/1", 0), "R", EXE),  # woken, ran 0.1 ms later
    switch(0, 1.030, DEC, "R+", SRV_LOOP),       # the server's own loop: 1 ms
    switch(0, 1.031, SRV_LOOP, "S", DEC),
    "    some other line perf printed",
    switch(0, 1.040, DEC, "S", IDLE),
    switch(1, 1.040, EXE, "S", ("swapper/1", 0)),
]


def test_parse_counts_who_took_the_core_and_the_waits() -> None:
    r = ss.parse(LINES, labels=LABELS)
    assert r.n_cpus == 2 and r.span_s == pytest.approx(0.040)
    want = {"decode-0": 0.0388, "rpc-exec-CPU": 0.0349, "rpc:python": 0.0002, "server:python": 0.001,
            ss.IDLE: 0.0051}
    assert set(r.cpu_s) == set(want)
    for k, v in want.items():
        assert r.cpu_s[k] == pytest.approx(v, abs=1e-9), k
    assert r.preempted == {"decode-0": {"rpc:python": 1, "server:python": 1}}
    assert [round(x, 6) for x in r.waits["decode-0"]["preempted"]] == [0.0002, 0.001]
    assert [round(x, 6) for x in r.waits["rpc-exec-CPU"]["woken"]] == [0.0001]
    text = ss.format_report(r)
    assert "compute threads preempted 2 times" in text
    assert "decode-0 2: rpc:python 1, server:python 1" in text
    assert "preempted n=2 0.600 1.000 1.2" in text  # median, p90, total in ms


def test_time_goes_to_the_thread_that_leaves_the_core() -> None:
    """A new thread first runs under its parent's name and names itself once running (pyllama's
    threads do): the interval belongs to the thread that the switch-out names. Taken from the
    switch-in, two threads that each ran to their end under their own names were counted as
    `python` (the two-thread recording test failed on that)."""
    lines = [
        switch(0, 2.000, IDLE, "R", ("python", 12)),          # switched in before it named itself
        switch(0, 2.200, ("decode-1", 12), "X", IDLE),        # ran 0.2 s, named decode-1 by now
        switch(1, 2.000, ("swapper/1", 0), "R", ("python", 13)),
        switch(1, 2.250, ("decode-0", 13), "X", ("swapper/1", 0)),
    ]
    r = ss.parse(lines)
    assert r.cpu_s["decode-1"] == pytest.approx(0.2) and r.cpu_s["decode-0"] == pytest.approx(0.25)
    assert "python" not in r.cpu_s


def test_without_labels_threads_keep_their_names() -> None:
    r = ss.parse(LINES)
    assert r.preempted == {"decode-0": {"python": 2}}


def test_compute_pattern_chooses_the_threads() -> None:
    r = ss.parse(LINES, compute=r"^rpc-exec", labels=LABELS)
    assert r.preempted == {} and set(r.waits) == {"rpc-exec-CPU"}


def test_nothing_recorded() -> None:
    assert ss.format_report(ss.parse([])) == "no context switches recorded"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "sched_switches.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_on_a_perf_script_file(tmp_path: Path) -> None:
    f = tmp_path / "s.txt"
    f.write_text("\n".join(LINES) + "\n")
    out = tmp_path / "r.json"
    p = _cli("--perf-script", str(f), "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "decode-0 2: python 2" in p.stdout
    assert json.loads(out.read_text())["preempted"] == {"decode-0": {"python": 2}}


@pytest.mark.parametrize("args, err", [
    ([], "give either --seconds or a command"),
    (["--seconds", "0"], "--seconds must be positive"),
    (["--seconds", "1", "--label", "x"], "more --label than --pid"),
    (["--seconds", "1", "--compute", "("], "--compute"),
])
def test_cli_bad_arguments(args: list[str], err: str) -> None:
    p = _cli(*args)
    assert p.returncode == 2 and err in p.stderr


def test_cli_gone_process_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "s.txt"
    f.write_text("\n".join(LINES))
    p = _cli("--perf-script", str(f), "--pid", "999999999")
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == ["sched_switches: process 999999999 is not running"]


def _perf_records() -> bool:
    if shutil.which("perf") is None:
        return False
    p = _cli("--seconds", "0.2")
    return p.returncode == 0 and "share of all the cores' time" in p.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's perf")
def test_records_named_threads_across_a_command() -> None:
    """Two named busy threads of a child process show up by name (perf's real output parsed). They
    hash (which lets go of the GIL), so both compute at once."""
    if not _perf_records():
        pytest.skip("perf cannot record scheduler events here (needs perf and root or perf_event_paranoid)")
    child = ("import sys; sys.path.insert(0, %r)\n"
             "import hashlib\n"
             "from pyllama.util.threads import Thread\n"
             "data = bytes(64 << 20)\n"
             "def spin():\n"
             "    for _ in range(6): hashlib.sha256(data).digest()\n"
             "ts = [Thread(target=spin, name=f'decode-{k}') for k in range(2)]\n"
             "[t.start() for t in ts]; [t.join() for t in ts]\n") % str(ROOT)
    p = _cli("--", sys.executable, "-c", child)
    assert p.returncode == 0, p.stderr
    shares = {ln.split()[0]: float(ln.split()[1]) for ln in p.stdout.splitlines()
              if ln.startswith("  ") and ln.split()[0].startswith("decode-") and ln.split()[2] == "s"}
    assert set(shares) == {"decode-0", "decode-1"} and sum(shares.values()) > 0.05, p.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's perf")
def test_a_watched_process_that_ends_while_recording_keeps_the_report() -> None:
    if not _perf_records():
        pytest.skip("perf cannot record scheduler events here (needs perf and root or perf_event_paranoid)")
    # an orphan (its parent exits at once), so that init reaps it and its /proc entry goes
    pid = int(subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True,
                             text=True, check=True).stdout)
    try:
        p = _cli("--pid", str(pid), "--label", "sleeper", "--", "sh", "-c", f"kill {pid}; sleep 0.3")
    finally:
        subprocess.run(["kill", str(pid)], capture_output=True)
    assert p.returncode == 0, p.stderr
    assert "share of all the cores' time" in p.stdout
