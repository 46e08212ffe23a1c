# cython: language_level=3
"""CPU kernels for the coarse graph ops: RMS norm, SwiGLU, and attention with RoPE and KV write.

Every kernel checks its arguments while it still holds the GIL (a graph may come from the wire),
then runs without it, parallel over rows with OpenMP.
"""
from cython.parallel cimport parallel, prange
from libc.math cimport exp, pow, cos, sin, sqrt, INFINITY
from libc.stdlib cimport malloc, free

# Below these sizes a kernel runs on the calling thread: waking a thread team costs more than
# the work, and on few cores an idle team spinning beside BLAS's threads costs even more.
DEF PARALLEL_MIN_ELEMENTS = 262144
DEF PARALLEL_MIN_ATTENTION = 65536


cdef inline void _rms_row(const float* x, const float* w, float* out, Py_ssize_t d, float eps) noexcept nogil:
    cdef double ss = 0.0
    cdef Py_ssize_t j
    for j in range(d):
        ss = ss + <double>x[j] * x[j]
    cdef float scale = <float>(1.0 / sqrt(ss / d + eps))
    for j in range(d):
        out[j] = x[j] * scale * w[j]


def rms_norm(const float[:, ::1] x, const float[::1] w, float[:, ::1] out, float eps, int n_threads=1):
    """out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w"""
    cdef Py_ssize_t n = x.shape[0], d = x.shape[1], i
    if w.shape[0] != d or out.shape[0] != n or out.shape[1] != d:
        raise ValueError(f"rms_norm: shapes x {(n, d)}, w {w.shape[0]}, out {(out.shape[0], out.shape[1])} disagree")
    if n == 0:
        return
    with nogil:
        if n * d < PARALLEL_MIN_ELEMENTS or n_threads <= 1:
            for i in range(n):
                _rms_row(&x[i, 0], &w[0], &out[i, 0], d, eps)
        else:
            for i in prange(n, num_threads=n_threads, schedule="static"):
                _rms_row(&x[i, 0], &w[0], &out[i, 0], d, eps)


cdef inline void _swiglu_row(const float* gu, float* out, Py_ssize_t f) noexcept nogil:
    cdef Py_ssize_t j
    cdef float g
    for j in range(f):
        g = gu[j]
        out[j] = g / (1.0 + exp(-g)) * gu[f + j]


def swiglu(const float[:, ::1] gu, float[:, ::1] out, int n_threads=1):
    """out = silu(gu[:, :f]) * gu[:, f:]"""
    cdef Py_ssize_t n = gu.shape[0], f = out.shape[1], i
    if gu.shape[1] != 2 * f or out.shape[0] != n:
        raise ValueError(f"swiglu: input {(n, gu.shape[1])} and output {(out.shape[0], f)} disagree")
    if n == 0:
        return
    with nogil:
        if n * f < PARALLEL_MIN_ELEMENTS or n_threads <= 1:
            for i in range(n):
                _swiglu_row(&gu[i, 0], &out[i, 0], f)
        else:
            for i in prange(n, num_threads=n_threads, schedule="static"):
                _swiglu_row(&gu[i, 0], &out[i, 0], f)


cdef inline void _norm_head(float* v, const float* w, int hd, float eps) noexcept nogil:
    cdef double ss = 0.0
    cdef int j
    for j in range(hd):
        ss = ss + <double>v[j] * v[j]
    cdef float scale = <float>(1.0 / sqrt(ss / hd + eps))
    for j in range(hd):
        v[j] = v[j] * scale * w[j]


cdef inline void _rope(float* v, const float* cs, int n_rot, int mode) noexcept nogil:
    # cs holds cos, sin interleaved per rotated pair
    cdef int i, half = n_rot // 2
    cdef float x0, x1, c, s
    for i in range(half):
        c = cs[2 * i]
        s = cs[2 * i + 1]
        if mode == 0:
            x0 = v[2 * i]
            x1 = v[2 * i + 1]
            v[2 * i] = x0 * c - x1 * s
            v[2 * i + 1] = x0 * s + x1 * c
        else:
            x0 = v[i]
            x1 = v[i + half]
            v[i] = x0 * c - x1 * s
            v[i + half] = x0 * s + x1 * c


cdef struct AttnArgs:
    const float* qkv
    Py_ssize_t qkv_stride
    float* k_cache
    float* v_cache
    const int* pos
    const int* kv_idx
    const int* cells
    const int* ranges
    const float* q_norm
    const float* k_norm
    float* out
    int H, Hkv, hd, n_rot, rope_mode
    double freq_base, freq_scale
    float eps, scale


cdef void _store_token(AttnArgs* a, Py_ssize_t t, float* cs) noexcept nogil:
    """Rotates (and normalizes) token t's q into out and its k into the cache; copies v."""
    cdef int i, h, d, hd = a.hd, H = a.H, Hkv = a.Hkv, half = a.n_rot // 2
    cdef double theta
    cdef const float* src = a.qkv + t * a.qkv_stride
    cdef float* q = a.out + t * H * hd
    cdef Py_ssize_t row = <Py_ssize_t>a.kv_idx[t] * Hkv * hd
    cdef float* k = a.k_cache + row
    cdef float* v = a.v_cache + row
    for i in range(half):
        theta = a.pos[t] * a.freq_scale * pow(a.freq_base, -2.0 * i / a.n_rot)
        cs[2 * i] = <float>cos(theta)
        cs[2 * i + 1] = <float>sin(theta)
    for d in range(H * hd):
        q[d] = src[d]
    for d in range(Hkv * hd):
        k[d] = src[H * hd + d]
        v[d] = src[(H + Hkv) * hd + d]
    for h in range(H):
        if a.q_norm != NULL:
            _norm_head(q + h * hd, a.q_norm, hd, a.eps)
        _rope(q + h * hd, cs, a.n_rot, a.rope_mode)
    for h in range(Hkv):
        if a.k_norm != NULL:
            _norm_head(k + h * hd, a.k_norm, hd, a.eps)
        _rope(k + h * hd, cs, a.n_rot, a.rope_mode)


cdef void _attend(AttnArgs* a, Py_ssize_t i, float* scratch) noexcept nogil:
    """softmax(q k^T * scale) v for head i % H of token i // H, over the token's listed cells."""
    cdef int hd = a.hd, H = a.H, d
    cdef Py_ssize_t t = i // H, j
    cdef int h = <int>(i % H)
    cdef int kvh = h // (H // a.Hkv)
    cdef Py_ssize_t r0 = a.ranges[2 * t], r1 = a.ranges[2 * t + 1]
    cdef Py_ssize_t stride = <Py_ssize_t>a.Hkv * hd
    cdef float* q = scratch
    cdef float* acc = scratch + hd
    cdef float* scores = scratch + 2 * hd
    cdef float* o = a.out + t * H * hd + h * hd
    cdef const float* kr
    cdef const float* vr
    cdef float s, m = -INFINITY, total = 0.0, p
    for d in range(hd):
        q[d] = o[d]
        acc[d] = 0.0
    for j in range(r1):
        kr = a.k_cache + a.cells[r0 + j] * stride + kvh * hd
        s = 0.0
        for d in range(hd):
            s = s + q[d] * kr[d]
        s = s * a.scale
        scores[j] = s
        if s > m:
            m = s
    for j in range(r1):
        p = <float>exp(scores[j] - m)
        total = total + p
        vr = a.v_cache + a.cells[r0 + j] * stride + kvh * hd
        for d in range(hd):
            acc[d] = acc[d] + p * vr[d]
    for d in range(hd):
        o[d] = acc[d] / total


def attention(const float[:, ::1] qkv, float[:, ::1] k_cache, float[:, ::1] v_cache,
              const int[::1] pos, const int[::1] kv_idx, const int[::1] cells, const int[:, ::1] ranges,
              const float[::1] q_norm, const float[::1] k_norm, float[:, ::1] out,
              int n_head, int n_head_kv, int head_dim, int n_rot, int rope_mode,
              double freq_base, double freq_scale, float norm_eps, float scale, int n_threads=1):
    """One layer's self-attention for a micro-batch (see graph.ops.Op.ATTENTION)."""
    cdef Py_ssize_t n = qkv.shape[0], n_cells = k_cache.shape[0], n_listed = cells.shape[0]
    cdef int hd = head_dim, H = n_head, Hkv = n_head_kv
    cdef int use_norm = q_norm.shape[0] > 0
    cdef Py_ssize_t t, i, j, c, r0, r1, max_len = 0, max_end = 0
    # --- validation (the graph may come from the wire) ---
    if H <= 0 or Hkv <= 0 or hd <= 0 or H % Hkv or n_rot < 0 or n_rot > hd or n_rot % 2:
        raise ValueError("attention: bad head parameters")
    if rope_mode not in (0, 2):
        raise ValueError(f"attention: unknown rope mode {rope_mode}")
    # widths in 64 bits: crafted head counts must not wrap into plausible shapes
    cdef Py_ssize_t q_width = <Py_ssize_t>H * hd, kv_width = <Py_ssize_t>Hkv * hd
    if qkv.shape[1] != q_width + 2 * kv_width or out.shape[0] != n or out.shape[1] != q_width:
        raise ValueError("attention: qkv / out shapes do not match the head parameters")
    if k_cache.shape[1] != kv_width or v_cache.shape[0] != n_cells or v_cache.shape[1] != kv_width:
        raise ValueError("attention: KV cache shapes do not match the head parameters")
    if pos.shape[0] != n or kv_idx.shape[0] != n or ranges.shape[0] != n or ranges.shape[1] != 2:
        raise ValueError("attention: per-token inputs must have one row per token")
    if use_norm and (q_norm.shape[0] != hd or k_norm.shape[0] != hd):
        raise ValueError("attention: q/k norm weights must have head_dim elements")
    for t in range(n):
        if kv_idx[t] < 0 or kv_idx[t] >= n_cells:
            raise ValueError(f"attention: cell {kv_idx[t]} outside the cache of {n_cells}")
        r0 = ranges[t, 0]
        r1 = ranges[t, 1]
        if r0 < 0 or r1 < 1 or r0 + r1 > n_listed:
            raise ValueError(f"attention: token {t} attends to cells [{r0}, {r0 + r1}) outside the list of {n_listed}")
        if r1 > max_len:
            max_len = r1
        if r0 + r1 > max_end:
            max_end = r0 + r1
    for i in range(max_end):  # only the referenced prefix of the list is meaningful
        if cells[i] < 0 or cells[i] >= n_cells:
            raise ValueError(f"attention: listed cell {cells[i]} outside the cache of {n_cells}")

    cdef Py_ssize_t work = 0
    for t in range(n):
        work += ranges[t, 1]
    work *= H
    cdef int nt = n_threads if (n_threads > 1 and work >= PARALLEL_MIN_ATTENTION) else 1
    cdef AttnArgs a
    a.qkv = &qkv[0, 0]
    a.qkv_stride = qkv.shape[1]
    a.k_cache = &k_cache[0, 0]
    a.v_cache = &v_cache[0, 0]
    a.pos = &pos[0]
    a.kv_idx = &kv_idx[0]
    a.cells = &cells[0]
    a.ranges = &ranges[0, 0]
    a.q_norm = &q_norm[0] if use_norm else NULL
    a.k_norm = &k_norm[0] if use_norm else NULL
    a.out = &out[0, 0]
    a.H = H
    a.Hkv = Hkv
    a.hd = hd
    a.n_rot = n_rot
    a.rope_mode = rope_mode
    a.freq_base = freq_base
    a.freq_scale = freq_scale
    a.eps = norm_eps
    a.scale = scale
    cdef float* scratch
    with nogil:
        if nt == 1:
            scratch = <float*>malloc(sizeof(float) * (max_len + 2 * hd + n_rot + 2))
            for t in range(n):
                _store_token(&a, t, scratch)
            for i in range(n * H):
                _attend(&a, i, scratch)
            free(scratch)
        else:
            with parallel(num_threads=nt):
                scratch = <float*>malloc(sizeof(float) * (max_len + 2 * hd + n_rot + 2))
                for t in prange(n, schedule="static"):
                    _store_token(&a, t, scratch)
                free(scratch)
            with parallel(num_threads=nt):
                scratch = <float*>malloc(sizeof(float) * (max_len + 2 * hd + n_rot + 2))
                for i in prange(n * H, schedule="dynamic"):
                    _attend(&a, i, scratch)
                free(scratch)
