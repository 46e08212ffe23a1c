"""The server-side tensor cache (--cache DIR): tensor bytes stored under their sha256.

SET_TENSOR_HASH looks a file up by its hex digest and copies it into the region; a SET_TENSOR of at
least CACHE_MIN_BYTES stores its bytes there (hashed and written by a background thread, through a
temporary file and a rename, so a reader never sees a partial file) so that a restarted server does
not need them again.

A temporary file is named `.tmp-<pid>-...` after the process writing it. A write that fails removes
its own; one cut short by the process dying (killed during an upload) cannot, so opening the cache
removes every `.tmp-*` file whose writer is no longer running. Every wait here is bounded: a
SET_TENSOR that finds the writer too far behind for WRITER_WAIT_S skips caching those bytes (a later
restart uploads them again), and close() waits at most CLOSE_WAIT_S for what is queued.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from collections import deque
from typing import Optional

from ..util.threads import Thread

log = logging.getLogger("pyllama.rpc_server")

CACHE_MIN_BYTES = 1 << 20
_MAX_PENDING = 512 << 20  # bytes waiting to be hashed before a SET_TENSOR waits for the writer
TMP_PREFIX = ".tmp-"
WRITER_WAIT_S = 120.0     # a SET_TENSOR waits this long at most for room in the writer's queue
CLOSE_WAIT_S = 60.0       # close() waits this long at most for the queued writes
_IDLE_WAIT_S = 5.0        # the idle writer wakes this often (close() wakes it at once)


class TensorCache:
    def __init__(self, directory: str):
        self.dir = os.path.abspath(directory)
        os.makedirs(self.dir, exist_ok=True)
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise PermissionError(f"cache directory {self.dir} is not writable")
        removed = remove_stale_temporaries(self.dir)
        if removed:
            log.info("cache %s: removed %d unfinished file(s) of an earlier run", self.dir, removed)
        self._pending: "deque[Optional[memoryview]]" = deque()
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._writing: Optional[str] = None  # the temporary file being written, if any

    def path(self, digest: bytes) -> str:
        return os.path.join(self.dir, digest.hex())

    # --- lookups (executor thread) -----------------------------------------------------------
    def read_into(self, digest: bytes, dst: memoryview) -> bool:
        """Fills `dst` (exactly its size) from the file of `digest`; False when there is none."""
        path = self.path(digest)
        try:
            with open(path, "rb", buffering=0) as fh:
                if os.fstat(fh.fileno()).st_size != dst.nbytes:
                    log.warning("cache file %s has %d bytes, %d were asked: ignored", path,
                                os.fstat(fh.fileno()).st_size, dst.nbytes)
                    return False
                got = 0
                while got < dst.nbytes:
                    n = fh.readinto(dst[got:])
                    if not n:
                        log.warning("cache file %s ended early", path)
                        return False
                    got += n
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("cache file %s: %s", path, exc)
            return False

    # --- stores ------------------------------------------------------------------------------
    def store_async(self, data: memoryview) -> None:
        """Queues `data` (never mutated afterwards) to be stored under its sha256."""
        with self._cond:
            if self._closed:
                return
            if self._thread is None:
                self._thread = Thread(target=self._run, name="rpc-cache-writer", daemon=True)
                self._thread.start()
            deadline = time.monotonic() + WRITER_WAIT_S
            while self._pending_bytes > _MAX_PENDING and self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("cache writer %.0f MiB behind for %.0f s: %d B not cached",
                                self._pending_bytes / 2**20, WRITER_WAIT_S, data.nbytes)
                    return
                self._cond.wait(left)
            self._pending.append(data)
            self._pending_bytes += data.nbytes
            self._cond.notify_all()

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Writes what is queued (for at most `timeout` seconds), then ends the writer thread.
        A write still running then is abandoned; its temporary file is removed now if possible,
        else by the next start."""
        with self._cond:
            self._closed = True
            self._pending.append(None)
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("cache writer still busy after %.0f s: unfinished writes abandoned", timeout)
                tmp = self._writing
                if tmp is not None:
                    _unlink(tmp)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait(_IDLE_WAIT_S)
                data = self._pending.popleft()
            if data is None:
                return
            try:
                self._store(data)
            except Exception as exc:  # noqa: BLE001 - a cache write failing only costs a later upload
                log.warning("cache write failed: %s", exc)
            finally:
                with self._cond:
                    self._pending_bytes -= data.nbytes
                    self._cond.notify_all()

    def _store(self, data: memoryview) -> None:
        digest = hashlib.sha256(data).digest()
        path = self.path(digest)
        if os.path.exists(path):
            return
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", dir=self.dir)
        self._writing = tmp
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        finally:
            self._writing = None
        log.debug("cached %d B as %s", data.nbytes, digest.hex())


def remove_stale_temporaries(directory: str) -> int:
    """Removes the `.tmp-*` files in `directory` whose writer is no longer running (any process
    whose pid is in the name and alive is left alone: another server sharing the directory);
    returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError as exc:
        log.warning("cache %s: %s", directory, exc)
        return 0
    for name in names:
        if not name.startswith(TMP_PREFIX):
            continue
        pid = name[len(TMP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        if _unlink(os.path.join(directory, name)):
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def as_bytes_view(data) -> memoryview:
    """A flat unsigned-byte memoryview of any contiguous buffer."""
    mv = memoryview(data)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


__all__ = ["TensorCache", "CACHE_MIN_BYTES", "as_bytes_view", "remove_stale_temporaries"]
