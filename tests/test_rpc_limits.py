"""What a client can make the rpc server hold, and what it computes with after a write: --mem caps
replies, kernel scratch and repacked weight copies as well as buffers (refused before allocating,
the server serving on), and every write of a weight's bytes drops its repacked copy."""
from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import quant_reference as ref
from pyllama._fast import qmatmul
from pyllama.backend.cpu import CPUBackend
from pyllama.backend.rpc import RPCBackend
from pyllama.rpc import protocol as P
from pyllama.rpc.connection import Connection, RPCError
from pyllama.rpc.protocol import Cmd
from pyllama.rpc_server import ServerThread
from pyllama.ir.tensor import DType, Graph, Op, Tensor, node
from rpc_client import RawClient
from test_qmatmul import activations
from test_rpc_server import tensor

needs_x8 = pytest.mark.skipif(int(T.Q8_0) not in qmatmul.x8_types(), reason="this build has no repacked kernels")


def _server(**kw) -> ServerThread:
    kw.setdefault("backend_factory", lambda: CPUBackend(2))
    st = ServerThread(port=0, **kw)
    st.start()
    return st


@needs_x8
def test_set_tensor_hash_drops_the_repacked_copy(tmp_path):
    """A weight overwritten from the server's cache (SET_TENSOR_HASH) computes with its new bytes,
    not with the repacked copy of the old ones."""
    rng = np.random.default_rng(11)
    m, k, n = 256, 4096, 2  # a Q8_0 weight of 1.1 MB: large enough for the hash path
    w_old, w_new = (ref.random_weights(T.Q8_0, m, k, rng) for _ in range(2))
    x = activations(n, k, rng)
    with _server(cache_dir=str(tmp_path / "cache")) as st:
        conn = Connection(f"127.0.0.1:{st.port}")
        try:
            rpc = RPCBackend(conn)
            # the cache learns w_new's bytes from an upload of them into a scratch weight buffer
            spare = rpc.alloc_buffer(w_new.nbytes, usage="weights")
            rpc.set_tensor(Tensor(DType.Q8_0, (m, k), "spare", spare, 0), w_new)
            rpc.synchronize()
            wbuf = rpc.alloc_buffer(w_old.nbytes, usage="weights")
            abuf = rpc.alloc_buffer(4 * (n * k + n * m), usage="compute")
            wt = Tensor(DType.Q8_0, (m, k), "w", wbuf, 0)
            xt = Tensor(DType.F32, (n, k), "x", abuf, 0)
            ot = Tensor(DType.F32, (n, m), "out", abuf, 4 * n * k)
            rpc.set_tensor(wt, w_old)
            rpc.set_tensor(xt, x)
            g = Graph([node(Op.MUL_MAT, ot, xt, wt)])
            rpc.graph_compute(g)
            before = rpc.get_tensor(ot)
            assert st.server.devices[0].backend.layout.packed_weights() == 1, "the weight was not repacked"
            digest = hashlib.sha256(w_new.tobytes()).digest()
            deadline = time.monotonic() + 10
            while not os.path.exists(st.server.cache.path(digest)) and time.monotonic() < deadline:
                time.sleep(0.02)  # the cache writes in the background
            sent = []
            real_call = conn.call
            conn.call = lambda cmd, *a, **kw: (sent.append(cmd), real_call(cmd, *a, **kw))[1]
            rpc.set_tensor(wt, w_new)  # a cache hit: the bytes come from the server's cache
            conn.call = real_call
            assert sent and sent[-1].name == "SET_TENSOR_HASH"
            assert rpc.get_tensor(wt).tobytes() == w_new.tobytes()
            rpc.graph_compute(g)
            after = rpc.get_tensor(ot)
            want = np.empty((n, m), np.float32)
            qmatmul.mul_mat_q_x8(x, qmatmul.repack_x8(w_new, int(T.Q8_0), k), int(T.Q8_0), want)
            assert not np.array_equal(before, want)
            np.testing.assert_array_equal(after, want)
        finally:
            conn.close()


# --- --mem caps what a client makes the server hold, not only its buffers -----------------------------

def _still_serves(st: ServerThread) -> None:
    """A well-behaved connection allocates, writes and reads back; nothing stayed held."""
    with RawClient(st.port) as c:
        bid = P.ALLOC_REP.unpack(c.ok(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 0, 4096)))[0]
        t = tensor(bid, 0, shape=(16,))
        data = np.arange(16, dtype=np.float32).tobytes()
        c.send(Cmd.SET_TENSOR, t + P.U64.pack(0) + data)
        assert c.ok(Cmd.GET_TENSOR, t + P.REGION.pack(0, 64)) == data
        c.ok(Cmd.FREE_BUFFER, P.U64.pack(bid))


def _entries(rec: bytes, count: int, size: int) -> bytes:
    return P.U32.pack(count) + (rec + P.REGION.pack(0, size)) * count


def test_a_get_tensors_reply_over_the_cap_is_refused_before_it_is_built():
    with _server(mem_limit=1 << 20) as st:
        with RawClient(st.port) as c:
            bid = P.ALLOC_REP.unpack(c.ok(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 0, 64 << 10)))[0]
            rec = tensor(bid, 0, DType.F32, (16 << 10,), "kv")
            msg = c.error(Cmd.GET_TENSORS, _entries(rec, 8192, 64 << 10))  # a 512 MiB reply
            assert "memory cap" in msg and "GET_TENSORS" in msg
            assert len(c.ok(Cmd.GET_TENSORS, _entries(rec, 4, 64 << 10))) == 256 << 10  # within the cap: served
            c.ok(Cmd.FREE_BUFFER, P.U64.pack(bid))
        _still_serves(st)
        assert st.server.devices[0].held == 0


def test_kernel_scratch_over_the_cap_is_refused_before_the_graph_runs():
    """A MOE_FFN over 1.8 MiB of buffers whose kernel would need 130 MiB of scratch."""
    n, cols, n_exp, f = 4096, 32, 64, 32
    shapes = dict(x=(n, cols), r=(n_exp, cols), g=(n_exp, f, cols), u=(n_exp, f, cols), d=(n_exp, cols, f),
                  o=(n, cols))
    with _server(mem_limit=8 << 20) as st:
        conn = Connection(f"127.0.0.1:{st.port}")
        try:
            rpc = RPCBackend(conn)
            buf = rpc.alloc_buffer(sum(4 * int(np.prod(s)) for s in shapes.values()))
            ts, off = {}, 0
            for name, shape in shapes.items():
                ts[name] = Tensor(DType.F32, shape, name, buf, off)
                off += 4 * int(np.prod(shape))
            rng = np.random.default_rng(3)
            for name in "xrgud":
                rpc.set_tensor(ts[name], rng.standard_normal(shapes[name]).astype(np.float32))
            g = Graph([node(Op.MOE_FFN, ts["o"], ts["x"], ts["r"], ts["g"], ts["u"], ts["d"], params=(n_exp, 1, 1.0))])
            rpc.graph_compute(g)
            with pytest.raises(RPCError, match="memory cap") as err:
                rpc.synchronize()
            assert "scratch" in str(err.value)
            rpc.free_buffer(buf)
        finally:
            conn.close()
        _still_serves(st)
        assert st.server.devices[0].held == 0


@needs_x8
def test_repacked_copies_count_against_the_cap_and_one_is_shared_per_weight():
    """Views of one weight: the same view twice shares one repacked copy; overlapping views at
    other offsets would each need their own, and past the cap they run on the file's layout
    instead (same products, within the kernels' bound); a view of another shape with as many bytes
    gets a copy of its own shape."""
    rng = np.random.default_rng(5)
    m, k, n = 256, 4096, 2
    w = ref.random_weights(T.Q8_0, m, k, rng)
    x = activations(n, k, rng)
    row = w.nbytes // m
    views = 16
    with _server(mem_limit=6 << 20) as st:
        dev = st.server.devices[0]
        conn = Connection(f"127.0.0.1:{st.port}")
        try:
            rpc = RPCBackend(conn)
            wbuf = rpc.alloc_buffer(w.nbytes, usage="weights")
            abuf = rpc.alloc_buffer(4 * n * k + 4 * n * 128 * (views + 2), usage="compute")
            rpc.set_tensor(Tensor(DType.Q8_0, (m, k), "w", wbuf, 0), w)
            xt = Tensor(DType.F32, (n, k), "x", abuf, 0)
            rpc.set_tensor(xt, x)
            outs, nodes = [], []
            for i in range(views):  # 128-row views, 8 rows apart: 16 x 557 KB of copies
                wt = Tensor(DType.Q8_0, (128, k), f"w{i}", wbuf, 8 * i * row)
                ot = Tensor(DType.F32, (n, 128), f"o{i}", abuf, 4 * n * k + 4 * n * 128 * i)
                nodes.append(node(Op.MUL_MAT, ot, xt, wt))
                outs.append((ot, w[8 * i:8 * i + 128]))
            same = Tensor(DType.Q8_0, (128, k), "w0 again", wbuf, 0)
            ot = Tensor(DType.F32, (n, 128), "again", abuf, 4 * n * k + 4 * n * 128 * views)
            nodes.append(node(Op.MUL_MAT, ot, xt, same))
            outs.append((ot, w[:128]))
            rpc.graph_compute(Graph(nodes))
            rpc.synchronize()
            packed = dev.backend.layout.packed_weights()
            assert 1 <= packed < views, packed
            assert dev.allocated + dev.held <= dev.mem_limit
            for ot, wv in outs:
                want = np.empty((n, 128), np.float32)
                qmatmul.mul_mat_q(x, np.ascontiguousarray(wv), int(T.Q8_0), want)
                np.testing.assert_allclose(rpc.get_tensor(ot), want, rtol=0, atol=np.abs(want).max() * 1e-5)
            # as many bytes, another shape: [256, 2048] over the first half's bytes is not [128, 4096]
            other = Tensor(DType.Q8_0, (256, k // 2), "w as 2048 cols", wbuf, 0)
            ot2 = Tensor(DType.F32, (n, 256), "o2", abuf, 0)
            x2 = Tensor(DType.F32, (n, k // 2), "x2", abuf, 4 * n * k + 4 * n * 128 * (views + 1) - 4 * n * k // 2)
            xs = activations(n, k // 2, rng)
            rpc.set_tensor(x2, xs)
            rpc.graph_compute(Graph([node(Op.MUL_MAT, ot2, x2, other)]))
            want = np.empty((n, 256), np.float32)
            qmatmul.mul_mat_q(xs, np.ascontiguousarray(w[:128]).reshape(256, -1), int(T.Q8_0), want)
            np.testing.assert_allclose(rpc.get_tensor(ot2), want, rtol=0, atol=np.abs(want).max() * 1e-5)
            rpc.free_buffer(wbuf)
            rpc.free_buffer(abuf)
        finally:
            conn.close()
        _still_serves(st)
        assert dev.held == 0 and dev.backend.layout.packed_weights() == 0


@needs_x8
def test_a_graph_writing_over_a_weight_drops_its_repacked_copy():
    """No real graph writes where a weight lies, but one may: the next product must use the bytes
    the weight holds then, not a repacked copy of what it held before."""
    rng = np.random.default_rng(12)
    m, k, n = 8, 256, 2
    w = ref.random_weights(T.Q8_0, m, k, rng)
    floats = w.nbytes // 4
    x = activations(n, k, rng)
    with _server() as st:
        conn = Connection(f"127.0.0.1:{st.port}")
        try:
            rpc = RPCBackend(conn)
            wbuf = rpc.alloc_buffer(w.nbytes, usage="weights")
            abuf = rpc.alloc_buffer(4 * (n * k + n * m + 2 * floats))
            wt = Tensor(DType.Q8_0, (m, k), "w", wbuf, 0)
            xt = Tensor(DType.F32, (n, k), "x", abuf, 0)
            ot = Tensor(DType.F32, (n, m), "out", abuf, 4 * n * k)
            a = Tensor(DType.F32, (floats,), "a", abuf, 4 * (n * k + n * m))
            b = Tensor(DType.F32, (floats,), "b", abuf, 4 * (n * k + n * m + floats))
            over = Tensor(DType.F32, (floats,), "over the weight", wbuf, 0)
            rpc.set_tensor(wt, w)
            rpc.set_tensor(xt, x)
            rpc.set_tensor(a, np.full(floats, 0.5, np.float32))
            rpc.set_tensor(b, np.full(floats, 0.25, np.float32))
            product = Graph([node(Op.MUL_MAT, ot, xt, wt)])
            rpc.graph_compute(product)
            before = rpc.get_tensor(ot)
            rpc.graph_compute(Graph([node(Op.ADD, over, a, b)]))  # every weight byte changes
            rpc.graph_compute(product)
            after = rpc.get_tensor(ot)
            now = rpc.get_tensor(wt).reshape(m, -1)
            assert now.tobytes() != w.tobytes()
            want = np.empty((n, m), np.float32)
            qmatmul.mul_mat_q_x8(x, qmatmul.repack_x8(now, int(T.Q8_0), k), int(T.Q8_0), want)
            assert not np.array_equal(before, want)
            np.testing.assert_array_equal(after, want)
        finally:
            conn.close()
