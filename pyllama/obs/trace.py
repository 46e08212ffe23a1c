"""The tracer: JSON-lines span events of one process (the file format and catalogue: docs/tracing.md).

Off by default and free when off: call sites read the module-level `enabled` and branch, so no
clock is read and nothing is allocated. On with PYLLAMA_TRACE=<path> or `--trace <path>`.

    t0 = trace.now() if trace.enabled else 0
    ...
    if trace.enabled:
        trace.event("server", "sampling", t0, trace.now(), grp=grp)

`event` only appends a tuple to a list; a writer thread formats and writes the lines, so no JSON
is built under any caller's lock and the caller pays one append. The file is flushed at least
every 50 ms, and at once when 128 events are waiting: a process killed with SIGKILL loses at most
the last 100 ms, and `close()` (called by the programs' shutdown paths and at exit) loses nothing.

Several processes handed one path (children inheriting PYLLAMA_TRACE) each write their own file:
the first takes the path (holding an exclusive lock on it), the others derive
`<base>.<role>.<port or pid>.jsonl`; no process truncates a file another one holds.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import secrets
import socket
import threading
import time
from typing import Any, Optional

from ..util.settings import current
from ..util.threads import Thread

ENV = "PYLLAMA_TRACE"
VERSION = 1
FLUSH_EVENTS = 128
FLUSH_PERIOD_S = 0.05

enabled = False

_lock = threading.Lock()
_pending: list[tuple] = []
_writer: Optional["_Writer"] = None
_tls = threading.local()
_uid = f"{secrets.randbits(64) | 1:016x}"


def now() -> int:
    """Microseconds of this host's monotonic clock (the trace's time base)."""
    return time.monotonic_ns() // 1000


def uid() -> str:
    """This process's trace id (an rpc server's is its HELLO server id)."""
    return _uid


def path() -> Optional[str]:
    """The file this process writes, or None when tracing is off."""
    return _writer.path if _writer is not None else None


def set_group(grp: Optional[int]) -> None:
    """Tags the calling thread's later events (RPC commands included) with a pipeline group."""
    _tls.grp = grp


def group() -> Optional[int]:
    return getattr(_tls, "grp", None)


def event(c: str, n: str, t0: int, t1: int, /, **fields: Any) -> None:
    """Records one span. Call only when `enabled`; never formats, never blocks on I/O."""
    rec = (c, n, t0, t1, threading.current_thread().name, fields)
    with _lock:
        _pending.append(rec)
        wake = len(_pending) >= FLUSH_EVENTS
    if wake and _writer is not None:
        _writer.wake.set()


def start(trace_path: Optional[str], role: str, endpoint: Optional[str] = None,
          trace_uid: Optional[str] = None) -> Optional[str]:
    """Opens this process's trace file (`trace_path`, else $PYLLAMA_TRACE; neither: stays off).
    Returns the path actually written, which differs from the one asked for when another
    process already holds that one."""
    global _writer, enabled, _uid
    trace_path = trace_path or current().obs.trace
    if not trace_path:
        return None
    if _writer is not None:
        return _writer.path
    if trace_uid:
        _uid = trace_uid
    fd, actual = _claim(trace_path, role, endpoint)
    header = {"type": "header", "version": VERSION, "role": role, "uid": _uid, "host": socket.gethostname(),
              "pid": os.getpid(), "endpoint": endpoint, "t_open_us": now(), "wall_us": time.time_ns() // 1000}
    _writer = _Writer(fd, actual, json.dumps(header, separators=(",", ":")))
    enabled = True
    atexit.register(close)
    return actual


def close() -> None:
    """Writes what is pending and closes the file; tracing is off afterwards."""
    global _writer, enabled
    enabled = False
    w, _writer = _writer, None
    if w is not None:
        w.stop()


# ---------------------------------------------------------------------------------------------
def _claim(trace_path: str, role: str, endpoint: Optional[str]) -> tuple[int, str]:
    """Opens and locks the first free one of: the path, <base>.<role>.<port|pid>.jsonl, and that
    with the pid appended."""
    base = trace_path[:-6] if trace_path.endswith(".jsonl") else trace_path
    label = endpoint.rpartition(":")[2] if endpoint else str(os.getpid())
    candidates = [trace_path, f"{base}.{role}.{label}.jsonl", f"{base}.{role}.{label}.{os.getpid()}.jsonl"]
    for cand in candidates:
        fd = os.open(cand, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                continue
            raise
        os.ftruncate(fd, 0)
        return fd, cand
    raise OSError(f"trace: every candidate file for {trace_path} is held by another process")


def _line(rec: tuple) -> str:
    c, n, t0, t1, tid, fields = rec
    ev = {"c": c, "n": n, "t0": t0, "t1": t1, "tid": tid}
    ev.update(fields)
    return json.dumps(ev, separators=(",", ":"), default=str)


class _Writer:
    def __init__(self, fd: int, file_path: str, header: str):
        self.path = file_path
        self.file = os.fdopen(fd, "w", encoding="utf-8", buffering=1 << 16)
        self.file.write(header + "\n")
        self.file.flush()
        self.wake = threading.Event()
        self._stop = False
        self.thread = Thread(target=self._run, name="trace-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            self.wake.wait(FLUSH_PERIOD_S)
            self.wake.clear()
            self._drain()

    def _drain(self) -> None:
        with _lock:
            if not _pending:
                return
            batch = _pending[:]
            _pending.clear()
        try:
            self.file.write("".join(_line(r) + "\n" for r in batch))
            self.file.flush()
        except (OSError, ValueError):  # a full disk must not take the server down with it
            pass

    def stop(self) -> None:
        self._stop = True
        self.wake.set()
        if self.thread is not threading.current_thread():
            self.thread.join(5)
        self._drain()
        try:
            self.file.close()  # closing the descriptor releases the lock
        except OSError:
            pass
