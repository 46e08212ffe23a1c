"""What the server's split check (pyllama/server/split_check.py) advises, started from several splits.

For each `-ts` value (`auto`: none, so the server chooses the split and its check moves it): an
rpc server and a server (`RPC0,CPU`, pipeline groups) on loopback, the check every `--check-s`
seconds, and two runs of bench_users' closed-loop load (`--users` x `--requests` of npp / ntg),
each long enough that the check sees whole rounds of prompts and generation. Prints per split the
tokens/s of both runs (with `auto` the first holds the move, the second is served by the moved
split), each device's busy share from the last `split check` line the server logged and what each
of its lines concluded, in order.

    python bench/split_advice.py --types q4_k_m,f32 --splits auto:6,6:7,5
    python bench/split_advice.py --model PATH --splits 4,2:3,3 --users 8 --requests 4 --check-s 5
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))

import pipeline_cells as pc  # noqa: E402  (puts tests/ on the path for server_util)
from bench_users import run_bench  # noqa: E402
from server_util import RPCServerProcess, ServerProcess  # noqa: E402

from pyllama.server.split_check import CHECK_ENV  # noqa: E402

CHECK_LINE = re.compile(r"split check over the last .*")
BUSY = re.compile(r"(\S+) \d+ blocks(?: \+ output)? busy (\d+)%")


def _outcome(line: str) -> str:
    if line.endswith(": balanced"):
        return "balanced"
    moved = re.search(r"moved to -ts (\S+) .* in (\d+) ms$", line)
    if moved:
        return f"moved to {moved[1]} in {moved[2]} ms"
    return (re.search(r"-ts (\S+) would even", line) or [None, "?"])[1]


def parse_check(text: str) -> Optional[dict]:
    """The `split check` lines in a server's log: {'line' (the last), 'busy': {device: %} (of the
    last), 'advice' (the last's outcome: balanced, a -ts value, or 'moved to X in N ms'),
    'outcomes' (every line's, in order)}."""
    lines = CHECK_LINE.findall(text)
    if not lines:
        return None
    line = lines[-1]
    return {"line": line, "busy": {m[0]: int(m[1]) for m in BUSY.findall(line)}, "advice": _outcome(line),
            "outcomes": [_outcome(x) for x in lines]}


def run_split(model: str, endpoint: str, ts: str, a, vocab: tuple[int, int]) -> dict:
    args = pc.server_args("RPC0,CPU", endpoint, a.groups, a.users, a.npp, a.ntg, a.threads, ts,
                          pc.prio_args(a.prio))
    srv = ServerProcess(model, *args, env={CHECK_ENV: str(a.check_s)}).wait_ready(a.ready_timeout)
    try:
        runs = [run_bench(srv.url, a.users, a.requests, a.npp, a.ntg, warmup=1 - k, timeout=a.timeout, vocab=vocab)
                for k in range(2)]
    finally:
        srv.stop()
    return {"ts": ts, "tok_s": [r["gen_tok_s"] for r in runs], "check": parse_check(srv.stderr_text)}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF model (default: the medium preset of each --types, made once)")
    ap.add_argument("--types", default="q4_k_m", help="weight types of the medium preset (without --model)")
    ap.add_argument("--splits", default="9,3:8,4:7,5:6,6", help="-ts values to start from, ':'-separated")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--requests", type=int, default=10, help="requests per user (rounds of the load)")
    ap.add_argument("--npp", type=int, default=64)
    ap.add_argument("--ntg", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--check-s", type=float, default=15.0, help="the check's interval ($%s)" % CHECK_ENV)
    ap.add_argument("--prio", type=int, default=0, help="--prio of both processes")
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args(argv)
    models = [(os.path.basename(a.model), a.model)] if a.model else \
        [(t, pc.model_path("medium", t)) for t in pc.parse_types(a.types)]
    splits = [s for s in a.splits.split(":") if s]
    peer = RPCServerProcess("-t", str(a.threads), *pc.prio_args(a.prio))
    rows = []
    try:
        for name, model in models:
            vocab = pc.prompt_vocab(model)
            for ts in splits:
                r = run_split(model, peer.endpoint, ts, a, vocab)
                c = r["check"]
                busy = " / ".join(f"{k} {v}%" for k, v in c["busy"].items()) if c else "-"
                first, second = r["tok_s"]
                rows.append(f"{name:10s} -ts {ts:8s} {first:8.1f} then {second:8.1f} tok/s  busy {busy:22s} "
                            f"checks: {' -> '.join(c['outcomes']) if c else 'none logged (raise --requests)'}")
                print(rows[-1], flush=True)
    finally:
        peer.stop()
    print(f"\nsplit check every {a.check_s:g} s, {a.groups} groups over RPC0,CPU, two runs of {a.users} users x "
          f"{a.requests} requests of npp {a.npp} / ntg {a.ntg} per server, -t {a.threads}, --prio {a.prio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
