"""Two checkouts of pyllama side by side: the same server cell (closed-loop users, bench_users)
against `python -m pyllama.server` from each, in interleaved legs, so that a change that claims
to keep or improve the server's throughput is judged on the same machine at the same time.

    python bench/ab_server.py --a OLD_CHECKOUT --b NEW_CHECKOUT -m MODEL [--users 1,8] [--legs 3]
        [--split RPC0,CPU [--groups 2] [--peer-threads 1]]

Each checkout must have its compiled kernels (pyllama/_fast/*.so) in place. Prints the generated
tokens per second of each leg and the ratio b/a of the medians per cell. With --split, each cell
is the model split over that device order (equal proportions) with `--pipeline-groups G`, against
a `python -m pyllama.rpc_server -t PEER_THREADS` of the same checkout started for the cell.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_users import run_bench  # noqa: E402
from server_util import RPCServerProcess, ServerProcess  # noqa: E402


def _cell(checkout: str, model: str, users: int, args: argparse.Namespace) -> float:
    env = {"PYTHONPATH": os.path.abspath(checkout)}
    extra: list[str] = []
    peer = None
    if args.split:
        peer = RPCServerProcess("-t", str(args.peer_threads), env=env)
        n_dev = len(args.split.split(","))
        extra = ["--rpc", peer.endpoint, "--device", args.split, "-ts", ",".join(["1"] * n_dev)]
        if args.groups > 1:
            extra += ["--pipeline-groups", str(args.groups)]
    np_ = -(-users // args.groups) * args.groups
    try:
        srv = ServerProcess(model, "-np", str(np_), "-c", str(np_ * (args.npp + args.ntg + 16)), "-t",
                            str(args.threads), *extra, env=env).wait_ready()
        try:
            rep = run_bench(srv.url, users, args.requests, args.npp, args.ntg, warmup=1)
        finally:
            srv.stop()
    finally:
        if peer is not None:
            peer.stop()
    return rep["gen_tok_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="the first checkout (the baseline)")
    ap.add_argument("--b", required=True, help="the second checkout")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--users", default="1,8")
    ap.add_argument("--npp", type=int, default=32)
    ap.add_argument("--ntg", type=int, default=64)
    ap.add_argument("-r", "--requests", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--legs", type=int, default=3)
    ap.add_argument("--split", help="a device order over one rpc server, e.g. RPC0,CPU")
    ap.add_argument("--groups", type=int, default=1, help="pipeline groups (with --split)")
    ap.add_argument("--peer-threads", type=int, default=1, help="the rpc server's -t (with --split)")
    args = ap.parse_args()
    for users in [int(u) for u in args.users.split(",")]:
        got: dict[str, list[float]] = {"a": [], "b": []}
        for leg in range(args.legs):
            order = ("a", "b") if leg % 2 == 0 else ("b", "a")
            for which in order:
                got[which].append(_cell(getattr(args, which), args.model, users, args))
        a, b = statistics.median(got["a"]), statistics.median(got["b"])
        print(f"users {users}: a {' '.join(f'{x:.1f}' for x in got['a'])} tok/s, "
              f"b {' '.join(f'{x:.1f}' for x in got['b'])} tok/s; median b/a {b / a:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
