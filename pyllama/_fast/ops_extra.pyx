# cython: language_level=3
"""CPU kernels of two element-wise ops the gemma family adds: a scale by a constant (its embedding
scale) and tanh soft-capping (gemma2's final logits); its GeGLU is beside SwiGLU in ops.pyx.

Each checks its shapes while it holds the GIL (a graph may come from the wire), then runs
without it, on the calling thread (one row per token, or the logits once).

Also the two numpy ops of a graph as NativeSteps (plan.pyx), so that a bound graph runs without
taking the GIL between its kernels: ADD of two arrays of one shape, and GET_ROWS of an F32
table (its ids checked at every run).
"""
from libc.math cimport tanh
from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy

from pyllama._fast.plan cimport NativeStep, bound, step_for


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


cdef struct AddJob:
    const float* a
    const float* b
    float* out
    int64_t n


cdef int _add_run(void* ctx, unsigned char* scratch) noexcept nogil:
    cdef AddJob* j = <AddJob*>ctx
    cdef int64_t i
    for i in range(j.n):
        j.out[i] = j.a[i] + j.b[i]
    return 0


def bind_add(checked, a, b, out):
    """out = a + b for three float32 C-contiguous arrays of one shape, as a NativeStep; None for
    anything else (broadcasting, other types: numpy's add does those) or no elements."""
    import numpy as np
    arrs = (a, b, out)
    if any(not isinstance(x, np.ndarray) or x.dtype != np.float32 or not x.flags.c_contiguous
           or x.shape != out.shape for x in arrs) or out.size == 0:
        return None
    cdef const float[::1] av = a.reshape(-1)
    cdef const float[::1] bv = b.reshape(-1)
    cdef float[::1] ov = out.reshape(-1)
    cdef NativeStep s = step_for(sizeof(AddJob), checked)
    cdef AddJob* j = <AddJob*>s.ctx
    j.a = &av[0]
    j.b = &bv[0]
    j.out = &ov[0]
    j.n = ov.shape[0]
    return bound(s, _add_run, (av, bv, ov))


cdef struct TakeJob:
    const char* table
    int64_t rows, row_bytes
    const int32_t* ids
    int64_t n
    char* out


cdef int _take_run(void* ctx, unsigned char* scratch) noexcept nogil:
    cdef TakeJob* j = <TakeJob*>ctx
    cdef int64_t i
    for i in range(j.n):
        if j.ids[i] < 0 or j.ids[i] >= j.rows:
            return 1
    for i in range(j.n):
        memcpy(j.out + i * j.row_bytes, j.table + j.ids[i] * j.row_bytes, j.row_bytes)
    return 0


def bind_get_rows_f32(checked, table, ids, out):
    """out[i] = table[ids[i]] (float32 rows, int32 ids) as a NativeStep, the ids checked at every
    run (out of range: `checked`, numpy's take, says which); None for any other layout or no rows."""
    import numpy as np
    if (not all(isinstance(x, np.ndarray) and x.flags.c_contiguous for x in (table, ids, out))
            or table.dtype != np.float32 or out.dtype != np.float32 or ids.dtype != np.int32
            or table.ndim != 2 or ids.ndim != 1 or out.shape != (ids.shape[0], table.shape[1])
            or out.size == 0 or table.shape[0] == 0):
        return None
    cdef const float[:, ::1] tv = table
    cdef const int32_t[::1] iv = ids
    cdef float[:, ::1] ov = out
    cdef NativeStep s = step_for(sizeof(TakeJob), checked)
    cdef TakeJob* j = <TakeJob*>s.ctx
    j.table = <const char*>&tv[0, 0]
    j.rows = tv.shape[0]
    j.row_bytes = tv.shape[1] * 4
    j.ids = &iv[0]
    j.n = iv.shape[0]
    j.out = <char*>&ov[0, 0]
    return bound(s, _take_run, (tv, iv, ov))
