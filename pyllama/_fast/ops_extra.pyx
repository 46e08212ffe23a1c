# cython: language_level=3
"""CPU kernels of the element-wise ops the gemma family adds: GeGLU (its FFN activation), a
scale by a constant (its embedding scale) and tanh soft-capping (gemma2's final logits).

Each checks its shapes while it holds the GIL (a graph may come from the wire), then runs
without it. GeGLU is split over the products' worker pool like SwiGLU (ops.pyx); the other two
touch one row per token (or the logits once) and run on the calling thread.
"""
from libc.math cimport tanh
from libc.stdint cimport int64_t

from pyllama._fast.qmatmul cimport pool_run

DEF PARALLEL_MIN_ELEMENTS = 16384  # geglu elements below which one thread does it all
DEF GEGLU_CHUNK = 2048             # geglu elements per item
# gelu's tanh form: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
DEF SQRT_2_OVER_PI = 0.7978845608028654
DEF GELU_COEF_A = 0.044715


cdef struct GluJob:
    const float* gu
    float* out
    Py_ssize_t f, chunks


cdef inline float _gelu(float x) noexcept nogil:
    return 0.5 * x * (1.0 + tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)))


cdef void _geglu_item(void* ctx, int64_t item) noexcept nogil:
    # item: (row, chunk of GEGLU_CHUNK columns), so that one long row spreads over the threads too
    cdef GluJob* j = <GluJob*>ctx
    cdef Py_ssize_t r = item // j.chunks, c0 = item % j.chunks * GEGLU_CHUNK, c
    cdef Py_ssize_t c1 = c0 + GEGLU_CHUNK if c0 + GEGLU_CHUNK < j.f else j.f
    cdef const float* gu = j.gu + r * 2 * j.f
    cdef float* out = j.out + r * j.f
    for c in range(c0, c1):
        out[c] = _gelu(gu[c]) * gu[j.f + c]


def geglu(const float[:, ::1] gu, float[:, ::1] out, int n_threads=1):
    """out = gelu_tanh(gu[:, :f]) * gu[:, f:]"""
    cdef Py_ssize_t n = gu.shape[0], f = out.shape[1]
    if gu.shape[1] != 2 * f or out.shape[0] != n:
        raise ValueError(f"geglu: input {(n, gu.shape[1])} and output {(out.shape[0], f)} disagree")
    if n == 0 or f == 0:
        return
    cdef GluJob job
    job.gu = &gu[0, 0]
    job.out = &out[0, 0]
    job.f = f
    job.chunks = (f + GEGLU_CHUNK - 1) // GEGLU_CHUNK
    with nogil:
        pool_run(n_threads if n * f >= PARALLEL_MIN_ELEMENTS else 1, n * job.chunks, _geglu_item, &job)


def scale(const float[:, ::1] x, float[:, ::1] out, float s):
    """out = x * s"""
    cdef Py_ssize_t n = x.shape[0], d = x.shape[1], i, j
    if out.shape[0] != n or out.shape[1] != d:
        raise ValueError(f"scale: input {(n, d)} and output {(out.shape[0], out.shape[1])} disagree")
    with nogil:
        for i in range(n):
            for j in range(d):
                out[i, j] = x[i, j] * s


def softcap(const float[:, ::1] x, float[:, ::1] out, float c):
    """out = c * tanh(x / c), c > 0"""
    cdef Py_ssize_t n = x.shape[0], d = x.shape[1], i, j
    if out.shape[0] != n or out.shape[1] != d:
        raise ValueError(f"softcap: input {(n, d)} and output {(out.shape[0], out.shape[1])} disagree")
    if not c > 0:
        raise ValueError(f"softcap: the cap must be a positive number, not {c}")
    cdef float inv = 1.0 / c
    with nogil:
        for i in range(n):
            for j in range(d):
                out[i, j] = c * <float>tanh(x[i, j] * inv)
