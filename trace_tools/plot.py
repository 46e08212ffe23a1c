"""A picture of a few decode steps of a merged trace: who computes, who waits, where the wire is.

    python trace_tools/plot.py TRACE... --out step.png [--steps A:B]

One lane per decode thread of the server (its host phases, RPC commands and staged copies, nested
spans drawn thinner on top of their parent), per rpc server (the receive / execute / reply phases
of each command it served) and per device (what it computed), on the server's clock. Arrows go
from a decode thread to the peer that received its command, and back for each reply. The title
names the bottleneck of the plotted stretch: the busiest device, or, when no device was busy for
longer than any device worked, the host phase that held most of that time.

`--steps A:B` picks iterations A to B-1 of the base file in time order (all groups, counted from
0; negative counts from the end); the default is four decode iterations from the middle of the
run. Needs matplotlib (`pip install -e '.[notebook]'`).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd

if __package__ in (None, ""):  # run as a script: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trace_tools import merge  # noqa: E402

HOST_KINDS = ("server", "sched", "rpc.client")  # c of the spans drawn in a decode thread's lane
SKIP = {("server", "iteration"), ("sched", "copy_stage")}  # an iteration is the step marks; copy_stage = read + send
COLOURS = {
    "batch_build": "#8dd3c7", "submit": "#bebada", "synchronize": "#fb8072", "post_decode": "#80b1d3",
    "sampling": "#fdb462", "result_send": "#b3de69", "split": "#d9d9d9", "copy_read": "#fccde5",
    "copy_send": "#bc80bd", "copy_alloc": "#ffed6f", "copy_event": "#e7298a", "rpc command": "#cccccc",
    "peer recv": "#a6cee3", "peer exec": "#1f78b4", "peer reply": "#ff7f00", "compute": "#33a02c",
}
DEFAULT_STEPS = 4


@dataclass
class Lane:
    """One row of the picture: `spans` are (t0, t1, colour key, depth) in µs of the base clock."""
    name: str
    kind: str  # "thread", "node" or "device"
    spans: list[tuple[int, int, str, int]] = field(default_factory=list)


@dataclass
class Picture:
    """What was drawn: the lanes top to bottom, the arrows (t_from, lane_from, t_to, lane_to,
    kind "send" or "reply"), the plotted range and the title."""
    lanes: list[Lane]
    arrows: list[tuple[int, str, int, str, str]]
    t0: int
    t1: int
    title: str
    figure: Any = None


def pick_steps(trace: merge.Trace, steps: Optional[str]) -> tuple[int, int, pd.DataFrame]:
    """The time range of the chosen iterations (see the module docstring) and those iterations."""
    it = merge.iterations(trace).reset_index(drop=True)
    if it.empty:
        raise merge.TraceError("no steps: the base trace has no server/iteration events")
    if steps:
        try:
            a_text, _, b_text = steps.partition(":")
            a = int(a_text) if a_text else 0
            b = int(b_text) if b_text else len(it)
        except ValueError:
            raise merge.TraceError(f"--steps {steps!r}: expected A:B, two iteration numbers") from None
        chosen = it.iloc[a:b]
    else:
        decode = it[merge.counts(it, "n_decode") > 0]
        pool = decode if len(decode) else it
        mid = max(0, len(pool) // 2 - DEFAULT_STEPS // 2)
        chosen = pool.iloc[mid:mid + DEFAULT_STEPS]
    if chosen.empty:
        raise merge.TraceError(f"--steps {steps!r}: no iteration in that range (the trace has {len(it)})")
    return int(chosen["t0"].min()), int(chosen["t1"].max()), chosen


def _depths(t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
    """Nesting depth of each span among the others (a span inside another is one deeper), so
    nested spans can be drawn on top of their parent."""
    order = np.lexsort((-(t1 - t0), t0))
    depth = np.zeros(len(t0), np.int64)
    stack: list[int] = []  # end times of the open spans
    for k in order:
        while stack and stack[-1] <= t0[k]:
            stack.pop()
        depth[k] = len(stack)
        stack.append(t1[k])
    return depth


def _colour_key(c: str, n: str) -> str:
    if c == "rpc.client":
        return "rpc command"
    if c == "dev":
        return "compute"
    return n


def lanes(trace: merge.Trace, t0: int, t1: int) -> list[Lane]:
    """The lanes of the range [t0, t1): decode threads, then per peer its node and its devices
    (local devices after the threads)."""
    ev = trace.events
    inside = ev[(ev["t1"] > t0) & (ev["t0"] < t1)]
    mine = inside[inside["file"] == trace.base]
    out: list[Lane] = []
    host = mine[mine["c"].isin(HOST_KINDS) & ~pd.Series(list(zip(mine["c"], mine["n"])), index=mine.index).isin(SKIP)]
    threads = sorted(mine.loc[(mine["c"] == "server") & (mine["n"] == "iteration"), "tid"].unique())
    for tid in threads:
        spans = host[host["tid"] == tid]
        a, b = spans["t0"].to_numpy(np.int64), spans["t1"].to_numpy(np.int64)
        depth = _depths(a, b)
        lane = Lane(f"server {tid}", "thread")
        lane.spans = [(int(x), int(y), _colour_key(c, n), int(d))
                      for x, y, c, n, d in zip(a, b, spans["c"], spans["n"], depth)]
        out.append(lane)
    devs = merge.devices(trace)
    for d in devs:
        if d.endpoint is None:
            out.append(_device_lane(inside, d))
    seen_files: set[int] = set()
    for d in devs:
        if d.endpoint is None:
            continue
        if d.file not in seen_files:
            seen_files.add(d.file)
            node = Lane(f"{d.label.split('/')[0]} node", "node")
            srv = inside[(inside["file"] == d.file) & (inside["c"] == "rpc.server")]
            for phase, a_col, b_col in merge.RPC_PHASES["rpc.server"]:
                if a_col not in srv or b_col not in srv:
                    continue
                ok = srv[a_col].notna() & srv[b_col].notna()
                for x, y in zip(srv.loc[ok, a_col], srv.loc[ok, b_col]):
                    if y > x:
                        node.spans.append((int(x), int(y), f"peer {'reply' if phase == 'send' else phase}", 0))
            out.append(node)
        out.append(_device_lane(inside, d))
    return out


def _device_lane(inside: pd.DataFrame, d: merge.Device) -> Lane:
    spans = inside[(inside["file"] == d.file) & (inside["c"] == "dev") & (inside["n"] == d.name)]
    lane = Lane(d.label, "device")
    lane.spans = [(int(x), int(y), "compute", 0) for x, y in zip(spans["t0"], spans["t1"])]
    return lane


def arrows(trace: merge.Trace, t0: int, t1: int) -> list[tuple[int, str, int, str, str]]:
    """Each RPC command of a decode thread in the range, matched to the command its peer served
    (same name, the first one received after the client started sending, per connection): an
    arrow from the end of the send to the end of the receive, and one from the start of the reply
    to its arrival."""
    ev = trace.events
    devs = {d.endpoint: d for d in merge.devices(trace) if d.endpoint is not None}
    cli = ev[(ev["file"] == trace.base) & (ev["c"] == "rpc.client") & (ev["t0"] < t1) & (ev["t1"] > t0)]
    out = []
    for endpoint, d in devs.items():
        mine = cli[merge.column(cli, "endpoint").astype("string").eq(endpoint).fillna(False).to_numpy(bool)]
        srv = ev[(ev["file"] == d.file) & (ev["c"] == "rpc.server")]
        if mine.empty or srv.empty:
            continue
        node = f"{d.label.split('/')[0]} node"
        left = mine[["n", "tid", "t_send0", "t_send1", "t_recv0", "t_recv1"]].dropna(subset=["t_send0"])
        left = left.astype({"t_send0": "int64"}).sort_values("t_send0")
        right = srv[["n", "t_recv0", "t_recv1", "t_send0", "t_send1"]].dropna(subset=["t_recv0"])
        right = right.rename(columns={c: f"s_{c}" for c in ("t_recv0", "t_recv1", "t_send0", "t_send1")})
        right = right.astype({"s_t_recv0": "int64"}).sort_values("s_t_recv0")
        # a peer's clock is known to within its offset's error (a few µs locally): allow 1 ms
        hit = pd.merge_asof(left, right, left_on="t_send0", right_on="s_t_recv0", by="n", direction="forward",
                            tolerance=1000)
        for r in hit.itertuples():
            if pd.isna(r.s_t_recv1):
                continue
            lane = f"server {r.tid}"
            out.append((int(r.t_send1), lane, int(r.s_t_recv1), node, "send"))
            if not pd.isna(r.t_recv1) and not pd.isna(r.s_t_send0):
                out.append((int(r.s_t_send0), node, int(r.t_recv1), lane, "reply"))
    return [a for a in out if t0 <= min(a[0], a[2]) and max(a[0], a[2]) <= t1]  # both ends in view


def bottleneck(trace: merge.Trace, t0: int, t1: int) -> str:
    """The busiest device of the range, or the host phase holding most of the time no device
    worked when that time exceeds every device's busy time."""
    win = (np.array([t0], np.int64), np.array([t1], np.int64))
    busy = {d.label: merge.length(merge.combine([win, d.busy], lambda w, b: w & b)) for d in merge.devices(trace)}
    gaps = merge.neither_busy(trace, (t0, t1))
    idle = merge.length(gaps)
    span = t1 - t0
    if not busy or idle > max(busy.values()):
        owner = merge.host_owner(trace, gaps)
        top = owner.index[0] if len(owner) else "unattributed"
        return f"host ({100 * idle / span:.0f}% with no device busy, most in {top})"
    name = max(busy, key=busy.__getitem__)
    return f"device {name} ({100 * busy[name] / span:.0f}% busy)"


def draw(trace: merge.Trace, steps: Optional[str] = None, out: Optional[str] = None) -> Picture:
    """Builds the picture of the chosen steps; saves it to `out` (PNG, SVG, PDF by extension)."""
    import matplotlib  # noqa: PLC0415
    if out is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    t0, t1, chosen = pick_steps(trace, steps)
    rows = lanes(trace, t0, t1)
    links = arrows(trace, t0, t1)
    ms = lambda t: (np.asarray(t, float) - t0) / 1e3  # noqa: E731
    title = (f"{len(chosen)} step(s), {(t1 - t0) / 1e3:.1f} ms; bottleneck: {bottleneck(trace, t0, t1)}")
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.55 * len(rows)))
    y_of = {}
    for i, lane in enumerate(rows):
        y = len(rows) - 1 - i
        y_of[lane.name] = y
        for depth in sorted({s[3] for s in lane.spans}):
            part = [s for s in lane.spans if s[3] == depth]
            h = 0.8 * (0.75 ** depth)
            ax.broken_barh([(ms(a), max(ms(b) - ms(a), 1e-3)) for a, b, _, _ in part], (y - h / 2, h),
                           facecolors=[COLOURS.get(k, "#999999") for _, _, k, _ in part], edgecolor="black",
                           linewidth=0.2, gid=f"lane:{lane.name}:{depth}")
    for a, la, b, lb, kind in links:
        ax.annotate("", xy=(ms(b), y_of[lb]), xytext=(ms(a), y_of[la]), gid=f"arrow:{kind}",
                    arrowprops={"arrowstyle": "->", "color": "#1f4e79" if kind == "send" else "#b22222",
                                "lw": 0.6, "alpha": 0.7})
    for x in chosen["t0"]:
        ax.axvline(ms(x), color="grey", lw=0.5, ls=":")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([lane.name for lane in reversed(rows)])
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_xlim(0, ms(t1))
    ax.set_xlabel("ms from the first plotted step's start (dotted: step starts)")
    ax.set_title(title, fontsize=10)
    used = sorted({s[2] for lane in rows for s in lane.spans})
    handles = [Patch(facecolor=COLOURS.get(k, "#999999"), label=k) for k in used]
    handles += [Patch(facecolor="#1f4e79", label="command sent"), Patch(facecolor="#b22222", label="reply")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=110)
    return Picture(rows, links, t0, t1, title, fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Draw a few decode steps of pyllama traces as a timeline.")
    ap.add_argument("traces", nargs="+", help="trace files (JSON lines), the server's first")
    ap.add_argument("--out", required=True, metavar="STEP.png", help="the picture (PNG, SVG or PDF)")
    ap.add_argument("--steps", metavar="A:B", help="iterations A..B-1 in time order (default: 4 decode steps "
                                                   "from the middle)")
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        print("plot: needs matplotlib (pip install -e '.[notebook]')", file=sys.stderr)
        return 1
    trace = merge.load_for_cli(args.traces, "plot")
    if trace is None:
        return 1
    try:
        pic = draw(trace, args.steps, args.out)
    except (merge.TraceError, OSError) as exc:
        print(f"plot: {exc}", file=sys.stderr)
        return 1
    print(f"plot: {args.out}: {len(pic.lanes)} lanes, {sum(len(x.spans) for x in pic.lanes)} spans, "
          f"{len(pic.arrows)} arrows; {pic.title}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
