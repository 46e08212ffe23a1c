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
from pyllama.rpc.connection import Connection
from pyllama.rpc_server import ServerThread
from pyllama.tensor import DType, Graph, Op, Tensor, node
from test_qmatmul import activations

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
            assert st.server.devices[0].backend.packed_weights() == 1, "the weight was not repacked"
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
