"""One connection to a llama.cpp `rpc-server` (ggml's RPC protocol), and telling the two kinds of
peer apart at connect.

The peer serves one client at a time and runs its commands in order, and replies in that order.
So a command holds the connection only while it writes (under the send lock, a replying command
also takes its place in the queue of replies), and its reply is read by its sender when every
earlier reply has been: one pipeline group can send its inputs and graph while another waits for
its results, and the peer runs them back to back. The peer reports no errors: it closes the
connection on a request it cannot serve (its own log says why), and this connection then fails
every later call (and every reply still awaited) with one message naming the command it died on.
"""
from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
from collections import deque
from typing import Optional, Sequence

import numpy as np

from ...obs import trace
from ...rpc.connection import RPCError, close_socket, configured_timeout, open_socket, parse_endpoint
from ...rpc.protocol import HEADER as PYLLAMA_HEADER, HELLO_REQ as PYLLAMA_HELLO_REQ, VERSION as PYLLAMA_VERSION
from . import protocol as P
from .protocol import GCmd

log = logging.getLogger(__name__)


class GGMLConnection:
    """A HELLO'd connection to one ggml rpc-server. Tensor records are rpc_tensor (protocol.RPC_TENSOR)."""

    def __init__(self, endpoint: str, timeout: Optional[float] = None):
        self.endpoint = endpoint
        self.timeout = timeout if timeout is not None else configured_timeout()
        self.sock = open_socket(endpoint, self.timeout)
        self._send_lock = threading.Lock()
        self._turn = threading.Condition()        # guards _replies: the replies awaited, in wire order
        self._replies: deque[Reply] = deque()
        self._reading = False                     # the first of them is being read
        self.broken: Optional[str] = None
        self.n_sent = self.bytes_out = self.n_replies = self.bytes_in = 0
        try:
            rep = self.call(GCmd.HELLO, P.hello_request())
            self.version = P.check_hello(endpoint, rep)
        except BaseException:
            self.close()
            raise

    def has(self, cap: object) -> bool:
        """Whether the peer offers one of pyllama's wire capabilities (rpc.protocol.Cap): llama.cpp's
        rpc-server has none of them (no busy time, no sampling, ...)."""
        return False

    def traffic(self) -> tuple[int, int, int]:
        """(replies read, bytes out, bytes in) since the connection opened."""
        return self.n_replies, self.bytes_out, self.bytes_in

    # --- the commands ---------------------------------------------------------------------------
    def device_count(self) -> int:
        return self._decode(P.decode_device_count, self.call(GCmd.DEVICE_COUNT))

    def device_memory(self, device: int) -> tuple[int, int]:
        """(free, total) bytes of one device."""
        return self._decode(P.decode_memory, self.call(GCmd.GET_DEVICE_MEMORY, P.U32.pack(device)))

    def alignment(self, device: int) -> int:
        return self._decode(P.decode_alignment, self.call(GCmd.GET_ALIGNMENT, P.U32.pack(device)))

    def max_size(self, device: int) -> int:
        return P.U64.unpack(self.call(GCmd.GET_MAX_SIZE, P.U32.pack(device)))[0]

    def alloc_buffer(self, device: int, size: int) -> tuple[int, int]:
        """(remote_ptr, size); (0, 0) when the device has no room."""
        rep = self.call(GCmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(device, size))
        return self._decode(P.decode_alloc, rep, size)

    def buffer_base(self, remote_ptr: int) -> int:
        return self._decode(P.decode_base, self.call(GCmd.BUFFER_GET_BASE, P.U64.pack(remote_ptr)), remote_ptr)

    def free_buffer(self, remote_ptr: int) -> None:
        self.call(GCmd.FREE_BUFFER, P.U64.pack(remote_ptr))

    def buffer_clear(self, remote_ptr: int, value: int = 0) -> None:
        self.call(GCmd.BUFFER_CLEAR, P.CLEAR_REQ.pack(remote_ptr, value))

    def set_tensor(self, rec: np.void, offset: int, data: bytes | memoryview) -> None:
        """One-way write of `data` at `offset` bytes into the tensor `rec` describes."""
        self.call(GCmd.SET_TENSOR, P.tensor_bytes(rec), P.U64.pack(offset), data, subj=_name(rec))

    def set_tensor_hash(self, rec: np.void, offset: int, fnv_hash: int) -> bool:
        """True when the peer's cache held bytes of that hash and wrote them (rpc-server -c)."""
        rep = self.call(GCmd.SET_TENSOR_HASH, P.tensor_bytes(rec), P.REGION.pack(offset, fnv_hash), subj=_name(rec))
        return self._decode(P.decode_bool, GCmd.SET_TENSOR_HASH, rep)

    def get_tensor(self, rec: np.void, offset: int, size: int, into: Optional[memoryview] = None) -> bytes:
        """`size` bytes at `offset` of the tensor; read straight into `into` when given."""
        return self.receive(self.ask_tensor(rec, offset, size), into)

    def ask_tensor(self, rec: np.void, offset: int, size: int) -> "Reply":
        """Sends a GET_TENSOR whose reply `receive` reads later (in its turn)."""
        got = self.send(GCmd.GET_TENSOR, P.tensor_bytes(rec), P.REGION.pack(offset, size), asked=size,
                        subj=_name(rec))
        assert got is not None
        return got

    def copy_tensor(self, src: np.void, dst: np.void) -> bool:
        rep = self.call(GCmd.COPY_TENSOR, P.tensor_bytes(src), P.tensor_bytes(dst), subj=_name(dst))
        return self._decode(P.decode_bool, GCmd.COPY_TENSOR, rep)

    def memset_tensor(self, rec: np.void, offset: int, size: int, value: int) -> None:
        self.call(GCmd.MEMSET_TENSOR, P.tensor_bytes(rec), P.MEMSET_TAIL.pack(offset, size, value), subj=_name(rec))

    def init_tensor(self, rec: np.void) -> None:
        self.call(GCmd.INIT_TENSOR, P.tensor_bytes(rec), subj=_name(rec))

    def graph_compute(self, device: int, nodes: Sequence[int], tensors: np.ndarray, subj: str = "") -> None:
        """One-way: the peer builds the graph of `nodes` from `tensors` and computes it, keeping it
        for GRAPH_RECOMPUTE on that device."""
        self.call(GCmd.GRAPH_COMPUTE, *P.graph_payload(device, nodes, tensors), subj=subj)

    def graph_recompute(self, device: int, subj: str = "") -> None:
        self.call(GCmd.GRAPH_RECOMPUTE, P.U32.pack(device), subj=subj)

    def _decode(self, decode, *args):
        """A reply's value checked by `decode`; one the protocol does not allow ends the connection
        (nothing more from that peer is believed)."""
        try:
            return decode(self.endpoint, *args)
        except P.GGMLProtocolError as exc:
            self._fail(str(exc))
            raise

    # --- the wire ---------------------------------------------------------------------------------
    def call(self, cmd: GCmd, *parts: bytes | memoryview, asked: int = 0, into: Optional[memoryview] = None,
             subj: str = "") -> bytes:
        """Sends one command; for a replying command waits for its reply, checks its size against
        the protocol before reading it, and returns it (b"" when read into `into`)."""
        reply = self.send(cmd, *parts, asked=asked, subj=subj)
        return self.receive(reply, into) if reply is not None else b""

    def send(self, cmd: GCmd, *parts: bytes | memoryview, asked: int = 0, subj: str = "") -> Optional["Reply"]:
        """Writes one command; returns the Reply to `receive` for a replying command (None for a
        one-way one). Every Reply sent must be received, in any thread: later replies wait for it."""
        size = sum(len(p) for p in parts)
        want = P.expected_reply(cmd, asked)
        t0 = trace.now() if trace.enabled else 0
        with self._send_lock:
            t_locked = trace.now() if t0 else 0
            if self.broken:
                raise RPCError(self.broken)
            try:
                self.sock.sendall(b"".join((P.HEADER.pack(int(cmd), size), *parts)))
            except TimeoutError:
                self._fail(f"{cmd.name}: could not send within {self.timeout:g} s")
                raise RPCError(self.broken) from None
            except OSError as exc:
                self._fail(f"the ggml peer at {self.endpoint} failed ({exc}) at {cmd.name} (an rpc-server closes "
                           "the connection on a request it cannot serve; its log says why)")
                raise RPCError(self.broken) from None
            self.n_sent += 1
            self.bytes_out += size + P.HEADER.size
            t_sent = trace.now() if t0 else 0
            reply = Reply(cmd, want, subj, size, t0, t_locked, t_sent) if want is not None else None
            if reply is not None:
                with self._turn:
                    self._replies.append(reply)
        if t0 and reply is None:
            trace.event("rpc.client", cmd.name, t0, trace.now(), endpoint=self.endpoint, peer="ggml",
                        bytes_out=size + P.HEADER.size, bytes_in=0, subj=subj, grp=trace.group(), t_enq=t0,
                        t_send0=t_locked, t_send1=t_sent, ok=True)
        return reply

    def receive(self, reply: "Reply", into: Optional[memoryview] = None) -> bytes:
        """The reply of a command `send` wrote, once every reply before it was read: its size
        checked against the protocol before it is read (into `into` when that is its size)."""
        cmd = reply.cmd
        with self._turn:
            idle_since = time.monotonic()
            while not self.broken and self._replies and self._replies[0] is not reply:
                if self._reading:          # an earlier reply is being read: that read is bounded
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > self.timeout:
                    self._fail(f"a reply before {cmd.name}'s was not read within {self.timeout:g} s")
                    break
                self._turn.wait(self.timeout)
            if self.broken:
                raise RPCError(self.broken)
            self._reading = True
        payload = b""
        try:
            got = P.U64.unpack(self._recv_exact(8))[0]
            t_head = trace.now() if reply.t0 else 0
            P.check_reply_size(self.endpoint, cmd, got, reply.want)
            if into is not None and len(into) == got:
                self._recv_into(into)
            else:
                payload = self._recv_exact(got)
            self.n_replies += 1
            self.bytes_in += got + 8
        except P.GGMLProtocolError as exc:
            self._fail(str(exc))
            raise
        except TimeoutError:
            self._fail(f"{cmd.name}: no reply within {self.timeout:g} s")
            raise RPCError(self.broken) from None
        except (OSError, EOFError) as exc:
            why = "closed the connection" if isinstance(exc, EOFError) else f"failed ({exc})"
            self._fail(f"the ggml peer at {self.endpoint} {why} at {cmd.name} (an rpc-server closes "
                       "the connection on a request it cannot serve; its log says why)")
            raise RPCError(self.broken) from None
        finally:
            with self._turn:
                self._reading = False
                if self._replies and self._replies[0] is reply:
                    self._replies.popleft()
                self._turn.notify_all()
        if reply.t0:
            trace.event("rpc.client", cmd.name, reply.t0, trace.now(), endpoint=self.endpoint, peer="ggml",
                        bytes_out=reply.size + P.HEADER.size, bytes_in=reply.want + 8, subj=reply.subj,
                        grp=trace.group(), t_enq=reply.t0, t_send0=reply.t_locked, t_send1=reply.t_sent, ok=True,
                        t_recv0=t_head, t_recv1=trace.now())
        return payload

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self._recv_into(memoryview(buf))
        return bytes(buf)

    def _recv_into(self, view: memoryview) -> None:
        got, n = 0, len(view)
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise EOFError
            got += k

    def check_peer(self) -> Optional[str]:
        """Why the connection is unusable, or None; notices a peer that closed it while idle (the
        socket reads as closed) without waiting for the next command."""
        if self.broken:
            return self.broken
        try:
            ready, _, _ = select.select([self.sock], [], [], 0)
            with self._turn:
                idle = not self._replies    # nobody awaits a reply: what is readable is the peer closing
                if ready and idle and self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    self._fail(f"the ggml peer at {self.endpoint} closed the connection")
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._fail(f"the ggml peer at {self.endpoint} is gone ({exc})")
        return self.broken

    def _fail(self, why: str) -> None:
        if not self.broken:
            self.broken = why
            log.error("%s", why)
        self._close_socket()
        with self._turn:                # every reply still awaited fails with it
            self._turn.notify_all()

    def close(self) -> None:
        if not self.broken:
            self.broken = f"the connection to the ggml peer at {self.endpoint} is closed"
        self._close_socket()

    def _close_socket(self) -> None:
        close_socket(self.sock)


class Reply:
    """A sent command's reply to come: what `receive` checks and traces."""
    __slots__ = ("cmd", "want", "subj", "size", "t0", "t_locked", "t_sent")

    def __init__(self, cmd: GCmd, want: int, subj: str, size: int, t0: int, t_locked: int, t_sent: int):
        self.cmd, self.want, self.subj, self.size = cmd, want, subj, size
        self.t0, self.t_locked, self.t_sent = t0, t_locked, t_sent


def _name(rec: np.void) -> str:
    return bytes(rec["name"]).rstrip(b"\0").decode("utf-8", "replace")


# --- which kind of peer ---------------------------------------------------------------------------
PYLLAMA, GGML = "pyllama", "ggml"
_kinds: dict[str, str] = {}     # endpoint -> the kind identify found there (a reconnect asks no more)


def known_kind(endpoint: str) -> Optional[str]:
    return _kinds.get(endpoint)


def identify(endpoint: str, timeout: Optional[float] = None) -> tuple[str, tuple[int, int, int]]:
    """("pyllama" | "ggml", its protocol version) of the peer at `endpoint`, from a HELLO of each
    kind on fresh connections: pyllama's first (its peers are the common case; a ggml peer closes
    at once on it, reading one byte), ggml's when that one was refused without a reply. Each waits
    at most `timeout` (default: the RPC timeout); a peer that does not answer pyllama's HELLO in
    that time is not asked again. Raises RPCError naming both attempts when neither answers as its
    protocol says."""
    timeout = timeout if timeout is not None else configured_timeout()
    host, port = parse_endpoint(endpoint)
    try:
        version = _pyllama_hello(host, port, timeout)
        _kinds[endpoint] = PYLLAMA
        return PYLLAMA, version
    except _NotThisKind as exc:
        first = str(exc)
    try:   # (a version refusal, GGMLProtocolError, is not an RPCError: it goes up as it is)
        conn = GGMLConnection(endpoint, timeout)
    except RPCError as exc:
        raise RPCError(f"the peer at {endpoint} answers neither pyllama's RPC protocol ({first}) nor "
                       f"ggml's ({exc})") from None
    version = conn.version
    conn.close()
    _kinds[endpoint] = GGML
    return GGML, version


class _NotThisKind(Exception):
    pass


def _pyllama_hello(host: str, port: int, timeout: float) -> tuple[int, int, int]:
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise RPCError(f"cannot connect to the RPC server at {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.settimeout(timeout)
        sock.sendall(PYLLAMA_HEADER.pack(0, PYLLAMA_HELLO_REQ.size) + PYLLAMA_HELLO_REQ.pack(*PYLLAMA_VERSION, 0))
        head = _read(sock, PYLLAMA_HEADER.size)
        status, size = PYLLAMA_HEADER.unpack(head)
        if status != 0 or size > 64:
            raise _NotThisKind(f"status {status}, {size} bytes")
        body = _read(sock, size)
        if len(body) < 3:
            raise _NotThisKind("a short HELLO reply")
        return struct.unpack_from("<BBB", body)
    except TimeoutError:
        raise RPCError(f"RPC peer {host}:{port} is not answering (no HELLO reply within {timeout:g} s)") from None
    except (OSError, EOFError) as exc:
        raise _NotThisKind("the peer closed the connection" if isinstance(exc, (EOFError, ConnectionError))
                           else str(exc)) from None
    finally:
        sock.close()


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)
