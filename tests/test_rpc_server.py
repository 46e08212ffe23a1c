"""python -m pyllama.rpc_server against raw sockets: the handshake, every command, a real llama graph
computed remotely equal to the local one, the weight cache, and hostile input (each followed by a
check that the server still serves a well-behaved connection and that nothing leaked)."""
from __future__ import annotations

import hashlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from pyllama._fast import wire
from pyllama.backend.base import DType
from pyllama.backend.cpu import CPUBackend
from pyllama.runtime.context import Batch, Context
from pyllama.models.build.ops import Op
from pyllama.models.model import Model
from pyllama.rpc import protocol as P
from pyllama.rpc.protocol import Cap, Cmd
from pyllama.rpc_server import ServerThread
from pyllama.models.weights import Placement, load_weights, split_layers
from rpc_client import RawClient
from pyllama.rpc.protocol import graph_tables

U64_MAX = 2**64 - 1
LOGGER = "pyllama.rpc_server"
REPLYING = {c for c in Cmd if c not in P.ONE_WAY}


# --- a tiny client ---------------------------------------------------------------------------------------

def tensor(buf: int, offset: int = 0, dtype: int = DType.F32, shape=(16,), name: str = "t") -> bytes:
    rec = np.zeros(1, P.TENSOR)
    rec["buffer"], rec["offset"], rec["dtype"], rec["n_dims"] = buf, offset, int(dtype), len(shape)
    rec["shape"][0, :len(shape)] = shape
    rec["name"] = name.encode()[:P.NAME_LEN]
    return rec.tobytes()


class Client(RawClient):
    """The raw frame client (bench/rpc_client.py) with the commands these tests use."""

    def closed_by_server(self, timeout: float = 5.0) -> bool:
        self.sock.settimeout(timeout)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False

    # commands
    def alloc(self, size: int, usage: int = 0) -> int:
        return P.ALLOC_REP.unpack(self.ok(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, usage, size)))[0]

    def free(self, bid: int) -> None:
        self.ok(Cmd.FREE_BUFFER, P.U64.pack(bid))

    def set_tensor(self, t: bytes, data: bytes, offset: int = 0) -> None:
        self.send(Cmd.SET_TENSOR, t + P.U64.pack(offset) + data)

    def get_tensor(self, t: bytes, offset: int, size: int) -> bytes:
        return self.ok(Cmd.GET_TENSOR, t + P.REGION.pack(offset, size))

    def sync(self) -> tuple[int, bytes]:
        return self.call(Cmd.SYNCHRONIZE, P.U32.pack(0))


def start_server(**kw) -> ServerThread:
    kw.setdefault("backend_factory", lambda: CPUBackend(2))
    st = ServerThread(port=0, **kw)
    st.start()
    return st


def wait_allocated(st: ServerThread, expected: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while st.server.allocated() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert st.server.allocated() == expected


def assert_healthy(st: ServerThread, baseline: int | None = None) -> None:
    """A second, well-behaved connection still works; nothing stayed allocated."""
    if baseline is not None:
        wait_allocated(st, baseline)
    with Client(st.port) as c:
        assert c.ok(Cmd.DEVICE_COUNT) == P.U32.pack(1)
        bid = c.alloc(256)
        t = tensor(bid, 64, shape=(16,))
        data = np.arange(16, dtype=np.float32).tobytes()
        c.set_tensor(t, data)
        assert c.get_tensor(t, 0, 64) == data
        c.free(bid)
    if baseline is not None:
        wait_allocated(st, baseline)


@pytest.fixture(scope="module")
def server():
    st = start_server(mem_limit=256 << 20)
    yield st
    st.stop()


@pytest.fixture
def healthy(server):
    """Checks after the test that the shared server still serves and that nothing leaked."""
    wait_allocated(server, 0)
    yield server
    assert_healthy(server, 0)


# --- handshake and commands ---------------------------------------------------------------------------------

def test_hello_fields_and_capabilities(healthy, tmp_path, monkeypatch, env_settings):
    with Client(healthy.port) as a, Client(healthy.port) as b:
        major, minor, patch, reserved, caps, sid = a.hello_reply
        assert (major, minor, patch, reserved) == (*P.VERSION, 0)
        assert caps == (Cap.GET_TENSORS | Cap.TRACE_SYNC | Cap.BACKEND_SAMPLING | Cap.DEVICE_TYPES | Cap.MOE_FFN
                        | Cap.DEVICE_BUSY | Cap.FAMILY_OPS | Cap.LANES | Cap.LORA)
        assert sid != 0 and b.hello_reply[5] == sid  # one id per server
    # another minor is compatible; a second HELLO is refused but the connection stays
    with Client(healthy.port, hello=False) as c:
        assert P.HELLO_REP.unpack(c.ok(Cmd.HELLO, P.HELLO_REQ.pack(P.VERSION[0], 9, 9, 0)))[4] == caps
        assert "already" in c.error(Cmd.HELLO, P.HELLO_REQ.pack(1, 0, 0, 0))
        assert c.ok(Cmd.DEVICE_COUNT) == P.U32.pack(1)
    with start_server(cache_dir=str(tmp_path)) as st, Client(st.port) as c:
        assert c.hello_reply[4] == (Cap.GET_TENSORS | Cap.TRACE_SYNC | Cap.BACKEND_SAMPLING | Cap.DEVICE_TYPES
                                        | Cap.SET_TENSOR_HASH | Cap.MOE_FFN | Cap.DEVICE_BUSY | Cap.FAMILY_OPS
                                        | Cap.LANES | Cap.LORA)
        assert c.hello_reply[5] != sid
    env_settings(PYLLAMA_RPC_SERVER_CAPS="0")
    with start_server(cache_dir=str(tmp_path)) as st, Client(st.port) as c:
        assert c.hello_reply[4] == 0
        assert "not advertised" in c.error(Cmd.GET_TENSORS, P.U32.pack(0))
        assert "not advertised" in c.error(Cmd.TRACE_SYNC, P.U64.pack(1))
        assert c.ok(Cmd.DEVICE_COUNT) == P.U32.pack(1)
    env_settings(PYLLAMA_RPC_SERVER_CAPS="0x1")
    with start_server() as st, Client(st.port) as c:
        assert c.hello_reply[4] == Cap.GET_TENSORS


def test_device_count_info_and_trace_sync(healthy):
    with Client(healthy.port) as c:
        assert P.U32.unpack(c.ok(Cmd.DEVICE_COUNT))[0] == 1
        name, kind, _, free, total = P.DEVICE_INFO.unpack(c.ok(Cmd.GET_DEVICE_INFO, P.U32.pack(0)))
        assert name.rstrip(b"\0") == b"CPU" and kind == 0
        assert (free, total) == (256 << 20, 256 << 20)
        bid = c.alloc(1 << 20)
        free2, total2 = P.DEVICE_INFO.unpack(c.ok(Cmd.GET_DEVICE_INFO, P.U32.pack(0)))[3:]
        assert (free2, total2) == ((255 << 20), 256 << 20)
        c.free(bid)
        assert "device 1" in c.error(Cmd.GET_DEVICE_INFO, P.U32.pack(1))
        assert "payload" in c.error(Cmd.DEVICE_COUNT, b"x")
        t0 = time.monotonic_ns() // 1000
        t2, t3 = P.TRACE_REP.unpack(c.ok(Cmd.TRACE_SYNC, P.U64.pack(123)))
        t4 = time.monotonic_ns() // 1000
        assert t0 <= t2 <= t3 <= t4  # same host, same monotonic clock
        assert c.sync() == (0, b"")


def test_alloc_set_get_clear_copy_round_trip(healthy):
    with Client(healthy.port) as c:
        bid = c.alloc(4096, usage=1)
        data = np.random.default_rng(0).standard_normal(256).astype(np.float32)
        t = tensor(bid, 1024, shape=(16, 16))
        c.set_tensor(t, data.tobytes())
        assert c.get_tensor(t, 0, 1024) == data.tobytes()
        c.set_tensor(t, b"\1" * 8, offset=100)  # a partial write inside the tensor
        got = c.get_tensor(t, 96, 16)
        assert got == data.tobytes()[96:100] + b"\1" * 8 + data.tobytes()[108:112]
        dst = tensor(bid, 3072, shape=(256,), name="dst")
        c.ok(Cmd.COPY_TENSOR, t + dst)
        assert c.get_tensor(dst, 0, 1024) == c.get_tensor(t, 0, 1024)
        assert "larger" in c.error(Cmd.COPY_TENSOR, t + tensor(bid, 0, shape=(8,)))
        c.ok(Cmd.BUFFER_CLEAR, P.U64.pack(bid) + b"\x07")
        assert c.get_tensor(t, 0, 1024) == b"\x07" * 1024
        q = tensor(bid, 0, DType.Q8_0, (2, 64), "q8")  # quantized tensors are bytes to the server
        c.set_tensor(q, bytes(range(136)))
        assert c.get_tensor(q, 0, 136) == bytes(range(136))
        assert c.get_tensor(t, 1024, 0) == b""
        c.free(bid)
        assert "not a live buffer" in c.error(Cmd.FREE_BUFFER, P.U64.pack(bid))


def test_get_tensors_of_several_regions(healthy):
    with Client(healthy.port) as c:
        a, b = c.alloc(1024), c.alloc(2048)
        da = np.arange(256, dtype=np.float32)
        db = np.arange(512, dtype=np.int32) * 3
        ta, tb = tensor(a, 0, shape=(256,)), tensor(b, 0, DType.I32, (512,))
        c.set_tensor(ta, da.tobytes())
        c.set_tensor(tb, db.tobytes())
        entries = [(ta, 0, 1024), (tb, 40, 400), (ta, 1020, 4), (tb, 0, 0), (ta, 8, 16)]
        payload = P.U32.pack(len(entries)) + b"".join(t + P.REGION.pack(o, s) for t, o, s in entries)
        got = c.ok(Cmd.GET_TENSORS, payload)
        want = b"".join((da.tobytes() if t is ta else db.tobytes())[o:o + s] for t, o, s in entries)
        assert got == want
        assert c.ok(Cmd.GET_TENSORS, P.U32.pack(0)) == b""
        assert "need" in c.error(Cmd.GET_TENSORS, payload[:-1])
        assert "need" in c.error(Cmd.GET_TENSORS, P.U32.pack(0xFFFF) + payload[4:])
        assert "at most" in c.error(Cmd.GET_TENSORS, P.U32.pack(0xFFFFFFFF) + payload[4:])


def test_frames_in_pieces_and_together(healthy):
    with Client(healthy.port) as c:
        bid = c.alloc(1024)
        t = tensor(bid, 0, shape=(256,))
        data = np.arange(256, dtype=np.float32).tobytes()
        frames = (P.HEADER.pack(Cmd.DEVICE_COUNT, 0) + P.HEADER.pack(Cmd.SET_TENSOR, 112 + 1024) + t
                  + P.U64.pack(0) + data + P.HEADER.pack(Cmd.GET_TENSOR, 120) + t + P.REGION.pack(0, 1024)
                  + P.HEADER.pack(Cmd.SYNCHRONIZE, 4) + P.U32.pack(0))
        c.sock.sendall(frames)  # several frames in one piece
        assert c.reply() == (0, P.U32.pack(1))
        assert c.reply() == (0, data)
        assert c.reply() == (0, b"")
        for i in range(len(frames)):  # and one byte at a time
            c.sock.sendall(frames[i:i + 1])
        assert [c.reply() for _ in range(3)] == [(0, P.U32.pack(1)), (0, data), (0, b"")]
        big = np.arange(300_000, dtype=np.float32).tobytes()  # larger than the receive buffer: staged
        b2 = c.alloc(len(big))
        tb = tensor(b2, 0, shape=(300_000,))
        msg = P.HEADER.pack(Cmd.SET_TENSOR, 112 + len(big)) + tb + P.U64.pack(0) + big + P.HEADER.pack(Cmd.DEVICE_COUNT, 0)
        for i in range(0, len(msg), 77_777):
            c.sock.sendall(msg[i:i + 77_777])
        assert c.reply() == (0, P.U32.pack(1))
        assert c.get_tensor(tb, 0, len(big)) == big
        c.free(bid)
        c.free(b2)


def test_half_closed_client_still_gets_its_replies(healthy):
    with Client(healthy.port) as c:
        bid = c.alloc(1 << 20)
        t = tensor(bid, 0, shape=(1 << 18,))
        c.sock.sendall((P.HEADER.pack(Cmd.GET_TENSOR, 120) + t + P.REGION.pack(0, 1 << 20)) * 3)
        c.sock.shutdown(socket.SHUT_WR)
        for _ in range(3):
            assert c.reply() == (0, b"\0" * (1 << 20))
        assert c.closed_by_server()


def test_one_way_error_reported_by_next_reply(healthy):
    with Client(healthy.port) as c:
        bid = c.alloc(1024)
        t = tensor(bid, 0, shape=(16,))
        c.set_tensor(t, b"\1" * 64)
        c.set_tensor(tensor(bid + 1000, 0), b"\0" * 64)       # unknown buffer: fails, no reply
        c.set_tensor(t, b"\2" * 64)                           # later one-way commands still run
        c.set_tensor(tensor(bid, 1000, shape=(16,)), b"\0")  # outside the buffer: counted
        status, msg = c.call(Cmd.GET_TENSOR, t + P.REGION.pack(0, 64))
        assert status == P.STATUS_EARLIER_ERROR
        assert "SET_TENSOR failed" in msg.decode() and "not a live buffer" in msg.decode()
        assert "1 later" in msg.decode()
        assert c.get_tensor(t, 0, 64) == b"\2" * 64  # cleared; the command after it runs
        c.free(bid)


# --- a real graph ------------------------------------------------------------------------------------------------

def graph_to_wire(graph, buffer_id):
    return graph_tables(graph, buffer_id)


@pytest.fixture(scope="module")
def captured(model_factory):
    """A decode of the tiny model on a local CPU backend: the graph, every buffer it uses as it was
    before compute and after, and the logits."""
    model = Model(model_factory("tiny", arch="qwen3"))
    backend = CPUBackend(2)
    placement = Placement([backend], split_layers(model.hparams.n_layer, [1]))
    ctx = Context(model, load_weights(model, placement), placement, 64, 1, 16, 16)
    seen = {}
    run = backend.graph_compute

    def capture(graph, reads=()):
        bufs = {t.buffer.id: t.buffer for nd in graph.nodes for t in (nd.out, *nd.srcs)}
        seen["graph"], seen["buffers"] = graph, bufs
        seen["before"] = {i: b.data.tobytes() for i, b in bufs.items()}
        run(graph, reads)
        seen["after"] = {i: b.data.tobytes() for i, b in bufs.items()}
    backend.graph_compute = capture  # type: ignore[method-assign]
    out = ctx.decode(Batch.for_sequence([256, 17, 33, 99, 4, 250, 7], 0, all_logits=True))
    seen["logits"] = out.logits.tobytes()
    seen["output"] = seen["graph"].nodes[-1].out
    assert seen["output"].name == "result_output"
    return seen


def upload(c: Client, cap: dict) -> dict[int, int]:
    """Allocates a remote twin of every buffer and fills it with the pre-compute bytes."""
    ids = {lid: c.alloc(buf.size, P.USAGE.get(buf.usage, 0)) for lid, buf in cap["buffers"].items()}
    restore(c, cap, ids)
    return ids


def restore(c: Client, cap: dict, ids: dict[int, int]) -> None:
    for lid, rid in ids.items():
        data = cap["before"][lid]
        assert len(data) % 4 == 0
        c.set_tensor(tensor(rid, 0, DType.F32, (len(data) // 4,), "all"), data)


def test_llama_graph_compute_equals_local(server, captured):
    cap = captured
    with Client(server.port) as c:
        ids = upload(c, cap)
        tensors, nodes = graph_to_wire(cap["graph"], lambda b: ids[b.id])
        payload = wire.encode_graph(0, 4242, tensors, nodes)
        c.send(Cmd.GRAPH_COMPUTE, payload)
        out = cap["output"]
        t_out = tensor(ids[out.buffer.id], out.offset, DType.F32, out.shape, out.name)
        logits = c.get_tensor(t_out, 0, out.nbytes)
        assert logits == cap["logits"]  # byte-identical
        for lid, rid in ids.items():  # the KV cache and every intermediate too
            whole = tensor(rid, 0, DType.F32, (cap["buffers"][lid].size // 4,))
            assert c.get_tensor(whole, 0, cap["buffers"][lid].size) == cap["after"][lid]

        # GRAPH_RECOMPUTE of the last uid runs it again on re-sent inputs (the compute buffer reuses
        # the inputs' space): same logits
        assert c.get_tensor(t_out, 0, out.nbytes) != cap["before"][out.buffer.id][out.offset:out.offset + out.nbytes]
        restore(c, cap, ids)
        c.send(Cmd.GRAPH_RECOMPUTE, P.RECOMPUTE.pack(0, 0, 4242))
        assert c.get_tensor(t_out, 0, out.nbytes) == cap["logits"]
        # a repeated GRAPH_COMPUTE of the same uid and bytes works as well
        restore(c, cap, ids)
        c.send(Cmd.GRAPH_COMPUTE, payload)
        assert c.get_tensor(t_out, 0, out.nbytes) == cap["logits"]
        # of a wrong uid: refused, reported by the next reply
        c.send(Cmd.GRAPH_RECOMPUTE, P.RECOMPUTE.pack(0, 0, 4243))
        status, msg = c.sync()
        assert status == P.STATUS_EARLIER_ERROR and "GRAPH_RECOMPUTE" in msg.decode() and "4242" in msg.decode()
        c.send(Cmd.GRAPH_RECOMPUTE, P.RECOMPUTE.pack(7, 0, 4242))
        assert c.sync()[0] == P.STATUS_EARLIER_ERROR
        assert c.sync() == (0, b"")
        for rid in ids.values():
            c.free(rid)
    wait_allocated(server, 0)


def hostile_graph(c: Client, cap: dict, mutate, expect: str, whole: bool = True) -> None:
    """Uploads the captured graph's buffers, sends a mutated GRAPH_COMPUTE, expects it refused."""
    ids = upload(c, cap)
    tensors, nodes = graph_to_wire(cap["graph"], lambda b: ids[b.id])
    payload = bytearray(wire.encode_graph(0, 77, tensors, nodes))
    mutate(payload, ids, tensors, nodes)
    c.send(Cmd.GRAPH_COMPUTE, bytes(payload))
    status, msg = c.sync()
    assert status == P.STATUS_EARLIER_ERROR, msg
    assert expect in msg.decode(), msg.decode()
    if whole:  # refused before anything ran: the compute buffer is as uploaded
        cbuf = cap["output"].buffer
        whole_t = tensor(ids[cbuf.id], 0, DType.F32, (cbuf.size // 4,))
        assert c.get_tensor(whole_t, 0, cbuf.size) == cap["before"][cbuf.id]
    for rid in ids.values():
        c.free(rid)


def _u32(buf: bytearray, off: int, value: int) -> None:
    P.U32.pack_into(buf, off, value)


def _node_off(tensors, j: int) -> int:
    return P.GRAPH_HEAD.size + len(tensors) * P.TENSOR.itemsize + j * P.NODE.itemsize


def _tensor_off(i: int) -> int:
    return P.GRAPH_HEAD.size + i * P.TENSOR.itemsize


def _find(nodes, op: Op) -> int:
    return next(j for j, nd in enumerate(nodes) if nd[0] == op)


@pytest.mark.parametrize("case", ["unknown buffer", "freed buffer", "tensor index", "unknown op", "source count",
                                  "dtype", "outside buffer", "offset overflow", "attention params",
                                  "unused param", "kernel shape", "output over ids"])
def test_hostile_graphs_are_refused(healthy, captured, case):
    def mutate(payload, ids, tensors, nodes):
        if case == "unknown buffer":
            P.U64.pack_into(payload, _tensor_off(3), 987654321)
        elif case == "freed buffer":  # the weights buffer (the embedding table's)
            rid = tensors[nodes[0][2][0]][0]
            ids.pop(next(k for k, v in ids.items() if v == rid))
            c.free(rid)
        elif case == "tensor index":
            _u32(payload, _node_off(tensors, 2) + 12, len(tensors))
        elif case == "unknown op":
            _u32(payload, _node_off(tensors, 1), 99)
        elif case == "source count":
            j = _find(nodes, Op.ADD)
            _u32(payload, _node_off(tensors, j) + 8, 1)
            _u32(payload, _node_off(tensors, j) + 16, P.NO_SRC)
        elif case == "dtype":
            j = _find(nodes, Op.GET_ROWS)
            _u32(payload, _tensor_off(nodes[j][2][1]) + 16, int(DType.F32))
        elif case == "outside buffer":
            P.U64.pack_into(payload, _tensor_off(0) + 8, 1 << 40)
        elif case == "offset overflow":
            P.U64.pack_into(payload, _tensor_off(0) + 8, U64_MAX - 8)
        elif case == "attention params":  # (H + 2 Hkv) * hd wraps to a plausible 32-bit value
            j = _find(nodes, Op.ATTENTION)
            base = _node_off(tensors, j) + 12 + 40
            np.frombuffer(payload, "<f8", 3, base)[:] = (65537, 1, 65536)
        elif case == "unused param":
            np.frombuffer(payload, "<f8", 1, _node_off(tensors, 0) + 12 + 40 + 8 * 11)[:] = 1.0
        elif case == "kernel shape":  # structurally fine; the RMS_NORM kernel refuses its shapes
            j = _find(nodes, Op.RMS_NORM)
            w = nodes[j][2][1]
            P.U64.pack_into(payload, _tensor_off(w) + 24, tensors[w][3][0] // 2)
        elif case == "output over ids":  # the lookup's ids laid inside the rows it writes
            j = _find(nodes, Op.GET_ROWS)
            out, idx = nodes[j][1], nodes[j][2][1]
            payload[_tensor_off(idx):_tensor_off(idx) + 16] = payload[_tensor_off(out):_tensor_off(out) + 16]
    expect = {"unknown buffer": "not a live buffer", "freed buffer": "not a live buffer",
              "tensor index": "outside the", "unknown op": "unknown op code 99", "source count": "1 sources",
              "dtype": "not I32", "outside buffer": "outside buffer", "offset overflow": "overflows",
              "attention params": "head parameters", "unused param": "unused parameter 11",
              "kernel shape": "rms_norm", "output over ids": "overlaps ids"}[case]
    with Client(healthy.port) as c:
        hostile_graph(c, captured, mutate, expect, whole=case != "kernel shape")


def test_freeing_a_buffer_forgets_the_graph(healthy, captured):
    cap = captured
    with Client(healthy.port) as c:
        ids = upload(c, cap)
        tensors, nodes = graph_to_wire(cap["graph"], lambda b: ids[b.id])
        c.send(Cmd.GRAPH_COMPUTE, wire.encode_graph(0, 5, tensors, nodes))
        assert c.sync() == (0, b"")
        victim = tensors[-1][0]
        c.free(victim)
        c.send(Cmd.GRAPH_RECOMPUTE, P.RECOMPUTE.pack(0, 0, 5))
        status, msg = c.sync()
        assert status == P.STATUS_EARLIER_ERROR and "none" in msg.decode()
        for rid in ids.values():
            if rid != victim:
                c.free(rid)


def test_graphs_of_many_shapes_are_kept_within_a_byte_bound(healthy, captured, monkeypatch):
    """Two pipeline groups alternate some fifty step shapes each: every graph a client re-sends
    runs without being decoded again, until the count or byte bound forgets the oldest."""
    from pyllama.rpc_server import session

    builds = []
    build = session.Session._build_graph

    def counting(self, dev, payload):
        builds.append(P.GRAPH_HEAD.unpack_from(payload)[2])
        return build(self, dev, payload)
    monkeypatch.setattr(session.Session, "_build_graph", counting)
    cap = captured
    with Client(healthy.port) as c:
        ids = upload(c, cap)
        tensors, nodes = graph_to_wire(cap["graph"], lambda b: ids[b.id])
        payloads = {uid: wire.encode_graph(0, uid, tensors, nodes) for uid in range(1, 101)}

        def run(cmd, payload):  # each run on the inputs as they were (a run overwrites them)
            restore(c, cap, ids)
            c.send(cmd, payload)
        for uid in payloads:
            run(Cmd.GRAPH_COMPUTE, payloads[uid])
        for uid in (1, 50, 100):  # all still decoded: no build
            run(Cmd.GRAPH_COMPUTE, payloads[uid])
        run(Cmd.GRAPH_RECOMPUTE, P.RECOMPUTE.pack(0, 0, 100))
        assert c.sync() == (0, b"")
        assert builds == list(range(1, 101))

        # a bound of two and a half graphs' bytes keeps the two most recently run ones
        monkeypatch.setattr(session, "RECENT_GRAPH_BYTES", len(payloads[1]) * 5 // 2)
        builds.clear()
        for uid in (201, 202, 203):
            run(Cmd.GRAPH_COMPUTE, wire.encode_graph(0, uid, tensors, nodes))
        run(Cmd.GRAPH_COMPUTE, wire.encode_graph(0, 202, tensors, nodes))  # kept
        run(Cmd.GRAPH_COMPUTE, wire.encode_graph(0, 201, tensors, nodes))  # forgotten: built again
        assert c.sync() == (0, b"")
        assert builds == [201, 202, 203, 201]
        for rid in ids.values():
            c.free(rid)


# --- the weight cache ------------------------------------------------------------------------------------------

def test_set_tensor_hash_cache_survives_a_restart(tmp_path):
    data = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8).tobytes()
    digest = hashlib.sha256(data).digest()
    cache = tmp_path / "cache"

    def hash_req(bid: int) -> bytes:
        return tensor(bid, 0, DType.F32, (len(data) // 4,), "w") + P.REGION.pack(0, len(data)) + digest

    with start_server(cache_dir=str(cache)) as st, Client(st.port) as c:
        bid = c.alloc(len(data), usage=1)
        assert c.ok(Cmd.SET_TENSOR_HASH, hash_req(bid)) == b"\0"  # miss
        c.set_tensor(tensor(bid, 0, DType.F32, (len(data) // 4,)), data)
        assert c.sync() == (0, b"")
        small = tensor(bid, 0, DType.F32, (16,))
        c.set_tensor(small, b"\0" * 64)  # below 1 MiB: not cached
        # a large write into a compute or KV buffer (a long prompt's hidden state) is not a weight
        for usage in (0, 2):
            act = c.alloc(2 << 20, usage=usage)
            c.set_tensor(tensor(act, 0, DType.F32, (1 << 19,)), bytes(range(256)) * (8 << 10))
            assert c.sync() == (0, b"")
            c.free(act)
        assert "outside" in c.error(Cmd.SET_TENSOR_HASH, hash_req(bid)[:104] + P.REGION.pack(8, len(data)) + digest)
    assert os.listdir(cache) == [digest.hex()]
    assert (cache / digest.hex()).read_bytes() == data
    with start_server(cache_dir=str(cache)) as st, Client(st.port) as c:
        bid = c.alloc(len(data), usage=1)
        assert c.ok(Cmd.SET_TENSOR_HASH, hash_req(bid)) == b"\1"  # hit: written from the cache
        assert c.get_tensor(tensor(bid, 0, DType.F32, (len(data) // 4,)), 0, len(data)) == data
        other = hashlib.sha256(b"other").digest()
        assert c.ok(Cmd.SET_TENSOR_HASH, hash_req(bid)[:-32] + other) == b"\0"
    with start_server() as st, Client(st.port) as c:  # without --cache the command is not advertised
        bid = c.alloc(len(data))
        assert "not advertised" in c.error(Cmd.SET_TENSOR_HASH, hash_req(bid))


# --- hostile input -------------------------------------------------------------------------------------------------

def test_first_command_not_hello_closes(healthy):
    with Client(healthy.port, hello=False) as c:
        c.send(Cmd.DEVICE_COUNT)
        assert c.closed_by_server()
    with Client(healthy.port, hello=False) as c:
        c.send(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 0, 1 << 20))
        assert c.closed_by_server()


def test_hello_of_another_major_errors_and_closes(healthy):
    with Client(healthy.port, hello=False) as c:
        msg = c.error(Cmd.HELLO, P.HELLO_REQ.pack(P.VERSION[0] + 1, 0, 0, 0))
        assert "major" in msg
        assert c.closed_by_server()
    with Client(healthy.port, hello=False) as c:
        assert "payload" in c.error(Cmd.HELLO, b"\1\0")
        assert c.closed_by_server()


def test_huge_size_field_closes_before_buffering(healthy, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    for hello in (False, True):
        with Client(healthy.port, hello=hello) as c:
            c.sock.sendall(P.HEADER.pack(Cmd.SET_TENSOR, U64_MAX))
            assert c.closed_by_server()
    assert "exceeds the frame limit" in caplog.text or "not HELLO" in caplog.text


def test_unknown_command_closes(healthy):
    with Client(healthy.port) as c:
        c.send(200, b"abc")
        assert c.closed_by_server()


def test_region_outside_buffer_and_overflowing_offsets(healthy):
    with Client(healthy.port) as c:
        bid = c.alloc(4096)
        cases = [
            tensor(bid, 4096 - 60, shape=(16,)) + P.REGION.pack(0, 4),     # tensor pokes out of its buffer
            tensor(bid, U64_MAX - 7, shape=(16,)) + P.REGION.pack(0, 4),    # tensor offset + size wraps
            tensor(bid, 0, shape=(16,)) + P.REGION.pack(U64_MAX, 2),         # region offset + size wraps
            tensor(bid, 0, shape=(16,)) + P.REGION.pack(1, U64_MAX),
            tensor(bid, 0, shape=(16,)) + P.REGION.pack(60, 8),              # past the tensor's end
            tensor(bid, 0, shape=(2**62, 4)) + P.REGION.pack(0, 4),          # byte size overflows 64 bits
            tensor(bid, 0, DType.Q4_K, (100,)) + P.REGION.pack(0, 4),       # partial block
            tensor(bid, 0, 77, (4,)) + P.REGION.pack(0, 4),                  # unknown dtype
            tensor(bid, 0, shape=(4,))[:20] + P.U32.pack(0) + tensor(bid)[24:] + P.REGION.pack(0, 4),  # n_dims 0
        ]
        for req in cases:
            c.error(Cmd.GET_TENSOR, req)
        c.set_tensor(tensor(bid, 0, shape=(16,)), b"\0" * 8, offset=U64_MAX - 3)  # one-way: reported next
        assert c.sync()[0] == P.STATUS_EARLIER_ERROR
        c.send(Cmd.SET_TENSOR, b"\0" * 50)  # shorter than its head
        assert c.sync()[0] == P.STATUS_EARLIER_ERROR
        assert "payload" in c.error(Cmd.GET_TENSOR, tensor(bid) + b"\0")
        c.free(bid)


def test_get_tensors_sums_that_wrap_or_pass_the_ceiling(healthy):
    with Client(healthy.port) as c:
        bid = c.alloc(4096)
        t = tensor(bid, 0, shape=(1024,))
        wrap = P.U32.pack(2) + t + P.REGION.pack(0, 2**63) + t + P.REGION.pack(0, 2**63)
        c.error(Cmd.GET_TENSORS, wrap)
        wrap2 = P.U32.pack(3) + (t + P.REGION.pack(0, 4096)) + (t + P.REGION.pack(0, U64_MAX)) * 2
        c.error(Cmd.GET_TENSORS, wrap2)
        c.free(bid)
    with start_server(max_frame=1 << 20) as st, Client(st.port) as c:
        bid = c.alloc(768 << 10)
        t = tensor(bid, 0, shape=(192 << 10,))
        one = P.U32.pack(1) + t + P.REGION.pack(0, 768 << 10)
        assert len(c.ok(Cmd.GET_TENSORS, one)) == 768 << 10
        two = P.U32.pack(2) + (t + P.REGION.pack(0, 768 << 10)) * 2
        assert "more than" in c.error(Cmd.GET_TENSORS, two)
        c.free(bid)
        assert_healthy(st, 0)


def test_alloc_above_mem_limit(healthy):
    with Client(healthy.port) as c:
        assert "cap" in c.error(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 0, (256 << 20) + 1))
        assert "cap" in c.error(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 0, U64_MAX))
        bid = c.alloc(200 << 20)
        assert "cap" in c.error(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 0, 100 << 20))
        assert "usage" in c.error(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 9, 16))
        assert "device" in c.error(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(3, 0, 16))
        assert healthy.server.allocated() == 200 << 20
    wait_allocated(healthy, 0)  # freed with the connection


def test_truncated_frame_then_close(healthy, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    with Client(healthy.port) as c:
        bid = c.alloc(1024)
        c.sock.sendall(P.HEADER.pack(Cmd.SET_TENSOR, 1000) + b"\0" * 100)
    deadline = time.monotonic() + 5
    while "middle of a frame" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "middle of a frame" in caplog.text
    with Client(healthy.port) as c:  # a large staged payload cut short, too
        c.sock.sendall(P.HEADER.pack(Cmd.SET_TENSOR, 4 << 20) + b"\0" * (1 << 20))
    assert bid


def test_garbage_frames_never_crash_the_server(healthy):
    rng = random.Random(1234)
    c = Client(healthy.port)
    bid = c.alloc(4096)
    valid = [
        (Cmd.GET_TENSOR, tensor(bid, 0, shape=(64,)) + P.REGION.pack(0, 256)),
        (Cmd.SET_TENSOR, tensor(bid, 256, shape=(64,)) + P.U64.pack(0) + b"\1" * 256),
        (Cmd.GET_TENSORS, P.U32.pack(1) + tensor(bid, 0, shape=(64,)) + P.REGION.pack(0, 256)),
        (Cmd.GRAPH_COMPUTE, wire.encode_graph(0, 1, [(bid, 0, 0, (4, 8), "x"), (bid, 128, 0, (8,), "w"),
                                                     (bid, 256, 0, (4, 8), "o")], [(2, 2, (0, 1), (1e-5,))])),
        (Cmd.COPY_TENSOR, tensor(bid, 0, shape=(64,)) + tensor(bid, 512, shape=(64,))),
        (Cmd.BUFFER_CLEAR, P.U64.pack(bid) + b"\0"),
        (Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 0, 64)),
    ]
    closed = 0
    for i in range(200):
        if rng.random() < 0.5:
            cmd, payload = rng.choice(valid)
            payload = bytearray(payload)
            for _ in range(rng.randint(1, 6)):
                if payload:
                    payload[rng.randrange(len(payload))] = rng.randrange(256)
            if rng.random() < 0.2:
                payload = payload[:rng.randrange(len(payload) + 1)]
            cmd = cmd if rng.random() < 0.9 else rng.randrange(0, 16)
        else:
            cmd = rng.randrange(0, len(Cmd) + 4)  # some codes no command has
            payload = bytearray(rng.randbytes(rng.choice([0, 1, 4, 8, 9, 16, 24, 104, 112, 120, 152, 208,
                                                          rng.randrange(300)])))
        c.send(cmd, bytes(payload))
        if cmd not in {int(x) for x in Cmd}:
            assert c.closed_by_server()
            closed += 1
            c.close()
            c = Client(healthy.port)
            bid2 = c.alloc(4096)
            valid = [(k, p.replace(P.U64.pack(bid), P.U64.pack(bid2))) for k, p in valid]
            bid = bid2
        elif cmd in REPLYING:
            status, _ = c.reply()
            assert status in (0, 1, 2)
    assert c.sync()[0] in (0, 2)
    assert c.sync() == (0, b"")
    c.close()
    assert closed > 0


# --- the program -------------------------------------------------------------------------------------------------

def test_program_flags_help_listening_line_and_sigterm(tmp_path):
    env = {**os.environ, "PYLLAMA_RPC_SERVER_CAPS": "1"}
    out = subprocess.run([sys.executable, "-m", "pyllama.rpc_server", "--help"], capture_output=True, text=True,
                         timeout=30)
    text = " ".join(out.stdout.split())  # argparse wraps at the terminal's width
    assert out.returncode == 0 and "no authentication" in text and "--auth-token-file" in text
    assert "PYLLAMA_RPC_SERVER_ARG_MAX_FRAME" in out.stdout  # not the server's PYLLAMA_ARG_
    bad = subprocess.run([sys.executable, "-m", "pyllama.rpc_server", "--mem", "lots"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1
    bad = subprocess.run([sys.executable, "-m", "pyllama.rpc_server", "--device", "CUDA7"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1
    bad = subprocess.run([sys.executable, "-m", "pyllama.rpc_server", "--port", "0"], capture_output=True,
                         text=True, timeout=30, env={**env, "PYLLAMA_RPC_SERVER_CAPS": "many"})
    assert bad.returncode == 1 and "PYLLAMA_RPC_SERVER_CAPS" in bad.stderr

    proc = subprocess.Popen([sys.executable, "-m", "pyllama.rpc_server", "--port", "0", "-t", "1",
                             "--cache", str(tmp_path)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=env)
    try:
        line = proc.stderr.readline()
        assert line.startswith("listening on 127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])
        with Client(port) as c:
            assert c.hello_reply[4] == 1  # the mask from the environment
            c.alloc(1 << 20)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 0
            assert c.closed_by_server()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _sample_graph(bid: int, rows: int, vocab: int, n_probs: int, window: int, out_dtype=DType.I32,
                  params=None) -> bytes:
    cols_in, cols_out = 12 + window, 2 + 2 * n_probs
    logits_off, in_off = 0, rows * vocab * 4
    out_off = in_off + rows * cols_in * 4
    tensors = [(bid, logits_off, int(DType.F32), (rows, vocab), "result_output"),
               (bid, in_off, int(DType.I32), (rows, cols_in), "inp_sampling"),
               (bid, out_off, int(out_dtype), (rows, cols_out), "result_sampled")]
    return wire.encode_graph(0, 9, tensors, [(int(Op.SAMPLE), 2, (0, 1), params or (n_probs, window))])


def test_sample_op_runs_the_host_sampler_and_is_validated(healthy):
    """SAMPLE on the peer equals the host's kernel on the same packed rows; bad parameters, a wrong
    output type and a server without the capability are refused."""
    from pyllama.batching.sampling import BatchSampler, SamplingParams, SequenceSampler
    rows, vocab, n_probs, window = 3, 50, 4, 8
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    bs = BatchSampler(vocab, rows, n_probs, window=window)
    samplers = [SequenceSampler(SamplingParams(temperature=t, seed=3, n_probs=2, repeat_penalty=1.2), [1, 2, 3])
                for t in (0.0, 0.7, 1.5)]
    packed = bs.pack(samplers).copy()
    ref = [SequenceSampler(SamplingParams(temperature=t, seed=3, n_probs=2, repeat_penalty=1.2), [1, 2, 3])
           for t in (0.0, 0.7, 1.5)]
    want = BatchSampler(vocab, rows, n_probs, window=window).sample(logits, ref)
    size = logits.nbytes + packed.nbytes + rows * (2 + 2 * n_probs) * 4
    with Client(healthy.port) as c:
        bid = c.alloc(size)
        c.set_tensor(tensor(bid, 0, DType.F32, (logits.size,)), logits.tobytes())
        c.set_tensor(tensor(bid, logits.nbytes, DType.I32, (packed.size,)), packed.tobytes())
        c.send(Cmd.GRAPH_COMPUTE, _sample_graph(bid, rows, vocab, n_probs, window))
        raw = c.get_tensor(tensor(bid, logits.nbytes + packed.nbytes, DType.I32, (rows, 2 + 2 * n_probs)), 0,
                           rows * (2 + 2 * n_probs) * 4)
        got = bs.unpack(np.frombuffer(raw, np.int32).reshape(rows, -1))
        assert got.ids.tolist() == want.ids.tolist()
        assert got.probs.tolist() == want.probs.tolist()
        assert got.top_ids.tolist() == want.top_ids.tolist()
        for params, expect in [((n_probs, -1), "out of range"), ((5000, window), "out of range"),
                               ((n_probs + 0.5, window), "out of range"), ((n_probs, window + 1), "SAMPLE")]:
            c.send(Cmd.GRAPH_COMPUTE, _sample_graph(bid, rows, vocab, n_probs, window, params=params))
            status, msg = c.sync()
            assert status == P.STATUS_EARLIER_ERROR and expect in msg.decode(), (params, msg)
        c.send(Cmd.GRAPH_COMPUTE, _sample_graph(bid, rows, vocab, n_probs, window, out_dtype=DType.F32))
        status, msg = c.sync()
        assert status == P.STATUS_EARLIER_ERROR and "not I32" in msg.decode(), msg
        c.free(bid)
    with start_server(caps_mask=int(Cap.GET_TENSORS)) as st, Client(st.port) as c:
        bid = c.alloc(size)
        c.send(Cmd.GRAPH_COMPUTE, _sample_graph(bid, rows, vocab, n_probs, window))
        status, msg = c.sync()
        assert status == P.STATUS_EARLIER_ERROR and "BACKEND_SAMPLING" in msg.decode(), msg


@pytest.mark.parametrize("case", ["geglu", "attention softcap", "moe"])
def test_ops_behind_a_capability_are_refused_when_it_is_off(captured, case):
    """A server that does not advertise FAMILY_OPS / MOE_FFN (as an older build) refuses graphs
    that hold them, before anything runs, naming the capability."""
    def mutate(payload, ids, tensors, nodes):
        if case == "geglu":  # same shape contract as SWIGLU
            _u32(payload, _node_off(tensors, _find(nodes, Op.SWIGLU)), int(Op.GEGLU))
        elif case == "attention softcap":
            base = _node_off(tensors, _find(nodes, Op.ATTENTION)) + 12 + 40
            np.frombuffer(payload, "<f8", 1, base + 8 * 9)[:] = 30.0
        else:
            _u32(payload, _node_off(tensors, _find(nodes, Op.SWIGLU)), int(Op.MOE_FFN))
    expect = "MOE_FFN capability" if case == "moe" else "FAMILY_OPS capability"
    mask = 0xFFFF & ~int(Cap.FAMILY_OPS) & ~int(Cap.MOE_FFN)
    with start_server(caps_mask=mask) as st, Client(st.port) as c:
        assert not c.hello_reply[4] & (Cap.FAMILY_OPS | Cap.MOE_FFN)
        hostile_graph(c, captured, mutate, expect)
