"""Decode throughput of the engine on the CPU backend, measured side by side in one run.

    python bench/bench_decode.py [--presets small,medium] [--batches 1,8,32] [-t THREADS] [--json OUT]

For each preset (a test model made with pyllama.models.make, cached under bench/out/models):
tokens/s of batched decode at each batch size (B sequences, one token each per step, greedy
sampling included), prompt processing tokens/s for a 512-token prompt, resident memory, the
weights' memory per file type, and the share of a decode step spent in Python rather than in
kernels (kernel time is measured around every bound kernel call of the CPU backend and the
sampling kernel; the rest of the step is Python: batch build, KV bookkeeping, plan lookup, input
upload, result handling).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from pyllama.backend import cpu as cpu_backend  # noqa: E402
from pyllama.context import Batch  # noqa: E402
from pyllama.engine import Engine  # noqa: E402
from pyllama.models.make import make_model  # noqa: E402
from pyllama.sampling import BatchSampler, SamplingParams, SequenceSampler  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class KernelClock:
    """Accumulates wall time spent inside the CPU backend's kernel calls."""

    def __init__(self) -> None:
        self.total = 0.0
        self._orig = cpu_backend.CPUBackend.graph_compute

    def install(self) -> None:
        clock = self

        def timed_compute(backend, graph, reads=()):
            orig_prepare = backend._plans.get(graph.uid)
            if orig_prepare is None:
                backend._plans[graph.uid] = backend._prepare(graph)
            for step in backend._plans[graph.uid]:
                t0 = time.perf_counter()
                step()
                clock.total += time.perf_counter() - t0
            for t, out in reads:
                backend.get_tensor(t, out)

        cpu_backend.CPUBackend.graph_compute = timed_compute  # type: ignore[method-assign]


def model_path(preset: str, wtype: str) -> str:
    out = os.path.join(HERE, "out", "models")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{preset}-{wtype}.gguf")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        make_model(preset, path, wtype=wtype)
        print(f"# made {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def bench_preset(preset: str, batches: list[int], n_threads: int, steps: int, n_prompt: int, clock: KernelClock) -> dict:
    path = model_path(preset, "f32")
    rss0 = rss_mib()
    engine = Engine(path, n_threads=n_threads)
    hp = engine.model.hparams
    bmax = max(batches)
    ctx_per_seq = max(n_prompt, 32 + steps + 8)
    ctx = engine.new_context(ctx_per_seq * bmax, bmax, n_batch=max(32 * bmax, n_prompt), n_ubatch=512)
    rss_loaded = rss_mib()
    res: dict = {"preset": preset, "params_M": engine.model.n_params() / 1e6, "n_vocab": hp.n_vocab,
                 "weights_MiB": sum(engine.weights.bytes_per_backend.values()) / 2**20,
                 "kv_MiB": sum(ctx.kv_bytes.values()) / 2**20}
    rng = np.random.default_rng(0)

    # prompt processing: one sequence of n_prompt tokens (warm-up run first)
    prompt = rng.integers(300, hp.n_vocab, n_prompt).tolist()
    times = []
    for _ in range(3):
        ctx.seq_rm(0)
        t0 = time.perf_counter()
        ctx.decode(Batch.for_sequence(prompt, 0, 0))
        times.append(time.perf_counter() - t0)
    ctx.seq_rm(0)
    res["pp_tok_s"] = n_prompt / min(times[1:])

    sampler = BatchSampler(hp.n_vocab, bmax)
    greedy = SamplingParams(temperature=0.0)
    for b in batches:
        ctx.clear()
        seqs = list(range(b))
        prompts = [rng.integers(300, hp.n_vocab, 32).tolist() for _ in seqs]
        out = ctx.decode(Batch.concat([Batch.for_sequence(p, 0, s) for p, s in zip(prompts, seqs)]))
        samplers = [SequenceSampler(greedy) for _ in seqs]
        pos = np.full(b, 32, dtype=np.int32)
        ids = sampler.sample(out.logits, samplers).ids.copy()
        # warm-up step, then the timed window
        out = ctx.decode(Batch(ids, pos, seqs, np.ones(b, bool)))
        pos += 1
        clock.total = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            k0 = time.perf_counter()
            ids = sampler.sample(out.logits, samplers).ids.copy()
            clock.total += time.perf_counter() - k0  # the sampling kernel counts as kernel time
            out = ctx.decode(Batch(ids, pos, seqs, np.ones(b, bool)))
            pos += 1
        dt = time.perf_counter() - t0
        res[f"tg_b{b}_tok_s"] = b * steps / dt
        res[f"tg_b{b}_step_ms"] = dt / steps * 1e3
        res[f"tg_b{b}_python_share"] = max(0.0, 1.0 - clock.total / dt)
    res["rss_MiB"] = rss_mib()
    res["rss_model_MiB"] = rss_loaded - rss0
    engine.close()
    return res


def weight_memory(preset: str) -> list[dict]:
    """File size vs resident weights for each file type the maker writes (the CPU stores F32)."""
    rows = []
    for wtype in ("f32", "f16", "q8_0"):
        path = model_path(preset, wtype)
        engine = Engine(path, n_threads=1)
        rows.append({"preset": preset, "type": wtype, "file_MiB": os.path.getsize(path) / 2**20,
                     "resident_weights_MiB": sum(engine.weights.bytes_per_backend.values()) / 2**20})
        engine.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="small,medium")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per batch size")
    ap.add_argument("--prompt", type=int, default=512, help="prompt length for prompt processing")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    clock = KernelClock()
    clock.install()
    batches = [int(x) for x in args.batches.split(",")]
    results = [bench_preset(p, batches, args.threads, args.steps, args.prompt, clock) for p in args.presets.split(",")]
    memory = [row for p in args.presets.split(",") for row in weight_memory(p)]
    print(f"# machine: {os.cpu_count()} cores; threads {args.threads or os.cpu_count()}")
    hdr = ["preset", "params_M", "pp_tok_s"] + [f"tg_b{b}_tok_s" for b in batches] + \
          [f"tg_b{b}_python_share" for b in batches] + ["weights_MiB", "kv_MiB", "rss_MiB"]
    print(" | ".join(hdr))
    for r in results:
        print(" | ".join(f"{r[h]:.3g}" if isinstance(r[h], float) else str(r[h]) for h in hdr))
    for r in results:
        ratios = ", ".join(f"b{b}/b1 {r[f'tg_b{b}_tok_s'] / r['tg_b1_tok_s']:.2f}x" for b in batches[1:])
        print(f"# {r['preset']}: batching gain {ratios}; step ms " +
              ", ".join(f"b{b} {r[f'tg_b{b}_step_ms']:.1f}" for b in batches))
    print("preset | type | file_MiB | resident_weights_MiB")
    for m in memory:
        print(f"{m['preset']} | {m['type']} | {m['file_MiB']:.1f} | {m['resident_weights_MiB']:.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"decode": results, "memory": memory}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
