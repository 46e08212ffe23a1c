"""Kernel-level throughput of pyllama._fast.qmatmul against the F32 baseline.

For each weight type, a set of (m, k) weight matrices larger than the last-level cache is cycled
through (as a decode step streams every layer's weights from memory), and each product
out[n, m] = x[n, k] @ W.T is timed at n activation rows. Reported per (type, n, threads):

  GB/s     weight bytes read per second (the figure that bounds decode at small n)
  rows/s   activation rows pushed through the whole weight set per second
  GMAC/s   multiply-accumulates per second (the figure that bounds prompts at large n)

The F32 baseline is pyllama._fast.gemm.mul_mat_t up to its small_rows_max() rows and numpy
(BLAS sgemm) above. For n >= 32 the quantized types are also timed through mul_mat_q_blas
(dequantized tiles + BLAS), which decides the prompt path's crossover. Types the CPU backend
repacks in groups of 8 rows (qmatmul.x8_types()) are also timed on that layout ("x8" rows,
mul_mat_q_x8), the kernel the backend uses for them.

    python bench/bench_qmatmul.py                          # all types, n = 1 8 32 512, 1 and 2 threads
    python bench/bench_qmatmul.py --types q4_k,q6_k --n 1,8 --threads 2 --mb 64
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from pyllama._fast import gemm, qmatmul

try:   # BLAS's own thread pool, limited to the row's thread count when threadpoolctl is present
    from threadpoolctl import threadpool_limits
except ImportError:
    threadpool_limits = None


def blas_threads(n: int):
    return threadpool_limits(limits=n, user_api="blas") if threadpool_limits else contextlib.nullcontext()

ALL_TYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0",
             "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs", "mxfp4")
# Byte offsets of each block's f16 scales: set to finite values (random bytes may be inf/nan).
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
              T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
              T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.MXFP4: (),
              T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,), T.IQ1_S: (0,),
              T.IQ1_M: (), T.TQ1_0: (52,), T.TQ2_0: (64,)}
# the grid IQ and ternary types: any bytes are valid blocks once the f16 scale is finite (optional in --types)
IQ_GRID_TYPES = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")
TERNARY_TYPES = ("tq1_0", "tq2_0")


def random_weights(qtype: T, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random weights of (m, k) elements as uint8 [m, row_bytes]."""
    if qtype in (T.F32, T.F16, T.BF16):
        w = rng.standard_normal((m, k), dtype=np.float32) * 0.05
        if qtype == T.F32:
            return w.view(np.uint8)
        if qtype == T.F16:
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (m, k // block, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scales = rng.uniform(0.001, 0.01, (m, k // block)).astype(np.float16)
        raw[:, :, off:off + 2] = scales.view(np.uint8).reshape(m, k // block, 2)
    if qtype == T.MXFP4:   # E8M0 block exponents of scales 2^-10 .. 2^-5
        raw[:, :, 0] = rng.integers(118, 124, (m, k // block))
    if qtype == T.IQ1_M:   # the f16 scale lives in the top nibbles of the 4 scale words (bytes 48..55)
        h = rng.uniform(0.001, 0.01, (m, k // block)).astype(np.float16).view(np.uint16)
        for j in range(4):
            word = raw[:, :, 48 + 2 * j].astype(np.uint16) | (raw[:, :, 49 + 2 * j].astype(np.uint16) << 8)
            word = (word & 0x0FFF) | (((h >> (4 * j)) & 0xF) << 12)
            raw[:, :, 48 + 2 * j] = (word & 0xFF).astype(np.uint8)
            raw[:, :, 49 + 2 * j] = (word >> 8).astype(np.uint8)
    return raw.reshape(m, -1)


def time_call(fn, repeats: int, budget_s: float) -> float:
    """Best wall time of fn() over up to `repeats` runs (the machine may be shared)."""
    fn()
    best = float("inf")
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best


def bench_type(name: str, ns: list[int], threads: list[int], mb: float, m: int, k: int,
               repeats: int, budget_s: float, blas: bool) -> list[tuple]:
    qtype = T[name.upper()]
    rng = np.random.default_rng(0)
    row_bytes = qmatmul.row_bytes(int(qtype), k)
    count = max(1, int(mb * 2**20 // (row_bytes * m)))
    mats = [random_weights(qtype, m, k, rng) for _ in range(count)]
    # the same weights in groups of 8 rows, for the types the backend repacks (ggml_x8.h)
    packed = [qmatmul.repack_x8(w, int(qtype), k) for w in mats] if int(qtype) in qmatmul.x8_types() else []
    total_bytes = count * m * row_bytes
    rows = []
    for n in ns:
        x = rng.standard_normal((n, k), dtype=np.float32)
        out = np.empty((n, m), dtype=np.float32)
        for nt in threads:
            with blas_threads(nt):
                if qtype == T.F32:
                    ws = [mw.view(np.float32) for mw in mats]
                    if n <= gemm.small_rows_max():
                        run = lambda: [gemm.mul_mat_t(x, w, out, None, nt) for w in ws]
                        label = "f32 gemm"
                    else:
                        run = lambda: [np.matmul(x, w.T, out=out) for w in ws]
                        label = "f32 blas"
                else:
                    run = lambda: [qmatmul.mul_mat_q(x, w, int(qtype), out, None, nt) for w in mats]
                    label = name
                t = time_call(run, repeats, budget_s)
                rows.append((label, n, nt, total_bytes / t / 1e9, n / t, n * m * k * count / t / 1e9))
                if packed:
                    run = lambda: [qmatmul.mul_mat_q_x8(x, wp, int(qtype), out, None, nt) for wp in packed]
                    t = time_call(run, repeats, budget_s)
                    rows.append((name + " x8", n, nt, total_bytes / t / 1e9, n / t, n * m * k * count / t / 1e9))
                if blas and qtype != T.F32 and n >= 32:
                    run = lambda: [qmatmul.mul_mat_q_blas(x, w, int(qtype), out, None, nt) for w in mats]
                    t = time_call(run, repeats, budget_s)
                    rows.append((name + " deq+blas", n, nt, total_bytes / t / 1e9, n / t, n * m * k * count / t / 1e9))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default=",".join(ALL_TYPES), help="comma-separated weight types")
    ap.add_argument("--n", default="1,8,32,512", help="activation rows per product")
    ap.add_argument("--threads", default="1,2", help="OpenMP threads")
    ap.add_argument("--mb", type=float, default=48.0, help="weight-set size in MiB (above the LLC)")
    ap.add_argument("--m", type=int, default=2048, help="weight rows per matrix")
    ap.add_argument("--k", type=int, default=768, help="row length")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=float, default=3.0, help="seconds per measurement at most")
    ap.add_argument("--no-blas", action="store_true", help="skip the dequantize+BLAS path")
    args = ap.parse_args(argv)
    types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in types if t not in ALL_TYPES + IQ_GRID_TYPES + TERNARY_TYPES]
    if unknown:
        print(f"bench_qmatmul: unknown type(s) {', '.join(unknown)} (known: {', '.join(ALL_TYPES + IQ_GRID_TYPES + TERNARY_TYPES)})",
              file=sys.stderr)
        return 1
    ns = [int(v) for v in args.n.split(",")]
    threads = [int(v) for v in args.threads.split(",")]
    print(f"avx2 kernels: {qmatmul.have_avx2()}  weights: ~{args.mb:.0f} MiB per type of "
          f"{args.m}x{args.k} matrices")
    print(f"{'kernel':<16} {'n':>5} {'thr':>3} {'GB/s':>8} {'rows/s':>10} {'GMAC/s':>8}")
    for name in types:
        for label, n, nt, gbs, rps, gmac in bench_type(name, ns, threads, args.mb, args.m, args.k,
                                                       args.repeats, args.budget, not args.no_blas):
            print(f"{label:<16} {n:>5} {nt:>3} {gbs:>8.2f} {rps:>10.1f} {gmac:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
