"""The RPC backend: a device of another machine, behind `python -m pyllama.rpc_server`.

Every Backend call becomes one command on the process-wide connection to that endpoint. Reads
queued with get_tensor_async leave as one GET_TENSORS at the next flush point (synchronize, a graph,
a write, a free) so a decode step costs one read round trip whatever its batch; a graph already
sent on this connection for this device is re-run by uid (GRAPH_RECOMPUTE), checked under the send
lock so one group never re-runs another's graph.

A lost peer (`lost()`) is brought back by `reconnect()`: a new connection to the same endpoint, on
which every buffer still alive here is allocated again under its old Buffer object (the tensors,
plans and contexts that point at it stay valid); what those buffers held is for the caller to
restore.
"""
from __future__ import annotations

import hashlib
import struct
import threading
import weakref
from typing import Optional

import numpy as np

from ...obs import trace
from ..._fast.wire import encode_graph
from ...ir.tensor import FAMILY_OPS, KV_CACHE_TYPES, Graph, Op
from ...rpc.connection import Connection, RPCError, get_connection
from ...rpc.protocol import (ALLOC_REP, graph_tables, ALLOC_REQ, DEVICE_INFO, KIND, MAX_DIMS, NAME_LEN, RECOMPUTE, REGION, U32, U64, USAGE,
                            Cap, Cmd, DEVICE_TYPES_HEAD, MAX_DEVICE_TYPES)
from ..base import Backend, Buffer, DeviceInfo, DType, Tensor
from ..remote import RemoteDevice
from ..stream import Stream
from .layout import PeerLayout
from ...util.settings import RpcSettings
from ...util.settings import current as current_settings

_KIND_NAMES = {v: k for k, v in KIND.items()}

_TENSOR = struct.Struct(f"<QQII{MAX_DIMS}Q{NAME_LEN}s")
_GRAPH_CACHE = 256
HASH_MIN_BYTES = 1 << 20  # smaller uploads are cheaper to send than to look up


class RPCBuffer(Buffer):
    __slots__ = ("remote_id",)

    def __init__(self, backend: "RPCBackend", size: int, usage: str, remote_id: int):
        super().__init__(backend, size, usage)
        self.remote_id = remote_id


def tensor_bytes(t: Tensor) -> bytes:
    """The wire descriptor of a tensor (docs/rpc-protocol.md, `tensor`)."""
    shape = list(t.shape) + [0] * (MAX_DIMS - len(t.shape))
    return _TENSOR.pack(t.buffer.remote_id, t.offset, int(t.dtype), len(t.shape), *shape,  # type: ignore[union-attr]
                        t.name.encode()[:NAME_LEN])


class _Commands:
    """The commands of one queue of work on a peer's device, over one connection (`conn`): the
    device's default stream (RPCBackend, on the session's connection, reads kept per thread) or a
    pipeline group's lane (RPCLane, a connection of its own). `dev` is the device."""

    dev: "RPCBackend"
    conn: Connection

    def _fence(self) -> None:
        """Before a command that depends on what the session's connection wrote (a lane's)."""

    @property
    def _reads(self) -> list[tuple[Tensor, np.ndarray]]:
        raise NotImplementedError

    @property
    def _inflight(self) -> list[tuple[int, Cmd, list[tuple[Tensor, np.ndarray]]]]:
        raise NotImplementedError

    # --- data ------------------------------------------------------------------------------------
    def set_tensor(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        src = memoryview(np.ascontiguousarray(data)).cast("B")
        if offset < 0 or offset + len(src) > tensor.nbytes:
            raise ValueError(f"set_tensor: {len(src)} bytes at {offset} overflow {tensor.name} ({tensor.nbytes} B)")
        self._flush_reads()
        self._fence()
        desc = tensor_bytes(tensor)
        if len(src) >= HASH_MIN_BYTES and tensor.buffer.usage == "weights" and self.conn.has(Cap.SET_TENSOR_HASH):
            # the server's weight cache may already hold these bytes: a restart then resends nothing
            digest = hashlib.sha256(src).digest()
            found = self.conn.call(Cmd.SET_TENSOR_HASH, desc, REGION.pack(offset, len(src)), digest, subj=tensor.name)
            if found == b"\x01":
                return
        self.conn.send(Cmd.SET_TENSOR, [desc, U64.pack(offset), src], subj=tensor.name)

    def get_tensor(self, tensor: Tensor, out: Optional[np.ndarray] = None) -> np.ndarray:
        self._flush_reads()
        if out is None:
            out = np.empty(tensor.nbytes, dtype=np.uint8)
            if tensor.dtype in (DType.F32, DType.I32, DType.F16):
                out = out.view({DType.F32: np.float32, DType.I32: np.int32, DType.F16: np.float16}[tensor.dtype]).reshape(tensor.shape)
        dst = memoryview(out.reshape(-1).view(np.uint8))
        if len(dst) != tensor.nbytes:
            raise ValueError(f"get_tensor: {tensor.name} has {tensor.nbytes} B, destination {len(dst)} B")
        self._fence()
        self.conn.call(Cmd.GET_TENSOR, tensor_bytes(tensor), REGION.pack(0, tensor.nbytes), into=dst, subj=tensor.name)
        return out

    def get_tensor_async(self, tensor: Tensor, out: np.ndarray) -> None:
        if not self.dev.batched_get:
            self.get_tensor(tensor, out)
            return
        if out.nbytes != tensor.nbytes or not out.flags.c_contiguous:
            raise ValueError(f"get_tensor_async: destination of {tensor.name} must be contiguous and {tensor.nbytes} B")
        self._reads.append((tensor, out))

    def _flush_reads(self) -> None:
        """Sends this thread's queued reads and waits for every read it has in flight. Every
        ticket is collected even when one reply is an error (the first error is raised after):
        a ticket left behind would stall every other user of the connection."""
        reads = self._reads
        if reads:
            self._send_reads(list(reads), locked=False)
            reads.clear()
        inflight = self._inflight
        first: Optional[RPCError] = None
        while inflight:
            ticket, cmd, batch = inflight.pop(0)
            try:
                self._receive_read(ticket, cmd, batch)
            except RPCError as exc:
                first = first or exc
        if first is not None:
            raise first

    def _receive_read(self, ticket: int, cmd: Cmd, batch: list[tuple[Tensor, np.ndarray]]) -> None:
        if len(batch) == 1:
            self.conn.receive(ticket, cmd, into=memoryview(batch[0][1].reshape(-1).view(np.uint8)))
            return
        buf = bytearray(sum(t.nbytes for t, _ in batch))
        self.conn.receive(ticket, cmd, into=memoryview(buf))
        pos = 0
        for t, out in batch:
            out.reshape(-1).view(np.uint8)[:] = np.frombuffer(buf, np.uint8, t.nbytes, pos)
            pos += t.nbytes

    def _send_reads(self, reads: list[tuple[Tensor, np.ndarray]], locked: bool) -> None:
        """Sends reads (one GET_TENSORS, or one GET_TENSOR each without the capability); their
        replies are received by _flush_reads."""
        for t, out in reads:
            if out.nbytes != t.nbytes or not out.flags.c_contiguous:
                raise ValueError(f"read of {t.name}: destination must be contiguous and {t.nbytes} B")
        if not locked:  # (a graph's reads go out behind it, which fenced already)
            self._fence()
        if self.dev.batched_get:
            parts = [U32.pack(len(reads))]
            for t, _ in reads:
                parts += [tensor_bytes(t), REGION.pack(0, t.nbytes)]
            subj = ",".join(t.name for t, _ in reads) if trace.enabled else ""
            ticket = self.conn.send(Cmd.GET_TENSORS, parts, locked=locked, subj=subj)
            self._inflight.append((ticket, Cmd.GET_TENSORS, reads))  # type: ignore[arg-type]
            return
        for t, out in reads:
            ticket = self.conn.send(Cmd.GET_TENSOR, [tensor_bytes(t), REGION.pack(0, t.nbytes)], locked=locked,
                                    subj=t.name)
            self._inflight.append((ticket, Cmd.GET_TENSOR, [(t, out)]))  # type: ignore[arg-type]

    def cpy_tensor_async(self, src: Tensor, dst: Tensor) -> bool:
        if isinstance(src.backend, RPCBackend):
            if src.backend.conn is not self.dev.conn:  # another peer (or session)
                return False
            self._flush_reads()
            self.conn.call(Cmd.COPY_TENSOR, tensor_bytes(src), tensor_bytes(dst), subj=dst.name)
            return True
        host = src.backend.host_array(src) if self.dev.async_copy else None
        if host is None:
            return False
        # the producer's compute is complete when its graph_compute returned (host devices run
        # synchronously), so its bytes can go as they are; SET_TENSOR is one-way
        self.set_tensor(dst, host)
        return True

    def stage_read(self, tensor: Tensor):
        """A region of the connection's staging arena to read `tensor` into (the read travels
        with the producing graph), or None: async copies off, or no room without waiting."""
        if not self.dev.async_copy:
            return None
        if self.conn.broken:
            raise RPCError(self.conn.broken)
        return self.dev.conn.arena.reserve(tensor.nbytes)  # the session's, shared by its lanes

    # --- compute ---------------------------------------------------------------------------------
    def graph_compute(self, graph: Graph, reads=()) -> None:
        """Sends the graph (or re-runs it by uid) and, under the same send lock, the reads that
        belong to it, so no other thread's graph can come between them on the wire."""
        self._flush_reads()
        self._fence()
        conn = self.conn
        with conn.send_lock:
            if conn.last_graph.get(self.dev.device) == graph.uid:
                conn.send(Cmd.GRAPH_RECOMPUTE, [RECOMPUTE.pack(self.dev.device, 0, graph.uid)], locked=True,
                          subj=str(graph.uid) if trace.enabled else "")
            else:
                payload = self.dev._encoded.get(graph.uid)
                if payload is None:
                    payload = self.dev._encode(graph)
                conn.send(Cmd.GRAPH_COMPUTE, [payload], locked=True, subj=str(graph.uid) if trace.enabled else "")
                conn.last_graph[self.dev.device] = graph.uid
            if reads:
                self._send_reads(list(reads), locked=True)

    def synchronize(self) -> None:
        if self._reads or self._inflight:
            self._flush_reads()  # their replies also report any earlier one-way failure
        else:
            self.conn.call(Cmd.SYNCHRONIZE, U32.pack(self.dev.device))


class RPCBackend(_Commands, RemoteDevice, Backend):
    # the peer runs every command for a device on that device's one executor, in arrival order
    in_order = True
    compute_async = True

    def __init__(self, conn: Connection, device: int = 0, name: str = "RPC0",
                 settings: Optional[RpcSettings] = None):
        self.device = device
        self.name = name
        self.settings = settings if settings is not None else current_settings().rpc
        # split copies without host round trips of their own (PYLLAMA_RPC_NO_ASYNC_COPY=1: off)
        self.async_copy = self.settings.async_copy
        # per thread: every pipeline group uses this backend from its own decode thread
        self._local = threading.local()
        self._encoded: dict[int, bytes] = {}
        self._kind: Optional[int] = None  # the peer device's kind (GET_DEVICE_INFO), once asked
        self._peer_types: Optional[tuple[Connection, tuple[frozenset, frozenset]]] = None  # GET_DEVICE_TYPES
        # every buffer allocated here and not freed, to allocate again after a reconnect
        self._buffers: "weakref.WeakValueDictionary[int, RPCBuffer]" = weakref.WeakValueDictionary()
        self.layout = PeerLayout(self)
        self._lanes: "weakref.WeakSet[RPCLane]" = weakref.WeakSet()  # the pipeline groups' streams
        self._use(conn)

    @property
    def dev(self) -> "RPCBackend":
        return self

    def new_stream(self) -> Stream:
        """A pipeline group's stream: a lane of its own to the peer when the peer offers lanes (its
        steps then never wait behind another group's on the peer), else this default stream."""
        if not self.conn.has(Cap.LANES):
            return self
        lane = RPCLane(self, self.conn.open_lane())
        self._lanes.add(lane)
        return lane

    def _use(self, conn: Connection) -> None:
        self.conn = conn
        self.batched_get = conn.has(Cap.GET_TENSORS) and self.settings.batched_get
        self._encoded.clear()  # encoded graphs name the old connection's buffer ids

    def _thread_state(self):
        """This thread's queued and in-flight reads, which belong to one connection: after a
        reconnect a thread starts afresh instead of waiting for tickets of the old one."""
        local = self._local
        if getattr(local, "conn", None) is not self.conn:
            local.conn = self.conn
            local.reads = []     # queued by get_tensor_async, not sent yet
            local.inflight = []  # sent (with their tickets), replies still to be received
        return local

    @property
    def _reads(self) -> list[tuple[Tensor, np.ndarray]]:
        return self._thread_state().reads

    @property
    def _inflight(self) -> list[tuple[int, Cmd, list[tuple[Tensor, np.ndarray]]]]:
        return self._thread_state().inflight

    # --- a lost peer ---------------------------------------------------------------------------
    def lost(self) -> Optional[str]:
        return self.conn.check_peer()

    def reach(self) -> None:
        get_connection(self.conn.endpoint)

    def reconnect(self) -> list[Buffer]:
        """Continues on a new connection to the same endpoint (the process-wide one: opened here
        unless already reopened) and allocates every live buffer there again, each under its old
        Buffer object. Returns those buffers; their contents are lost. Raises RPCError when the
        peer cannot be reached or refuses, or lacks a capability this backend's graphs rely on.
        Nothing may use this backend meanwhile."""
        old = self.conn
        conn = get_connection(old.endpoint)
        if old.has(Cap.BACKEND_SAMPLING) and not conn.has(Cap.BACKEND_SAMPLING):
            raise RPCError(f"{old.endpoint}: the RPC server came back without backend sampling, which this "
                           "server's graphs use; restart it as it was")
        kind = self._kind
        held = self._peer_types[1][0] if self._peer_types else None
        self._use(conn)
        if held is not None and not held <= self.weight_types:  # weights were stored in those types
            raise RPCError(f"{old.endpoint}: the RPC server came back holding other weight types "
                           f"({', '.join(sorted(t.name for t in self.weight_types))}); restart it as it was")
        if kind is not None:
            self.device_info()
            if self._kind != kind:  # the weights were converted for the old device's kind
                raise RPCError(f"{old.endpoint}: the RPC server came back serving a {_KIND_NAMES.get(self._kind, '?')} "
                               f"device instead of {_KIND_NAMES.get(kind, '?')}; restart it as it was")
        buffers = sorted(self._buffers.values(), key=lambda b: b.id)
        for buf in buffers:
            rep = conn.call(Cmd.ALLOC_BUFFER, ALLOC_REQ.pack(self.device, USAGE.get(buf.usage, 0), buf.size))
            buf.remote_id, got = ALLOC_REP.unpack(rep)
            if got < buf.size:
                raise RPCError(f"{old.endpoint}: ALLOC_BUFFER gave {got} of {buf.size} bytes")
        for lane in list(self._lanes):  # every group's lane, bound to the new session
            lane.reopen(conn)
        return list(buffers)

    # --- buffers -------------------------------------------------------------------------------
    def alloc_buffer(self, size: int, usage: str = "compute") -> Buffer:
        rep = self.conn.call(Cmd.ALLOC_BUFFER, ALLOC_REQ.pack(self.device, USAGE.get(usage, 0), size))
        remote_id, got = ALLOC_REP.unpack(rep)
        buf = RPCBuffer(self, got, usage, remote_id)
        self._buffers[buf.id] = buf
        return buf

    def free_buffer(self, buffer: Buffer) -> None:
        self._buffers.pop(buffer.id, None)
        if self.conn.broken:  # the peer freed it with the connection
            return
        try:
            self._flush_reads()
            self.conn.call(Cmd.FREE_BUFFER, U64.pack(buffer.remote_id))  # type: ignore[attr-defined]
        except RPCError:
            if not self.conn.broken:  # a refusal, not a lost peer (which freed it anyway)
                raise

    def disconnect(self) -> None:
        """Closes the connection: whoever waits on it gets an error at once, and the peer frees
        everything this process had there."""
        self.conn.close()

    def clear_buffer(self, buffer: Buffer, value: int = 0) -> None:
        self._flush_reads()
        self.conn.call(Cmd.BUFFER_CLEAR, U64.pack(buffer.remote_id) + bytes([value & 0xFF]))  # type: ignore[attr-defined]

    def can_copy_from(self, src: Backend) -> bool:
        if isinstance(src, RPCBackend):
            return src.conn is self.conn
        # a host-memory producer: the SET_TENSOR goes out of its bytes in place, no staging
        return self.async_copy and src.host_memory

    def _encode(self, graph: Graph) -> bytes:
        def remote_id(buf: Buffer) -> int:
            if buf is None or buf.backend is not self:
                raise ValueError(f"a graph tensor is not on {self.name}")
            return buf.remote_id  # type: ignore[attr-defined]

        tensors, nodes = graph_tables(graph, remote_id)
        payload = encode_graph(self.device, graph.uid, tensors, nodes)
        if len(self._encoded) >= _GRAPH_CACHE:
            self._encoded.pop(next(iter(self._encoded)))
        self._encoded[graph.uid] = payload
        return payload

    # --- information -------------------------------------------------------------------------
    def device_info(self) -> DeviceInfo:
        name, kind, _, free, total = DEVICE_INFO.unpack(self.conn.call(Cmd.GET_DEVICE_INFO, U32.pack(self.device)))
        self._kind = kind
        desc = name.rstrip(b"\0").decode("utf-8", "replace")
        return DeviceInfo(self.name, "rpc", f"{desc} ({_KIND_NAMES.get(kind, '?')}) at {self.conn.endpoint}", free, total)

    def refusal_hint(self) -> str:
        return f"the RPC server at {self.conn.endpoint}; update that server"

    def supports(self, op: int) -> bool:
        if op in (Op.LAYER_NORM, Op.GELU):  # no capability announces them yet: a peer may predate them
            return False
        if op == Op.MUL_MAT_CAT:  # servers that negotiate weight types run it, on a CPU device
            return self.conn.has(Cap.DEVICE_TYPES) and self.device_kind() == KIND["cpu"]
        if op == Op.MOE_FFN:  # servers that advertise it run it, on a CPU device
            return self.conn.has(Cap.MOE_FFN) and self.device_kind() == KIND["cpu"]
        if op == Op.LORA:  # likewise
            return self.conn.has(Cap.LORA) and self.device_kind() == KIND["cpu"]
        if op in FAMILY_OPS or op == Op.MLA_ATTENTION:  # likewise (ATTENTION's and MOE_FFN's extensions too)
            return self.conn.has(Cap.FAMILY_OPS) and self.device_kind() == KIND["cpu"]
        return op != Op.SAMPLE or self.conn.has(Cap.BACKEND_SAMPLING)

    @property
    def small_batches_cheap(self) -> bool:  # type: ignore[override]
        return self.device_kind() == KIND["cpu"]

    def device_kind(self) -> int:
        """The peer device's kind (protocol KIND), asked once."""
        if self._kind is None:
            self.device_info()
        return self._kind  # type: ignore[return-value]

    @property
    def kv_types(self) -> frozenset:  # type: ignore[override]
        """A CPU peer holds every KV cache type, a GPU peer F32 only (as the local CUDA backend)."""
        if self._kind is None:
            self.device_info()
        return frozenset({DType.F32}) if self._kind == KIND["cuda"] else KV_CACHE_TYPES

    def peer_types(self) -> Optional[tuple[frozenset, frozenset]]:
        """(weight types, KV cache types) the peer's device holds, asked once per connection
        (GET_DEVICE_TYPES); None from a peer without the DEVICE_TYPES capability."""
        conn = self.conn
        if not conn.has(Cap.DEVICE_TYPES):
            return None
        cached = self._peer_types
        if cached is not None and cached[0] is conn:
            return cached[1]
        rep = conn.call(Cmd.GET_DEVICE_TYPES, U32.pack(self.device))
        n_w, n_kv = DEVICE_TYPES_HEAD.unpack_from(rep)
        if n_w > MAX_DEVICE_TYPES or n_kv > MAX_DEVICE_TYPES or len(rep) != DEVICE_TYPES_HEAD.size + 4 * (n_w + n_kv):
            raise RPCError(f"{conn.endpoint}: malformed GET_DEVICE_TYPES reply ({len(rep)} bytes)")
        ids = struct.unpack_from(f"<{n_w + n_kv}I", rep, DEVICE_TYPES_HEAD.size)
        types = (frozenset(_known_types(ids[:n_w])), frozenset(_known_types(ids[n_w:])))
        self._peer_types = (conn, types)
        return types

    @property
    def weight_types(self) -> frozenset:  # type: ignore[override]
        """The weight types the peer computes on as stored: as it says (DEVICE_TYPES), else what
        peers without that capability hold (F32 on a CPU; F32, F16, BF16 on a GPU)."""
        types = self.peer_types()
        if types is not None:
            return types[0]
        if self._kind is None:
            self.device_info()
        return frozenset({DType.F32, DType.F16, DType.BF16}) if self._kind == KIND["cuda"] else frozenset({DType.F32})


class RPCLane(_Commands, Stream):
    """A pipeline group's stream on a peer's device: a connection of its own bound to the device's
    session (LANES), so the peer runs this group's commands on an executor of their own. Used by
    one decode thread; a command that depends on what the session's connection wrote (weights,
    restored KV rows) first waits until the peer has run those writes (`Connection.fence`)."""

    def __init__(self, device: RPCBackend, conn: Connection):
        self.dev = device
        self.conn = conn
        self._state: tuple[Connection, list, list] = (conn, [], [])

    @property
    def backend(self) -> RPCBackend:
        return self.dev

    def _fence(self) -> None:
        self.dev.conn.fence()

    def _queues(self) -> tuple[Connection, list, list]:
        if self._state[0] is not self.conn:  # after a reconnect: nothing of the old lane is awaited
            self._state = (self.conn, [], [])
        return self._state

    @property
    def _reads(self) -> list[tuple[Tensor, np.ndarray]]:
        return self._queues()[1]

    @property
    def _inflight(self) -> list[tuple[int, Cmd, list[tuple[Tensor, np.ndarray]]]]:
        return self._queues()[2]

    def set_tensor_async(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        self.set_tensor(tensor, data, offset)

    def forget_graph(self, uid: int) -> None:
        self.dev.forget_graph(uid)

    def reopen(self, session: Connection) -> None:
        """Continues on a new lane of `session` (the device's connection after a reconnect)."""
        old, self.conn = self.conn, session.open_lane()
        old.close()

    def release(self) -> None:
        self.conn.close()


def _known_types(ids) -> list[DType]:
    """The type ids a peer listed that this side knows (an unknown one it cannot be sent anyway)."""
    out = []
    for i in ids:
        try:
            out.append(DType(i))
        except ValueError:
            pass
    return out


__all__ = ["RPCBackend", "RPCBuffer", "RPCError", "RPCLane", "tensor_bytes"]
