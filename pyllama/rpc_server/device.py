"""A device the RPC server exposes: its backend and its memory accounting; and the executor thread
that runs one connection's commands.

Every connection (a lane) has one executor that runs its commands in arrival order, so a write
never races a graph of the same lane still computing from the same buffer. Lanes run concurrently;
what they share (the accounting here, a session's buffer table, the backend's bound plans and
repacked copies) is kept under locks held for bookkeeping only.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

from ..backend.base import Backend, Buffer
from ..backend.cpu import CPUBackend
from ..rpc.protocol import KIND
from ..util.threads import Thread

log = logging.getLogger("pyllama.rpc_server")

_MAX_HOLD = 0.0005  # seconds a completed one-way command may wait to be reported with others
_IDLE_WAIT_S = 5.0  # an idle executor wakes this often (stop() wakes it at once)
STOP_WAIT_S = 60.0  # stop() waits this long at most for the queued commands


class Executor:
    """One thread that runs submitted jobs in order; exceptions are logged, never raised.

    A job is `fn` plus, optionally, the loop and callback that receive its result; such an `fn`
    returns `(urgent, result)`. Results go back with `loop.call_soon_threadsafe`, batched: an urgent
    one (a reply) is handed over at once with everything completed before it; others (one-way
    commands) wait until the queue runs dry or the oldest has waited _MAX_HOLD, so a burst of
    one-way commands costs the loop one wake-up, not one each.
    """

    def __init__(self, name: str, on_exit: Optional[Callable[[], None]] = None):
        """`on_exit` runs on the thread after its last job (what the thread held on the devices)."""
        self._on_exit = on_exit
        self._q: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._thread = Thread(target=self._run, name=name, daemon=True)
        self._started = False
        self._start_lock = threading.Lock()  # the loop starts it, another lane's executor may stop it

    def start(self) -> None:
        with self._start_lock:
            if not self._started:
                self._thread.start()
                self._started = True

    def submit(self, fn: Callable[[], Any], loop: Optional[asyncio.AbstractEventLoop] = None,
               done: Optional[Callable[[Any], None]] = None) -> None:
        self._q.put((fn, loop, done))

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Runs what is queued (for at most `timeout` seconds), then ends the thread."""
        with self._start_lock:
            started = self._started
        if started:
            self._q.put(None)
            self._thread.join(timeout)

    def close(self) -> None:
        """Ends the thread once what is queued has run, without waiting for it."""
        if self._started:
            self._q.put(None)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            if self._on_exit is not None:
                try:
                    self._on_exit()
                except Exception:  # noqa: BLE001 - the thread ends anyway
                    log.exception("executor %s: releasing its devices' state failed", self._thread.name)

    def _serve(self) -> None:
        ready: list[tuple[asyncio.AbstractEventLoop, Callable[[Any], None], Any]] = []
        first = 0.0
        while True:
            if ready:
                try:
                    job = self._q.get_nowait()
                except queue.Empty:
                    _hand_over(ready)
                    continue
            else:
                try:
                    job = self._q.get(timeout=_IDLE_WAIT_S)
                except queue.Empty:
                    continue
            if job is None:
                _hand_over(ready)
                return
            fn, loop, done = job
            try:
                out = fn()
            except BaseException:  # noqa: BLE001 - the thread must survive anything a job does
                log.exception("executor %s: unexpected failure", self._thread.name)
                continue
            if done is not None and loop is not None:
                urgent, result = out
                if not ready:
                    first = time.monotonic()
                ready.append((loop, done, result))
                if urgent or time.monotonic() - first > _MAX_HOLD:
                    _hand_over(ready)


def _hand_over(ready: list) -> None:
    """Delivers completed results to their loops, one wake-up per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for loop, done, result in ready:
        by_loop.setdefault(loop, []).append((done, result))
    ready.clear()
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the loop is closed (shutdown)
            pass


def _deliver(items: list) -> None:
    for done, result in items:
        try:
            done(result)
        except Exception:  # noqa: BLE001
            log.exception("delivering a result failed")


class Device:
    """One device: its backend, what is held on it against the cap, and its executor.

    `--mem` (mem_limit) caps everything clients make the server hold here: their buffers
    (`allocated`) and what their commands need besides (`held`): replies being built and sent,
    the kernel scratch of a graph while it runs, repacked copies of weights. Each is reserved
    before it is allocated, and refused (MemoryError, an error reply) past the cap."""

    def __init__(self, index: int, backend: Backend, mem_limit: Optional[int] = None):
        self.index = index
        self.backend = backend
        self.name = backend.name
        info = backend.device_info()
        self.kind = KIND.get(info.kind, 0)
        self.weight_types = frozenset(backend.weight_types)  # what graphs may give as weights here
        self.kv_types = frozenset(backend.kv_types)  # the KV cache types it holds
        self.mem_limit = mem_limit
        self.allocated = 0  # bytes of live buffers, over all connections
        self.held = 0       # bytes reserved besides them (replies, scratch, repacked copies)
        self._lock = threading.Lock()  # replies are released on the event loop, the rest on the executor
        if isinstance(backend, CPUBackend):
            backend.budget = self  # its graphs' scratch and its repacked copies count here too
        # work is done when the executor returns from a command (no device queue to wait for)
        self.completes_in_executor = isinstance(backend, CPUBackend)

    def memory(self) -> tuple[int, int]:
        """(free, total): the cap when one is set, else what the backend reports."""
        if self.mem_limit is not None:
            return max(0, self.mem_limit - self.allocated - self.held), self.mem_limit
        info = self.backend.device_info()
        return info.free, info.total

    def reserve(self, size: int, what: str) -> None:
        """Counts `size` bytes of `what` against the cap, or raises MemoryError (nothing counted)."""
        with self._lock:
            if self.mem_limit is not None and size > self.mem_limit - self.allocated - self.held:
                raise MemoryError(f"{what} of {size} B on {self.name} exceeds the server's memory cap (--mem: "
                                  f"{self.allocated + self.held} of {self.mem_limit} B in use)")
            self.held += size

    def release(self, size: int) -> None:
        with self._lock:
            self.held -= size

    def alloc(self, size: int, usage: str) -> Buffer:
        with self._lock:
            if self.mem_limit is not None and size > self.mem_limit - self.allocated - self.held:
                raise MemoryError(f"allocating {size} B on {self.name} exceeds the server's memory cap "
                                  f"({self.allocated + self.held} of {self.mem_limit} B in use)")
        if self.mem_limit is None:
            free, _ = self.memory()
            if free and size > free:
                raise MemoryError(f"allocating {size} B on {self.name}: only {free} B are available")
        buf = self.backend.alloc_buffer(size, usage)
        with self._lock:
            self.allocated += size
        return buf

    def free(self, buf: Buffer) -> None:
        self.backend.free_buffer(buf)  # first: its repacked copies are released with it
        with self._lock:
            self.allocated -= buf.size

    def forget_graph(self, uid: int) -> None:
        """Drops whatever the backend keeps per graph (the CPU backend's bound plan holds views of
        its buffers, which would keep freed memory alive until the plan ages out)."""
        self.backend.forget_graph(uid)
