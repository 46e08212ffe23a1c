"""Where the streaming F32 kernel (`_fast/gemm.pyx` mul_mat_t) stops beating BLAS, by row count.

    python bench/bench_gemm.py [--k 2048] [--n 5632] [--rows 1,2,4,8,16,24,32,48,64,128] [--threads 1]
                               [--mats 1]

For each row count M it times out[M, N] = x[M, K] @ w[N, K].T with the streaming kernel and with
numpy's matmul (OpenBLAS, limited to the same threads), side by side in this one run, and prints
both and their ratio (BLAS time / kernel time: above 1 the kernel is faster). The CPU backend
sends products of at most `gemm.small_rows_max()` rows to the kernel; the crossover this prints on
a machine is the evidence for that bound there (it depends on the vector width and the caches).
With `--mats N` each timed call runs the product over N weight matrices in turn, so that with
enough of them (their sum well above the last-level cache a process gets) the weights stream from
memory as a model's do; it also prints the weight bytes read per second.
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
    ap.add_argument("--mats", type=int, default=1, help="weight matrices each call goes through in turn")
    args = ap.parse_args()
    if args.mats < 1:
        ap.error("--mats must be at least 1")
    set_compute_threads(args.threads)
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((args.n, args.k), dtype=np.float32) for _ in range(args.mats)]
    w_bytes = ws[0].nbytes
    print(f"K={args.k} N={args.n} threads={args.threads} mats={args.mats} ({args.mats * w_bytes / 2**20:.0f} MiB); "
          f"small_rows_max={gemm.small_rows_max()}")
    print(f"{'rows':>5} {'kernel ms':>10} {'BLAS ms':>10} {'BLAS/kernel':>12} {'kernel GB/s':>12} {'GFLOP/s':>8}")
    for m in (int(r) for r in args.rows.split(",")):
        x = rng.standard_normal((m, args.k), dtype=np.float32)
        out_k = np.empty((m, args.n), dtype=np.float32)
        out_b = np.empty((m, args.n), dtype=np.float32)

        def kernel() -> None:
            for w in ws:
                gemm.mul_mat_t(x, w, out_k, None, args.threads)

        def blas() -> None:
            for w in ws:
                np.matmul(x, w.T, out=out_b)
        tk = best_of(kernel) / args.mats
        tb = best_of(blas) / args.mats
        if not np.allclose(out_k, out_b, rtol=1e-3, atol=1e-3):
            print(f"rows {m}: the kernel and BLAS disagree", file=sys.stderr)
            return 1
        print(f"{m:>5} {tk * 1e3:>10.3f} {tb * 1e3:>10.3f} {tb / tk:>12.2f} {w_bytes / tk / 1e9:>12.1f} "
              f"{2 * m * args.n * args.k / tk / 1e9:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
