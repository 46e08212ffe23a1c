# cython: language_level=3
"""Matrix products for decode-sized batches: out = x @ w.T (+ bias), w stored (N, K) row-major.

BLAS packs the whole weight matrix on every call; when x has only a few rows that packing costs
more than the product, and a single thread then reads weights at a third of the memory bandwidth.
This kernel streams each weight row once from memory and keeps x in cache: blocks of 4 weight
rows times up to 4 rows of x, accumulated in vector registers along K. Every output element is
summed in the same order whatever the number of rows, so a sequence's logits do not depend on
what else shares its batch. Above `small_rows_max()` rows BLAS is faster and the caller uses it.
`bind_mul_mat_t` returns the product as a NativeStep (plan.pyx) for a bound graph.
"""
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

from pyllama._fast.plan cimport NativeStep, bound, step_for
from pyllama._fast.qmatmul cimport pool_run

cdef extern from "gemm.h" nogil:
    void pl_mm_t_range(const float* x, long M, long K, long ldx, const float* w, long N,
                       float* out, long ldo, const float* bias, long b0, long b1)
    void pl_mm_panel(const float* x, long K, long ldx, const float* w, long N, float* out, long ldo,
                     const float* bias, long n, long m0, long m1, float* pack)
    long pl_panel_width()

# Up to this many rows the kernel beat OpenBLAS on one thread on the AVX-512 machine it was tuned
# on; above it BLAS's packed micro-kernels win. The crossover depends on the vector width and the
# caches: bench/bench_gemm.py measures it side by side on the machine at hand.
DEF SMALL_ROWS_MAX = 32
# Weight-row blocks per thread chunk: large enough that a thread streams whole pages of w.
DEF CHUNK_BLOCKS = 16


cdef struct Product:  # out[M, N] = x[M, K] @ w[N, K].T (+ bias[N]), rows ldx and ldo floats apart
    const float* x
    long M, K, ldx
    const float* w
    long N
    float* out
    long ldo
    const float* bias


cdef struct MmJob:
    Product p
    long blocks
    int nt


cdef void _mm_item(void* ctx, int64_t c) noexcept nogil:
    cdef MmJob* j = <MmJob*>ctx
    cdef long b0 = c * CHUNK_BLOCKS
    cdef long b1 = b0 + CHUNK_BLOCKS if b0 + CHUNK_BLOCKS < j.blocks else j.blocks
    cdef Product* q = &j.p
    pl_mm_t_range(q.x, q.M, q.K, q.ldx, q.w, q.N, q.out, q.ldo, q.bias, b0, b1)


# Where mul_mat_packed matched OpenBLAS on two threads (AVX-512, 170 GFLOP/s at 235 rows, K 288 and
# 768): from this many rows (below, packing each panel costs more than its product gains) and up to
# this K (the panel stays in L2); elsewhere the caller keeps BLAS.
DEF PACKED_ROWS_MIN = 128
DEF PACKED_K_MAX = 1024
# mul_mat_packed: rows of x per item where a product has few panels (split in parts of about this
# many rows, so that it still spreads over the threads)
DEF PACKED_ROWS = 128


cdef struct PackedJob:
    Product p
    long panels, parts
    int nt
    int failed


cdef void _packed_item(void* ctx, int64_t i) noexcept nogil:
    cdef PackedJob* j = <PackedJob*>ctx
    cdef long p = i // j.parts, part = i % j.parts
    cdef Product* q = &j.p
    cdef long m0 = q.M * part // j.parts, m1 = q.M * (part + 1) // j.parts
    # the panel's copy: K x panel width floats, the item's own (the pool's threads share nothing)
    cdef float* pack = <float*>malloc(sizeof(float) * q.K * pl_panel_width())
    if pack == NULL:
        j.failed = 1
        return
    pl_mm_panel(q.x, q.K, q.ldx, q.w, q.N, q.out, q.ldo, q.bias, p * pl_panel_width(), m0, m1, pack)
    free(pack)


cdef int _product(Product* p, str kernel, const float[:, :] x, const float[:, ::1] w, float[:, :] out, bias,
                  list keep) except -1:
    """Refuses shapes that do not make out[M, N] = x[M, K] @ w[N, K].T (+ bias[N]) and fills p
    (the arrays kept alive in `keep`); 0 when there is nothing to compute (no rows or columns)."""
    cdef Py_ssize_t M = x.shape[0], K = x.shape[1], N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"{kernel}: x has {K} columns, w has {w.shape[1]}")
    if out.shape[0] != M or out.shape[1] != N:
        raise ValueError(f"{kernel}: out is {out.shape[0]}x{out.shape[1]}, expected {M}x{N}")
    if (K > 1 and x.strides[1] != 4) or (N > 1 and out.strides[1] != 4):
        raise ValueError(f"{kernel}: rows of x and out must be contiguous")
    cdef const float[::1] b
    p.bias = NULL
    if bias is not None:
        b = bias
        if b.shape[0] != N:
            raise ValueError(f"{kernel}: bias has {b.shape[0]} elements, expected {N}")
        keep.append(b)
        p.bias = &b[0]
    if M == 0 or N == 0:
        return 0
    p.x = &x[0, 0]
    p.M = M
    p.K = K
    p.ldx = x.strides[0] // 4
    p.w = &w[0, 0]
    p.N = N
    p.out = &out[0, 0]
    p.ldo = out.strides[0] // 4
    keep.extend((x, w, out))
    return 1


cdef int _packed_setup(PackedJob* job, const float[:, :] x, const float[:, ::1] w, float[:, :] out, bias,
                       int n_threads, list keep) except -1:
    """Checks the shapes and fills job; 0 when there is nothing to compute."""
    if not _product(&job.p, "mul_mat_packed", x, w, out, bias, keep) or job.p.K == 0:
        return 0
    cdef long M = job.p.M, N = job.p.N
    job.panels = (N + pl_panel_width() - 1) // pl_panel_width()
    # split the rows only where the panels alone leave threads idle: each part reads and packs
    # its panel again
    job.parts = 1 if job.panels >= 8 * n_threads else (M + PACKED_ROWS - 1) // PACKED_ROWS
    job.nt = n_threads if job.panels * job.parts >= 2 else 1
    return 1


cdef int _packed_run(void* ctx, unsigned char* scratch) noexcept nogil:
    cdef PackedJob* job = <PackedJob*>ctx
    job.failed = 0
    pool_run(job.nt, job.panels * job.parts, _packed_item, job)
    return job.failed


def packed_fits(Py_ssize_t rows, Py_ssize_t k) -> bool:
    """Whether mul_mat_packed is the kernel for a product of `rows` rows of x with K = k."""
    return rows >= PACKED_ROWS_MIN and k <= PACKED_K_MAX


def mul_mat_packed(const float[:, :] x, const float[:, ::1] w, float[:, :] out, bias=None, int n_threads=1):
    """out[M, N] = x[M, K] @ w[N, K].T (+ bias[N]) for many rows of x: the weight in packed panels
    (gemm.h), on the products' pool. Rows of x and out may be strided; their elements must be
    contiguous."""
    cdef PackedJob job
    cdef int failed = 0
    if _packed_setup(&job, x, w, out, bias, n_threads, []):
        with nogil:
            failed = _packed_run(&job, NULL)
    if failed:
        raise MemoryError("mul_mat_packed: cannot allocate a panel")


def bind_mul_mat_packed(checked, const float[:, :] x, const float[:, ::1] w, float[:, :] out, bias=None,
                        int n_threads=1):
    """mul_mat_packed bound as a NativeStep (plan.pyx), or None for an empty product."""
    cdef NativeStep s = step_for(sizeof(PackedJob), checked)
    cdef list keep = []
    if not _packed_setup(<PackedJob *>s.ctx, x, w, out, bias, n_threads, keep):
        return None
    return bound(s, _packed_run, keep)


def small_rows_max() -> int:
    """The most rows of x for which mul_mat_t is the faster kernel."""
    return SMALL_ROWS_MAX


cdef int _mm_setup(MmJob* job, const float[:, :] x, const float[:, ::1] w, float[:, :] out, bias, int n_threads,
                   list keep) except -1:
    """Checks the shapes and fills job; 0 when there is nothing to compute."""
    if not _product(&job.p, "mul_mat_t", x, w, out, bias, keep):
        return 0
    cdef long N = job.p.N
    job.blocks = (N + 3) // 4
    # chunks claimed one at a time on the products' pool: a thread the OS is late to run holds
    # nobody up (an OpenMP static schedule waited for it at the barrier)
    job.nt = n_threads if (job.blocks + CHUNK_BLOCKS - 1) // CHUNK_BLOCKS >= 2 else 1
    return 1


cdef int _mm_run(void* ctx, unsigned char* scratch) noexcept nogil:
    cdef MmJob* job = <MmJob*>ctx
    pool_run(job.nt, (job.blocks + CHUNK_BLOCKS - 1) // CHUNK_BLOCKS, _mm_item, job)
    return 0


def mul_mat_t(const float[:, :] x, const float[:, ::1] w, float[:, :] out, bias=None,
              int n_threads=1):
    """out[M, N] = x[M, K] @ w[N, K].T (+ bias[N]). Rows of x and out may be strided; their
    elements must be contiguous."""
    cdef MmJob job
    if _mm_setup(&job, x, w, out, bias, n_threads, []):
        with nogil:
            _mm_run(&job, NULL)


def bind_mul_mat_t(checked, const float[:, :] x, const float[:, ::1] w, float[:, :] out, bias=None,
                   int n_threads=1):
    """mul_mat_t bound to these arrays as a NativeStep (plan.pyx), or None for an empty product."""
    cdef NativeStep s = step_for(sizeof(MmJob), checked)
    cdef list keep = []
    if not _mm_setup(<MmJob *>s.ctx, x, w, out, bias, n_threads, keep):
        return None
    return bound(s, _mm_run, keep)
