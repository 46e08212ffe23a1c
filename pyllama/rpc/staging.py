"""The host staging arena of one RPC connection, shared by every pipeline group that uses it.

A tensor read from a peer on its way to another device lands in a region of this arena (the read
travels with the producing graph) and leaves it when the consuming device has taken the bytes;
only then is the region released. Regions are handed out in order from a ring. A region that does
not fit before the end wraps to the start, and a wrap waits until every outstanding region, of
whichever group, has been released, so no two live regions ever overlap. When the last outstanding
region is released the ring starts over at the beginning, so a server uses the first pages of its
arena over and over rather than walking all of it. A caller that already
holds a region is never made to wait for a wrap (it would wait for itself): it gets None and
takes the synchronous path for that copy, and so does a caller whose wrap found no room within
`wait_s` (the RPC timeout: the regions it waits for are released within it, unless their owner
failed). Closing the arena (the connection went away) wakes every
waiter; their reservations fail.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

import numpy as np

from ..util.settings import STAGING_ALIGN as ALIGN
from ..util.settings import current


def arena_size() -> int:
    """Bytes of a connection's arena: $PYLLAMA_RPC_STAGING_BYTES, else 64 MiB."""
    return current().rpc.staging_bytes


class Region:
    """Reserved bytes of the arena; `view` is valid until release()."""

    __slots__ = ("arena", "start", "view", "_live")

    def __init__(self, arena: "StagingArena", start: int, nbytes: int):
        self.arena = arena
        self.start = start
        self.view = arena.data[start:start + nbytes]
        self._live = True

    def release(self) -> None:
        if self._live:
            self._live = False
            self.arena._release(self)


class StagingArena:
    def __init__(self, size: int, wait_s: float = 120.0):
        raw = np.zeros(size + ALIGN, dtype=np.uint8)
        start = (-raw.ctypes.data) % ALIGN
        self.data = raw[start:start + size]
        self.size = size
        self.wait_s = wait_s
        self._head = 0
        self._outstanding = 0
        self._held = threading.local()  # regions the calling thread holds
        self._cond = threading.Condition()
        self._closed = False
        self.wraps = 0  # how many times the ring wrapped (for tests and stats)

    def reserve(self, nbytes: int) -> Optional[Region]:
        """A region of `nbytes`, or None when it can never fit, fitting it would mean waiting
        for a region this thread holds, or no room came within `wait_s`. Raises RuntimeError
        once the arena is closed."""
        n = -(-nbytes // ALIGN) * ALIGN
        if n > self.size:
            return None
        held = getattr(self._held, "n", 0)
        deadline = None
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the connection's staging arena is closed")
                if self._head + n <= self.size:
                    break
                if held:  # a wrap waits for every region, ours included
                    return None
                if self._outstanding == 0:
                    self._head = 0
                    self.wraps += 1
                    break
                if deadline is None:
                    deadline = time.monotonic() + self.wait_s
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            start = self._head
            self._head += n
            self._outstanding += 1
        self._held.n = held + 1
        return Region(self, start, nbytes)

    def _release(self, region: Region) -> None:
        with self._cond:
            self._outstanding -= 1
            if self._outstanding == 0:
                # Nothing is reserved: start over at the beginning. Walking the whole arena would
                # touch every page of it (a fault each, the first time), and the pages in use would
                # be cold by the time the ring came back to them.
                if self._head:
                    self._head = 0
                    self.wraps += 1
                self._cond.notify_all()
        self._held.n = max(getattr(self._held, "n", 1) - 1, 0)

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
