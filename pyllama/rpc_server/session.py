"""One connection's state on the server and the handlers of its commands.

A Session holds what a connection owns: its buffers (id -> Buffer), the last graph per device
(decoded once, re-run by GRAPH_RECOMPUTE), and the first failure of a one-way command until the
next replying command reports it. Handlers run on the connection's executor thread (a few
informational ones run on the event loop while nothing of the connection is queued).

A lane (a further connection bound with BIND_SESSION) is a Session of its own whose buffer table is
its owner's: it keeps its own graphs and its own pending failure, and uses the owner's buffers.
The table is a dict that each lane's executor reads while the owner's adds and removes entries
(single dict operations, atomic in CPython); a lane drops its graphs that name a freed buffer the
next time it computes (the owner counts its frees).

Everything a request names is checked before anything is allocated or written (docs/rpc-protocol.md,
"Validation"): Python integers never wrap, and the codec checks graph structure in 64-bit
arithmetic with explicit overflow tests.
"""
from __future__ import annotations

from collections import OrderedDict

import logging
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

import numpy as np

from .._fast import wire
from ..backend.base import Buffer, DType, Tensor
from ..backend.cpu import CPUBackend
from ..ir.tensor import OP_TABLE, Graph, Node, Op, check_node, family_node, src_roles
from ..rpc import protocol as P
from ..rpc.protocol import Cap, Cmd
from ..obs.trace import now as now_us
from .cache import CACHE_MIN_BYTES, as_bytes_view

if TYPE_CHECKING:
    from .device import Device
    from .server import RPCServer

log = logging.getLogger("pyllama.rpc_server")

TENSOR_SIZE = P.TENSOR.itemsize                                       # 104
REGION_ENTRY = np.dtype([("tensor", P.TENSOR), ("offset", "<u8"), ("size", "<u8")])  # 120
SET_HEAD = TENSOR_SIZE + P.U64.size                                   # SET_TENSOR: tensor | offset
GET_REQ = TENSOR_SIZE + P.REGION.size                                 # tensor | offset | size
HASH_REQ = GET_REQ + 32                                               # ... | sha256
CLEAR_REQ = struct.Struct("<QB")                                      # buffer_id, value
MAX_GET_TENSORS = 1 << 16                                             # entries in one GET_TENSORS
USAGE_NAMES = {v: k for k, v in P.USAGE.items()}
INT32_MAX = 2**31 - 1

SAMPLE_MAX_PROBS = 4096
SAMPLE_MAX_WINDOW = 1 << 20
ATTN_INT_PARAMS = 5  # n_head, n_head_kv, head_dim, n_rot, rope_mode travel as f64


class CommandError(Exception):
    """A request the server refuses; the message goes back to the client."""


class Frame(bytearray):
    """A reply that a handler built whole (header included), to copy large payloads only once.
    `charge`: (device, bytes) reserved against the device's cap for it, released by the connection
    once the reply has left (or the connection closed)."""

    charge: Optional[tuple["Device", int]] = None


def frame(status: int, payload: bytes = b"") -> bytes:
    return P.HEADER.pack(status, len(payload)) + payload


# Decoded graphs kept per connection, as many as a context keeps plans. Each pipeline group's steps
# take dozens of shapes while prompts and generations mix (a prompt chunk plus 0..n decode rows),
# and the groups' graphs alternate on the wire: keeping 16, the peer of a 2-group medium split
# decoded 24 of its 88 graphs of a 32-user run a second time (2-3 ms each, against a ~12 ms stage).
# The byte bound caps what a client can make the server hold whatever its graphs' sizes (a decoded
# graph takes some ten times its payload; the newest graph always stays).
RECENT_GRAPHS = 128
RECENT_GRAPH_BYTES = 32 << 20


@dataclass
class StoredGraph:
    uid: int
    payload: bytes
    graph: Graph
    buffers: frozenset
    written: tuple = ()   # the tensors its nodes write (outputs, ATTENTION's caches)


def _name(raw: bytes) -> str:
    return bytes(raw).split(b"\0", 1)[0].decode("utf-8", "replace")


def _expect(payload, size: int, what: str) -> None:
    if len(payload) != size:
        raise CommandError(f"{what}: payload of {len(payload)} bytes, expected {size}")


def _make_tensor(dtype: DType, shape: tuple, name: str, buf: Buffer, offset: int, nbytes: int) -> Tensor:
    t = Tensor.__new__(Tensor)
    t.dtype, t.shape, t.name, t.buffer, t.offset, t.nbytes = dtype, shape, name, buf, offset, nbytes
    return t


def _byte_view(t: Tensor, offset: int, size: int) -> Tensor:
    """The bytes [offset, offset + size) of `t` as a 1-D I8 tensor (already checked to fit)."""
    return _make_tensor(DType.I8, (size,), t.name, t.buffer, t.offset + offset, size)


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors share a byte (empty ones share none)."""
    return (a.buffer is b.buffer and a.nbytes > 0 and b.nbytes > 0
            and a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes)


def _written_by(graph: Graph) -> tuple:
    """Each tensor the nodes of `graph` write, once."""
    seen: dict[tuple[int, int, int], Tensor] = {}
    for nd in graph.nodes:
        for t in (nd.out,) + ((nd.srcs[1], nd.srcs[2]) if nd.op == Op.ATTENTION else ()):
            seen.setdefault((id(t.buffer), t.offset, t.nbytes), t)
    return tuple(seen.values())


def describe(exc: BaseException) -> str:
    if isinstance(exc, (CommandError, ValueError, IndexError)):
        return str(exc)
    if isinstance(exc, MemoryError):
        return str(exc) or "out of memory"
    return f"{type(exc).__name__}: {exc}"


def log_failure(peer: str, cmd: Cmd, exc: BaseException) -> None:
    if isinstance(exc, (CommandError, ValueError, IndexError, MemoryError, OverflowError)):
        log.warning("%s: %s refused: %s", peer, cmd.name, describe(exc))
    else:
        log.error("%s: %s failed", peer, cmd.name, exc_info=exc)


class Session:
    """The state of one connection, touched only by its device's executor (or the loop while idle)."""

    def __init__(self, server: "RPCServer", peer: str):
        self.server = server
        self.peer = peer
        self.buffers: dict[int, tuple[Buffer, "Device"]] = {}
        self.owner: Optional["Session"] = None  # a lane: the session whose buffers it uses
        self.frees = 0                          # FREE_BUFFERs run (lanes compare it with what they saw)
        self._seen_frees = 0
        self.graphs: dict[int, StoredGraph] = {}   # device index -> last graph
        # recently decoded graphs by (device, uid): pipeline groups alternate their graphs on one
        # connection, and re-decoding and re-binding each one every step costs the server a lot
        self.recent: "OrderedDict[tuple[int, int], StoredGraph]" = OrderedDict()
        self.pending: Optional[str] = None          # the first one-way failure not yet reported
        self._more_failures = 0                     # one-way failures after it
        self.closed = False
        self.last_nodes = 0                         # nodes of the graph the last command ran (tracing)
        self._handlers: dict[Cmd, Callable] = {
            Cmd.HELLO: self._hello_again,
            Cmd.DEVICE_COUNT: self._device_count,
            Cmd.GET_DEVICE_INFO: self._device_info,
            Cmd.ALLOC_BUFFER: self._alloc,
            Cmd.FREE_BUFFER: self._free,
            Cmd.BUFFER_CLEAR: self._clear,
            Cmd.SET_TENSOR: self._set_tensor,
            Cmd.SET_TENSOR_HASH: self._set_tensor_hash,
            Cmd.GET_TENSOR: self._get_tensor,
            Cmd.GET_TENSORS: self._get_tensors,
            Cmd.COPY_TENSOR: self._copy_tensor,
            Cmd.GRAPH_COMPUTE: self._graph_compute,
            Cmd.GRAPH_RECOMPUTE: self._graph_recompute,
            Cmd.SYNCHRONIZE: self._synchronize,
            Cmd.TRACE_SYNC: self._trace_sync,
            Cmd.AUTH: self._auth_again,
            Cmd.GET_DEVICE_TYPES: self._device_types,
            Cmd.DEVICE_BUSY: self._device_busy,
        }

    # --- dispatch ------------------------------------------------------------------------------
    def execute(self, cmd: Cmd, payload, t_recv: int) -> Optional[Union[bytes, bytearray]]:
        """Runs one command; returns the whole reply frame, or None for a one-way command."""
        handler = self._handlers[cmd]
        self.last_nodes = 0
        if cmd in P.ONE_WAY:
            try:
                handler(payload, t_recv)
            except Exception as exc:  # noqa: BLE001 - any failure becomes the connection's pending error
                log_failure(self.peer, cmd, exc)
                if self.pending is None:
                    self.pending = f"{cmd.name} failed: {describe(exc)}"
                else:
                    self._more_failures += 1
            return None
        earlier = self.earlier_error()
        if earlier is not None:
            return earlier
        try:
            out = handler(payload, t_recv)
        except Exception as exc:  # noqa: BLE001 - any failure is an error reply, the server keeps serving
            log_failure(self.peer, cmd, exc)
            return frame(P.STATUS_ERROR, f"{cmd.name}: {describe(exc)}".encode("utf-8", "replace"))
        if isinstance(out, Frame):
            return out
        return frame(P.STATUS_OK, out)

    def earlier_error(self) -> Optional[bytes]:
        """The reply that reports a failed one-way command (then forgotten), or None: a replying
        command answers with it instead of running."""
        if self.pending is None:
            return None
        msg, self.pending = self.pending, None
        if self._more_failures:
            msg += f" (and {self._more_failures} later one-way command(s) failed too)"
            self._more_failures = 0
        return frame(P.STATUS_EARLIER_ERROR, msg.encode("utf-8", "replace"))

    def bind(self, owner: "Session") -> None:
        """Makes this (fresh) session a lane of `owner`: its buffers are the owner's from now on."""
        self.owner = owner
        self.buffers = owner.buffers
        self._seen_frees = owner.frees

    @property
    def fresh(self) -> bool:
        """Nothing allocated, computed or failed yet: the state BIND_SESSION requires."""
        return not self.buffers and not self.recent and self.pending is None and self.owner is None

    def release(self, device: "Device") -> None:
        """Frees everything this connection holds on `device` (runs on its executor at close; a
        lane's buffers are its owner's, which frees them)."""
        self.graphs.pop(device.index, None)
        for key in [k for k in list(self.recent) if k[0] == device.index]:
            stored = self.recent.pop(key, None)  # (a closing session's job may release a lane too)
            if stored is not None:
                device.forget_graph(stored.graph.uid)
        if self.owner is not None:
            return
        for bid in [b for b, (_, dev) in self.buffers.items() if dev is device]:
            buf, _ = self.buffers.pop(bid)
            device.free(buf)

    # --- lookups -------------------------------------------------------------------------------
    def _device(self, index: int) -> "Device":
        devices = self.server.devices
        if index >= len(devices):
            raise CommandError(f"device {index} does not exist (the server has {len(devices)})")
        return devices[index]

    def _buffer(self, bid: int, what: str) -> tuple[Buffer, "Device"]:
        entry = self.buffers.get(bid)
        if entry is None:
            raise CommandError(f"{what}: buffer {bid} is not a live buffer of this connection")
        return entry

    def _need(self, cap: Cap, cmd: Cmd) -> None:
        if not self.server.capabilities & cap:
            raise CommandError(f"{cmd.name} is not advertised by this server")

    def _tensor(self, rec, what: str) -> tuple[Tensor, "Device"]:
        """A wire tensor record checked whole: dims, dtype, size, live buffer, region inside it.
        `rec` is a P.TENSOR record or the tuple of its fields as Python values, in P.TENSOR's order
        (a graph's records are converted column by column: reading each record's fields one by one
        was a quarter of the time a graph took to decode)."""
        if not isinstance(rec, tuple):
            bid, off, dtype, nd, dims, raw = rec.item()
            rec = (bid, off, dtype, nd, dims.tolist(), raw)  # the shape field comes as an array
        bid, off, dtype, nd, dims, raw = rec
        name = _name(raw)
        if not 1 <= nd <= P.MAX_DIMS:
            raise CommandError(f"{what} {name!r}: n_dims {nd} is not in 1..{P.MAX_DIMS}")
        if any(dims[nd:]):
            raise CommandError(f"{what} {name!r}: unused shape entries {dims[nd:]} are not 0")
        shape = tuple(dims[:nd])
        try:
            nbytes = wire.tensor_nbytes(dtype, shape)
        except ValueError as exc:
            raise CommandError(f"{what} {name!r}: {exc}") from None
        buf, dev = self._buffer(bid, f"{what} {name!r}")
        if off > buf.size or nbytes > buf.size - off:
            raise CommandError(f"{what} {name!r}: bytes [{off}, {off + nbytes}) lie outside buffer {buf.id} "
                               f"of {buf.size} B")
        return _make_tensor(DType(dtype), shape, name, buf, off, nbytes), dev

    @staticmethod
    def _region(t: Tensor, offset: int, size: int, what: str) -> Tensor:
        if offset > t.nbytes or size > t.nbytes - offset:
            raise CommandError(f"{what} {t.name!r}: bytes [{offset}, {offset + size}) lie outside the tensor "
                               f"of {t.nbytes} B")
        return _byte_view(t, offset, size)

    # --- informational commands ------------------------------------------------------------------
    def _hello_again(self, payload, t_recv: int) -> bytes:
        raise CommandError("HELLO was already exchanged on this connection")

    def _auth_again(self, payload, t_recv: int) -> bytes:
        self._need(Cap.AUTH, Cmd.AUTH)
        raise CommandError("this connection is already authenticated")

    def _device_count(self, payload, t_recv: int) -> bytes:
        _expect(payload, 0, "DEVICE_COUNT")
        return P.U32.pack(len(self.server.devices))

    def _device_info(self, payload, t_recv: int) -> bytes:
        _expect(payload, P.U32.size, "GET_DEVICE_INFO")
        dev = self._device(P.U32.unpack(payload)[0])
        free, total = dev.memory()
        name = dev.name.encode("utf-8")[:63].decode("utf-8", "ignore").encode("utf-8")
        return P.DEVICE_INFO.pack(name, dev.kind, 0, free, total)

    def _device_types(self, payload, t_recv: int) -> bytes:
        self._need(Cap.DEVICE_TYPES, Cmd.GET_DEVICE_TYPES)
        _expect(payload, P.U32.size, "GET_DEVICE_TYPES")
        dev = self._device(P.U32.unpack(payload)[0])
        weights, kv = sorted(int(t) for t in dev.weight_types), sorted(int(t) for t in dev.kv_types)
        return P.DEVICE_TYPES_HEAD.pack(len(weights), len(kv)) + struct.pack(f"<{len(weights) + len(kv)}I", *weights, *kv)

    def _device_busy(self, payload, t_recv: int) -> bytes:
        self._need(Cap.DEVICE_BUSY, Cmd.DEVICE_BUSY)
        _expect(payload, P.BUSY_REQ.size, "DEVICE_BUSY")
        device, _, since = P.BUSY_REQ.unpack(payload)
        clock = getattr(self._device(device).backend, "busy", None)
        if clock is None:
            raise CommandError(f"device {device} does not record its busy time")
        at = now_us()
        spans = clock.spans(since, at, P.MAX_BUSY_SPANS)
        head = P.BUSY_HEAD.pack(t_recv, at, clock.total_us(at), len(spans), 0)
        return head + b"".join(P.BUSY_SPAN.pack(a, b) for a, b in spans)

    def _trace_sync(self, payload, t_recv: int) -> bytes:
        self._need(Cap.TRACE_SYNC, Cmd.TRACE_SYNC)
        _expect(payload, P.U64.size, "TRACE_SYNC")
        return P.TRACE_REP.pack(t_recv, now_us())

    def _synchronize(self, payload, t_recv: int) -> bytes:
        _expect(payload, P.U32.size, "SYNCHRONIZE")
        self._device(P.U32.unpack(payload)[0]).backend.synchronize()
        return b""

    # --- buffers ---------------------------------------------------------------------------------
    def _alloc(self, payload, t_recv: int) -> bytes:
        _expect(payload, P.ALLOC_REQ.size, "ALLOC_BUFFER")
        device, usage, size = P.ALLOC_REQ.unpack(payload)
        dev = self._device(device)
        if usage not in USAGE_NAMES:
            raise CommandError(f"unknown buffer usage {usage} (0 compute, 1 weights, 2 kv)")
        buf = dev.alloc(size, USAGE_NAMES[usage])
        self.buffers[buf.id] = (buf, dev)
        log.debug("%s: buffer %d of %d B (%s) on %s", self.peer, buf.id, size, USAGE_NAMES[usage], dev.name)
        return P.ALLOC_REP.pack(buf.id, buf.size)

    def _free(self, payload, t_recv: int) -> bytes:
        _expect(payload, P.U64.size, "FREE_BUFFER")
        bid = P.U64.unpack(payload)[0]
        buf, dev = self._buffer(bid, "FREE_BUFFER")
        self._drop_graphs_using(bid)
        del self.buffers[bid]
        (self.owner or self).frees += 1
        dev.free(buf)
        return b""

    def _clear(self, payload, t_recv: int) -> bytes:
        _expect(payload, CLEAR_REQ.size, "BUFFER_CLEAR")
        bid, value = CLEAR_REQ.unpack(payload)
        buf, dev = self._buffer(bid, "BUFFER_CLEAR")
        dev.backend.clear_buffer(buf, value)
        return b""

    # --- tensor data -----------------------------------------------------------------------------
    def _set_tensor(self, payload, t_recv: int) -> None:
        n = len(payload)
        if n < SET_HEAD:
            raise CommandError(f"payload of {n} bytes is shorter than tensor + offset ({SET_HEAD})")
        t, dev = self._tensor(np.frombuffer(payload, P.TENSOR, 1)[0], "SET_TENSOR")
        off = P.U64.unpack_from(payload, TENSOR_SIZE)[0]
        size = n - SET_HEAD
        view = self._region(t, off, size, "SET_TENSOR")
        if size:
            dev.backend.set_tensor(view, np.frombuffer(payload, np.uint8, size, SET_HEAD))
        cache = self.server.cache
        # weights only: a hidden state or cache rows are never asked for again by hash
        if cache is not None and size >= CACHE_MIN_BYTES and t.buffer is not None and t.buffer.usage == "weights":
            cache.store_async(as_bytes_view(payload)[SET_HEAD:])

    def _set_tensor_hash(self, payload, t_recv: int) -> bytes:
        self._need(Cap.SET_TENSOR_HASH, Cmd.SET_TENSOR_HASH)
        _expect(payload, HASH_REQ, "SET_TENSOR_HASH")
        t, dev = self._tensor(np.frombuffer(payload, P.TENSOR, 1)[0], "SET_TENSOR_HASH")
        off, size = P.REGION.unpack_from(payload, TENSOR_SIZE)
        view = self._region(t, off, size, "SET_TENSOR_HASH")
        digest = bytes(payload[GET_REQ:HASH_REQ])
        cache = self.server.cache
        if cache is None:
            return b"\0"
        # written in place below, past the backend's set_tensor: a repacked copy of a weight there
        # would otherwise stay and the next graph compute with the old bytes
        dev.backend.layout.drop_weights([view])
        if isinstance(dev.backend, CPUBackend):  # straight into the buffer
            found = cache.read_into(digest, memoryview(CPUBackend.bytes_of(view)))
        else:
            tmp = np.empty(size, np.uint8)
            found = cache.read_into(digest, memoryview(tmp))
            if found:
                dev.backend.set_tensor(view, tmp)
        return b"\1" if found else b"\0"

    def _get_tensor(self, payload, t_recv: int) -> Frame:
        _expect(payload, GET_REQ, "GET_TENSOR")
        t, dev = self._tensor(np.frombuffer(payload, P.TENSOR, 1)[0], "GET_TENSOR")
        off, size = P.REGION.unpack_from(payload, TENSOR_SIZE)
        view = self._region(t, off, size, "GET_TENSOR")
        return self._read_frame([(view, dev)], size, "GET_TENSOR reply")

    def _get_tensors(self, payload, t_recv: int) -> Frame:
        self._need(Cap.GET_TENSORS, Cmd.GET_TENSORS)
        n = len(payload)
        if n < P.U32.size:
            raise CommandError(f"payload of {n} bytes has no count")
        count = P.U32.unpack_from(payload)[0]
        if count > MAX_GET_TENSORS:
            raise CommandError(f"{count} regions in one request (at most {MAX_GET_TENSORS})")
        need = P.U32.size + count * REGION_ENTRY.itemsize
        if n != need:
            raise CommandError(f"payload of {n} bytes, {count} regions need {need}")
        ceiling = self.server.max_read
        entries = np.frombuffer(payload, REGION_ENTRY, count, P.U32.size)
        views, total = [], 0
        for i in range(count):
            e = entries[i]
            t, dev = self._tensor(e["tensor"], f"GET_TENSORS entry {i}")
            off, size = int(e["offset"]), int(e["size"])
            views.append((self._region(t, off, size, f"GET_TENSORS entry {i}"), dev))
            total += size
            if total > ceiling:
                raise CommandError(f"the regions add up to more than the {ceiling} B a reply may carry")
        return self._read_frame(views, total, f"a reply of {count} regions")

    def _read_frame(self, views: list[tuple[Tensor, "Device"]], total: int, what: str) -> Frame:
        """The reply carrying the bytes of `views`, counted against the cap (refused before it is
        allocated) until the connection has sent it."""
        dev = views[0][1] if views else self.server.devices[0]
        size = P.HEADER.size + total
        dev.reserve(size, what)
        try:
            out = Frame(size)
        except BaseException:
            dev.release(size)
            raise
        out.charge = (dev, size)
        P.HEADER.pack_into(out, 0, P.STATUS_OK, total)
        pos = P.HEADER.size
        for view, dev in views:
            if view.nbytes:
                dev.backend.get_tensor(view, out=np.frombuffer(out, np.uint8, view.nbytes, pos))
                pos += view.nbytes
        return out

    def _copy_tensor(self, payload, t_recv: int) -> bytes:
        _expect(payload, 2 * TENSOR_SIZE, "COPY_TENSOR")
        recs = np.frombuffer(payload, P.TENSOR, 2)
        src, sdev = self._tensor(recs[0], "COPY_TENSOR source")
        dst, ddev = self._tensor(recs[1], "COPY_TENSOR destination")
        if sdev is not ddev:
            raise CommandError("COPY_TENSOR between devices is not supported")
        if src.nbytes > dst.nbytes:
            raise CommandError(f"COPY_TENSOR: source {src.name!r} ({src.nbytes} B) is larger than destination "
                               f"{dst.name!r} ({dst.nbytes} B)")
        s, d = _byte_view(src, 0, src.nbytes), _byte_view(dst, 0, src.nbytes)
        if not ddev.backend.cpy_tensor_async(s, d):
            ddev.backend.set_tensor(d, ddev.backend.get_tensor(s))
        ddev.backend.synchronize()
        return b""

    # --- graphs ----------------------------------------------------------------------------------
    def _graph_compute(self, payload, t_recv: int) -> None:
        if len(payload) < P.GRAPH_HEAD.size:
            raise CommandError(f"payload of {len(payload)} bytes is shorter than the graph head")
        device, _, uid, _, _ = P.GRAPH_HEAD.unpack_from(payload)
        dev = self._device(device)
        self._drop_stale_graphs()
        data = payload if isinstance(payload, bytes) else bytes(payload)
        self.graphs.pop(device, None)  # a refused graph still replaces the last one
        stored = self.recent.get((device, uid))
        if stored is None or stored.payload != data:
            self._forget((device, uid))
            graph, bufs = self._build_graph(dev, data)
            stored = StoredGraph(uid, data, graph, bufs, _written_by(graph))
            self.recent[(device, uid)] = stored
            self._trim_recent()
        else:
            self.recent.move_to_end((device, uid))
        self.graphs[device] = stored
        self._compute(dev, stored)

    def _graph_recompute(self, payload, t_recv: int) -> None:
        _expect(payload, P.RECOMPUTE.size, "GRAPH_RECOMPUTE")
        device, _, uid = P.RECOMPUTE.unpack(payload)
        dev = self._device(device)
        self._drop_stale_graphs()
        stored = self.graphs.get(device)
        if stored is None or stored.uid != uid:
            last = "none" if stored is None else stored.uid
            raise CommandError(f"graph {uid} is not the last graph of device {device} on this connection "
                               f"(that is {last})")
        self.recent.move_to_end((device, uid))  # a re-run graph is recently used too
        self._compute(dev, stored)

    def _compute(self, dev: "Device", stored: StoredGraph) -> None:
        self.last_nodes = len(stored.graph.nodes)
        try:
            dev.backend.graph_compute(stored.graph)
        finally:
            # a graph may write where a weight lies (no real one does): its repacked copy is stale
            dev.backend.layout.drop_weights(stored.written)

    def _trim_recent(self) -> None:
        """Forgets the least recently run graphs beyond RECENT_GRAPHS or RECENT_GRAPH_BYTES."""
        size = sum(len(g.payload) for g in self.recent.values())
        while len(self.recent) > 1 and (len(self.recent) > RECENT_GRAPHS or size > RECENT_GRAPH_BYTES):
            key = next(iter(self.recent))
            size -= len(self.recent[key].payload)
            self._forget(key)

    def _forget(self, key: tuple[int, int]) -> None:
        stored = self.recent.pop(key, None)
        if stored is not None:
            if self.graphs.get(key[0]) is stored:
                del self.graphs[key[0]]
            self.server.devices[key[0]].forget_graph(stored.graph.uid)

    def _drop_graphs_using(self, bid: int) -> None:
        for key in [k for k, g in self.recent.items() if bid in g.buffers]:
            self._forget(key)

    def _drop_stale_graphs(self) -> None:
        """A lane forgets its graphs that name a buffer another lane of its session freed since."""
        shared = self.owner or self
        if shared.frees == self._seen_frees:
            return
        self._seen_frees = shared.frees
        for key in [k for k, g in self.recent.items() if not all(b in self.buffers for b in g.buffers)]:
            self._forget(key)

    def _build_graph(self, dev: "Device", payload: bytes) -> tuple[Graph, frozenset]:
        """Decodes and checks a whole graph; refuses it whole on the first problem."""
        try:
            _, _, tens, nodes = wire.decode_graph(payload)
        except ValueError as exc:
            raise CommandError(f"malformed graph: {exc}") from None
        tensors: list[Tensor] = []
        bufs: set[int] = set()
        for i, rec in enumerate(zip(*(tens[f].tolist() for f in P.TENSOR.names))):
            t, tdev = self._tensor(rec, f"graph tensor {i}")
            if tdev is not dev:
                raise CommandError(f"graph tensor {i} {t.name!r} lives on {tdev.name}, the graph runs on {dev.name}")
            tensors.append(t)
            bufs.add(t.buffer.id)
        out_nodes: list[Node] = []
        ops, outs, nsrc = nodes["op"].tolist(), nodes["out"].tolist(), nodes["n_src"].tolist()
        srcs, params = nodes["src"].tolist(), nodes["params"].tolist()
        for j in range(len(ops)):
            try:
                op = Op(ops[j])
            except ValueError:
                raise CommandError(f"graph node {j}: unknown op code {ops[j]}") from None
            n = nsrc[j]
            out = tensors[outs[j]]
            ins = tuple(tensors[s] for s in srcs[j][:n])
            if op == Op.SAMPLE and not self.server.capabilities & Cap.BACKEND_SAMPLING:
                raise CommandError(f"graph node {j}: SAMPLE needs the BACKEND_SAMPLING capability, not advertised here")
            if op == Op.MOE_FFN and not self.server.capabilities & Cap.MOE_FFN:
                raise CommandError(f"graph node {j}: MOE_FFN needs the MOE_FFN capability, not advertised here")
            if op == Op.LORA and not self.server.capabilities & Cap.LORA:
                raise CommandError(f"graph node {j}: LORA needs the LORA capability, not advertised here")
            if not self.server.capabilities & Cap.FAMILY_OPS and family_node(op, params[j], n):
                raise CommandError(f"graph node {j}: {op.name} (or ATTENTION's soft-cap, window or scaled RoPE) "
                                   "needs the FAMILY_OPS capability, not advertised here")
            # the op table (pyllama.ir.tensor) states each op's sources and types, for every backend
            why = check_node(op, out.dtype, [t.dtype for t in ins], params[j], dev.weight_types)
            if why is not None:
                raise CommandError(f"graph node {j} ({op.name}): {why}")
            n_params = OP_TABLE[op].n_params
            p = params[j]
            self._check_params(j, op, p, n_params)
            self._check_index_aliasing(j, op, out, ins, p)
            out_nodes.append(Node(op, out, ins, tuple(p[:n_params])))
        return Graph(out_nodes), frozenset(bufs)

    @staticmethod
    def _check_index_aliasing(j: int, op: Op, out: Tensor, ins: tuple, params: list[float]) -> None:
        """Kernels check their index sources (GET_ROWS' ids, ATTENTION's positions and cache
        indices, SAMPLE's settings) once, then address memory with them while they write: a graph
        laying a written tensor (the output; ATTENTION's caches too) over an index source would
        move those addresses after the check (out-of-bounds reads and writes). No real graph does
        (a node's output never reuses the memory of its own sources, and the caches have buffers of
        their own)."""
        roles = src_roles(op, len(ins), params)
        written = [("output", out)] + ([("k_cache", ins[1]), ("v_cache", ins[2])] if op == Op.ATTENTION else [])
        for name, t in written:
            for role, src in zip(roles, ins):
                if role.dtypes == {DType.I32} and _overlap(t, src):
                    raise CommandError(f"graph node {j} ({op.name}): {name} {t.name!r} overlaps {role.name} "
                                       f"{src.name!r}, which the kernel reads while it writes")

    @staticmethod
    def _check_params(j: int, op: Op, p: list[float], n_used: int) -> None:
        for k in range(n_used, P.N_PARAMS):
            if p[k] != 0.0:
                raise CommandError(f"graph node {j} ({op.name}): unused parameter {k} is {p[k]}, not 0")
        for k in range(n_used):
            if not math.isfinite(p[k]):
                raise CommandError(f"graph node {j} ({op.name}): parameter {k} is {p[k]}")
        if op == Op.SAMPLE:
            n_probs, window = p[0], p[1]
            if n_probs != int(n_probs) or not 0 <= n_probs <= SAMPLE_MAX_PROBS \
                    or window != int(window) or not 0 <= window <= SAMPLE_MAX_WINDOW:
                raise CommandError(f"graph node {j} (SAMPLE): n_probs {n_probs} / window {window} out of range")
        if op == Op.ATTENTION:
            for k in range(ATTN_INT_PARAMS):
                if p[k] != int(p[k]) or not -INT32_MAX - 1 <= p[k] <= INT32_MAX:
                    raise CommandError(f"graph node {j} (ATTENTION): parameter {k} ({p[k]}) is not a 32-bit integer")
            h, hkv, hd = int(p[0]), int(p[1]), int(p[2])
            # the kernel indexes rows in 32-bit ints: keep (H + 2 Hkv) * head_dim inside them
            if h <= 0 or hkv <= 0 or hd <= 0 or (h + 2 * hkv) * hd > INT32_MAX:
                raise CommandError(f"graph node {j} (ATTENTION): head parameters ({h}, {hkv}, {hd}) out of range")
