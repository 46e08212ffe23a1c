"""RPC commands per decode step, counted from the server's trace over a decode-only window.

    python bench/rpc_step_counts.py [--preset small] [--users 8] [--npp 128] [--ntg 256] [--out DIR]

Two local rpc servers on the CPU backend and a server with `--device RPC0,RPC1 -sm layer` (so the
output layer and its logits are on a peer), 8 concurrent users (bench_users), prompts of npp tokens,
ntg generated. Four arms: host sampling and `--backend-sampling`, each before (features off:
PYLLAMA_RPC_NO_BATCHED_GET=1, one GET_TENSOR per tensor read, and PYLLAMA_RPC_NO_ASYNC_COPY=1) and
after (batched reads and asynchronous split copies on). The
server traces (`--trace`); a step counts when its iteration submitted decode tokens only (prefill
and mixed steps excluded), and a command belongs to the step whose iteration (same group) contains
its start. Printed per arm: GET_TENSOR, GET_TENSORS, SET_TENSOR, graph commands and all commands
per step, bytes received per step, and generated tokens/s (a side figure: one run, shared machine).
The hidden state crossing from RPC0 to RPC1 is one read and one write per step in every arm (the
split between two peers); the rest is what the arm changes.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # a checkout without an install
    sys.path.insert(0, ROOT)

from bench_users import run_bench  # noqa: E402
from pipeline_cells import model_path, prompt_vocab  # noqa: E402
from server_util import RPCServerProcess, ServerProcess  # noqa: E402

ARMS = [("host sampling, before", False, False), ("host sampling, after", False, True),
        ("backend sampling, before", True, False), ("backend sampling, after", True, True)]
SHOWN = ("GET_TENSOR", "GET_TENSORS", "SET_TENSOR")


def count_per_step(trace_file: str) -> dict:
    """Commands per decode-only step from one server trace file."""
    with open(trace_file) as fh:
        fh.readline()
        events = [json.loads(line) for line in fh if line.strip()]
    steps = [e for e in events if e["c"] == "server" and e["n"] == "iteration"
             and e.get("n_prompt") == 0 and e.get("n_decode", 0) > 0]
    by_grp: dict = collections.defaultdict(list)
    for s in steps:
        by_grp[s["grp"]].append((s["t0"], s["t1"]))
    counts: collections.Counter = collections.Counter()
    bytes_in = 0
    for e in events:
        if e["c"] != "rpc.client":
            continue
        for t0, t1 in by_grp.get(e.get("grp"), ()):
            if t0 <= e["t0"] <= t1:
                counts[e["n"]] += 1
                bytes_in += e.get("bytes_in") or 0
                break
    n = max(len(steps), 1)
    out = {k: counts[k] / n for k in SHOWN}
    out["graph"] = (counts["GRAPH_COMPUTE"] + counts["GRAPH_RECOMPUTE"]) / n
    out["total"] = sum(counts.values()) / n
    out["bytes_in"] = bytes_in / n
    out["steps"] = len(steps)
    return out


def run_arm(model: str, a, backend_sampling: bool, batched: bool, vocab) -> dict:
    off = "0" if batched else "1"
    env = {"PYLLAMA_TRACE": "", "PYLLAMA_RPC_NO_BATCHED_GET": off, "PYLLAMA_RPC_NO_ASYNC_COPY": off}
    tag = f"{'bs' if backend_sampling else 'hs'}-{'after' if batched else 'before'}"
    base = os.path.join(a.out, f"steps-{tag}.jsonl")
    for f in glob.glob(base[:-6] + "*.jsonl"):
        os.unlink(f)
    peers = [RPCServerProcess("-t", "1", env=env) for _ in range(2)]
    srv = None
    try:
        args = ["--rpc", ",".join(p.endpoint for p in peers), "--device", "RPC0,RPC1", "-sm", "layer",
                "-np", str(a.users), "-c", str(a.users * (a.npp + a.ntg + 16)), "--trace", base]
        args.append("--backend-sampling" if backend_sampling else "--no-backend-sampling")
        srv = ServerProcess(model, *args, env=env).wait_ready(600)
        rep = run_bench(srv.url, a.users, 1, a.npp, a.ntg, warmup=0, vocab=vocab)
    finally:
        if srv is not None:
            srv.stop()
        for p in peers:
            p.stop()
    res = count_per_step(base)
    res["tok_s"] = rep["gen_tok_s"]
    res["errors"] = rep["errors"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=256)
    ap.add_argument("--out", default=os.path.join(HERE, "out", "steps"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model = model_path(a.preset)
    vocab = prompt_vocab(model)
    print(f"# {a.preset}, --device RPC0,RPC1 -sm layer, {a.users} users, npp {a.npp}, ntg {a.ntg}; "
          "per decode-only step")
    print(f"{'arm':26s} {'GET_TENSOR':>10s} {'GET_TENSORS':>11s} {'SET_TENSOR':>10s} {'graph':>6s} "
          f"{'total':>6s} {'KiB in':>8s} {'steps':>6s} {'tok/s':>7s}")
    failed = False
    for title, bs, batched in ARMS:
        r = run_arm(model, a, bs, batched, vocab)
        failed |= bool(r["errors"])
        print(f"{title:26s} {r['GET_TENSOR']:10.2f} {r['GET_TENSORS']:11.2f} {r['SET_TENSOR']:10.2f} "
              f"{r['graph']:6.2f} {r['total']:6.2f} {r['bytes_in'] / 1024:8.1f} {r['steps']:6d} {r['tok_s']:7.1f}",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
