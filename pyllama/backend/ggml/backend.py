"""A device of a llama.cpp rpc-server: its buffers hold pyllama's tensors at their offsets, and
each graph pyllama places there is lowered to ggml's ops (lower.py) and computed by the peer.

The peer serves one client at a time, so every device of an endpoint shares the process's one
connection to it (`ggml_connection`), and pipeline groups share it too: the peer runs their
commands in order. A graph seen before (by uid) is not lowered again while its attention keeps its
layout (the same groups of sequences over the same rounded cell counts): only the attention's
inputs go up (cell gathers and masks), and when its records are the last ones the device ran it
is re-run with GRAPH_RECOMPUTE (a decode step's graph repeats while its batch keeps its size).
Those inputs and the intermediate results live in two buffers of the device's own, grown as
graphs need; one lock keeps a graph's input upload, compute and the asking of its reads together,
so two groups never interleave on them, and the reads' replies are read after it (the peer answers
in order), while the next group sends its step.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..._fast.wire import fnv1a64
from ...obs import trace
from ...rpc.connection import RPCError
from ...ir.tensor import KV_CACHE_TYPES, WEIGHT_TYPES, Buffer, DType, Graph, Tensor
from ...util.errors import PyllamaError
from ..base import Backend, DeviceInfo
from ..host_sample import bind_sample
from ..layout import WeightLayout
from ..remote import RemoteDevice
from . import graph as G
from . import protocol as P
from .connection import GGMLConnection
from .lower import LOWERED_OPS, AttnSpec, GraphSources, Lowering, SampleTail

HOST_I32_MAX = 1 << 20   # I32 inputs up to this size keep a host copy (the attention's cell lists)
HASH_MIN_BYTES = 10 << 20   # a longer write first offers its FNV-1a hash to the peer's cache (rpc-server -c),
                            # as llama.cpp's client does (HASH_THRESHOLD): the peer writes the bytes it kept
_LOWERED_KEPT = 256      # lowerings kept (by graph uid and shape; the scheduler forgets graphs it drops)

_connections: dict[str, GGMLConnection] = {}   # endpoint -> the process's connection
_users: dict[int, int] = {}                     # id(connection) -> devices open on it
_connections_lock = threading.Lock()


def ggml_connection(endpoint: str) -> GGMLConnection:
    """The process's connection to a ggml peer (one: the peer serves one client at a time)."""
    with _connections_lock:
        conn = _connections.get(endpoint)
        if conn is None or conn.broken:
            conn = _connections[endpoint] = GGMLConnection(endpoint)
        return conn


def release_if_unused(endpoint: str) -> None:
    """Closes the process's connection to `endpoint` when no device is open on it (it was opened
    to count the peer's devices): the peer serves its next client."""
    with _connections_lock:
        conn = _connections.get(endpoint)
        if conn is None or _users.get(id(conn), 0) > 0:
            return
        del _connections[endpoint]
    conn.close()


def _release(conn: GGMLConnection) -> None:
    """One device of `conn` closed; the last one closes the connection (the peer then serves its
    next client)."""
    with _connections_lock:
        left = _users.get(id(conn), 1) - 1
        if left > 0:
            _users[id(conn)] = left
            return
        _users.pop(id(conn), None)
        if _connections.get(conn.endpoint) is conn:
            del _connections[conn.endpoint]
    conn.close()


class GGMLBuffer(Buffer):
    __slots__ = ("remote_ptr", "base")

    def __init__(self, backend: "GGMLBackend", size: int, usage: str, remote_ptr: int, base: int):
        super().__init__(backend, size, usage)
        self.remote_ptr = remote_ptr
        self.base = base


class GGMLBackend(RemoteDevice, Backend):
    in_order = True
    small_batches_cheap = True
    weight_types = frozenset(WEIGHT_TYPES)
    kv_types = KV_CACHE_TYPES

    def __init__(self, conn: GGMLConnection, device: int, name: str):
        self.conn = conn
        self.device = device
        self.name = name
        with _connections_lock:
            _users[id(conn)] = _users.get(id(conn), 0) + 1
        self._closed = False
        self.alignment = conn.alignment(device)
        self.layout = WeightLayout(self)
        self._lock = threading.RLock()
        self._host_i32: dict[tuple[int, int], np.ndarray] = {}
        self._scratch: Optional[GGMLBuffer] = None
        self._inputs: Optional[GGMLBuffer] = None
        self._inputs_used = 0
        self._last_graph: Optional[bytes] = None
        self._lowered: dict[tuple, _Lowered] = {}   # (graph uid, its shape) -> its lowering
        self._sources: dict[int, GraphSources] = {}   # graph uid -> the host inputs its shape reads
        self._inputs_made: list[tuple[AttnSpec, list[int]]] = []
        self._lowering = Lowering(self._address, self._host_copy, self._input_leaves)
        # every live buffer, to allocate again on a new connection after the peer was lost
        self._buffers: "weakref.WeakValueDictionary[int, GGMLBuffer]" = weakref.WeakValueDictionary()

    # --- device ---------------------------------------------------------------------------------
    def device_info(self) -> DeviceInfo:
        free, total = self.conn.device_memory(self.device)
        return DeviceInfo(self.name, "ggml", f"llama.cpp rpc-server device {self.device} at {self.conn.endpoint}",
                          free, total)

    def supports(self, op: int) -> bool:
        return op in LOWERED_OPS


    def holds_kv(self, dtype: DType, head_dim: int) -> bool:
        # ggml's attention views a cache a head at a time: a quantized head is whole 32-value blocks
        return dtype in self.kv_types and head_dim % P.GGML_QUANT_SIZES[P.GGMLQuantizationType(int(dtype))][0] == 0

    def refusal_hint(self) -> str:
        return f"a llama.cpp rpc-server at {self.conn.endpoint}; pyllama does not lower that op to ggml's yet"


    # --- buffers --------------------------------------------------------------------------------
    def alloc_buffer(self, size: int, usage: str = "compute") -> Buffer:
        ptr, got = self.conn.alloc_buffer(self.device, max(size, 1))
        if not ptr:
            raise PyllamaError(f"{self.name}: the llama.cpp rpc-server at {self.conn.endpoint} has no room for "
                               f"{size / 2**20:.1f} MiB ({usage})")
        buf = GGMLBuffer(self, got, usage, ptr, self.conn.buffer_base(ptr))
        self._buffers[buf.id] = buf
        return buf

    def free_buffer(self, buffer: Buffer) -> None:
        self._buffers.pop(buffer.id, None)
        self._host_i32 = {k: v for k, v in self._host_i32.items() if k[0] != buffer.id}
        if not self.conn.broken:
            self.conn.free_buffer(buffer.remote_ptr)  # type: ignore[attr-defined]

    def clear_buffer(self, buffer: Buffer, value: int = 0) -> None:
        self.conn.buffer_clear(buffer.remote_ptr, value)  # type: ignore[attr-defined]

    def _record(self, t: Tensor) -> np.void:
        buf = t.buffer
        if not isinstance(buf, GGMLBuffer) or buf.backend is not self:
            raise ValueError(f"{t.name} is not on {self.name}")
        return P.tensor_record(1, int(t.dtype), tuple(reversed(t.shape)) or (1,), buffer=buf.remote_ptr,
                               data=buf.base + t.offset, name=t.name)

    def set_tensor(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        raw = np.ascontiguousarray(data)
        view = memoryview(raw).cast("B")
        if offset < 0 or offset + len(view) > tensor.nbytes:
            raise ValueError(f"set_tensor: {len(view)} bytes at {offset} overflow {tensor.name} ({tensor.nbytes} B)")
        with self._lock:
            if tensor.dtype == DType.I32 and tensor.nbytes <= HOST_I32_MAX:
                key = (tensor.buffer.id, tensor.offset)  # type: ignore[union-attr]
                mirror = self._host_i32.get(key)
                if mirror is None or mirror.size * 4 != tensor.nbytes:
                    mirror = self._host_i32[key] = np.zeros(tensor.nbytes // 4, np.int32)
                mirror.view(np.uint8)[offset:offset + len(view)] = np.frombuffer(view, np.uint8)
            rec = self._record(tensor)
            if len(view) > HASH_MIN_BYTES and self.conn.set_tensor_hash(rec, offset, fnv1a64(view)):
                return   # the peer had kept these bytes (a weight sent to it before) and wrote them
            self.conn.set_tensor(rec, offset, view)

    def get_tensor(self, tensor: Tensor, out: Optional[np.ndarray] = None) -> np.ndarray:
        if out is None:
            out = np.empty(tensor.nbytes, dtype=np.uint8)
        dst = memoryview(out.reshape(-1).view(np.uint8))
        if len(dst) != tensor.nbytes:
            raise ValueError(f"get_tensor: {tensor.name} has {tensor.nbytes} B, destination {len(dst)} B")
        with self._lock:
            self.conn.get_tensor(self._record(tensor), 0, tensor.nbytes, into=dst)
        return out

    # --- compute --------------------------------------------------------------------------------
    def graph_compute(self, graph: Graph, reads: Sequence[tuple[Tensor, np.ndarray]] = ()) -> None:
        # The step's shape and attention inputs are worked out before the lock: while another
        # group's graph computes on the peer this one's host work is done, and the peer idles only
        # for the upload. A graph is lowered once per shape it takes (a mix of prompts and decodes
        # recurs), not again each time its batch changes shape.
        for t, out in reads:   # checked before any read is asked: every reply asked must be read
            if out.nbytes != t.nbytes:
                raise ValueError(f"get_tensor: {t.name} has {t.nbytes} B, destination {out.nbytes} B")
        t_ready = trace.now() if trace.enabled else 0
        memo: dict = {}
        sources = self._sources.get(graph.uid)
        kept = self._lowered.get((graph.uid,) + self._lowering.shape_of(sources, memo)) \
            if sources is not None else None
        arrays = [self._lowering.inputs(spec, memo) for spec, _ in kept.inputs_at] if kept is not None else None
        with self._lock:
            t_lock = trace.now() if t_ready else 0
            done = kept if kept is not None and kept.scratch is self._scratch and kept.inputs is self._inputs \
                else None
            if done is not None and arrays is not None:
                for (_, at), arrs in zip(done.inputs_at, arrays):   # only the inputs are new
                    self._send_inputs(arrs, at)
            else:
                done = self._lower(graph, memo)
            recompute = done.raw == self._last_graph
            if recompute:
                self.conn.graph_recompute(self.device, subj=str(graph.uid))
            else:
                self.conn.graph_compute(self.device, done.nodes, done.recs, subj=str(graph.uid))
                self._last_graph = done.raw
            if t_ready:
                trace.event("ggml", "prepare", t_ready, trace.now(), dev=self.name, t_lock=t_lock,
                            lowered=done is not kept, recompute=recompute, grp=trace.group())
            # the reads are asked under the lock, so they come before any later graph on the wire;
            # their replies are read after it, while the next group sends its step
            asked = [self._ask_read(t, out, done.sample) for t, out in reads]
        error: Optional[BaseException] = None
        for reply, into, then in asked:     # every reply is read, even after an error: later ones wait
            try:
                self.conn.receive(reply, into)
                if error is None and then is not None:
                    then()
            except BaseException as exc:  # noqa: BLE001 - the first error is raised below
                error = error or exc
        if error is not None:
            raise error

    def _ask_read(self, t: Tensor, out: np.ndarray, tail: Optional[SampleTail]):
        """(reply, where it goes, what follows it) of one read after a graph. The SAMPLE node's
        result is made here: from the peer's ARGMAX ids, or by the host's sampler chain on the
        logits read back."""
        if tail is None or t is not tail.node.out:
            return self.conn.ask_tensor(self._record(t), 0, t.nbytes), memoryview(out.reshape(-1).view(np.uint8)), None
        nd = tail.node
        sampled = out.reshape(-1).view(np.int32).reshape(nd.out.shape)
        if tail.ids is not None:
            rec = P.tensor_record(1, G.I32, tail.ids.ne, buffer=tail.ids.buffer, data=tail.ids.data)
            ids = np.empty(nd.out.shape[0], np.int32)

            def place_ids() -> None:
                sampled[:] = 0
                sampled[:, 0] = ids
            return self.conn.ask_tensor(rec, 0, ids.nbytes), memoryview(ids).cast("B"), place_ids
        logits, sampling = nd.srcs
        host_logits = np.empty(logits.shape, np.float32)
        rows = self._host_copy(sampling).reshape(sampling.shape).copy()   # this step's, before the next one's

        def sample_here() -> None:
            bind_sample(host_logits, rows, sampled, int(nd.params[0]), int(nd.params[1]), 1)()
        return (self.conn.ask_tensor(self._record(logits), 0, logits.nbytes), memoryview(host_logits).cast("B"),
                sample_here)

    def _lower(self, graph: Graph, memo: dict) -> "_Lowered":
        while True:
            self._inputs_used = 0
            self._inputs_made = []
            try:
                g = self._lowering.lower(graph, memo)
                break
            except _Relower:   # the inputs buffer grew: the inputs go into the new one
                continue
        nodes, recs = self._finish(g)
        sources = self._sources[graph.uid] = self._lowering.sources
        while len(self._lowered) >= _LOWERED_KEPT:
            self._lowered.pop(next(iter(self._lowered)))
        key = (graph.uid,) + self._lowering.shape_of(sources, memo)
        done = self._lowered[key] = _Lowered(nodes, recs, recs.tobytes(), list(self._inputs_made),
                                             self._scratch, self._inputs, self._lowering.sample)
        return done

    def forget_graph(self, uid: int) -> None:
        self._sources.pop(uid, None)
        for key in [k for k in self._lowered if k[0] == uid]:
            del self._lowered[key]

    def _finish(self, g: G.GraphBuilder) -> tuple[list[int], np.ndarray]:
        """Places the graph's intermediates in the device's scratch buffer, grown (and the graph
        placed again) when it is too small."""
        if self._scratch is not None:
            try:
                nodes, recs, _ = g.finish(self._scratch.remote_ptr, self._scratch.base, self._scratch.size,
                                          self.alignment)
                return nodes, recs
            except MemoryError:
                pass
        _, _, need = g.finish(0, 0, 1 << 62, self.alignment)
        if self._scratch is not None:
            self.free_buffer(self._scratch)
        self._scratch = self.alloc_buffer(max(need, 1 << 20) * 2, "compute")
        self._last_graph = None
        nodes, recs, _ = g.finish(self._scratch.remote_ptr, self._scratch.base, self._scratch.size, self.alignment)
        return nodes, recs

    # --- what the lowering asks ----------------------------------------------------------------
    def _address(self, t: Tensor) -> tuple[int, int]:
        buf = t.buffer
        if not isinstance(buf, GGMLBuffer) or buf.backend is not self:
            raise ValueError(f"a graph tensor ({t.name}) is not on {self.name}")
        return buf.remote_ptr, buf.base + t.offset

    def _host_copy(self, t: Tensor) -> np.ndarray:
        got = self._host_i32.get((t.buffer.id, t.offset))  # type: ignore[union-attr]
        if got is None:
            raise ValueError(f"{self.name}: {t.name} was not written from this host (the attention's cell "
                             "lists must be)")
        return got

    def _input_leaves(self, g: G.GraphBuilder, spec: AttnSpec) -> list[G.GT]:
        items = self._lowering.inputs(spec, self._lowering.memo)
        offsets = []
        for _, arr in items:
            need = self._inputs_used + arr.nbytes
            if self._inputs is None or need > self._inputs.size:
                # a larger buffer: earlier inputs of this graph are written again into it
                if self._inputs is not None:
                    self.free_buffer(self._inputs)
                self._inputs = self.alloc_buffer(max(need * 2, 1 << 20), "compute")
                self._last_graph = None
                raise _Relower()
            offsets.append(self._inputs_used)
            self._inputs_used = (need + self.alignment - 1) // self.alignment * self.alignment
        self._send_inputs(items, offsets)
        self._inputs_made.append((spec, offsets))
        return [g.leaf(_GGML_TYPE[arr.dtype.char], tuple(reversed(arr.shape)), self._inputs.remote_ptr,
                       self._inputs.base + at, name) for (name, arr), at in zip(items, offsets)]

    def _send_inputs(self, items: list[tuple[str, np.ndarray]], offsets: list[int]) -> None:
        inputs = self._inputs
        assert inputs is not None
        for (name, arr), at in zip(items, offsets):
            rec = P.tensor_record(1, _GGML_TYPE[arr.dtype.char], tuple(reversed(arr.shape)),
                                  buffer=inputs.remote_ptr, data=inputs.base + at, name=name)
            self.conn.set_tensor(rec, 0, memoryview(np.ascontiguousarray(arr)).cast("B"))

    # --- a lost peer ------------------------------------------------------------------------------
    def lost(self) -> Optional[str]:
        return self.conn.check_peer()

    def reach(self) -> None:
        ggml_connection(self.conn.endpoint)

    def reconnect(self) -> list[Buffer]:
        """Continues on the process's new connection to the peer: every live buffer is allocated
        there again under its old Buffer object (contents lost, for the engine to restore), and
        what was kept of the old connection's graphs is dropped."""
        old, conn = self.conn, ggml_connection(self.conn.endpoint)
        with self._lock:
            if conn is not old:
                with _connections_lock:
                    _users[id(conn)] = _users.get(id(conn), 0) + 1
                _release(old)
                self.conn = conn
            self._scratch = self._inputs = None
            self._lowered.clear()
            self._sources.clear()
            self._last_graph = None
            buffers = sorted(self._buffers.values(), key=lambda b: b.id)
            for buf in buffers:
                ptr, got = conn.alloc_buffer(self.device, max(buf.size, 1))
                if not ptr or got < buf.size:
                    raise RPCError(f"{self.name}: the llama.cpp rpc-server at {conn.endpoint} came back without room "
                                   f"for {buf.size / 2**20:.1f} MiB")
                buf.remote_ptr, buf.base = ptr, conn.buffer_base(ptr)
        return buffers

    def disconnect(self) -> None:
        self.conn.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._scratch = self._inputs = None   # the peer frees every buffer with the connection
        _release(self.conn)


@dataclass
class _Lowered:
    """A graph as last lowered: what to send again while its attention keeps its layout."""
    nodes: list[int]
    recs: np.ndarray
    raw: bytes
    inputs_at: list[tuple[AttnSpec, list[int]]]   # (spec, its arrays' offsets in the inputs buffer)
    scratch: Optional[GGMLBuffer]
    inputs: Optional[GGMLBuffer]
    sample: Optional[SampleTail]                   # how its SAMPLE node is made, if it has one


class _Relower(Exception):
    """The inputs buffer grew: lower the graph again."""


_GGML_TYPE = {"f": G.F32, "e": G.F16, "i": G.I32}


__all__ = ["GGMLBackend", "GGMLBuffer", "ggml_connection", "release_if_unused"]
