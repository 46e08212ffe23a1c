"""bench/pipeline_cells.py's other arms: pyllama unsplit, llama.cpp's split and unsplit servers,
weight types, traced busy shares, a 3-stage split over two rpc servers; the pure parts, and tiny
end-to-end runs (llama.cpp's cells only where $PYLLAMA_PEERS names a folder with its programs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "pipeline_cells.py")

import pipeline_cells as pc  # noqa: E402
from server_util import pid_alive  # noqa: E402


def test_arms_and_schedule_interleave_every_arm_per_leg():
    arms = pc.make_arms(["RPC0,CPU"], [1, 2], [1, 2], llama=True)
    assert [pc.arm_label(pc.arm_key(a)) for a in arms] == [
        "pyllama split RPC0,CPU 1 group", "pyllama split RPC0,CPU 2 groups", "pyllama -t 1", "pyllama -t 2",
        "llama.cpp split", "llama.cpp -t 1", "llama.cpp -t 2"]
    runs = pc.full_schedule(["f32", "q4_k_m"], arms, [32], legs=3)
    assert len(runs) == 2 * 3 * len(arms)
    assert [r["leg"] for r in runs[:2 * len(arms)]] == [1] * len(arms) + [2] * len(arms)
    assert {r["type"] for r in runs[:3 * len(arms)]} == {"f32"}
    assert pc.make_arms(["RPC0,CPU"], [1], [], llama=False) == [{"kind": "split", "order": "RPC0,CPU", "groups": 1}]


def test_unsplit_groups_arm_and_its_ratios():
    arms = pc.make_arms(["RPC0,CPU"], [1, 2], [1, 2], llama=False, unsplit_groups=[1, 2], split_threads=1)
    assert [pc.arm_label(pc.arm_key(a)) for a in arms] == [
        "pyllama split RPC0,CPU 1 group", "pyllama split RPC0,CPU 2 groups", "pyllama -t 1", "pyllama -t 2",
        "pyllama -t 1 2 groups"]
    assert pc.unsplit_args(32, 64, 64, 1, groups=2) == ["-np", "32", "-c", str(32 * 144), "-t", "1",
                                                        "--cache-ram", "0", "--pipeline-groups", "2"]
    assert pc.unsplit_args(31, 64, 64, 1, groups=2)[:2] == ["-np", "32"]
    recs = []
    for leg, (t1, t2, u2, g2) in enumerate([(400, 660, 830, 600), (410, 670, 840, 610)], 1):
        recs += [_rec("q4_k_m", "unsplit", leg, t1, threads=1), _rec("q4_k_m", "unsplit", leg, t2, threads=2),
                 _rec("q4_k_m", "unsplit", leg, u2, threads=1, groups=2),
                 _rec("q4_k_m", "split", leg, g2, order="RPC0,CPU", groups=2)]
    rows = {r["name"]: r for r in pc.target_ratios(recs, ["q4_k_m"], [32], ["RPC0,CPU"], [2], [1, 2], 1, [2])}
    assert rows["pyllama -t 1 2 groups / -t 1"]["ratio"] == pytest.approx(1670 / 810)
    assert rows["pyllama -t 1 2 groups / -t 2"]["ratio"] == pytest.approx(1670 / 1330)
    assert rows["pyllama -t 2 / -t 1"]["ratio"] == pytest.approx(1330 / 810)  # the 2-group arm stays apart
    assert rows["RPC0,CPU: 2 group(s) / pyllama unsplit -t 1 2 groups"]["ratio"] == pytest.approx(1210 / 1670)


def test_parse_types_and_threads():
    assert pc.parse_types("f32, Q4_K_M") == ["f32", "q4_k_m"]
    for bad in ("", "f32,f32", "q3_x"):
        with pytest.raises(ValueError):
            pc.parse_types(bad)
    assert pc.parse_thread_list("none", "unsplit-threads") == []
    assert pc.parse_thread_list("1,2", "unsplit-threads") == [1, 2]


def test_unsplit_and_llama_arguments():
    # every prompt of the load is its own: no prompt cache in either server
    assert pc.unsplit_args(32, 64, 64, 2) == ["-np", "32", "-c", str(32 * 144), "-t", "2", "--cache-ram", "0"]
    assert pc.llama_args(32, 64, 64, 1) == ["-np", "32", "-c", str(32 * 144), "-t", "1", "-tb", "1",
                                            "--cache-ram", "0"]
    assert pc.llama_args(4, 8, 4, 1, "127.0.0.1:5", 7)[-4:] == ["--rpc", "127.0.0.1:5", "-ngl", "7"]


def test_llama_split_has_the_blocks_of_pyllamas_split_per_process():
    # medium: 12 blocks; -ts 1,1 -> the last device holds 6 blocks and the output layer
    assert pc.split_blocks(12, "even", "RPC0,CPU") == 6
    assert pc.split_blocks(12, "7,5", "RPC0,CPU") == 5
    assert pc.split_blocks(12, "auto", "RPC0,CPU") is None
    # llama.cpp's -ngl counts the output layer first: 5 blocks + output -> -ngl 6
    assert pc.llama_ngl(5) == 6
    log = "... model m loaded: 32 slots ...; layers: RPC0 0-6, CPU 7-11 + output\n"
    assert pc.blocks_from_log(log) == 5
    assert pc.blocks_from_log("layers: CPU 0-3, RPC0 4-11 + output") == 8
    assert pc.blocks_from_log("no such line") is None


SUMMARY = """window 5123.4 ms: 812 steps, 2 group(s), 2 device(s); times in ms
device              busy     idle other busy none busy  idle%  transfer
CPU               4611.0    512.4      400.1     112.3  10.0%     120.0
RPC0/CPU          3739.5   1383.9     1300.0      83.9  27.0%     310.2
  RPC0 = 127.0.0.1:50052
no device busy 80.0 ms (1.6%); longest stretch 3.1 ms at +200.0 ms
"""


def test_parse_busy_reads_merge_summary():
    assert pc.parse_busy(SUMMARY) == {"CPU": 90.0, "RPC0/CPU": 73.0}
    assert pc.parse_busy("no steps and no device spans: nothing to summarise") == {}


def _rec(t, kind, leg, tok, **kw):
    return {"type": t, "kind": kind, "users": 32, "leg": leg, "gen_tok_s": tok, "tpot_ms": 1.0,
            "ttft_ms_median": 1.0, "ttft_ms_p99": 1.0, "errors": 0, "short": 0, "exit_status": 0,
            "bench": {"requests_done": 32, "requests": 32}, **kw}


def test_ratios_pair_the_legs():
    recs = []
    for leg, (t1, t2, g1, g2, ll) in enumerate([(250, 380, 260, 370, 200), (252, 390, 258, 372, 210),
                                                 (248, 370, 262, 368, 190)], 1):
        recs += [_rec("f32", "unsplit", leg, t1, threads=1), _rec("f32", "unsplit", leg, t2, threads=2),
                 _rec("f32", "split", leg, g1, order="RPC0,CPU", groups=1, busy_pct={"CPU": 50.0}),
                 _rec("f32", "split", leg, g2, order="RPC0,CPU", groups=2, busy_pct={"CPU": 90.0 + leg}),
                 _rec("f32", "llama-split", leg, ll)]
    rows = {r["name"]: r for r in pc.target_ratios(recs, ["f32"], [32], ["RPC0,CPU"], [1, 2], [1, 2], 1)}
    r = rows["pyllama -t 2 / -t 1"]
    assert r["ratio"] == pytest.approx((380 + 390 + 370) / (250 + 252 + 248))
    assert (r["min"], r["max"]) == (pytest.approx(370 / 248), pytest.approx(390 / 252)) and r["legs"] == 3
    assert rows["RPC0,CPU: 2 groups / 1 group"]["ratio"] == pytest.approx(1110 / 780)
    assert rows["RPC0,CPU: 2 group(s) / pyllama unsplit -t 2"]["ratio"] == pytest.approx(1110 / 1140)
    assert rows["RPC0,CPU: pyllama split 2 group(s) / llama.cpp split"]["ratio"] == pytest.approx(1110 / 600)
    assert "llama.cpp -t 2 / -t 1" not in rows  # not measured: no ratio
    cells = {c["arm"]: c for c in pc.all_cells(recs)}
    assert cells["pyllama split RPC0,CPU 2 groups"]["busy_pct"] == {"CPU": 92.0}
    assert cells["llama.cpp split"]["tok_s_mean"] == pytest.approx(200) and cells["llama.cpp split"]["legs"] == 3
    text = pc.format_ratios(pc.target_ratios(recs, ["f32"], [32], ["RPC0,CPU"], [1, 2], [1, 2], 1))
    assert "f32 32 users: pyllama -t 2 / -t 1: 1.52x [1.49..1.55]" in text


def test_thread_summary_and_the_preemption_column():
    C = pc.thread_stats.ThreadCounters
    before = {(1, 10): C(1, 10, "decode-0", 0, 0, 0, 0), (1, 11): C(1, 11, "python", 0, 0, 0, 0),
              (2, 20): C(2, 20, "rpc-exec-CPU", 0, 0, 0, 0)}
    after = {(1, 10): C(1, 10, "decode-0", 900_000_000, 100_000_000, 50, 40),
             (1, 11): C(1, 11, "python", 50_000_000, 50_000_000, 99, 400),     # not a compute thread
             (1, 12): C(1, 12, "kernel-pool", 100_000_000, 0, 5, 10),          # started in the window
             (2, 20): C(2, 20, "rpc-exec-CPU", 800_000_000, 200_000_000, 20, 30)}
    th = pc.thread_summary(before, after, {1: "server", 2: "rpc"}, 2.0)
    assert th["window_s"] == 2.0
    assert th["server"] == {"cpu_s": 1.05, "wait_s": 0.15, "compute_wait_pct": 9.1, "compute_preempted": 50}
    assert th["rpc"] == {"cpu_s": 0.8, "wait_s": 0.2, "compute_wait_pct": 20.0, "compute_preempted": 30}
    assert pc.preempt_rate(th) == 40.0 and pc.preempt_rate(None) is None
    recs = [_rec("f32", "split", leg, 300, order="RPC0,CPU", groups=2,
                 thread_stats={**th, "window_s": 2.0 * leg},
                 machine_pct={"busy": 80.0 - leg, "idle": 19.0 + leg, "stolen": 1.0}) for leg in (1, 2)]
    recs.append(_rec("f32", "unsplit", 1, 400, threads=1))  # no counters: a dash
    cells = pc.all_cells(recs)
    assert cells[0]["preempted_per_s"] == 30.0 and cells[1]["preempted_per_s"] is None
    assert (cells[0]["idle_pct"], cells[0]["stolen_pct"]) == (20.5, 1.0) and cells[1]["idle_pct"] is None
    lines = pc.format_cells(cells).splitlines()
    assert "preempted/s" in lines[0] and "idle %" in lines[0]
    assert lines[2].split("|")[8].strip() == "30" and lines[3].split("|")[8].strip() == "-"
    assert [v.strip() for v in lines[2].split("|")[9:11]] == ["20.5", "1.0"]
    assert [v.strip() for v in lines[3].split("|")[9:11]] == ["-", "-"]


def test_tiny_end_to_end_with_the_new_arms(tiny_model, tmp_path):
    out = tmp_path / "cells.json"
    args = ["--model", tiny_model, "--groups", "1", "--users", "2", "--legs", "1", "--orders", "RPC0,CPU",
            "--npp", "8", "--ntg", "4", "-r", "1", "--unsplit-threads", "1,2", "--trace", str(tmp_path / "traces"),
            "--json", str(out)]
    peers = os.environ.get("PYLLAMA_PEERS")
    llama = bool(peers) and os.path.isfile(os.path.join(peers, "bin", "llama-server"))
    env = dict(os.environ)
    if not llama:
        env.pop("PYLLAMA_PEERS", None)
    r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       stdin=subprocess.DEVNULL, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    kinds = [lg["kind"] for lg in doc["legs"]]
    assert kinds == ["split", "unsplit", "unsplit"] + (["llama-split", "llama-unsplit", "llama-unsplit"] if llama else [])
    split, t1, t2 = doc["legs"][:3]
    assert "--rpc" not in t1["server_args"] and t1["server_args"][-4:] == ["-t", "1", "--cache-ram", "0"] and t2["gen_tok_s"] > 0
    assert split["last_blocks"] == 1  # the tiny model: 2 blocks, -ts 1,1
    assert set(split["busy_pct"]) == {"CPU", "RPC0/CPU"} and all(0 < v <= 100 for v in split["busy_pct"].values())
    # the threads of pyllama's processes over the measured window: both ends of the split computed
    st = split["thread_stats"]
    assert set(st) == {"window_s", "server", "rpc"} and set(t1["thread_stats"]) == {"window_s", "server"}
    assert st["window_s"] > 0 and st["server"]["cpu_s"] > 0 and st["rpc"]["cpu_s"] > 0
    assert all(isinstance(v["compute_preempted"], int) for k, v in st.items() if k != "window_s")
    assert "preempted/s" in r.stdout
    # every leg, llama.cpp's too, gets the machine's shares over its window, unless the window
    # was shorter than a clock tick (these tiny legs can be)
    shares = [lg["machine_pct"] for lg in doc["legs"] if lg.get("machine_pct") is not None]
    for m in shares:
        assert set(m) == {"busy", "idle", "stolen"} and sum(m.values()) == pytest.approx(100, abs=0.5)
    assert ("cores idle" in r.stderr) == bool(shares)
    assert "pyllama -t 2 / -t 1:" in r.stdout and "RPC0,CPU: 1 group(s) / pyllama unsplit -t 2" in r.stdout
    if llama:
        assert doc["legs"][3]["server_args"][-2:] == ["-ngl", "2"]
        assert "llama.cpp cells count completed requests only" in r.stdout


def test_three_stage_orders_name_their_rpc_servers():
    assert pc.parse_orders("RPC0,RPC1,CPU; rpc1,rpc0,cpu;RPC0,CPU") == ["RPC0,RPC1,CPU", "RPC1,RPC0,CPU", "RPC0,CPU"]
    for bad in ("RPC1,CPU", "RPC0,RPC2,CPU", "RPC0,GPU", "RPC0,RPC0,CPU"):
        with pytest.raises(ValueError):
            pc.parse_orders(bad)
    assert pc.rpc_indices("RPC1,RPC0,CPU") == [1, 0] and pc.rpc_indices("CPU") == []
    assert pc.rpc_count(["RPC0,CPU", "RPC0,RPC1,CPU"]) == 2 and pc.rpc_count(["RPC0,CPU"]) == 1
    assert pc.rpc_count(["CPU"]) == 0 and pc.rpc_count([]) == 0
    eps = ["127.0.0.1:1", "127.0.0.1:2"]
    assert pc.rpc_arg(eps, "RPC0,CPU") == "127.0.0.1:1" and pc.rpc_arg(eps, "RPC1,RPC0,CPU") == "127.0.0.1:1,127.0.0.1:2"
    args = pc.server_args("RPC0,RPC1,CPU", pc.rpc_arg(eps, "RPC0,RPC1,CPU"), 2, 4, 8, 4, 1)
    assert args[:4] == ["--rpc", "127.0.0.1:1,127.0.0.1:2", "--device", "RPC0,RPC1,CPU"]
    assert args[args.index("-ts") + 1] == "1,1,1"   # even: one proportion per device
    pc.check_tensor_split("even", ["RPC0,CPU", "RPC0,RPC1,CPU"])
    pc.check_tensor_split("2,1,1", ["RPC0,RPC1,CPU", "CPU"])
    with pytest.raises(ValueError):
        pc.check_tensor_split("7,5", ["RPC0,CPU", "RPC0,RPC1,CPU"])
    # llama.cpp's split (one ggml-rpc-server) is paired with the 2-stage order only
    recs = [_rec("f32", "split", 1, 300, order=o, groups=2) for o in ("RPC0,CPU", "RPC0,RPC1,CPU")]
    recs.append(_rec("f32", "llama-split", 1, 150))
    names = [r["name"] for r in pc.target_ratios(recs, ["f32"], [32], ["RPC0,CPU", "RPC0,RPC1,CPU"], [2], [], 1)]
    assert names == ["RPC0,CPU: pyllama split 2 group(s) / llama.cpp split"]


def test_three_stages_with_a_group_each_are_judged_against_every_unsplit_run():
    # the 3-stage target is 3 groups against -t 2 (the machine's cores), not only -t 3
    recs = []
    for leg, (g2, g3, t1, t2) in enumerate([(380, 400, 250, 440), (390, 396, 252, 420)], 1):
        recs += [_rec("f32", "split", leg, g2, order="RPC0,RPC1,CPU", groups=2),
                 _rec("f32", "split", leg, g3, order="RPC0,RPC1,CPU", groups=3),
                 _rec("f32", "unsplit", leg, t1, threads=1), _rec("f32", "unsplit", leg, t2, threads=2)]
    rows = {r["name"]: r for r in pc.target_ratios(recs, ["f32"], [32], ["RPC0,RPC1,CPU"], [1, 2, 3], [1, 2], 1)}
    r = rows["RPC0,RPC1,CPU: 3 group(s) / pyllama unsplit -t 2"]
    assert r["ratio"] == pytest.approx(796 / 860) and (r["min"], r["max"]) == (pytest.approx(400 / 440),
                                                                                pytest.approx(396 / 420))
    assert rows["RPC0,RPC1,CPU: 2 group(s) / pyllama unsplit -t 2"]["ratio"] == pytest.approx(770 / 860)
    assert "RPC0,RPC1,CPU: 3 group(s) / pyllama unsplit -t 3" not in rows   # -t 3 did not run


def test_tiny_end_to_end_three_stages(tiny_model, tmp_path):
    # the tiny model has 2 blocks: -ts 1,1,0 gives RPC0 one, RPC1 the other, the CPU the output layer
    out = tmp_path / "cells.json"
    args = ["--model", tiny_model, "--orders", "RPC0,RPC1,CPU", "--groups", "1,2", "--users", "2", "--legs", "1",
            "--npp", "8", "--ntg", "4", "-r", "1", "--tensor-split", "1,1,0", "--trace", str(tmp_path / "traces"),
            "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "PYLLAMA_PEERS"}
    r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       stdin=subprocess.DEVNULL, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert len(doc["rpc_endpoints"]) == 2 and len(set(doc["rpc_endpoints"])) == 2
    assert [(lg["kind"], lg["order"], lg["groups"]) for lg in doc["legs"]] == [
        ("split", "RPC0,RPC1,CPU", 1), ("split", "RPC0,RPC1,CPU", 2)]
    for lg in doc["legs"]:
        sa = lg["server_args"]
        assert sa[sa.index("--rpc") + 1] == ",".join(doc["rpc_endpoints"]) and sa[sa.index("-ts") + 1] == "1,1,0"
        assert lg["errors"] == 0 and lg["gen_tok_s"] > 0 and lg["bench"]["requests_ok"] == 2
        assert lg["last_blocks"] == 0   # the CPU holds the output layer only
        # both rpc servers' traces went into the busy shares, and both computed
        assert set(lg["busy_pct"]) == {"CPU", "RPC0/CPU", "RPC1/CPU"}
        assert lg["busy_pct"]["RPC0/CPU"] > 0 and lg["busy_pct"]["RPC1/CPU"] > 0
        assert set(lg["thread_stats"]) == {"window_s", "server", "rpc", "rpc1"}
    assert sorted(os.listdir(tmp_path / "traces"))[-2:] == ["rpc-server-RPC1.jsonl", "rpc-server.jsonl"]
    assert "RPC0,RPC1,CPU: 2 groups / 1 group" in r.stdout


def test_link_arms_their_names_and_the_shaped_over_loopback_ratio():
    links = pc.parse_links(["0/none,2/1gbit", "0.5/10gbit"])
    assert links == [{"name": "0ms/none", "delay_ms": 0.0, "rate_bit_s": None},
                     {"name": "2ms/1gbit", "delay_ms": 2.0, "rate_bit_s": 1e9},
                     {"name": "0.5ms/10gbit", "delay_ms": 0.5, "rate_bit_s": 1e10}]
    assert pc.parse_links(None) == [] and pc.parse_links([]) == []
    for bad in (["2/1gbit", "2.0/1000mbit"], ["fast"], ["2/warp"]):
        with pytest.raises(ValueError):
            pc.parse_links(bad)
    names = ["2ms/1gbit"]
    arms = pc.make_arms(["RPC0,CPU"], [1, 2], [2], llama=False, links=names)
    assert [pc.arm_label(pc.arm_key(a)) for a in arms] == [
        "pyllama split RPC0,CPU 1 group", "pyllama split RPC0,CPU 2 groups",
        "pyllama split RPC0,CPU 1 group link 2ms/1gbit", "pyllama split RPC0,CPU 2 groups link 2ms/1gbit",
        "pyllama -t 2"]
    runs = pc.full_schedule(["f32"], arms, [32], legs=2)   # the link arms interleave with the others
    assert [r.get("link") for r in runs[:len(arms)]] == [None, None, "2ms/1gbit", "2ms/1gbit", None]
    assert [r["leg"] for r in runs] == [1] * len(arms) + [2] * len(arms)
    assert pc._trace_name(runs[2]) == "f32-split-RPC0-CPU-link2ms_1gbit-g1-u32-leg1.jsonl"
    recs = []
    for leg, (lo1, lo2, sh1, sh2) in enumerate([(300, 420, 240, 380), (310, 430, 250, 370)], 1):
        recs += [_rec("f32", "split", leg, lo1, order="RPC0,CPU", groups=1),
                 _rec("f32", "split", leg, lo2, order="RPC0,CPU", groups=2),
                 _rec("f32", "split", leg, sh1, order="RPC0,CPU", groups=1, link="2ms/1gbit"),
                 _rec("f32", "split", leg, sh2, order="RPC0,CPU", groups=2, link="2ms/1gbit")]
    rows = {r["name"]: r for r in pc.target_ratios(recs, ["f32"], [32], ["RPC0,CPU"], [1, 2], [], 1, (), names)}
    assert rows["RPC0,CPU 1 group(s): link 2ms/1gbit / loopback"]["ratio"] == pytest.approx(490 / 610)
    r2 = rows["RPC0,CPU 2 group(s): link 2ms/1gbit / loopback"]
    assert r2["ratio"] == pytest.approx(750 / 850) and (r2["min"], r2["max"]) == (pytest.approx(370 / 430),
                                                                                 pytest.approx(380 / 420))
    assert rows["RPC0,CPU link 2ms/1gbit: 2 groups / 1 group"]["ratio"] == pytest.approx(750 / 490)
    assert rows["RPC0,CPU: 2 groups / 1 group"]["ratio"] == pytest.approx(850 / 610)   # loopback only
    cells = pc.summarize(recs, ["RPC0,CPU"], [32], [1, 2], names)
    assert [(c["link"], c["groups"]) for c in cells] == [(None, 1), (None, 2), ("2ms/1gbit", 1), ("2ms/1gbit", 2)]
    assert cells[3]["ratio"] == pytest.approx(750 / 490) and cells[1]["ratio"] == pytest.approx(850 / 610)
    assert cells[0]["legs"] == 2 and cells[2]["tok_s_mean"] == pytest.approx(245)
    best = pc.best_ratios(cells, ["RPC0,CPU"])
    assert set(best) == {"RPC0,CPU", "RPC0,CPU link 2ms/1gbit"}
    assert best["RPC0,CPU link 2ms/1gbit"]["ratio"] == pytest.approx(750 / 490)
    lines = pc.format_table(cells).splitlines()
    assert [v.strip() for v in lines[0].split("|")[:3]] == ["order", "link", "groups"]
    assert lines[2].split("|")[1].strip() == "loopback" and lines[4].split("|")[1].strip() == "2ms/1gbit"
    assert len({len(ln) for ln in lines}) == 1
    assert "link" not in pc.format_table(pc.summarize(recs[:2], ["RPC0,CPU"], [32], [1, 2])).splitlines()[0]
    # an order without an rpc server has no link to shape
    assert [a.get("link") for a in pc.make_arms(["CPU", "RPC0,CPU"], [1], [], False, links=names)] == \
        [None, None, "2ms/1gbit"]
    assert pc.relay_prefix(0) == [] and pc.relay_prefix(-1) == []
    assert pc.relay_prefix(1) == ["chrt", "-f", "41"] and pc.relay_prefix(3) == ["chrt", "-f", "91"]


def test_tiny_end_to_end_over_a_shaped_link(tiny_model, tmp_path):
    out = tmp_path / "cells.json"
    args = ["--model", tiny_model, "--orders", "RPC0,CPU", "--groups", "1", "--users", "2", "--legs", "1",
            "--npp", "8", "--ntg", "4", "-r", "1", "--link", "2/1gbit", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "PYLLAMA_PEERS"}
    r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       stdin=subprocess.DEVNULL, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    (link,) = doc["links"]
    assert link["name"] == "2ms/1gbit" and link["delay_ms"] == 2.0 and link["rate_bit_s"] == 1e9
    assert [(lg["kind"], lg.get("link")) for lg in doc["legs"]] == [("split", None), ("split", "2ms/1gbit")]
    loop, shaped = doc["legs"]
    rpc = [lg["server_args"][lg["server_args"].index("--rpc") + 1] for lg in doc["legs"]]
    assert rpc == [doc["rpc_endpoints"][0], link["endpoints"][0]] and rpc[0] != rpc[1]
    for lg in doc["legs"]:
        assert lg["errors"] == 0 and lg["gen_tok_s"] > 0 and lg["bench"]["requests_ok"] == 2
    # every token crosses the link there and back: 2 ms each way is a floor (no ceiling)
    assert shaped["tpot_ms"] >= 4.0
    assert "link" in shaped["thread_stats"] and "link" not in loop["thread_stats"]
    assert "pyllama split RPC0,CPU 1 group link 2ms/1gbit" in r.stderr
    names = [row["name"] for row in doc["ratios"]]
    assert "RPC0,CPU 1 group(s): link 2ms/1gbit / loopback" in names
    assert "RPC0,CPU 1 group(s): link 2ms/1gbit / loopback:" in r.stdout
    assert not any(pid_alive(pid) for pid in link["pids"])   # the relay went with the run


@pytest.mark.skipif(not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2 or not __import__("shutil").which("taskset"),
                    reason="needs Linux, taskset and two CPUs")
def test_pin_puts_each_peer_on_a_cpu_of_its_own_and_back():
    """--pin: every thread of each rpc server on CPU 1 + its index for the cell, then every CPU again."""
    procs = [subprocess.Popen([sys.executable, "-c", "import threading, time; threading.Thread(target=time.sleep, "
                               "args=(30,), daemon=True).start(); time.sleep(30)"]) for _ in range(2)]
    n = os.cpu_count() or 1

    def allowed(pid: int) -> set:
        return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}

    try:
        __import__("time").sleep(0.3)  # its second thread exists
        pc.pin_peers([p.pid for p in procs], True)
        assert allowed(procs[0].pid) == {frozenset({1 % n})} and allowed(procs[1].pid) == {frozenset({2 % n})}
        pc.pin_peers([p.pid for p in procs], False)
        assert allowed(procs[0].pid) == {frozenset(range(n))}
        assert pc.make_arms(["RPC0,CPU"], [1, 2], [], False, links=["pinned"])[-1] == \
            {"kind": pc.SPLIT, "order": "RPC0,CPU", "groups": 2, "link": "pinned"}
    finally:
        for p in procs:
            p.kill()
            p.wait()
