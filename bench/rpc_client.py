"""A raw frame client of the RPC wire for tests and the wire fuzzer: it sends exactly the bytes it
is given and reads replies as they come, with none of pyllama.rpc.connection's checks."""
from __future__ import annotations

import socket
from typing import Optional

from pyllama.rpc import auth
from pyllama.rpc import protocol as P
from pyllama.rpc.protocol import Cmd


def cmd_name(code: int) -> str:
    try:
        return Cmd(code).name
    except ValueError:
        return f"CMD_{code}"


class StatusError(AssertionError):
    """A reply whose status was not the expected one."""


class RawClient:
    """One connection to an rpc server on loopback; with hello, the HELLO (and, given a token,
    the AUTH exchange) is done at once."""

    def __init__(self, port: int, hello: bool = True, timeout: float = 10.0, token: Optional[bytes] = None):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.hello_reply = None
        if hello:
            self.hello_reply = P.HELLO_REP.unpack(self.ok(Cmd.HELLO, P.HELLO_REQ.pack(*P.VERSION, 0)))
            if token is not None:
                cn = auth.new_nonce()
                rep = self.ok(Cmd.AUTH, bytes([auth.STEP_BEGIN]) + cn)
                self.ok(Cmd.AUTH, bytes([auth.STEP_PROVE]) + auth.client_proof(token, cn, rep[:auth.NONCE]))

    def __enter__(self) -> "RawClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, cmd: int, payload: bytes = b"") -> None:
        self.sock.sendall(P.HEADER.pack(int(cmd), len(payload)) + payload)

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("closed by the server")
            buf += chunk
        return bytes(buf)

    def reply(self) -> tuple[int, bytes]:
        status, size = P.HEADER.unpack(self.recv_exact(P.HEADER.size))
        return status, self.recv_exact(size)

    def call(self, cmd: int, payload: bytes = b"") -> tuple[int, bytes]:
        self.send(cmd, payload)
        return self.reply()

    def ok(self, cmd: int, payload: bytes = b"") -> bytes:
        status, data = self.call(cmd, payload)
        if status != P.STATUS_OK:
            raise StatusError(f"{cmd_name(cmd)}: status {status}: {data[:200].decode(errors='replace')}")
        return data

    def error(self, cmd: int, payload: bytes = b"", status: int = P.STATUS_ERROR) -> str:
        got, data = self.call(cmd, payload)
        if got != status:
            raise StatusError(f"{cmd_name(cmd)}: expected status {status}, got {got} {data[:200]!r}")
        return data.decode()
