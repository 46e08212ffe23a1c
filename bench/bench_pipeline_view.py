"""What the live pipeline view costs: generation tokens/s of a loaded RPC0,CPU split with the
/pipeline page open (polling /pipeline/stats as the page does) against closed.

    python bench/bench_pipeline_view.py [--model PATH] [--phase-s 8] [--rounds 2] [--poll-ms 1000]

Starts an rpc server and a server (2 pipeline groups, 4 slots) on loopback, keeps every slot busy
with short greedy completions, and alternates phases with the view closed and open (A B A B ...,
so a drift of the machine falls on both alike). Tokens are counted by the clients, as completions
finish within each phase. Prints one line per phase and the mean of each side; the difference is
the view's cost when it lies outside the spread of the phases of one side.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from server_util import RPCServerProcess, ServerProcess  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF model (default: a small test model made here)")
    ap.add_argument("--phase-s", type=float, default=8.0, help="seconds per phase")
    ap.add_argument("--rounds", type=int, default=2, help="closed/open pairs")
    ap.add_argument("--poll-ms", type=int, default=1000, help="the page's polling period (the page: 1000)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--n-predict", type=int, default=32)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-view-")
    model = args.model
    if not model:
        model = os.path.join(tmp, "small.gguf")
        from pyllama.models.make import main as make  # noqa: PLC0415
        make(["--preset", "small", "--out", model])
    peer = RPCServerProcess()
    srv = ServerProcess(model, "--rpc", peer.endpoint, "--device", "RPC0,CPU", "-ts", "1,1", "-np", "4",
                        "-c", "4096", "--pipeline-groups", "2").wait_ready()
    done_tokens = [0]
    lock = threading.Lock()
    stop = threading.Event()

    def client(i: int) -> None:
        k = 0
        while not stop.is_set():
            k += 1
            status, res = srv.post("/completion", {"prompt": f"client {i} request {k}", "n_predict": args.n_predict,
                                                   "ignore_eos": True, "temperature": 0, "cache_prompt": False})
            if status == 200:
                with lock:
                    done_tokens[0] += res["tokens_predicted"]

    polls: list[float] = []

    def viewer(until: float) -> None:
        url = srv.url + "/pipeline/stats"
        while time.monotonic() < until:
            t0 = time.monotonic()
            with urllib.request.urlopen(url, timeout=30) as r:
                json.loads(r.read())
            polls.append(time.monotonic() - t0)
            time.sleep(max(0.0, args.poll_ms / 1000 - (time.monotonic() - t0)))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # warm up
    results: dict[str, list[float]] = {"closed": [], "open": []}
    try:
        for r in range(args.rounds):
            for side in ("closed", "open"):
                v = None
                t_end = time.monotonic() + args.phase_s
                if side == "open":
                    v = threading.Thread(target=viewer, args=(t_end,), daemon=True)
                    v.start()
                with lock:
                    n0 = done_tokens[0]
                t0 = time.monotonic()
                time.sleep(max(0.0, t_end - time.monotonic()))
                with lock:
                    n1 = done_tokens[0]
                rate = (n1 - n0) / (time.monotonic() - t0)
                if v is not None:
                    v.join()
                results[side].append(rate)
                print(f"round {r} {side:>6}: {rate:8.1f} tokens/s", flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        srv.stop()
        peer.stop()
    c, o = statistics.mean(results["closed"]), statistics.mean(results["open"])
    spread = max(max(v) - min(v) for v in results.values())
    print(f"closed {c:.1f} tokens/s, open {o:.1f} tokens/s: {100 * (o - c) / c:+.1f} % "
          f"(spread of one side's phases up to {100 * spread / c:.1f} %); "
          f"/pipeline/stats answered in {1e3 * statistics.median(polls):.1f} ms (median of {len(polls)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
