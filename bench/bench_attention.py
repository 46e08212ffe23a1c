"""The ATTENTION op's kernel alone (`_fast/ops.pyx` attention) at a model's shapes, per layer.

    python bench/bench_attention.py [--tokens 32] [--heads 12] [--kv-heads 4] [--head-dim 64]
                                    [--cells 50,100] [--threads 1,2] [--layers 12] [--sweep-mb 8]
                                    [--cache-type f16] [--legs 2]

Each token is its own sequence attending to `cells` cells (a decode step of `tokens` sequences),
over `layers` separate caches sized as a server's (128 cells per sequence) and filled with random
values, so a call reads a cache another call did not just read. With `--sweep-mb` > 0 a buffer of
that size is summed before every call, as the products between two layers' attention would push
the cache out of L2; 0 leaves it warm. It prints microseconds per layer (the mean over the timed
calls) for every (cells, threads) cell, legs interleaved.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pyllama._fast import ops  # noqa: E402
from pyllama.runtime.cache_types import CACHE_TYPES  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32, help="tokens (sequences) per call")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cells", default="50,100", help="cells each token attends to, comma-separated")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--layers", type=int, default=12, help="separate caches the calls go through in turn")
    ap.add_argument("--sweep-mb", type=float, default=8.0, help="MB summed before each call (0: none)")
    ap.add_argument("--cache-type", default="f16", choices=sorted(CACHE_TYPES))
    ap.add_argument("--rounds", type=int, default=40, help="timed passes over the layers per cell and leg")
    ap.add_argument("--legs", type=int, default=2, help="interleaved repetitions of every cell")
    a = ap.parse_args()
    cells = [int(c) for c in a.cells.split(",")]
    threads = [int(t) for t in a.threads.split(",")]
    n, H, Hkv, hd = a.tokens, a.heads, a.kv_heads, a.head_dim
    if n <= 0 or H <= 0 or Hkv <= 0 or H % Hkv or hd <= 0 or hd % 2 or min(cells) <= 0 or max(cells) > 128:
        ap.error("need tokens, heads and head size > 0, heads a multiple of kv heads, an even head size "
                 "and 1..128 cells")
    ctype = int(CACHE_TYPES[a.cache_type])
    row = ops.kv_row_nbytes(ctype, Hkv * hd)
    if row == 0:
        ap.error(f"a {a.cache_type} cache cannot hold rows of {Hkv * hd} elements")
    rng = np.random.default_rng(0)
    per_seq = 128
    caches = []
    for _ in range(a.layers):
        kc = np.zeros((n * per_seq, row), np.uint8)
        ops.kv_store(ctype, rng.standard_normal((n * per_seq, Hkv * hd)).astype(np.float32), kc)
        caches.append((kc, kc[::-1].copy()))
    qkv = rng.standard_normal((n, (H + 2 * Hkv) * hd)).astype(np.float32)
    out = np.zeros((n, H * hd), np.float32)
    none = np.zeros(0, np.float32)
    sweep = np.ones(max(int(a.sweep_mb * 2**20) // 4, 1), np.float32)

    def inputs(c: int):
        pos = np.full(n, c - 1, np.int32)
        kv_idx = (np.arange(n, dtype=np.int32) * per_seq + c - 1).astype(np.int32)
        listed = (np.arange(n)[:, None] * per_seq + np.arange(c)[None, :]).astype(np.int32).ravel()
        ranges = np.stack([np.arange(n) * c, np.full(n, c)], axis=1).astype(np.int32)
        return pos, kv_idx, listed, ranges

    def per_layer_us(c: int, nt: int) -> float:
        pos, kv_idx, listed, ranges = inputs(c)
        total = 0.0
        for r in range(a.rounds + 2):
            for kc, vc in caches:
                if a.sweep_mb > 0:
                    sweep.sum()
                t0 = time.perf_counter()
                ops.attention(qkv, kc, vc, pos, kv_idx, listed, ranges, none, none, out, H, Hkv, hd, hd, 0,
                              10000.0, 1.0, 1e-5, 1.0 / np.sqrt(hd), nt, ctype, ctype)
                if r >= 2:  # two warm-up passes
                    total += time.perf_counter() - t0
        return total / (a.rounds * a.layers) * 1e6

    results: dict[tuple[int, int], list[float]] = {}
    for _ in range(a.legs):
        for c in cells:
            for nt in threads:
                results.setdefault((c, nt), []).append(per_layer_us(c, nt))
    print(f"attention, {n} tokens, {H} heads over {Hkv} kv heads, head size {hd}, {a.cache_type} cache, "
          f"{a.layers} layers' caches, sweep {a.sweep_mb:g} MB; us per layer, legs in order")
    for (c, nt), v in results.items():
        print(f"  cells {c:4d}  threads {nt}: " + " / ".join(f"{x:7.1f}" for x in v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
