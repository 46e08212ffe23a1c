"""Tracer cost and the step time lines of a split, measured side by side in one run.

    python bench/trace_overhead.py [--preset medium] [--users 32] [--npp 64] [--ntg 128] [-t 1]
        [--ts 7,5] [--legs 2] [--bracket split|unsplit|both] [--timelines] [--out bench/out/trace]

Overhead, two brackets (`--bracket split|unsplit|both`): a split, one rpc server and one server
(`--device RPC0,CPU --pipeline-groups 2`), and an unsplit server (`--device CPU`, no RPC at all),
restarted per leg, legs bracketed off/on/off/on/...: generated tokens/s of bench_users per leg, and
for the traced legs the events per second and MB per minute each process wrote.

--timelines: three traced runs, each analysed with trace_tools.merge and trace_tools.device_idle:
one group with the output layer on the peer (`CPU,RPC0`), one group with it local (`RPC0,CPU`),
two groups with it local. Printed per run: median step time and host phases, local and peer device
busy per step, idle with neither computing, where that idle time went, and the bottleneck (the
device busiest per step, or the host phase that holds most of the idle time when no device is).
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # a checkout without an install
    sys.path.insert(0, ROOT)

from bench_users import run_bench  # noqa: E402
from pipeline_cells import model_path, prompt_vocab  # noqa: E402
from server_util import RPCServerProcess, ServerProcess  # noqa: E402


def run_leg(model: str, a, order: str, groups: int, trace_base: str | None, vocab) -> dict:
    """One rpc server (unless `order` names no RPC device) and one server, bench_users once;
    returns tok/s and the trace files."""
    extra = ["--trace", trace_base] if trace_base else []
    env = {"PYLLAMA_TRACE": "", "PYLLAMA_ARG_PIPELINE_GROUPS": str(groups)}
    rpc = RPCServerProcess(*extra, "-t", str(a.threads), env=env) if "RPC" in order else None
    srv = None
    try:
        n_slots = -(-a.users // groups) * groups
        split = ["--rpc", rpc.endpoint, "-ts", a.ts] if rpc is not None else []
        args = [*split, "--device", order, "-np", str(n_slots), "-c",
                str(n_slots * (a.npp + a.ntg + 16)), "-t", str(a.threads), *extra]
        srv = ServerProcess(model, *args, env=env).wait_ready(600)
        rep = run_bench(srv.url, a.users, 1, a.npp, a.ntg, warmup=1, vocab=vocab)
    finally:
        if srv is not None:
            srv.stop()
        if rpc is not None:
            rpc.stop()
    files = sorted(glob.glob(trace_base[:-6] + "*.jsonl")) if trace_base else []
    return {"tok_s": rep["gen_tok_s"], "errors": rep["errors"], "wall_s": rep["wall_s"], "files": files}


def trace_rates(files: list[str]) -> list[str]:
    """Events per second and MB per minute of each file, over the time its events span."""
    import json  # noqa: PLC0415
    out = []
    for f in files:
        with open(f) as fh:
            head = json.loads(fh.readline())
            t0 = t1 = None
            n = 0
            for line in fh:
                ev = json.loads(line)
                n += 1
                t0 = ev["t0"] if t0 is None else min(t0, ev["t0"])
                t1 = ev["t1"] if t1 is None else max(t1, ev["t1"])
        span = max((t1 - t0) / 1e6, 1e-6) if n else 0
        size = os.path.getsize(f)
        out.append(f"    {head['role']:10s} {n:8d} events over {span:6.1f} s: {n / span if span else 0:8.0f} events/s, "
                   f"{size / 2**20 / (span / 60) if span else 0:6.2f} MB/min ({os.path.basename(f)})")
    return out


BRACKETS = {"split": ("RPC0,CPU", 2), "unsplit": ("CPU", 1)}


def overhead(model: str, a, vocab, bracket: str = "split") -> None:
    order, groups = BRACKETS[bracket]
    print(f"# overhead, {bracket}: --device {order}, {groups} group(s), {a.users} users, npp {a.npp}, ntg {a.ntg}, "
          f"-t {a.threads}" + (f", -ts {a.ts}" if "RPC" in order else ""))
    res: dict[str, list[float]] = {"off": [], "on": []}
    for leg in range(a.legs):
        for mode in ("off", "on"):
            base = os.path.join(a.out, f"overhead-{bracket}-{leg}.jsonl") if mode == "on" else None
            for f in glob.glob(os.path.join(a.out, f"overhead-{bracket}-{leg}*.jsonl")) if base else []:
                os.unlink(f)
            r = run_leg(model, a, order, groups, base, vocab)
            res[mode].append(r["tok_s"])
            print(f"  leg {leg + 1} trace {mode:3s}: {r['tok_s']:7.1f} tok/s, errors {r['errors']}", flush=True)
            if base:
                print("\n".join(trace_rates(r["files"])), flush=True)
    off, on = statistics.fmean(res["off"]), statistics.fmean(res["on"])
    print(f"  mean off {off:.1f} tok/s (spread {min(res['off']):.1f}..{max(res['off']):.1f}), "
          f"on {on:.1f} (spread {min(res['on']):.1f}..{max(res['on']):.1f}): on/off {on / off:.3f}")


def timeline(files: list[str]) -> None:
    from trace_tools import device_idle, merge  # noqa: PLC0415
    tr = merge.load(files)
    steps = merge.step_summary(tr)
    dec = steps[steps["n_decode"] > 0]
    if dec.empty:
        print("    no decode steps in the trace")
        return
    med = dec.median(numeric_only=True)
    phases = ["batch_build_us", "submit_us", "synchronize_us", "post_decode_us", "sampling_us", "result_send_us"]
    print(f"    decode steps {len(dec)}; median per step (ms): step {med['step_us'] / 1e3:.1f}, "
          + ", ".join(f"{p[:-3]} {med[p] / 1e3:.2f}" for p in phases))
    print(f"    local busy {med['local_busy_us'] / 1e3:.1f}, peer busy {med['peer_busy_us'] / 1e3:.1f}, "
          f"idle both {med['idle_both_us'] / 1e3:.1f}, logits read {med['logits_read_us'] / 1e3:.2f}")
    idle_cols = [c for c in dec.columns if c.startswith("idle_") and c != "idle_both_us"]
    total_idle = dec["idle_both_us"].sum()
    if total_idle > 0:
        shares = sorted(((dec[c].sum() / total_idle, c[5:-3]) for c in idle_cols), reverse=True)[:5]
        print("    idle-both charged to: " + ", ".join(f"{name} {s:.0%}" for s, name in shares))
    idle = device_idle.device_idle(tr)
    print("    " + idle.to_string().replace("\n", "\n    "))
    local, peer, gap = med["local_busy_us"], med["peer_busy_us"], med["idle_both_us"]
    if gap > max(local, peer):
        name = max(((dec[c].sum(), c[5:-3]) for c in idle_cols), default=(0, "unattributed"))[1]
        print(f"    bottleneck: host time with neither device busy, most of it in {name}")
    else:
        print(f"    bottleneck: the {'local' if local >= peer else 'peer'} device "
              f"({max(local, peer) / 1e3:.1f} ms busy per step)")


def timelines(model: str, a, vocab) -> None:
    runs = [("one group, output layer on the peer", "CPU,RPC0", 1),
            ("one group, output layer local", "RPC0,CPU", 1),
            ("two groups, output layer local", "RPC0,CPU", 2)]
    for i, (title, order, groups) in enumerate(runs):
        base = os.path.join(a.out, f"timeline-{i}.jsonl")
        for f in glob.glob(base[:-6] + "*.jsonl"):
            os.unlink(f)
        r = run_leg(model, a, order, groups, base, vocab)
        print(f"# {title} ({order}, {groups} group(s)): {r['tok_s']:.1f} tok/s; traces {', '.join(r['files'])}")
        timeline(r["files"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--npp", type=int, default=64)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--ts", default="7,5", help="-ts of the server (device order RPC0,CPU or CPU,RPC0)")
    ap.add_argument("--legs", type=int, default=2, help="off/on pairs")
    ap.add_argument("--timelines", action="store_true", help="only the three analysed time lines")
    ap.add_argument("--bracket", choices=["split", "unsplit", "both"], default="both",
                    help="overhead legs of a split (RPC0,CPU, 2 groups), of a local run (CPU, no RPC), or both")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "trace"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model = model_path(a.preset)
    vocab = prompt_vocab(model)
    if a.timelines:
        timelines(model, a, vocab)
    else:
        for bracket in (["split", "unsplit"] if a.bracket == "both" else [a.bracket]):
            overhead(model, a, vocab, bracket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
