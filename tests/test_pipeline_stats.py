"""The pipeline view's measurements: the busy clock, the DEVICE_BUSY command of the rpc server,
/pipeline/stats and its /metrics families, against independent answers (brute force, the rpc
server's own clock, counted tokens) and against an old peer that does not report its busy time."""
from __future__ import annotations

import random
import threading
import time

import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.backend.rpc import RPCBackend
from pyllama.obs.busy import BusyClock
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.rpc import protocol as P
from pyllama.rpc.connection import Connection, RPCError
from pyllama.rpc.protocol import Cap, Cmd
from pyllama.rpc_server.server import ServerThread
from pyllama.obs.metrics import pipeline_families, render_families
from pyllama.server.pipeline_stats import covered, union

from server_util import RPCServerProcess, ServerProcess


# --- the interval arithmetic and the clock --------------------------------------------------------
@pytest.mark.parametrize("seed", range(20))
def test_union_and_covered_match_brute_force(seed):
    rng = random.Random(seed)
    spans = [(a, a + rng.randint(0, 30)) for a in (rng.randint(0, 200) for _ in range(rng.randint(0, 25)))]
    u = union(spans)
    assert all(a < b for a, b in u) and all(u[i][1] < u[i + 1][0] for i in range(len(u) - 1))
    cells = {t for a, b in spans for t in range(a, b)}
    assert {t for a, b in u for t in range(a, b)} == cells
    w0, w1 = sorted(rng.sample(range(-10, 260), 2))
    assert covered(u, w0, w1) == sum(1 for t in cells if w0 <= t < w1)


def test_busy_clock_merges_overlapping_threads():
    clock = BusyClock()
    started, release_a, a_done = threading.Event(), threading.Event(), threading.Event()

    def worker_a():
        clock.begin()
        started.set()
        release_a.wait()
        clock.end()
        a_done.set()

    t = threading.Thread(target=worker_a)
    t.start()
    started.wait()
    time.sleep(0.02)
    clock.begin()            # a second computation while the first runs
    assert clock.total_us() >= 20000
    release_a.set()
    a_done.wait()
    time.sleep(0.02)
    clock.end()
    t.join()
    spans = clock.spans()
    assert len(spans) == 1    # one busy span, not two overlapping ones
    (s0, s1), = spans
    assert clock.total_us() == s1 - s0 >= 40000
    assert clock.spans(since_us=s1) == []
    clock.end()               # an unmatched end changes nothing
    assert clock.total_us() == s1 - s0
    # bounded: only the newest spans are kept, the total stays exact
    small = BusyClock(max_spans=4)
    for _ in range(10):
        small.begin()
        small.end()
        time.sleep(0.001)
    assert len(small.spans()) == 4 and small.spans(limit=2) == small.spans()[-2:]


# --- DEVICE_BUSY --------------------------------------------------------------------------------
def _busy(conn: Connection, device: int = 0, since: int = 0):
    rep = conn.call(Cmd.DEVICE_BUSY, P.BUSY_REQ.pack(device, 0, since))
    t_recv, t_reply, total, n, _ = P.BUSY_HEAD.unpack_from(rep)
    assert len(rep) == P.BUSY_HEAD.size + n * P.BUSY_SPAN.size
    return t_recv, t_reply, total, list(P.BUSY_SPAN.iter_unpack(rep[P.BUSY_HEAD.size:]))


def test_device_busy_reports_the_servers_own_clock(tiny_model):
    with ServerThread(port=0) as st:
        clock = st.server.devices[0].backend.busy
        conn = Connection(f"127.0.0.1:{st.port}")
        try:
            assert conn.has(Cap.DEVICE_BUSY)
            t_recv, t_reply, total, spans = _busy(conn)
            assert total == 0 and spans == [] and t_recv <= t_reply
            engine = Engine(tiny_model, n_threads=1, backends=[RPCBackend(conn), CPUBackend(1)], tensor_split=[1, 1])
            ctx = engine.new_context(256, 1)
            out = ctx.decode(Batch.for_sequence([1, 5, 9, 13], 0, 0))
            for i in range(4):
                out = ctx.decode(Batch.for_sequence([int(out.logits[-1].argmax())], 4 + i, 0))
            t_recv, t_reply, total, spans = _busy(conn)
            # nothing computes between the reply and now: the reply is the server's clock exactly
            assert total == clock.total_us() > 0
            assert spans == clock.spans() and len(spans) >= 1
            assert sum(b - a for a, b in spans) == total  # every span since start is still kept
            assert all(a < b <= t_reply for a, b in spans)
            assert _busy(conn, since=spans[-1][1])[3] == []
            assert _busy(conn, since=spans[0][1])[3] == spans[1:]
            with pytest.raises(RPCError, match="device 3 does not exist"):
                _busy(conn, device=3)
            with pytest.raises(RPCError, match="DEVICE_BUSY"):
                conn.call(Cmd.DEVICE_BUSY, P.BUSY_REQ.pack(0, 0, 0)[:-1])
            engine.close()
        finally:
            conn.close()


def test_device_busy_refused_when_not_advertised():
    with ServerThread(port=0, caps_mask=int(Cap.GET_TENSORS)) as st:
        conn = Connection(f"127.0.0.1:{st.port}")
        try:
            assert not conn.has(Cap.DEVICE_BUSY)
            with pytest.raises(RPCError, match="not advertised"):
                _busy(conn)
        finally:
            conn.close()


# --- /pipeline/stats and /metrics ---------------------------------------------------------------------
def _shares_add_up(dev: dict) -> None:
    assert dev["measured"]
    assert abs(dev["busy"] + dev["waiting"] + dev["idle"] - 1) < 1e-9
    assert 0 <= dev["busy"] <= 1 and 0 <= dev["waiting"] <= 1 and 0 <= dev["idle"] <= 1


def test_pipeline_stats_local(tiny_model):
    srv = ServerProcess(tiny_model, "--metrics", "-np", "2", "-c", "1024", "--pipeline-groups", "2").wait_ready()
    try:
        n_predict, n_requests = 20, 6
        for i in range(n_requests):
            status, res = srv.post("/completion", {"prompt": f"Count {i}", "n_predict": n_predict, "ignore_eos": True})
            assert status == 200 and res["tokens_predicted"] == n_predict
        status, snap = srv.request("GET", "/pipeline/stats?window=30")
        assert status == 200, snap
        (cpu,) = snap["devices"]
        assert cpu["name"] == "CPU" and cpu["kind"] == "cpu"
        _shares_add_up(cpu)
        assert cpu["waiting"] == 0  # nothing else to wait on
        assert cpu["busy"] > 0 and cpu["busy_total_s"] > 0
        assert snap["window_t0_us"] < snap["window_t1_us"] <= snap["t_us"]
        # every sampled token counted: each request samples n_predict tokens (the first at its prompt)
        assert sum(g["tokens_total"] for g in snap["groups"]) == n_predict * n_requests
        assert [g["group"] for g in snap["groups"]] == [0, 1]
        for g in snap["groups"]:
            if g["steps"]:
                assert g["step_ms"] > 0 and g["batch_size"] >= 1
        assert snap["slots"] == {"total": 2, "busy": 0, "waiting": 0}
        assert snap["rpc"] == []
        for bad in ("0", "31", "abc", "nan", ""):
            status, err = srv.request("GET", f"/pipeline/stats?window={bad}")
            assert status == 400 and "'window'" in err["error"]["message"], (bad, err)
        status, text = srv.request("GET", "/metrics")
        assert status == 200
        lines = text.splitlines()
        assert "# TYPE llamacpp:device_busy_ratio gauge" in lines
        assert any(line.startswith('llamacpp:device_busy_ratio{device="CPU"} ') for line in lines)
        assert any(line.startswith('llamacpp:group_steps_total{group="1"} ') for line in lines)
        assert not any("rpc_" in line for line in lines)
    finally:
        assert srv.stop() == 0


def test_pipeline_stats_split_and_an_old_peer(tiny_model):
    # an older server: without DEVICE_BUSY (and without the newer optional commands)
    old_caps = hex(int(Cap.GET_TENSORS | Cap.DEVICE_TYPES))
    new, old = RPCServerProcess(), RPCServerProcess(env={"PYLLAMA_RPC_SERVER_CAPS": old_caps})
    try:
        for peer, measured in ((new, True), (old, False)):
            srv = ServerProcess(tiny_model, "--metrics", "--rpc", peer.endpoint, "--device", "RPC0,CPU", "-ts", "1,1",
                                "-np", "2", "-c", "1024").wait_ready()
            try:
                for i in range(3):  # an old peer keeps working
                    status, res = srv.post("/completion", {"prompt": f"Hi {i}", "n_predict": 16, "ignore_eos": True})
                    assert status == 200 and res["tokens_predicted"] == 16
                _, first = srv.request("GET", "/pipeline/stats?window=30")
                srv.post("/completion", {"prompt": "more", "n_predict": 16, "ignore_eos": True})
                status, snap = srv.request("GET", "/pipeline/stats?window=30")
                assert status == 200, snap
                devs = {d["name"]: d for d in snap["devices"]}
                assert sorted(devs) == ["CPU", "RPC0"] and devs["RPC0"]["endpoint"] == peer.endpoint
                _shares_add_up(devs["CPU"])
                if measured:
                    _shares_add_up(devs["RPC0"])
                    assert devs["RPC0"]["busy"] > 0 and devs["CPU"]["waiting"] > 0
                    assert devs["CPU"]["idle"] == devs["RPC0"]["idle"]
                else:
                    assert not devs["RPC0"]["measured"] and devs["RPC0"]["busy"] is None
                    assert "DEVICE_BUSY" in devs["RPC0"]["note"]
                (link,) = snap["rpc"]
                assert link["endpoint"] == peer.endpoint
                assert link["round_trips_total"] > first["rpc"][0]["round_trips_total"]
                assert link["round_trips_per_step"] > 0 and link["bytes_in_per_step"] > 0
                _, text = srv.request("GET", "/metrics")
                assert (f'llamacpp:device_busy_ratio{{device="RPC0"}} ' in text) == measured
                assert f'llamacpp:rpc_round_trips_total{{endpoint="{peer.endpoint}"}} ' in text
            finally:
                assert srv.stop() == 0
    finally:
        assert new.stop() == 0 and old.stop() == 0


def test_metric_families_format():
    snap = {"window_s": 5.0, "devices": [
        {"name": 'we"ird\\', "measured": True, "busy": 0.25, "waiting": 0.5, "idle": 0.25, "busy_total_s": 3},
        {"name": "RPC0", "measured": False, "busy": None, "waiting": None, "idle": None, "busy_total_s": None}],
        "groups": [{"group": 0, "step_ms": 2.0, "batch_size": 3.0, "tokens_per_s": 10.0, "steps_total": 7}],
        "rpc": []}
    text = render_families(pipeline_families(snap))
    assert 'llamacpp:device_busy_ratio{device="we\\"ird\\\\"} 0.25' in text
    assert 'llamacpp:group_step_seconds{group="0"} 0.002' in text
    assert "RPC0" not in text and "rpc_" not in text  # nothing measured, nothing written
    assert render_families([("x", "gauge", "h", [])]) == ""
