"""A client connection to one rpc_server endpoint, shared by every user in the process.

Whole messages are written under the send lock, and each replying command takes a ticket there;
replies are read in ticket order by the thread whose turn it is, so a thread waiting for its reply
holds no lock and other threads keep sending. Errors of one-way commands come back with the next
reply (status 2). A broken connection fails every waiter and every later call with one clear error.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Optional, Sequence

from ..errors import PyllamaError
from . import stats
from .protocol import (HEADER, HELLO_REP, HELLO_REQ, ONE_WAY, STATUS_OK, VERSION, Cap, Cmd)

log = logging.getLogger(__name__)

_connections: dict[str, "Connection"] = {}
_connections_lock = threading.Lock()


class RPCError(PyllamaError):
    """A failed RPC command or a lost peer."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PyllamaError(f"bad RPC endpoint '{endpoint}': expected host:port")
    return host.strip("[]"), int(port)


def get_connection(endpoint: str) -> "Connection":
    """The one connection of this process to `endpoint` (opened on first use)."""
    with _connections_lock:
        conn = _connections.get(endpoint)
        if conn is None or conn.broken:
            conn = Connection(endpoint)
            _connections[endpoint] = conn
        return conn


def close_all() -> None:
    with _connections_lock:
        for conn in _connections.values():
            conn.close()
        _connections.clear()


class Connection:
    def __init__(self, endpoint: str, timeout: Optional[float] = None):
        self.endpoint = endpoint
        host, port = parse_endpoint(endpoint)
        self.timeout = timeout if timeout is not None else float(os.environ.get("PYLLAMA_RPC_TIMEOUT", "120"))
        try:
            self.sock = socket.create_connection((host, port), timeout=min(self.timeout, 10.0))
        except OSError as exc:
            raise RPCError(f"cannot connect to the RPC server at {endpoint}: {exc.strerror or exc}") from None
        self.sock.settimeout(self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_lock = threading.Lock()
        self._turn = threading.Condition()
        self._next_ticket = 0
        self._next_reply = 0
        self.broken: Optional[str] = None
        self.last_graph: dict[int, int] = {}  # device -> uid of the last graph sent (guarded by the send lock)
        self.send_lock = self._send_lock
        rep = self.call(Cmd.HELLO, HELLO_REQ.pack(*VERSION, 0))
        if len(rep) != HELLO_REP.size:
            raise RPCError(f"{endpoint}: malformed HELLO reply")
        major, minor, patch, _, caps, server_id = HELLO_REP.unpack(rep)
        self.server_version = (major, minor, patch)
        self.caps = Cap(caps)
        self.server_id = server_id

    def has(self, cap: Cap) -> bool:
        return bool(self.caps & cap)

    # ------------------------------------------------------------------------------------------
    def send(self, cmd: Cmd, parts: Sequence[bytes | memoryview], locked: bool = False) -> Optional[int]:
        """Writes one whole message; returns its reply ticket (None for one-way commands).
        With locked=True the caller already holds the send lock."""
        size = sum(len(p) for p in parts)
        if not locked:
            self._send_lock.acquire()
        try:
            self._check()
            ticket = None
            if cmd not in ONE_WAY:
                ticket = self._next_ticket
                self._next_ticket += 1
            try:
                self.sock.sendall(HEADER.pack(int(cmd), size))
                for p in parts:
                    self.sock.sendall(p)
            except OSError as exc:
                self._fail(f"send failed: {exc}")
                raise RPCError(self.broken) from None
        finally:
            if not locked:
                self._send_lock.release()
        if stats.enabled:
            stats.record(cmd.name, size + HEADER.size, 0)
        return ticket

    def receive(self, ticket: int, cmd: Cmd, into: Optional[memoryview] = None) -> bytes:
        """Waits for the reply of `ticket` (replies come in ticket order); holds no send lock."""
        with self._turn:
            while self._next_reply != ticket and not self.broken:
                self._turn.wait()
        self._check()
        try:
            head = self._recv_exact(HEADER.size)
            status, size = HEADER.unpack(head)
            if status != STATUS_OK or into is None or size != len(into):
                payload = self._recv_exact(size)
            else:
                self._recv_into(into)
                payload = b""
        except (OSError, RPCError) as exc:
            self._fail(f"receive failed: {exc}")
            raise RPCError(self.broken) from None
        finally:
            with self._turn:
                self._next_reply += 1
                self._turn.notify_all()
        if stats.enabled:
            stats.record(cmd.name, 0, size + HEADER.size, count=0)
        if status != STATUS_OK:
            raise RPCError(f"{self.endpoint}: {cmd.name} failed: {payload.decode('utf-8', 'replace')}")
        return payload

    def call(self, cmd: Cmd, *parts: bytes | memoryview, into: Optional[memoryview] = None) -> bytes:
        ticket = self.send(cmd, parts)
        if ticket is None:
            return b""
        return self.receive(ticket, cmd, into)

    # ------------------------------------------------------------------------------------------
    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self._recv_into(memoryview(buf))
        return bytes(buf)

    def _recv_into(self, view: memoryview) -> None:
        got = 0
        n = len(view)
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise RPCError("the peer closed the connection")
            got += k

    def _check(self) -> None:
        if self.broken:
            raise RPCError(self.broken)

    def _fail(self, why: str) -> None:
        self._shut(f"RPC peer {self.endpoint} is gone ({why})", log.error)

    def close(self) -> None:
        self._shut(f"RPC connection to {self.endpoint} closed", log.debug)

    def _shut(self, reason: str, say) -> None:
        """Marks the connection broken (the first reason wins) and wakes every waiting thread."""
        if not self.broken:
            self.broken = reason
            say("%s", reason)
            try:
                self.sock.close()
            except OSError:
                pass
        with self._turn:
            self._turn.notify_all()
