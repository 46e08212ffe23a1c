#!/usr/bin/env python3
"""What two pipeline groups share in a split: the same users over one server with 2 groups, over
two servers of one group sharing one rpc server, and over two servers with an rpc server each, on
the same cores, measured side by side.

    python bench/split_sharing.py [--preset medium --type q4_k_m | --model M] [--users 32]
        [-r 3] [--npp 64] [--ntg 64] [--legs 2] [--tensor-split 7,5] [--json OUT]

Arms (every leg runs each arm once, in this order):
- `2 groups`: one pyllama.server, --pipeline-groups 2 over RPC0,CPU, one rpc server;
- `2 servers, 1 rpc`: two servers of one group with half the slots and half the users each, both
  on one rpc server, whose one executor runs the two servers' graphs in arrival order, as it runs
  the two groups' graphs of the first arm;
- `2 servers, 2 rpc`: the same with an rpc server each: two independent splits.
Every server and rpc server uses one compute thread (-t 1), -ts as given, no prompt cache. Each
server gets its own load (bench/bench_users.py), started together. An arm's tokens/s is its
loads' generated tokens over the time from the first load's measured window opening to the last
one's closing; idle is the machine's idle share (/proc/stat) over that time: no thread of any
process wanted a core.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Optional

for _p in (os.path.dirname(os.path.abspath(__file__)),
           os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_users import run_bench  # noqa: E402
import pipeline_cells as pc  # noqa: E402
import thread_stats  # noqa: E402
from server_util import RPCServerProcess, ServerProcess  # noqa: E402

ARMS = {  # name: (servers, rpc servers, pipeline groups per server)
    "2 groups": (1, 1, 2),
    "2 servers, 1 rpc": (2, 1, 1),
    "2 servers, 2 rpc": (2, 2, 1),
}


def server_args(endpoint: str, users: int, groups: int, npp: int, ntg: int, tensor_split: str) -> list[str]:
    """A split server of `groups` groups over RPC0,CPU for `users` users, one compute thread: the
    arguments of pipeline_cells.py's split cells."""
    return pc.server_args("RPC0,CPU", endpoint, groups, users, npp, ntg, 1, tensor_split)


def run_arm(name: str, model: str, a: argparse.Namespace, vocab: tuple[int, int]) -> dict:
    """Starts the arm's rpc servers and servers, runs one load per server at once, stops them all."""
    n_servers, n_rpc, groups = ARMS[name]
    users = a.users // n_servers
    rpcs: list[RPCServerProcess] = []
    servers: list[ServerProcess] = []
    try:
        for _ in range(n_rpc):
            rpcs.append(RPCServerProcess())
        for i in range(n_servers):
            args = server_args(rpcs[i % n_rpc].endpoint, users, groups, a.npp, a.ntg, a.tensor_split)
            servers.append(ServerProcess(model, *args))  # stopped below even if it never gets ready
            servers[-1].wait_ready(timeout=300)
        starts: list[Optional[float]] = [None] * n_servers
        cpu0: list[list[int]] = []  # the machine's counters when the first window opens
        lock = threading.Lock()

        def opened(i: int) -> None:
            with lock:
                if not cpu0:
                    cpu0.append(thread_stats.read_cpu_times())
                starts[i] = time.monotonic()

        reports: list[Optional[dict]] = [None] * n_servers

        def load(i: int) -> None:
            reports[i] = run_bench(servers[i].url, users, a.requests, a.npp, a.ntg, warmup=1,
                                   seed=a.seed + i, vocab=vocab, on_window_start=lambda: opened(i))

        threads = [threading.Thread(target=load, args=(i,)) for i in range(n_servers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cpu1 = thread_stats.read_cpu_times()  # a few ms after the last window: /metrics read
    finally:
        for s in servers:
            s.stop()
        for r in rpcs:
            r.stop()
    failures = [f for r in reports for f in (r or {}).get("failures", ["no report"])]
    if failures:
        raise RuntimeError(f"{name}: " + "; ".join(failures[:3]))
    tokens = sum(r["gen_tokens"] for r in reports)
    span = max(s + r["wall_s"] for s, r in zip(starts, reports)) - min(starts)
    shares = thread_stats.machine_shares(cpu0[0], cpu1) or {}
    return {"arm": name, "tok_s": tokens / span, "gen_tokens": tokens,
            "idle_pct": shares.get("idle"), "stolen_pct": shares.get("stolen"),
            "loads_tok_s": [r["gen_tok_s"] for r in reports]}


def summarize(records: list[dict]) -> list[dict]:
    rows = []
    for name in ARMS:
        tok = [r["tok_s"] for r in records if r["arm"] == name]
        idle = [r["idle_pct"] for r in records if r["arm"] == name and r["idle_pct"] is not None]
        if tok:
            rows.append({"arm": name, "tok_s": statistics.fmean(tok), "min": min(tok), "max": max(tok),
                         "idle_pct": statistics.fmean(idle) if idle else None})
    return rows


def format_rows(rows: list[dict]) -> str:
    base = next((r["tok_s"] for r in rows if r["arm"] == "2 groups"), None)
    out = [f"{'arm':<18} {'tok/s mean [min..max]':<28} {'idle %':>7} {'x 2 groups':>10}"]
    for r in rows:
        idle = f"{r['idle_pct']:.1f}" if r["idle_pct"] is not None else "-"
        ratio = f"{r['tok_s'] / base:.2f}x" if base else "-"
        cell = f"{r['tok_s']:.1f} [{r['min']:.1f}..{r['max']:.1f}]"
        out.append(f"{r['arm']:<18} {cell:<28} {idle:>7} {ratio:>10}")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: --preset/--type, made once)")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--type", default="q4_k_m")
    ap.add_argument("-u", "--users", type=int, default=32, help="users in all (even: half per server)")
    ap.add_argument("-r", "--requests", type=int, default=3, help="measured requests per user")
    ap.add_argument("--npp", type=int, default=64)
    ap.add_argument("--ntg", type=int, default=64)
    ap.add_argument("--legs", type=int, default=2)
    ap.add_argument("--tensor-split", default="7,5", help="-ts of every server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the legs and the summary to this file")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    if a.users < 2 or a.users % 2:
        print("--users must be an even number of at least 2", file=sys.stderr)
        return 2
    if a.requests < 1 or a.npp < 1 or a.ntg < 1 or a.legs < 1:
        print("--requests, --npp, --ntg and --legs must be at least 1", file=sys.stderr)
        return 2
    if a.model and not os.path.isfile(a.model):
        print(f"split_sharing.py: --model {a.model}: no such file", file=sys.stderr)
        return 2
    os.environ.pop("PYLLAMA_ARG_PIPELINE_GROUPS", None)  # one group must mean one group
    try:
        model = a.model or pc.model_path(a.preset, a.type)
    except (ValueError, KeyError) as exc:  # a preset or weight type pyllama.models.make does not know
        print(f"split_sharing.py: --preset {a.preset} --type {a.type}: {exc}", file=sys.stderr)
        return 2
    vocab = pc.prompt_vocab(model)
    records = []
    for leg in range(a.legs):
        for name in ARMS:
            try:
                rec = run_arm(name, model, a, vocab)
            except (RuntimeError, TimeoutError) as exc:  # a process that would not start, a failed load
                print(f"split_sharing.py: {name}: {exc}", file=sys.stderr)
                return 1
            rec["leg"] = leg
            records.append(rec)
            loads = " + ".join(f"{x:.1f}" for x in rec["loads_tok_s"])
            shares = ("idle -, stolen - (a window shorter than a clock tick)" if rec["idle_pct"] is None
                      else f"idle {rec['idle_pct']:.1f}%, stolen {rec['stolen_pct']:.1f}%")
            print(f"leg {leg + 1} {name:<18} {rec['tok_s']:8.1f} tok/s (loads' own windows {loads}), {shares}",
                  flush=True)
    rows = summarize(records)
    print(format_rows(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"legs": records, "summary": rows, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
