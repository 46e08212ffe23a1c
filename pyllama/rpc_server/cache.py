"""The server-side tensor cache (--cache DIR): tensor bytes stored under their sha256.

SET_TENSOR_HASH looks a file up by its hex digest and copies it into the region; a SET_TENSOR of at
least CACHE_MIN_BYTES stores its bytes there (hashed and written by a background thread, through a
temporary file and a rename, so a reader never sees a partial file) so that a restarted server does
not need them again.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from collections import deque
from typing import Optional

log = logging.getLogger("pyllama.rpc_server")

CACHE_MIN_BYTES = 1 << 20
_MAX_PENDING = 512 << 20  # bytes waiting to be hashed before a SET_TENSOR waits for the writer


class TensorCache:
    def __init__(self, directory: str):
        self.dir = os.path.abspath(directory)
        os.makedirs(self.dir, exist_ok=True)
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise PermissionError(f"cache directory {self.dir} is not writable")
        self._pending: "deque[Optional[memoryview]]" = deque()
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

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
                self._thread = threading.Thread(target=self._run, name="rpc-cache-writer", daemon=True)
                self._thread.start()
            while self._pending_bytes > _MAX_PENDING and self._pending:
                self._cond.wait()
            self._pending.append(data)
            self._pending_bytes += data.nbytes
            self._cond.notify_all()

    def close(self) -> None:
        """Writes what is queued, then ends the writer thread."""
        with self._cond:
            self._closed = True
            self._pending.append(None)
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
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
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        log.info("cached %d B as %s", data.nbytes, digest.hex())


def as_bytes_view(data) -> memoryview:
    """A flat unsigned-byte memoryview of any contiguous buffer."""
    mv = memoryview(data)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


__all__ = ["TensorCache", "CACHE_MIN_BYTES", "as_bytes_view"]
