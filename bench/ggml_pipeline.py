"""Pipeline groups over llama.cpp's rpc-server: pyllama's server against llama-server, both split
over one `ggml-rpc-server` (needs --peers).

    python bench/ggml_pipeline.py --peers DIR [--model PATH | --preset medium --type q4_k_m]
        [--users 32] [--groups 1,2] [--legs 3] [-r 3] [--npp 64] [--ntg 32] [--ngl N] [-t 1]
        [--llama-args=--kv-unified]

One ggml-rpc-server (-t T) lives for the whole run. Arms, interleaved leg by leg: llama-server
`--rpc EP -ngl N` (it turns pipelining off with an RPC device), and pyllama's server with the same
`--rpc EP -ngl N` at each --groups value (`--pipeline-groups G`); every server runs -t T and
-np USERS and is stopped before the next starts (the peer serves one client at a time).
bench_users drives USERS closed-loop users; printed per arm: generated tokens/s, mean and min..max
over legs, and the ratio of each pyllama arm to llama-server's with the per-leg spread.
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
                    srv = ServerProcess(model, "--rpc", peer.endpoint, "-ngl", str(ngl), "-t", str(a.threads),
                                        "-np", str(np_), "-c", str(ctx_for(np_, a.npp, a.ntg)), *extra).wait_ready(600)
                try:
                    rep = run_bench(srv.url, a.users, a.requests, a.npp, a.ntg)
                finally:
                    srv.stop()
                got[arm].append(rep["gen_tok_s"])
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
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
