"""Matrix products against weights kept in their GGUF block layout, with ggml's arithmetic.

`mul_mat_q` quantizes the activation rows to the weight type's vec_dot_type exactly as ggml's
reference quantizers do (Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for the K-quants,
F16/BF16 for F16/BF16 weights), then forms integer dot products per block and applies the block
scales as ggml's vec_dot_* do. The kernels are C (ggml_quants.h): AVX2 when the build targets it
(several activation rows per unpacked weight block), a portable scalar path otherwise or on
request (`portable=True`), both computing the same integer block sums; their float results
differ only by summation order, within (k + 16) * 2^-24 * sum|terms| (see ggml_quants.h).

`mul_mat_q_blas` is the prompt-sized alternative: weight tiles dequantized to float32 (exactly,
as gguf/ggml dequantize) and multiplied by BLAS sgemm with float32 activations, i.e. ggml's
arithmetic with BLAS rather than its quantized-activation arithmetic. `prompt_rows_min()` is the
row count from which it is faster on the measured machine (bench/bench_qmatmul.py).

Every function validates its arguments (ValueError with the reason) before releasing the GIL.
`bind_mul_mat_q`, `bind_mul_mat_q_x8_parts` and `bind_get_rows_q` validate them once and return the
kernel as a NativeStep (plan.pyx) for a bound graph (the row ids are still checked at every run).
"""
from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.stdlib cimport malloc, free

from pyllama._fast.plan cimport NativeStep, bound, step_for

import numpy as np

cdef void pool_run(int n_threads, int64_t n_items, pool_item_fn fn, void *ctx) noexcept nogil:
    """fn(ctx, i) for i < n_items on the calling thread and up to n_threads - 1 of the pool's helpers."""
    pq_pool_run(n_threads, n_items, <pq_item_fn>fn, ctx)


# The pool's test hook: items that record which OS thread ran them, when and how often, each busy
# for a while so that the jobs of concurrent callers overlap.
cdef extern from *:
    """
    #include "ggml_quants.h"
    typedef struct { int32_t *who; int32_t *runs; int64_t *when; int64_t busy_ns; } pq_trace_job;
    static void pq_trace_item(void *ctx, int64_t i) {
        const pq_trace_job *j = (const pq_trace_job *)ctx;
        const int64_t t0 = pq_now_ns();
        __atomic_fetch_add(&j->runs[i], 1, __ATOMIC_RELAXED);
        j->who[i] = (int32_t)syscall(SYS_gettid);
        j->when[i] = t0;
        while (pq_now_ns() - t0 < j->busy_ns) pq_cpu_relax();
    }
    """
    ctypedef struct pq_trace_job:
        int32_t *who
        int32_t *runs
        int64_t *when
        int64_t busy_ns
    void pq_trace_item(void *ctx, int64_t i) noexcept nogil


def _pool_trace(int n_threads, int32_t[::1] who, int32_t[::1] runs, int64_t[::1] when, int64_t busy_ns=0):
    """Test hook: pool_run(n_threads, len(who), ...) over items that each store the OS thread id
    (threading.get_native_id()) that ran them in who[i] and their start (CLOCK_MONOTONIC, ns) in
    when[i], add 1 to runs[i], and stay busy busy_ns."""
    if who.shape[0] == 0 or runs.shape[0] != who.shape[0] or when.shape[0] != who.shape[0]:
        raise ValueError("_pool_trace: who, runs and when must be non-empty and of one length")
    cdef pq_trace_job j
    j.who = &who[0]
    j.runs = &runs[0]
    j.when = &when[0]
    j.busy_ns = busy_ns
    with nogil:
        pool_run(n_threads, who.shape[0], <pool_item_fn>pq_trace_item, &j)

# Weight types accepted by mul_mat_q / get_rows_q (gguf.GGMLQuantizationType values).
DEF T_Q8_1 = 9
DEF T_Q8_K = 15
_SUPPORTED = (0, 1, 30, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, 39, 16, 17, 18, 19, 21, 22, 29, 34, 35)
_VEC_TYPES = (0, 1, 30, 8, 9, 15)

# Rows of x from which mul_mat_q_blas beats mul_mat_q: measured on one AVX2 core (Q4_K, k = 768,
# m = 2048) the integer path gives 33-35 GMAC/s at 32..128 rows and 24 at 512, dequantized
# tiles + OpenBLAS 19-28 GMAC/s at 32..128 rows and 34 at 512.
DEF PROMPT_ROWS_MIN = 256
# Weight rows dequantized per BLAS tile: 1 MiB or so of float32 at k = 768..4096.
DEF BLAS_TILE_ELEMS = 262144


def _name(int qtype):
    try:
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(qtype).name
    except Exception:
        return f"type id {qtype}"


cdef pq_traits _traits(int qtype, tuple allowed, str what) except *:
    cdef pq_traits tr
    if qtype not in allowed or not pq_get_traits(qtype, &tr):
        names = ", ".join(_name(t) for t in allowed)
        raise ValueError(f"{what}: unsupported type {_name(qtype)} (supported: {names})")
    return tr


cdef int64_t _row_bytes(pq_traits tr, int qtype, int64_t k, str what) except -1:
    if k < 0:
        raise ValueError(f"{what}: row length must be >= 0, got {k}")
    if k % tr.block:
        raise ValueError(
            f"{what}: a row of {k} elements is not a whole number of {_name(qtype)} blocks of {tr.block}")
    return k // tr.block * tr.bytes


def supported_types() -> tuple:
    """ggml type ids that mul_mat_q and get_rows_q accept."""
    return _SUPPORTED


def have_avx2() -> bool:
    """True when this build contains the AVX2 kernels (else only the portable path)."""
    return bool(pq_have_avx2())


def prompt_rows_min() -> int:
    """Rows of x from which mul_mat_q_blas is faster than mul_mat_q on the measured machine."""
    return PROMPT_ROWS_MIN


def vec_dot_type(int qtype) -> int:
    """The activation type ggml quantizes x to for a dot product with weights of `qtype`."""
    return _traits(qtype, _SUPPORTED, "vec_dot_type").vec_type


def row_bytes(int qtype, Py_ssize_t k) -> int:
    """Bytes of one row of k elements of `qtype` (weight or activation type); ValueError if k is
    not a whole number of blocks."""
    cdef pq_traits tr = _traits(qtype, _SUPPORTED + (T_Q8_1, T_Q8_K), "row_bytes")
    return _row_bytes(tr, qtype, k, "row_bytes")


def quantize_rows(x, int vec_type):
    """x: float32 [n, k] -> uint8 [n, row_bytes(vec_type, k)], each row quantized as ggml's
    reference quantizer for `vec_type` (F32, F16, BF16, Q8_0, Q8_1 or Q8_K) does."""
    cdef pq_traits tr = _traits(vec_type, _VEC_TYPES, "quantize_rows")
    arr = np.ascontiguousarray(x, dtype=np.float32)
    if arr.ndim != 2:
        raise ValueError(f"quantize_rows: x must be 2-D, got shape {arr.shape}")
    cdef const float[:, ::1] xv = arr
    cdef int64_t n = xv.shape[0], k = xv.shape[1]
    cdef int64_t rb = _row_bytes(tr, vec_type, k, "quantize_rows")
    out = np.zeros((n, rb), dtype=np.uint8)
    if n == 0 or k == 0:
        return out
    cdef uint8_t[:, ::1] ov = out
    cdef int64_t r
    with nogil:
        for r in range(n):
            pq_quantize_row(vec_type, &xv[r, 0], &ov[r, 0], k)
    return out


def int_block_sums(xq, w, int qtype, Py_ssize_t k):
    """The integer sums per block (and sub-block) that the portable path forms for one weight
    row `w` (uint8, row_bytes(qtype, k)) and one quantized activation row `xq` (uint8,
    row_bytes(vec_dot_type(qtype), k)): int32 [n_blocks, ints], ints per type as documented in
    ggml_quants.h (pq_isums_*). Float types (F32, F16, BF16) have none: ValueError."""
    cdef pq_traits tw = _traits(qtype, _SUPPORTED, "int_block_sums")
    if tw.ints == 0:
        raise ValueError(f"int_block_sums: {_name(qtype)} has no integer block sums")
    cdef pq_traits tx = tw
    pq_get_traits(tw.vec_type, &tx)
    cdef int64_t wb = _row_bytes(tw, qtype, k, "int_block_sums")
    cdef int64_t xb = _row_bytes(tx, tw.vec_type, k, "int_block_sums")
    cdef const uint8_t[::1] wv = np.ascontiguousarray(w, dtype=np.uint8).reshape(-1)
    cdef const uint8_t[::1] xv = np.ascontiguousarray(xq, dtype=np.uint8).reshape(-1)
    if wv.shape[0] != wb:
        raise ValueError(f"int_block_sums: w has {wv.shape[0]} bytes, a {_name(qtype)} row of {k} needs {wb}")
    if xv.shape[0] != xb:
        raise ValueError(f"int_block_sums: xq has {xv.shape[0]} bytes, a {_name(tw.vec_type)} row of {k} needs {xb}")
    cdef int64_t nb = k // tw.block
    out = np.zeros((nb, tw.ints), dtype=np.int32)
    if nb == 0:
        return out
    cdef int32_t[:, ::1] ov = out
    with nogil:
        pq_isums_row(qtype, nb, &wv[0], &xv[0], &ov[0, 0])
    return out


cdef int64_t _check_matmul(str what, int qtype, pq_traits tr, const float[:, ::1] x, const uint8_t[:, ::1] w,
                           float[:, :] out, bias, int n_threads) except -1:
    cdef int64_t k = x.shape[1]
    cdef int64_t rb = _row_bytes(tr, qtype, k, what)
    if w.shape[1] != rb:
        raise ValueError(
            f"{what}: weight rows have {w.shape[1]} bytes, a {_name(qtype)} row of {k} elements needs {rb}")
    _check_out(what, x.shape[0], w.shape[0], out, bias, n_threads)
    return rb


cdef int _check_out(str what, int64_t n, int64_t m, float[:, :] out, bias, int n_threads) except -1:
    """out: n x m with contiguous rows; bias None or float32 [m]; n_threads >= 1."""
    if out.shape[0] != n or out.shape[1] != m:
        raise ValueError(f"{what}: out is {out.shape[0]}x{out.shape[1]}, expected {n}x{m}")
    if m > 1 and out.strides[1] != 4:
        raise ValueError(f"{what}: the elements of each row of out must be contiguous")
    if n > 1 and out.strides[0] % 4:
        raise ValueError(f"{what}: the row stride of out must be a whole number of floats")
    if bias is not None:
        b = np.asarray(bias)
        if b.dtype != np.float32 or b.ndim != 1 or b.shape[0] != m:
            raise ValueError(f"{what}: bias must be float32 [{m}], got {b.dtype} {b.shape}")
    if n_threads < 1:
        raise ValueError(f"{what}: n_threads must be >= 1, got {n_threads}")
    return 0


cdef struct MqJob:
    int t, portable, nt
    const float *x
    int64_t n, k, ldx, m, wstride, ldo, xq_stride
    const uint8_t *w
    float *out
    const float *bias


cdef int _mq_setup(MqJob* j, const float[:, ::1] x, const uint8_t[:, ::1] w, int qtype, float[:, :] out, bias,
                   int n_threads, bint portable, list keep) except -1:
    """Checks the arguments and fills j; its scratch is xq_stride bytes per row of x. 0: nothing
    to compute; 2: k is 0 (out is the bias), left to mul_mat_q."""
    cdef pq_traits tr = _traits(qtype, _SUPPORTED, "mul_mat_q")
    _check_matmul("mul_mat_q", qtype, tr, x, w, out, bias, n_threads)
    cdef int64_t n = x.shape[0], k = x.shape[1], m = w.shape[0]
    if n == 0 or m == 0:
        return 0
    if k == 0:
        return 2
    cdef pq_traits tx = tr
    pq_get_traits(tr.vec_type, &tx)
    j.xq_stride = k // tx.block * tx.bytes
    if qtype in (1, 30):  # F16 / BF16: room for the activations widened to floats (ggml_quants.h)
        j.xq_stride = 4 * k
    cdef const float[::1] bv
    j.bias = NULL
    if bias is not None:
        bv = bias
        j.bias = &bv[0]
        keep.append(bv)
    j.t = qtype
    j.portable = portable
    j.nt = n_threads
    j.x = &x[0, 0]
    j.n = n
    j.k = k
    j.ldx = x.strides[0] // 4 if n > 1 else k
    j.w = &w[0, 0]
    j.m = m
    j.wstride = w.strides[0] if m > 1 else w.shape[1]
    j.out = &out[0, 0]
    j.ldo = out.strides[0] // 4 if n > 1 else m
    keep.extend((x, w, out))
    return 1


cdef int _mq_run(void* ctx, unsigned char* scratch) noexcept nogil:
    cdef MqJob *j = <MqJob *>ctx
    pq_mul_mat(j.t, j.x, j.n, j.k, j.ldx, j.w, j.m, j.wstride, j.out, j.ldo, j.bias, scratch, j.xq_stride, j.nt,
               j.portable)
    return 0


def mul_mat_q(const float[:, ::1] x, const uint8_t[:, ::1] w, int qtype, float[:, :] out, bias=None,
              int n_threads=1, bint portable=False):
    """out[n, m] = x[n, k] @ dequant(w[m, :]).T (+ bias[m]) with ggml's arithmetic.

    x: float32 [n, k], C-contiguous. w: uint8 [m, row_bytes(qtype, k)] (memory maps are fine).
    out: float32 [n, m] whose rows may be strided (a column slice of a wider array).
    bias: float32 [m] or None. n_threads: threads of the products' pool (ggml_quants.h) over tiles
    of weight rows, handed out one at a time, the caller among them (products under ~10 us of
    work use one thread); results do not depend on it.
    portable: force the scalar path (tests). The GIL is released while computing.
    """
    cdef MqJob j
    cdef int what = _mq_setup(&j, x, w, qtype, out, bias, n_threads, portable, [])
    if what == 0:
        return
    if what == 2:  # no elements: out is the bias
        out[:, :] = 0.0
        if bias is not None:
            np.asarray(out)[:] += np.asarray(bias)
        return
    cdef uint8_t *xq = <uint8_t *>malloc(j.n * j.xq_stride + 64)
    if xq == NULL:
        raise MemoryError("mul_mat_q: cannot allocate the quantized activations")
    with nogil:
        _mq_run(&j, xq)
    free(xq)


def bind_mul_mat_q(checked, const float[:, ::1] x, const uint8_t[:, ::1] w, int qtype, float[:, :] out,
                   bias=None, int n_threads=1):
    """mul_mat_q bound to these arrays as a NativeStep (plan.pyx), or None where mul_mat_q has
    nothing to compute or no product to form (k = 0)."""
    cdef NativeStep s = step_for(sizeof(MqJob), checked)
    cdef list keep = []
    if _mq_setup(<MqJob *>s.ctx, x, w, qtype, out, bias, n_threads, False, keep) != 1:
        return None
    return bound(s, _mq_run, keep, (<MqJob *>s.ctx).n * (<MqJob *>s.ctx).xq_stride + 64)


DEF PQ_MAX_PARTS = 8   # ggml_x8.h's PQ_X8_MAX_PARTS, for the arrays below

cdef extern from "ggml_x8.h" nogil:
    int pq_x8_block_bytes(int t)
    int pq_x8_block_elems(int t)
    int pq_have_x8()
    int pq_repack_x8(int t, const uint8_t *w, int64_t m, int64_t wstride, int64_t k, uint8_t *out)
    int PQ_X8_MAX_PARTS
    int pq_mul_mat_x8_parts(int nparts, const int *types, const uint8_t *const *wps, const int64_t *ms,
                            const float *const *biases, const float *x, int64_t n, int64_t k, int64_t ldx,
                            float *out, int64_t ldo, uint8_t *xq, int64_t xq_stride, int n_threads)


def x8_types() -> tuple:
    """Weight types that repack_x8 lays out in groups of 8 rows (empty without the AVX2 kernels):
    Q4_0, Q8_0, Q4_K, Q5_K, Q6_K."""
    return tuple(t for t in _SUPPORTED if pq_x8_block_bytes(t)) if pq_have_x8() else ()


def repack_x8(const uint8_t[:, ::1] w, int qtype, Py_ssize_t k):
    """w: m rows (m a multiple of 8) of k elements of `qtype` (one of x8_types()) -> the same weights
    in groups of 8 rows (ggml_x8.h), a 64-byte aligned uint8 [m // 8, packed bytes per group]
    for mul_mat_q_x8. ValueError for another type, a row count not a multiple of 8, or a build
    without the AVX2 kernels."""
    cdef pq_traits tr = _traits(qtype, _SUPPORTED, "repack_x8")
    if qtype not in x8_types():
        raise ValueError(f"repack_x8: {_name(qtype)} weights are not repacked in this build")
    cdef int64_t rb = _row_bytes(tr, qtype, k, "repack_x8")
    cdef int64_t m = w.shape[0]
    if w.shape[1] != rb:
        raise ValueError(f"repack_x8: weight rows have {w.shape[1]} bytes, a {_name(qtype)} row of {k} needs {rb}")
    if m % 8:
        raise ValueError(f"repack_x8: {m} rows is not a multiple of 8")
    cdef int64_t gb = k // pq_x8_block_elems(qtype) * pq_x8_block_bytes(qtype)
    raw = np.empty(m // 8 * gb + 64, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64
    out = raw[start:start + m // 8 * gb].reshape(m // 8, gb)
    if m == 0 or k == 0:
        return out
    cdef uint8_t[:, ::1] ov = out
    cdef int qt = qtype
    cdef int64_t ws = w.strides[0]
    with nogil:
        pq_repack_x8(qt, &w[0, 0], m, ws, k, &ov[0, 0])
    return out


def mul_mat_q_x8(const float[:, ::1] x, const uint8_t[:, ::1] wp, int qtype, float[:, :] out, bias=None,
                 int n_threads=1):
    """As mul_mat_q, against weights repacked by repack_x8 (wp: [m // 8, packed bytes per group]);
    the same integer sums, results within the same rounding bound."""
    mul_mat_q_x8_parts(x, [wp], [qtype], out, bias, n_threads)


cdef struct X8Job:
    int nparts, nt
    int types[PQ_MAX_PARTS]
    const uint8_t *wps[PQ_MAX_PARTS]
    int64_t ms[PQ_MAX_PARTS]
    const float *bptr[PQ_MAX_PARTS]
    bint has_bias
    const float *x
    int64_t n, k, ldx, ldo, xq_stride
    float *out


cdef int _x8_setup(X8Job *j, const float[:, ::1] x, list parts, list qtypes, float[:, :] out, bias,
                   int n_threads, list keep) except -1:
    """Checks the arguments and fills j; its scratch is xq_stride bytes per row of x. 0: nothing
    to compute; 2: k is 0 (out is the bias), left to mul_mat_q_x8_parts."""
    cdef int nparts = len(parts)
    if nparts < 1 or nparts > PQ_X8_MAX_PARTS or len(qtypes) != nparts:
        raise ValueError(f"mul_mat_q_x8: 1..{PQ_X8_MAX_PARTS} parts with one type each, got {nparts} and {len(qtypes)}")
    cdef int64_t n = x.shape[0], k = x.shape[1], m = out.shape[1]
    cdef const uint8_t[:, ::1] wv
    cdef int64_t rows = 0
    cdef int p
    for p in range(nparts):
        qt = qtypes[p]
        if qt not in x8_types():
            raise ValueError(f"mul_mat_q_x8: {_name(qt)} weights are not repacked in this build")
        if k % pq_x8_block_elems(qt):
            raise ValueError(f"mul_mat_q_x8: a row of {k} elements is not a whole number of {_name(qt)} blocks "
                             f"of {pq_x8_block_elems(qt)}")
        if vec_dot_type(qt) != vec_dot_type(qtypes[0]):
            raise ValueError(f"mul_mat_q_x8: parts of {_name(qtypes[0])} and {_name(qt)} quantize x differently")
        wv = parts[p]
        if wv.shape[0] == 0 or wv.shape[1] != k // pq_x8_block_elems(qt) * pq_x8_block_bytes(qt):
            raise ValueError(f"mul_mat_q_x8: packed weight {wv.shape[0]}x{wv.shape[1]} does not hold rows of {k} "
                             f"{_name(qt)} elements")
        j.types[p] = qt
        j.ms[p] = wv.shape[0] * 8
        j.wps[p] = &wv[0, 0]
        keep.append(wv)
        rows += j.ms[p]
    if rows != m:
        raise ValueError(f"mul_mat_q_x8: the packed weights do not hold {m} rows (they have {rows})")
    _check_out("mul_mat_q_x8", n, m, out, bias, n_threads)
    if n == 0:
        return 0
    if k == 0:
        return 2
    cdef const float[::1] bv
    j.has_bias = bias is not None
    if bias is not None:
        bv = np.ascontiguousarray(bias)
        keep.append(bv)
        rows = 0
        for p in range(nparts):
            j.bptr[p] = &bv[rows]
            rows += j.ms[p]
    cdef pq_traits tx
    pq_get_traits(vec_dot_type(qtypes[0]), &tx)
    j.nparts = nparts
    j.nt = n_threads
    j.x = &x[0, 0]
    j.n = n
    j.k = k
    j.ldx = x.strides[0] // 4 if n > 1 else k
    j.out = &out[0, 0]
    j.ldo = out.strides[0] // 4 if n > 1 else m
    j.xq_stride = k // tx.block * tx.bytes
    keep.extend((x, out))
    return 1


cdef int _x8_run(void* ctx, unsigned char* scratch) noexcept nogil:
    cdef X8Job *j = <X8Job *>ctx
    cdef const float **bpp = NULL
    if j.has_bias:
        bpp = j.bptr
    pq_mul_mat_x8_parts(j.nparts, j.types, j.wps, j.ms, bpp, j.x, j.n, j.k, j.ldx, j.out, j.ldo, scratch,
                        j.xq_stride, j.nt)
    return 0


def mul_mat_q_x8_parts(const float[:, ::1] x, list parts, list qtypes, float[:, :] out, bias=None,
                       int n_threads=1):
    """out[:, the parts' rows side by side] = x @ (each repacked weight of `parts`, of its type in
    `qtypes`).T (+ bias), as one product: x is quantized once and one pool run covers every part's
    tiles (a MUL_MAT_CAT of q|k|v or gate|up). Parts as repack_x8 returns them."""
    cdef X8Job j
    cdef list keep = []
    cdef int what = _x8_setup(&j, x, parts, qtypes, out, bias, n_threads, keep)
    if what == 0:
        return
    if what == 2:
        out[:, :] = 0.0
        if bias is not None:
            np.asarray(out)[:] += np.asarray(bias)
        return
    cdef uint8_t *xq = <uint8_t *>malloc(j.n * j.xq_stride + 64)
    if xq == NULL:
        raise MemoryError("mul_mat_q_x8: cannot allocate the quantized activations")
    with nogil:
        _x8_run(&j, xq)
    free(xq)


def bind_mul_mat_q_x8_parts(checked, const float[:, ::1] x, list parts, list qtypes, float[:, :] out, bias=None,
                            int n_threads=1):
    """mul_mat_q_x8_parts bound to these arrays as a NativeStep, or None where it has nothing to
    compute or no product to form (k = 0)."""
    cdef NativeStep s = step_for(sizeof(X8Job), checked)
    cdef list keep = []
    if _x8_setup(<X8Job *>s.ctx, x, parts, qtypes, out, bias, n_threads, keep) != 1:
        return None
    return bound(s, _x8_run, keep, (<X8Job *>s.ctx).n * (<X8Job *>s.ctx).xq_stride + 64)


def dequantize_rows(const uint8_t[:, ::1] w, int qtype, Py_ssize_t k, Py_ssize_t j0, Py_ssize_t j1,
                    float[:, ::1] out, int n_threads=1):
    """Weight rows [j0, j1) of w (k elements each) dequantized bit-exactly into out[j1 - j0, k]."""
    cdef pq_traits tr = _traits(qtype, _SUPPORTED, "dequantize_rows")
    cdef int64_t rb = _row_bytes(tr, qtype, k, "dequantize_rows")
    if w.shape[1] != rb:
        raise ValueError(f"dequantize_rows: weight rows have {w.shape[1]} bytes, expected {rb}")
    if not (0 <= j0 <= j1 <= w.shape[0]):
        raise ValueError(f"dequantize_rows: rows [{j0}, {j1}) outside 0..{w.shape[0]}")
    if out.shape[0] != j1 - j0 or out.shape[1] != k:
        raise ValueError(f"dequantize_rows: out is {out.shape[0]}x{out.shape[1]}, expected {j1 - j0}x{k}")
    if j1 == j0 or k == 0:
        return
    cdef int qt = qtype
    cdef int64_t wstride = w.strides[0]
    with nogil:
        pq_dequant_rows(qt, &w[0, 0], wstride, k, j0, j1, &out[0, 0], n_threads)


def mul_mat_q_blas(const float[:, ::1] x, const uint8_t[:, ::1] w, int qtype, out, bias=None,
                   int n_threads=1):
    """As mul_mat_q, but weight tiles are dequantized to float32 and multiplied by BLAS with the
    float32 activations (no activation quantization): the faster path for prompts of
    prompt_rows_min() rows or more. BLAS uses its own thread pool."""
    cdef pq_traits tr = _traits(qtype, _SUPPORTED, "mul_mat_q_blas")
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 2:
        raise ValueError("mul_mat_q_blas: out must be a 2-D float32 array")
    _check_matmul("mul_mat_q_blas", qtype, tr, x, w, out, bias, n_threads)
    cdef int64_t n = x.shape[0], k = x.shape[1], m = w.shape[0]
    if n == 0 or m == 0:
        return
    xa = np.asarray(x)
    tile_rows = max(1, min(m, BLAS_TILE_ELEMS // max(k, 1)))
    tile = np.empty((tile_rows, k), dtype=np.float32)
    for j0 in range(0, m, tile_rows):
        j1 = min(m, j0 + tile_rows)
        t = tile[: j1 - j0]
        dequantize_rows(w, qtype, k, j0, j1, t, n_threads)
        np.matmul(xa, t.T, out=out[:, j0:j1])
    if bias is not None:
        out += np.asarray(bias, dtype=np.float32)


cdef struct GrJob:
    int t, nt
    const uint8_t *w
    int64_t wstride, k, n, m
    const int32_t *ids
    float *out


cdef int _gr_setup(GrJob *j, const uint8_t[:, ::1] w, int qtype, const int32_t[::1] ids, float[:, ::1] out,
                   int n_threads) except -1:
    """Checks the shapes and fills j (the ids are checked by _gr_ids_ok); 0: nothing to compute."""
    cdef pq_traits tr = _traits(qtype, _SUPPORTED, "get_rows_q")
    cdef int64_t n = ids.shape[0], k = out.shape[1], m = w.shape[0]
    cdef int64_t rb = _row_bytes(tr, qtype, k, "get_rows_q")
    if w.shape[1] != rb:
        raise ValueError(
            f"get_rows_q: weight rows have {w.shape[1]} bytes, a {_name(qtype)} row of {k} elements needs {rb}")
    if out.shape[0] != n:
        raise ValueError(f"get_rows_q: out has {out.shape[0]} rows for {n} ids")
    if n_threads < 1:
        raise ValueError(f"get_rows_q: n_threads must be >= 1, got {n_threads}")
    if n == 0 or k == 0 or m == 0:  # (m = 0 with ids: none is in range, which _gr_ids_ok says)
        j.n = n
        j.m = m
        j.ids = &ids[0] if n else NULL
        return 0
    j.t = qtype
    j.nt = n_threads
    j.w = &w[0, 0]
    j.wstride = w.strides[0] if m > 1 else rb
    j.k = k
    j.n = n
    j.m = m
    j.ids = &ids[0]
    j.out = &out[0, 0]
    return 1


cdef bint _gr_ids_ok(GrJob *j) noexcept nogil:
    cdef int64_t i
    for i in range(j.n):
        if j.ids[i] < 0 or j.ids[i] >= j.m:
            return False
    return True


cdef int _gr_run(void* ctx, unsigned char* scratch) noexcept nogil:
    cdef GrJob *j = <GrJob *>ctx
    if not _gr_ids_ok(j):
        return 1
    pq_get_rows(j.t, j.w, j.wstride, j.k, j.ids, j.n, j.out, j.k, j.nt)
    return 0


def get_rows_q(const uint8_t[:, ::1] w, int qtype, const int32_t[::1] ids, float[:, ::1] out, int n_threads=1):
    """out[i] = dequant(w[ids[i]]) bit-exactly as gguf/ggml dequantize (the token embedding
    lookup). w: uint8 [m, row_bytes(qtype, k)] with k = out.shape[1]; ids bounds-checked."""
    cdef GrJob j
    cdef int what = _gr_setup(&j, w, qtype, ids, out, n_threads)
    cdef int64_t i
    if not _gr_ids_ok(&j):
        for i in range(j.n):
            if ids[i] < 0 or ids[i] >= j.m:
                raise ValueError(f"get_rows_q: id {ids[i]} at position {i} is outside 0..{j.m - 1}")
    if what:
        with nogil:
            _gr_run(&j, NULL)


def bind_get_rows_q(checked, const uint8_t[:, ::1] w, int qtype, const int32_t[::1] ids, float[:, ::1] out,
                    int n_threads=1):
    """get_rows_q bound as a NativeStep (the ids checked at every run), or None for no rows."""
    cdef NativeStep s = step_for(sizeof(GrJob), checked)
    if not _gr_setup(<GrJob *>s.ctx, w, qtype, ids, out, n_threads):
        return None
    return bound(s, _gr_run, (w, ids, out))
