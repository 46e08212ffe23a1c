"""Speculative decoding side by side: pyllama's server and llama-server (with --peers), each with
and without drafts, on the same GGUF file, the same prompts and the same flags.

    python bench/bench_spec.py [--model PATH | --preset medium --type f32] [--users 1,32] [--legs 3]
        [--n-predict 128] [-r 2] [-t 1] [--split] [--spec 'ARGS' | --draft q4_0 [--spec 'ARGS']]
        [--peers DIR]

Arms, interleaved leg by leg (each leg starts every arm's server afresh): `pyllama` and
`pyllama spec` (the --spec arguments, default `--spec-type ngram-mod` with llama-server's
defaults; with --draft TYPE, `-md` the target quantized to TYPE by llama.cpp's llama-quantize,
then --spec's arguments, default none), and with --peers `llama-server` and `llama-server spec`
with the same arguments. --type other than f32 is the f32 model quantized by llama-quantize too
(with --peers; else pyllama's own quantizer). --split
runs pyllama as `--rpc EP --device RPC0,CPU` over `python -m pyllama.rpc_server -t T`, and
llama-server as `--rpc EP -ngl N/2+1` over llama.cpp's `ggml-rpc-server -t T` (half the blocks
and the output layer on the peer on both sides).

The prompts are code with edits: a module of similar functions, each request asking for one
more, so an n-gram draft finds what it needs in the prompt; every user sends its own variant
(`-r` requests each, greedy, --n-predict tokens, ignore_eos). Per arm and user count: generated
tokens/s (all users' tokens over the leg's wall time; mean over legs and min..max), the draft
acceptance (accepted / drafted, from each response's timings), and for each server its spec arm
over its plain arm. llama-server answers some requests against random-weight models with HTTP
500; only completed requests count, and the errors are printed.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import statistics
import sys
import threading
import time
import urllib.parse
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from compare_logits import quantized  # noqa: E402
from peers import Peers  # noqa: E402
from pipeline_cells import GgmlRpcPeer, LlamaServer, model_path  # noqa: E402
from server_util import RPCServerProcess, ServerProcess  # noqa: E402

TEMPLATE = '''def {name}_{i}(values, scale={i}):
    """Return the {name} of values, scaled by {i}."""
    total = 0
    for value in values:
        total = total + value * scale
    return total

'''


def prompt_for(user: int, request: int) -> str:
    body = "".join(TEMPLATE.format(name=name, i=i) for i, name in enumerate(("sum", "mean", "peak"), 1))
    return f"# module {user}.{request}: helpers\n\n{body}def tail_{user}_{request}(values, scale=5):\n"


def http_json(url: str, body: dict, timeout: float) -> tuple[int, object]:
    """POSTs JSON; (status, the decoded reply, or its text when it is not JSON)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", parts.path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, data.decode(errors="replace")
    finally:
        conn.close()


def run_leg(url: str, users: int, requests: int, n_predict: int) -> dict:
    """users closed-loop clients; returns tokens, wall seconds, drafted, accepted, errors."""
    lock = threading.Lock()
    tot = {"tokens": 0, "drafted": 0, "accepted": 0, "errors": 0, "last_error": ""}

    def user(u: int) -> None:
        for r in range(requests):
            status, doc = http_json(url + "/completion", {"prompt": prompt_for(u, r), "n_predict": n_predict,
                                                          "temperature": 0, "ignore_eos": True}, timeout=600)
            with lock:
                if status != 200:
                    tot["errors"] += 1
                    tot["last_error"] = str(doc)[:200]
                    continue
                assert isinstance(doc, dict)
                t = doc.get("timings", {})
                tot["tokens"] += int(doc.get("tokens_predicted", t.get("predicted_n", 0)))
                tot["drafted"] += int(t.get("draft_n", 0))
                tot["accepted"] += int(t.get("draft_n_accepted", 0))

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tot["wall"] = time.perf_counter() - t0
    return tot


class Arm:
    def __init__(self, name: str, start) -> None:
        self.name = name
        self.start = start  # (users) -> server with .url and .stop()
        self.legs: dict[int, list[dict]] = {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a GGUF file (default: bench/out/models/PRESET-TYPE.gguf, made once)")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--type", default="f32", help="weight type of the made model")
    ap.add_argument("--users", default="1,32")
    ap.add_argument("--legs", type=int, default=3)
    ap.add_argument("-r", "--requests", type=int, default=2, help="requests per user and leg")
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=1, help="threads of each process")
    ap.add_argument("--split", action="store_true", help="split over a local rpc server (see the module help)")
    ap.add_argument("--spec", default=None,
                    help="the spec arms' arguments (both servers; default --spec-type ngram-mod, none with --draft)")
    ap.add_argument("--draft", help="a draft model: the target's f32 quantized to this type (-md)")
    ap.add_argument("--peers", help="llama.cpp's folder (bin/llama-server, bin/ggml-rpc-server)")
    ap.add_argument("--ready-timeout", type=float, default=300)
    args = ap.parse_args()
    peers = Peers.find(args.peers)
    if args.model:
        model = args.model
    elif args.type == "f32":
        model = model_path(args.preset, "f32")
    else:
        model = quantized(peers, model_path(args.preset, "f32"), args.type, args.preset)
    users = [int(u) for u in args.users.split(",")]
    spec = shlex.split(args.spec if args.spec is not None else "" if args.draft else "--spec-type ngram-mod")
    if args.draft:
        spec = ["-md", quantized(peers, model_path(args.preset, "f32"), args.draft, args.preset),
                "--spec-type", "draft-simple", *spec]
        args.spec = " ".join(spec)
    n_slots = max(users)
    ctx = n_slots * (400 + args.n_predict + 64)
    common = ["-c", str(ctx), "-np", str(n_slots), "-t", str(args.threads), "-tb", str(args.threads)]

    py_peer: Optional[RPCServerProcess] = None
    ggml_peer: Optional[GgmlRpcPeer] = None
    py_split: list[str] = []
    llama_split: list[str] = []
    if args.split:
        py_peer = RPCServerProcess("-t", str(args.threads))
        py_split = ["--rpc", py_peer.endpoint, "--device", "RPC0,CPU", "-ts", "1,1"]
        if peers is not None:
            from pyllama.models.gguf_file import read_metadata  # noqa: PLC0415
            meta = read_metadata(model)
            n_layer = int(meta[f"{meta['general.architecture']}.block_count"])
            ggml_peer = GgmlRpcPeer(peers, args.threads)
            llama_split = ["--rpc", ggml_peer.endpoint, "-ngl", str(n_layer // 2 + 1)]
    arms = [Arm("pyllama", lambda: ServerProcess(model, *common, *py_split).wait_ready(args.ready_timeout)),
            Arm("pyllama spec", lambda: ServerProcess(model, *common, *py_split, *spec).wait_ready(args.ready_timeout))]
    if peers is not None:
        arms += [Arm("llama-server", lambda: LlamaServer(peers, model, [*common, *llama_split], args.ready_timeout)),
                 Arm("llama-server spec", lambda: LlamaServer(peers, model, [*common, *llama_split, *spec],
                                                              args.ready_timeout))]
    print(f"model {model}; {'split RPC0,CPU' if args.split else 'unsplit'}, {args.threads} thread(s) per process; "
          f"spec arms: {args.spec}; {args.requests} requests per user and leg, {args.n_predict} tokens each")
    try:
        for u in users:
            for leg in range(args.legs):
                for arm in arms:
                    srv = arm.start()
                    try:
                        run_leg(srv.url, 1, 1, 8)  # warm-up
                        res = run_leg(srv.url, u, args.requests, args.n_predict)
                    finally:
                        srv.stop()
                    arm.legs.setdefault(u, []).append(res)
                    print(f"  users {u} leg {leg + 1} {arm.name}: {res['tokens'] / res['wall']:.1f} tok/s"
                          + (f", {res['errors']} errors ({res['last_error']})" if res["errors"] else ""), flush=True)
    finally:
        if py_peer is not None:
            py_peer.stop()
        if ggml_peer is not None:
            ggml_peer.stop()

    print()
    print(f"{'arm':<20} {'users':>5} {'tok/s mean':>10} {'min..max':>16} {'accepted':>14} {'errors':>6}")
    rates: dict[tuple[str, int], list[float]] = {}
    for arm in arms:
        for u, legs in arm.legs.items():
            r = [x["tokens"] / x["wall"] for x in legs]
            rates[(arm.name, u)] = r
            drafted = sum(x["drafted"] for x in legs)
            acc = sum(x["accepted"] for x in legs)
            acc_s = f"{acc}/{drafted} {acc / drafted:.0%}" if drafted else "-"
            print(f"{arm.name:<20} {u:>5} {statistics.mean(r):>10.1f} {min(r):>7.1f}..{max(r):<7.1f} {acc_s:>14} "
                  f"{sum(x['errors'] for x in legs):>6}")
    print()
    for server in ("pyllama", "llama-server"):
        for u in users:
            if (server, u) not in rates:
                continue
            base, with_spec = rates[(server, u)], rates[(server + " spec", u)]
            if not min(base) or not min(with_spec):
                print(f"{server} at {u} users: a leg completed no request (see the errors)")
                continue
            per_leg = [a / b for a, b in zip(with_spec, base)]
            print(f"{server} spec / {server} at {u} users: {statistics.mean(with_spec) / statistics.mean(base):.2f}x "
                  f"(per leg {min(per_leg):.2f}..{max(per_leg):.2f})")
    if peers is not None:
        for u in users:
            py = statistics.mean(rates[("pyllama spec", u)])
            ll = statistics.mean(rates[("llama-server spec", u)])
            if ll:
                print(f"pyllama spec / llama-server spec at {u} users: {py / ll:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
