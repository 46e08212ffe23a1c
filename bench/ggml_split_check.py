"""pyllama's split over llama.cpp's rpc-server against llama-server's own split over it (needs --peers).

    python bench/ggml_split_check.py --peers DIR [--preset medium] [--arch llama|qwen2moe|...]
                                     [--types f32,q8_0,q4_k_m] [--ngl N] [--steps 16] [--margin 0.05]
                                     [--n-peers 1|2] [--pyllama-args="--pipeline-groups 2"]
                                     [--both-args="-ctk q8_0 -ctv q8_0"]

For each weight type (the f32 reference model, quantized by llama.cpp's llama-quantize), one
`ggml-rpc-server -t 1` serves in turn: llama-server `--rpc EP -ngl N` and pyllama's server with the
same `--rpc EP -ngl N` (the output layer and the last N-1 blocks on the peer, llama.cpp's count,
so both sides put the same layers there), each asked the same greedy prompts with the top-2
logprobs of every step. Printed per type and prompt: the steps whose chosen tokens agree, where
they first differ and llama.cpp's top-2 margin there (a margin under --margin is a near tie, where
either choice is right), and the largest difference of the compared top logprobs. pyllama unsplit
is asked too, for the same table. Exits 1 when a difference comes at a step with a clear margin.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from compare_logits import quantized, steps_of  # noqa: E402
from peers import Peers  # noqa: E402
from pipeline_cells import GgmlRpcPeer, LlamaServer, model_path  # noqa: E402
from server_util import ServerProcess  # noqa: E402

PROMPTS = ("Hello, my name is", "The capital of France is", "Q: What is 2+2?\nA:", "Once upon a time")


def compare(ref: list, got: list, margin: float) -> tuple[int, str, float, bool]:
    """(steps agreeing, where they first differ, largest |logprob diff| on compared steps, tie):
    tie is True when the first difference comes where the reference's top-2 margin is a near tie."""
    worst, n = 0.0, 0
    for (ta, pa), (tb, pb) in zip(ref, got):
        common = set(pa) & set(pb)
        if common:
            worst = max(worst, max(abs(pa[t] - pb[t]) for t in common))
        if ta != tb:
            top = sorted(pa.values(), reverse=True)
            gap = top[0] - top[1] if len(top) > 1 else math.inf
            return n, f"step {n}: {ta} / {tb}, llama.cpp's top-2 margin {gap:.3f}", worst, gap < margin
        n += 1
    return n, "", worst, False


def arch_model(preset: str, arch: str) -> str:
    """bench/out/models/PRESET-ARCH-f32.gguf, made once. ARCH may name boolean FamilyOptions after
    a `+` each (phi3+longrope, qwen2+output_bias)."""
    from pyllama.models.make import FamilyOptions, make_model  # noqa: PLC0415
    name, *flags = arch.split("+")
    path = os.path.join(HERE, "out", "models", f"{preset}-{arch}-f32.gguf")
    if not os.path.exists(path):
        make_model(preset, path + ".tmp", wtype="f32", arch=name, opts=FamilyOptions(**{f: True for f in flags}))
        os.replace(path + ".tmp", path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default=os.environ.get("PYLLAMA_PEERS"))
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--arch", default="llama", help="the reference model's architecture (qwen2moe, qwen3moe, "
                    "mixtral: Mixture-of-Experts layers on the peer; phi3+longrope, qwen2+output_bias: "
                    "with those FamilyOptions)")
    ap.add_argument("--types", default="f32,q8_0,q4_k_m")
    ap.add_argument("--ngl", type=int, default=0, help="layers on the peer, llama.cpp's count (0: half the blocks + 1)")
    ap.add_argument("--n-peers", type=int, default=1, help="ggml-rpc-servers, the peer layers split evenly "
                    "over them (-ts 1,1 on both sides)")
    ap.add_argument("--pyllama-args", default="", help="more flags for pyllama's server only, e.g. "
                    "'--pipeline-groups 2' (then -np is the group count)")
    ap.add_argument("--both-args", default="", help="more flags for both servers (and the unsplit one), e.g. "
                    "'-ctk q8_0 -ctv q8_0'")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--unsplit", action="store_true", help="no peer: pyllama's server against llama-server, both "
                    "on this CPU (architectures the lowering lacks, deepseek2's latent attention)")
    a = ap.parse_args()
    peers = Peers.find(a.peers) if a.peers else None
    if peers is None:
        raise SystemExit("--peers DIR with llama.cpp's programs is needed")
    src = model_path(a.preset, "f32") if a.arch == "llama" else arch_model(a.preset, a.arch)
    tag = a.preset if a.arch == "llama" else f"{a.preset}-{a.arch}"
    from pyllama.models.gguf_file import read_metadata  # noqa: PLC0415
    meta = read_metadata(src)
    n_layer = int(meta[f"{meta['general.architecture']}.block_count"])
    ngl = a.ngl or n_layer // 2 + 1
    split = ["-ngl", str(ngl), "-t", "1", "-c", "1024"] + (["-ts", ",".join("1" * a.n_peers)] if a.n_peers > 1 else [])
    split += a.both_args.split()
    ours_extra = a.pyllama_args.split()
    groups = int(ours_extra[ours_extra.index("--pipeline-groups") + 1]) if "--pipeline-groups" in ours_extra else 1
    bad = False
    for qtype in [t for t in a.types.split(",") if t]:
        model = src if qtype == "f32" else quantized(peers, src, qtype, tag)
        if a.unsplit:
            bad |= unsplit_only(peers, model, qtype, a)
            continue
        fleet = [GgmlRpcPeer(peers, 1) for _ in range(a.n_peers)]
        rpc = ",".join(p.endpoint for p in fleet)
        try:
            llama = LlamaServer(peers, model, ["--rpc", rpc, "-np", "1", *split], 300)
            try:
                ref = [steps_of(llama.url, p, a.steps, 2) for p in PROMPTS]
            finally:
                llama.stop()       # the peer serves one client at a time
            ours = ServerProcess(model, "--rpc", rpc, "-np", str(groups), *split, *ours_extra).wait_ready(300)
            try:
                got = [steps_of(ours.url, p, a.steps, 2) for p in PROMPTS]
                log = ours.log_tail(40)
            finally:
                ours.stop()
        finally:
            for p in fleet:
                p.stop()
        plain = ServerProcess(model, "-t", "1", "-np", "1", "-c", "1024", *a.both_args.split()).wait_ready(300)
        try:
            unsplit = [steps_of(plain.url, p, a.steps, 2) for p in PROMPTS]
        finally:
            plain.stop()
        print(f"== {qtype} ({os.path.basename(model)}), -ngl {ngl} "
              f"({min(ngl - 1, n_layer)} of {n_layer} blocks and the output layer) on {a.n_peers} peer(s)"
              f"{' ' + a.pyllama_args if a.pyllama_args else ''}")
        if "llama.cpp rpc-server" not in log:
            print("   (pyllama's log does not name the peer as a llama.cpp rpc-server)")
        for p, r, g, u in zip(PROMPTS, ref, got, unsplit):
            n, where, worst, tie = compare(r, g, a.margin)
            nu, _, worst_u, _ = compare(r, u, a.margin)
            verdict = "ok" if not where or tie else "DIFFERS at a clear margin"
            bad |= bool(where) and not tie
            print(f"   {p!r}: split {n}/{len(r)} steps agree, max |dlogprob| {worst:.2e}; unsplit {nu}/{len(r)}, "
                  f"{worst_u:.2e}  {where}  {verdict}")
    return 1 if bad else 0


def unsplit_only(peers, model: str, qtype: str, a) -> bool:
    """pyllama unsplit against llama-server unsplit, the same flags; True where a difference comes
    at a clear margin."""
    flags = ["-t", "1", "-np", "1", "-c", "1024", *a.both_args.split()]
    llama = LlamaServer(peers, model, flags, 300)
    try:
        ref = [steps_of(llama.url, p, a.steps, 2) for p in PROMPTS]
    finally:
        llama.stop()
    ours = ServerProcess(model, *flags, *a.pyllama_args.split()).wait_ready(300)
    try:
        got = [steps_of(ours.url, p, a.steps, 2) for p in PROMPTS]
    finally:
        ours.stop()
    print(f"== {qtype} ({os.path.basename(model)}) unsplit, both on this CPU")
    bad = False
    for p, r, g in zip(PROMPTS, ref, got):
        n, where, worst, tie = compare(r, g, a.margin)
        bad |= bool(where) and not tie
        print(f"   {p!r}: {n}/{len(r)} steps agree, max |dlogprob| {worst:.2e}  {where}  "
              f"{'ok' if not where or tie else 'DIFFERS at a clear margin'}")
    return bad


if __name__ == "__main__":
    sys.exit(main())
