"""Merges the trace files of one run onto a common time line.

Every process of a run (the HTTP server, `generate`, each rpc-server) writes its own JSON-lines
file in the microseconds of its own host's monotonic clock. Those clocks are unrelated across
hosts, so the files only make sense together once each rpc-server file is shifted by the offset
its client measured (the `clock` events). This module does that shift, then offers three views:

* `chrome_trace`: every span in the Chrome trace event format, to look at in Perfetto or
  chrome://tracing, with the RPC phases (send / wait / recv, recv / exec / send) as nested slices;
* `step_summary`: one row per decode step (`server`/`iteration`) with its host phases, how busy
  the devices were, where the time that no device worked went, and the step's own path through
  the split (`step_chain`: its local compute, and per peer stage the wait in the peer's queue, the
  peer's execution and the wait of the reply);
* `device_summary` / `format_summary`: per device (each local one, each peer's) busy, idle while
  another device was busy, idle while none was, idle share and transfer time, the longest stretch
  in which no device worked and the host phase that owns it;
* the CLI: ``python trace_tools/merge.py TRACE... [--chrome OUT.json] [--summary] [--steps]
  [--out STEPS.csv|STEPS.parquet]``.

The events table (`Trace.events`) has one row per event and flattened columns: `file` (the
position of its file in the list given to `load`), `uid`, `role`, `host` (from that file's
header), `c`, `n`, `t0`, `t1`, `tid`, `grp`, then one column per other field found in any event
(`subj`, `endpoint`, `t_send0`, `n_decode`, ...), missing values as NA. `t0`, `t1` and every
`t_*` column are on the base file's clock; other fields are kept as written (so the `t2`/`t3` of
a `clock` event stay in the peer's clock).
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import pandas as pd

from pyllama.obs.spans import union  # noqa: F401 - the busy spans' arithmetic, shared with the live view

ROLES = ("server", "rpc-server", "generate")
CLIENT_ROLES = ("server", "generate")
CORE = ["file", "uid", "role", "host", "c", "n", "t0", "t1", "tid", "grp"]
STEP_PHASES = ("batch_build", "submit", "synchronize", "post_decode", "sampling", "result_send")
LOGITS_TENSOR = "result_output"
LOGITS_READS = ("GET_TENSOR", "GET_TENSORS")
RPC_PHASES = {
    "rpc.client": (("send", "t_send0", "t_send1"), ("wait", "t_send1", "t_recv0"), ("recv", "t_recv0", "t_recv1")),
    "rpc.server": (("recv", "t_recv0", "t_recv1"), ("exec", "t_exec0", "t_exec1"), ("send", "t_send0", "t_send1")),
}
_UID = re.compile(r"[0-9a-fA-F]{16}")

Intervals = tuple[np.ndarray, np.ndarray]  # sorted, disjoint [start, end) pairs as two int64 arrays


class TraceError(ValueError):
    """A trace file that does not follow the format; the message names the file and line."""


@dataclass
class Trace:
    """The merged files. `headers[i]` describes file i (its header fields plus `path` and
    `offset_us`, the peer clock minus the base clock that was subtracted from its times);
    `base` is the file whose clock is the common time line (None when no server/generate file
    was given); `warnings` lists what could not be aligned."""
    headers: list[dict]
    events: pd.DataFrame
    base: Optional[int]
    warnings: list[str] = field(default_factory=list)


# --- reading --------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _header_problem(h: Any) -> Optional[str]:
    """Why `h` is not a valid header, or None. Checked strictly: every later step trusts it."""
    if not isinstance(h, dict) or h.get("type") != "header":
        return "missing header (line 1 is not a header record)"
    if h.get("version") != 1:
        return f"unsupported trace version {h.get('version')!r}"
    if h.get("role") not in ROLES:
        return f"invalid header: role {h.get('role')!r} is not one of {', '.join(ROLES)}"
    if not isinstance(h.get("uid"), str) or not _UID.fullmatch(h["uid"]):
        return f"invalid header: uid {h.get('uid')!r} is not 16 hex digits"
    if not isinstance(h.get("host"), str) or not _is_int(h.get("pid")):
        return "invalid header: host must be a string and pid an integer"
    if h.get("endpoint") is not None and not isinstance(h.get("endpoint"), str):
        return "invalid header: endpoint must be a string or null"
    if not (_is_int(h.get("t_open_us")) and _is_int(h.get("wall_us"))):
        return "invalid header: t_open_us and wall_us must be integers"
    return None


def _event(line: str) -> Optional[dict]:
    """The event on `line`, or None when the line is not one (bad JSON or missing fields)."""
    try:
        ev = json.loads(line)
    except json.JSONDecodeError:
        return None
    ok = (isinstance(ev, dict) and isinstance(ev.get("c"), str) and isinstance(ev.get("n"), str)
          and _is_int(ev.get("t0")) and _is_int(ev.get("t1")))
    return ev if ok else None


def read_file(path: str | Path) -> tuple[dict, list[dict]]:
    """Header and events of one file. A process killed while writing leaves a partial last
    line, which is dropped; any other bad line means the file is not what we think it is, so
    it raises TraceError rather than silently merging half a file."""
    lines = Path(path).read_text(encoding="utf-8", errors="replace").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        header = None
    problem = _header_problem(header)
    if problem:
        raise TraceError(f"{path}:1: {problem}")
    events = []
    for no, line in enumerate(lines[1:], start=2):
        ev = _event(line)
        if ev is None:
            if no == len(lines):
                break
            raise TraceError(f"{path}:{no}: not a trace event: {line[:60]!r}")
        events.append(ev)
    return header, events


def _frame(i: int, header: dict, events: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame.from_records(events) if events else pd.DataFrame(columns=["c", "n", "t0", "t1"])
    return df.assign(file=i, uid=header["uid"], role=header["role"], host=header["host"])


def _normalise(df: pd.DataFrame) -> pd.DataFrame:
    """Fixed dtypes and column order: int64 times, nullable Int64 for optional integers."""
    for col in CORE:
        if col not in df:
            df[col] = pd.NA
    df["t0"] = df["t0"].astype("int64")
    df["t1"] = df["t1"].astype("int64")
    df["file"] = df["file"].astype("int64")
    df["tid"] = df["tid"].fillna("").astype(str)
    for col in ["grp"] + _time_columns(df):
        df[col] = pd.to_numeric(df[col], errors="coerce").round().astype("Int64")
    return df[CORE + sorted(c for c in df.columns if c not in CORE)]


def _time_columns(df: pd.DataFrame) -> list[str]:
    """The optional time-stamp fields (t_send0, t_exec1, ...): the ones the clock shift moves."""
    return [c for c in df.columns if c.startswith("t_")]


def column(df: pd.DataFrame, col: str) -> pd.Series:
    """A column that may be absent (no event had that field): all NA then."""
    return df[col] if col in df else pd.Series(pd.NA, index=df.index, dtype="object")


def _bind_offsets(headers: list[dict], events: pd.DataFrame, base: Optional[int]) -> tuple[list[int], list[str]]:
    """Offset per file. An rpc-server file is bound by its uid to the base file's `clock` events
    (the peer_uid is the uid the peer put in its header, so host names and endpoints, which
    repeat and get rewritten by proxies, play no part); of several measurements the one with the
    smallest round trip is the tightest."""
    offsets, notes = [0] * len(headers), []
    uids = [h["uid"] for h in headers]
    for u in sorted({u for u in uids if uids.count(u) > 1}):
        notes.append(f"uid {u} appears in several files; their clocks cannot be told apart")
    clocks = events[(events["file"] == base) & (events["c"] == "clock") & (events["n"] == "offset")]
    peer = column(clocks, "peer_uid").astype("string").str.lower()
    offset = pd.to_numeric(column(clocks, "offset_us"), errors="coerce")
    rtt = pd.to_numeric(column(clocks, "rtt_us"), errors="coerce").fillna(np.inf)
    for i, h in enumerate(headers):
        if h["role"] != "rpc-server":
            continue
        mine = (peer == h["uid"].lower()).fillna(False).to_numpy(bool) & offset.notna().to_numpy(bool)
        if base is None or not mine.any():
            notes.append(f"{h['path']}: no clock event of the base trace names uid {h['uid']}; "
                         "its times are left unshifted (offset 0)")
            continue
        offsets[i] = int(offset[mine].loc[rtt[mine].idxmin()])
    return offsets, notes


def load(paths: Sequence[str | Path]) -> Trace:
    """Reads the files and puts every event on the clock of the base file (the first server or
    generate file given). Files that cannot be aligned are still merged, with a warning."""
    files = [read_file(p) for p in paths]
    headers = [dict(h, path=str(p)) for p, (h, _) in zip(paths, files)]
    frames = [_frame(i, h, evs) for i, (h, evs) in enumerate(files)]
    events = _normalise(pd.concat(frames, ignore_index=True) if frames else pd.DataFrame())
    base = next((i for i, h in enumerate(headers) if h["role"] in CLIENT_ROLES), None)
    offsets, notes = _bind_offsets(headers, events, base)
    shift = events["file"].map(dict(enumerate(offsets))).astype("int64")
    for col in ["t0", "t1"] + _time_columns(events):
        events[col] = events[col] - shift
    for h, off in zip(headers, offsets):
        h["offset_us"] = off
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return Trace(headers=headers, events=events, base=base, warnings=notes)


# --- interval arithmetic ------------------------------------------------------------------
def _length_before(starts: np.ndarray, ends: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Sum over spans of their length left of each x: a piecewise linear function of x, so
    sorted starts and ends with prefix sums give it for all x at once."""
    s, e = np.sort(starts), np.sort(ends)
    cs, ce = np.r_[np.int64(0), np.cumsum(s)], np.r_[np.int64(0), np.cumsum(e)]
    i, j = np.searchsorted(s, x, "right"), np.searchsorted(e, x, "right")
    return (i * x - cs[i]) - (j * x - ce[j])


def overlap(starts: Any, ends: Any, w0: Any, w1: Any) -> np.ndarray:
    """For each window [w0, w1): the summed length of the spans' overlaps with it. Overlapping
    spans count each time; pass `union(...)` to measure covered time instead."""
    s, e = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    s, e = s[e > s], e[e > s]
    w0, w1 = np.asarray(w0, np.int64), np.asarray(w1, np.int64)
    return _length_before(s, e, w1) - _length_before(s, e, w0)


def locate(iv: Intervals, x: np.ndarray) -> np.ndarray:
    """Index of the interval of `iv` that contains each x, -1 where none does."""
    s, e = iv
    if len(s) == 0:
        return np.full(len(x), -1)
    k = np.searchsorted(s, x, "right") - 1
    return np.where((k >= 0) & (x < e[np.maximum(k, 0)]), k, -1)


def combine(sets: Sequence[Intervals], keep: Callable[..., np.ndarray]) -> Intervals:
    """Set algebra on interval sets: cuts the time line at every edge of every set and keeps the
    pieces where `keep(*memberships)` holds, e.g. `combine([a, b], lambda x, y: x & ~y)` is a
    minus b."""
    edges = np.unique(np.concatenate([np.r_[s, e] for s, e in sets] + [np.empty(0, np.int64)]))
    lo, hi = edges[:-1], edges[1:]
    inside = keep(*[locate(iv, lo) >= 0 for iv in sets])
    return union(lo[inside], hi[inside])


def length(iv: Intervals) -> int:
    """Total time of a disjoint interval set."""
    return int((iv[1] - iv[0]).sum())


def innermost(t0: Any, t1: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cuts the time covered by (possibly nested) spans into pieces, each owned by its innermost
    covering span: the one that started last, ties going to the shortest. That is the span the
    thread was actually in. A sweep over the sorted edges with a heap of open spans; returns
    (starts, ends, owner index), pieces sorted and disjoint."""
    t0, t1 = np.asarray(t0, np.int64).tolist(), np.asarray(t1, np.int64).tolist()
    order = sorted(range(len(t0)), key=t0.__getitem__)
    edges = sorted(set(t0) | set(t1))
    heap: list[tuple[int, int, int]] = []
    pieces: list[tuple[int, int, int]] = []
    nxt = 0
    for lo, hi in zip(edges[:-1], edges[1:]):
        while nxt < len(order) and t0[order[nxt]] <= lo:
            k = order[nxt]
            heapq.heappush(heap, (-t0[k], t1[k] - t0[k], k))
            nxt += 1
        while heap and t1[heap[0][2]] <= lo:
            heapq.heappop(heap)
        if heap:
            pieces.append((lo, hi, heap[0][2]))
    s, e, k = np.array(pieces, np.int64).reshape(-1, 3).T
    return s, e, k


# --- per-step summary ---------------------------------------------------------------------
def _same_group(grp: pd.Series, g: Any) -> np.ndarray:
    """Rows of group g (a missing group matches missing ones only)."""
    return (grp.isna() if pd.isna(g) else grp.eq(g).fillna(False)).to_numpy(bool)


def _by_group(spans: pd.DataFrame, it: pd.DataFrame) -> np.ndarray:
    """Per iteration: summed overlap with its window of the spans of the same group."""
    out = np.zeros(len(it), np.int64)
    for g in it["grp"].unique():
        m = _same_group(it["grp"], g)
        mine = spans[_same_group(spans["grp"], g)]
        out[m] = overlap(mine["t0"], mine["t1"], it["t0"].to_numpy()[m], it["t1"].to_numpy()[m])
    return out


def _names(subj: pd.Series, name: str) -> pd.Series:
    """Whether a comma-joined tensor list names `name` exactly."""
    pattern = rf"(?:^|,){re.escape(name)}(?:,|$)"
    return subj.astype("string").str.contains(pattern, regex=True).fillna(False).astype(bool)


def _inherit_group(spans: pd.DataFrame, mine: pd.DataFrame) -> pd.Series:
    """The group of each span; one written without a group (the scheduler's spans, a command sent
    outside a tagged thread) takes it from the ctx.decode, else the iteration, that encloses it
    on the same thread: it was done on behalf of that step."""
    grp = spans["grp"].copy()
    for c, n in (("ctx", "decode"), ("server", "iteration")):
        todo = spans[grp.isna()]
        parents = mine[(mine["c"] == c) & (mine["n"] == n) & mine["grp"].notna()]
        at = _enclosing(todo, parents)
        hit = at >= 0
        grp.loc[todo.index[hit]] = parents["grp"].to_numpy()[at[hit]]
    return grp


def _enclosing(spans: pd.DataFrame, parents: pd.DataFrame) -> np.ndarray:
    """Per span, the position in `parents` of the one on the same thread that encloses it (the
    latest to start before it, if it ends after it), or -1."""
    out = np.full(len(spans), -1)
    if spans.empty or parents.empty:
        return out
    left = pd.DataFrame({"tid": spans["tid"].to_numpy(), "t0": spans["t0"].to_numpy(np.int64),
                         "t1": spans["t1"].to_numpy(np.int64), "row": np.arange(len(spans))}).sort_values("t0")
    right = pd.DataFrame({"tid": parents["tid"].to_numpy(), "p0": parents["t0"].to_numpy(np.int64),
                          "p1": parents["t1"].to_numpy(np.int64), "at": np.arange(len(parents))}).sort_values("p0")
    hit = pd.merge_asof(left, right, left_on="t0", right_on="p0", by="tid", direction="backward")
    hit = hit[hit["p1"].astype("float") >= hit["t1"]]
    out[hit["row"].to_numpy()] = hit["at"].to_numpy(np.int64)
    return out


def _host_spans(mine: pd.DataFrame) -> pd.DataFrame:
    """The base file's host-side spans that idle device time can be charged to, labelled c:n."""
    c, n = mine["c"], mine["n"]
    host = mine[((c == "server") & (n != "iteration")) | ((c == "ctx") & (n == "decode"))
                | (c == "sched") | (c == "rpc.client")]
    return pd.DataFrame({"t0": host["t0"], "t1": host["t1"], "grp": _inherit_group(host, mine),
                         "label": host["c"] + ":" + host["n"]})


def _attribute_idle(mine: pd.DataFrame, it: pd.DataFrame, busy: Intervals) -> pd.DataFrame:
    """Per iteration, the time no device worked, split by the innermost host span of the step's
    group covering it. Pieces are disjoint and lie inside the idle time, so the columns never add
    up to more than the idle time."""
    host = _host_spans(mine)
    cols = {f"idle_{lab}_us": np.zeros(len(it), np.int64) for lab in sorted(host["label"].unique())}
    w0, w1 = it["t0"].to_numpy(), it["t1"].to_numpy()
    for g in it["grp"].unique():
        m = _same_group(it["grp"], g)
        h = host[_same_group(host["grp"], g)]
        s, e, owner = innermost(h["t0"], h["t1"])
        edges = np.unique(np.r_[s, e, busy[0], busy[1]])
        lo, hi = edges[:-1], edges[1:]
        piece = locate((s, e), lo)
        idle = (piece >= 0) & (locate(busy, lo) < 0)
        labels = h["label"].to_numpy()[owner[piece[idle]]]
        for lab in np.unique(labels):
            sel = labels == lab
            cols[f"idle_{lab}_us"][m] += overlap(lo[idle][sel], hi[idle][sel], w0[m], w1[m])
    return pd.DataFrame(cols, index=it.index)


def iterations(trace: Trace) -> pd.DataFrame:
    """The base file's decode steps (server/iteration events), in time order."""
    ev = trace.events
    it = ev[(ev["file"] == trace.base) & (ev["c"] == "server") & (ev["n"] == "iteration")]
    return it.sort_values("t0", kind="stable")


def counts(df: pd.DataFrame, col: str) -> np.ndarray:
    """An optional count field (n_prompt, n_decode) as int64, 0 where it was not written."""
    return pd.to_numeric(column(df, col), errors="coerce").fillna(0).astype("int64").to_numpy()


def step_summary(trace: Trace) -> pd.DataFrame:
    """One row per decode step of the base file: its host phases, device busy time (all local
    devices together, all peers together, and each device on its own as `busy:<device>_us`), the
    time data spent on the wire or in staged copies for the step's group (`transfer_us`), the time
    no device worked (`idle_both_us`), its longest stretch (`longest_idle_us`) and to which host
    phase that time belongs, then the step's own path through the split (`step_chain`'s columns).
    Times in µs."""
    ev = trace.events
    mine = ev[ev["file"] == trace.base]
    it = iterations(trace)
    w0, w1 = it["t0"].to_numpy(np.int64), it["t1"].to_numpy(np.int64)
    out = pd.DataFrame({"grp": it["grp"].array, "t0": w0, "step_us": w1 - w0,
                        "n_prompt": counts(it, "n_prompt"), "n_decode": counts(it, "n_decode")}, index=it.index)
    for name in STEP_PHASES:
        out[f"{name}_us"] = _by_group(mine[(mine["c"] == "server") & (mine["n"] == name)], it)
    dev = ev[ev["c"] == "dev"]
    local = (dev["file"] == trace.base).to_numpy(bool)
    busy = union(dev["t0"], dev["t1"])
    out["local_busy_us"] = overlap(*union(dev["t0"][local], dev["t1"][local]), w0, w1)
    out["peer_busy_us"] = overlap(*union(dev["t0"][~local], dev["t1"][~local]), w0, w1)
    for d in devices(trace):
        out[f"busy:{d.label}_us"] = overlap(*d.busy, w0, w1)
    wire = _wire_spans(trace)
    wire = wire.assign(grp=_inherit_group(wire, mine))
    out["transfer_us"] = _covered_by_group(wire, it)
    out["idle_both_us"] = (w1 - w0) - overlap(*busy, w0, w1)
    out["longest_idle_us"] = _longest_inside(_gaps(busy, int(w0.min()) if len(w0) else 0,
                                                   int(w1.max()) if len(w1) else 0), w0, w1)
    logits = _names(column(mine, "subj"), LOGITS_TENSOR)
    reads = mine[(mine["c"] == "rpc.client") & mine["n"].isin(LOGITS_READS) & logits]
    out["logits_read_us"] = _by_group(reads, it)
    attributed = _attribute_idle(mine, it, busy)
    out = pd.concat([out, attributed], axis=1)
    out["idle_unattributed_us"] = out["idle_both_us"] - attributed.sum(axis=1).astype("int64")
    return pd.concat([out, step_chain(trace)], axis=1).reset_index(drop=True)


def _covered_by_group(spans: pd.DataFrame, it: pd.DataFrame) -> np.ndarray:
    """Per iteration: the time its window is covered by at least one span of its group (spans of
    one group overlap, e.g. a send to one peer during a receive from another: counted once)."""
    out = np.zeros(len(it), np.int64)
    for g in it["grp"].unique():
        m = _same_group(it["grp"], g)
        mine = spans[_same_group(spans["grp"], g)]
        out[m] = overlap(*union(mine["t0"], mine["t1"]), it["t0"].to_numpy()[m], it["t1"].to_numpy()[m])
    return out


def _gaps(busy: Intervals, w0: int, w1: int) -> Intervals:
    """The parts of [w0, w1) outside `busy`."""
    win = (np.array([w0], np.int64), np.array([w1], np.int64))
    return combine([win, busy], lambda w, b: w & ~b)


def _longest_inside(gaps: Intervals, w0: np.ndarray, w1: np.ndarray) -> np.ndarray:
    """Per window, the longest piece of `gaps` inside it (gaps clipped to the window)."""
    s, e = gaps
    out = np.zeros(len(w0), np.int64)
    lo, hi = np.searchsorted(e, w0, "right"), np.searchsorted(s, w1, "left")
    for k in range(len(w0)):
        if hi[k] > lo[k]:
            out[k] = int((np.minimum(e[lo[k]:hi[k]], w1[k]) - np.maximum(s[lo[k]:hi[k]], w0[k])).max())
    return out


GRAPH_COMMANDS = ("GRAPH_COMPUTE", "GRAPH_RECOMPUTE")
CHAIN_COLUMNS = ("local_compute_us", "to_peer_us", "peer_queue_us", "peer_exec_us", "peer_reply_us")


def _peer_endpoints(trace: Trace) -> dict[str, str]:
    """A peer's uid (lower case) -> the endpoint the base file's client dialled, from its clocks."""
    ev = trace.events
    clocks = ev[(ev["file"] == trace.base) & (ev["c"] == "clock")]
    return {str(u).lower(): str(e) for u, e in zip(column(clocks, "peer_uid"), column(clocks, "endpoint"))
            if _present(u) and _present(e)}


def _peer_files(trace: Trace) -> dict[str, int]:
    """Client endpoint -> the rpc-server file it reached."""
    endpoints = _peer_endpoints(trace)
    return {endpoints[uid]: i for i, h in enumerate(trace.headers)
            if h.get("role") == "rpc-server" and (uid := str(h.get("uid", "")).lower()) in endpoints}


def _served(trace: Trace, file: int, name: str) -> pd.DataFrame:
    """A peer file's rpc.server events of one command with all their phase times, in order of
    arrival."""
    ev = trace.events
    need = ["t_recv1", "t_exec0", "t_exec1", "t_send0"]
    srv = ev[(ev["file"] == file) & (ev["c"] == "rpc.server") & (ev["n"] == name)]
    if srv.empty or any(c not in srv for c in need):
        return pd.DataFrame({c: pd.Series(dtype="int64") for c in ["n", *need]})
    srv = srv[srv["t_recv1"].notna() & srv["t_exec0"].notna() & srv["t_exec1"].notna()]
    return srv[["n", *need]].sort_values("t_recv1", kind="stable")


def _match_served(sent: pd.DataFrame, served: pd.DataFrame, ends: np.ndarray) -> np.ndarray:
    """For each command `sent` (client side, same command name), the position in `served` of the
    peer's event for it, or -1: the first arrival at or after the command's send began, and before
    `ends` (the end of the step that sent it). A connection delivers commands in the order they
    were sent, so that is the command itself as long as the clocks agree to better than the time
    between two sends of the same command."""
    arrivals = served["t_recv1"].to_numpy(np.int64)
    k = np.searchsorted(arrivals, sent["t_send0"].to_numpy(np.int64), "left")
    ok = k < len(arrivals)
    ok[ok] &= arrivals[k[ok]] <= ends[ok]
    return np.where(ok, k, -1)


def step_chain(trace: Trace) -> pd.DataFrame:
    """Per decode step (rows as `iterations`), the step's own path through the devices, in µs:

    - `local_compute_us`: this process's device spans on the step's own thread (another group's
      compute on the same device is not counted, unlike `local_busy_us`);
    - `to_peer_us`: from the step's start until its first graph for a peer had been sent (batch
      building, the inputs' writes: host work before any peer can start);
    - per graph sent to a peer (summed over peers): `peer_queue_us` from its arrival until the
      peer began it (commands of other groups and connections ahead of it), `peer_exec_us` its
      execution there;
    - `peer_reply_us`, per read of the step from a peer: from the end of its execution until the
      peer began sending the reply (the hand-over from the executor to the peer's network loop).

    Peer columns need the rpc-server's trace and its clock binding; without them, and for steps
    that sent nothing to a peer, they are NaN (`to_peer_us` too when no graph went to a peer)."""
    ev = trace.events
    mine = ev[ev["file"] == trace.base]
    it = iterations(trace)
    w0, w1 = it["t0"].to_numpy(np.int64), it["t1"].to_numpy(np.int64)
    tids = it["tid"].astype(str).to_numpy()
    out = pd.DataFrame(index=it.index)
    dev = mine[mine["c"] == "dev"]
    dev_tids = dev["tid"].astype(str).to_numpy()
    local = np.zeros(len(it), np.int64)
    for tid in np.unique(tids):
        m = tids == tid
        d = dev[dev_tids == tid]
        local[m] = overlap(*union(d["t0"], d["t1"]), w0[m], w1[m])
    out["local_compute_us"] = local
    nan = np.full(len(it), np.nan)
    to_peer, queue, execu, reply = nan.copy(), nan.copy(), nan.copy(), nan.copy()
    rpc = mine[(mine["c"] == "rpc.client") & mine["t_send0"].notna()] if "t_send0" in mine else mine.iloc[:0]
    step_of = _enclosing(rpc, it)  # commands go out on the thread that runs the step
    names = rpc["n"].to_numpy()
    graphs = np.isin(names, GRAPH_COMMANDS) & (step_of >= 0)
    if graphs.any():
        first = pd.Series(rpc["t_send1"].to_numpy(np.int64)[graphs]).groupby(step_of[graphs]).min()
        to_peer[first.index.to_numpy()] = first.to_numpy() - w0[first.index.to_numpy()]
    endpoints = column(rpc, "endpoint").astype("string").fillna("").to_numpy()
    replied = column(rpc, "t_recv1").notna().to_numpy(bool)
    for endpoint, file in _peer_files(trace).items():
        for name in (*GRAPH_COMMANDS, *LOGITS_READS):  # every read, not only the logits'
            is_read = name in LOGITS_READS
            pick = (names == name) & (endpoints == endpoint) & (step_of >= 0) & (replied | (not is_read))
            served = _served(trace, file, name) if pick.any() else None
            if served is None or served.empty:
                continue
            k = _match_served(rpc[pick], served, w1[step_of[pick]])
            steps, at = step_of[pick][k >= 0], served.iloc[k[k >= 0]]
            if is_read:
                _accumulate(reply, steps, _between(at, "t_exec1", "t_send0"))
            else:
                _accumulate(queue, steps, _between(at, "t_recv1", "t_exec0"))
                _accumulate(execu, steps, _between(at, "t_exec0", "t_exec1"))
    out["to_peer_us"], out["peer_queue_us"], out["peer_exec_us"], out["peer_reply_us"] = to_peer, queue, execu, reply
    return out


def _between(ev: pd.DataFrame, a: str, b: str) -> np.ndarray:
    """Per event, the time from its field a to its field b (NaN where either is missing)."""
    return ev[b].to_numpy(float) - ev[a].to_numpy(float)


def _accumulate(acc: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """acc[rows] += values, a NaN row starting from 0; repeated rows add up."""
    ok = ~np.isnan(values)
    rows, values = rows[ok], values[ok]
    acc[rows] = np.nan_to_num(acc[rows])
    np.add.at(acc, rows, values)


# --- per device -----------------------------------------------------------------------------
@dataclass
class Device:
    """One device that computed: `label` is its local name (`CPU`, `CUDA0`) for the base file's
    own devices, `<RPCi>/<name>` for a peer's (`RPC1/CUDA0`), with the RPC name the server gave the
    peer's connection; `endpoint` is that connection as the client dialled it (None locally)."""
    label: str
    file: int
    name: str
    endpoint: Optional[str]
    busy: Intervals


def _rpc_names(trace: Trace) -> dict[str, str]:
    """Client endpoint -> the RPC device name (RPC0, RPC1, ...) the scheduler ran it as: the
    scheduler's split span names its backend, and the graph it sends inside names the endpoint."""
    ev = trace.events
    mine = ev[ev["file"] == trace.base]
    splits = mine[(mine["c"] == "sched") & (mine["n"] == "split")]
    sends = mine[(mine["c"] == "rpc.client") & mine["n"].isin(["GRAPH_COMPUTE", "GRAPH_RECOMPUTE"])]
    names: dict[str, str] = {}
    if splits.empty or sends.empty or "endpoint" not in sends or "backend" not in splits:
        return names
    for endpoint, first in sends.sort_values("t0").groupby("endpoint", sort=False):
        g = first.iloc[0]
        inside = splits[(splits["tid"] == g["tid"]) & (splits["t0"] <= g["t0"]) & (splits["t1"] >= g["t1"])]
        if len(inside):
            names[str(endpoint)] = str(inside["backend"].iloc[-1])
    return names


def devices(trace: Trace) -> list[Device]:
    """Every device with `dev` spans: the base file's own first, then the peers, by RPC name.
    A peer whose RPC name cannot be found (no clock event, no graph sent) is labelled by the
    first 8 digits of its uid."""
    ev = trace.events
    dev = ev[ev["c"] == "dev"]
    uid_endpoint = _peer_endpoints(trace)
    rpc = _rpc_names(trace)
    out = []
    for (file, name), spans in dev.groupby(["file", "n"], sort=True):
        h = trace.headers[int(file)]
        short = str(name).removeprefix("compute ")
        if file == trace.base:
            label, endpoint = short, None
        else:
            endpoint = uid_endpoint.get(h["uid"].lower())
            label = f"{rpc.get(endpoint or '', h['uid'][:8])}/{short}"
        out.append(Device(label, int(file), str(name), endpoint, union(spans["t0"], spans["t1"])))
    return sorted(out, key=lambda d: (d.endpoint is not None, d.label))


def analysis_window(trace: Trace) -> Optional[tuple[int, int]]:
    """First iteration start to last iteration end; without iterations the span of all dev
    events; None when there is neither."""
    it = iterations(trace)
    if len(it):
        return int(it["t0"].min()), int(it["t1"].max())
    dev = trace.events[trace.events["c"] == "dev"]
    if len(dev):
        return int(dev["t0"].min()), int(dev["t1"].max())
    return None


def _wire_spans(trace: Trace, endpoint: Optional[str] = None) -> pd.DataFrame:
    """Time data moved, as spans of the base file: each RPC command's send and receive phases
    (to `endpoint` only, when given; the wait for the reply is not transfer), and, for all
    endpoints, the scheduler's staged copy writes (copy_send) and event-gated copies (copy_event)."""
    ev = trace.events
    mine = ev[ev["file"] == trace.base]
    rpc = mine[mine["c"] == "rpc.client"]
    if endpoint is not None:
        rpc = rpc[column(rpc, "endpoint").astype("string").eq(endpoint).fillna(False).to_numpy(bool)]
    parts = []
    for a, b in (("t_send0", "t_send1"), ("t_recv0", "t_recv1")):
        if a in rpc and b in rpc:
            ok = rpc[a].notna() & rpc[b].notna()
            parts.append(pd.DataFrame({"t0": rpc[a][ok].astype("int64"), "t1": rpc[b][ok].astype("int64"),
                                       "tid": rpc["tid"][ok], "grp": rpc["grp"][ok]}))
    if endpoint is None:
        cp = mine[(mine["c"] == "sched") & mine["n"].isin(["copy_send", "copy_event"])]
        parts.append(cp[["t0", "t1", "tid", "grp"]])
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame({"t0": pd.Series(dtype="int64"), "t1": pd.Series(dtype="int64"),
                             "tid": pd.Series(dtype="object"), "grp": pd.Series(dtype="Int64")})
    return pd.concat(parts, ignore_index=True)


def host_owner(trace: Trace, gaps: Intervals, by_group: bool = False) -> pd.Series:
    """The time of `gaps` charged to host phases: each instant to the innermost base-file host span
    covering it (any group; labelled `g<grp> c:n` with by_group), the rest to `unattributed`.
    Returns µs per label, largest first."""
    mine = trace.events[trace.events["file"] == trace.base]
    host = _host_spans(mine)
    total = length(gaps)
    if host.empty or total == 0:
        return pd.Series({"unattributed": total} if total else {}, dtype="int64")
    labels = host["label"].to_numpy()
    if by_group:
        grp = host["grp"].astype("string").fillna("-").to_numpy()
        labels = np.array([f"g{g} {lab}" for g, lab in zip(grp, labels)], dtype=object)
    s, e, owner = innermost(host["t0"], host["t1"])
    edges = np.unique(np.r_[s, e, gaps[0], gaps[1]])
    lo, hi = edges[:-1], edges[1:]
    piece, inside = locate((s, e), lo), locate(gaps, lo) >= 0
    got = pd.Series((hi - lo)[inside & (piece >= 0)], dtype="int64").groupby(
        labels[owner[piece[inside & (piece >= 0)]]]).sum()
    rest = total - int(got.sum())
    if rest:
        got["unattributed"] = rest
    return got.sort_values(ascending=False).astype("int64")


def device_summary(trace: Trace, window: Optional[tuple[int, int]] = None) -> pd.DataFrame:
    """One row per device over the window (default: `analysis_window`): busy, idle while another
    device was busy, idle while none was, idle share, transfer (its peer's RPC send and receive
    phases; for a local device the staged copies written to it), all in µs. For every device
    busy_us + idle_other_us + idle_neither_us == window_us."""
    cols = ["device", "endpoint", "window_us", "busy_us", "idle_other_us", "idle_neither_us", "idle_pct",
            "transfer_us"]
    window = window or analysis_window(trace)
    devs = devices(trace)
    if window is None or not devs:
        return pd.DataFrame(columns=cols)
    win = (np.array([window[0]], np.int64), np.array([window[1]], np.int64))
    span = window[1] - window[0]
    anyone = union(np.concatenate([d.busy[0] for d in devs]), np.concatenate([d.busy[1] for d in devs]))
    rows = []
    mine = trace.events[trace.events["file"] == trace.base]
    for d in devs:
        others = [o for o in devs if o is not d]
        other = union(np.concatenate([o.busy[0] for o in others] + [np.empty(0, np.int64)]),
                      np.concatenate([o.busy[1] for o in others] + [np.empty(0, np.int64)]))
        busy = length(combine([win, d.busy], lambda w, b: w & b))
        idle_other = length(combine([win, d.busy, other], lambda w, b, o: w & ~b & o))
        idle_neither = length(combine([win, anyone], lambda w, a: w & ~a))
        if d.endpoint is not None:
            wire = _wire_spans(trace, d.endpoint)
        else:
            cp = mine[(mine["c"] == "sched") & (mine["n"] == "copy_send")]
            wire = cp[column(cp, "backend").astype("string").eq(d.name.removeprefix("compute ")).fillna(False)
                      .to_numpy(bool)]
        transfer = length(combine([win, union(wire["t0"], wire["t1"])], lambda w, x: w & x))
        rows.append({"device": d.label, "endpoint": d.endpoint, "window_us": span, "busy_us": busy,
                     "idle_other_us": idle_other, "idle_neither_us": idle_neither,
                     "idle_pct": 100.0 * (span - busy) / span if span else float("nan"), "transfer_us": transfer})
    return pd.DataFrame(rows, columns=cols)


def neither_busy(trace: Trace, window: Optional[tuple[int, int]] = None) -> Intervals:
    """The stretches of the window in which no device (of any file) was busy."""
    window = window or analysis_window(trace)
    if window is None:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    dev = trace.events[trace.events["c"] == "dev"]
    return _gaps(union(dev["t0"], dev["t1"]), *window)


def _ms(us: float) -> str:
    return f"{us / 1e3:.1f}"


def format_summary(trace: Trace, steps: Optional[pd.DataFrame] = None, width: int = 80) -> str:
    """The compact report: one line per device (busy, idle split and share, transfer), the time no
    device worked with its longest stretch and the host phases that hold it, then per group the
    median step and host phases. Every line fits `width` columns."""
    steps = step_summary(trace) if steps is None else steps
    window = analysis_window(trace)
    if window is None:
        return "no steps and no device spans: nothing to summarise"
    span = window[1] - window[0]
    devs = device_summary(trace, window)
    n_groups = steps["grp"].nunique(dropna=False) if len(steps) else 0
    lines = [f"window {_ms(span)} ms: {len(steps)} steps, {n_groups} group(s), {len(devs)} device(s); "
             "times in ms"]
    if len(devs):
        lines.append(f"{'device':<16}{'busy':>9}{'idle':>9}{'other busy':>11}{'none busy':>10}{'idle%':>7}"
                     f"{'transfer':>10}")
        for r in devs.itertuples():
            lines.append(f"{r.device[:16]:<16}{_ms(r.busy_us):>9}{_ms(r.window_us - r.busy_us):>9}"
                         f"{_ms(r.idle_other_us):>11}{_ms(r.idle_neither_us):>10}{r.idle_pct:>6.1f}%"
                         f"{_ms(r.transfer_us):>10}")
        peers = devs[devs["endpoint"].notna()]
        for r in peers.itertuples():
            lines.append(f"  {r.device.split('/')[0]} = {r.endpoint}"[:width])
    gaps = neither_busy(trace, window)
    total = length(gaps)
    if total:
        k = int(np.argmax(gaps[1] - gaps[0]))
        longest = (gaps[0][k:k + 1], gaps[1][k:k + 1])
        owner = host_owner(trace, longest, by_group=True)
        lines.append(f"no device busy {_ms(total)} ms ({100 * total / span:.1f}%); longest stretch "
                     f"{_ms(length(longest))} ms at +{_ms(gaps[0][k] - window[0])} ms")
        lines.append(f"  longest is in: {_shares(owner, length(longest), width - 17)}")
        lines.append(f"  by host phase: {_shares(host_owner(trace, gaps), total, width - 17)}")
    if len(steps):
        lines.append("median per step, per group (ms)")
        lines += _median_table(steps, ["step_us"] + [f"{p}_us" for p in STEP_PHASES] + ["transfer_us"],
                               ["step", "build", "submit", "sync", "post", "sample", "send", "xfer"])
        sent = steps[steps["peer_exec_us"].notna()] if "peer_exec_us" in steps else steps.iloc[:0]
        if len(sent):
            lines.append("median path through the split, per group (ms; steps with a peer stage)")
            lines += _median_table(sent, ["step_us", *CHAIN_COLUMNS],
                                   ["step", "local", "to peer", "queue", "peer", "reply"])
    return "\n".join(line[:width] for line in lines)


def _median_table(steps: pd.DataFrame, cols: list[str], heads: list[str]) -> list[str]:
    """A header line, then per group its step count and the medians of `cols` in ms."""
    lines = [f"{'grp':>4}{'steps':>6}" + "".join(f"{h:>8}" for h in heads)]
    for g, part in steps.groupby(steps["grp"].astype("string").fillna("-"), sort=True):
        med = part[cols].median()
        lines.append(f"{g:>4}{len(part):>6}" + "".join(f"{med[c] / 1e3:>8.2f}" for c in cols))
    return lines


def _shares(owner: pd.Series, total: int, width: int) -> str:
    """`label pct%, ...` of the largest shares, as many as fit."""
    out = ""
    for lab, us in owner.items():
        part = f"{lab} {100 * us / total:.0f}%" if total else str(lab)
        if out and len(out) + 2 + len(part) > width:
            break
        out = f"{out}, {part}" if out else part
    return out or "-"


def format_steps(steps: pd.DataFrame) -> str:
    """The per-step table (wide: one column per host phase, device and idle owner) and, per
    column, its median and mean over the steps."""
    if steps.empty:
        return "no steps: the base trace has no server/iteration events"
    with pd.option_context("display.width", 250, "display.max_columns", None, "display.max_rows", None):
        table = steps.to_string(index=False)
        totals = steps.drop(columns=["grp", "t0"]).astype(float).agg(["median", "mean"]).T.round(1)
        return f"{table}\n\ntotals over {len(steps)} steps\n{totals.to_string()}"


def write_steps(steps: pd.DataFrame, path: str | Path) -> None:
    """The per-step table as CSV, or as Parquet when the name ends in .parquet (needs pyarrow)."""
    if str(path).endswith(".parquet"):
        try:
            steps.to_parquet(path, index=False)
        except ImportError:  # pandas' own message is several lines about two engines
            raise TraceError(f"{path}: writing Parquet needs pyarrow (pip install pyarrow)") from None
    else:
        steps.to_csv(path, index=False)


# --- Chrome trace ---------------------------------------------------------------------------
def _row_names(ev: pd.DataFrame) -> pd.Series:
    """The timeline row of each event: its thread, split per pipeline group, and one row per
    device for what the devices executed."""
    row = ev["tid"] + (" g" + ev["grp"].astype("string")).fillna("")
    return row.where(ev["c"] != "dev", ev["n"])


def _present(v: Any) -> bool:
    return v is not None and v is not pd.NA and not (isinstance(v, float) and math.isnan(v))


def _json_default(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else str(v)


def _phase_slices(ev: pd.DataFrame, pid: np.ndarray, tid: np.ndarray) -> list[dict]:
    """Child slices of each RPC command, clipped to the command so that they always nest."""
    out = []
    t0, t1 = ev["t0"].to_numpy(float), ev["t1"].to_numpy(float)
    for c, parts in RPC_PHASES.items():
        for name, a, b in parts:
            if a not in ev or b not in ev:
                continue
            lo = np.maximum(ev[a].to_numpy(float, na_value=np.nan), t0)
            hi = np.minimum(ev[b].to_numpy(float, na_value=np.nan), t1)
            for k in np.flatnonzero((ev["c"] == c).to_numpy(bool) & (hi >= lo)):
                out.append({"ph": "X", "name": name, "cat": f"{c}.phase", "pid": int(pid[k]), "tid": int(tid[k]),
                            "ts": int(lo[k]), "dur": int(hi[k] - lo[k]), "args": {"cmd": ev["n"].iat[k]}})
    return out


def chrome_trace(trace: Trace) -> dict:
    """The merged trace in the Chrome trace event format: one process per file, one X event per
    span (ts and dur in µs on the common time line), RPC phases as slices inside their command."""
    ev = trace.events
    pid = ev["file"].to_numpy() + 1
    rows = _row_names(ev)
    tid_index, keys = pd.factorize(ev["file"].astype(str) + "|" + rows)
    tid = tid_index + 1
    out: list[dict] = []
    for i, h in enumerate(trace.headers):
        out.append({"ph": "M", "name": "process_name", "pid": i + 1,
                    "args": {"name": f"{h['role']} {h['host']} {h['uid'][:8]}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": i + 1, "args": {"sort_index": i}})
    for k, key in enumerate(keys):
        file, name = key.split("|", 1)
        out.append({"ph": "M", "name": "thread_name", "pid": int(file) + 1, "tid": k + 1, "args": {"name": name}})
    skip = {"file", "uid", "role", "host", "c", "n", "t0", "t1", "tid"}
    for k, rec in enumerate(ev.to_dict("records")):
        args = {key: v for key, v in rec.items() if key not in skip and _present(v)}
        out.append({"ph": "X", "name": rec["n"], "cat": rec["c"], "pid": int(pid[k]), "tid": int(tid[k]),
                    "ts": int(rec["t0"]), "dur": int(rec["t1"] - rec["t0"]), "args": args})
    out.extend(_phase_slices(ev, pid, tid))
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome(trace: Trace, path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(trace), f, default=_json_default)


# --- command line ---------------------------------------------------------------------------
def load_for_cli(paths: Sequence[str], prog: str) -> Optional[Trace]:
    """load() for a command line: warnings go to stderr as lines, a bad file is one line and None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trace = load(paths)
    except (TraceError, OSError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    for note in trace.warnings:
        print(f"{prog}: warning: {note}", file=sys.stderr)
    return trace


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Merge pyllama trace files onto one time line.")
    ap.add_argument("traces", nargs="+", help="trace files (JSON lines), the server's first")
    ap.add_argument("--chrome", metavar="OUT.json", help="write a Chrome trace (Perfetto, chrome://tracing)")
    ap.add_argument("--summary", action="store_true",
                    help="print per device busy / idle / transfer, the time no device worked, and per group "
                         "the median step and, over a split, its path through the peers (fits 80 columns)")
    ap.add_argument("--steps", action="store_true", help="print the wide per-step table and its medians/means")
    ap.add_argument("--out", metavar="OUT.csv|OUT.parquet", help="write the per-step table (Parquet needs pyarrow)")
    ap.add_argument("--csv", metavar="OUT.csv", help=argparse.SUPPRESS)  # the older spelling of --out
    args = ap.parse_args(argv)
    trace = load_for_cli(args.traces, "merge")
    if trace is None:
        return 1
    steps = step_summary(trace)
    if args.chrome:
        write_chrome(trace, args.chrome)
    for out in (args.out, args.csv):
        if out:
            try:
                write_steps(steps, out)
            except (TraceError, OSError) as exc:
                print(f"merge: {exc}", file=sys.stderr)
                return 1
    if args.summary:
        print(format_summary(trace, steps))
    if args.steps:
        print(format_steps(steps))
    print(f"merged {len(trace.headers)} files, {len(trace.events)} events, {len(steps)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
