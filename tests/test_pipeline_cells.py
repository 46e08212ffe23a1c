"""bench/pipeline_cells.py: the pure parts (schedule, server arguments, aggregation, ratios) and a
cheap end-to-end run on the tiny model (one rpc server on loopback, optionally in a namespace)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "pipeline_cells.py")

_spec = importlib.util.spec_from_file_location("pipeline_cells", SCRIPT)
pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)


# ---------------------------------------------------------------------------------------------
# Pure functions

def test_schedule_interleaves_legs_over_groups():
    runs = pc.schedule(["CPU,RPC0", "RPC0,CPU"], [1, 2, 4], [32, 64], legs=2)
    assert len(runs) == 2 * 2 * 2 * 3
    key = [(r["order"], r["users"], r["leg"], r["groups"]) for r in runs]
    assert key[:12] == [
        ("CPU,RPC0", 32, 1, 1), ("CPU,RPC0", 32, 1, 2), ("CPU,RPC0", 32, 1, 4),
        ("CPU,RPC0", 32, 2, 1), ("CPU,RPC0", 32, 2, 2), ("CPU,RPC0", 32, 2, 4),
        ("CPU,RPC0", 64, 1, 1), ("CPU,RPC0", 64, 1, 2), ("CPU,RPC0", 64, 1, 4),
        ("CPU,RPC0", 64, 2, 1), ("CPU,RPC0", 64, 2, 2), ("CPU,RPC0", 64, 2, 4),
    ]
    assert key[12:] == [("RPC0,CPU",) + k[1:] for k in key[:12]]
    # every arm gets every leg exactly once
    assert len(set(key)) == len(key)


def test_schedule_one_leg_one_group():
    assert pc.schedule(["CPU,RPC0"], [1], [2], 1) == [{"order": "CPU,RPC0", "users": 2, "leg": 1, "groups": 1}]


def test_slots_and_context():
    assert pc.slots_for(32, 1) == 32
    assert pc.slots_for(32, 3) == 33
    assert pc.slots_for(3, 2) == 4
    assert pc.slots_for(1, 4) == 4
    assert pc.ctx_for(33, 64, 64) == 33 * 144


def test_server_args():
    a1 = pc.server_args("RPC0,CPU", "127.0.0.1:5000", 1, 32, 64, 64, 2)
    assert a1 == ["--rpc", "127.0.0.1:5000", "--device", "RPC0,CPU", "-np", "32", "-c", str(32 * 144),
                  "-t", "2", "--cache-ram", "0", "-ts", "1,1"]
    a3 = pc.server_args("CPU,RPC0", "h:1", 3, 32, 8, 4, 1, "auto", ["--kv-unified"])
    assert a3[a3.index("-np") + 1] == "33"
    assert a3[a3.index("-c") + 1] == str(33 * 28)
    assert a3[a3.index("--pipeline-groups") + 1] == "3"
    assert "-ts" not in a3 and a3[-1] == "--kv-unified"
    cpu_only = pc.server_args("CPU", "h:1", 1, 2, 8, 4, 1)
    assert "--rpc" not in cpu_only and "-ts" not in cpu_only
    assert pc.split_arg("0.3,0.7", "RPC0,CPU") == "0.3,0.7"


def test_parse_lists():
    assert pc.parse_orders("CPU,RPC0;rpc0, cpu") == ["CPU,RPC0", "RPC0,CPU"]
    assert pc.parse_int_list("1,2,4", "groups") == [1, 2, 4]
    for bad in ("CPU,RPC1", "CPU,CPU", "CPU;CPU", ""):
        with pytest.raises(ValueError):
            pc.parse_orders(bad)
    for bad in ("0", "1,x", "2,2", ""):
        with pytest.raises(ValueError):
            pc.parse_int_list(bad, "users")


def _leg(tok, tpot=10.0, med=100.0, p99=200.0, errors=0, short=0, exit_status=0):
    return {"gen_tok_s": tok, "tpot_ms": tpot, "ttft_ms_median": med, "ttft_ms_p99": p99,
            "errors": errors, "short": short, "exit_status": exit_status}


def test_aggregate_mean_min_max():
    c = pc.aggregate([_leg(100.0, 10, 100, 300), _leg(130.0, 20, 200, 400, errors=1, exit_status=1),
                      _leg(115.0, 30, 300, 500, short=2, exit_status=1)])
    assert c["legs"] == 3
    assert c["tok_s_mean"] == pytest.approx(115.0)
    assert (c["tok_s_min"], c["tok_s_max"]) == (100.0, 130.0)
    assert c["tpot_ms"] == pytest.approx(20.0)
    assert c["ttft_ms_median"] == pytest.approx(200.0)
    assert c["ttft_ms_p99"] == pytest.approx(400.0)
    assert (c["errors"], c["short"], c["failed_legs"]) == (1, 2, 2)


def test_aggregate_skips_missing_values():
    # a leg whose server never started has no numbers, only errors
    c = pc.aggregate([_leg(90.0), {"gen_tok_s": None, "tpot_ms": None, "ttft_ms_median": None,
                                   "ttft_ms_p99": None, "errors": 4, "short": 0, "exit_status": 1}])
    assert c["tok_s_mean"] == 90.0 and c["tok_s_min"] == c["tok_s_max"] == 90.0
    assert c["tpot_ms"] == 10.0 and c["errors"] == 4
    empty = pc.aggregate([])
    assert empty["tok_s_mean"] is None and empty["tpot_ms"] is None and empty["errors"] == 0


def _rec(order, groups, users, leg, tok):
    return {"order": order, "groups": groups, "users": users, "leg": leg, **_leg(tok)}


def test_summarize_ratios_against_groups_1():
    recs = [_rec("A", 1, 8, 1, 100.0), _rec("A", 1, 8, 2, 120.0),
            _rec("A", 2, 8, 1, 150.0), _rec("A", 2, 8, 2, 180.0),
            _rec("A", 1, 16, 1, 200.0), _rec("A", 2, 16, 1, 260.0),
            _rec("B", 1, 8, 1, 50.0), _rec("B", 2, 8, 1, 40.0)]
    cells = pc.summarize(recs, ["A", "B"], [8, 16], [1, 2])
    assert [(c["order"], c["users"], c["groups"]) for c in cells] == [
        ("A", 8, 1), ("A", 8, 2), ("A", 16, 1), ("A", 16, 2),
        ("B", 8, 1), ("B", 8, 2), ("B", 16, 1), ("B", 16, 2)]
    by = {(c["order"], c["users"], c["groups"]): c for c in cells}
    assert by["A", 8, 1]["ratio"] == 1.0
    assert by["A", 8, 2]["ratio"] == pytest.approx(165.0 / 110.0)
    assert by["A", 16, 2]["ratio"] == pytest.approx(1.3)
    assert by["B", 8, 2]["ratio"] == pytest.approx(0.8)
    assert by["B", 16, 1]["legs"] == 0 and by["B", 16, 1]["ratio"] is None
    best = pc.best_ratios(cells, ["A", "B"], 2)
    assert best["A"]["users"] == 8 and best["A"]["ratio"] == pytest.approx(1.5)
    assert best["B"]["users"] == 8 and best["B"]["ratio"] == pytest.approx(0.8)
    text = pc.format_best(best)
    assert "A: 2 groups over 1: best 1.50x at 8 users" in text


def test_summarize_without_groups_1_has_no_ratio():
    cells = pc.summarize([_rec("A", 2, 8, 1, 150.0)], ["A"], [8], [2])
    assert cells[0]["ratio"] is None
    assert pc.best_ratios(cells, ["A"])["A"] is None
    assert "not measured" in pc.format_best(pc.best_ratios(cells, ["A"]))


def test_format_table():
    cells = pc.summarize([_rec("RPC0,CPU", 1, 32, 1, 99.7), _rec("RPC0,CPU", 2, 32, 1, 130.4)],
                         ["RPC0,CPU"], [32], [1, 2])
    text = pc.format_table(cells)
    lines = text.splitlines()
    assert lines[0].split(" | ")[0].strip() == "order"
    assert "tok/s mean [min..max]" in lines[0] and "TTFT p99" in lines[0]
    assert "99.7 [99.7..99.7]" in lines[2] and "1.00x" in lines[2]
    assert "130.4 [130.4..130.4]" in lines[3] and "1.31x" in lines[3]
    assert len({len(ln) for ln in lines}) == 1   # aligned columns


def test_pick_subnet_and_burst():
    assert pc.pick_subnet(1250, set()) == 1250 % 256
    assert pc.pick_subnet(1250, {226, 227}) == 228
    assert pc.pick_subnet(255, {255}) == 0
    with pytest.raises(RuntimeError):
        pc.pick_subnet(1, set(range(256)))
    assert pc.tbf_burst("10gbit") == str(int(10e9 / 8 * 0.004))
    assert pc.tbf_burst("1mbit") == "65536"
    with pytest.raises(ValueError):
        pc.tbf_burst("fast")


def test_netns_without_root_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert pc.main(["--netns", "--model", "/nonexistent.gguf"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs root" in err


# ---------------------------------------------------------------------------------------------
# End to end on the tiny model

TINY_ARGS = ["--groups", "1", "--users", "2", "--legs", "2", "--orders", "CPU,RPC0", "--npp", "8", "--ntg", "4", "-r", "1"]


def _run(args, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, stdin=subprocess.DEVNULL)


def test_tiny_end_to_end(tiny_model, tmp_path):
    out = tmp_path / "cells.json"
    r = _run(["--model", tiny_model, *TINY_ARGS, "--json", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("order "))
    assert "tok/s mean [min..max]" in lines[head] and "ratio" in lines[head]
    row = lines[head + 2].split("|")
    assert [c.strip() for c in row[:3]] == ["CPU,RPC0", "1", "2"]
    assert row[4].strip() == "1.00x" and row[8].strip() == "0"
    assert "CPU,RPC0: 2 groups over 1: not measured" in r.stdout

    doc = json.loads(out.read_text())
    assert doc["exit_status"] == 0
    legs = doc["legs"]
    assert [(lg["order"], lg["groups"], lg["users"], lg["leg"]) for lg in legs] == \
        [("CPU,RPC0", 1, 2, 1), ("CPU,RPC0", 1, 2, 2)]
    for lg in legs:
        assert lg["start_error"] is None and lg["errors"] == 0 and lg["gen_tok_s"] > 0
        assert lg["bench"]["requests_ok"] == 2 and lg["bench"]["ntg"] == 4
        assert lg["np"] == 2 and lg["ctx"] == 2 * (8 + 4 + 16)
        assert "--pipeline-groups" not in lg["server_args"]
        assert "RPC0" in lg["server_log_tail"]   # the split really had a remote device
    (cell,) = doc["cells"]
    assert cell["legs"] == 2 and cell["ratio"] == 1.0 and cell["errors"] == 0
    toks = [lg["gen_tok_s"] for lg in legs]
    assert cell["tok_s_mean"] == pytest.approx(sum(toks) / 2)
    assert (cell["tok_s_min"], cell["tok_s_max"]) == (min(toks), max(toks))


def test_chrt_prefix_matches_prio_levels():
    assert pc.chrt_prefix(0) == []
    assert pc.chrt_prefix(-1) == ["chrt", "-b", "0"]
    assert [pc.chrt_prefix(n) for n in (1, 2, 3)] == [["chrt", "-f", "40"], ["chrt", "-f", "80"], ["chrt", "-f", "90"]]


def test_prio_reaches_every_pyllama_process(tiny_model, tmp_path):
    # -1 (SCHED_BATCH) needs no privilege, so this runs anywhere
    out = tmp_path / "cells.json"
    r = _run(["--model", tiny_model, *TINY_ARGS, "--legs", "1", "--prio", "-1", "--json", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--prio -1" in r.stderr + r.stdout
    (leg,) = json.loads(out.read_text())["legs"]
    assert leg["server_args"][-2:] == ["--prio", "-1"] and leg["errors"] == 0


def test_bad_flag_value_exits_1():
    r = _run(["--groups", "0"], timeout=60)
    assert r.returncode == 1 and "--groups" in r.stderr
    r = _run(["--prio", "5"], timeout=60)
    assert r.returncode != 0 and "--prio" in r.stderr


def test_failed_cell_exits_1(tiny_model, tmp_path):
    # a server that refuses its arguments is a failed cell (errors), not a crash of the harness
    out = tmp_path / "cells.json"
    r = _run(["--model", tiny_model, *TINY_ARGS, "--legs", "1", "--server-args=--no-such-flag",
              "--json", str(out)])
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    (leg,) = doc["legs"]
    assert leg["start_error"] and leg["errors"] == 2 and leg["gen_tok_s"] is None
    assert "FAIL CPU,RPC0 groups 1 users 2 leg 1: server did not start" in r.stdout


# ---------------------------------------------------------------------------------------------
# --netns (root only)

def _netns_unavailable() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "--netns needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "--netns needs ip and tc (iproute2)"
    name = f"pyllama-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns does not work here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _gone(ns: str, veth: str) -> bool:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    link = subprocess.run(["ip", "link", "show", veth], capture_output=True, text=True)
    return ns not in names and link.returncode != 0


@pytest.fixture(scope="module")
def netns_ok():
    why = _netns_unavailable()
    if why:
        pytest.skip(why)


def test_netns_tiny(netns_ok, tiny_model, tmp_path):
    out = tmp_path / "cells.json"
    r = _run(["--model", tiny_model, *TINY_ARGS, "--legs", "1", "--orders", "RPC0,CPU", "--netns",
              "--rate", "1gbit", "--json", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "in netns behind tbf 1gbit" in r.stdout
    doc = json.loads(out.read_text())
    ns = doc["netns"]
    assert ns["namespace"].startswith("pyllama-peer-")
    x = ns["addresses"][1].split(".")[2]
    assert ns["addresses"] == [f"10.231.{x}.1/30", f"10.231.{x}.2/30"]
    assert doc["rpc_endpoint"].startswith(f"10.231.{x}.2:")
    assert doc["legs"][0]["errors"] == 0 and doc["cells"][0]["ratio"] == 1.0
    assert _gone(ns["namespace"], ns["veth"][0])


def test_netns_torn_down_on_sigterm(netns_ok, tiny_model):
    proc = subprocess.Popen([sys.executable, SCRIPT, "--model", tiny_model, *TINY_ARGS, "--legs", "200",
                             "--netns"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, stdin=subprocess.DEVNULL)
    ns, veth = f"pyllama-peer-{proc.pid}", f"pl{proc.pid}a"
    try:
        deadline = time.monotonic() + 60
        seen = False
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if line.startswith("[2/"):
                seen = True
                break
        assert seen, "the harness did not get to its second run"
        assert not _gone(ns, veth)
        proc.send_signal(signal.SIGTERM)
        proc.stderr.read()
        assert proc.wait(60) != 0
        assert _gone(ns, veth)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
