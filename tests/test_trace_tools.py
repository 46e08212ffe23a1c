"""trace_tools on synthetic traces whose answers are known by construction."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from trace_tools import device_idle, merge  # noqa: E402

BASE_UID = "00000000000000b1"
PEER_UID = "00000000000000c1"


def write_trace(path: Path, role: str, uid: str, events: list[dict], host: str = "h1",
                endpoint: str | None = None, tail: str = "") -> str:
    """A trace file: header line, one line per event, then `tail` as written (a partial line)."""
    header = {"type": "header", "version": 1, "role": role, "uid": uid, "host": host, "pid": 7,
              "endpoint": endpoint, "t_open_us": 0, "wall_us": 1_700_000_000_000_000}
    path.write_text("\n".join(json.dumps(x) for x in [header, *events]) + "\n" + tail)
    return str(path)


def ev(c: str, n: str, t0: int, t1: int, tid: str = "srv", **extra) -> dict:
    return {"c": c, "n": n, "t0": t0, "t1": t1, "tid": tid, **extra}


def clock(peer_uid: str, offset: int, rtt: int = 40, endpoint: str = "gpuhost:50052") -> dict:
    """A client's clock measurement of a peer: peer clock = our clock + offset. Its own `t1`
    field (the send time) lands on the event's t1, as the writer's field merge does."""
    half = rtt // 2
    return ev("clock", "offset", 100, 100, tid="conn", endpoint=endpoint, peer_uid=peer_uid, t2=100 + offset + half,
              t3=100 + offset + half, t4=100 + rtt, offset_us=offset, rtt_us=rtt)


def rpc_client(n: str, t0: int, t1: int, subj: str, grp: int | None = 0, bytes_in: int = 4096) -> dict:
    third = (t1 - t0) // 3
    return ev("rpc.client", n, t0, t1, endpoint="gpuhost:50052", bytes_out=24, bytes_in=bytes_in, subj=subj,
              grp=grp, t_enq=t0, t_send0=t0, t_send1=t0 + third, t_turn=t0 + third, t_recv0=t1 - third,
              t_recv1=t1, ok=True)


def iteration(t0: int, t1: int, grp: int, n_prompt: int, n_decode: int, n_slots: int = 1) -> dict:
    return ev("server", "iteration", t0, t1, tid=f"srv{grp}", grp=grp, n_slots=n_slots,
              n_prompt=n_prompt, n_decode=n_decode)


# --- (a) idle attribution -------------------------------------------------------------------
PEER_OFFSET = 7000


@pytest.fixture
def step_files(tmp_path: Path) -> list[str]:
    """One step [1000, 2000) of group 0. Devices work [1000,1100) [1500,1600) here and [1700,1800)
    on the peer, so 700 µs are idle: 100 of them ([1800,1900)) under no span of group 0."""
    base = [
        iteration(1000, 2000, 0, n_prompt=0, n_decode=1),
        ev("server", "batch_build", 1100, 1200, tid="srv0", grp=0, n_slots=1),
        ev("server", "submit", 1200, 1500, tid="srv0", grp=0, n_slots=1),
        ev("ctx", "decode", 1210, 1490, tid="srv0", grp=0, n_tokens=1, n_outputs=1, n_splits=2),
        ev("sched", "split", 1210, 1250, tid="srv0", backend="CPU", n_inputs=1, n_nodes=9),
        rpc_client("GET_TENSOR", 1300, 1450, "result_output"),
        ev("server", "sampling", 1600, 1650, tid="srv0", grp=0, n_slots=1),
        ev("server", "result_send", 1650, 1700, tid="srv0", grp=0, n_slots=1),
        ev("server", "sampling", 1800, 1900, tid="srv1", grp=1, n_slots=1),  # another group's
        ev("server", "post_decode", 1900, 2000, tid="srv0", grp=0, n_slots=1),
        ev("dev", "compute CPU", 1000, 1100, tid="dev"),
        ev("dev", "compute CPU", 1500, 1600, tid="dev"),
        clock(PEER_UID, PEER_OFFSET),
    ]
    o = PEER_OFFSET
    peer = [
        ev("rpc.server", "GRAPH_COMPUTE", 1690 + o, 1810 + o, tid="conn", t_recv0=1690 + o, t_recv1=1700 + o,
           t_exec0=1700 + o, t_exec1=1800 + o, t_send0=1800 + o, t_send1=1810 + o, bytes_in=900, bytes_out=16,
           n_nodes=40, dev=0),
        ev("dev", "compute CUDA0", 1700 + o, 1800 + o, tid="gpu"),
    ]
    return [write_trace(tmp_path / "trace.jsonl", "server", BASE_UID, base),
            write_trace(tmp_path / "trace.rpc.jsonl", "rpc-server", PEER_UID, peer, host="gpuhost")]


def test_idle_attribution_innermost_and_exact(step_files: list[str]) -> None:
    row = merge.step_summary(merge.load(step_files)).iloc[0]
    expected = {"grp": 0, "t0": 1000, "step_us": 1000, "n_prompt": 0, "n_decode": 1,
                "batch_build_us": 100, "submit_us": 300, "synchronize_us": 0, "post_decode_us": 100,
                "sampling_us": 50, "result_send_us": 50, "local_busy_us": 200, "peer_busy_us": 100,
                "idle_both_us": 700, "logits_read_us": 150,
                "idle_server:batch_build_us": 100, "idle_server:submit_us": 20, "idle_ctx:decode_us": 90,
                "idle_sched:split_us": 40,  # same start as ctx.decode, shorter: innermost
                "idle_rpc.client:GET_TENSOR_us": 150,  # nested in submit and ctx.decode: inner wins
                "idle_server:sampling_us": 50, "idle_server:result_send_us": 50,
                "idle_server:post_decode_us": 100, "idle_unattributed_us": 100}
    assert {k: int(row[k]) for k in expected} == expected
    attributed = [k for k in row.index if k.startswith("idle_") and k != "idle_both_us"]
    assert sum(int(row[k]) for k in attributed) == row["idle_both_us"]


def _oracle(dev: list[tuple[int, int]], host: list[tuple[int, int, str]], end: int) -> Counter:
    """Idle time charged per label, one microsecond at a time (the slow, obvious way)."""
    out: Counter = Counter()
    for t in range(end):
        if any(a <= t < b for a, b in dev):
            continue
        covering = [(-a, b - a, k) for k, (a, b, _) in enumerate(host) if a <= t < b]
        out[host[min(covering)[2]][2] if covering else "unattributed"] += 1
    return out


@pytest.mark.parametrize("seed", range(8))
def test_idle_attribution_matches_brute_force(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    names = ["submit", "synchronize", "sampling"]
    host = []
    for _ in range(12):
        a = rng.randrange(0, 290)
        host.append((a, a + rng.randrange(1, 60), rng.choice(names)))
    dev = [(a, a + rng.randrange(1, 40)) for a in (rng.randrange(0, 290) for _ in range(6))]
    events = [iteration(0, 300, 0, 0, 1)]
    events += [ev("server", name, a, b, tid="srv0", grp=0) for a, b, name in host]
    events += [ev("dev", "compute CPU", a, b, tid="dev") for a, b in dev]
    row = merge.step_summary(merge.load([write_trace(tmp_path / "t.jsonl", "server", BASE_UID, events)])).iloc[0]
    want = _oracle(dev, host, 300)
    got = {k[len("idle_server:"):-3]: int(row[k]) for k in row.index if k.startswith("idle_server:")}
    got["unattributed"] = int(row["idle_unattributed_us"])
    assert {k: v for k, v in got.items() if v} == dict(want)
    assert sum(got.values()) == row["idle_both_us"] == sum(want.values())


# --- (b) phases -----------------------------------------------------------------------------
def test_device_idle_phase_split(tmp_path: Path) -> None:
    """prefill [0,100) [320,350); decode [100,300) [350,450) (a speculative-looking batch, a mixed
    one, and group 1's decode overlapping a prefill); other [300,320)."""
    off = 1_000_000
    base = [iteration(0, 100, 0, n_prompt=10, n_decode=0),
            iteration(100, 200, 0, n_prompt=0, n_decode=8, n_slots=2),
            iteration(200, 300, 0, n_prompt=5, n_decode=2, n_slots=3),
            iteration(320, 400, 0, n_prompt=4, n_decode=0),
            iteration(350, 450, 1, n_prompt=0, n_decode=1),
            clock(PEER_UID, off)]
    base += [ev("dev", "compute CPU", a, b, tid="dev") for a, b in [(10, 60), (150, 250), (310, 330), (400, 420)]]
    peer = [ev("dev", "compute CUDA0", a + off, b + off, tid="gpu") for a, b in [(40, 120), (240, 260), (340, 360)]]
    files = [write_trace(tmp_path / "trace.jsonl", "server", BASE_UID, base),
             write_trace(tmp_path / "peer.jsonl", "rpc-server", PEER_UID, peer)]
    table = device_idle.device_idle(merge.load(files)).set_index(["device", "phase"])
    cols = ["span_us", "busy_us", "idle_other_us", "idle_neither_us", "idle_median_us"]
    cpu, gpu = "CPU", f"{PEER_UID[:8]}/CUDA0"  # a peer with no RPC name in the trace: its uid
    expected = {
        (cpu, "prefill"): [130, 60, 50, 20, 20.0], (cpu, "decode"): [300, 120, 40, 140, 50.0],
        (cpu, "other"): [20, 10, 0, 10, 10.0], (cpu, "all"): [450, 190, 90, 170, 60.0],
        (gpu, "prefill"): [130, 70, 40, 20, 30.0], (gpu, "decode"): [300, 50, 110, 140, 90.0],
        (gpu, "other"): [20, 0, 10, 10, 20.0], (gpu, "all"): [450, 120, 160, 170, 85.0],
    }
    for key, want in expected.items():
        assert table.loc[key, cols].tolist() == want, key
        assert table.loc[key, "busy_pct"] == pytest.approx(100 * want[1] / want[0])
        assert table.loc[key, "idle_neither_pct"] == pytest.approx(100 * want[3] / want[0])
    # group 0 decodes in [100,300), group 1 in [350,450): each covers its share of the 300 µs
    groups = device_idle.group_stats(merge.load(files)).set_index("grp")
    assert groups.loc[0, ["iterations", "prefill", "decode"]].tolist() == [4, 2, 2]
    assert groups.loc[0, "decode_median_us"] == 100 and groups.loc[0, "prefill_median_us"] == 90
    assert groups.loc[0, "decode_cover_pct"] == pytest.approx(200 / 3)
    assert groups.loc[1, "decode_cover_pct"] == pytest.approx(100 / 3)


def test_device_idle_charges_neither_busy_time_to_host_phases(two_peer_files: list[str]) -> None:
    """Nothing computes in [600,1000): 100 µs under sampling, 300 under post_decode."""
    tr = merge.load(two_peer_files)
    owners = device_idle.neither_owners(tr)
    decode = owners[owners["phase"] == "decode"].set_index("owner")
    assert decode["us"].to_dict() == {"server:post_decode": 300, "server:sampling": 100}
    assert decode["pct"].to_dict() == {"server:post_decode": 75.0, "server:sampling": 25.0}
    report = device_idle.format_report(tr)
    assert all(len(line) <= 80 for line in report.splitlines()), report
    assert "RPC1/CUDA0" in report and "30.0%" in report  # RPC1 busy 300 of 1000 µs
    assert "server:post_decode 0.3 (75%)" in report


# --- (c) binding by uid ---------------------------------------------------------------------
def test_peers_on_one_host_bound_by_uid(tmp_path: Path) -> None:
    """Two peers on one host; the clock events come in the other order, with endpoints that do
    not match the headers, and a worse (larger rtt) measurement of A that must lose."""
    a_uid, b_uid = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"
    a_off, b_off = 500_000, -300_000
    base = [clock(b_uid, b_off, rtt=30, endpoint="gpuhost:50052"),
            clock(a_uid, 123_456, rtt=900, endpoint="gpuhost:50053"),
            clock(a_uid, a_off, rtt=35, endpoint="gpuhost:50053"),
            ev("dev", "compute CPU", 10_000_000, 10_000_500, tid="dev")]
    peer_a = [ev("dev", "compute CUDA0", 10_001_000 + a_off, 10_001_100 + a_off, tid="gpu"),
              ev("rpc.server", "GRAPH_COMPUTE", 10_000_990 + a_off, 10_001_110 + a_off, tid="c",
                 t_recv0=10_000_990 + a_off, t_recv1=10_001_000 + a_off, t_exec0=10_001_000 + a_off,
                 t_exec1=10_001_100 + a_off, t_send0=10_001_100 + a_off, t_send1=10_001_110 + a_off)]
    peer_b = [ev("dev", "compute CUDA0", 10_002_000 + b_off, 10_002_100 + b_off, tid="gpu")]
    files = [write_trace(tmp_path / "trace.jsonl", "server", BASE_UID, base, host="front"),
             write_trace(tmp_path / "a.jsonl", "rpc-server", a_uid, peer_a, host="gpuhost", endpoint="gpuhost:50052"),
             write_trace(tmp_path / "b.jsonl", "rpc-server", b_uid, peer_b, host="gpuhost", endpoint="gpuhost:50053")]
    trace = merge.load(files)
    assert [h["offset_us"] for h in trace.headers] == [0, a_off, b_off]
    assert trace.warnings == []
    dev = trace.events[trace.events["c"] == "dev"].set_index("uid")
    assert dev.loc[a_uid, ["t0", "t1"]].tolist() == [10_001_000, 10_001_100]
    assert dev.loc[b_uid, ["t0", "t1"]].tolist() == [10_002_000, 10_002_100]
    rs = trace.events[trace.events["c"] == "rpc.server"].iloc[0]
    assert [rs["t_exec0"], rs["t_exec1"]] == [10_001_000, 10_001_100]


def test_unbound_peer_warns_and_keeps_its_clock(tmp_path: Path) -> None:
    files = [write_trace(tmp_path / "trace.jsonl", "server", BASE_UID, [clock("0123456789abcdef", 5)]),
             write_trace(tmp_path / "p.jsonl", "rpc-server", PEER_UID, [ev("dev", "compute CUDA0", 50, 60)])]
    with pytest.warns(UserWarning, match=PEER_UID):
        trace = merge.load(files)
    assert trace.headers[1]["offset_us"] == 0 and len(trace.warnings) == 1
    assert trace.events[trace.events["c"] == "dev"]["t0"].tolist() == [50]


# --- (d) logits read by tensor name -----------------------------------------------------------
def test_logits_read_identified_by_tensor_name(tmp_path: Path) -> None:
    events = [iteration(0, 1000, 0, 0, 1),
              rpc_client("GET_TENSOR", 100, 200, "result_output", bytes_in=4096),
              rpc_client("GET_TENSOR", 300, 450, "l_out-3", bytes_in=4096),  # same size, not logits
              rpc_client("GET_TENSORS", 500, 530, "l_out-5,result_output"),
              rpc_client("GET_TENSOR", 600, 640, "result_output_norm"),
              rpc_client("SET_TENSOR", 650, 660, "result_output"),
              rpc_client("GET_TENSOR", 700, 800, "result_output", grp=1)]  # another group's
    steps = merge.step_summary(merge.load([write_trace(tmp_path / "t.jsonl", "server", BASE_UID, events)]))
    assert steps["logits_read_us"].tolist() == [100 + 30]


# --- (e) damaged files ----------------------------------------------------------------------
def test_truncated_last_line_is_ignored(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", "server", BASE_UID, [ev("dev", "compute CPU", 0, 5)],
                       tail='{"c":"dev","n":"compute CP')
    assert len(merge.load([path]).events) == 1


HEADER = {"type": "header", "version": 1, "role": "server", "uid": BASE_UID, "host": "h", "pid": 1,
          "endpoint": None, "t_open_us": 0, "wall_us": 0}
EVENT = json.dumps(ev("dev", "x", 0, 1))


@pytest.mark.parametrize("lines, line", [
    ([json.dumps(HEADER), EVENT, "not json", EVENT], 3),  # garbage in the middle
    ([EVENT], 1),  # no header
    (['{"type":"header","version":1,"role":"server"'], 1),  # partial header
    ([json.dumps(dict(HEADER, role="client"))], 1),
    ([json.dumps(dict(HEADER, uid="xyz"))], 1),
    ([json.dumps(dict(HEADER, version=2))], 1),
    ([], 1),  # empty file
])
def test_bad_file_raises_trace_error(tmp_path: Path, lines: list[str], line: int) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(x + "\n" for x in lines))
    with pytest.raises(merge.TraceError, match=rf"bad\.jsonl:{line}:"):
        merge.load([str(path)])
    assert issubclass(merge.TraceError, ValueError)


def _cli(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"trace_tools/{tool}.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_bad_file_exits_1_with_one_line(tmp_path: Path, step_files: list[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("garbage\n")
    for tool in ("merge", "device_idle"):
        res = _cli(tool, step_files[0], str(bad))
        assert res.returncode == 1
        assert len(res.stderr.strip().splitlines()) == 1 and "bad.jsonl:1" in res.stderr


# --- (f) Chrome trace -----------------------------------------------------------------------
def test_chrome_trace(step_files: list[str], tmp_path: Path) -> None:
    trace = merge.load(step_files)
    out = tmp_path / "chrome.json"
    merge.write_chrome(trace, out)
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {1: f"server h1 {BASE_UID[:8]}", 2: f"rpc-server gpuhost {PEER_UID[:8]}"}
    spans = [e for e in events if e["ph"] == "X" and not e["cat"].endswith(".phase")]
    want = Counter((int(r.file) + 1, r.c, r.n, int(r.t0), int(r.t1 - r.t0)) for r in trace.events.itertuples())
    assert Counter((e["pid"], e["cat"], e["name"], e["ts"], e["dur"]) for e in spans) == want
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"srv0 g0", "srv1 g1", "compute CPU", "compute CUDA0"} <= set(rows.values())
    phases = [e for e in events if e["ph"] == "X" and e["cat"].endswith(".phase")]
    assert sorted(e["name"] for e in phases) == ["exec", "recv", "recv", "send", "send", "wait"]
    for p in phases:
        parents = [e for e in spans if e["cat"] == p["cat"][:-len(".phase")] and e["name"] == p["args"]["cmd"]
                   and (e["pid"], e["tid"]) == (p["pid"], p["tid"])]
        assert parents and all(e["ts"] <= p["ts"] and p["ts"] + p["dur"] <= e["ts"] + e["dur"] for e in parents)


# --- (g) CLI --------------------------------------------------------------------------------
def test_cli_summary_chrome_out(step_files: list[str], tmp_path: Path) -> None:
    chrome, csv, legacy = tmp_path / "c.json", tmp_path / "s.csv", tmp_path / "legacy.csv"
    res = _cli("merge", *step_files, "--summary", "--chrome", str(chrome), "--out", str(csv), "--csv", str(legacy))
    assert res.returncode == 0, res.stderr
    assert "merged 2 files, 15 events, 1 steps" in res.stdout
    assert all(len(line) <= 80 for line in res.stdout.splitlines()), res.stdout
    assert "idle_unattributed_us" not in res.stdout  # the wide table only with --steps
    assert "no device busy 0.7 ms (70.0%); longest stretch 0.4 ms at +0.1 ms" in res.stdout
    assert json.loads(chrome.read_text())["traceEvents"]
    assert csv.read_text().startswith("grp,t0,step_us") and legacy.read_text() == csv.read_text()
    res = _cli("merge", *step_files, "--steps")
    assert res.returncode == 0 and "idle_unattributed_us" in res.stdout and "median" in res.stdout
    res = _cli("device_idle", *step_files)
    assert res.returncode == 0, res.stderr
    assert f"{PEER_UID[:8]}/CUDA0" in res.stdout and "none busy, by host phase" in res.stdout
    assert all(len(line) <= 80 for line in res.stdout.splitlines()), res.stdout
    res = _cli("device_idle", *step_files, "--table")
    assert res.returncode == 0 and "idle_neither_us" in res.stdout and "idle_neither_pct" in res.stdout


def test_cli_parquet_without_pyarrow_is_one_line(step_files: list[str], tmp_path: Path) -> None:
    out = tmp_path / "s.parquet"
    res = _cli("merge", *step_files, "--out", str(out))
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1 and "pyarrow" in res.stderr
    else:
        import pandas as pd
        assert res.returncode == 0 and len(pd.read_parquet(out)) == 1


# --- (i) per device -------------------------------------------------------------------------
UID_A, UID_B = "00000000000000a1", "00000000000000a2"


def wire(n: str, t0: int, t1: int, endpoint: str, send: tuple[int, int], recv: tuple[int, int] | None) -> dict:
    """An RPC command with explicit send / receive phases (recv None: a one-way command)."""
    return ev("rpc.client", n, t0, t1, tid="srv0", endpoint=endpoint, grp=0, subj="x", t_enq=t0, t_send0=send[0],
              t_send1=send[1], t_turn=send[1], t_recv0=recv[0] if recv else None,
              t_recv1=recv[1] if recv else None, ok=True)


@pytest.fixture
def two_peer_files(tmp_path: Path) -> list[str]:
    """One step [0, 1000). Local CPU computes [0,100), RPC0 (a:1) [100,400), RPC1 (b:1)
    [300,600); nothing [600,1000), under sampling [600,700) and post_decode [700,1000)."""
    base = [
        iteration(0, 1000, 0, n_prompt=0, n_decode=1),
        ev("dev", "compute CPU", 0, 100, tid="srv0"),
        ev("sched", "split", 80, 110, tid="srv0", backend="RPC0", n_inputs=1, n_nodes=5),
        wire("GRAPH_COMPUTE", 90, 100, "a:1", (90, 100), None),
        wire("GET_TENSORS", 395, 420, "a:1", (395, 397), (400, 420)),
        ev("sched", "split", 270, 310, tid="srv0", backend="RPC1", n_inputs=1, n_nodes=5),
        wire("GRAPH_COMPUTE", 280, 300, "b:1", (280, 300), None),
        wire("GET_TENSORS", 560, 600, "b:1", (560, 562), (580, 600)),
        ev("sched", "copy_send", 590, 600, tid="srv0", backend="CPU", subj="l_out-3", nbytes=64, grp=0),
        ev("server", "sampling", 600, 700, tid="srv0", grp=0, n_slots=1),
        ev("server", "post_decode", 700, 1000, tid="srv0", grp=0, n_slots=1),
        clock(UID_A, 0, endpoint="a:1"), clock(UID_B, 0, endpoint="b:1"),
    ]
    return [write_trace(tmp_path / "t.jsonl", "server", BASE_UID, base),
            write_trace(tmp_path / "b.jsonl", "rpc-server", UID_B, [ev("dev", "compute CUDA0", 300, 600)],
                        endpoint="127.0.0.1:2"),
            write_trace(tmp_path / "a.jsonl", "rpc-server", UID_A, [ev("dev", "compute CUDA0", 100, 400)],
                        endpoint="127.0.0.1:1")]


def test_device_summary_per_peer_exact(two_peer_files: list[str]) -> None:
    tr = merge.load(two_peer_files)
    got = merge.device_summary(tr).set_index("device")
    assert list(got.index) == ["CPU", "RPC0/CUDA0", "RPC1/CUDA0"]  # local first, peers by RPC name
    want = {"CPU": (100, 500, 400, 10), "RPC0/CUDA0": (300, 300, 400, 32), "RPC1/CUDA0": (300, 300, 400, 42)}
    for dev, (busy, other, neither, transfer) in want.items():
        r = got.loc[dev]
        assert (r.window_us, r.busy_us, r.idle_other_us, r.idle_neither_us, r.transfer_us) == \
            (1000, busy, other, neither, transfer), dev
        assert r.idle_pct == pytest.approx(100 * (1000 - busy) / 1000)
    assert got.loc["RPC0/CUDA0", "endpoint"] == "a:1" and pd_isna(got.loc["CPU", "endpoint"])
    row = merge.step_summary(tr).iloc[0]
    assert (row["busy:CPU_us"], row["busy:RPC0/CUDA0_us"], row["busy:RPC1/CUDA0_us"]) == (100, 300, 300)
    assert row["local_busy_us"] == 100 and row["peer_busy_us"] == 500
    assert row["transfer_us"] == 74  # 32 + 42, the CPU's copy lies inside RPC1's receive
    assert row["longest_idle_us"] == 400 and row["idle_both_us"] == 400
    text = merge.format_summary(tr)
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "no device busy 0.4 ms (40.0%); longest stretch 0.4 ms at +0.6 ms" in text
    assert "longest is in: g0 server:post_decode 75%, g0 server:sampling 25%" in text
    assert "RPC0 = a:1" in text and "RPC1 = b:1" in text



# --- (i) a step's own path through the split ------------------------------------------------
def _sent(n: str, grp: int, send: tuple[int, int], recv: tuple[int, int] | None = None) -> dict:
    return ev("rpc.client", n, send[0], recv[1] if recv else send[1], tid=f"srv{grp}", endpoint="p:1", grp=grp,
              subj="x", t_enq=send[0], t_send0=send[0], t_send1=send[1], t_turn=send[1],
              t_recv0=recv[0] if recv else None, t_recv1=recv[1] if recv else None, ok=True)


def _served(n: str, recv1: int, exec0: int, exec1: int, send0: int | None = None) -> dict:
    return ev("rpc.server", n, recv1 - 2, send0 + 3 if send0 else exec1, tid="MainThread", t_recv0=recv1 - 2,
              t_recv1=recv1, t_exec0=exec0, t_exec1=exec1, t_send0=send0, t_send1=send0 + 3 if send0 else None,
              bytes_in=100, bytes_out=16 if send0 else 0, n_nodes=9, dev="CPU", peer="127.0.0.1:9")


@pytest.fixture
def chain_files(tmp_path: Path) -> list[str]:
    """Two groups share one connection to a peer (offset 500 µs). Group 0's step [0, 1000): graph
    sent [100, 110), read sent at 120, reply [600, 620), local compute [620, 900). Group 1's step
    [300, 1300): graph sent [350, 360), its graph waits at the peer behind group 0's, reply [950,
    970), local compute [970, 1250). A third step [1400, 1500) of group 0 computes only locally."""
    o = 500
    base = [
        iteration(0, 1000, 0, n_prompt=0, n_decode=16), iteration(300, 1300, 1, n_prompt=0, n_decode=16),
        iteration(1400, 1500, 0, n_prompt=0, n_decode=16),
        _sent("SET_TENSOR", 0, (60, 70)), _sent("GRAPH_COMPUTE", 0, (100, 110)),
        _sent("GET_TENSORS", 0, (120, 125), (600, 620)),
        _sent("GRAPH_COMPUTE", 1, (350, 360)), _sent("GET_TENSORS", 1, (365, 370), (950, 970)),
        ev("dev", "compute CPU", 620, 900, tid="srv0"), ev("dev", "compute CPU", 970, 1250, tid="srv1"),
        ev("dev", "compute CPU", 1420, 1480, tid="srv0"),
        clock(PEER_UID, o, endpoint="p:1"),
    ]
    peer = [
        _served("SET_TENSOR", 65 + o, 66 + o, 68 + o),
        _served("GRAPH_COMPUTE", 115 + o, 130 + o, 580 + o), _served("GET_TENSORS", 127 + o, 580 + o, 590 + o, 595 + o),
        _served("GRAPH_COMPUTE", 362 + o, 590 + o, 930 + o), _served("GET_TENSORS", 372 + o, 930 + o, 935 + o, 945 + o),
        ev("dev", "compute CPU", 140 + o, 580 + o, tid="rpc-exec-CPU"),
        ev("dev", "compute CPU", 600 + o, 930 + o, tid="rpc-exec-CPU"),
    ]
    return [write_trace(tmp_path / "s.jsonl", "server", BASE_UID, base),
            write_trace(tmp_path / "p.jsonl", "rpc-server", PEER_UID, peer, endpoint="127.0.0.1:1")]


def test_step_chain_follows_each_step_to_its_peer_commands(chain_files: list[str]) -> None:
    steps = merge.step_summary(merge.load(chain_files))
    got = steps[["grp", "t0", *merge.CHAIN_COLUMNS]]
    # local: own thread only (group 1's compute inside group 0's window is not counted); to peer:
    # step start to the graph's send end; queue: arrival to start (group 1 waits behind group 0);
    # reply: execution end of the read to its reply's send
    assert got.iloc[0].tolist() == [0, 0, 280, 110, 15, 450, 5]
    assert got.iloc[1].tolist() == [1, 300, 280, 60, 228, 340, 10]
    last = got.iloc[2]
    assert last["local_compute_us"] == 60
    assert all(pd_isna(last[c]) for c in merge.CHAIN_COLUMNS[1:])  # nothing went to a peer
    text = merge.format_summary(merge.load(chain_files))
    assert all(len(line) <= 80 for line in text.splitlines()), text
    lines = text.splitlines()
    k = lines.index("median path through the split, per group (ms; steps with a peer stage)")
    assert lines[k + 1].split() == ["grp", "steps", "step", "local", "to", "peer", "queue", "peer", "reply"]
    assert lines[k + 2].split() == ["0", "1", "1.00", "0.28", "0.11", "0.01", "0.45", "0.01"]
    assert lines[k + 3].split() == ["1", "1", "1.00", "0.28", "0.06", "0.23", "0.34", "0.01"]


def test_step_chain_leaves_an_unmatched_graph_unknown(chain_files: list[str], tmp_path: Path) -> None:
    """The peer's trace lacks group 1's graph (it was not written); the only later arrival comes
    after group 1's step had ended, so it cannot be that graph's: NaN, not a wrong match."""
    lines = Path(chain_files[1]).read_text().splitlines()
    kept = [ln for ln in lines if '"t_recv1": 862' not in ln]  # group 1's GRAPH_COMPUTE (362 + 500)
    assert len(kept) == len(lines) - 1
    late = _served("GRAPH_COMPUTE", 1350 + 500, 1360 + 500, 1390 + 500)
    Path(chain_files[1]).write_text("\n".join([*kept, json.dumps(late)]) + "\n")
    got = merge.step_summary(merge.load(chain_files))
    assert got.iloc[0][["peer_queue_us", "peer_exec_us"]].tolist() == [15, 450]
    assert pd_isna(got.iloc[1]["peer_queue_us"]) and pd_isna(got.iloc[1]["peer_exec_us"])
    assert got.iloc[1]["peer_reply_us"] == 10  # its read is still there

def test_step_chain_without_the_peers_trace(chain_files: list[str]) -> None:
    steps = merge.step_summary(merge.load(chain_files[:1]))
    assert steps["local_compute_us"].tolist() == [280, 280, 60]
    assert steps["to_peer_us"].tolist()[:2] == [110, 60]  # known from this side alone
    for c in ("peer_queue_us", "peer_exec_us", "peer_reply_us"):
        assert steps[c].isna().all(), c
    assert "median path through the split" not in merge.format_summary(merge.load(chain_files[:1]))

def pd_isna(v: object) -> bool:
    import pandas as pd
    return bool(pd.isna(v))


# --- (h) notebook ---------------------------------------------------------------------------
def test_notebook_is_valid_and_compiles() -> None:
    nb = json.loads((ROOT / "trace_tools" / "notebook.ipynb").read_text())
    assert nb["nbformat"] == 4
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code
    for cell in code:
        assert cell["outputs"] == [] and cell["execution_count"] is None
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        compile(src, "notebook cell", "exec")
    assert any("from trace_tools import" in "".join(c["source"]) for c in code)


def test_interval_helpers() -> None:
    s, e = merge.union([5, 0, 3, 20], [8, 4, 6, 20])
    assert s.tolist() == [0] and e.tolist() == [8]
    assert merge.overlap([0, 2], [4, 6], [1, 10], [3, 12]).tolist() == [3, 0]
    a = (np.array([0, 10]), np.array([5, 15]))
    b = (np.array([3]), np.array([12]))
    d = merge.combine([a, b], lambda x, y: x & ~y)
    assert d[0].tolist() == [0, 12] and d[1].tolist() == [3, 15]
