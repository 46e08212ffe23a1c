"""A real traced split run for the trace tools' tests: rpc servers and one HTTP server, each
writing its own trace, a few concurrent completions, everything stopped before returning.

    python tests/trace_run.py MODEL OUT_DIR [--devices RPC0,RPC1] [--groups 2] [-- SERVER ARGS...]

prints the trace files (server first), so the docs' picture can be made from the same run.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import threading
from typing import Sequence

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if BENCH not in sys.path:  # (run as a script: the server helpers live in bench/)
    sys.path.insert(0, BENCH)

from server_util import RPCServerProcess, ServerProcess  # noqa: E402

PROMPTS = ["The little cat sat on the", "Once upon a time", "A B C D", "1 2 3 4 5"]


def traced_split(model: str, out: str, devices: str = "RPC0,RPC1", groups: int = 2, n_predict: int = 12,
                 prompts: Sequence[str] = PROMPTS, extra: Sequence[str] = ()) -> list[str]:
    """Runs the split with tracing on in every process; returns the trace files, the server's
    first (its clock is the merge's time line), then the peers' in --rpc order. `extra`: more
    server arguments (e.g. `-ts 1,1,0`: the tiny model has two layers for three devices)."""
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, "trace.jsonl")
    for f in glob.glob(os.path.join(out, "trace*.jsonl")):
        os.unlink(f)
    n_peers = sum(1 for d in devices.split(",") if d.startswith("RPC"))
    env = {"PYLLAMA_TRACE": ""}
    peers = []
    srv = None
    try:
        for i in range(n_peers):
            peers.append(RPCServerProcess("--trace", os.path.join(out, f"peer{i}.jsonl"), env=env))
        n_slots = 2 * groups
        srv = ServerProcess(model, "--rpc", ",".join(p.endpoint for p in peers), "--device", devices,
                            "--pipeline-groups", str(groups), "-np", str(n_slots), "-c", str(n_slots * 64),
                            "-t", "1", "--trace", base, *extra, env=env).wait_ready(120)
        errors: list[str] = []

        def one(prompt: str) -> None:
            status, body = srv.post("/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                                    "ignore_eos": True, "cache_prompt": False})
            if status != 200:
                errors.append(f"{status}: {body}")

        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if errors:
            raise RuntimeError(f"completions failed: {errors}")
    finally:
        if srv is not None:
            srv.stop()
        for p in peers:
            p.stop()
    return [base] + [os.path.join(out, f"peer{i}.jsonl") for i in range(n_peers)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--devices", default="RPC0,RPC1")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--n-predict", type=int, default=12)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after --: more server arguments
    a = ap.parse_args(argv[:cut])
    extra = argv[cut + 1:]
    print("\n".join(traced_split(a.model, a.out, a.devices, a.groups, a.n_predict, extra=extra)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
