"""A TCP proxy for fault tests: forwards between a client and one upstream endpoint and can delay,
stall, drop or cut what passes.

    proxy = FaultProxy("127.0.0.1:50052")   # listens on proxy.endpoint
    proxy.delay = 0.002                     # seconds before each forwarded chunk
    proxy.stall()                           # stop forwarding (sockets stay open: a half-open peer)
    proxy.resume()
    proxy.drop()                            # close every current connection at once
    proxy.cut_mid_frame()                   # the next reply chunk of 64 bytes or more is cut in half, then both sides close
    proxy.close()

Threads, not asyncio: two pump threads per connection, each blocking on recv with a short timeout
so that close() ends them promptly. A stalled pump keeps what it read and stops reading, so the
sender's socket buffers fill as they would on a dead link.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Optional

_CHUNK = 65536
_TICK = 0.05


class _Pair:
    def __init__(self, client: socket.socket, upstream: socket.socket):
        self.client = client
        self.upstream = upstream
        self.closed = False
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for s in (self.client, self.upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class FaultProxy:
    def __init__(self, upstream: str, port: int = 0):
        host, _, p = upstream.rpartition(":")
        self.upstream = (host, int(p))
        self.delay = 0.0
        self._flowing = threading.Event()
        self._flowing.set()
        self._cut = threading.Event()
        self._stop = threading.Event()
        self._pairs: list[_Pair] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.n_accepted = 0
        self.n_cut = 0  # replies cut in the middle
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(16)
        self.listener.settimeout(_TICK)
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._spawn(self._accept)

    # --- controls ------------------------------------------------------------------------------
    def stall(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def drop(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            pair.close()

    def cut_mid_frame(self) -> None:
        """The next chunk of at least 64 bytes from the upstream is forwarded only in half, then
        both sides close: the client sees its reply end in the middle of a frame."""
        self._cut.set()

    @property
    def n_open(self) -> int:
        with self._lock:
            return sum(1 for p in self._pairs if not p.closed)

    def close(self) -> None:
        self._stop.set()
        self._flowing.set()
        self.drop()
        for t in self._threads:
            t.join(5)
        self.listener.close()

    # --- internals -----------------------------------------------------------------------------
    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.settimeout(_TICK)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, upstream)
            with self._lock:
                self._pairs.append(pair)
                self.n_accepted += 1
            self._spawn(self._pump, pair, client, upstream, False)
            self._spawn(self._pump, pair, upstream, client, True)

    def _pump(self, pair: _Pair, src: socket.socket, dst: socket.socket, from_upstream: bool) -> None:
        try:
            while not pair.closed and not self._stop.is_set():
                try:
                    data = src.recv(_CHUNK)
                except socket.timeout:
                    continue
                if not data:
                    break
                while not self._flowing.wait(_TICK):  # stalled: hold the chunk, read nothing more
                    if pair.closed or self._stop.is_set():
                        return
                if self.delay:
                    time.sleep(self.delay)
                if from_upstream and len(data) >= 64 and self._cut.is_set():
                    self._cut.clear()
                    self._send(pair, dst, data[:len(data) // 2])
                    self.n_cut += 1
                    break
                self._send(pair, dst, data)
        except OSError:
            pass
        finally:
            pair.close()

    def _send(self, pair: _Pair, dst: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view and not pair.closed and not self._stop.is_set():
            try:
                n = dst.send(view)
            except socket.timeout:
                continue
            view = view[n:]


def wait_for(predicate, timeout: float, interval: float = 0.05) -> Optional[object]:
    """Polls predicate() until it returns something true (returned) or the time is up (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)
