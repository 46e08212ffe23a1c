"""Tokens/s of the split's cost-cutting arms, side by side in one run.

    python bench/cheap_split.py [--preset medium] [--orders 'CPU,RPC0;RPC0,CPU'] [--groups 1,2]
        [--users 32] [--npp 64] [--ntg 128] [-t 1] [--ts 7,5] [--legs 1] [--netns [--rate 1gbit]]

One rpc server for the whole run; per cell (device order, groups, arm) a fresh server driven by
bench_users. Arms: `base` (asynchronous split copies off, PYLLAMA_RPC_NO_ASYNC_COPY=1, and host
sampling, `--no-backend-sampling`: the logits of every output row come back from the device of the output layer), `async
copy` (split copies through the connection's staging arena, or straight out of host memory),
`backend sampling` (`--backend-sampling`: the sampler runs there, only ids come back) and `both`. With `CPU,RPC0` the output layer is on the peer, with `RPC0,CPU` it is local. Arms are
interleaved per leg. Printed: tokens/s per cell, and each arm's ratio to `base` in the same order
and groups.

--netns puts the rpc server in its own network namespace behind a veth pair shaped by tbf at
--rate on both ends (pipeline_cells.NetnsPeer; root only), so the logits and hidden states cross a
link of known bandwidth instead of loopback.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # a checkout without an install
    sys.path.insert(0, ROOT)

from bench_users import run_bench  # noqa: E402
from pipeline_cells import NetnsPeer, model_path, prompt_vocab, tbf_burst  # noqa: E402
from server_util import RPCServerProcess, ServerProcess  # noqa: E402

OFF = {"PYLLAMA_RPC_NO_ASYNC_COPY": "1"}
ON = {"PYLLAMA_RPC_NO_ASYNC_COPY": "0"}
HOST = ["--no-backend-sampling"]
ARMS = {"base": (HOST, OFF), "async copy": (HOST, ON), "backend sampling": (["--backend-sampling"], OFF),
        "both": (["--backend-sampling"], ON)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--orders", default="CPU,RPC0;RPC0,CPU")
    ap.add_argument("--groups", default="1,2")
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--npp", type=int, default=64)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--ts", default="7,5")
    ap.add_argument("--legs", type=int, default=1)
    ap.add_argument("--netns", action="store_true", help="rpc server in its own network namespace (root)")
    ap.add_argument("--rate", default="1gbit", help="tbf rate of the veth pair with --netns")
    a = ap.parse_args()
    if a.netns:
        try:
            tbf_burst(a.rate)
        except ValueError as e:
            ap.error(str(e))
        if os.geteuid() != 0:
            ap.error("--netns needs root (network namespace, veth pair, tc)")
    model = model_path(a.preset)
    vocab = prompt_vocab(model)
    orders = [o for o in a.orders.split(";") if o]
    groups = [int(g) for g in a.groups.split(",")]
    env = {"PYLLAMA_TRACE": ""}
    peer = rpc = None
    if a.netns:
        peer = NetnsPeer(a.rate, a.threads)
        try:
            peer.setup()
            endpoint = peer.start_rpc()
        except RuntimeError as e:
            peer.teardown()
            print(f"cheap_split: --netns: {e}", file=sys.stderr)
            return 1
    else:
        rpc = RPCServerProcess("-t", str(a.threads), env=env)
        endpoint = rpc.endpoint
    res: dict[tuple, list[float]] = {}
    failed = False
    try:
        print(f"# {a.preset}, {a.users} users, npp {a.npp}, ntg {a.ntg}, -t {a.threads}, -ts {a.ts}, legs {a.legs}, "
              + (f"rpc in netns behind tbf {a.rate}" if a.netns else "rpc on loopback"))
        for order in orders:
            for g in groups:
                for leg in range(a.legs):
                    for arm, (extra, arm_env) in ARMS.items():
                        n_slots = -(-a.users // g) * g
                        args = ["--rpc", endpoint, "--device", order, "-np", str(n_slots),
                                "-c", str(n_slots * (a.npp + a.ntg + 16)), "-t", str(a.threads), "-ts", a.ts,
                                "--pipeline-groups", str(g), *extra]
                        srv = ServerProcess(model, *args, env={**env, **arm_env}).wait_ready(600)
                        try:
                            rep = run_bench(srv.url, a.users, 1, a.npp, a.ntg, warmup=1, vocab=vocab)
                        finally:
                            srv.stop()
                        failed |= bool(rep["errors"])
                        res.setdefault((order, g, arm), []).append(rep["gen_tok_s"])
                        print(f"  {order} groups {g} {arm:17s} leg {leg + 1}: {rep['gen_tok_s']:7.1f} tok/s, "
                              f"TPOT {rep['tpot_ms']:.1f} ms, errors {rep['errors']}", flush=True)
        print(f"{'order':9s} {'groups':>6s} " + " ".join(f"{arm:>17s}" for arm in ARMS) + "  ratios to base")
        for order in orders:
            for g in groups:
                means = {arm: statistics.fmean(res[(order, g, arm)]) for arm in ARMS}
                print(f"{order:9s} {g:6d} " + " ".join(f"{means[arm]:17.1f}" for arm in ARMS) + "  "
                      + ", ".join(f"{arm} {means[arm] / means['base']:.2f}x" for arm in ARMS if arm != "base"))
    finally:
        if rpc is not None:
            rpc.stop()
        if peer is not None:
            peer.teardown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
