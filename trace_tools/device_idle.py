"""When each device waited, and whether anything else was working meanwhile.

A device that is idle while another one is busy waits on the pipeline (its turn has not come);
a device idle while no device is busy waits on the host (sampling, batch building, the network).
The two call for different fixes, so they are counted apart, overall and per phase of serving:

* `decode`: covered by an iteration that decoded at least one token (mixed batches included,
  as are batches where a slot contributes several tokens);
* `prefill`: covered only by iterations that processed prompt tokens and decoded none;
* `other`: the rest of the window (no iteration running, or only empty ones).

The window runs from the first iteration's start to the last one's end in the base file (all
dev spans when there are no iterations). A device is one `dev` span name in one file, labelled
``<role>:<uid[:8]>:<name>``.

CLI: ``python trace_tools/device_idle.py TRACE...``
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
COLUMNS = ["device", "phase", "span_us", "busy_us", "idle_other_us", "idle_neither_us",
           "idle_median_us", "idle_stretches"]


def analysis_window(trace: merge.Trace) -> Optional[tuple[int, int]]:
    """First iteration start to last iteration end; without iterations the span of all dev
    events; None when there is neither."""
    it = merge.iterations(trace)
    if len(it):
        return int(it["t0"].min()), int(it["t1"].max())
    dev = trace.events[trace.events["c"] == "dev"]
    if len(dev):
        return int(dev["t0"].min()), int(dev["t1"].max())
    return None


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


def _devices(trace: merge.Trace) -> dict[str, Intervals]:
    """Busy time of each device, by label, in file order."""
    dev = trace.events[trace.events["c"] == "dev"]
    out = {}
    for (file, name), spans in dev.groupby(["file", "n"], sort=True):
        h = trace.headers[file]
        out[f"{h['role']}:{h['uid'][:8]}:{name}"] = union(spans["t0"], spans["t1"])
    return out


def _union_all(sets: list[Intervals]) -> Intervals:
    """Time during which at least one of the sets is on."""
    empty = np.empty(0, np.int64)
    return union(np.concatenate([iv[0] for iv in sets] + [empty]), np.concatenate([iv[1] for iv in sets] + [empty]))


def _row(label: str, phase: str, span: Intervals, mine: Intervals, others: Intervals, anyone: Intervals) -> dict:
    stretches = combine([span, mine], lambda p, m: p & ~m)
    lengths = stretches[1] - stretches[0]
    return {"device": label, "phase": phase, "span_us": length(span),
            "busy_us": length(combine([span, mine], lambda p, m: p & m)),
            "idle_other_us": length(combine([span, mine, others], lambda p, m, o: p & ~m & o)),
            "idle_neither_us": length(combine([span, anyone], lambda p, a: p & ~a)),
            "idle_median_us": float(np.median(lengths)) if len(lengths) else float("nan"),
            "idle_stretches": len(lengths)}


def device_idle(trace: merge.Trace) -> pd.DataFrame:
    """One row per device and phase (`all` included): busy time, idle time while another device
    was busy, idle time while none was, and the median idle stretch, all in µs. busy + both idle
    columns = span_us, the phase's length inside the window."""
    window = analysis_window(trace)
    devices = _devices(trace)
    if window is None or not devices:
        return pd.DataFrame(columns=COLUMNS)
    phases = phase_intervals(trace, window)
    anyone = _union_all(list(devices.values()))
    rows = []
    for label, mine in devices.items():
        others = _union_all([iv for other, iv in devices.items() if other != label])
        rows += [_row(label, phase, phases[phase], mine, others, anyone) for phase in PHASES]
    return pd.DataFrame(rows, columns=COLUMNS)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Per-device busy and idle time of a pyllama trace.")
    ap.add_argument("traces", nargs="+", help="trace files (JSON lines), the server's first")
    args = ap.parse_args(argv)
    trace = merge.load_for_cli(args.traces, "device_idle")
    if trace is None:
        return 1
    table = device_idle(trace)
    if table.empty:
        print("no dev events: nothing to report")
    else:
        with pd.option_context("display.width", 200, "display.max_rows", None):
            print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
