"""The client of ggml's RPC protocol (llama.cpp's rpc-server) against a Python peer that follows
that server's rules (tests/ggml_fake_peer.py); bench/ggml_wire_check.py runs the same client
against llama.cpp's own rpc-server."""
from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

from ggml_fake_peer import FakeGGMLPeer
from pyllama.backend.ggml import protocol as P
from pyllama.backend.ggml.connection import GGMLConnection, identify
from pyllama.backend.ggml.protocol import GCmd
from pyllama.rpc.connection import RPCError


@pytest.fixture
def peer():
    p = FakeGGMLPeer(devices=((3 << 30, 4 << 30), (1 << 30, 2 << 30)))
    yield p
    p.stop()


def test_rpc_tensor_is_the_packed_c_struct():
    # offsets of `struct rpc_tensor` under #pragma pack(1): u64 id, u32 type, u64 buffer, u32 ne[4],
    # u32 nb[4], u32 op, i32 op_params[16], i32 flags, u64 src[10], u64 view_src, u64 view_offs,
    # u64 data, char name[64], char padding[4]
    offsets = {n: P.RPC_TENSOR.fields[n][1] for n in P.RPC_TENSOR.names}
    assert offsets == {"id": 0, "type": 8, "buffer": 12, "ne": 20, "nb": 36, "op": 52, "op_params": 56,
                       "flags": 120, "src": 124, "view_src": 204, "view_offs": 212, "data": 220, "name": 228,
                       "padding": 292}
    assert P.RPC_TENSOR.itemsize == 296
    rec = P.tensor_record(7, 8, [64, 3], buffer=0x10, data=0x2000, op=int(P.GOp.MUL_MAT), src=[1, 2],
                          op_params=struct.pack("<f", 0.5), name="blk.0.attn_q")
    raw = P.tensor_bytes(rec)
    assert struct.unpack_from("<QIQ", raw) == (7, 8, 0x10)
    assert struct.unpack_from("<4I4I", raw, 20) == (64, 3, 1, 1, 34, 68, 204, 204)   # Q8_0: 34-byte blocks
    assert struct.unpack_from("<I", raw, 52)[0] == 29 and struct.unpack_from("<f", raw, 56)[0] == 0.5
    assert struct.unpack_from("<QQ", raw, 124) == (1, 2) and struct.unpack_from("<Q", raw, 220)[0] == 0x2000
    assert raw[228:240] == b"blk.0.attn_q" and raw[240:296] == bytes(56)


def test_op_codes_of_this_protocol_version():
    assert (P.GOp.ADD, P.GOp.RMS_NORM, P.GOp.MUL_MAT, P.GOp.GET_ROWS, P.GOp.SET_ROWS, P.GOp.SOFT_MAX,
            P.GOp.ROPE, P.GOp.FLASH_ATTN_EXT, P.GOp.GLU) == (2, 25, 29, 40, 42, 46, 48, 74, 100)
    assert GCmd.HELLO == 14 and len(GCmd) == 18


def test_every_command_against_the_peer(peer):
    conn = GGMLConnection(peer.endpoint)
    try:
        assert conn.version == P.VERSION
        assert conn.device_count() == 2
        assert conn.device_memory(1) == (1 << 30, 2 << 30)
        assert conn.alignment(0) == 32 and conn.max_size(0) == 1 << 40
        ptr, size = conn.alloc_buffer(0, 4096)
        assert ptr and size == 4096
        assert conn.alloc_buffer(1, 2 << 30) == (0, 0)        # no room: a null buffer, not an error
        base = conn.buffer_base(ptr)
        x = np.arange(48, dtype=np.float32)
        t = P.tensor_record(1, 0, [16, 3], buffer=ptr, data=base + 64, name="x")
        conn.set_tensor(t, 0, x.tobytes())
        assert np.array_equal(np.frombuffer(conn.get_tensor(t, 0, 192), np.float32), x)
        view = memoryview(bytearray(64))
        assert conn.get_tensor(t, 64, 64, into=view) == b"" and bytes(view) == x[16:32].tobytes()
        u = P.tensor_record(2, 0, [16, 3], buffer=ptr, data=base + 512, name="y")
        assert conn.copy_tensor(t, u) and peer.read(ptr, 512 - 0x1000 + 0x1000, 192) == x.tobytes()
        conn.memset_tensor(u, 0, 64, 0)
        assert peer.read(ptr, 512, 64) == bytes(64)
        assert conn.set_tensor_hash(t, 0, 0x1234) is False      # not in the peer's cache
        peer.cache[0x1234] = bytes(range(64))
        assert conn.set_tensor_hash(t, 0, 0x1234) is True and peer.read(ptr, 64, 64) == bytes(range(64))
        out = P.tensor_record(3, 0, [16, 3], buffer=ptr, data=base + 1024, op=int(P.GOp.ADD), src=[1, 2], name="z")
        recs = np.array([t, u, out], dtype=P.RPC_TENSOR)
        conn.graph_compute(0, [3], recs)
        conn.graph_recompute(0)
        conn.buffer_clear(ptr, 7)
        conn.free_buffer(ptr)
        assert conn.device_count() == 2     # a replying command: the one-way ones before it ran
        dev, nodes, tensors = peer.graphs[0]
        assert dev == 0 and list(nodes) == [3] and tensors.tobytes() == recs.tobytes()
        assert peer.recomputes == [0] and peer.buffers == {}
    finally:
        conn.close()


def test_a_refused_request_closes_the_connection_with_one_message(peer):
    conn = GGMLConnection(peer.endpoint)
    with pytest.raises(RPCError, match="FREE_BUFFER") as first:
        conn.free_buffer(0xDEAD)
    assert "closed the connection" in str(first.value) and "its log says why" in str(first.value)
    with pytest.raises(RPCError) as later:
        conn.device_count()
    assert str(later.value) == str(first.value)
    conn.close()
    again = GGMLConnection(peer.endpoint)      # the peer serves the next client
    assert again.device_count() == 2
    again.close()


@pytest.mark.parametrize("version,ok", [((5, 0, 0), True), ((5, 0, 7), False), ((4, 0, 0), False),
                                        ((5, 1, 0), False), ((6, 0, 0), False)])
def test_protocol_versions(version, ok):
    p = FakeGGMLPeer(version=version)
    try:
        if ok:
            conn = GGMLConnection(p.endpoint)
            assert conn.version == version
            conn.close()
        else:
            with pytest.raises(P.GGMLProtocolError) as e:
                GGMLConnection(p.endpoint)
            assert P.version_text(version) in str(e.value) and "5.0.0" in str(e.value)
            assert "\n" not in str(e.value)
    finally:
        p.stop()


def _hostile(replies: dict[GCmd, bytes]) -> FakeGGMLPeer:
    return FakeGGMLPeer(reply_hook=lambda cmd, payload: replies.get(cmd))


@pytest.mark.parametrize("cmd,reply,call,match", [
    (GCmd.DEVICE_COUNT, P.U64.pack(4) + P.U32.pack(0), lambda c: c.device_count(), "0 devices"),
    (GCmd.DEVICE_COUNT, P.U64.pack(4) + P.U32.pack(1 << 20), lambda c: c.device_count(), "devices"),
    (GCmd.DEVICE_COUNT, P.U64.pack(1 << 60), lambda c: c.device_count(), "with 1152921504606846976 bytes"),
    (GCmd.GET_ALIGNMENT, P.U64.pack(8) + P.U64.pack(48), lambda c: c.alignment(0), "alignment of 48"),
    (GCmd.ALLOC_BUFFER, P.U64.pack(16) + P.PTR_SIZE.pack(0x1000, 10), lambda c: c.alloc_buffer(0, 4096),
     "10 bytes for 4096"),
    (GCmd.ALLOC_BUFFER, P.U64.pack(16) + P.PTR_SIZE.pack(0, 10), lambda c: c.alloc_buffer(0, 4096), "no buffer"),
    (GCmd.GET_DEVICE_MEMORY, P.U64.pack(16) + P.PTR_SIZE.pack(10, 5), lambda c: c.device_memory(0),
     "10 bytes free of 5"),
    (GCmd.COPY_TENSOR, P.U64.pack(1) + b"\x07", lambda c: c.copy_tensor(P.tensor_record(1, 0, [4]),
                                                                         P.tensor_record(2, 0, [4])), "result 7"),
    (GCmd.BUFFER_GET_BASE, P.U64.pack(8) + P.U64.pack(0), lambda c: c.buffer_base(5), "null base"),
    (GCmd.GET_TENSOR, P.U64.pack(1 << 40), lambda c: c.get_tensor(P.tensor_record(1, 0, [4]), 0, 16),
     "the protocol's reply is 16 bytes"),
])
def test_a_hostile_reply_is_one_clear_error(cmd, reply, call, match):
    p = _hostile({cmd: reply})
    try:
        conn = GGMLConnection(p.endpoint)
        with pytest.raises(P.GGMLProtocolError, match=match):
            call(conn)
        assert conn.broken                          # and nothing more is read from that peer
        with pytest.raises(RPCError):
            conn.device_count()
        conn.close()
    finally:
        p.stop()


def test_random_replies_never_crash_the_client():
    # a peer that answers every command with random bytes (sizes included) for a while
    rng = np.random.default_rng(1)

    def noise(cmd, payload):
        n = int(rng.integers(0, 40))
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()

    p = FakeGGMLPeer(reply_hook=noise, close_after_hook=True)
    calls = [lambda c: c.device_count(), lambda c: c.device_memory(0), lambda c: c.alignment(0),
             lambda c: c.alloc_buffer(0, 64), lambda c: c.buffer_base(1),
             lambda c: c.get_tensor(P.tensor_record(1, 0, [4]), 0, 16), lambda c: c.max_size(0)]
    outcomes = set()
    try:
        for i in range(60):
            try:
                conn = GGMLConnection(p.endpoint, timeout=2)
            except (RPCError, P.GGMLProtocolError) as exc:
                outcomes.add(type(exc).__name__)
                continue
            try:
                calls[i % len(calls)](conn)
                outcomes.add("ok")
            except (RPCError, P.GGMLProtocolError) as exc:
                outcomes.add(type(exc).__name__)
            finally:
                conn.close()
    finally:
        p.stop()
    assert outcomes <= {"ok", "RPCError", "GGMLProtocolError"} and "GGMLProtocolError" in outcomes


def test_graph_payload_round_trip_and_truncation():
    recs = np.array([P.tensor_record(i + 1, 0, [8, 2], name=f"t{i}") for i in range(3)], dtype=P.RPC_TENSOR)
    body = b"".join(bytes(x) for x in P.graph_payload(1, [3, 2], recs))
    dev, nodes, tensors = P.parse_graph(body)
    assert dev == 1 and list(nodes) == [3, 2] and tensors.tobytes() == recs.tobytes()
    for cut in (0, 7, 8 + 16, len(body) - 1):
        with pytest.raises(P.GGMLProtocolError):
            P.parse_graph(body[:cut])


def test_identify_tells_the_two_kinds_apart(peer, rpc_peer):
    assert identify(peer.endpoint) == ("ggml", P.VERSION)
    kind, version = identify(rpc_peer.endpoint)
    assert kind == "pyllama"


def test_identify_names_both_protocols_when_neither_answers():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.1)
    stop = threading.Event()

    def slam():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            c.close()

    t = threading.Thread(target=slam, daemon=True)
    t.start()
    ep = f"127.0.0.1:{srv.getsockname()[1]}"
    try:
        with pytest.raises(RPCError, match="neither pyllama's RPC protocol .* nor ggml's"):
            identify(ep)
    finally:
        stop.set()
        srv.close()
        t.join(2)


def test_rpc_names_a_ggml_peer_and_gives_its_device(peer, caplog):
    from pyllama.backend.ggml.backend import GGMLBackend
    from pyllama.runtime.placement.devices import make_backends
    caplog.set_level("INFO")
    backends = make_backends("RPC0,CPU", peer.endpoint, "layer", 1)
    try:
        dev = backends[0]
        assert isinstance(dev, GGMLBackend) and dev.name == "RPC0"
        info = dev.device_info()
        assert (info.kind, info.free, info.total) == ("ggml", 3 << 30, 4 << 30)
        said = "is a llama.cpp rpc-server (ggml RPC protocol 5.0.0, 2 devices)"
        assert any(said in r.message for r in caplog.records)
    finally:
        for b in backends:
            b.close()


def test_every_command_is_traced_with_its_peer(peer, tmp_path):
    from pyllama.obs import trace
    path = tmp_path / "t.jsonl"
    trace.start(str(path), "test")
    try:
        conn = GGMLConnection(peer.endpoint)
        conn.device_count()
        ptr, _ = conn.alloc_buffer(0, 64)
        conn.set_tensor(P.tensor_record(1, 0, [4], buffer=ptr, data=conn.buffer_base(ptr), name="w"), 0, bytes(16))
        conn.close()
    finally:
        trace.close()
    import json
    events = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    got = {e["n"]: e for e in events if e["c"] == "rpc.client"}
    assert {"HELLO", "DEVICE_COUNT", "ALLOC_BUFFER", "BUFFER_GET_BASE", "SET_TENSOR"} <= set(got)
    assert all(e["peer"] == "ggml" and e["endpoint"] == peer.endpoint for e in got.values())
    assert got["DEVICE_COUNT"]["bytes_in"] == 12 and got["DEVICE_COUNT"]["t_recv1"] >= got["DEVICE_COUNT"]["t_send1"]
    assert "t_recv1" not in got["SET_TENSOR"] and got["SET_TENSOR"]["subj"] == "w"


def test_a_lost_peer_is_noticed_reached_and_reconnected():
    from pyllama.backend.ggml.backend import GGMLBackend, ggml_connection
    from pyllama.ir.tensor import DType, Tensor
    first = FakeGGMLPeer()
    port = int(first.endpoint.rsplit(":", 1)[1])
    dev = GGMLBackend(ggml_connection(first.endpoint), 0, "RPC0")
    try:
        buf = dev.alloc_buffer(4096, "weights")
        t = Tensor(DType.F32, (4, 16), "w", buf, 64)
        dev.set_tensor(t, np.arange(64, dtype=np.float32))
        assert dev.lost() is None
        first.stop()                                   # the peer dies while the device is idle
        assert "closed the connection" in (dev.lost() or "")
        with pytest.raises(RPCError):
            dev.reach()                                # nobody listens yet
        second = FakeGGMLPeer(port=port)
        try:
            dev.reach()
            assert dev.reconnect() == [buf] and buf.remote_ptr in second.buffers and dev.lost() is None
            assert not dev.get_tensor(t).view(np.float32).any()              # contents are the caller's to restore
            dev.set_tensor(t, np.ones(64, np.float32))
            assert (dev.get_tensor(t).view(np.float32) == 1).all()
        finally:
            dev.close()
            second.stop()
    finally:
        first.stop()


def test_replies_are_read_in_the_order_their_commands_were_sent(peer):
    # two reads asked back to back (as two pipeline groups ask theirs): the second's receiver waits
    # until the first reply was read, then each gets its own bytes; a one-way write goes meanwhile
    import time
    conn = GGMLConnection(peer.endpoint)
    try:
        ptr, _ = conn.alloc_buffer(0, 64)
        base = conn.buffer_base(ptr)
        a = P.tensor_record(1, 0, [4], buffer=ptr, data=base, name="a")
        b = P.tensor_record(2, 0, [4], buffer=ptr, data=base + 16, name="b")
        conn.set_tensor(a, 0, np.arange(4, dtype=np.float32).tobytes())
        conn.set_tensor(b, 0, np.arange(10, 14, dtype=np.float32).tobytes())
        first, second = conn.ask_tensor(a, 0, 16), conn.ask_tensor(b, 0, 16)
        got: dict = {}
        t = threading.Thread(target=lambda: got.__setitem__("b", conn.receive(second)))
        t.start()
        time.sleep(0.2)
        assert "b" not in got                       # its turn has not come
        conn.set_tensor(b, 0, np.zeros(4, np.float32).tobytes())   # one-way, after both reads on the wire
        got["a"] = conn.receive(first)
        t.join(10)
        assert np.frombuffer(got["a"], np.float32).tolist() == [0, 1, 2, 3]
        assert np.frombuffer(got["b"], np.float32).tolist() == [10, 11, 12, 13]
        assert conn.get_tensor(b, 0, 16) == bytes(16)
    finally:
        conn.close()


def test_a_peer_lost_while_replies_are_awaited_fails_every_one_of_them():
    # the peer takes both reads, then closes without answering: both receivers fail, naming it
    import time

    def close_at_the_read(cmd: GCmd, payload: bytes):
        if cmd != GCmd.GET_TENSOR:
            return None
        time.sleep(0.3)                               # the second read is on the wire by now
        return b""
    peer = FakeGGMLPeer(reply_hook=close_at_the_read, close_after_hook=True)
    conn = GGMLConnection(peer.endpoint)
    try:
        ptr, _ = conn.alloc_buffer(0, 64)
        rec = P.tensor_record(1, 0, [4], buffer=ptr, data=conn.buffer_base(ptr), name="a")
        replies = [conn.ask_tensor(rec, 0, 16), conn.ask_tensor(rec, 0, 16)]
        errors: list = []

        def wait(reply) -> None:
            try:
                conn.receive(reply)
            except RPCError as exc:
                errors.append(str(exc))
        threads = [threading.Thread(target=wait, args=(r,)) for r in reversed(replies)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(errors) == 2 and all(peer.endpoint in e and "GET_TENSOR" in e for e in errors), errors
        with pytest.raises(RPCError):
            conn.device_count()                       # and every later call
    finally:
        conn.close()
        peer.stop()
