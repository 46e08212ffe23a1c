"""A client connection to one rpc_server endpoint, shared by every user in the process.

Whole messages are written under the send lock, and each replying command takes a ticket there;
replies are read in ticket order by the thread whose turn it is, so a thread waiting for its reply
holds no lock and other threads keep sending. Errors of one-way commands come back with the next
reply (status 2). A broken connection fails every waiter and every later call with one clear error.

Every blocking socket operation is bounded by the RPC timeout (`set_timeout`, else
$PYLLAMA_RPC_TIMEOUT, else 120 s): a whole send, each wait for reply bytes, and each wait for a
turn to read (a reply that nobody reads or cancels for that long breaks the connection: its owner
failed without `cancel`). A peer that stops answering therefore breaks the connection after at
most that long, TCP keepalive notices a vanished idle peer within about as long, and breaking the
connection (or closing it) wakes every thread waiting on it at once. A broken connection stays
broken: a later `get_connection` opens a new one to the same endpoint.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
import weakref
from typing import Optional, Sequence

from ..obs import trace
from ..util.settings import current
from ..util.errors import PyllamaError
from . import auth
from ..obs import rpc_stats as stats
from .keepalive import enable_keepalive
from .staging import StagingArena, arena_size
from .protocol import (HEADER, HELLO_REP, HELLO_REQ, ONE_WAY, SESSION_KEY_SIZE, STATUS_EARLIER_ERROR, STATUS_OK,
                       TRACE_REP, U32, U64, VERSION, Cap, Cmd)

log = logging.getLogger(__name__)

_connections: dict[str, "Connection"] = {}
_connections_lock = threading.Lock()
_token: Optional[bytes] = None
_token_set = False
_timeout: Optional[float] = None
_PEER_CLOSED = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
_JOIN_MAX = 64 << 10  # a message up to this size is written with one call (joined into one bytes)


def set_token(token: Optional[bytes]) -> None:
    """The token later connections prove (None: none); without a call, $PYLLAMA_RPC_TOKEN."""
    global _token, _token_set
    _token, _token_set = token, True


def configured_token() -> Optional[bytes]:
    return _token if _token_set else auth.read_token(None, "")


def set_timeout(seconds: Optional[float]) -> None:
    """The RPC timeout of later connections (None: $PYLLAMA_RPC_TIMEOUT, else 120 s)."""
    global _timeout
    if seconds is not None and not (seconds > 0 and seconds != float("inf")):
        raise PyllamaError(f"RPC timeout {seconds}: must be a positive number of seconds")
    _timeout = seconds


def configured_timeout() -> float:
    if _timeout is not None:
        return _timeout
    return current().rpc.timeout_s


class RPCError(PyllamaError):
    """A failed RPC command or a lost peer."""


def open_socket(endpoint: str, timeout: float) -> socket.socket:
    """A TCP connection to a peer: every blocking operation bounded by `timeout`, no Nagle delay,
    keepalive so that a half-open idle peer is noticed within about the timeout."""
    host, port = parse_endpoint(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=min(timeout, 10.0))
    except OSError as exc:
        raise RPCError(f"cannot connect to the RPC server at {endpoint}: {exc.strerror or exc}") from None
    sock.settimeout(timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    enable_keepalive(sock, timeout)
    return sock


def close_socket(sock: socket.socket) -> None:
    """Shuts the socket down, which wakes a thread blocked on it at once (close alone would not),
    then closes it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PyllamaError(f"bad RPC endpoint '{endpoint}': expected host:port")
    return host.strip("[]"), int(port)


def get_connection(endpoint: str) -> "Connection":
    """The one connection of this process to `endpoint`, opened when there is none or the last one
    broke. The handshake runs outside the registry's lock: a peer that accepts but never answers
    holds up only the caller, for at most the RPC timeout."""
    with _connections_lock:
        conn = _connections.get(endpoint)
        if conn is not None and not conn.broken:
            return conn
    fresh = Connection(endpoint)
    with _connections_lock:
        conn = _connections.get(endpoint)
        if conn is not None and not conn.broken:  # another thread got there first
            extra, fresh = fresh, conn
            extra.close()
        else:
            _connections[endpoint] = fresh
        return fresh


def close_all() -> None:
    with _connections_lock:
        conns = list(_connections.values())
        _connections.clear()
    for conn in conns:
        conn.close()


class _SendLock:
    """The connection's send lock as a context manager whose wait is bounded (acquire_send)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: "Connection"):
        self._conn = conn

    def __enter__(self) -> None:
        self._conn.acquire_send()

    def __exit__(self, *exc) -> None:
        self._conn.release_send()


class Connection:
    """One TCP connection to an rpc server. The first one to an endpoint holds the session (the
    buffers); with the LANES capability `open_lane` gives further connections bound to it, one per
    pipeline group, so the peer runs each group's commands on an executor of their own."""

    def __init__(self, endpoint: str, timeout: Optional[float] = None, session: Optional["Connection"] = None):
        self.endpoint = endpoint
        # a lane: the session's first connection (its buffers, its staging); else None
        self.session = session
        self.lanes: "weakref.WeakSet[Connection]" = weakref.WeakSet()  # a session's: its open lanes
        self.lane = 0 if session is None else session._lane_number()  # names the lane in traces
        self._lanes_opened = 0
        self._key: Optional[bytes] = None
        # one-way commands sent, and how many of them the peer has run (known from a later reply):
        # a lane's command waits for the session's writes (fence)
        self.one_way_sent = 0
        self.one_way_done = 0
        self._one_way_before: dict[int, int] = {}  # ticket -> one-way commands sent before it
        self._retired = (0, 0, 0)  # a session's: the traffic of its lanes that closed
        self.timeout = timeout if timeout is not None else configured_timeout()
        self.sock = open_socket(endpoint, self.timeout)
        self._send_lock = threading.Lock()
        self._turn = threading.Condition()
        self._next_ticket = 0
        self._next_reply = 0
        self._reading = False  # a thread is reading the reply of _next_reply (guarded by _turn)
        self._cancelled: set[int] = set()  # tickets whose replies nobody will collect (guarded by _turn)
        self._carried: Optional[str] = None  # an earlier one-way failure read from a dropped reply
        self.broken: Optional[str] = None
        self.last_graph: dict[int, int] = {}  # device -> uid of the last graph sent (guarded by the send lock)
        self.send_lock = _SendLock(self)  # `with conn.send_lock:` waits at most the RPC timeout
        self._traced: dict[int, tuple] = {}  # ticket -> the send half of its trace event
        self._arena: Optional[StagingArena] = None
        self._arena_lock = threading.Lock()
        # what crossed the link, always counted (a few additions per command): the live pipeline view
        self.n_sent = self.bytes_out = 0      # commands sent and their bytes (under the send lock)
        self.n_replies = self.bytes_in = 0    # replies read and their bytes (by the thread whose turn it is)
        rep = self.call(Cmd.HELLO, HELLO_REQ.pack(*VERSION, 0))
        if len(rep) != HELLO_REP.size:
            raise RPCError(f"{endpoint}: malformed HELLO reply")
        major, minor, patch, _, caps, server_id = HELLO_REP.unpack(rep)
        self.server_version = (major, minor, patch)
        self.caps = Cap(caps)
        self.server_id = server_id
        try:
            self._authenticate(configured_token())
            if session is not None:
                if not self.has(Cap.LANES):
                    raise RPCError(f"{endpoint}: the RPC server does not offer lanes")
                self.call(Cmd.BIND_SESSION, session.session_key())
        except BaseException:
            self.close()
            raise
        if trace.enabled and session is None:  # (a lane reaches the same peer clock)
            self.trace_sync()

    # --- sessions and lanes ------------------------------------------------------------------------
    def session_key(self) -> bytes:
        """The key that binds lanes to this connection's session (asked once)."""
        if self._key is None:
            key = self.call(Cmd.SESSION_KEY)
            if len(key) != SESSION_KEY_SIZE:
                raise RPCError(f"{self.endpoint}: malformed SESSION_KEY reply")
            self._key = key
        return self._key

    def _lane_number(self) -> int:
        self._lanes_opened += 1
        return self._lanes_opened

    def open_lane(self) -> "Connection":
        """A further connection bound to this session (the peer advertises LANES): it uses the
        session's buffers, and closes with it. Opened synchronously (at load or reconnection),
        never from a path that must not wait."""
        if self.session is not None:
            raise ValueError("a lane opens no lanes of its own")
        lane = Connection(self.endpoint, self.timeout, session=self)
        self.lanes.add(lane)
        return lane

    def traffic(self) -> tuple[int, int, int]:
        """(replies read, bytes out, bytes in) of a session: its connection and every lane it had."""
        n, out, inn = (self.n_replies + self._retired[0], self.bytes_out + self._retired[1],
                       self.bytes_in + self._retired[2])
        for lane in list(self.lanes):
            n, out, inn = n + lane.n_replies, out + lane.bytes_out, inn + lane.bytes_in
        return n, out, inn

    def fence(self) -> None:
        """Waits until the peer has run every one-way command sent so far (a round trip, only when
        some are still unconfirmed): a lane's next command then sees what this connection wrote."""
        if self.one_way_done != self.one_way_sent:
            self.call(Cmd.SYNCHRONIZE, U32.pack(0))

    def _authenticate(self, token: Optional[bytes]) -> None:
        """Proves the token to a server that asks for one, then checks the server's proof;
        refuses a server that does not ask when a token is configured."""
        if not self.has(Cap.AUTH):
            if token is not None:
                raise RPCError(f"{self.endpoint}: a token is configured but this RPC server does not authenticate; "
                               "refusing it (give the server --auth-token-file, or drop the token)")
            return
        if token is None:
            raise RPCError(f"{self.endpoint}: the RPC server requires a token: give --rpc-token-file PATH "
                           f"or set ${auth.ENV}")
        cn = auth.new_nonce()
        rep = self.call(Cmd.AUTH, bytes([auth.STEP_BEGIN]) + cn)
        wrong = f"{self.endpoint}: the RPC server does not hold our token (wrong token on one side)"
        if self.server_version < auth.CLIENT_FIRST_VERSION:
            # a 1.0 server proves first: check its proof before proving ours
            if len(rep) != auth.NONCE + auth.PROOF:
                raise RPCError(f"{self.endpoint}: malformed AUTH reply")
            sn, proof = rep[:auth.NONCE], rep[auth.NONCE:]
            if not auth.verify(auth.server_proof(token, cn, sn), proof):
                raise RPCError(wrong)
            try:
                self.call(Cmd.AUTH, bytes([auth.STEP_PROVE]) + auth.client_proof(token, cn, sn))
            except RPCError as exc:
                raise RPCError(f"{self.endpoint}: authentication refused: {exc}") from None
            return
        if len(rep) != auth.NONCE:
            raise RPCError(f"{self.endpoint}: malformed AUTH reply")
        sn = rep
        try:
            proof = self.call(Cmd.AUTH, bytes([auth.STEP_PROVE]) + auth.client_proof(token, cn, sn))
        except RPCError as exc:
            raise RPCError(f"{self.endpoint}: authentication refused ({exc}): wrong token on one side") from None
        if len(proof) != auth.PROOF or not auth.verify(auth.server_proof(token, cn, sn), proof):
            raise RPCError(wrong)

    def trace_sync(self) -> None:
        """Measures the peer's clock against ours (TRACE_SYNC, four timestamps) and records the
        offset with the peer's id, which binds its trace file to ours. Peers that do not
        advertise the capability are never sent the command."""
        if not self.has(Cap.TRACE_SYNC):
            return
        t1 = trace.now()
        rep = self.call(Cmd.TRACE_SYNC, U64.pack(t1))
        t4 = trace.now()
        t2, t3 = TRACE_REP.unpack(rep)
        offset = ((t2 - t1) + (t3 - t4)) // 2
        # an instant at t1: its span's t1 is the exchange's t1, so t1..t4 all read as the protocol names them
        trace.event("clock", "offset", t1, t1, endpoint=self.endpoint, peer_uid=f"{self.server_id:016x}",
                    t2=t2, t3=t3, t4=t4, offset_us=offset, rtt_us=(t4 - t1) - (t3 - t2))

    @property
    def arena(self) -> StagingArena:
        """The host staging shared by every group on this connection (made on first use)."""
        if self._arena is None:
            with self._arena_lock:
                if self._arena is None:
                    self._arena = StagingArena(arena_size(), wait_s=self.timeout)
        return self._arena

    def has(self, cap: Cap) -> bool:
        return bool(self.caps & cap)

    def check_peer(self) -> Optional[str]:
        """Why the connection is unusable, or None. Also notices, without waiting or reading, a
        peer that closed its end (it exited, or was killed) while nobody waits for a reply, and
        then breaks the connection; a peer that merely stops answering is noticed by the next
        command that waits for it (within the timeout)."""
        if self.broken:
            return self.broken
        try:
            poller = select.poll()
            poller.register(self.sock.fileno(), _PEER_CLOSED)
            closed = any(ev & _PEER_CLOSED for _, ev in poller.poll(0))
        except (OSError, ValueError):
            closed = True
        if closed:
            self._fail("the peer closed the connection")
        return self.broken

    # ------------------------------------------------------------------------------------------
    def send(self, cmd: Cmd, parts: Sequence[bytes | memoryview], locked: bool = False,
             subj: str = "") -> Optional[int]:
        """Writes one whole message; returns its reply ticket (None for one-way commands).
        With locked=True the caller already holds the send lock. `subj` names what the command
        is about (a tensor, a graph uid) for the trace."""
        size = sum(len(p) for p in parts)
        t_enq = trace.now() if trace.enabled else 0
        if not locked:
            self.acquire_send()
        try:
            self._check()
            t_send0 = trace.now() if t_enq else 0
            ticket = None
            if cmd not in ONE_WAY:
                ticket = self._next_ticket
                self._next_ticket += 1
                self._one_way_before[ticket] = self.one_way_sent
            else:
                self.one_way_sent += 1
            try:
                if size <= _JOIN_MAX:
                    # one write: every syscall lets another thread take the GIL, and a frame cut
                    # in pieces wakes the peer's loop once per piece
                    self.sock.sendall(b"".join((HEADER.pack(int(cmd), size), *parts)))
                else:
                    self.sock.sendall(HEADER.pack(int(cmd), size))
                    for p in parts:
                        self.sock.sendall(p)
            except TimeoutError:
                self._fail(f"a send did not complete within {self.timeout:g} s", stalled=True)
                raise RPCError(self.broken) from None
            except OSError as exc:
                self._fail(f"send failed: {exc}")
                raise RPCError(self.broken) from None
            self.n_sent += 1
            self.bytes_out += size + HEADER.size
            if t_enq:
                sent = (t_enq, t_send0, trace.now(), size + HEADER.size, subj, trace.group())
                if ticket is None:
                    self._trace(cmd, sent, None, True)
                else:
                    self._traced[ticket] = sent
        finally:
            if not locked:
                self._send_lock.release()
        stats.record(cmd.name, size + HEADER.size, 0)
        return ticket

    def acquire_send(self) -> None:
        """Takes the send lock. Its holder's send is bounded by the RPC timeout, so a wait longer
        than that means the connection is stuck: the caller gets an RPCError instead of waiting on."""
        if not self._send_lock.acquire(timeout=self.timeout):
            self._check()
            raise RPCError(f"RPC connection to {self.endpoint}: no turn to send within {self.timeout:g} s")

    def release_send(self) -> None:
        self._send_lock.release()

    def receive(self, ticket: int, cmd: Cmd, into: Optional[memoryview] = None) -> bytes:
        """Waits for the reply of `ticket` (replies come in ticket order); holds no send lock.
        Replies of cancelled tickets ahead of it are read and dropped on the way."""
        while True:
            taken = self._take_turn(ticket)
            if taken == ticket:
                break
            self._drop_reply(taken)
        sent = self._traced.pop(ticket, None) if self._traced else None
        t_turn = t_recv0 = 0
        if sent is not None:
            t_turn = trace.now()
        size = 0
        status = STATUS_OK
        try:
            self._check()
            head = self._recv_exact(HEADER.size)
            status, size = HEADER.unpack(head)
            if sent is not None:
                t_recv0 = trace.now()
            if status != STATUS_OK or into is None or size != len(into):
                payload = self._recv_exact(size)
            else:
                self._recv_into(into)
                payload = b""
            self.n_replies += 1
            self.bytes_in += size + HEADER.size
        except (OSError, RPCError) as exc:
            if sent is not None:
                self._trace(cmd, sent, (t_turn, t_recv0 or trace.now(), trace.now(), 0), False)
            self._fail_receive(exc)
            raise RPCError(self.broken) from None
        finally:
            carried, self._carried = self._carried, None  # only the thread whose turn it is touches it
            self._end_turn()
        if carried is not None and status == STATUS_OK:
            status, payload = STATUS_EARLIER_ERROR, carried.encode()
        if sent is not None:
            self._trace(cmd, sent, (t_turn, t_recv0, trace.now(), size + HEADER.size), status == STATUS_OK)
        stats.record(cmd.name, 0, size + HEADER.size, count=0)
        if status != STATUS_OK:
            raise RPCError(f"{self.endpoint}: {cmd.name} failed: {payload.decode('utf-8', 'replace')}")
        return payload

    def cancel(self, ticket: Optional[int]) -> None:
        """Gives up the reply of `ticket` (taken by send, not received): whoever waits behind it
        reads and drops it, so a caller that fails between sending and receiving never stalls
        the other users of the connection."""
        if ticket is None:
            return
        with self._turn:
            if ticket >= self._next_reply:
                self._cancelled.add(ticket)
                self._traced.pop(ticket, None)
                self._turn.notify_all()

    def _take_turn(self, ticket: int) -> int:
        """Blocks until this thread may read the next reply: its own (returns `ticket`) or that
        of a cancelled ticket ahead of it (returns that ticket, to drop). Bounded: the wait is
        woken by every reply read and by the connection breaking; a reply that is neither being
        read nor cancelled for a whole RPC timeout means its owner will never collect it, which
        breaks the connection (every waiter gets an error) instead of stalling it forever."""
        with self._turn:
            seen = self._next_reply
            deadline = time.monotonic() + self.timeout
            while not self.broken:
                nxt = self._next_reply
                if not self._reading:
                    if nxt == ticket:
                        self._reading = True
                        return ticket
                    if nxt in self._cancelled:
                        self._cancelled.discard(nxt)
                        self._reading = True
                        return nxt
                if nxt != seen or self._reading:  # progress, or a reader bounded by the socket timeout
                    seen = nxt
                    deadline = time.monotonic() + self.timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._turn.wait(min(left, self.timeout))
        if not self.broken:
            self._shut(f"RPC connection to {self.endpoint} stalled: the reply to request #{self._next_reply} was "
                       f"never collected within {self.timeout:g} s", log.error)
        return ticket  # the caller's own read fails at once on the broken connection

    def _end_turn(self) -> None:
        with self._turn:
            self._reading = False
            # a reply (whatever its status) comes after the peer ran every command sent before it
            done = self._one_way_before.pop(self._next_reply, None)
            if done is not None and done > self.one_way_done:
                self.one_way_done = done
            self._next_reply += 1
            self._turn.notify_all()

    def _drop_reply(self, ticket: int) -> None:
        """Reads the reply of a cancelled ticket and throws it away (an error in it included)."""
        try:
            self._check()
            status, size = HEADER.unpack(self._recv_exact(HEADER.size))
            scratch = memoryview(bytearray(min(size, 1 << 20) or 1))
            left = size
            while left:
                k = min(left, len(scratch))
                self._recv_into(scratch[:k])
                left -= k
            if status == STATUS_EARLIER_ERROR:  # an earlier one-way command failed: the next reply says so
                self._carried = bytes(scratch[:min(size, len(scratch))]).decode("utf-8", "replace")
            elif status != STATUS_OK:
                log.debug("%s: dropped the error reply of cancelled request #%d", self.endpoint, ticket)
        except (OSError, RPCError) as exc:
            self._fail_receive(exc)
        finally:
            self._end_turn()

    def _fail_receive(self, exc: BaseException) -> None:
        if not self.broken:
            if isinstance(exc, TimeoutError):
                self._fail(f"no reply within {self.timeout:g} s", stalled=True)
            else:
                self._fail(f"receive failed: {exc}")

    def call(self, cmd: Cmd, *parts: bytes | memoryview, into: Optional[memoryview] = None,
             subj: str = "") -> bytes:
        ticket = self.send(cmd, parts, subj=subj)
        if ticket is None:
            return b""
        return self.receive(ticket, cmd, into)

    def _trace(self, cmd: Cmd, sent: tuple, got: Optional[tuple], ok: bool) -> None:
        t_enq, t_send0, t_send1, bytes_out, subj, grp = sent
        t_turn, t_recv0, t_recv1, bytes_in = got if got is not None else (None, None, None, 0)
        trace.event("rpc.client", cmd.name, t_enq, t_recv1 if t_recv1 is not None else t_send1,
                    endpoint=self.endpoint, lane=self.lane, bytes_out=bytes_out, bytes_in=bytes_in, subj=subj, grp=grp,
                    t_enq=t_enq, t_send0=t_send0, t_send1=t_send1, t_turn=t_turn, t_recv0=t_recv0,
                    t_recv1=t_recv1, ok=ok)

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

    def _fail(self, why: str, stalled: bool = False) -> None:
        """A session and its lanes fail together: a lost lane is restored by restoring the session."""
        state = "is not answering" if stalled else "is gone"
        self._shut(f"RPC peer {self.endpoint} {state} ({why})", log.error)
        if self.session is not None and not self.session.broken:
            self.session._shut(f"RPC peer {self.endpoint}: lane {self.lane} {state} ({why})", log.debug)

    def close(self) -> None:
        self._shut(f"RPC connection to {self.endpoint} closed", log.debug)

    def _shut(self, reason: str, say) -> None:
        """Marks the connection broken (the first reason wins) and wakes every waiting thread; a
        session's lanes close with it (the peer ends them too)."""
        if not self.broken:
            self.broken = reason
            say("%s", reason)
            for lane in list(self.lanes):
                lane._shut(f"{reason} (its session)", log.debug)
            if self.session is not None and self in self.session.lanes:  # its traffic stays counted
                self.session.lanes.discard(self)
                r = self.session._retired
                self.session._retired = (r[0] + self.n_replies, r[1] + self.bytes_out, r[2] + self.bytes_in)
            if self._arena is not None:
                self._arena.close()
            close_socket(self.sock)
        with self._turn:
            self._turn.notify_all()
