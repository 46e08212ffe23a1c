"""The split checked against the load it serves (pyllama.server.split_check, balance.advise_split)."""
from __future__ import annotations

import importlib.util
import logging
import math
import os
import threading
import time

import pytest

from pyllama.runtime.placement.balance import advise_split, output_blocks
from pyllama.models.model import Model
from pyllama.server.pipeline_stats import StepLog
from pyllama.server.split_check import CHECK_ENV, SplitCheck, check_interval, describe_advice
from pyllama.util.errors import PyllamaError
from server_util import ServerProcess


# --- the advice ---------------------------------------------------------------------------------
def test_balanced_load_keeps_the_split():
    # busy shares of a served 7,5 split whose stages came out even over the whole mix
    a = advise_split(["RPC0", "CPU"], [0.77, 0.74], [7, 5], 4.5)
    assert a.counts == [7, 5] and a.busiest_now == a.busiest_then == pytest.approx(0.77)


def test_an_overloaded_first_stage_gives_blocks_to_the_last():
    # 9 blocks at 95% (10.6% each), the last device 3 blocks + 4.5 of output at 60% (8% a unit)
    a = advise_split(["RPC0", "CPU"], [0.95, 0.60], [9, 3], 4.5)
    assert a.counts == [7, 5]
    per_first, per_last = 0.95 / 9, 0.60 / 7.5
    assert a.busiest_then == pytest.approx(max(7 * per_first, 9.5 * per_last))
    assert a.busiest_then < 0.95 * a.busiest_now


def test_an_overloaded_last_stage_gives_blocks_to_the_first():
    a = advise_split(["RPC0", "CPU"], [0.73, 0.96], [7, 5], 4.5)
    assert a.counts == [8, 4]


def test_the_advice_stays_within_what_each_device_can_hold():
    # the first stage wants 2 more blocks (9,3 -> 7,5) but the last device has room for one more
    a = advise_split(["RPC0", "CPU"], [0.95, 0.60], [9, 3], 4.5, caps=[None, 4])
    assert a.counts == [8, 4]
    assert advise_split(["RPC0", "CPU"], [0.95, 0.60], [9, 3], 4.5, caps=[None, 3]).counts == [9, 3]


def test_a_small_gain_is_not_advised():
    # moving a block (0.084 from B, 0.076 onto A) makes the slowest stage 0.5% lighter: noise
    busy = [0.76, 0.84]
    a = advise_split(["A", "B"], busy, [10, 14], 0.0, gain=0.95)
    assert a.counts == [10, 14]
    moved = advise_split(["A", "B"], busy, [10, 14], 0.0, gain=1.0)
    assert moved.counts == [11, 13] and moved.busiest_then == pytest.approx(0.836)


def test_three_devices_and_one_block_each_at_least():
    a = advise_split(["RPC0", "RPC1", "CPU"], [0.9, 0.1, 0.5], [4, 4, 4], 0.0)
    assert sum(a.counts) == 12 and min(a.counts) >= 1
    assert a.counts[0] < 4 and a.counts[1] > 4
    assert a.busiest_then < a.busiest_now


@pytest.mark.parametrize("busy,counts", [([0.5, 0.5], [0, 5]),          # a first stage with nothing on it
                                         ([math.nan, 0.5], [6, 6]),
                                         ([0.5, -0.1], [6, 6]),
                                         ([0.5], [6, 6])])
def test_figures_that_say_nothing_give_no_advice(busy, counts):
    assert advise_split(["A", "B"], busy, counts, 1.0) is None


def test_output_blocks_is_the_output_bytes_over_a_mean_block(model_factory):
    for tied in (True, False):
        m = Model(model_factory("tiny256", wtype="q4_k_m", tied=tied))
        t = m.file.tensors
        out = t["token_embd.weight" if m.tied_output else "output.weight"].raw.nbytes
        block = sum(v.raw.nbytes for k, v in t.items() if k.startswith("blk.")) / m.hparams.n_layer
        assert m.tied_output == tied
        assert output_blocks(m) == pytest.approx(out / block)


def test_the_log_line_says_what_to_pass():
    names, counts = ["RPC0", "CPU"], [9, 3]
    a = advise_split(names, [0.95, 0.60], counts, 4.5)
    line = describe_advice(names, counts, [0.95, 0.60], 60.0, a)
    assert line.startswith("split check over the last 60 s: RPC0 9 blocks busy 95%, CPU 3 blocks + output busy 60%: ")
    assert "-ts 7,5 would even the stages out" in line and "next start" in line
    kept = advise_split(names, [0.77, 0.74], [7, 5], 4.5)
    assert describe_advice(names, [7, 5], [0.77, 0.74], 60.0, kept).endswith(": balanced")


def test_the_bench_reads_the_last_check_line_back():
    spec = importlib.util.spec_from_file_location(
        "split_advice", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                                     "split_advice.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    names = ["RPC0", "CPU"]
    moved = describe_advice(names, [9, 3], [0.95, 0.60], 60.0, advise_split(names, [0.95, 0.60], [9, 3], 4.5))
    kept = describe_advice(names, [7, 5], [0.77, 0.74], 60.0, advise_split(names, [0.77, 0.74], [7, 5], 4.5))
    log = f"x INFO pyllama.server: {moved}\ny INFO pyllama.server: {kept}\n"
    assert bench.parse_check(log) == {"line": kept, "busy": {"RPC0": 77, "CPU": 74}, "advice": "balanced",
                                      "outcomes": ["7,5", "balanced"]}
    assert bench.parse_check(f"INFO: {moved}\n")["advice"] == "7,5"
    applied = describe_advice(names, [9, 3], [0.95, 0.60], 60.0, advise_split(names, [0.95, 0.60], [9, 3], 4.5),
                              moved_s=0.1234)
    assert bench.parse_check(f"INFO: {applied}\nINFO: {kept}\n")["outcomes"] == ["moved to 7,5 in 123 ms", "balanced"]
    assert bench.parse_check("nothing logged\n") is None


# --- the check over time ------------------------------------------------------------------------
class FakeStats:
    """Snapshots of busy totals: each call returns the next (t seconds, [busy seconds per device])
    and first logs its (rows computed, rows sampled) as one step of `log`."""

    def __init__(self, points, names=("RPC0", "CPU")):
        self.points, self.names, self.log = list(points), names, StepLog()

    def __call__(self) -> dict:
        t, totals, rows = self.points.pop(0)
        if rows[0]:
            self.log.add(0, 1, rows[0], rows[1])
        return {"t_us": int(t * 1e6), "devices": [{"name": n, "busy_total_s": b} for n, b in zip(self.names, totals)]}


def run_checks(check: SplitCheck, n: int, caplog) -> list[list[str]]:
    """The messages each of n checks logged."""
    lines = []
    with caplog.at_level(logging.INFO, logger="pyllama.server"):
        for _ in range(n):
            assert check.check()
            lines.append([r.getMessage() for r in caplog.records])
            caplog.clear()
    return lines


def test_check_logs_after_a_loaded_interval_and_when_the_advice_changes(caplog):
    gen = (100, 100)  # every computed row sampled: the output layer weighs its whole 4.5 blocks
    stats = FakeStats([(10, [0, 0], gen),
                       (20, [7.7, 7.4], gen),      # loaded and even: "balanced"
                       (30, [15.4, 14.8], gen),    # the same again: nothing new to say
                       (40, [15.5, 14.9], gen),    # idle: not a measurement
                       (50, [25.0, 20.9], gen)])   # the first stage at 95%, the last at 60%: advice
    check = SplitCheck(stats, [stats.log], ["RPC0", "CPU"], [9, 3], 4.5, 10.0)
    lines = run_checks(check, 5, caplog)
    assert lines[0] == [] and lines[2] == [] and lines[3] == []
    assert len(lines[1]) == 1 and lines[1][0].endswith("CPU 3 blocks + output busy 74%: balanced")
    assert len(lines[4]) == 1 and "RPC0 9 blocks busy 95%" in lines[4][0] and "-ts 7,5" in lines[4][0]


def test_the_servers_own_split_is_moved_once_and_never_back(caplog):
    """With a move (the split was the server's choice) the advice is applied: the counts follow,
    the next interval starts afresh, and advice back to a split already served is only logged."""
    gen = (100, 100)
    stats = FakeStats([(10, [0, 0], gen),
                       (20, [9.5, 6.0], gen),      # 9,3: the first stage at 95%, the last at 60%: move
                       (30, [9.5, 6.0], gen),      # the first interval of the new split: a baseline only
                       (40, [17.2, 13.4], gen),    # even at 7,5: balanced
                       (50, [23.2, 23.0], gen)])   # the last stage now the busier: 9,3 again, served before
    moves = []
    check = SplitCheck(stats, [stats.log], ["RPC0", "CPU"], [9, 3], 4.5, 10.0, caps=lambda c: [None, None],
                       move=moves.append)
    lines = run_checks(check, 5, caplog)
    assert moves == [[7, 5]] and check.counts == [7, 5]
    assert len(lines[1]) == 1 and "RPC0 9 blocks busy 95%" in lines[1][0]
    assert "moved to -ts 7,5 (slowest stage modelled 95% -> " in lines[1][0] and lines[1][0].endswith(" ms")
    assert lines[2] == [] and len(lines[3]) == 1 and lines[3][0].endswith("balanced")
    assert len(lines[4]) == 1 and "-ts 9,3 would even the stages out" in lines[4][0]
    assert lines[4][0].endswith("it was served before, so the split stays")


def test_a_move_that_fails_leaves_the_split_and_is_not_tried_again(caplog):
    gen = (100, 100)
    stats = FakeStats([(10, [0, 0], gen), (20, [9.5, 6.0], gen), (30, [19.0, 12.0], gen), (40, [19.1, 12.1], gen),
                       (50, [28.6, 18.0], gen)])

    def refuse(counts):
        raise MemoryError("allocating 9437184 B on RPC0 exceeds the server's memory cap")

    check = SplitCheck(stats, [stats.log], ["RPC0", "CPU"], [9, 3], 4.5, 10.0, move=refuse)
    with caplog.at_level(logging.INFO, logger="pyllama.server"):
        assert check.check() and check.check()
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "moving to -ts 7,5 failed, the split stays: allocating" in warned[0].getMessage()
        assert check.counts == [9, 3]
        caplog.clear()
        check.check(), check.check(), check.check()  # idle, then the same advice: not tried again
    assert "failed" not in caplog.text and check.counts == [9, 3]


def test_a_given_split_is_advised_not_moved(caplog):
    stats = FakeStats([(10, [0, 0], (100, 100)), (20, [9.5, 6.0], (100, 100))])
    check = SplitCheck(stats, [stats.log], ["RPC0", "CPU"], [9, 3], 4.5, 10.0)
    with caplog.at_level(logging.INFO, logger="pyllama.server"):
        check.check(), check.check()
    assert "-ts 7,5 would even the stages out" in caplog.text and "it applies at the next start" in caplog.text


def test_prompt_rows_lighten_the_output_layer(caplog):
    """The same busy shares with half the computed rows sampled (prompts as long as the replies):
    the output layer weighs half as much, so the last device's blocks are dearer and it keeps
    fewer of them than when every row is sampled."""
    names, counts, busy = ["RPC0", "CPU"], [8, 4], [8.3, 5.7]
    advised = {}
    for sampled in (100, 50):
        stats = FakeStats([(10, [0, 0], (100, sampled)), (20, busy, (100, sampled))])
        check = SplitCheck(stats, [stats.log], names, counts, 5.34, 10.0)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pyllama.server"):
            check.check()
            check.check()
        advised[sampled] = check._advised
    assert advised[50] == advise_split(names, [0.83, 0.57], counts, 5.34 * 0.5).counts == [7, 5]
    assert advised[100] == advise_split(names, [0.83, 0.57], counts, 5.34).counts == [6, 6]


def test_an_interval_without_steps_is_not_a_measurement(caplog):
    stats = FakeStats([(10, [0, 0], (10, 10)), (20, [8.0, 8.0], (0, 0))])
    check = SplitCheck(stats, [stats.log], ["RPC0", "CPU"], [6, 6], 1.0, 10.0)
    with caplog.at_level(logging.INFO, logger="pyllama.server"):
        assert check.check() and check.check()
    assert "split check" not in caplog.text


def test_check_stops_when_a_device_does_not_report(caplog):
    stats = FakeStats([(10, [None, 1.0], (0, 0))])
    check = SplitCheck(stats, [stats.log], ["RPC0", "CPU"], [6, 6], 1.0, 10.0)
    with caplog.at_level(logging.INFO, logger="pyllama.server"):
        assert not check.check()
    assert "split check off: no busy time from RPC0" in caplog.text


def test_check_thread_runs_and_stops():
    calls = threading.Event()

    def snapshot() -> dict:
        calls.set()
        return {"t_us": time.monotonic_ns() // 1000, "devices": [{"name": "A", "busy_total_s": 0.0},
                                                                  {"name": "B", "busy_total_s": 0.0}]}
    check = SplitCheck(snapshot, [], ["A", "B"], [1, 1], 0.0, 0.05)
    check.start()
    assert calls.wait(5)
    check.stop()
    assert not check._thread.is_alive()


@pytest.mark.parametrize("raw,value", [("", 60.0), ("0", 0.0), ("2.5", 2.5)])
def test_check_interval_from_the_environment(env_settings, raw, value):
    env_settings(**{CHECK_ENV: raw})
    assert check_interval() == value


@pytest.mark.parametrize("raw", ["soon", "-1", "nan"])
def test_a_bad_interval_is_one_clear_error(env_settings, raw, tiny_model):
    with pytest.raises(PyllamaError, match=CHECK_ENV):
        env_settings(**{CHECK_ENV: raw})
    if raw == "soon":  # the server refuses it before loading anything
        srv = ServerProcess(tiny_model, env={CHECK_ENV: raw})
        assert srv.proc.wait(60) == 1
        srv._collect()
        assert f"error: {CHECK_ENV}='soon': expected a number of seconds" in srv.stderr_text


# --- a served split ------------------------------------------------------------------------------
def test_a_split_under_load_logs_its_check(model_factory, rpc_peer):
    model = model_factory("small")
    srv = ServerProcess(model, "--rpc", rpc_peer.endpoint, "--device", "RPC0,CPU", "-ts", "4,2",
                        "--pipeline-groups", "2", "-np", "4", "-c", "2048",
                        env={CHECK_ENV: "1"}).wait_ready()
    try:
        deadline = time.monotonic() + 60
        body = {"prompt": "Once upon a time", "n_predict": 48, "ignore_eos": True, "temperature": 0}

        def load() -> None:
            while time.monotonic() < deadline and "split check over" not in srv.log_tail(200):
                status, _ = srv.post("/completion", body)
                assert status == 200
        workers = [threading.Thread(target=load) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        assert srv.stop() == 0
    lines = [ln for ln in srv.stderr_text.splitlines() if "split check over the last" in ln]
    assert lines, srv.stderr_text[-2000:]
    assert "RPC0 4 blocks busy " in lines[0] and "CPU 2 blocks + output busy " in lines[0]
