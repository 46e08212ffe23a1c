"""A ggml RPC peer in Python, for tests: it speaks llama.cpp rpc-server's protocol (5.0.0) on a
loopback port, one client at a time, with that server's rules: HELLO first, every reply of the
exact size its command defines, and a request it cannot serve (unknown buffer, a region outside
its buffer, a wrong size) closes the connection. Buffers live in host memory at made-up addresses.
Graphs are decoded and kept (`graphs`); with `compute=True` they are also run by ggml_numpy.py,
a float64 reading of the ops pyllama's lowering uses (the lowering itself is checked against
llama.cpp's own rpc-server in bench/, where ggml computes).

`reply_hook(cmd, payload) -> bytes | None` replaces the reply of a command (a hostile peer);
with `close_after_hook` the peer then closes the connection."""
from __future__ import annotations

import socket
import struct
import threading
from typing import Callable, Optional

import numpy as np

from pyllama._fast.wire import fnv1a64
from pyllama.backend.ggml import protocol as P
from pyllama.backend.ggml.protocol import GCmd


class _Closed(Exception):
    pass


class FakeGGMLPeer:
    BASE = 0x7F00_0000_0000

    def __init__(self, devices: tuple[tuple[int, int], ...] = ((3 << 30, 4 << 30),), version=P.VERSION,
                 alignment: int = 32, reply_hook: Optional[Callable[[GCmd, bytes], Optional[bytes]]] = None,
                 close_after_hook: bool = False, compute: bool = False, port: int = 0):
        self.devices = list(devices)
        self.version = version
        self.alignment = alignment
        self.reply_hook = reply_hook
        self.close_after_hook = close_after_hook   # a hooked reply ends the connection (it may be short)
        self.compute = compute
        self.buffers: dict[int, tuple[int, bytearray]] = {}   # remote_ptr -> (base, bytes)
        self.graphs: list[tuple[int, np.ndarray, np.ndarray]] = []
        self.recomputes: list[int] = []
        self.commands: list[GCmd] = []
        self.cache: dict[int, bytes] = {}     # fnv hash -> bytes (rpc-server -c)
        self.keep_cache = False               # as rpc-server -c: a SET_TENSOR longer than hash_min is kept
        self.hash_min = 10 << 20
        self.closed_on: list[str] = []        # why connections were closed
        self._next = self.BASE
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self._sock.listen(4)
        self.endpoint = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = False
        self._client_sock: Optional[socket.socket] = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        client = self._client_sock
        if client is not None:     # a peer that dies: its client's connection goes with it
            try:
                client.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            socket.create_connection(self._sock.getsockname(), timeout=1).close()
        except OSError:
            pass
        self._thread.join(5)
        self._sock.close()

    # --- the server loop: one client at a time, as rpc-server serves ------------------------------
    def _serve(self) -> None:
        while not self._stop:
            conn, _ = self._sock.accept()
            if self._stop:
                conn.close()
                break
            self._client_sock = conn
            with conn:
                try:
                    self._client(conn)
                except _Closed as exc:
                    self.closed_on.append(str(exc))
                except OSError:
                    pass

    def _client(self, c: socket.socket) -> None:
        cmd = self._read(c, 1)[0]
        if cmd != GCmd.HELLO:
            raise _Closed("expected HELLO")
        if P.U64.unpack(self._read(c, 8))[0] != P.CONN_CAPS_SIZE:
            raise _Closed("HELLO size")
        self._read(c, P.CONN_CAPS_SIZE)
        self._send(c, GCmd.HELLO, b"", struct.pack("<BBBB", *self.version, 0) + bytes(P.CONN_CAPS_SIZE))
        while True:
            head = c.recv(1)
            if not head:
                return
            cmd = head[0]
            if cmd >= len(GCmd):
                raise _Closed(f"unknown command {cmd}")
            cmd = GCmd(cmd)
            size = P.U64.unpack(self._read(c, 8))[0]
            payload = self._read(c, size)
            self.commands.append(cmd)
            hooked = self.reply_hook(cmd, payload) if self.reply_hook is not None else None
            if hooked is not None:      # the hook's bytes instead of running the command
                c.sendall(hooked)
                if self.close_after_hook:
                    return
                continue
            reply = self._run(cmd, payload)
            if cmd not in P.ONE_WAY:
                self._send(c, cmd, payload, reply)

    def _send(self, c: socket.socket, cmd: GCmd, payload: bytes, reply: bytes) -> None:
        hooked = self.reply_hook(cmd, payload) if self.reply_hook is not None and cmd == GCmd.HELLO else None
        c.sendall(hooked if hooked is not None else P.U64.pack(len(reply)) + reply)
        if hooked is not None and self.close_after_hook:
            raise _Closed("closed after a hooked reply")

    @staticmethod
    def _read(c: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = c.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise _Closed("client left")
            buf += chunk
        return bytes(buf)

    # --- the commands ----------------------------------------------------------------------------
    def _need(self, ok: bool, why: str) -> None:
        if not ok:
            raise _Closed(why)

    def _device(self, payload: bytes, size: int = 4) -> int:
        self._need(len(payload) == size, "request size")
        dev = P.U32.unpack_from(payload)[0]
        self._need(dev < len(self.devices), f"device {dev}")
        return dev

    def _region(self, rec: np.void, offset: int, size: int) -> tuple[bytearray, int]:
        """The buffer and the start of [data + offset, + size) in it, as rpc-server checks it."""
        ptr = int(rec["buffer"])
        self._need(ptr in self.buffers, "buffer not found")
        base, mem = self.buffers[ptr]
        start = int(rec["data"]) + offset
        self._need(base <= start < base + len(mem) and size <= base + len(mem) - start, "region out of bounds")
        return mem, start - base

    def _write(self, rec: np.void, offset: int, data: bytes) -> None:
        mem, at = self._region(rec, offset, len(data))
        mem[at:at + len(data)] = data

    def _run(self, cmd: GCmd, p: bytes) -> bytes:
        T = P.RPC_TENSOR.itemsize
        if cmd == GCmd.DEVICE_COUNT:
            self._need(not p, "request size")
            return P.U32.pack(len(self.devices))
        if cmd in (GCmd.GET_ALIGNMENT, GCmd.GET_MAX_SIZE):
            self._device(p)
            return P.U64.pack(self.alignment if cmd == GCmd.GET_ALIGNMENT else 1 << 40)
        if cmd == GCmd.GET_DEVICE_MEMORY:
            return P.PTR_SIZE.pack(*self.devices[self._device(p)])
        if cmd == GCmd.ALLOC_BUFFER:
            dev = self._device(p, P.ALLOC_REQ.size)
            size = P.ALLOC_REQ.unpack(p)[1]
            if size > self.devices[dev][0]:
                return P.PTR_SIZE.pack(0, 0)
            ptr, base = self._next, self._next + 0x1000
            self._next += (size + 0x2000 + 0xFFF) & ~0xFFF
            self.buffers[ptr] = (base, bytearray(size))
            return P.PTR_SIZE.pack(ptr, size)
        if cmd == GCmd.BUFFER_GET_BASE:
            self._need(len(p) == 8 and P.U64.unpack(p)[0] in self.buffers, "buffer not found")
            return P.U64.pack(self.buffers[P.U64.unpack(p)[0]][0])
        if cmd == GCmd.FREE_BUFFER:
            self._need(len(p) == 8 and P.U64.unpack(p)[0] in self.buffers, "buffer not found")
            del self.buffers[P.U64.unpack(p)[0]]
            return b""
        if cmd == GCmd.BUFFER_CLEAR:
            self._need(len(p) == P.CLEAR_REQ.size, "request size")
            ptr, value = P.CLEAR_REQ.unpack(p)
            self._need(ptr in self.buffers, "buffer not found")
            mem = self.buffers[ptr][1]
            mem[:] = bytes([value]) * len(mem)
            return b""
        if cmd == GCmd.SET_TENSOR:
            self._need(len(p) >= T + 8, "request size")
            data = p[T + 8:]
            self._write(np.frombuffer(p, P.RPC_TENSOR, 1)[0], P.U64.unpack_from(p, T)[0], data)
            if self.keep_cache and len(data) > self.hash_min:
                self.cache[fnv1a64(data)] = bytes(data)
            return b""
        if cmd == GCmd.SET_TENSOR_HASH:
            self._need(len(p) == T + 16, "request size")
            offset, h = P.REGION.unpack_from(p, T)
            if h not in self.cache:
                return b"\0"
            self._write(np.frombuffer(p, P.RPC_TENSOR, 1)[0], offset, self.cache[h])
            return b"\1"
        if cmd == GCmd.GET_TENSOR:
            self._need(len(p) == T + 16, "request size")
            rec = np.frombuffer(p, P.RPC_TENSOR, 1)[0]
            offset, size = P.REGION.unpack_from(p, T)
            mem, at = self._region(rec, offset, size)
            return bytes(mem[at:at + size])
        if cmd == GCmd.COPY_TENSOR:
            self._need(len(p) == 2 * T, "request size")
            src, dst = np.frombuffer(p, P.RPC_TENSOR, 2)
            n = P.tensor_nbytes(src)
            smem, s_at = self._region(src, 0, n)
            dmem, d_at = self._region(dst, 0, n)
            dmem[d_at:d_at + n] = smem[s_at:s_at + n]
            return b"\1"
        if cmd == GCmd.MEMSET_TENSOR:
            self._need(len(p) == T + P.MEMSET_TAIL.size, "request size")
            rec = np.frombuffer(p, P.RPC_TENSOR, 1)[0]
            offset, size, value = P.MEMSET_TAIL.unpack_from(p, T)
            mem, at = self._region(rec, offset, size)
            mem[at:at + size] = bytes([value]) * size
            return b""
        if cmd == GCmd.INIT_TENSOR:
            self._need(len(p) == T, "request size")
            return b""
        if cmd == GCmd.GRAPH_COMPUTE:
            try:
                dev, nodes, tensors = P.parse_graph(p)
            except P.GGMLProtocolError as exc:
                raise _Closed(str(exc)) from None
            self._need(dev < len(self.devices), f"device {dev}")
            ids = set(int(i) for i in tensors["id"])
            self._need(all(int(n) in ids for n in nodes), "a node id without a tensor")
            self.graphs.append((dev, nodes.copy(), tensors.copy()))
            if self.compute:
                self._compute(nodes, tensors)
            return b""
        if cmd == GCmd.GRAPH_RECOMPUTE:
            dev = self._device(p)
            self._need(any(g[0] == dev for g in self.graphs), "no stored graph")
            self.recomputes.append(dev)
            if self.compute:
                last = [gr for gr in self.graphs if gr[0] == dev][-1]
                self._compute(last[1], last[2])
            return b""
        raise _Closed(f"command {cmd.name} not served here")

    def _compute(self, nodes, tensors) -> None:
        from ggml_numpy import run_graph  # noqa: PLC0415
        try:
            run_graph(self.buffers, nodes, tensors)
        except (ValueError, KeyError, IndexError) as exc:
            raise _Closed(f"graph: {exc}") from None

    # test helpers
    def read(self, ptr: int, offset: int, size: int) -> bytes:
        base, mem = self.buffers[ptr]
        return bytes(mem[offset:offset + size])

