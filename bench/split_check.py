"""Split check: greedy output of a layer split over two local rpc servers equals the unsplit server.

    python bench/split_check.py [--model PATH | --preset tiny] [--prompts N] [--n-predict N] [--device RPC0,RPC1]

Starts two `pyllama.rpc_server` processes on the CPU backend and two `pyllama.server` processes,
one splitting the layers over the rpc servers (`--device`, default RPC0,RPC1) and one unsplit, sends
the same greedy prompts to both one at a time, and compares the generated text and token ids byte
for byte. Exits 1 when any request fails, any output differs or any count is short; prints how many
completions and bytes it compared. Every process it starts is stopped before it exits.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from server_util import RPCServerProcess, ServerProcess  # noqa: E402

PROMPTS = ["Once upon a time", "The capital of France is", "In a hole in the ground there lived",
           "def fibonacci(n):", "Roses are red,", "1, 2, 3, 4,", "The quick brown fox", "Dear diary, today"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--device", default="RPC0,RPC1")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the split server (repeatable)")
    args = ap.parse_args()
    model = args.model
    if not model:
        from pyllama.models.make import make_model  # noqa: PLC0415
        os.makedirs(os.path.join(HERE, "out", "models"), exist_ok=True)
        model = os.path.join(HERE, "out", "models", f"{args.preset}-f32.gguf")
        if not os.path.exists(model):
            make_model(args.preset, model)
    extra_env = dict(e.split("=", 1) for e in args.env)
    started: list = []
    failures: list[str] = []
    compared = n_bytes = 0
    try:
        peers = [RPCServerProcess(), RPCServerProcess()]
        started += peers
        rpc = ",".join(p.endpoint for p in peers)
        split = ServerProcess(model, "--rpc", rpc, "--device", args.device, "-np", "1", env=extra_env)
        started.append(split)
        plain = ServerProcess(model, "-np", "1")
        started.append(plain)
        split.wait_ready(120)
        plain.wait_ready(120)
        for i in range(args.prompts):
            prompt = PROMPTS[i % len(PROMPTS)] + (f" ({i})" if i >= len(PROMPTS) else "")
            body = {"prompt": prompt, "n_predict": args.n_predict, "temperature": 0, "ignore_eos": True,
                    "cache_prompt": False, "return_tokens": True}
            results = []
            for srv in (plain, split):
                try:
                    status, res = srv.post("/completion", body, timeout=300)
                except (OSError, http.client.HTTPException) as exc:
                    status, res = 0, {"error": str(exc)}
                results.append((status, res))
            (s0, r0), (s1, r1) = results
            if s0 != 200 or s1 != 200:
                failures.append(f"prompt {i}: HTTP {s0} / {s1}: {json.dumps(r0)[:200]} / {json.dumps(r1)[:200]}")
                continue
            if not r0.get("content") or r0.get("tokens_predicted") != args.n_predict or \
                    r1.get("tokens_predicted") != args.n_predict:
                failures.append(f"prompt {i}: missing content or short count")
            if r0["content"] != r1["content"] or r0["tokens"] != r1["tokens"]:
                failures.append(f"prompt {i}: outputs differ: {r0['content']!r} vs {r1['content']!r}")
            compared += 1
            n_bytes += len(r0["content"].encode())
    except Exception as exc:  # noqa: BLE001 - reported as a failure of the check
        failures.append(f"harness: {exc!r}")
    finally:
        for proc in reversed(started):
            proc.stop(signal.SIGTERM)
    print(f"split check ({args.device}): compared {compared} completions, {n_bytes} bytes of text; "
          f"{len(failures)} failures")
    for f in failures:
        print("  " + f)
    return 1 if failures or compared == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
