"""The RPC server: an event loop that owns the sockets and parses frames, executor threads that run
the commands (docs/rpc-protocol.md).

The loop never computes. Each connection is an `asyncio.BufferedProtocol`: small frames are parsed
out of a receive buffer (a frame may arrive in many pieces, several frames in one piece); a payload
larger than that buffer is received straight into its own staging array, allocated once the header
was checked against --max-frame. A complete frame goes to its connection's executor, which runs
that connection's commands in arrival order and hands each reply back with
`loop.call_soon_threadsafe`; replies of one connection therefore leave in request order. Each
connection is a lane: lanes run concurrently, and a lane bound to a session (BIND_SESSION) uses that
session's buffers, so a client's pipeline groups each compute over a lane of their own. A few
informational commands (DEVICE_COUNT, GET_DEVICE_INFO, TRACE_SYNC, and SYNCHRONIZE on a CPU device)
are answered on the loop when nothing of that connection is queued, which keeps that order too.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
from typing import Callable, Optional

import numpy as np

from ..obs import trace
from ..backend.base import Backend
from ..backend.cpu import CPUBackend
from ..rpc import auth
from ..rpc.keepalive import enable_keepalive
from ..rpc import protocol as P
from ..rpc.protocol import Cap, Cmd
from .cache import TensorCache
from .device import Device, Executor
from .session import CommandError, Session, frame, now_us
from ..util.settings import RpcSettings, current
from ..util.threads import Thread

log = logging.getLogger("pyllama.rpc_server")

CAPS_ENV = "PYLLAMA_RPC_SERVER_CAPS"
_RX_SIZE = 256 * 1024          # receive buffer; larger payloads get their own staging array
HANDSHAKE_RX = 256             # the receive buffer until the handshake is done (its frames are small)
DEFAULT_HANDSHAKE_TIMEOUT = 10.0  # seconds a connection has to say HELLO (and prove the token)
DEFAULT_MAX_CONNECTIONS = 64
_QUEUED_HIGH = 64 << 20        # stop reading a connection while this much of it waits to execute
_QUEUED_LOW = 16 << 20
_SESSION_CMDS = frozenset({Cmd.SESSION_KEY, Cmd.BIND_SESSION})
_LOOP_CMDS = frozenset({Cmd.HELLO, Cmd.DEVICE_COUNT, Cmd.GET_DEVICE_INFO, Cmd.TRACE_SYNC, Cmd.AUTH}) | _SESSION_CMDS
_KNOWN = frozenset(int(c) for c in Cmd)
_HELLO_MAX = 64                # a first frame claiming more than this is not a HELLO


class RPCServer:
    """Serves the devices made by `backend_factory` (one for now) over TCP.

    mem_limit: bytes all connections may allocate on a device (None: what the host has);
    cache_dir: enables the SET_TENSOR_HASH weight cache; max_frame: the largest request payload.
    caps_mask: restricts the advertised capabilities (default: $PYLLAMA_RPC_SERVER_CAPS, else none).
    handshake_timeout: seconds a connection has to complete HELLO (and AUTH with a token) before it
    is closed; max_connections: connections open at once, handshaking or not (one more is told so
    and closed).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 50052,
                 backend_factory: Callable[[], Backend] = CPUBackend, mem_limit: Optional[int] = None,
                 cache_dir: Optional[str] = None, max_frame: int = P.DEFAULT_MAX_FRAME,
                 caps_mask: Optional[int] = None, token: Optional[bytes] = None,
                 handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        if max_frame < P.GRAPH_HEAD.size:
            raise ValueError(f"max_frame {max_frame} is too small")
        if not handshake_timeout > 0:
            raise ValueError("handshake_timeout must be positive")
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        if mem_limit is not None and mem_limit < 0:
            raise ValueError("mem_limit must not be negative")
        self.host, self.port = host, port
        self.max_frame = max_frame
        self.max_read = min(P.DEFAULT_MAX_READ, max_frame)
        self.cache = TensorCache(cache_dir) if cache_dir else None
        caps = (Cap.GET_TENSORS | Cap.TRACE_SYNC | Cap.BACKEND_SAMPLING | Cap.DEVICE_TYPES | Cap.MOE_FFN
                | Cap.DEVICE_BUSY | Cap.FAMILY_OPS | Cap.LANES | Cap.LORA | (Cap.SET_TENSOR_HASH if self.cache else 0))
        mask = caps_mask if caps_mask is not None else current().rpc.server_caps
        if mask is not None:
            caps &= mask
        self.token = token
        if token is not None:  # never masked away: it is a requirement, not an offer
            caps |= Cap.AUTH
        self.capabilities = int(caps)
        # also the trace uid of `python -m pyllama.rpc_server`: a client's clock event names it
        self.server_id = secrets.randbits(64) or 1
        self.devices = [Device(0, backend_factory(), mem_limit)]
        self._server: Optional[asyncio.AbstractServer] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._conns: set["_Connection"] = set()
        self._all_closed: Optional[asyncio.Event] = None
        self.sessions: dict[bytes, "_Connection"] = {}  # SESSION_KEY -> the session's first connection
        self.sessions_lock = threading.Lock()  # the sessions and their connections' lanes and keys
        self._executors: set[Executor] = set()  # every connection's, until its thread has ended
        self._next_conn = 0

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> int:
        """Listens; returns the bound port."""
        self._loop = asyncio.get_running_loop()
        self._all_closed = asyncio.Event()
        self._all_closed.set()
        self._server = await self._loop.create_server(lambda: _Connection(self), self.host, self.port,
                                                      reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        log.debug("serving %s on %s:%d (capabilities 0x%x, server id %016x)", ", ".join(d.name for d in self.devices),
                  self.host, self.port, self.capabilities, self.server_id)
        return self.port

    async def stop(self) -> None:
        """Stops accepting, closes every connection (freeing its buffers), ends the threads."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.abort()
        if self._all_closed is not None:
            try:
                await asyncio.wait_for(self._all_closed.wait(), 5.0)
            except asyncio.TimeoutError:  # pragma: no cover
                log.warning("some connections did not close in time")
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            except asyncio.TimeoutError:  # pragma: no cover
                pass
            self._server = None
        loop = asyncio.get_running_loop()
        executors = list(self._executors)
        for ex in executors:  # each bounded (Executor.stop, TensorCache.close)
            await loop.run_in_executor(None, ex.stop)
        if self.cache is not None:
            await loop.run_in_executor(None, self.cache.close)
        if any(ex.alive for ex in executors):  # a command still computing: its buffers stay until the process ends
            log.warning("a command is still running; not closing the devices")
            return
        for dev in self.devices:
            dev.backend.close()

    def allocated(self) -> int:
        """Bytes allocated by all connections on all devices."""
        return sum(d.allocated for d in self.devices)

    @property
    def connections(self) -> int:
        return len(self._conns)

    def _opened(self, conn: "_Connection") -> None:
        self._conns.add(conn)
        assert self._all_closed is not None
        self._all_closed.clear()
        self._next_conn += 1
        conn.number = self._next_conn
        conn.executor = Executor(f"rpc-exec-{conn.number}", on_exit=self._executor_done)  # (15 characters kept)
        self._executors = {ex for ex in self._executors if ex.alive}  # those of closed lanes end on their own
        self._executors.add(conn.executor)

    def _executor_done(self) -> None:
        """On a connection's executor thread as it ends: a GPU frees the stream it kept for it."""
        for dev in self.devices:
            dev.backend.end_thread()

    def _closed(self, conn: "_Connection") -> None:
        self._conns.discard(conn)
        if not self._conns and self._all_closed is not None:
            self._all_closed.set()


class _Connection(asyncio.BufferedProtocol):
    """Frames of one client: incremental parsing, HELLO gate, in-order dispatch, flow control."""

    def __init__(self, server: RPCServer):
        self.server = server
        self.transport: Optional[asyncio.Transport] = None
        self.session: Optional[Session] = None
        self.peer = "?"
        self.hello_done = False
        self.closing = False
        self._eof = False
        self.number = 0            # the server's count of connections when it was opened (logs, traces)
        # the lane's executor (made by RPCServer._opened, which connection_made calls first): its
        # commands run there in arrival order, concurrently with other lanes
        self.executor: Executor
        self.session_key: Optional[bytes] = None  # a session's first connection: its key, once asked
        self.lanes: set["_Connection"] = set()    # a session's first connection: the lanes bound to it
        self.lane_of: Optional["_Connection"] = None  # a lane: its session's first connection
        self.inflight = 0          # commands handed to an executor and not yet completed
        self.queued_bytes = 0      # their payload bytes
        self._write_paused = False
        self._read_paused = False
        # a connection holds little until it has completed the handshake (a flood of idle sockets
        # must not cost a receive buffer each); frames before it are at most _HELLO_MAX bytes
        self._rx = bytearray(HANDSHAKE_RX)
        self._rxv = memoryview(self._rx)
        self._deadline: Optional[asyncio.TimerHandle] = None
        self._unsent: list[tuple[Device, int]] = []  # reserved replies the transport still buffers
        self._start = 0            # unparsed bytes are _rx[_start:_end]
        self._end = 0
        self._payload: Optional[np.ndarray] = None  # a large payload being received into place
        self._pfill = 0
        self._pcmd = 0
        self._hdr_t = 0            # when the header of the frame being received was first seen (tracing)
        self.authed = server.token is None
        self._nonces: Optional[tuple[bytes, bytes]] = None  # (client, server) of a begun AUTH
        self._client_version = (0, 0, 0)  # from its HELLO
        # a CPU device finishes its work inside the executor: with nothing of this connection queued,
        # SYNCHRONIZE has nothing to wait for and is answered at once
        self._sync_on_loop = all(d.completes_in_executor for d in server.devices)

    # --- asyncio callbacks ---------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # a client whose machine vanished is noticed (and its buffers freed) within about
                # the default RPC timeout, though it never closed the connection
                enable_keepalive(sock, RpcSettings.timeout_s, user_timeout=False)
            except OSError:  # pragma: no cover
                pass
        self.server._opened(self)
        if self.server.connections > self.server.max_connections:
            why = (f"the server has {self.server.max_connections} connections open already "
                   "(--max-connections): try again later")
            log.warning("%s: %s: closing", self.peer, why)
            self._write(frame(P.STATUS_ERROR, why.encode()))
            self._close()
            return
        self.session = Session(self.server, self.peer)
        assert self.server._loop is not None
        self._deadline = self.server._loop.call_later(self.server.handshake_timeout, self._handshake_expired)
        log.info("%s: connected", self.peer)

    def _handshake_expired(self) -> None:
        self._deadline = None
        if self.closing or self._handshaken:
            return
        why = (f"handshake not completed within {self.server.handshake_timeout:g} s "
               f"({'AUTH' if self.hello_done else 'HELLO'} missing)")
        log.warning("%s: %s: closing", self.peer, why)
        self._write(frame(P.STATUS_ERROR, why.encode()))
        self._close()

    @property
    def _handshaken(self) -> bool:
        return self.hello_done and self.authed

    def _handshake_done(self) -> None:
        """HELLO (and AUTH) done: the deadline goes, the full receive buffer comes."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if len(self._rx) < _RX_SIZE:
            n = self._end - self._start
            rx = bytearray(_RX_SIZE)
            rx[:n] = self._rx[self._start:self._end]
            self._rx, self._rxv = rx, memoryview(rx)
            self._start, self._end = 0, n

    def connection_lost(self, exc) -> None:
        self._log_partial_frame()
        log.info("%s: disconnected%s", self.peer, f" ({exc})" if exc else "")
        self.closing = True
        self._release_unsent()
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._payload = None
        session = self.session
        if session is not None:
            session.closed = True
            with self.server.sessions_lock:
                if self.lane_of is not None:
                    self.lane_of.lanes.discard(self)
                if self.session_key is not None:
                    self.server.sessions.pop(self.session_key, None)
                lanes = list(self.lanes)
                self.lanes.clear()
            for lane in lanes:  # a session's lanes end with its first connection
                if lane.session is not None:
                    lane.session.closed = True
                lane.abort()

            def release() -> None:
                # the lanes' executors end first: none still computes with a buffer freed here
                for lane in lanes:
                    lane.executor.stop()
                for dev in self.server.devices:  # after whatever is already queued
                    for lane in lanes:
                        if lane.session is not None:
                            lane.session.release(dev)
                    session.release(dev)

            self.executor.start()
            self.executor.submit(release)
            self.executor.close()
        self.server._closed(self)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._release_unsent()
        self._update_reading()

    def _release_unsent(self) -> None:
        unsent, self._unsent = self._unsent, []
        for dev, size in unsent:
            dev.release(size)

    def eof_received(self) -> bool:
        """The client stopped sending: answer what is queued, then close."""
        self._log_partial_frame()
        self._eof = True
        if self.inflight == 0:
            self._close()
        return True

    def _log_partial_frame(self) -> None:
        if self.closing:
            return
        if self._payload is not None or self._end > self._start:
            got = self._pfill + P.HEADER.size if self._payload is not None else self._end - self._start
            log.warning("%s: connection closed in the middle of a frame (%d bytes of it received)", self.peer, got)
            self._payload = None
            self._start = self._end = 0

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._payload is not None:
            return memoryview(self._payload)[self._pfill:]
        if self._end == len(self._rx):  # only when a frame header sits at the very end
            self._compact()
        return self._rxv[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.closing:
            return
        if self._payload is not None:
            self._pfill += nbytes
            if self._pfill == len(self._payload):
                payload, self._payload = self._payload, None
                self._dispatch(self._pcmd, payload)
            return
        self._end += nbytes
        self._parse()

    # --- parsing -------------------------------------------------------------------------------
    def _compact(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start:
            n = self._end - self._start
            self._rx[:n] = self._rx[self._start:self._end]
            self._start, self._end = 0, n

    def _parse(self) -> None:
        hs = P.HEADER.size
        while not self.closing:
            avail = self._end - self._start
            if avail < hs:
                break
            cmd, size = P.HEADER.unpack_from(self._rx, self._start)
            if trace.enabled and not self._hdr_t:
                self._hdr_t = trace.now()
            if not self._header_ok(cmd, size):
                return
            if avail - hs >= size:
                p0 = self._start + hs
                payload = bytes(self._rxv[p0:p0 + size])
                self._start = p0 + size
                self._dispatch(cmd, payload)
                continue
            if hs + size <= len(self._rx):
                break  # the rest arrives into the receive buffer
            try:
                staged = np.empty(size, np.uint8)
            except (MemoryError, ValueError):
                log.warning("%s: cannot stage a %d-byte payload: closing", self.peer, size)
                self._close()
                return
            have = avail - hs
            staged[:have] = np.frombuffer(self._rx, np.uint8, have, self._start + hs)
            self._start = self._end = 0
            self._payload, self._pfill, self._pcmd = staged, have, cmd
            return
        self._compact()

    def _header_ok(self, cmd: int, size: int) -> bool:
        """Checks made on a header alone, before any of its payload is kept."""
        if size > self.server.max_frame:
            log.warning("%s: %s payload of %d bytes exceeds the frame limit of %d: closing", self.peer,
                        _cmd_name(cmd), size, self.server.max_frame)
            self._close()
            return False
        if not self.hello_done and (cmd != Cmd.HELLO or size > _HELLO_MAX):
            log.warning("%s: first command is %s (%d bytes), not HELLO: closing", self.peer, _cmd_name(cmd), size)
            self._close()
            return False
        if cmd not in _KNOWN:
            log.warning("%s: unknown command %d: closing", self.peer, cmd)
            self._close()
            return False
        if self.hello_done and not self.authed and (cmd != Cmd.AUTH or size > _HELLO_MAX):
            # nothing of an unauthenticated client is buffered beyond a handshake frame
            log.warning("%s: %s (%d bytes) before authentication: closing", self.peer, _cmd_name(cmd), size)
            self._write(frame(P.STATUS_ERROR, f"authentication required before {_cmd_name(cmd)}".encode()))
            self._close()
            return False
        return True

    # --- dispatch ------------------------------------------------------------------------------
    def _dispatch(self, code: int, payload) -> None:
        t_recv = now_us()
        # (t_recv0, t_recv1) of this frame while tracing, else None
        rx = (self._hdr_t or t_recv, t_recv) if trace.enabled else None
        self._hdr_t = 0
        cmd = Cmd(code)
        if not self.hello_done:
            self._hello(payload)
            return
        if not self.authed:
            self._auth(cmd, bytes(payload))
            return
        session = self.session
        assert session is not None
        if self.inflight == 0 and (cmd in _LOOP_CMDS or (cmd is Cmd.SYNCHRONIZE and self._sync_on_loop)):
            t_exec0 = trace.now() if rx else 0
            reply = self._session_command(cmd, payload) if cmd in _SESSION_CMDS else session.execute(cmd, payload, t_recv)
            t_exec1 = trace.now() if rx else 0
            tx = self._reply(reply, rx is not None)
            if rx:
                self._trace(cmd, rx, (t_exec0, t_exec1, None), len(payload), reply, tx)
            return
        nbytes = len(payload)
        self.inflight += 1
        self.queued_bytes += nbytes

        def run() -> tuple[bool, tuple]:
            reply = None
            t_exec0 = trace.now() if rx else 0
            if not session.closed:
                try:
                    if cmd in _SESSION_CMDS:
                        reply = self._session_command(cmd, payload)
                    else:
                        reply = session.execute(cmd, payload, t_recv)
                except BaseException as exc:  # noqa: BLE001 - execute answers errors itself; this is a bug
                    log.exception("%s: %s crashed", session.peer, cmd.name)
                    if cmd not in P.ONE_WAY:
                        reply = frame(P.STATUS_ERROR, f"{cmd.name}: internal error: {exc!r}".encode())
            ex = (t_exec0, trace.now(), session.last_nodes) if rx else None
            return reply is not None, (reply, nbytes, cmd, rx, ex)

        self.executor.start()
        self.executor.submit(run, self.server._loop, self._done)
        self._update_reading()

    def _session_command(self, cmd: Cmd, payload) -> bytes:
        """SESSION_KEY and BIND_SESSION (on the loop, or on the executor behind queued commands):
        the server's table of sessions and their lanes change under its lock."""
        assert self.session is not None
        earlier = self.session.earlier_error()
        if earlier is not None:
            return earlier
        try:
            if not self.server.capabilities & Cap.LANES:
                raise CommandError(f"{cmd.name} is not advertised by this server")
            with self.server.sessions_lock:
                out = self._session_key(payload) if cmd is Cmd.SESSION_KEY else self._bind(payload)
            return frame(P.STATUS_OK, out)
        except CommandError as exc:
            log.warning("%s: %s refused: %s", self.peer, cmd.name, exc)
            return frame(P.STATUS_ERROR, f"{cmd.name}: {exc}".encode())

    def _session_key(self, payload) -> bytes:
        if len(payload):
            raise CommandError(f"payload of {len(payload)} bytes, expected none")
        if self.lane_of is not None:
            raise CommandError("this connection is a lane of another session")
        if self.session_key is None:
            key = secrets.token_bytes(P.SESSION_KEY_SIZE)
            self.server.sessions[key] = self
            self.session_key = key
        return self.session_key

    def _bind(self, payload) -> bytes:
        if len(payload) != P.SESSION_KEY_SIZE:
            raise CommandError(f"payload of {len(payload)} bytes, expected a {P.SESSION_KEY_SIZE}-byte key")
        owner = self.server.sessions.get(bytes(payload))
        if owner is None or owner.closing or owner.session is None:
            raise CommandError("no open session has this key")
        if owner is self:
            raise CommandError("a connection cannot be a lane of its own session")
        assert self.session is not None
        if not self.session.fresh or self.session_key is not None:
            raise CommandError("only a connection that has not used buffers, graphs or a session key yet can "
                               "become a lane")
        self.session.bind(owner.session)
        self.lane_of = owner
        owner.lanes.add(self)
        log.info("%s: lane %d of the session of connection %d (%s)", self.peer, len(owner.lanes), owner.number,
                 owner.peer)
        return b""

    def _done(self, result: tuple) -> None:
        """On the loop: a queued command completed."""
        reply, nbytes, cmd, rx, ex = result
        self.inflight -= 1
        self.queued_bytes -= nbytes
        tx = self._reply(reply, rx is not None)
        if rx is not None and ex is not None:
            self._trace(cmd, rx, ex, nbytes, reply, tx)
        if (self._eof or self.closing) and self.inflight == 0:
            self._close()
            return
        self._update_reading()

    def _auth(self, cmd: Cmd, payload: bytes) -> None:
        """Before authentication only AUTH is served; anything else, or a wrong proof, closes.
        The client proves first: a peer without the token gets a nonce and a refusal, nothing
        derived from the token (which it could test guesses against offline)."""
        token = self.server.token
        assert token is not None
        step = payload[0] if payload else 0
        body = payload[1:]
        if cmd is Cmd.AUTH and step == auth.STEP_BEGIN and len(body) == auth.NONCE and self._nonces is None:
            if self._client_version < auth.CLIENT_FIRST_VERSION:
                why = (f"client protocol {'.'.join(map(str, self._client_version))} expects the server to prove "
                       f"first; this server requires the client to prove first (protocol "
                       f"{'.'.join(map(str, auth.CLIENT_FIRST_VERSION))}): upgrade the client")
            else:
                sn = auth.new_nonce()
                self._nonces = (body, sn)
                self._write(frame(P.STATUS_OK, sn))
                return
        elif cmd is Cmd.AUTH and step == auth.STEP_PROVE and len(body) == auth.PROOF and self._nonces is not None:
            cn, sn = self._nonces
            if auth.verify(auth.client_proof(token, cn, sn), body):
                self.authed = True
                log.info("%s: authenticated", self.peer)
                self._write(frame(P.STATUS_OK, auth.server_proof(token, cn, sn)))
                self._handshake_done()
                return
            why = "authentication failed"
        elif cmd is Cmd.AUTH:
            why = "malformed AUTH"
        else:
            why = f"authentication required before {cmd.name}"
        log.warning("%s: %s: closing", self.peer, why)
        self._write(frame(P.STATUS_ERROR, why.encode()))
        self._close()

    def _hello(self, payload) -> None:
        if len(payload) != P.HELLO_REQ.size:
            self._write(frame(P.STATUS_ERROR, f"HELLO: payload of {len(payload)} bytes, expected "
                                              f"{P.HELLO_REQ.size}".encode()))
            log.warning("%s: malformed HELLO: closing", self.peer)
            self._close()
            return
        major, minor, patch, _ = P.HELLO_REQ.unpack(payload)
        if major != P.VERSION[0]:
            msg = (f"client protocol {major}.{minor}.{patch} is not compatible with server "
                   f"{'.'.join(map(str, P.VERSION))} (the major versions differ)")
            log.warning("%s: %s: closing", self.peer, msg)
            self._write(frame(P.STATUS_ERROR, msg.encode()))
            self._close()
            return
        self.hello_done = True
        self._client_version = (major, minor, patch)
        log.debug("%s: HELLO from protocol %d.%d.%d", self.peer, major, minor, patch)
        self._write(frame(P.STATUS_OK, P.HELLO_REP.pack(*P.VERSION, 0, self.server.capabilities,
                                                         self.server.server_id)))
        if self.authed:  # no token
            self._handshake_done()

    def _reply(self, reply, traced: bool) -> Optional[tuple[int, int]]:
        """Writes the reply, if any; traced, returns when the transport got it and when the write
        returned (the socket took what it could, the transport buffers the rest)."""
        if reply is None:
            return None
        t0 = trace.now() if traced else 0
        self._write(reply)
        charge = getattr(reply, "charge", None)
        if charge is not None:
            if self._write_paused and not self.closing:
                self._unsent.append(charge)  # the transport holds it: released once it drains
            else:
                charge[0].release(charge[1])
        return (t0, trace.now()) if traced else None

    def _trace(self, cmd: Cmd, rx: tuple, ex: tuple, nbytes: int, reply, tx: Optional[tuple[int, int]]) -> None:
        """One rpc.server event: receive, execution, and the reply's write (tx) when there is one."""
        t_send0, t_send1 = tx if tx is not None else (None, None)
        trace.event("rpc.server", cmd.name, rx[0], t_send1 or ex[1], t_recv0=rx[0], t_recv1=rx[1],
                    t_exec0=ex[0], t_exec1=ex[1], t_send0=t_send0, t_send1=t_send1,
                    bytes_in=nbytes + P.HEADER.size, bytes_out=len(reply) if reply is not None else 0,
                    n_nodes=ex[2], dev=self.server.devices[0].name, peer=self.peer, conn=self.number,
                    lane_of=self.lane_of.number if self.lane_of is not None else None)

    # --- output and flow control ----------------------------------------------------------------
    def _write(self, data) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _update_reading(self) -> None:
        if self.transport is None or self.closing:
            return
        if self._read_paused:
            if not self._write_paused and self.queued_bytes <= _QUEUED_LOW:
                self._read_paused = False
                self.transport.resume_reading()
        elif self._write_paused or self.queued_bytes > _QUEUED_HIGH:
            self._read_paused = True
            self.transport.pause_reading()

    def _close(self) -> None:
        """Stops reading at once; closes once the commands already queued have completed and what
        was written is flushed. A refused frame must not cost the client the replies of the valid
        commands before it (else what a client gets would depend on how TCP cut its stream)."""
        self.closing = True
        self._payload = None
        self._start = self._end = 0
        if self.transport is None:
            return
        if self.inflight:  # _done closes after the last of them
            if not self._read_paused:
                self._read_paused = True
                self.transport.pause_reading()
            return
        self.transport.close()

    def abort(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.abort()


def _cmd_name(code: int) -> str:
    try:
        return Cmd(code).name
    except ValueError:
        return f"command {code}"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed, else asyncio's."""
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class ServerThread:
    """Runs an RPCServer on its own event loop in a background thread (tests, embedding).

    with ServerThread(port=0, mem_limit=...) as st: ... st.port, st.server ...
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **kwargs):
        self.server = RPCServer(host, port, **kwargs)
        self.port = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None

    def start(self, timeout: float = 10.0) -> int:
        self._loop = new_event_loop()
        self._thread = Thread(target=self._loop.run_forever, name="rpc-server-loop", daemon=True)
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout)
        return self.port

    def call(self, fn: Callable, *args, timeout: float = 10.0):
        """Runs fn(*args) on the server's loop and returns its result."""
        assert self._loop is not None

        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            assert self._thread is not None
            self._thread.join(timeout)
            self._loop.close()
            self._loop = None

    def __enter__(self) -> "ServerThread":
        if self._loop is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
