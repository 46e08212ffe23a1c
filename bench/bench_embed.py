"""Embeddings and reranking of a BERT model: pyllama's vectors and scores against llama.cpp's, and
the throughput of both on the same file.

    python bench/bench_embed.py [--peers DIR] [--arch bert|nomic-bert|jina-bert-v2] [--preset small] [--inputs 32]
                                [--rounds 5] [-t 2] [--ub 512] [--json OUT]

Two files are made with pyllama.models.make under bench/out/models: `--arch bert` (mean pooling) and
`--arch bert --rerank-head` (rank pooling); likewise for `--arch jina-bert-v2`; with `--arch nomic-bert`
the first alone (llama.cpp reads no reranker's head for it). Each is served by pyllama's server (`--embedding`, and
`--rerank` for the reranker) and, with `--peers`, by llama.cpp's llama-server with the same flags.
Printed: per input the cosine of pyllama's /v1/embeddings vector with llama.cpp's (the smallest
over the inputs, and the largest absolute difference of the normalized values), the largest
absolute difference of the /v1/rerank scores, and the throughput of one /v1/embeddings request of
`--inputs` texts (inputs per second, the best of `--rounds`, both servers side by side in this
run) with pyllama's over llama.cpp's. Without `--peers` only pyllama's figures are printed.
Exits 1 when a cosine is below 1 - 1e-4.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from peers import Peers  # noqa: E402
from pipeline_cells import LlamaServer  # noqa: E402
from server_util import ServerProcess  # noqa: E402
from slot_restore import post  # noqa: E402

WORDS = ("the", "cat", "sat", "on", "mat", "what", "is", "capital", "of", "france", "paris", "river", "city",
         "weather", "today", "hello", "world", "dog", "and", "where", "how", "this", "that", "with")
COS_TOL = 1e-4


def texts(n: int, seed: int = 0) -> list[str]:
    """n sentences of 6 to 40 words from the test vocabulary's whole words, deterministic."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 41)))) + "." for _ in range(n)]


def make(arch: str, preset: str, rerank: bool) -> str:
    from pyllama.models.make import FamilyOptions, make_model  # noqa: PLC0415
    folder = os.path.join(HERE, "out", "models")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{arch}-{preset}{'-rerank' if rerank else ''}.gguf")
    if not os.path.exists(path):
        make_model(preset, path, arch=arch, opts=FamilyOptions(rerank_head=rerank))
    return path


def vectors(url: str, inputs: list[str]) -> np.ndarray:
    data = post(url, "/v1/embeddings", {"input": inputs})["data"]
    return np.asarray([d["embedding"] for d in sorted(data, key=lambda d: d["index"])], dtype=np.float64)


def scores(url: str, query: str, docs: list[str]) -> np.ndarray:
    res = post(url, "/v1/rerank", {"query": query, "documents": docs})["results"]
    out = np.zeros(len(docs))
    for r in res:
        out[r["index"]] = r["relevance_score"]
    return out


def throughput(url: str, inputs: list[str], rounds: int) -> float:
    """Inputs per second of one request carrying all of them, the best of `rounds`."""
    post(url, "/v1/embeddings", {"input": inputs[:2]})  # warm
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        post(url, "/v1/embeddings", {"input": inputs})
        best = min(best, time.perf_counter() - t0)
    return len(inputs) / best


def run(args: argparse.Namespace, peers: Any) -> dict:
    flags = ["-t", str(args.threads), "-c", str(args.ctx), "-np", str(args.parallel), "-b", str(args.ub),
             "-ub", str(args.ub)]
    inputs = texts(args.inputs)
    query, docs = "what is the capital of france", texts(8, seed=1)
    out: dict = {"arch": args.arch, "preset": args.preset, "inputs": args.inputs, "threads": args.threads}
    sides: dict[str, dict] = {}
    for side in ("pyllama", "llama.cpp") if peers is not None else ("pyllama",):
        got: dict = {}
        for rerank in (False, True) if args.arch != "nomic-bert" else (False,):
            path = make(args.arch, args.preset, rerank)
            mode = ["--rerank"] if rerank else ["--embedding"]
            srv = (ServerProcess(path, *flags, *mode).wait_ready(300) if side == "pyllama"
                   else LlamaServer(peers, path, [*flags, *mode], 300))
            try:
                if rerank:
                    got["scores"] = scores(srv.url, query, docs)
                else:
                    got["vectors"] = vectors(srv.url, inputs)
                    got["per_s"] = throughput(srv.url, inputs, args.rounds)
            finally:
                srv.stop()
        sides[side] = got
    py = sides["pyllama"]
    out["pyllama_inputs_per_s"] = round(py["per_s"], 2)
    print(f"{args.arch} {args.preset}: {args.inputs} inputs of 6-40 words, -t {args.threads}")
    print(f"pyllama    /v1/embeddings {py['per_s']:8.1f} inputs/s")
    if peers is None:
        return out
    cpp = sides["llama.cpp"]
    a, b = py["vectors"], cpp["vectors"]
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    out.update(min_cosine=float(cos.min()), max_abs_diff=float(np.abs(a - b).max()),
               llama_cpp_inputs_per_s=round(cpp["per_s"], 2), ratio=round(py["per_s"] / cpp["per_s"], 3))
    print(f"llama.cpp  /v1/embeddings {cpp['per_s']:8.1f} inputs/s   pyllama / llama.cpp {out['ratio']:.3f}")
    print(f"vectors: min cosine {cos.min():.9f} (1 - cos {1 - cos.min():.2e}, target <= {COS_TOL:g}), "
          f"max |diff| {out['max_abs_diff']:.2e}")
    if "scores" in py:
        out["rerank_max_abs_diff"] = float(np.abs(py["scores"] - cpp["scores"]).max())
        print(f"rerank:  {len(docs)} scores, max |diff| {out['rerank_max_abs_diff']:.2e} "
              f"(pyllama {np.round(py['scores'], 5).tolist()})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", help="llama.cpp's folder (bin/llama-server)")
    ap.add_argument("--arch", default="bert", choices=["bert", "nomic-bert", "jina-bert-v2"])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--ub", type=int, default=512, help="-b and -ub of both servers (a whole input per micro-batch)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    peers = Peers.find(args.peers) if args.peers else None
    if args.peers and peers is None:
        print(f"bench_embed: no llama.cpp programs under {args.peers}/bin", file=sys.stderr)
        return 2
    try:
        out = run(args, peers)
    finally:
        if peers is not None:
            peers.close()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 1 if out.get("min_cosine", 1.0) < 1 - COS_TOL else 0


if __name__ == "__main__":
    sys.exit(main())
