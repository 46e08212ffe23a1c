"""Multi-turn conversations over fewer slots: the prompt cache in host memory (`--cache-ram`).

    python bench/prompt_cache.py [--model PATH | --preset medium --type q4_k_m] [--conversations 8]
        [--turns 4] [-np 2] [--system 256] [--turn-tokens 64] [--ntg 16] [-t 1] [--legs 2]
        [--peers DIR] [--json OUT]

C conversations share a system prompt of --system tokens; turn k of a conversation is that
prompt, then its user turns 0..k (--turn-tokens ids each, seeded), then the reply it asked for
(greedy, --ntg tokens). One client sends the turns conversation after conversation, so with fewer
slots (-np) than conversations each slot gives its conversation up before it returns: without a
prompt cache the whole history is computed again, with one it is loaded back.

Arms, interleaved leg by leg, each a fresh server on the same GGUF file: pyllama with
`--cache-ram 0` and with its default (8192 MiB), and with --peers llama.cpp's llama-server the same
two. Per arm: wall time of all turns, prompt tokens the server computed (`timings.prompt_n`) and
reused (`timings.cache_n`), and the mean and p90 of `timings.prompt_ms` over turns after the first
round (the rounds a cache can serve). Servers bind 127.0.0.1 on free ports and are stopped here.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from peers import Peers  # noqa: E402
from pipeline_cells import LlamaServer, add_server_bench_options, model_and_vocab  # noqa: E402
from server_util import ServerProcess  # noqa: E402


def conversation_turns(n_conv: int, n_turns: int, system: int, turn: int, vocab: int, seed: int) -> list[list[list[int]]]:
    """turns[c][k]: the user tokens of conversation c's turn k (the system prompt is turns' prefix)."""
    rng = random.Random(seed)
    return [[[rng.randrange(3, vocab) for _ in range(turn)] for _ in range(n_turns)] for _ in range(n_conv)]


def run_arm(url: str, system: list[int], turns: list[list[list[int]]], ntg: int) -> dict:
    host, port = url.rsplit("/", 1)[-1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    history = [list(system) for _ in turns]
    per_turn = []
    t0 = time.perf_counter()
    for k in range(len(turns[0])):
        for c, conv in enumerate(turns):
            history[c] += conv[k]
            body = {"prompt": history[c], "n_predict": ntg, "temperature": 0, "cache_prompt": True,
                    "return_tokens": True}
            conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
            reply = json.loads(data)
            t = reply["timings"]
            per_turn.append({"round": k, "conv": c, "prompt_n": t["prompt_n"], "cache_n": t.get("cache_n", 0),
                             "prompt_ms": t["prompt_ms"], "n_history": len(history[c])})
            history[c] += reply.get("tokens") or []
    wall = time.perf_counter() - t0
    conn.close()
    later = sorted(p["prompt_ms"] for p in per_turn if p["round"] > 0)
    return {"wall_s": wall, "prompt_n": sum(p["prompt_n"] for p in per_turn),
            "cache_n": sum(p["cache_n"] for p in per_turn),
            "prompt_ms_mean": statistics.mean(later) if later else 0.0,
            "prompt_ms_p90": later[int(0.9 * (len(later) - 1))] if later else 0.0, "turns": per_turn}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_bench_options(ap, legs=2)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("-np", "--parallel", type=int, default=2)
    ap.add_argument("--system", type=int, default=256)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--ntg", type=int, default=16)
    args = ap.parse_args()
    path, vocab = model_and_vocab(args)
    rng = random.Random(args.seed)
    system = [1] + [rng.randrange(3, vocab) for _ in range(args.system - 1)]
    turns = conversation_turns(args.conversations, args.turns, args.system, args.turn_tokens, vocab, args.seed + 1)
    longest = args.system + args.turns * (args.turn_tokens + args.ntg) + 16
    ctx = args.parallel * (-(-longest // 256) * 256)
    common = ["-np", str(args.parallel), "-c", str(ctx), "-t", str(args.threads)]
    arms = [("pyllama --cache-ram 0", "pyllama", ["--cache-ram", "0"]), ("pyllama (default)", "pyllama", [])]
    peers = Peers.find(args.peers)
    if peers is not None:
        arms += [("llama-server --cache-ram 0", "llama", ["--cache-ram", "0"]), ("llama-server (default)", "llama", [])]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in arms}
    print(f"# {os.path.basename(path)}: {args.conversations} conversations x {args.turns} turns over -np "
          f"{args.parallel}, system {args.system}, turns of {args.turn_tokens} tokens, replies {args.ntg}, -t "
          f"{args.threads}, {args.legs} legs", flush=True)
    try:
        for leg in range(args.legs):
            for name, kind, extra in arms:
                if kind == "pyllama":
                    server = ServerProcess(path, *common, *extra).wait_ready(300)
                else:
                    server = LlamaServer(peers, path, [*common, *extra], 300)
                try:
                    r = run_arm(server.url, system, turns, args.ntg)
                finally:
                    server.stop()
                results[name].append(r)
                print(f"leg {leg + 1} {name}: {r['wall_s']:.2f} s, computed {r['prompt_n']}, reused {r['cache_n']}, "
                      f"prompt_ms after round 1 mean {r['prompt_ms_mean']:.1f} p90 {r['prompt_ms_p90']:.1f}", flush=True)
    finally:
        if peers is not None:
            peers.close()
    print("\narm | wall s mean [min..max] | prompt tokens computed | reused | prompt ms (rounds 2+) mean | p90")
    base = statistics.mean(r["wall_s"] for r in results[arms[0][0]])
    for name, _, _ in arms:
        rs = results[name]
        walls = [r["wall_s"] for r in rs]
        print(f"{name} | {statistics.mean(walls):.2f} [{min(walls):.2f}..{max(walls):.2f}] ({base / statistics.mean(walls):.2f}x "
              f"the first arm's speed) | {rs[0]['prompt_n']} | {rs[0]['cache_n']} | "
              f"{statistics.mean(r['prompt_ms_mean'] for r in rs):.1f} | {statistics.mean(r['prompt_ms_p90'] for r in rs):.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
