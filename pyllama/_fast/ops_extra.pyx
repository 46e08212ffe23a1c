# cython: language_level=3
"""CPU kernels of two element-wise ops the gemma family adds: a scale by a constant (its embedding
scale) and tanh soft-capping (gemma2's final logits); its GeGLU is beside SwiGLU in ops.pyx.

Each checks its shapes while it holds the GIL (a graph may come from the wire), then runs
without it, on the calling thread (one row per token, or the logits once).
"""
from libc.math cimport tanh


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
