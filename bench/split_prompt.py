"""A long prompt over a layer split: prompt tokens/s with a step's micro-batches as a wavefront
(micro-batch u + 1 on the first stage while u runs on the second, `Scheduler.compute_ubatches`)
against the same micro-batches one after the other, side by side in one run, with the unsplit
engine and llama.cpp's split for reference.

    python bench/split_prompt.py [--preset medium] [--types f32,q4_k_m] [--orders RPC0,CPU]
        [--prompt 2048] [--ubatch 512,256] [-t 1] [--ts 7,5] [--unsplit-threads 1,2] [--legs 3]
        [--peers DIR] [--json OUT]

One pyllama rpc server (`-t T`) for the whole run; this process is the client and computes the
local stage (`-t T`). Per weight type, device order and micro-batch size, every leg times one
prompt of --prompt tokens (a fresh sequence, after one warm-up prompt) in each arm, in turn:
`wavefront` (the engine as it is), `one by one` (the same engine and context with the wavefront
turned off, the schedule before it), pyllama unsplit at each --unsplit-threads value (the
same micro-batch size), and with --peers llama.cpp's split: `ggml-rpc-server -t T` plus
`llama-bench --rpc -ngl N -t T -p P -n 0 -ub U` (the output layer and the last blocks on the rpc
server, as pipeline_cells' llama-server split). Printed: tokens/s mean [min..max] per arm and the
ratios of `wavefront` to the others.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # a checkout without an install
    sys.path.insert(0, ROOT)

from peers import Peers  # noqa: E402
from pipeline_cells import GgmlRpcPeer, llama_ngl, model_path  # noqa: E402
from pyllama.backend.cpu import CPUBackend, set_compute_threads  # noqa: E402
from pyllama.backend.rpc import RPCBackend  # noqa: E402
from pyllama.runtime.context import Batch  # noqa: E402
from pyllama.runtime.engine import Engine  # noqa: E402
from pyllama.rpc.connection import Connection  # noqa: E402
from pyllama.runtime.sched import Scheduler  # noqa: E402
from server_util import RPCServerProcess  # noqa: E402


@contextmanager
def one_by_one() -> Iterator[None]:
    """The step's micro-batches run one after the other through all stages (no wavefront)."""
    saved = Scheduler.__dict__["_wavefront_ok"]
    Scheduler._wavefront_ok = staticmethod(lambda jobs: False)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Scheduler._wavefront_ok = saved  # type: ignore[method-assign]


def prompt_tokens(n: int, vocab: int, salt: int) -> list[int]:
    return [1 + (7919 * i + 104729 * salt) % (vocab - 1) for i in range(n)]


class Arm:
    """An engine context that decodes one prompt of `n` tokens per timing."""

    def __init__(self, engine: Engine, n: int, ubatch: int, threads: int):
        self.engine = engine
        self.threads = threads
        self.ctx = engine.new_context(n + 16, 1, n_batch=n, n_ubatch=ubatch)
        self.n = n
        self.vocab = engine.model.hparams.n_vocab
        self.salt = 0
        self.time_one()  # warm-up: plans built, pages touched

    def time_one(self) -> float:
        self.salt += 1
        self.ctx.seq_rm(0, 0)
        batch = Batch.for_sequence(prompt_tokens(self.n, self.vocab, self.salt), 0, 0)
        # BLAS's thread cap is the process's, set by the last engine made: each arm sets its own
        set_compute_threads(self.threads)
        t0 = time.perf_counter()
        self.ctx.decode(batch)
        return self.n / (time.perf_counter() - t0)


def llama_split(peers: Peers, rpc: GgmlRpcPeer, model: str, n: int, ubatch: int, threads: int,
                last_blocks: int) -> float:
    out = peers.run("llama-bench", "-m", model, "--rpc", rpc.endpoint, "-ngl", str(llama_ngl(last_blocks)),
                    "-t", str(threads), "-p", str(n), "-n", "0", "-ub", str(ubatch), "-b", str(n), "-r", "1",
                    "-o", "json")
    rows = json.loads(out)
    return float(rows[0]["avg_ts"])


def summary(values: list[float]) -> str:
    return f"{statistics.mean(values):7.1f} [{min(values):.1f}..{max(values):.1f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--types", default="f32,q4_k_m")
    ap.add_argument("--orders", default="RPC0,CPU", help="device orders, ';'-separated (RPC0,CPU;CPU,RPC0)")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens (one step: -b is set to it)")
    ap.add_argument("--ubatch", default="512,256", help="micro-batch sizes, comma-separated")
    ap.add_argument("-t", "--threads", type=int, default=1, help="compute threads of each process of the split")
    ap.add_argument("--ts", default="7,5", help="layer proportions of the split, in device order")
    ap.add_argument("--unsplit-threads", default="1,2", help="threads of the unsplit arms ('' for none)")
    ap.add_argument("--legs", type=int, default=3)
    ap.add_argument("--peers", default=None, help="llama.cpp's programs (DIR/bin; default $PYLLAMA_PEERS)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    types = [t for t in a.types.split(",") if t]
    orders = [o for o in a.orders.split(";") if o]
    ubatches = [int(u) for u in a.ubatch.split(",") if u]
    unsplit = [int(t) for t in a.unsplit_threads.split(",") if t]
    ts = [float(x) for x in a.ts.split(",")]
    peers = Peers.find(a.peers)
    print(f"# machine: {os.cpu_count()} cores; prompt {a.prompt} tokens; -t {a.threads} per process; -ts {a.ts}; "
          f"llama.cpp: {'yes' if peers else 'not found'}; {a.legs} legs", flush=True)
    rpc_proc = RPCServerProcess("-t", str(a.threads))
    ggml_rpc: Optional[GgmlRpcPeer] = GgmlRpcPeer(peers, a.threads) if peers else None
    results: list[dict] = []
    try:
        for wtype in types:
            path = model_path(a.preset, wtype)
            for order in orders:
                names = order.split(",")
                conn = Connection(rpc_proc.endpoint)
                try:
                    backends = [RPCBackend(conn) if nm == "RPC0" else CPUBackend(a.threads) for nm in names]
                    split = Engine(path, n_threads=a.threads, backends=backends, tensor_split=ts)
                    last_blocks = sum(1 for b in split.placement.layer_backend if b == len(names) - 1)
                    alone = {t: Engine(path, n_threads=t) for t in unsplit}
                    for ub in ubatches:
                        arms: dict[str, Arm] = {"wavefront": Arm(split, a.prompt, ub, a.threads)}
                        with one_by_one():
                            arms["one by one"] = Arm(split, a.prompt, ub, a.threads)
                        for t, eng in alone.items():
                            arms[f"unsplit -t {t}"] = Arm(eng, a.prompt, ub, t)
                        got: dict[str, list[float]] = {k: [] for k in arms}
                        if ggml_rpc is not None:
                            got["llama.cpp split"] = []
                        for leg in range(a.legs):
                            for name, arm in arms.items():
                                if name == "one by one":
                                    with one_by_one():
                                        got[name].append(arm.time_one())
                                else:
                                    got[name].append(arm.time_one())
                            if ggml_rpc is not None and peers is not None:
                                got["llama.cpp split"].append(
                                    llama_split(peers, ggml_rpc, path, a.prompt, ub, a.threads, last_blocks))
                            print(f"# {wtype} {order} -ub {ub} leg {leg + 1}: "
                                  + ", ".join(f"{k} {v[-1]:.1f}" for k, v in got.items()), flush=True)
                        base = statistics.mean(got["wavefront"])
                        print(f"\n{wtype} {order} -ub {ub} (prompt tok/s, mean [min..max]; wavefront / arm)")
                        for name, vals in got.items():
                            ratio = "" if name == "wavefront" else f"  {base / statistics.mean(vals):.2f}x"
                            print(f"  {name:16s} {summary(vals)}{ratio}")
                        print(flush=True)
                        results.append({"type": wtype, "order": order, "ubatch": ub, "prompt": a.prompt,
                                        "threads": a.threads, "ts": a.ts, "tok_s": got})
                        for arm in arms.values():
                            arm.ctx.free()
                    for eng in alone.values():
                        eng.close()
                    split.close()
                finally:
                    conn.close()
    finally:
        if ggml_rpc is not None:
            ggml_rpc.stop()
        rpc_proc.stop()
        if peers is not None:
            peers.close()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
