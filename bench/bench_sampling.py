"""Host sampling cost per row: BatchSampler.sample on random logits, side by side in one run.

    python bench/bench_sampling.py                      # 32 rows of 32000, 1 thread
    python bench/bench_sampling.py --rows 16 --vocab 151936 --threads 2

Arms (interleaved rounds, the median of each): greedy rows as the server samples them
(chosen_prob=False: the chosen token's probability is not computed without n_probs), greedy rows
with that probability (chosen_prob=True, the BatchSampler default), greedy with n_probs=5, and
the llama-server default chain (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05). Prints
microseconds per row (the sampler's Python packing included) and each arm's ratio to the
server's greedy arm. The logits are reused, so they sit in cache as a step's just-computed ones.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pyllama.batching.sampling import BatchSampler, SamplingParams, SequenceSampler  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=40, help="sample() calls per arm and round")
    a = ap.parse_args()
    if min(a.rows, a.vocab, a.threads, a.rounds, a.calls) < 1:
        ap.error("every count must be at least 1")
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((a.rows, a.vocab)) * 3).astype(np.float32)
    arms = {
        "greedy, server (chosen_prob=False)": (False, SamplingParams(temperature=0)),
        "greedy, chosen_prob=True": (True, SamplingParams(temperature=0)),
        "greedy, n_probs=5": (False, SamplingParams(temperature=0, n_probs=5)),
        "llama-server default chain": (False, SamplingParams(seed=1)),
    }
    samplers = {name: (BatchSampler(a.vocab, a.rows, 5, n_threads=a.threads, chosen_prob=cp),
                       [SequenceSampler(p) for _ in range(a.rows)]) for name, (cp, p) in arms.items()}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(2):  # warm-up
        for bs, ss in samplers.values():
            bs.sample(logits, ss)
    for _ in range(a.rounds):
        for name, (bs, ss) in samplers.items():
            t0 = time.perf_counter()
            for _ in range(a.calls):  # the same logits, in cache as a step's just-computed ones
                bs.sample(logits, ss)
            times[name].append((time.perf_counter() - t0) / a.calls / a.rows * 1e6)
    base = statistics.median(times["greedy, server (chosen_prob=False)"])
    print(f"{a.rows} rows x {a.vocab} logits, {a.threads} thread(s), median of {a.rounds} rounds")
    print(f"{'arm':38s} {'us/row':>8s} {'ratio':>7s}")
    for name, v in times.items():
        m = statistics.median(v)
        print(f"{name:38s} {m:8.2f} {m / base:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
