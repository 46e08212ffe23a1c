"""bench/split_sharing.py: the arms' server arguments, the summary, bad options, and a tiny run of
every arm end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "split_sharing.py")

import split_sharing as ss  # noqa: E402


def test_server_arguments_of_one_and_two_groups():
    one = ss.server_args("127.0.0.1:5", 16, 1, 64, 64, "7,5")
    assert one[:4] == ["--rpc", "127.0.0.1:5", "--device", "RPC0,CPU"] and one[one.index("-ts") + 1] == "7,5"
    assert "--pipeline-groups" not in one and one[one.index("-np") + 1] == "16"
    two = ss.server_args("127.0.0.1:5", 32, 2, 64, 64, "7,5")
    assert two[-2:] == ["--pipeline-groups", "2"] and two[two.index("-c") + 1] == str(ss.pc.ctx_for(32, 64, 64))
    assert ["--cache-ram", "0"] == two[two.index("--cache-ram"):two.index("--cache-ram") + 2]


def test_summary_means_each_arm_and_compares_with_two_groups():
    recs = [{"arm": "2 groups", "tok_s": 400.0, "idle_pct": 16.0},
            {"arm": "2 servers, 2 rpc", "tok_s": 480.0, "idle_pct": None},
            {"arm": "2 groups", "tok_s": 420.0, "idle_pct": 14.0}]
    rows = ss.summarize(recs)
    assert [r["arm"] for r in rows] == ["2 groups", "2 servers, 2 rpc"]
    assert rows[0]["tok_s"] == 410.0 and (rows[0]["min"], rows[0]["max"]) == (400.0, 420.0)
    assert rows[0]["idle_pct"] == 15.0 and rows[1]["idle_pct"] is None
    table = ss.format_rows(rows).splitlines()
    assert table[1].split()[-1] == "1.00x" and table[2].split()[-1] == "1.17x" and table[2].split()[-2] == "-"


def test_bad_options_are_one_clear_error(tiny_model):
    for args, what in ((["--users", "3"], "--users must be an even number"),
                       (["--legs", "0"], "must be at least 1"),
                       (["--model", "/nonexistent.gguf"], "no such file"),
                       (["--type", "q9_z"], "unknown weight type 'q9_z'"),
                       (["--preset", "nosuch"], "unknown preset 'nosuch'")):
        r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 2 and what in r.stderr and "Traceback" not in r.stderr
    # a split the server refuses: the server's own message, no traceback
    r = subprocess.run([sys.executable, SCRIPT, "--model", tiny_model, "--tensor-split", "1,x", "--users", "2",
                        "-r", "1", "--legs", "1"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and "2 groups: server exited" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_tiny_run_of_every_arm(tiny_model, tmp_path):
    out = tmp_path / "sharing.json"
    r = subprocess.run([sys.executable, SCRIPT, "--model", tiny_model, "--users", "2", "-r", "1", "--npp", "8",
                        "--ntg", "4", "--legs", "1", "--tensor-split", "1,1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert [lg["arm"] for lg in doc["legs"]] == list(ss.ARMS)
    for lg in doc["legs"]:
        n_servers = ss.ARMS[lg["arm"]][0]
        assert lg["gen_tokens"] == 2 * 1 * 4 and lg["tok_s"] > 0 and len(lg["loads_tok_s"]) == n_servers
    assert [row["arm"] for row in doc["summary"]] == list(ss.ARMS)
    assert "x 2 groups" in r.stdout
