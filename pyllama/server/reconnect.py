"""PeerReconnector: brings lost rpc servers back without restarting the server.

One background thread. It learns of a lost device from a group whose step failed (`notify`), or
by itself every POLL_S seconds: a peer that closed its connection (it exited or was killed) is
noticed even while nothing runs; one that stopped answering is noticed by the next command that
waits for it, after the RPC timeout. While a device is lost, /health reports it and every group
answers new requests with 503.

Each attempt first opens a new connection to the lost peers without stopping anything (a peer
still down costs a refused connect; a stalled one, up to the RPC timeout). Once that succeeds it
stops every group between steps (their locks, taken in order, each waited for at most the RPC
timeout) and, with all of them stopped:
fails the requests still running (part of their KV cache went with the peer; they are never
resumed on an empty one), makes every slot forget its cached prompt, has the engine re-create
what it had on the peer (weight buffers refilled, through the peer's weight cache when it has
one; every context's KV cache and compute buffers), and clears the groups' faults. A failed
attempt is retried after a delay that doubles from BACKOFF_MIN_S up to BACKOFF_MAX_S.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

from ..runtime.engine import Engine
from ..rpc.connection import configured_timeout
from ..batching.group import PipelineGroup, groups_stopped
from ..util.threads import Thread

log = logging.getLogger(__name__)

POLL_S = 0.5
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 5.0


class PeerReconnector:
    def __init__(self, engine: Engine, groups: list[PipelineGroup]):
        self.engine = engine
        self.groups = groups
        self.attempts = 0                   # failed attempts since the device was lost
        self.last_error: Optional[str] = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.thread = Thread(target=self._run, name="reconnect", daemon=True)
        for g in groups:
            g.on_fault = self.notify

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Ends the thread; an attempt blocked on a stalled peer is left to end with the process
        (it holds no group)."""
        self._stop.set()
        self._wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def notify(self) -> None:
        """A group's step failed on a lost device: look now rather than at the next poll."""
        self._wake.set()

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _run(self) -> None:
        delay = BACKOFF_MIN_S
        while not self._stop.is_set():
            lost = self.engine.lost_devices()
            if not lost:
                self.attempts, self.last_error, delay = 0, None, BACKOFF_MIN_S
                self._sleep(POLL_S)
                continue
            try:
                self._reconnect(lost)
            except Exception as exc:  # noqa: BLE001 - any failure: the device stays lost, try later
                self.attempts += 1
                self.last_error = str(exc)
                log.warning("reconnecting %s failed (attempt %d): %s; next attempt in %.1f s",
                            ", ".join(lost), self.attempts, exc, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
            else:
                self.attempts, self.last_error, delay = 0, None, BACKOFF_MIN_S

    def _reconnect(self, lost: dict[str, str]) -> None:
        self.engine.reach_lost_devices()  # raises while a peer is still away
        if self._stop.is_set():
            return
        reason = "; ".join(lost.values())
        # a step ends within the RPC timeout; one that does not fails this attempt
        with groups_stopped(self.groups, configured_timeout()):
            for g in self.groups:
                g.abandon(reason)
            restored = self.engine.restore_lost_devices()
            for g in self.groups:
                g.fault = None
        log.info("reconnected %s; serving again", ", ".join(restored))
