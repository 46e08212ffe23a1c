"""When each device waited, and whether anything else was working meanwhile.

A device that is idle while another one is busy waits on the pipeline (its turn has not come);
a device idle while no device is busy waits on the host (sampling, batch building, the network).
The two call for different fixes, so they are counted apart, overall and per phase of serving:

* `decode`: covered by an iteration that decoded at least one token (mixed batches included,
  as are batches where a slot contributes several tokens);
* `prefill`: covered only by iterations that processed prompt tokens and decoded none;
* `other`: the rest of the window (no iteration running, or only empty ones).

The window runs from the first iteration's start to the last one's end in the base file (all
dev spans when there are no iterations). A device is one `dev` span name in one file, labelled as
`merge.devices` does (`CPU` for the server's own, `RPC1/CUDA0` for a peer's).

Besides the split, the time no device worked is charged to the host phase that owned it (the
innermost host span covering it), and each pipeline group's iterations are summarised (count,
median and 90th percentile step, how much of the decode phase the group covers).

CLI: ``python trace_tools/device_idle.py TRACE... [--table]``
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd

if __package__ in (None, ""):  # run as a script: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trace_tools import merge  # noqa: E402
from trace_tools.merge import Intervals, combine, length, union  # noqa: E402

PHASES = ("all", "prefill", "decode", "other")
COLUMNS = ["device", "phase", "span_us", "busy_us", "idle_other_us", "idle_neither_us", "busy_pct",
           "idle_other_pct", "idle_neither_pct", "idle_median_us", "idle_stretches"]
GROUP_COLUMNS = ["grp", "iterations", "prefill", "decode", "decode_median_us", "decode_p90_us",
                 "prefill_median_us", "decode_cover_pct"]

analysis_window = merge.analysis_window


def phase_intervals(trace: merge.Trace, window: tuple[int, int]) -> dict[str, Intervals]:
    """The window cut into decode / prefill / other time (see the module docstring), plus `all`."""
    it = merge.iterations(trace)
    n_decode, n_prompt = merge.counts(it, "n_decode"), merge.counts(it, "n_prompt")
    t0, t1 = it["t0"].to_numpy(), it["t1"].to_numpy()
    win = (np.array([window[0]], np.int64), np.array([window[1]], np.int64))
    decoding = union(t0[n_decode > 0], t1[n_decode > 0])
    prompt_only = union(t0[(n_decode == 0) & (n_prompt > 0)], t1[(n_decode == 0) & (n_prompt > 0)])
    empty = union(t0[(n_decode == 0) & (n_prompt == 0)], t1[(n_decode == 0) & (n_prompt == 0)])
    decode = combine([win, decoding], lambda w, d: w & d)
    prefill = combine([win, prompt_only, decoding, empty], lambda w, p, d, e: w & p & ~d & ~e)
    other = combine([win, decode, prefill], lambda w, d, p: w & ~d & ~p)
    return {"all": win, "prefill": prefill, "decode": decode, "other": other}


def _union_all(sets: list[Intervals]) -> Intervals:
    """Time during which at least one of the sets is on."""
    empty = np.empty(0, np.int64)
    return union(np.concatenate([iv[0] for iv in sets] + [empty]), np.concatenate([iv[1] for iv in sets] + [empty]))


def _pct(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else float("nan")


def _row(label: str, phase: str, span: Intervals, mine: Intervals, others: Intervals, anyone: Intervals) -> dict:
    stretches = combine([span, mine], lambda p, m: p & ~m)
    lengths = stretches[1] - stretches[0]
    total = length(span)
    busy = length(combine([span, mine], lambda p, m: p & m))
    idle_other = length(combine([span, mine, others], lambda p, m, o: p & ~m & o))
    idle_neither = length(combine([span, anyone], lambda p, a: p & ~a))
    return {"device": label, "phase": phase, "span_us": total, "busy_us": busy, "idle_other_us": idle_other,
            "idle_neither_us": idle_neither, "busy_pct": _pct(busy, total), "idle_other_pct": _pct(idle_other, total),
            "idle_neither_pct": _pct(idle_neither, total),
            "idle_median_us": float(np.median(lengths)) if len(lengths) else float("nan"),
            "idle_stretches": len(lengths)}


def device_idle(trace: merge.Trace) -> pd.DataFrame:
    """One row per device (labelled as merge.devices does: `CPU`, `RPC1/CUDA0`) and phase (`all`
    included): busy time, idle time while another device was busy, idle time while none was, each
    also as a percentage of the phase's time, and the median idle stretch; times in µs.
    busy + both idle columns = span_us, the phase's length inside the window."""
    window = analysis_window(trace)
    devices = {d.label: d.busy for d in merge.devices(trace)}
    if window is None or not devices:
        return pd.DataFrame(columns=COLUMNS)
    phases = phase_intervals(trace, window)
    anyone = _union_all(list(devices.values()))
    rows = []
    for label, mine in devices.items():
        others = _union_all([iv for other, iv in devices.items() if other != label])
        rows += [_row(label, phase, phases[phase], mine, others, anyone) for phase in PHASES]
    return pd.DataFrame(rows, columns=COLUMNS)


def neither_owners(trace: merge.Trace) -> pd.DataFrame:
    """Per phase, the time no device was busy charged to the host phase that owned it (the
    innermost host span of the base file covering each instant, any group; `unattributed` where
    none does): columns phase, owner, us, pct (of that phase's neither-busy time)."""
    window = analysis_window(trace)
    cols = ["phase", "owner", "us", "pct"]
    if window is None:
        return pd.DataFrame(columns=cols)
    gaps = merge.neither_busy(trace, window)
    rows = []
    for phase, span in phase_intervals(trace, window).items():
        mine = combine([span, gaps], lambda p, g: p & g)
        total = length(mine)
        for owner, us in merge.host_owner(trace, mine).items():
            rows.append({"phase": phase, "owner": owner, "us": int(us), "pct": _pct(int(us), total)})
    return pd.DataFrame(rows, columns=cols)


def group_stats(trace: merge.Trace) -> pd.DataFrame:
    """Per pipeline group: its iterations (prefill: prompt tokens only; decode: any generated
    token), the median and 90th percentile decode step, the median prefill step (µs), and how much
    of the decode phase its decode iterations cover (%: 100 for each group means the groups ran
    side by side the whole time)."""
    it = merge.iterations(trace)
    window = analysis_window(trace)
    if it.empty or window is None:
        return pd.DataFrame(columns=GROUP_COLUMNS)
    decode_phase = length(phase_intervals(trace, window)["decode"])
    n_decode, n_prompt = merge.counts(it, "n_decode"), merge.counts(it, "n_prompt")
    step = (it["t1"] - it["t0"]).to_numpy(np.int64)
    grp = it["grp"].astype("string").fillna("-").to_numpy()
    rows = []
    for g in sorted(set(grp)):
        m = grp == g
        dec, pre = m & (n_decode > 0), m & (n_decode == 0) & (n_prompt > 0)
        cover = length(union(it["t0"].to_numpy()[dec], it["t1"].to_numpy()[dec]))
        rows.append({"grp": int(g) if g.lstrip("-").isdigit() else g, "iterations": int(m.sum()),
                     "prefill": int(pre.sum()), "decode": int(dec.sum()),
                     "decode_median_us": float(np.median(step[dec])) if dec.any() else float("nan"),
                     "decode_p90_us": float(np.percentile(step[dec], 90)) if dec.any() else float("nan"),
                     "prefill_median_us": float(np.median(step[pre])) if pre.any() else float("nan"),
                     "decode_cover_pct": _pct(cover, decode_phase)})
    return pd.DataFrame(rows, columns=GROUP_COLUMNS)


def _ms(us: float) -> str:
    return "-" if us != us else f"{us / 1e3:.1f}"


def format_report(trace: merge.Trace, width: int = 80) -> str:
    """The report the CLI prints: per phase, each device's busy and idle time with its share of
    the phase; where the time no device worked went; per group, its iterations."""
    table = device_idle(trace)
    if table.empty:
        return "no dev events: nothing to report"
    window = analysis_window(trace)
    lines = [f"window {_ms(window[1] - window[0])} ms; times in ms, % of the phase's time; idle while "
             "another device was busy (other busy) or while none was (none busy)"]
    owners = neither_owners(trace)
    for phase in PHASES:
        part = table[table["phase"] == phase]
        span = int(part["span_us"].iat[0])
        if span == 0:
            continue
        lines.append(f"{phase}: {_ms(span)} ms ({100 * span / (window[1] - window[0]):.1f}% of the window)")
        lines.append(f"  {'device':<16}{'busy':>8}{'%':>7}{'other busy':>12}{'%':>7}{'none busy':>11}{'%':>7}"
                     f"{'med idle':>9}")
        for r in part.itertuples():
            lines.append(f"  {r.device[:16]:<16}{_ms(r.busy_us):>8}{r.busy_pct:>6.1f}%{_ms(r.idle_other_us):>12}"
                         f"{r.idle_other_pct:>6.1f}%{_ms(r.idle_neither_us):>11}{r.idle_neither_pct:>6.1f}%"
                         f"{_ms(r.idle_median_us):>9}")
        mine = owners[owners["phase"] == phase]
        if len(mine):
            text = ", ".join(f"{o.owner} {_ms(o.us)} ({o.pct:.0f}%)" for o in mine.head(4).itertuples())
            lines.append(f"  none busy, by host phase: {text}")
    groups = group_stats(trace)
    for r in groups.itertuples():
        lines.append(f"group {r.grp}: {r.iterations} iterations ({r.prefill} prefill, {r.decode} decode); decode "
                     f"median {_ms(r.decode_median_us)} ms, p90 {_ms(r.decode_p90_us)}, covering "
                     f"{r.decode_cover_pct:.1f}% of the decode phase; prefill median {_ms(r.prefill_median_us)} ms")
    return "\n".join(_wrap(line, width) for line in lines)


def _wrap(line: str, width: int) -> str:
    """A line longer than `width` broken at spaces, continuation lines indented."""
    if len(line) <= width:
        return line
    lead = len(line) - len(line.lstrip())
    indent = " " * (lead + 4)
    out, cur = [], " " * lead
    for word in line.lstrip().split(" "):
        if cur.strip() and len(cur) + 1 + len(word) > width:
            out.append(cur)
            cur = indent + word
        else:
            cur = f"{cur} {word}" if cur.strip() else cur + word
    out.append(cur)
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Per-device busy and idle time of a pyllama trace.")
    ap.add_argument("traces", nargs="+", help="trace files (JSON lines), the server's first")
    ap.add_argument("--table", action="store_true", help="print the full table (µs) instead of the report")
    args = ap.parse_args(argv)
    trace = merge.load_for_cli(args.traces, "device_idle")
    if trace is None:
        return 1
    table = device_idle(trace)
    if table.empty:
        print("no dev events: nothing to report")
    elif args.table:
        with pd.option_context("display.width", 250, "display.max_rows", None, "display.max_columns", None):
            print(table.round(1).to_string(index=False))
    else:
        print(format_report(trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
