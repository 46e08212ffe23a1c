"""What a JSON schema costs: generated tokens/s with and without one, at 1 and 32 users.

    python bench/bench_constrained.py [--model PATH | --preset small] [--users 1,32] [--ntg 32]
        [--requests 2] [--threads 1] [--rpc] [--json OUT]

One server (`python -m pyllama.server`, --parallel = the most users) serves both arms, side by
side: for each user count, U closed-loop users (one thread and one keep-alive connection each)
send R requests of `n_predict` NTG tokens each to /completion, first unconstrained, then with
SCHEMA (an array of at least 100 objects with a free string and an integer: never complete
within NTG tokens, so both arms generate exactly NTG tokens per request, and the string keeps
nearly the whole vocabulary in play, the costly case for a mask). Sampling is seeded, the
prompt cache off. Reported per user count: tokens/s of each arm, their ratio and the cost of the
constraint in percent.

Before that, in this process, the per-step work a constrained row adds on the decode thread's
side is timed on the same vocabulary: computing one mask (done off the decode thread, overlapped
with the next step), and applying a batch of masks to the logits (done on the decode thread).

With --rpc the output layer goes to a local rpc server (`--device CPU,RPC0 --backend-sampling`):
the plain arm then samples on that device and only ids come back, while every step of the schema
arm takes the logits back and samples on this host, so the ratio includes moving them.

The model defaults to pyllama's "small" preset (32,000 tokens of vocabulary), made once under
bench/out/models.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from pyllama.models.make import make_model  # noqa: E402
from pyllama.batching.constraint import (ConstraintSpec, Constraint, apply_masks,  # noqa: E402
                                       compile_constraint)
from pyllama.runtime.engine import Engine  # noqa: E402

SCHEMA = {"type": "array", "minItems": 100,
          "items": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                    "required": ["name", "age"], "additionalProperties": False}}
PROMPT = "Here are the people, as JSON:"


def model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    out = os.path.join(HERE, "out", "models", f"{args.preset}-f32.gguf")
    if not os.path.exists(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        make_model(args.preset, out)
    return out


# --- in-process: the per-step work of a constrained row -----------------------------------------
def time_masks(path: str, rows: int, steps: int = 64) -> dict:
    """Mask computation per row and mask application per step of `rows` rows, on this vocabulary,
    following tokens drawn from each mask (uniformly among the allowed ones, seeded)."""
    tok = Engine(path, n_threads=1).tokenizer
    spec = ConstraintSpec("json_schema", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    compile_constraint(spec, tok)
    t_compile = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    cons = [Constraint(compile_constraint(spec, tok), tok.n_vocab) for _ in range(rows)]
    logits = rng.standard_normal((rows, tok.n_vocab)).astype(np.float32)
    t_mask = t_apply = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        for c in cons:
            c.compute_mask()
        t1 = time.perf_counter()
        work = logits.copy()
        t2 = time.perf_counter()
        apply_masks(work, list(range(rows)), cons)
        t3 = time.perf_counter()
        t_mask += t1 - t0
        t_apply += t3 - t2
        for k, c in enumerate(cons):
            allowed = np.flatnonzero(np.isfinite(work[k]))
            assert c.consume(int(rng.choice(allowed)))
    return {"rows": rows, "compile_ms": t_compile * 1e3, "mask_us_per_row": t_mask / steps / rows * 1e6,
            "apply_us_per_step": t_apply / steps * 1e6}


# --- the server: tokens/s with and without the schema ----------------------------------------------
def start_rpc_server(threads: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "pyllama.rpc_server", "--host", "127.0.0.1", "--port", "0",
                             "-t", str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(HERE))
    for line in proc.stderr:  # type: ignore[union-attr]
        if "listening on" in line:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
            return proc, "127.0.0.1:" + line.rsplit(":", 1)[1].split()[0]
    raise RuntimeError("the rpc server did not start")


def start_server(path: str, n_slots: int, threads: int, n_ctx_slot: int,
                 extra: list[str]) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "pyllama.server", "-m", path, "--port", "0", "-t", str(threads),
           "-np", str(n_slots), "-c", str(n_slots * n_ctx_slot), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(HERE))
    port = 0
    lines = []
    for line in proc.stderr:  # type: ignore[union-attr]
        lines.append(line)
        if "listening on http://" in line and proc.poll() is None:
            port = int(line.rsplit(":", 1)[1].strip())
            break
    if not port:
        raise RuntimeError("the server did not start:\n" + "".join(lines[-20:]))
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    return proc, port


def run_users(port: int, users: int, requests: int, ntg: int, schema: bool) -> dict:
    errors: list[str] = []
    tokens = [0] * users
    barrier = threading.Barrier(users + 1)

    def user(u: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            barrier.wait()
            for r in range(requests):
                body = {"prompt": PROMPT, "n_predict": ntg, "seed": 1000 * u + r, "cache_prompt": False}
                if schema:
                    body["json_schema"] = SCHEMA
                conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
                resp = conn.getresponse()
                doc = json.loads(resp.read())
                if resp.status != 200:
                    errors.append(str(doc)[:200])
                    continue
                if doc["tokens_predicted"] != ntg:
                    errors.append(f"{doc['tokens_predicted']} tokens, not {ntg} ({doc['stop_type']})")
                tokens[u] += doc["tokens_predicted"]
        finally:
            conn.close()

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"tokens": sum(tokens), "seconds": wall, "tokens_per_s": sum(tokens) / wall, "errors": errors[:5]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF model (default: make --preset)")
    ap.add_argument("--preset", default="small", help="pyllama.models.make preset when no --model")
    ap.add_argument("--users", default="1,32", help="user counts, comma-separated")
    ap.add_argument("--ntg", type=int, default=32, help="tokens per request")
    ap.add_argument("--requests", type=int, default=2, help="requests per user and arm")
    ap.add_argument("--threads", type=int, default=1, help="server threads (-t)")
    ap.add_argument("--rpc", action="store_true", help="output layer on a local rpc server, --backend-sampling")
    ap.add_argument("--json", default=None, help="write the figures here too")
    args = ap.parse_args()
    users = [int(u) for u in args.users.split(",")]
    path = model_path(args)
    out: dict = {"model": path, "ntg": args.ntg, "requests": args.requests, "threads": args.threads, "rpc": args.rpc}

    out["masks"] = [time_masks(path, rows) for rows in (1, max(users))]
    for m in out["masks"]:
        print(f"masks, {m['rows']} rows: compile {m['compile_ms']:.1f} ms once per schema; "
              f"{m['mask_us_per_row']:.0f} us per row per step to compute (off the decode thread); "
              f"{m['apply_us_per_step']:.0f} us per step to apply (on it)")

    peer = None
    extra: list[str] = []
    if args.rpc:
        peer, endpoint = start_rpc_server(args.threads)
        extra = ["--rpc", endpoint, "--device", "CPU,RPC0", "--backend-sampling"]
    proc, port = start_server(path, max(users), args.threads, 256 + args.ntg, extra)
    out["runs"] = []
    failed = False
    try:
        for u in users:
            run_users(port, u, 1, 4, True)  # warm-up: the schema compiles once, the pages are touched
            plain = run_users(port, u, args.requests, args.ntg, False)
            constrained = run_users(port, u, args.requests, args.ntg, True)
            ratio = constrained["tokens_per_s"] / plain["tokens_per_s"]
            out["runs"].append({"users": u, "plain": plain, "schema": constrained, "ratio": ratio})
            print(f"{u:3d} users: {plain['tokens_per_s']:8.1f} tokens/s plain, {constrained['tokens_per_s']:8.1f} "
                  f"with the schema: ratio {ratio:.3f} (cost {100 * (1 - ratio):+.1f}%)")
            for arm in (plain, constrained):
                if arm["errors"]:
                    failed = True
                    print("  errors:", arm["errors"])
    finally:
        proc.terminate()
        proc.wait(30)
        if peer is not None:
            peer.terminate()
            peer.wait(30)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
