"""How the client writes a message: small ones in one call (a frame in pieces lets another thread
take the GIL between the pieces and wakes the peer's loop once per piece), large ones piece by
piece (no copy of a weight's bytes); either way the peer gets the same bytes."""
from __future__ import annotations

import numpy as np

from pyllama.backend.rpc import RPCBackend
from pyllama.rpc import connection as rpc_connection
from pyllama.rpc.connection import Connection
from pyllama.ir.tensor import DType, Tensor


class _CountingSocket:
    """The connection's socket, counting sendall calls."""

    def __init__(self, sock):
        self._sock = sock
        self.sendalls = 0

    def sendall(self, data) -> None:
        self.sendalls += 1
        self._sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_small_messages_are_one_write_large_ones_arrive_whole(rpc_peer):
    conn = Connection(rpc_peer.endpoint)
    try:
        rpc = RPCBackend(conn)
        n_small, n_large = 256, (rpc_connection._JOIN_MAX // 4) + 1024  # floats
        buf = rpc.alloc_buffer((n_small + n_large) * 4, usage="compute")
        small = Tensor(DType.F32, (n_small,), "small", buf, 0)
        large = Tensor(DType.F32, (n_large,), "large", buf, n_small * 4)
        rng = np.random.default_rng(0)
        a = rng.standard_normal(n_small).astype(np.float32)
        b = rng.standard_normal(n_large).astype(np.float32)
        counting = _CountingSocket(conn.sock)
        conn.sock = counting
        rpc.set_tensor(small, a)
        assert counting.sendalls == 1
        counting.sendalls = 0
        rpc.set_tensor(large, b)
        assert counting.sendalls > 1  # header, then the parts as they are
        np.testing.assert_array_equal(rpc.get_tensor(small), a)
        np.testing.assert_array_equal(rpc.get_tensor(large), b)
        rpc.free_buffer(buf)
    finally:
        conn.close()
