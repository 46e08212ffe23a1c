"""Sessions and lanes (docs/rpc-protocol.md, "Sessions and lanes"): a further connection bound to a
session with BIND_SESSION uses the session's buffers, runs its commands on an executor of its own
(concurrently with the session's other lanes), and ends with the session's first connection. The
client gives each pipeline group (each context's stream) a lane of its own."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pyllama._fast import wire
from pyllama.backend.cpu import CPUBackend
from pyllama.backend.rpc import RPCBackend, RPCLane
from pyllama.obs import trace
from pyllama.rpc import protocol as P
from pyllama.rpc.connection import Connection
from pyllama.rpc.protocol import Cap, Cmd
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from test_rpc_server import Client, start_server, tensor, wait_allocated

KEY = P.SESSION_KEY_SIZE


@pytest.fixture(scope="module")
def server():
    st = start_server(mem_limit=256 << 20)
    yield st
    st.stop()


def bind(c: Client, key: bytes) -> None:
    assert c.ok(Cmd.BIND_SESSION, key) == b""


def test_a_lane_uses_the_session_buffers_and_ends_with_it(server):
    s = Client(server.port)
    key = s.ok(Cmd.SESSION_KEY)
    assert len(key) == KEY and s.ok(Cmd.SESSION_KEY) == key  # one key per session
    bid = s.alloc(1024)
    data = np.arange(16, dtype=np.float32).tobytes()
    s.set_tensor(tensor(bid, 0), data)
    assert s.sync()[0] == 0
    lane = Client(server.port)
    bind(lane, key)
    assert lane.get_tensor(tensor(bid, 0), 0, 64) == data  # the session's buffer, read on the lane
    lane.set_tensor(tensor(bid, 64), data[::-1])
    assert lane.sync() == (0, b"")
    assert s.get_tensor(tensor(bid, 64), 0, 64) == data[::-1]
    # closing a lane frees nothing of the session
    lane.close()
    time.sleep(0.2)
    assert server.server.allocated() == 1024 and s.get_tensor(tensor(bid, 0), 0, 64) == data
    # closing the session's first connection ends its other lanes and frees its buffers
    lane2 = Client(server.port)
    bind(lane2, key)
    s.close()
    assert lane2.closed_by_server()
    wait_allocated(server, 0)
    # the key died with the session
    late = Client(server.port)
    assert "no open session" in late.error(Cmd.BIND_SESSION, key)
    late.close()


def test_bind_refusals_leave_the_connection_usable(server):
    s = Client(server.port)
    key = s.ok(Cmd.SESSION_KEY)
    c = Client(server.port)
    assert "no open session" in c.error(Cmd.BIND_SESSION, bytes(KEY))
    assert "expected a 16-byte key" in c.error(Cmd.BIND_SESSION, key[:8])
    assert "expected none" in c.error(Cmd.SESSION_KEY, b"x")
    assert "its own session" in s.error(Cmd.BIND_SESSION, key)
    bid = c.alloc(64)  # a connection that holds buffers of its own cannot become a lane
    assert "not used buffers" in c.error(Cmd.BIND_SESSION, key)
    c.free(bid)
    assert c.ok(Cmd.DEVICE_COUNT) == P.U32.pack(1)
    lane = Client(server.port)
    bind(lane, key)
    assert "not used" in lane.error(Cmd.BIND_SESSION, key)  # bound once
    assert "a lane of another session" in lane.error(Cmd.SESSION_KEY)
    for x in (lane, c, s):
        x.close()
    wait_allocated(server, 0)


def test_a_bind_reports_an_earlier_one_way_failure(server):
    c = Client(server.port)
    c.send(Cmd.GRAPH_RECOMPUTE, P.RECOMPUTE.pack(0, 0, 7))  # fails: no such graph
    status, msg = c.call(Cmd.BIND_SESSION, bytes(KEY))
    assert status == P.STATUS_EARLIER_ERROR and b"GRAPH_RECOMPUTE" in msg
    assert "no open session" in c.error(Cmd.BIND_SESSION, bytes(KEY))
    c.close()


def test_without_the_capability_the_commands_are_refused():
    st = start_server(caps_mask=int(Cap.GET_TENSORS))
    try:
        c = Client(st.port)
        assert not c.hello_reply[4] & Cap.LANES
        assert "not advertised" in c.error(Cmd.SESSION_KEY)
        assert "not advertised" in c.error(Cmd.BIND_SESSION, bytes(KEY))
        c.close()
    finally:
        st.stop()


class _SlowCPU(CPUBackend):
    """A CPU device whose graphs take half a second: long enough to see lanes overlap."""

    def graph_compute(self, graph, reads=()):
        time.sleep(0.5)
        super().graph_compute(graph, reads)


def test_lanes_run_concurrently():
    """While one lane computes a slow graph, another lane's read is answered; on the same lane it
    waits for the graph (commands of one lane run in order)."""
    st = start_server(backend_factory=lambda: _SlowCPU(1))
    try:
        s = Client(st.port)
        key = s.ok(Cmd.SESSION_KEY)
        bid = s.alloc(1024)
        graph = wire.encode_graph(0, 1, [(bid, 0, 0, (4, 8), "x"), (bid, 128, 0, (8,), "w"),
                                         (bid, 256, 0, (4, 8), "o")], [(2, 2, (0, 1), (1e-5,))])
        a, b = Client(st.port), Client(st.port)
        bind(a, key)
        bind(b, key)
        t0 = time.monotonic()
        a.send(Cmd.GRAPH_COMPUTE, graph)
        time.sleep(0.05)
        b.get_tensor(tensor(bid, 0), 0, 64)
        other_lane = time.monotonic() - t0
        a.get_tensor(tensor(bid, 0), 0, 64)
        same_lane = time.monotonic() - t0
        assert other_lane < 0.4 <= same_lane, (other_lane, same_lane)
        for c in (a, b, s):
            c.close()
        wait_allocated(st, 0)
    finally:
        st.stop()


# --- the client -------------------------------------------------------------------------------------

def _greedy(engine: Engine, n: int = 6) -> list[list[int]]:
    """Two contexts (two groups' streams), each generating greedily from its own prompt, their
    steps interleaved."""
    ctxs = [engine.new_context(128, 1), engine.new_context(128, 1)]
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outs = [c.decode(Batch.for_sequence(p, 0, 0)).logits for c, p in zip(ctxs, prompts)]
    toks: list[list[int]] = [[], []]
    for step in range(n):
        for i, c in enumerate(ctxs):
            t = int(outs[i][-1].argmax())
            toks[i].append(t)
            outs[i] = c.decode(Batch.for_sequence([t], len(prompts[i]) + step, 0)).logits
    for c in ctxs:
        c.free()
    return toks


@pytest.mark.parametrize("order", ["RPC0,CPU", "CPU,RPC0"])
def test_each_context_gets_a_lane_and_the_same_tokens(tiny_model, order):
    want = _greedy(Engine(tiny_model, n_threads=1))
    for caps in (None, int(Cap.GET_TENSORS | Cap.BACKEND_SAMPLING | Cap.DEVICE_TYPES | Cap.FAMILY_OPS)):
        st = start_server(backend_factory=lambda: CPUBackend(1), caps_mask=caps)
        try:
            conn = Connection(f"127.0.0.1:{st.port}")
            rpc = RPCBackend(conn)
            backends = [rpc if d == "RPC0" else CPUBackend(1) for d in order.split(",")]
            engine = Engine(tiny_model, n_threads=1, backends=backends, tensor_split=[1, 1])
            streams = [engine.new_context(64, 1).sched.streams[backends.index(rpc)] for _ in range(2)]
            if caps is None:  # a lane each, bound to the one session
                assert all(isinstance(s, RPCLane) for s in streams) and streams[0].conn is not streams[1].conn
                assert len(conn.lanes) == 2 and all(s.conn.session is conn for s in streams)
            else:  # a peer without lanes: the shared connection, as before
                assert streams == [rpc, rpc] and len(conn.lanes) == 0
            assert _greedy(engine) == want
            engine.close()
            conn.close()
            wait_allocated(st, 0)
        finally:
            st.stop()


def test_a_lane_sees_what_the_session_wrote_just_before(tiny_model):
    """Writes on the session's connection are one-way; a lane's next command waits until the peer
    ran them (fence), so a read on the lane never sees the bytes from before."""
    st = start_server(backend_factory=lambda: CPUBackend(1))
    try:
        conn = Connection(f"127.0.0.1:{st.port}")
        rpc = RPCBackend(conn)
        lane = rpc.new_stream()
        assert isinstance(lane, RPCLane)
        buf = rpc.alloc_buffer(1 << 20)
        from pyllama.backend.base import DType, Tensor  # noqa: PLC0415
        t = Tensor(DType.F32, (1 << 18,), "t", buf, 0)
        for i in range(20):
            data = np.full(1 << 18, float(i), np.float32)
            rpc.set_tensor(t, data)  # one-way, on the session's connection
            out = np.empty_like(data)
            lane.get_tensor_async(t, out)
            lane.synchronize()
            assert out[0] == i and out[-1] == i
        rpc.free_buffer(buf)
        conn.close()
    finally:
        st.stop()


def test_rpc_commands_in_the_trace_name_their_lane(tiny_model, tmp_path):
    st = start_server(backend_factory=lambda: CPUBackend(1))
    path = tmp_path / "t.jsonl"
    try:
        trace.start(str(path), "test")
        conn = Connection(f"127.0.0.1:{st.port}")
        rpc = RPCBackend(conn)
        engine = Engine(tiny_model, n_threads=1, backends=[rpc, CPUBackend(1)], tensor_split=[1, 1])
        _greedy(engine, 2)
        engine.close()
        conn.close()
    finally:
        trace.close()
        st.stop()
    import json  # noqa: PLC0415
    events = [json.loads(line) for line in path.read_text().splitlines()]
    lanes = {e.get("lane") for e in events if e.get("c") == "rpc.client"}
    assert {0, 1, 2} <= lanes  # the session's connection and the two contexts' lanes
    graphs = {e.get("lane") for e in events if e.get("c") == "rpc.client" and e.get("n") == "GRAPH_COMPUTE"}
    assert graphs <= {1, 2} and graphs


def test_two_groups_on_lanes_under_load(tiny_model):
    """Two decode threads, each on its own lane, alternate many steps; each sequence equals its
    run alone (no command of one group lands in the other's lane)."""
    want = _greedy(Engine(tiny_model, n_threads=1), 12)
    st = start_server(backend_factory=lambda: CPUBackend(1))
    try:
        conn = Connection(f"127.0.0.1:{st.port}")
        engine = Engine(tiny_model, n_threads=1, backends=[RPCBackend(conn), CPUBackend(1)], tensor_split=[1, 1])
        got: list = [None, None]

        def run(i: int) -> None:
            ctx = engine.new_context(128, 1)
            prompt = [[5, 6, 7, 8], [9, 10, 11]][i]
            out = ctx.decode(Batch.for_sequence(prompt, 0, 0)).logits
            toks = []
            for step in range(12):
                t = int(out[-1].argmax())
                toks.append(t)
                out = ctx.decode(Batch.for_sequence([t], len(prompt) + step, 0)).logits
            got[i] = toks

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert got == want
        engine.close()
        conn.close()
    finally:
        st.stop()

