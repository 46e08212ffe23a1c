"""Dequantization of GGUF tensor data to float32, bit-exact with ggml's reference CPU code.

Byte layouts are ggml's (the same as `gguf.quants`). Every kernel runs without the GIL and
splits the blocks over OpenMP threads.

Exactness: the results are bit-identical to ggml's dequantize_row_* (and gguf.quants, which
mirrors them) whatever the compiler does with the project's -fassociative-math and FMA
contraction. Each value is ``(d*sc)*q - dmin*m`` or a part of it, where d/dmin are f16
(11 significant bits), sc/m integers of at most 8 bits and q of at most 6: every intermediate
result is exact in float32 and only the last operation rounds, once, so reordering the products
or fusing the subtraction into an FMA gives the same float. The f16 -> f32 conversion is exact.
tests/test_quant.py checks this bit for bit.
"""
from cython.parallel cimport prange
from libc.stdint cimport int8_t, uint8_t, uint16_t, uint32_t
from libc.string cimport memcpy
cimport openmp

import numpy as np

cdef extern from "quant.h":
    float f16_to_f32 "pyl_f16_to_f32"(uint16_t h) noexcept nogil
    float load_f16 "pyl_load_f16"(const uint8_t *p) noexcept nogil
    float bf16_to_f32 "pyl_bf16_to_f32"(uint16_t h) noexcept nogil

cdef extern from "ggml_quants.h" nogil:
    # Block dequantizers of the types without a tuned kernel below (bit-exact, as ggml's).
    void pq_dequant_block(int t, const uint8_t *b, float *y) noexcept


# ggml type ids (gguf.GGMLQuantizationType values) and their (block size, bytes per block).
cdef enum:
    T_F32 = 0
    T_F16 = 1
    T_Q4_0 = 2
    T_Q4_1 = 3
    T_Q5_0 = 6
    T_Q5_1 = 7
    T_Q8_0 = 8
    T_Q2_K = 10
    T_Q3_K = 11
    T_Q4_K = 12
    T_Q5_K = 13
    T_Q6_K = 14
    T_IQ2_XXS = 16
    T_IQ2_XS = 17
    T_IQ3_XXS = 18
    T_IQ1_S = 19
    T_IQ4_NL = 20
    T_IQ3_S = 21
    T_IQ2_S = 22
    T_IQ4_XS = 23
    T_IQ1_M = 29
    T_BF16 = 30
    T_TQ1_0 = 34
    T_TQ2_0 = 35
    T_MXFP4 = 39
    QK_K = 256
    # Elements per parallel work item: a multiple of every block size.
    WORK = 8192
    # Below this many output bytes one thread does all the work (a parallel region costs ~us).
    PARALLEL_MIN_BYTES = 1 << 18


BLOCK_SIZES = {
    T_F32: (1, 4),
    T_F16: (1, 2),
    T_BF16: (1, 2),
    T_Q8_0: (32, 34),
    T_Q4_0: (32, 18),
    T_Q4_1: (32, 20),
    T_Q5_0: (32, 22),
    T_Q5_1: (32, 24),
    T_Q2_K: (QK_K, 84),
    T_Q3_K: (QK_K, 110),
    T_Q4_K: (QK_K, 144),
    T_Q5_K: (QK_K, 176),
    T_Q6_K: (QK_K, 210),
    T_IQ4_NL: (32, 18),
    T_IQ4_XS: (QK_K, 136),
    T_IQ2_XXS: (QK_K, 66),
    T_IQ2_XS: (QK_K, 74),
    T_IQ2_S: (QK_K, 82),
    T_IQ3_XXS: (QK_K, 98),
    T_IQ3_S: (QK_K, 110),
    T_IQ1_S: (QK_K, 50),
    T_IQ1_M: (QK_K, 56),
    T_TQ1_0: (QK_K, 54),
    T_TQ2_0: (QK_K, 66),
    T_MXFP4: (32, 17),
}
"""Supported type id -> (elements per block, bytes per block)."""

SUPPORTED_TYPES = frozenset(BLOCK_SIZES)


def _type_name(int qtype):
    try:
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(qtype).name
    except Exception:
        return f"type id {qtype}"


# ---------------------------------------------------------------------------------------------
# Block kernels: one block of `raw` -> its values in `y`. Arithmetic order follows ggml's
# dequantize_row_* exactly.

# Each kernel first unpacks the integer quants into a small local byte array, then scales them
# in a separate loop over runs of 32 with constant shifts (after inlining): both loops
# vectorize. (One fused loop makes GCC vectorize across blocks instead, with strided loads, and
# int-sized temporaries or variable shifts cost 2-4x.)

cdef inline void _deq_q8_0(const uint8_t *b, float *y) noexcept nogil:
    # d f16 | qs int8[32]
    cdef float d = load_f16(b)
    cdef const int8_t *qs = <const int8_t *>(b + 2)
    cdef int j
    for j in range(32):
        y[j] = <float>qs[j] * d


cdef inline void _deq_q4_0(const uint8_t *b, float *y) noexcept nogil:
    # d f16 | qs[16]: low nibbles are values 0..15, high nibbles 16..31
    cdef float d = load_f16(b)
    cdef const uint8_t *qs = b + 2
    cdef int t[32]
    cdef int j
    for j in range(16):
        t[j] = <int>(qs[j] & 0x0F) - 8
        t[j + 16] = <int>(qs[j] >> 4) - 8
    for j in range(32):
        y[j] = <float>t[j] * d


cdef inline void _k4_scales(const uint8_t *s, float d, float dmin, float *dl, float *ml) noexcept nogil:
    # The 12 scale bytes of Q4_K/Q5_K hold eight 6-bit scales and eight 6-bit mins
    # (ggml's get_scale_min_k4).
    cdef int j
    cdef uint8_t sc, m
    for j in range(8):
        if j < 4:
            sc = s[j] & 63
            m = s[j + 4] & 63
        else:
            sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4)
            m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
        dl[j] = d * <float>sc
        ml[j] = dmin * <float>m


cdef inline void _k_run32(const uint8_t *qs, int shift, const uint8_t *qh, int hbit,
                          float dg, float mg, float *y) noexcept nogil:
    # 32 values of Q4_K (qh == NULL) or Q5_K: q = nibble `shift` of qs[l] | bit `hbit` of qh[l] << 4;
    # y = dg*q - mg. Inlined with constant shifts, both loops vectorize.
    cdef uint8_t t[32]
    cdef int l
    if qh == NULL:
        for l in range(32):
            t[l] = (qs[l] >> shift) & 0x0F
    else:
        for l in range(32):
            t[l] = ((qs[l] >> shift) & 0x0F) | (((qh[l] >> hbit) & 1) << 4)
    for l in range(32):
        y[l] = dg * <float>t[l] - mg


cdef inline void _deq_q4_k(const uint8_t *b, float *y) noexcept nogil:
    # d f16 | dmin f16 | scales[12] | qs[128]; run g of 32 values: low (g even) or high
    # nibbles of qs[32*(g//2):][:32], value = d*sc[g] * q - dmin*m[g]
    cdef float dl[8]
    cdef float ml[8]
    cdef const uint8_t *qs = b + 16
    _k4_scales(b + 4, load_f16(b), load_f16(b + 2), dl, ml)
    _k_run32(qs, 0, NULL, 0, dl[0], ml[0], y)
    _k_run32(qs, 4, NULL, 0, dl[1], ml[1], y + 32)
    _k_run32(qs + 32, 0, NULL, 0, dl[2], ml[2], y + 64)
    _k_run32(qs + 32, 4, NULL, 0, dl[3], ml[3], y + 96)
    _k_run32(qs + 64, 0, NULL, 0, dl[4], ml[4], y + 128)
    _k_run32(qs + 64, 4, NULL, 0, dl[5], ml[5], y + 160)
    _k_run32(qs + 96, 0, NULL, 0, dl[6], ml[6], y + 192)
    _k_run32(qs + 96, 4, NULL, 0, dl[7], ml[7], y + 224)


cdef inline void _deq_q5_k(const uint8_t *b, float *y) noexcept nogil:
    # d f16 | dmin f16 | scales[12] | qh[32] | qs[128]; as Q4_K with bit g of qh[l] as bit 4
    cdef float dl[8]
    cdef float ml[8]
    cdef const uint8_t *qh = b + 16
    cdef const uint8_t *qs = b + 48
    _k4_scales(b + 4, load_f16(b), load_f16(b + 2), dl, ml)
    _k_run32(qs, 0, qh, 0, dl[0], ml[0], y)
    _k_run32(qs, 4, qh, 1, dl[1], ml[1], y + 32)
    _k_run32(qs + 32, 0, qh, 2, dl[2], ml[2], y + 64)
    _k_run32(qs + 32, 4, qh, 3, dl[3], ml[3], y + 96)
    _k_run32(qs + 64, 0, qh, 4, dl[4], ml[4], y + 128)
    _k_run32(qs + 64, 4, qh, 5, dl[5], ml[5], y + 160)
    _k_run32(qs + 96, 0, qh, 6, dl[6], ml[6], y + 192)
    _k_run32(qs + 96, 4, qh, 7, dl[7], ml[7], y + 224)


cdef inline void _q6_run32(const uint8_t *ql, int shift, const uint8_t *qh, int hshift,
                           float s0, float s1, float *y) noexcept nogil:
    # 32 values of Q6_K: q = (nibble `shift` of ql[l] | bits hshift..hshift+1 of qh[l] << 4) - 32,
    # scaled by s0 (first 16) and s1 (last 16). Inlined with constant shifts, both loops vectorize.
    cdef int8_t t[32]
    cdef float s[32]
    cdef int l
    for l in range(32):
        t[l] = <int8_t>((((ql[l] >> shift) & 0x0F) | (((qh[l] >> hshift) & 3) << 4)) - 32)
    for l in range(16):
        s[l] = s0
        s[l + 16] = s1
    for l in range(32):
        y[l] = s[l] * <float>t[l]


cdef inline void _deq_q6_k(const uint8_t *b, float *y) noexcept nogil:
    # ql[128] | qh[64] | scales int8[16] | d f16. Half h (128 values) is four runs of 32: run k
    # takes the low (k < 2) or high nibbles of ql[64h + 32*(k&1):][:32] and bits 2k..2k+1 of
    # qh[32h:][:32]; value = (d*scale[i//16]) * (q - 32), as ggml's d * sc[is] * q.
    cdef const int8_t *sc = <const int8_t *>(b + 192)
    cdef float d = load_f16(b + 208)
    cdef const uint8_t *ql
    cdef const uint8_t *qh
    cdef float *yy
    cdef int h
    for h in range(2):
        ql = b + 64 * h
        qh = b + 128 + 32 * h
        yy = y + 128 * h
        _q6_run32(ql, 0, qh, 0, d * <float>sc[8 * h + 0], d * <float>sc[8 * h + 1], yy)
        _q6_run32(ql + 32, 0, qh, 2, d * <float>sc[8 * h + 2], d * <float>sc[8 * h + 3], yy + 32)
        _q6_run32(ql, 4, qh, 4, d * <float>sc[8 * h + 4], d * <float>sc[8 * h + 5], yy + 64)
        _q6_run32(ql + 32, 4, qh, 6, d * <float>sc[8 * h + 6], d * <float>sc[8 * h + 7], yy + 96)


cdef inline void _deq_chunk(int qtype, const uint8_t *src, float *dst, Py_ssize_t n) noexcept nogil:
    # n elements of an element-wise type.
    cdef Py_ssize_t i
    cdef const uint16_t *h
    if qtype == T_F32:
        memcpy(dst, src, n * 4)
    elif qtype == T_F16:
        h = <const uint16_t *>src
        for i in range(n):
            dst[i] = f16_to_f32(h[i])
    else:
        h = <const uint16_t *>src
        for i in range(n):
            dst[i] = bf16_to_f32(h[i])


# One loop function per type, so that each is optimized (inlined, vectorized) on its own.
cdef void _range_q8_0(const uint8_t *src, float *dst, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(nb):
        _deq_q8_0(src + i * 34, dst + i * 32)


cdef void _range_q4_0(const uint8_t *src, float *dst, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(nb):
        _deq_q4_0(src + i * 18, dst + i * 32)


cdef void _range_q4_k(const uint8_t *src, float *dst, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(nb):
        _deq_q4_k(src + i * 144, dst + i * QK_K)


cdef void _range_q5_k(const uint8_t *src, float *dst, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(nb):
        _deq_q5_k(src + i * 176, dst + i * QK_K)


cdef void _range_q6_k(const uint8_t *src, float *dst, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(nb):
        _deq_q6_k(src + i * 210, dst + i * QK_K)


cdef void _range_generic(int qtype, const uint8_t *src, float *dst, Py_ssize_t nb,
                        Py_ssize_t block, Py_ssize_t type_size) noexcept nogil:
    # Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4, the grid IQ types and TQ1_0 / TQ2_0: ggml_quants.h's
    # block functions (the formulas of
    # ggml's dequantize_row_*, every product exact in float32 as above).
    cdef Py_ssize_t i
    for i in range(nb):
        pq_dequant_block(qtype, src + i * type_size, dst + i * block)


cdef void _deq_range(int qtype, const uint8_t *src, float *dst, Py_ssize_t n,
                     Py_ssize_t block, Py_ssize_t type_size) noexcept nogil:
    # n elements (a whole number of blocks) starting at block-aligned src/dst.
    cdef Py_ssize_t nb = n // block
    if block == 1:
        _deq_chunk(qtype, src, dst, n)
    elif qtype == T_Q8_0:
        _range_q8_0(src, dst, nb)
    elif qtype == T_Q4_0:
        _range_q4_0(src, dst, nb)
    elif qtype == T_Q4_K:
        _range_q4_k(src, dst, nb)
    elif qtype == T_Q5_K:
        _range_q5_k(src, dst, nb)
    elif qtype == T_Q6_K:
        _range_q6_k(src, dst, nb)
    else:
        _range_generic(qtype, src, dst, nb, block, type_size)


cdef void _run(int qtype, const uint8_t *src, float *dst, Py_ssize_t n_elements,
               Py_ssize_t block, Py_ssize_t type_size, int nt) noexcept nogil:
    # Work items of WORK elements (a multiple of every block size), handed out dynamically so
    # that a thread delayed by the OS (busy cores) does not hold up the others.
    cdef Py_ssize_t i, start, n
    cdef Py_ssize_t n_items = (n_elements + WORK - 1) // WORK
    if nt == 1 or n_items == 1:
        _deq_range(qtype, src, dst, n_elements, block, type_size)
        return
    for i in prange(n_items, num_threads=nt, schedule="dynamic"):
        start = i * WORK
        n = n_elements - start
        if n > WORK:
            n = WORK
        _deq_range(qtype, src + start // block * type_size, dst + start, n, block, type_size)


def dequantize(raw, int qtype, Py_ssize_t n_elements, out, int n_threads=0):
    """Dequantizes `n_elements` values of ggml type `qtype` from `raw` into `out`.

    raw: 1-D C-contiguous uint8 array (or other byte buffer) of exactly
    n_elements / block_size * type_size bytes; read-only buffers (memory maps) are fine.
    qtype: a gguf.GGMLQuantizationType value: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
    IQ1_M, TQ1_0 or TQ2_0.
    out: 1-D C-contiguous writable float32 array of n_elements.
    n_threads: OpenMP threads to use; 0 = the OpenMP default (small inputs always use one).

    Raises ValueError for an unsupported type, a size mismatch or a wrong array kind.
    """
    if qtype not in BLOCK_SIZES:
        supported = ", ".join(_type_name(t) for t in sorted(BLOCK_SIZES))
        raise ValueError(f"dequantize: unsupported tensor type {_type_name(qtype)} (supported: {supported})")
    block, type_size = BLOCK_SIZES[qtype]
    if n_elements < 0:
        raise ValueError(f"dequantize: n_elements must be >= 0, got {n_elements}")
    if n_elements % block:
        raise ValueError(
            f"dequantize: {n_elements} elements is not a whole number of {_type_name(qtype)} blocks of {block}")
    if n_threads < 0:
        raise ValueError(f"dequantize: n_threads must be >= 0, got {n_threads}")
    if isinstance(raw, np.ndarray) and (raw.dtype != np.uint8 or raw.ndim != 1 or not raw.flags.c_contiguous):
        raise ValueError(
            f"dequantize: raw must be a 1-D C-contiguous uint8 array, got {raw.dtype} with shape "
            f"{raw.shape}{'' if raw.flags.c_contiguous else ' (not contiguous)'}")
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 1 or not out.flags.c_contiguous:
        desc = f"{out.dtype} with shape {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(f"dequantize: out must be a 1-D C-contiguous float32 array, got {desc}")
    if not out.flags.writeable:
        raise ValueError("dequantize: out is read-only")
    cdef const uint8_t[::1] src
    try:
        src = raw
    except (ValueError, TypeError, BufferError) as exc:
        raise ValueError(f"dequantize: raw must be a 1-D C-contiguous uint8 buffer ({exc})") from None
    cdef float[::1] dst = out
    cdef Py_ssize_t expected = n_elements // block * type_size
    if src.shape[0] != expected:
        raise ValueError(
            f"dequantize: raw has {src.shape[0]} bytes but {n_elements} {_type_name(qtype)} elements need {expected}")
    if dst.shape[0] != n_elements:
        raise ValueError(f"dequantize: out has {dst.shape[0]} elements, expected {n_elements}")
    if n_elements == 0:
        return
    cdef int nt = n_threads if n_threads > 0 else openmp.omp_get_max_threads()
    if n_elements * 4 < PARALLEL_MIN_BYTES or nt < 1:
        nt = 1
    cdef int qt = qtype
    cdef Py_ssize_t c_block = block, c_type_size = type_size
    with nogil:
        _run(qt, &src[0], &dst[0], n_elements, c_block, c_type_size, nt)


def dequantize_to_f32(raw, qtype, shape, int n_threads=0):
    """Dequantizes a tensor of `shape` (numpy row-major order) into a new float32 array."""
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    if any(s < 0 for s in shape):
        raise ValueError(f"dequantize_to_f32: bad shape {shape}")
    n = 1
    for s in shape:
        n *= s
    row = shape[len(shape) - 1] if shape else 1
    if int(qtype) in BLOCK_SIZES and row % BLOCK_SIZES[int(qtype)][0]:
        block = BLOCK_SIZES[int(qtype)][0]
        raise ValueError(
            f"dequantize_to_f32: rows of {row} are not a whole number of "
            f"{_type_name(int(qtype))} blocks of {block}")
    out = np.empty(n, dtype=np.float32)
    dequantize(raw, int(qtype), n, out, n_threads)
    return out.reshape(shape)
