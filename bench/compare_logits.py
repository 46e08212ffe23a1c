"""Top logprobs of pyllama's quantized products against llama.cpp's, type by type.

    python bench/compare_logits.py [--peers DIR] [--types q4_0,q8_0,...] [--preset medium] [--steps 2]
                                   [--top 10] [-t 2] [--json OUT]

The reference model (pyllama.models.make, f32, under bench/out/models) is quantized to each type with
llama.cpp's llama-quantize (`--peers`; `*_pure` types use --pure, `*_q8out` keep Q8_0 output and
embeddings so that only the named type's products differ); without `--peers` pyllama's own
quantizer writes the (pure) files instead. Each file is served by pyllama's server on its repacked
path (the default) and its file-layout path (--no-repack), and with `--peers` by llama-server
--no-repack, all with `-ctk f32 -ctv f32 -fa off` and greedy sampling. For every prompt the first
`--steps` steps' top `--top` logprobs are compared by token id; a step is compared only while the
sides chose the same tokens before it. Printed per type: the largest absolute difference of the
compared logprobs, pyllama repacked and file layout each against llama.cpp (or against each other
without peers), and `!` where it is over --tol (1e-3); then per prompt (p0 is the BOS token alone,
one row: the weight types' arithmetic without prompt-sized attention) repacked / file layout.

Servers are started on free loopback ports and stopped by this script.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from peers import Peers  # noqa: E402
from pipeline_cells import LlamaServer, model_path  # noqa: E402
from server_util import ServerProcess  # noqa: E402
from slot_restore import post  # noqa: E402

# None: the BOS token alone, a first step of one row (the products, norms and FFN, attention over
# one cell), which isolates the weight types' arithmetic from the prompt-sized attention
PROMPTS = (None, "Hello, my name is", "Q: What is 2+2?\nA:",
           "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there lived")
# llama-quantize's name of each type (a suffix: _pure = --pure, _q8out = Q8_0 output and embeddings)
TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_m", "q4_k_m", "q5_k_m", "q6_k",
         "q4_0_pure", "q4_1_pure", "q5_0_pure", "q5_1_pure", "q2_k_pure", "q3_k_pure", "q4_k_pure", "q5_k_pure",
         "q6_k_pure", "iq4_nl", "iq4_xs", "iq4_nl_pure", "iq4_xs_pure", "mxfp4_moe_pure", "f32", "f16", "bf16")
SERVER_FLAGS = ("-ctk", "f32", "-ctv", "f32", "-fa", "off", "-c", "512", "-np", "1")
# pyllama's own quantizer's names for the pure files it writes without peers
_OWN = {"q8_0": "q8_0", "q4_0": "q4_0", "q4_1": "q4_1", "q5_0": "q5_0", "q5_1": "q5_1", "q2_k": "q2_k",
        "q3_k": "q3_k", "q4_k": "q4_k", "q5_k": "q5_k", "q6_k": "q6_k", "q4_k_m": "q4_k_m", "q5_k_m": "q5_k_m",
        "iq4_nl": "iq4_nl_mix", "iq4_xs": "iq4_xs_mix", "mxfp4_moe": "mxfp4"}


def quantized(peers: Optional[Peers], src: str, qtype: str, preset: str) -> str:
    """The reference model as `qtype`, made once under bench/out/models."""
    out = os.path.join(HERE, "out", "models")
    path = os.path.join(out, f"{preset}-{qtype}-{'lq' if peers else 'own'}.gguf")
    if os.path.exists(path):
        return path
    base, pure, q8out = qtype, False, False
    for suffix in ("_pure", "_q8out"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            pure, q8out = pure or suffix == "_pure", q8out or suffix == "_q8out"
    tmp = path + f".{os.getpid()}.tmp"
    try:
        if peers is None:
            own = _OWN.get(base)
            if own is None:
                raise SystemExit(f"compare_logits: {qtype} needs llama-quantize (--peers)")
            return model_path(preset, own)
        args = ["--pure"] if pure else []
        if q8out:
            args += ["--output-tensor-type", "q8_0", "--token-embedding-type", "q8_0"]
        peers.run("llama-quantize", *args, src, tmp, base.upper(), timeout=600)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def steps_of(url: str, prompt, n_steps: int, top: int) -> list[tuple[int, dict[int, float]]]:
    """[(chosen token, {token id: logprob of the top `top`})] for the first n_steps greedy steps
    (prompt: text, or a list of token ids)."""
    r = post(url, "/completion", {"prompt": prompt, "n_predict": n_steps, "n_probs": top, "temperature": 0,
                                  "cache_prompt": False, "seed": 0}, timeout=300)
    steps = []
    for p in r.get("completion_probabilities", []):
        steps.append((p["id"], {t["id"]: t["logprob"] for t in p["top_logprobs"]}))
    return steps


def diff(a: list, b: list) -> tuple[float, int, str]:
    """(largest |logprob difference| over the compared steps, steps compared, note)."""
    worst, n = 0.0, 0
    for (ta, pa), (tb, pb) in zip(a, b):
        common = set(pa) & set(pb)
        if not common:
            return math.inf, n, "no common tokens"
        worst = max(worst, max(abs(pa[t] - pb[t]) for t in common))
        n += 1
        if ta != tb:
            return worst, n, f"chose {ta} / {tb}"
    return worst, n, ""


def run_side(server, prompts, n_steps: int, top: int) -> list:
    try:
        return [steps_of(server.url, p, n_steps, top) for p in prompts]
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", help="llama.cpp's folder (bin/llama-server, bin/llama-quantize)")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--json")
    args = ap.parse_args()
    peers = Peers.find(args.peers) if args.peers else None
    if args.peers and peers is None:
        print(f"compare_logits: no llama.cpp programs under {args.peers}/bin", file=sys.stderr)
        return 2
    src = model_path(args.preset, "f32")
    from pyllama.models.gguf_file import read_metadata  # noqa: PLC0415
    bos = int(read_metadata(src).get("tokenizer.ggml.bos_token_id", 1))
    prompts = [[bos] if p is None else p for p in PROMPTS[: args.prompts]]
    rows, over = [], False
    try:
        for qtype in [t for t in args.types.split(",") if t]:
            path = quantized(peers, src, qtype, args.preset)
            flags = [*SERVER_FLAGS, "-t", str(args.threads)]
            repacked = run_side(ServerProcess(path, *flags).wait_ready(300), prompts, args.steps, args.top)
            layout = run_side(ServerProcess(path, *flags, "--no-repack").wait_ready(300), prompts, args.steps,
                              args.top)
            ref = layout
            if peers is not None:
                ref = run_side(LlamaServer(peers, path, [*flags, "--no-repack"], 300), prompts, args.steps, args.top)
            row = {"type": qtype, "prompts": []}
            for i, p in enumerate(prompts):
                d_rep = diff(repacked[i], ref[i])
                d_lay = diff(layout[i], ref[i]) if peers is not None else (0.0, len(layout[i]), "")
                row["prompts"].append({"prompt": p if isinstance(p, str) else f"tokens {p}", "repacked": d_rep[0], "repacked_steps": d_rep[1],
                                       "repacked_note": d_rep[2], "layout": d_lay[0], "layout_steps": d_lay[1],
                                       "layout_note": d_lay[2]})
            row["repacked"] = max(q["repacked"] for q in row["prompts"])
            row["layout"] = max(q["layout"] for q in row["prompts"])
            over |= row["repacked"] > args.tol or row["layout"] > args.tol
            rows.append(row)
            what = "llama.cpp --no-repack" if peers else "pyllama --no-repack"
            cells = "  ".join(f"p{i}: {q['repacked']:.2e}/{q['layout']:.2e}"
                              + (f" ({q['repacked_note'] or q['layout_note']})" if q['repacked_note'] or q['layout_note']
                                 else "") for i, q in enumerate(row["prompts"]))
            flag = lambda v: "!" if v > args.tol else " "  # noqa: E731
            print(f"{qtype:12s} repacked {row['repacked']:.2e}{flag(row['repacked'])} layout {row['layout']:.2e}"
                  f"{flag(row['layout'])} vs {what}   [{cells}]", flush=True)
    finally:
        if peers is not None:
            peers.close()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
