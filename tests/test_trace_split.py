"""The trace tools on real traced splits: an HTTP server with two pipeline groups over two rpc
servers (`--device RPC0,RPC1`), and the same with the output layer local (`RPC0,RPC1,CPU`).
Each figure is checked against a plain recomputation from the JSON lines."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from trace_run import traced_split  # noqa: E402
from trace_tools import device_idle, merge  # noqa: E402


@pytest.fixture(scope="module")
def split2(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return traced_split(tiny_model, str(tmp_path_factory.mktemp("split2")), "RPC0,RPC1", groups=2)


@pytest.fixture(scope="module")
def split3(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return traced_split(tiny_model, str(tmp_path_factory.mktemp("split3")), "RPC0,RPC1,CPU", groups=2,
                         extra=["-ts", "1,1,0"])


def _lines(path: str) -> tuple[dict, list[dict]]:
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return rows[0], rows[1:]


def _busy_by_hand(files: list[str]) -> tuple[tuple[int, int], dict[str, int]]:
    """The window (first iteration start to last end) and each file's dev time inside it, by uid:
    the peers' spans moved by the offset of the server's clock event that names them, overlapping
    spans merged by a walk over the sorted list."""
    head, events = _lines(files[0])
    its = [e for e in events if e["c"] == "server" and e["n"] == "iteration"]
    w0, w1 = min(e["t0"] for e in its), max(e["t1"] for e in its)
    offset = {e["peer_uid"]: e["offset_us"] for e in events if e["c"] == "clock"}
    out = {}
    for f in files:
        h, evs = _lines(f)
        off = offset.get(h["uid"], 0)
        spans = sorted((max(e["t0"] - off, w0), min(e["t1"] - off, w1)) for e in evs if e["c"] == "dev")
        total, reach = 0, w0
        for a, b in spans:
            a = max(a, reach)
            if b > a:
                total += b - a
                reach = b
        if spans:
            out[h["uid"]] = total
    return (w0, w1), out


def test_summary_names_both_peers_and_adds_up(split2: list[str]) -> None:
    tr = merge.load(split2)
    assert not tr.warnings
    table = merge.device_summary(tr)
    peers = [_lines(f)[0] for f in split2[1:]]
    assert list(table["device"]) == ["RPC0/CPU", "RPC1/CPU"]
    # the server dialled the peers in --rpc order: RPC0 is the first peer started
    assert list(table["endpoint"]) == [p["endpoint"] for p in peers]
    (w0, w1), busy = _busy_by_hand(split2)
    for r, p in zip(table.itertuples(), peers):
        assert r.window_us == w1 - w0
        assert r.busy_us + r.idle_other_us + r.idle_neither_us == r.window_us, r
        assert r.busy_us == busy[p["uid"]] > 0, r
        assert 0 < r.transfer_us < r.window_us
    # with two devices, each one's "idle while the other is busy" is exactly the other's busy time
    # minus the time both were busy
    both = table["busy_us"].sum() - (table["window_us"].iat[0] - table["idle_neither_us"].iat[0])
    assert table["idle_other_us"].tolist() == [table["busy_us"].iat[1] - both, table["busy_us"].iat[0] - both]
    steps = merge.step_summary(tr)
    assert set(steps["grp"]) == {0, 1}
    assert {"busy:RPC0/CPU_us", "busy:RPC1/CPU_us"} <= set(steps.columns)
    assert (steps["busy:RPC0/CPU_us"] + steps["busy:RPC1/CPU_us"] >= steps["peer_busy_us"]).all()
    assert (steps["local_busy_us"] == 0).all()

    res = subprocess.run([sys.executable, "trace_tools/merge.py", *split2, "--summary"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert all(len(x) <= 80 for x in lines), res.stdout
    assert any(x.startswith("RPC0/CPU ") for x in lines) and any(x.startswith("RPC1/CPU ") for x in lines)
    for p, name in zip(peers, ("RPC0", "RPC1")):
        assert f"  {name} = {p['endpoint']}" in lines
    assert any(x.startswith("no device busy ") for x in lines)
    assert len(res.stdout) < 2000  # compact: no per-step table unless asked


def test_summary_with_a_local_device(split3: list[str]) -> None:
    tr = merge.load(split3)
    table = merge.device_summary(tr)
    assert list(table["device"]) == ["CPU", "RPC0/CPU", "RPC1/CPU"]
    (w0, w1), busy = _busy_by_hand(split3)
    uids = [_lines(f)[0]["uid"] for f in split3]
    assert table["busy_us"].tolist() == [busy[u] for u in uids]
    assert (table["busy_us"] + table["idle_other_us"] + table["idle_neither_us"] == w1 - w0).all()
    # the hidden state reaches the local device through staged copies: some transfer time
    assert table.set_index("device").loc["CPU", "transfer_us"] > 0
    idle = device_idle.device_idle(tr)
    everything = idle[idle["phase"] == "all"].set_index("device")
    assert sorted(everything.index) == sorted(f"{lab}" for lab in table["device"])


def test_device_idle_report_on_a_real_split(split2: list[str]) -> None:
    tr = merge.load(split2)
    groups = device_idle.group_stats(tr)
    its = [e for e in _lines(split2[0])[1] if e["c"] == "server" and e["n"] == "iteration"]
    assert sorted(groups["grp"]) == [0, 1]
    assert groups["iterations"].sum() == len(its)
    owners = device_idle.neither_owners(tr)
    total = owners.groupby("phase")["us"].sum()
    table = device_idle.device_idle(tr)
    neither = table.groupby("phase")["idle_neither_us"].first()
    for phase, us in total.items():
        assert us == neither[phase], phase  # every neither-busy microsecond charged exactly once
    res = subprocess.run([sys.executable, "trace_tools/device_idle.py", *split2], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "RPC0/CPU" in res.stdout and "%" in res.stdout and "group 0" in res.stdout


def test_plot_draws_the_lanes_and_spans_of_the_data(split3: list[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plot.py needs matplotlib (pip install -e '.[notebook]')")
    from trace_tools import plot
    tr = merge.load(split3)
    out = tmp_path / "step.png"
    pic = plot.draw(tr, "2:6", str(out))
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    # the range: iterations 2..5 of the server's file in time order, read from the JSON lines
    head, events = _lines(split3[0])
    its = sorted((e for e in events if e["c"] == "server" and e["n"] == "iteration"), key=lambda e: e["t0"])[2:6]
    t0, t1 = min(e["t0"] for e in its), max(e["t1"] for e in its)
    assert (pic.t0, pic.t1) == (t0, t1)
    offset = {e["peer_uid"]: e["offset_us"] for e in events if e["c"] == "clock"}
    seen = lambda e, off=0: e["t1"] - off > t0 and e["t0"] - off < t1  # noqa: E731
    want: dict[str, int] = {}
    for tid in sorted({e["tid"] for e in its}):
        want[f"server {tid}"] = sum(1 for e in events if e["tid"] == tid and seen(e) and e["c"] in
                                    ("server", "sched", "rpc.client") and e["n"] not in ("iteration", "copy_stage"))
    want["CPU"] = sum(1 for e in events if e["c"] == "dev" and seen(e))
    for name, f in zip(("RPC0", "RPC1"), split3[1:]):
        h, evs = _lines(f)
        off = offset[h["uid"]]
        served = [e for e in evs if e["c"] == "rpc.server" and seen(e, off)]
        want[f"{name} node"] = sum(1 for e in served for a, b in (("t_recv0", "t_recv1"), ("t_exec0", "t_exec1"),
                                                                   ("t_send0", "t_send1"))
                                   if e.get(a) is not None and e.get(b) is not None and e[b] > e[a])
        want[f"{name}/CPU"] = sum(1 for e in evs if e["c"] == "dev" and seen(e, off))
    assert [lane.name for lane in pic.lanes] == list(want)
    assert {lane.name: len(lane.spans) for lane in pic.lanes} == want
    # and the figure holds exactly that: one tick per lane, one bar per span
    ax = pic.figure.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == list(reversed(want))
    drawn: dict[str, int] = {}
    for coll in ax.collections:
        gid = coll.get_gid() or ""
        if gid.startswith("lane:"):
            name = gid[len("lane:"):].rsplit(":", 1)[0]
            drawn[name] = drawn.get(name, 0) + len(coll.get_paths())
    assert drawn == {k: v for k, v in want.items() if v}
    assert all(want[f"{p} node"] > 0 and want[f"{p}/CPU"] > 0 for p in ("RPC0", "RPC1"))
    kinds = [t.get_gid() for t in ax.texts if (t.get_gid() or "").startswith("arrow:")]
    assert kinds.count("arrow:send") == sum(1 for a in pic.arrows if a[4] == "send") > 0
    assert kinds.count("arrow:reply") == sum(1 for a in pic.arrows if a[4] == "reply") > 0
    assert "bottleneck: " in pic.title
    res = subprocess.run([sys.executable, "trace_tools/plot.py", *split3, "--out", str(tmp_path / "cli.png"),
                          "--steps", "99999:"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "no iteration in that range" in res.stderr
