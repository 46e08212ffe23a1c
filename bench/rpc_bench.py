"""RPC figures in one run: round trip, weight upload speed, commands and bytes per decode step,
and tokens/s of a split server against the unsplit one.

    python bench/rpc_bench.py [--preset medium] [--users 8] [--npp 64] [--ntg 64] [-r 2] [--json OUT]

One local rpc server on the CPU backend (its own process, one compute thread), the client in this
process for the first three parts, then `pyllama.server` processes (local, CPU,RPC0 and RPC0,CPU)
driven by bench_users.py. Loopback only; every process started is stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT, os.path.join(ROOT, "tests")]

from bench_users import run_bench  # noqa: E402
from pyllama.backend.cpu import CPUBackend  # noqa: E402
from pyllama.backend.rpc import RPCBackend  # noqa: E402
from pyllama.runtime.context import Batch  # noqa: E402
from pyllama.runtime.engine import Engine  # noqa: E402
from pyllama.models.make import make_model  # noqa: E402
from pyllama.obs import rpc_stats as stats  # noqa: E402
from pyllama.rpc.connection import Connection  # noqa: E402
from pyllama.rpc.protocol import Cmd  # noqa: E402
from server_util import RPCServerProcess, ServerProcess  # noqa: E402


def model_path(preset: str) -> str:
    path = os.path.join(HERE, "out", "models", f"{preset}-f32.gguf")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        make_model(preset, path)
    return path


def per_step(engine: Engine, users: int, steps: int = 16) -> dict:
    ctx = engine.new_context(users * 160, users)
    prompts = [[300 + (7 * i + j) % 500 for j in range(32)] for i in range(users)]
    ctx.decode(Batch.concat([Batch.for_sequence(p, 0, s) for s, p in enumerate(prompts)]))
    stats.reset()
    pos = np.full(users, 32)
    for step in range(steps):
        ctx.decode(Batch(np.full(users, 300 + step), pos, range(users), np.ones(users, bool)))
        pos += 1
    counts, n = stats.snapshot()
    ctx.free()
    return {name: {"per_step": c / n, "bytes_out_per_step": o / n, "bytes_in_per_step": i / n}
            for name, (c, o, i) in counts.items() if c}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--npp", type=int, default=64)
    ap.add_argument("--ntg", type=int, default=64)
    ap.add_argument("-r", "--requests", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=1, help="compute threads of each process")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = model_path(args.preset)
    out: dict = {"preset": args.preset}
    peer = RPCServerProcess("-t", str(args.threads))
    try:
        conn = Connection(peer.endpoint)
        lat = []
        for _ in range(1000):
            t0 = time.perf_counter()
            conn.call(Cmd.DEVICE_COUNT)
            lat.append(time.perf_counter() - t0)
        out["round_trip_us_median"] = statistics.median(lat) * 1e6
        out["round_trip_us_p99"] = sorted(lat)[int(0.99 * len(lat))] * 1e6

        stats.reset()
        t0 = time.perf_counter()
        engine = Engine(model, n_threads=args.threads, backends=[RPCBackend(conn, 0, "RPC0")], tensor_split=[1])
        load_s = time.perf_counter() - t0
        counts, _ = stats.snapshot()
        sent = counts.get("SET_TENSOR", (0, 0, 0))[1]
        out["upload_MB"] = sent / 1e6
        out["upload_MB_s_including_dequant"] = sent / 1e6 / load_s
        engine.close()
        # raw upload speed: one 256 MiB buffer
        b = RPCBackend(conn, 0, "RPC0")
        from pyllama.backend.base import DType, Tensor  # noqa: PLC0415
        buf = b.alloc_buffer(256 << 20, "weights")
        t = Tensor(DType.F32, (64 << 20,), "blob", buf, 0)
        data = np.ones(64 << 20, np.float32)
        t0 = time.perf_counter()
        for _ in range(4):
            b.set_tensor(t, data)
        b.synchronize()
        out["upload_MB_s_raw"] = 4 * data.nbytes / 1e6 / (time.perf_counter() - t0)
        b.free_buffer(buf)

        for order in ("CPU,RPC0", "RPC0,CPU"):
            backs = [CPUBackend(args.threads) if d == "CPU" else RPCBackend(conn, 0, "RPC0") for d in order.split(",")]
            engine = Engine(model, n_threads=args.threads, backends=backs, tensor_split=[1, 1])
            out[f"per_step_{order}"] = per_step(engine, args.users)
            engine.close()
        conn.close()

        cells = {}
        for label, extra in (("local", []), ("CPU,RPC0", ["--rpc", peer.endpoint, "--device", "CPU,RPC0"]),
                             ("RPC0,CPU", ["--rpc", peer.endpoint, "--device", "RPC0,CPU"])):
            srv = ServerProcess(model, "-np", str(args.users), "-c", str(args.users * (args.npp + args.ntg + 16)),
                                "-t", str(args.threads), *extra).wait_ready(300)
            try:
                r = run_bench(srv.url, args.users, args.requests, args.npp, args.ntg, warmup=1)
                cells[label] = {"tok_s": r["gen_tok_s"], "tpot_ms": r["tpot_ms"], "ttft_ms_median": r["ttft_ms_median"],
                                "errors": r["errors"] + r["short"]}
            finally:
                srv.stop()
        out["server"] = cells
    finally:
        peer.stop()
    print(json.dumps(out, indent=1))
    base = out["server"]["local"]["tok_s"]
    print(f"\nround trip {out['round_trip_us_median']:.0f} us median; upload {out['upload_MB_s_raw']:.0f} MB/s raw, "
          f"{out['upload_MB_s_including_dequant']:.0f} MB/s while loading the model")
    for order in ("CPU,RPC0", "RPC0,CPU"):
        ps = out[f"per_step_{order}"]
        total = sum(v["per_step"] for v in ps.values())
        print(f"{order}: {total:.2f} commands per decode step: " +
              ", ".join(f"{k} {v['per_step']:.2f} ({v['bytes_out_per_step'] + v['bytes_in_per_step']:.0f} B)"
                        for k, v in sorted(ps.items())))
    for label, c in out["server"].items():
        print(f"server {label}: {c['tok_s']:.1f} tok/s ({c['tok_s'] / base:.2f}x local), TPOT {c['tpot_ms']:.1f} ms, "
              f"errors {c['errors']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
