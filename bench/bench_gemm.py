"""Where the streaming F32 kernel (`_fast/gemm.pyx` mul_mat_t) stops beating BLAS, by row count.

    python bench/bench_gemm.py [--k 2048] [--n 5632] [--rows 1,2,4,8,16,24,32,48,64,128] [--threads 1]

For each row count M it times out[M, N] = x[M, K] @ w[N, K].T with the streaming kernel and with
numpy's matmul (OpenBLAS, limited to the same threads), side by side in this one run, and prints
both and their ratio (BLAS time / kernel time: above 1 the kernel is faster). The CPU backend
sends products of at most `gemm.small_rows_max()` rows to the kernel; the crossover this prints on
a machine is the evidence for that bound there (it depends on the vector width and the caches).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pyllama._fast import gemm  # noqa: E402
from pyllama.backend.cpu import set_compute_threads  # noqa: E402


def best_of(fn, min_s: float = 0.2, reps: int = 5) -> float:
    """Seconds per call: the best of `reps` rounds, each repeating fn for at least min_s."""
    fn()
    best = float("inf")
    for _ in range(reps):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_s:
                break
        best = min(best, dt / n)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=2048, help="columns of x (the model width)")
    ap.add_argument("--n", type=int, default=5632, help="rows of w (output features)")
    ap.add_argument("--rows", default="1,2,4,8,16,24,32,48,64,128", help="row counts of x to try")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    set_compute_threads(args.threads)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((args.n, args.k), dtype=np.float32)
    print(f"K={args.k} N={args.n} threads={args.threads}; small_rows_max={gemm.small_rows_max()}")
    print(f"{'rows':>5} {'kernel ms':>10} {'BLAS ms':>10} {'BLAS/kernel':>12}")
    for m in (int(r) for r in args.rows.split(",")):
        x = rng.standard_normal((m, args.k), dtype=np.float32)
        out_k = np.empty((m, args.n), dtype=np.float32)
        out_b = np.empty((m, args.n), dtype=np.float32)
        tk = best_of(lambda: gemm.mul_mat_t(x, w, out_k, None, args.threads))
        tb = best_of(lambda: np.matmul(x, w.T, out=out_b))
        if not np.allclose(out_k, out_b, rtol=1e-3, atol=1e-3):
            print(f"rows {m}: the kernel and BLAS disagree", file=sys.stderr)
            return 1
        print(f"{m:>5} {tk * 1e3:>10.3f} {tb * 1e3:>10.3f} {tb / tk:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
