"""bench/thread_stats.py: per-thread CPU time, run-queue wait and switches of running processes."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from pyllama.util.threads import Thread

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "bench", "thread_stats.py")
_spec = importlib.util.spec_from_file_location("thread_stats", SCRIPT)
thread_stats = importlib.util.module_from_spec(_spec)
sys.modules["thread_stats"] = thread_stats  # its dataclasses look their module up while it loads
_spec.loader.exec_module(thread_stats)
C = thread_stats.ThreadCounters

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")


def test_difference_per_thread_and_new_threads_from_zero():
    before = {(1, 10): C(1, 10, "decode-0", 1_000_000, 500_000, 3, 1)}
    after = {(1, 10): C(1, 10, "decode-0", 31_000_000, 10_500_000, 13, 6),
             (1, 11): C(1, 11, "tasks", 4_000_000, 4_000_000, 2, 0),        # started in between
             (1, 12): C(1, 12, "reconnect", 500_000, 0, 1, 0),              # under 1 ms: left out
             (2, 20): C(2, 20, "rpc-exec-CPU", 50_000_000, 0, 7, 0)}
    rows = thread_stats.difference(before, after)
    assert [(r.pid, r.name) for r in rows] == [(1, "decode-0"), (1, "tasks"), (2, "rpc-exec-CPU")]
    d = rows[0]
    assert (d.cpu_ms, d.wait_ms, d.voluntary, d.involuntary) == (30.0, 10.0, 10, 5)
    assert d.wait_pct == pytest.approx(25.0)
    assert rows[1].wait_pct == pytest.approx(50.0) and rows[2].wait_pct == 0.0
    text = thread_stats.format_rows(rows, 0.1, {1: "server"})
    lines = text.splitlines()
    assert lines[0].startswith("over 0.10 s")
    assert lines[2].split() == ["server", "decode-0", "30", "30.0", "10", "25.0", "5", "10"]
    assert lines[4].split() == ["server", "(all)", "34", "34.0", "14", "29.2", "5", "12"]
    assert lines[5].split()[:2] == ["2", "rpc-exec-CPU"]


def test_a_busy_named_thread_of_this_process_is_counted():
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    t = Thread(target=spin, name="spinner", daemon=True)
    t.start()
    try:
        before = thread_stats.snapshot([os.getpid()])
        time.sleep(0.2)
        rows = thread_stats.difference(before, thread_stats.snapshot([os.getpid()]))
    finally:
        stop.set()
        t.join(5)
    spinner = [r for r in rows if r.tid == t.native_id]
    assert len(spinner) == 1 and spinner[0].name == "spinner"
    assert spinner[0].cpu_ms > 20


def test_machine_shares_from_proc_stat():
    before = thread_stats.read_cpu_times("cpu  100 0 50 800 0 0 10 40 0 0\ncpu0 50 0 25 400 0 0 5 20 0 0\n")
    after = thread_stats.read_cpu_times("cpu  400 20 130 1100 100 10 40 140 0 0\n")
    shares = thread_stats.machine_shares(before, after)
    # 300 user + 20 nice + 80 system + 10 irq + 30 softirq busy, 300 + 100 idle, 100 stolen, of 940
    assert shares["busy"] == pytest.approx(100 * 440 / 940)
    assert shares["idle"] == pytest.approx(100 * 400 / 940)
    assert shares["stolen"] == pytest.approx(100 * 100 / 940)
    assert thread_stats.format_machine(shares) == "machine (/proc/stat, all CPUs): busy 46.8%, idle 42.6%, stolen 10.6%"
    # no clock tick in between (a window shorter than 10 ms): nothing to say, not zeros
    assert thread_stats.machine_shares(before, before) is None
    assert thread_stats.format_machine(None).endswith("too short an interval to count")
    # a kernel without the steal column: nothing stolen
    old = thread_stats.read_cpu_times("cpu  1 2 3 4 5 6 7\n")
    assert old == [1, 2, 3, 4, 5, 6, 7, 0]
    with pytest.raises(thread_stats.ProcessGone, match="no cpu line"):
        thread_stats.read_cpu_times("intr 1 2 3\n")


def test_command_line_measures_across_a_command(tmp_path):
    out = tmp_path / "ts.json"
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"])
    try:
        run = subprocess.run([sys.executable, SCRIPT, "--pid", str(busy.pid), "--label", "spinner", "--json", str(out),
                              "--", sys.executable, "-c", "import time; time.sleep(0.3)"],
                             capture_output=True, text=True, timeout=60)
    finally:
        busy.kill()
        busy.wait()
    assert run.returncode == 0, run.stderr
    assert "spinner " in run.stdout and "(all)" in run.stdout
    data = json.loads(out.read_text())
    assert data["wall_s"] >= 0.3 and data["command_rc"] == 0
    assert data["threads"][0]["pid"] == busy.pid and data["threads"][0]["cpu_ms"] > 100
    assert "machine (/proc/stat, all CPUs): busy " in run.stdout
    # the spinner kept a core busy throughout
    assert sum(data["machine"].values()) == pytest.approx(100, abs=0.5) and data["machine"]["busy"] > 100 / os.cpu_count() / 2


def test_command_rc_passes_through_and_bad_arguments_are_one_error():
    run = subprocess.run([sys.executable, SCRIPT, "--pid", str(os.getpid()), "--", sys.executable, "-c",
                          "raise SystemExit(3)"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 3 and "over " in run.stdout
    both = subprocess.run([sys.executable, SCRIPT, "--pid", str(os.getpid()), "--seconds", "1", "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "either --seconds or a command" in both.stderr
    gone = subprocess.run([sys.executable, SCRIPT, "--pid", "999999999", "--seconds", "0.1"],
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode != 0 and "no process 999999999" in gone.stderr
    assert gone.stderr.count("\n") == 1
