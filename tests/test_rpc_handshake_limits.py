"""Connections that never complete the handshake: closed after a deadline, limited in number, and
holding only a small receive buffer until they have said HELLO (and proven the token)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.rpc import protocol as P
from pyllama.rpc.protocol import Cmd
from pyllama.rpc_server import ServerThread
from pyllama.rpc_server.server import HANDSHAKE_RX
from rpc_client import RawClient
from test_rpc_server import Client

TOKEN = b"0123456789abcdef0123456789abcdef"


def _server(**kw) -> ServerThread:
    st = ServerThread(port=0, backend_factory=lambda: CPUBackend(1), **kw)
    st.start()
    return st


def _wait_connections(st: ServerThread, n: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while st.server.connections != n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert st.server.connections == n


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
def test_a_connection_that_does_not_finish_the_handshake_is_closed(token):
    with _server(handshake_timeout=0.3, token=token) as st:
        silent = socket.create_connection(("127.0.0.1", st.port))
        half = Client(st.port, hello=False)
        half.send(Cmd.HELLO, P.HELLO_REQ.pack(*P.VERSION, 0))
        assert half.reply()[0] == P.STATUS_OK
        done = RawClient(st.port, token=token)
        try:
            silent.settimeout(5.0)
            assert silent.recv(4096).startswith(bytes([P.STATUS_ERROR]))  # says why, then closes
            if token is not None:  # HELLO alone does not authenticate
                status, msg = half.reply()
                assert status == P.STATUS_ERROR and b"handshake" in msg and half.closed_by_server()
            _wait_connections(st, 1 if token is not None else 2)
            # a connection that completed it stays past the deadline
            assert done.ok(Cmd.DEVICE_COUNT) == P.U32.pack(1)
            if token is None:
                assert half.ok(Cmd.DEVICE_COUNT) == P.U32.pack(1)
        finally:
            silent.close()
            half.close()
            done.close()


def test_connections_are_limited_and_the_limit_frees_up():
    with _server(max_connections=2, handshake_timeout=30.0) as st:
        a, b = RawClient(st.port), socket.create_connection(("127.0.0.1", st.port))
        _wait_connections(st, 2)
        extra = Client(st.port, hello=False)
        status, msg = extra.call(Cmd.HELLO, P.HELLO_REQ.pack(*P.VERSION, 0))
        assert status == P.STATUS_ERROR and b"--max-connections" in msg and extra.closed_by_server()
        extra.close()
        b.close()
        _wait_connections(st, 1)
        with RawClient(st.port) as c:
            assert c.ok(Cmd.DEVICE_COUNT) == P.U32.pack(1)
        assert a.ok(Cmd.DEVICE_COUNT) == P.U32.pack(1)
        a.close()


def test_the_receive_buffer_is_small_until_the_handshake_is_done():
    def rx_sizes(st):
        return sorted(st.call(lambda: [len(c._rx) for c in st.server._conns]))

    with _server(token=TOKEN) as st:
        idle = [socket.create_connection(("127.0.0.1", st.port)) for _ in range(3)]
        hello_only = Client(st.port, hello=False)
        hello_only.ok(Cmd.HELLO, P.HELLO_REQ.pack(*P.VERSION, 0))
        _wait_connections(st, 4)
        assert rx_sizes(st) == [HANDSHAKE_RX] * 4
        with RawClient(st.port, token=TOKEN) as c:
            assert c.ok(Cmd.DEVICE_COUNT) == P.U32.pack(1)
            assert max(rx_sizes(st)) > HANDSHAKE_RX  # an authenticated connection gets the full one
            bid = P.ALLOC_REP.unpack(c.ok(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 0, 1 << 16)))[0]
            assert bid
        for s in idle:
            s.close()
        hello_only.close()


def test_flags_and_their_environment_variables(tmp_path):
    env = {**os.environ, "PYLLAMA_RPC_SERVER_ARG_MAX_CONNECTIONS": "0"}
    p = subprocess.run([sys.executable, "-m", "pyllama.rpc_server", "--port", "0"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == 1 and "--max-connections" in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "pyllama.rpc_server", "--port", "0", "--handshake-timeout", "-1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "--handshake-timeout" in p.stderr and "Traceback" not in p.stderr, p.stderr
    h = subprocess.run([sys.executable, "-m", "pyllama.rpc_server", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert "--handshake-timeout" in h.stdout and "--max-connections" in h.stdout
