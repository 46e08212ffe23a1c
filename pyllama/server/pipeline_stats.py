"""The live pipeline view: how busy each device of the split was over the last few seconds.

Measured, not guessed, from three records the server keeps anyway:

* each local device's busy spans (`pyllama.obs.busy.BusyClock`, filled by the backend around every
  graph it computes);
* each rpc peer's busy spans, asked of the rpc server with DEVICE_BUSY (docs/rpc-protocol.md) when
  a reader wants them, and mapped onto this host's clock with the reply's timestamps as TRACE_SYNC
  does; a peer that does not advertise the command is shown as not measured;
* each pipeline group's steps (`StepLog`, one tuple per decode step), and the RPC connections'
  command and byte counters.

Over a window [t - window, t] every device's time splits into busy, waiting (another device busy,
this one not: it waits on the other node) and idle (no device busy), which add up to the window.
These are the same quantities `trace_tools/merge.py` computes from trace files (union of the
devices' compute spans), so the two agree within the clock mapping's error.

Nothing here runs unless someone reads: `/pipeline/stats` and `/metrics` call `snapshot`, which
polls the peers (one small round trip each) and computes on a worker thread. Memory is bounded:
the step logs and span stores keep at most a few thousand entries each.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Optional, Sequence, Union

import numpy as np

from ..obs import spans as _spans
from ..obs.busy import now_us
from ..obs.steps import StepLog  # noqa: F401 - the server's views read the groups' logs through here
from ..rpc import protocol as P
from ..rpc.protocol import Cap, Cmd

__all__ = ["StepLog", "PipelineStats", "union", "covered", "MAX_WINDOW_S", "DEFAULT_WINDOW_S"]

DEFAULT_WINDOW_S = 5.0
MAX_WINDOW_S = 30.0
_KEEP_US = int((MAX_WINDOW_S + 5) * 1e6)  # peer spans older than this are dropped
_LOCK_WAIT_S = 2.0       # a snapshot that waits longer for another one answers with that one's result
_FIRST_WAIT_S = 120.0  # (a first snapshot has no earlier one to answer with)


# --- interval arithmetic ------------------------------------------------------------------------
Spans = np.ndarray  # [n, 2] int64 (start, end) rows


def union(spans: Union[Sequence[tuple[int, int]], np.ndarray]) -> Spans:
    """Sorted, disjoint spans covering exactly what the given (start, end) spans cover (spans that
    touch become one): obs.spans.union over rows."""
    a = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    return np.stack(_spans.union(a[:, 0], a[:, 1]), axis=1)


def covered(spans: Union[Sequence[tuple[int, int]], np.ndarray], w0: int, w1: int) -> int:
    """Length of [w0, w1) that disjoint `spans` cover."""
    a = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    return _spans.covered((a[:, 0], a[:, 1]), w0, w1)


# --- the peers ----------------------------------------------------------------------------------
class _Peer:
    """What is known of one rpc device: its spans on our clock, until when they are known."""

    def __init__(self) -> None:
        self.spans: Spans = np.zeros((0, 2), np.int64)  # local clock, disjoint, ascending
        self.since_srv = 0                      # the next poll asks for spans ending after this (peer clock)
        self.known_until = 0                    # local time up to which `spans` is complete
        self.total_us = 0
        self.offsets: deque[tuple[int, int]] = deque(maxlen=8)  # (rtt, offset) of recent polls
        self.conn_id = 0
        self.note: Optional[str] = None


class PipelineStats:
    """Snapshots of the pipeline over a recent window; thread-safe, one snapshot at a time."""

    def __init__(self, backends: Sequence[Any], groups: Sequence[Any], router: Any = None) -> None:
        self.backends = list(backends)
        self.groups = list(groups)
        self.router = router
        # the window never reaches before the first step recorded (made on first use, this object
        # finds the steps of the minutes before in the groups' logs)
        firsts = [g.step_log.steps[0][0] for g in self.groups if g.step_log.steps]
        self.started_us = min(firsts) if firsts else now_us()
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {b.name: _Peer() for b in self.backends if b.remote}
        # per connection: (n, bytes out, bytes in) of our own DEVICE_BUSY calls, not the pipeline's
        self._own: dict[int, list[int]] = {}
        # (t_us, steps of all groups, {endpoint: (round trips, bytes out, bytes in)}) of earlier snapshots
        self._link_history: deque[tuple[int, int, dict[str, tuple[int, int, int]]]] = deque(maxlen=64)
        self._last: Optional[dict] = None

    # --- peers -----------------------------------------------------------------------------------
    def _poll_peer(self, backend: Any) -> None:
        peer = self._peers[backend.name]
        conn = backend.conn
        if id(conn) != peer.conn_id:  # a new connection (reconnected): a new server process, maybe
            peer.conn_id = id(conn)
            peer.since_srv = 0
            peer.offsets.clear()
        if conn.broken:
            peer.note = f"unreachable: {conn.broken}"
            return
        if not conn.has(Cap.DEVICE_BUSY):
            peer.note = "not measured: the rpc server does not report its busy time (DEVICE_BUSY)"
            return
        req = P.BUSY_REQ.pack(backend.device, 0, peer.since_srv)
        t1 = now_us()
        try:
            rep = conn.call(Cmd.DEVICE_BUSY, req)
        except Exception as exc:  # noqa: BLE001 - a peer's failure must not fail the page
            peer.note = f"not measured: {exc}"
            return
        t4 = now_us()
        own = self._own.setdefault(id(conn), [0, 0, 0])
        own[0] += 1
        own[1] += len(req) + P.HEADER.size
        own[2] += len(rep) + P.HEADER.size
        if len(rep) < P.BUSY_HEAD.size:
            peer.note = "not measured: malformed DEVICE_BUSY reply"
            return
        t2, t3, total, n, _ = P.BUSY_HEAD.unpack_from(rep)
        if len(rep) != P.BUSY_HEAD.size + n * P.BUSY_SPAN.size:
            peer.note = "not measured: malformed DEVICE_BUSY reply"
            return
        # offset = peer clock - our clock, NTP style; the poll with the shortest round trip of the
        # recent ones is the most accurate (waiting behind the peer's queued work lengthens it)
        peer.offsets.append(((t4 - t1) - (t3 - t2), ((t2 - t1) + (t3 - t4)) // 2))
        offset = min(peer.offsets)[1]
        fresh = np.frombuffer(rep, dtype="<u8", count=2 * n, offset=P.BUSY_HEAD.size).astype(np.int64).reshape(-1, 2)
        old = peer.spans
        # spans ending after the last poll's time come again (a running one then, finished now)
        old = old[(old[:, 1] > t4 - _KEEP_US) & (old[:, 1] + offset <= peer.since_srv)]
        peer.spans = union(np.concatenate([old, fresh - offset]))
        peer.since_srv = t3
        peer.known_until = t3 - offset
        peer.total_us = total
        peer.note = None

    # --- the snapshot ----------------------------------------------------------------------------
    def snapshot(self, window_s: float = DEFAULT_WINDOW_S) -> dict:
        """The figures of the last `window_s` seconds (capped at MAX_WINDOW_S and at the server's
        age). Blocks for one round trip per rpc peer: call it off the event loop."""
        if not self._lock.acquire(timeout=_LOCK_WAIT_S):
            if self._last is not None:
                return self._last
            # the first snapshot: whoever holds the lock waits on peers, each bounded by the RPC timeout
            if not self._lock.acquire(timeout=_FIRST_WAIT_S):
                raise TimeoutError(f"pipeline figures still not ready after {_FIRST_WAIT_S:.0f} s")
        try:
            self._last = self._snapshot(min(max(window_s, 0.1), MAX_WINDOW_S))
            return self._last
        finally:
            self._lock.release()

    def _snapshot(self, window_s: float) -> dict:
        for b in self.backends:
            if b.remote:
                self._poll_peer(b)
        now = now_us()
        w1 = now
        for b in self.backends:  # the window ends where every device's record is complete
            if b.remote and self._peers[b.name].note is None:
                w1 = min(w1, self._peers[b.name].known_until)
        w0 = max(self.started_us, w1 - int(window_s * 1e6))
        length = max(w1 - w0, 1)
        spans: dict[str, Spans] = {}
        devices: list[dict] = []
        for b in self.backends:
            d: dict[str, Any] = {"name": b.name, "kind": "rpc" if b.remote else _kind(b), "measured": False,
                                 "busy": None, "waiting": None, "idle": None, "busy_total_s": None, "note": None}
            if b.remote:
                d["endpoint"] = b.conn.endpoint
                peer = self._peers[b.name]
                if peer.note is None:
                    spans[b.name] = peer.spans[peer.spans[:, 1] > w0]
                    d["busy_total_s"] = peer.total_us / 1e6
                else:
                    d["note"] = peer.note
            else:
                clock = getattr(b, "busy", None)
                if clock is not None:
                    spans[b.name] = union(clock.spans(w0, w1))
                    d["busy_total_s"] = clock.total_us(now) / 1e6
                else:
                    d["note"] = "not measured: this device does not record its busy time"
            devices.append(d)
        measured = list(spans)
        all_busy = covered(union(np.concatenate([spans[n] for n in measured])), w0, w1) if measured else 0
        idle = 1.0 - all_busy / length
        for d in devices:
            s = spans.get(d["name"])
            if s is None:
                continue
            busy_us = covered(s, w0, w1)
            d.update(measured=True, busy=busy_us / length, waiting=(all_busy - busy_us) / length, idle=idle)
        groups = []
        n_steps_all = 0
        tokens_all = 0
        for g in self.groups:
            log: StepLog = g.step_log
            steps = [s for s in log.since(w0) if s[0] < w1]
            n = len(steps)
            tokens = sum(s[3] for s in steps)
            n_steps_all += log.n_total
            tokens_all += tokens
            groups.append({
                "group": g.index, "steps": n, "steps_total": log.n_total, "tokens_total": log.tokens_total,
                "step_ms": sum(s[1] - s[0] for s in steps) / n / 1e3 if n else None,
                "batch_size": sum(s[2] for s in steps) / n if n else None,
                "tokens_per_s": tokens / (length / 1e6),
                "slots": len(g.slots), "slots_busy": g.n_busy(),
            })
        slots_total = sum(len(g.slots) for g in self.groups)
        slots_busy = sum(g["slots_busy"] for g in groups)
        waiting = getattr(self.router, "n_deferred", 0) if self.router is not None else 0
        return {
            "window_s": length / 1e6, "window_t0_us": w0, "window_t1_us": w1, "t_us": now, "devices": devices,
            "idle_all": idle if measured else None,
            "groups": groups, "tokens_per_s": tokens_all / (length / 1e6),
            "slots": {"total": slots_total, "busy": slots_busy, "waiting": waiting},
            "rpc": self._links(now, n_steps_all),
        }

    def _links(self, now: int, n_steps: int) -> list[dict]:
        """Per rpc connection: totals since it opened, and per decode step since the oldest earlier
        snapshot of the window (null on the first snapshot: nothing to compare with yet)."""
        counters: dict[str, tuple[int, int, int]] = {}
        for b in self.backends:
            if not b.remote or b.conn.endpoint in counters:
                continue
            conn = b.conn
            own = self._own.get(id(conn), [0, 0, 0])
            n, out, inn = conn.traffic()  # the session's connection and its groups' lanes
            counters[conn.endpoint] = (n - own[0], out - own[1], inn - own[2])
        base = None
        for t, steps, c in self._link_history:
            if now - t <= int(MAX_WINDOW_S * 1e6) and steps < n_steps:
                base = (t, steps, c)
                break
        self._link_history.append((now, n_steps, counters))
        out = []
        for ep, (rt, bo, bi) in counters.items():
            d: dict[str, Any] = {"endpoint": ep, "round_trips_total": rt, "bytes_out_total": bo, "bytes_in_total": bi,
                                 "round_trips_per_step": None, "bytes_out_per_step": None,
                                 "bytes_in_per_step": None}
            if base is not None and ep in base[2]:
                prev = base[2][ep]
                ds = n_steps - base[1]
                if all(x >= y for x, y in zip((rt, bo, bi), prev)):  # not a new connection since
                    d.update(round_trips_per_step=(rt - prev[0]) / ds, bytes_out_per_step=(bo - prev[1]) / ds,
                             bytes_in_per_step=(bi - prev[2]) / ds)
            out.append(d)
        return out


def _kind(backend: Any) -> str:
    try:
        return backend.device_info().kind
    except Exception:  # noqa: BLE001
        return "?"
