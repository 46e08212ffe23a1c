"""Server throughput cells: bench_users.py against `python -m pyllama.server`, one run side by side.

    python bench/server_cells.py [--models small,medium] [--users 1,8,32] [--npp 128] [--ntg 64] [-r 2]
                                 [--frontend-users 16] [--json OUT]

For each model (a test model made with pyllama.models.make under bench/out/models) it starts one
server with as many slots as the largest user count, runs bench_users.py at every user count and
prints generated tokens/s, TPOT, TTFT median/p99 and errors. Then it measures what the front end
alone sustains: the tiny model, n_predict 1, a few prompt tokens, many users (requests/s).
Every server is started on a free loopback port and stopped by this script.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench_users import run_bench  # noqa: E402
from server_util import ServerProcess  # noqa: E402
from pyllama.models.make import make_model  # noqa: E402


def model_path(preset: str) -> str:
    out = os.path.join(HERE, "out", "models")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{preset}-f32.gguf")
    if not os.path.exists(path):
        make_model(preset, path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,medium")
    ap.add_argument("--users", default="1,8,32")
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=64)
    ap.add_argument("-r", "--requests", type=int, default=2, help="measured requests per user")
    ap.add_argument("-t", "--threads", type=int, default=0, help="server compute threads")
    ap.add_argument("--frontend-users", type=int, default=16)
    ap.add_argument("--frontend-requests", type=int, default=100)
    ap.add_argument("--json")
    args = ap.parse_args()
    users = [int(u) for u in args.users.split(",")]
    rows, failed = [], False
    presets = [m for m in args.models.split(",") if m and m != "none"]
    for preset in presets:
        np_ = max(users)
        srv = ServerProcess(model_path(preset), "-np", str(np_), "-c", str(np_ * (args.npp + args.ntg + 16)),
                            "-t", str(args.threads)).wait_ready(300)
        try:
            for u in users:
                r = run_bench(srv.url, u, args.requests, args.npp, args.ntg, warmup=1)
                failed |= r["exit_status"] != 0
                rows.append({"model": preset, "users": u, "tok_s": r["gen_tok_s"], "tpot_ms": r["tpot_ms"],
                             "ttft_med_ms": r["ttft_ms_median"], "ttft_p99_ms": r["ttft_ms_p99"],
                             "errors": r["errors"] + r["short"], "counters_match":
                                 r["counters"].get("tokens_predicted_match")})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            srv.stop()
    srv = ServerProcess(model_path("tiny"), "-np", str(args.frontend_users), "-t", "1").wait_ready(300)
    try:
        fe = run_bench(srv.url, args.frontend_users, args.frontend_requests, 8, 1, warmup=1, vocab=(260, 512))
        failed |= fe["exit_status"] != 0
    finally:
        srv.stop()
    print("\nmodel | users | gen tok/s | TPOT ms | TTFT median ms | TTFT p99 ms | errors | counters match")
    for r in rows:
        print(f"{r['model']} | {r['users']} | {r['tok_s']:.1f} | {r['tpot_ms']:.1f} | {r['ttft_med_ms']:.1f} | "
              f"{r['ttft_p99_ms']:.1f} | {r['errors']} | {r['counters_match']}")
    for m in presets:
        base = next((r for r in rows if r["model"] == m and r["users"] == users[0]), None)
        if base and base["tok_s"]:
            print(f"# {m}: " + ", ".join(f"{r['users']} users {r['tok_s'] / base['tok_s']:.2f}x"
                                         for r in rows if r["model"] == m))
    print(f"\nfront end (tiny model, n_predict 1, {args.frontend_users} users): {fe['req_s']:.0f} requests/s, "
          f"TTFT median {fe['ttft_ms_median']:.1f} ms, errors {fe['errors'] + fe['short']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cells": rows, "frontend": {k: fe[k] for k in ("req_s", "ttft_ms_median", "errors")}}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
