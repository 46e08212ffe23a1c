"""Pipeline groups over llama.cpp's rpc-server: pyllama's server against llama-server, both split
over one `ggml-rpc-server` (needs --peers).

    python bench/ggml_pipeline.py --peers DIR [--model PATH | --preset medium --type q4_k_m]
        [--users 32] [--groups 1,2] [--legs 3] [-r 3] [--npp 64] [--ntg 32] [--ngl N] [-t 1]
        [--llama-args=--kv-unified] [--trace DIR]

One ggml-rpc-server (-t T) lives for the whole run. Arms, interleaved leg by leg: llama-server
`--rpc EP -ngl N` (it turns pipelining off with an RPC device), and pyllama's server with the same
`--rpc EP -ngl N` at each --groups value (`--pipeline-groups G`); every server runs -t T and
-np USERS and is stopped before the next starts (the peer serves one client at a time).
bench_users drives USERS closed-loop users; printed per arm: generated tokens/s, mean and min..max
over legs, and the ratio of each pyllama arm to llama-server's with the per-leg spread.

--trace DIR: pyllama's servers write traces there, and each pyllama arm's line gets busy shares
over the load: the peer's, from pyllama's own spans (the ggml peer writes no trace: each graph
counts from its GRAPH_COMPUTE or GRAPH_RECOMPUTE to the reply of the read that follows it, which
waits for it) and the server's local compute (`sched` splits on the CPU), both as the share of
the loaded time they cover; llama-server's stages have no trace.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_users import run_bench  # noqa: E402
from peers import Peers  # noqa: E402
from pipeline_cells import GgmlRpcPeer, LlamaServer, ctx_for, llama_args, model_path  # noqa: E402
from server_util import ServerProcess  # noqa: E402


def _covered(spans: list[tuple[int, int]]) -> int:
    """Microseconds covered by the union of the spans."""
    total, end = 0, None
    for t0, t1 in sorted(spans):
        if end is None or t0 > end:
            total += t1 - t0
            end = t1
        elif t1 > end:
            total += t1 - end
            end = t1
    return total


def busy_shares(path: str) -> tuple[float, float]:
    """(peer, server CPU) busy shares over a pyllama server's trace of a leg: the peer from each
    graph sent to it to the reply of the read after it; the CPU from its `sched` splits. The
    loaded time runs from the first decode step to the last."""
    import json  # noqa: PLC0415
    peer, cpu, steps = [], [], []
    sent: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            c, n = e.get("c"), e.get("n")
            if c == "ctx" and n == "decode":
                steps.append((e["t0"], e["t1"]))
            elif c == "sched" and n == "split" and e.get("backend") == "CPU":
                cpu.append((e["t0"], e["t1"]))
            elif c == "rpc.client" and e.get("peer") == "ggml":
                if n in ("GRAPH_COMPUTE", "GRAPH_RECOMPUTE"):
                    sent[e["tid"]] = e["t0"]
                elif n == "GET_TENSOR" and e["tid"] in sent:
                    peer.append((sent.pop(e["tid"]), e["t1"]))
    steps.sort()
    while len(steps) > 1 and steps[1][0] - steps[0][1] > 500_000:   # the warm-up, long before the load
        steps.pop(0)
    if len(steps) < 2:
        return 0.0, 0.0
    t0, t1 = steps[0][0], max(t for _, t in steps)

    def within(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(max(a, t0), min(b, t1)) for a, b in spans if b > t0 and a < t1]
    return _covered(within(peer)) / (t1 - t0), _covered(within(cpu)) / (t1 - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default=os.environ.get("PYLLAMA_PEERS"))
    ap.add_argument("--model")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--type", default="q4_k_m")
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--groups", default="1,2")
    ap.add_argument("--legs", type=int, default=3)
    ap.add_argument("-r", "--requests", type=int, default=3)
    ap.add_argument("--npp", type=int, default=64)
    ap.add_argument("--ntg", type=int, default=32)
    ap.add_argument("--ngl", type=int, default=0, help="llama.cpp's count (0: half the blocks + 1)")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--llama-args", default="", help="more llama-server arguments, e.g. '--kv-unified'")
    ap.add_argument("--trace", metavar="DIR", help="pyllama's servers trace there; busy shares are printed")
    a = ap.parse_args()
    peers = Peers.find(a.peers) if a.peers else None
    if peers is None:
        raise SystemExit("--peers DIR with llama.cpp's programs is needed")
    model = a.model or model_path(a.preset, a.type)
    from pyllama.models.gguf_file import read_metadata  # noqa: PLC0415
    meta = read_metadata(model)
    n_layer = int(meta[f"{meta['general.architecture']}.block_count"])
    ngl = a.ngl or n_layer // 2 + 1
    groups = [int(g) for g in a.groups.split(",") if g]
    arms = ["llama.cpp"] + [f"pyllama {g} group{'s' if g > 1 else ''}" for g in groups]
    got: dict[str, list[float]] = {arm: [] for arm in arms}
    busy: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
    if a.trace:
        os.makedirs(a.trace, exist_ok=True)
    peer = GgmlRpcPeer(peers, a.threads)
    try:
        for leg in range(1, a.legs + 1):
            for arm in arms:
                if arm == "llama.cpp":
                    args = llama_args(a.users, a.npp, a.ntg, a.threads, peer.endpoint, ngl) + a.llama_args.split()
                    srv = LlamaServer(peers, model, args, 600)
                else:
                    g = int(arm.split()[1])
                    np_ = -(-a.users // g) * g
                    extra = ["--pipeline-groups", str(g)] if g > 1 else []
                    trace_path = os.path.join(a.trace, f"{g}g-leg{leg}.jsonl") if a.trace else None
                    if trace_path:
                        extra += ["--trace", trace_path]
                    srv = ServerProcess(model, "--rpc", peer.endpoint, "-ngl", str(ngl), "-t", str(a.threads),
                                        "-np", str(np_), "-c", str(ctx_for(np_, a.npp, a.ntg)), *extra).wait_ready(600)
                try:
                    rep = run_bench(srv.url, a.users, a.requests, a.npp, a.ntg)
                finally:
                    srv.stop()
                got[arm].append(rep["gen_tok_s"])
                if arm != "llama.cpp" and a.trace:
                    busy[arm].append(busy_shares(trace_path))
                print(f"[leg {leg}] {arm}: {rep['gen_tok_s']:.1f} tok/s, errors {rep.get('errors', 0)}", flush=True)
    finally:
        peer.stop()
    print(f"\n{os.path.basename(model)}, -ngl {ngl} ({min(ngl - 1, n_layer)} of {n_layer} blocks and the output "
          f"layer) on ggml-rpc-server -t {a.threads}, "
          f"{a.users} users, npp {a.npp}, ntg {a.ntg}, -r {a.requests}, {a.legs} legs")
    base = got["llama.cpp"]
    for arm in arms:
        v = got[arm]
        line = f"  {arm:18s} {statistics.fmean(v):7.1f} tok/s [{min(v):.1f}..{max(v):.1f}]"
        if arm != "llama.cpp":
            per = [x / y for x, y in zip(v, base)]
            line += f"  {statistics.fmean(v) / statistics.fmean(base):.2f}x llama.cpp [{min(per):.2f}..{max(per):.2f}]"
            if busy[arm]:
                line += (f"  busy: peer {statistics.fmean(b[0] for b in busy[arm]):.0%}, "
                         f"server CPU {statistics.fmean(b[1] for b in busy[arm]):.0%}")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
