# cython: language_level=3
"""CPU kernels for the coarse graph ops: RMS norm, LayerNorm, GELU, SwiGLU and GeGLU, and attention with RoPE and the KV
write, over a cache of any KV cache type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL; conversions in
kv_types.h).

Every kernel checks its arguments while it still holds the GIL (a graph may come from the wire),
then runs without it, split into items on the products' worker pool (qmatmul.pxd): one set of
helper threads serves every kernel of a step, and a helper the OS is late to schedule holds
nobody up (no barrier). Which thread computes an item never changes its result.

`bind_rms_norm`, `bind_layer_norm`, `bind_gelu`, `bind_glu` and `bind_attention` check the same arguments once and return the
kernel as a NativeStep (plan.pyx) for a bound graph; attention's per-step data (the cells, the
lists, the ids) is still checked at every run.
"""
from libc.math cimport ceilf, fabs, floorf, fmaf, logf, powf, sqrt, sqrtf, tanh
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc, free

from pyllama._fast.plan cimport NativeStep, bound, step_for
from pyllama._fast.qmatmul cimport pool_run

import numpy as np

# Below these amounts of work a kernel runs on the calling thread alone: handing items to a
# helper costs about a microsecond, so only kernels of some tens of microseconds gain from it.
DEF PARALLEL_MIN_ELEMENTS = 16384   # rms_norm / swiglu elements
DEF PARALLEL_MIN_ATTENTION = 32768  # attention: query heads x listed cells x head_dim
DEF GLU_CHUNK = 2048                # swiglu / geglu elements per item
DEF RMS_ITEM_ELEMENTS = 8192        # rms_norm: whole rows per item, about this many elements
# KQV's lanes over the cells with F32 caches (vec_math.h's pv_ggml_attend). llama.cpp sums them as
# llamafile's tinyBLAS does (16) in every step of several rows (prompts, decoding several sequences)
# and as ggml_vec_dot_f32 does (64) in a step of one row (tinyBLAS refuses a single row); the two
# agree up to 16 cells. The form follows the step's row count as llama.cpp's does, so a prompt
# decoded alone gives llama.cpp's numbers at every step; a row decoded beside other sequences
# differs from one decoded alone by the summation order only, as it does in llama.cpp.
DEF GGML_KQV_LANES_ROWS = 16
DEF GGML_KQV_LANES_ONE_ROW = 64


cdef extern from "vec_math.h" nogil:
    void pv_rms_row(const float *x, const float *w, float *out, int64_t d, float eps)
    void pv_layer_norm_row(const float *x, const float *w, const float *b, float *out, int64_t d, float eps)
    void pv_gelu_mul(const float *g, const float *u, float *out, int64_t n)


cdef inline void _rms_row(const float* x, const float* w, float* out, Py_ssize_t d, float eps) noexcept nogil:
    pv_rms_row(x, w, out, d, eps)


cdef struct RowsJob:
    const float* x
    const float* w
    const float* b  # layer_norm's bias
    float* out
    Py_ssize_t n, d, chunks  # rms_norm: chunks = rows per item; GLU: column chunks per row
    float eps
    bint gelu  # GeGLU, else SwiGLU
    int nt     # threads for this amount of work


cdef void _rms_item(void* ctx, int64_t i) noexcept nogil:
    # several rows per item: a row of a few thousand elements is well under a microsecond, about
    # what claiming an item costs when two threads take them from one counter
    cdef RowsJob* j = <RowsJob*>ctx
    cdef Py_ssize_t r = i * j.chunks, r1 = r + j.chunks if r + j.chunks < j.n else j.n
    while r < r1:
        _rms_row(j.x + r * j.d, j.w, j.out + r * j.d, j.d, j.eps)
        r += 1


cdef int _rows_job(RowsJob* job, const float[:, ::1] x, const float[::1] w, float[:, ::1] out, float eps,
                   int n_threads) noexcept:
    """Fills a norm's job over x's rows (shapes checked by the caller); 0 when there is nothing to
    compute."""
    cdef Py_ssize_t n = x.shape[0], d = x.shape[1]
    if n == 0 or d == 0:
        return 0
    job.x = &x[0, 0]
    job.w = &w[0]
    job.out = &out[0, 0]
    job.n = n
    job.d = d
    job.chunks = max(1, RMS_ITEM_ELEMENTS // d)
    job.eps = eps
    job.nt = n_threads if n * d >= PARALLEL_MIN_ELEMENTS else 1
    return 1


cdef int _rms_setup(RowsJob* job, const float[:, ::1] x, const float[::1] w, float[:, ::1] out, float eps,
                    int n_threads) except -1:
    """Checks the shapes and fills job; 0 when there is nothing to compute."""
    cdef Py_ssize_t n = x.shape[0], d = x.shape[1]
    if w.shape[0] != d or out.shape[0] != n or out.shape[1] != d:
        raise ValueError(f"rms_norm: shapes x {(n, d)}, w {w.shape[0]}, out {(out.shape[0], out.shape[1])} disagree")
    return _rows_job(job, x, w, out, eps, n_threads)


cdef int _rms_run(void* ctx, unsigned char* scratch) noexcept nogil:
    cdef RowsJob* job = <RowsJob*>ctx
    pool_run(job.nt, (job.n + job.chunks - 1) // job.chunks, _rms_item, job)
    return 0


def rms_norm(const float[:, ::1] x, const float[::1] w, float[:, ::1] out, float eps, int n_threads=1):
    """out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w"""
    cdef RowsJob job
    if _rms_setup(&job, x, w, out, eps, n_threads):
        with nogil:
            _rms_run(&job, NULL)


def bind_rms_norm(checked, const float[:, ::1] x, const float[::1] w, float[:, ::1] out, float eps,
                  int n_threads=1):
    """rms_norm bound to these arrays as a NativeStep (plan.pyx), or None when there is nothing to
    compute. checked: the same op as a Python callable."""
    cdef NativeStep s = step_for(sizeof(RowsJob), checked)
    if not _rms_setup(<RowsJob*>s.ctx, x, w, out, eps, n_threads):
        return None
    return bound(s, _rms_run, (x, w, out))


cdef void _ln_item(void* ctx, int64_t i) noexcept nogil:
    # whole rows per item, as _rms_item
    cdef RowsJob* j = <RowsJob*>ctx
    cdef Py_ssize_t r = i * j.chunks, r1 = r + j.chunks if r + j.chunks < j.n else j.n
    while r < r1:
        pv_layer_norm_row(j.x + r * j.d, j.w, j.b, j.out + r * j.d, j.d, j.eps)
        r += 1


cdef int _ln_setup(RowsJob* job, const float[:, ::1] x, const float[::1] w, const float[::1] b, float[:, ::1] out,
                   float eps, int n_threads) except -1:
    """Checks the shapes and fills job; 0 when there is nothing to compute."""
    cdef Py_ssize_t n = x.shape[0], d = x.shape[1]
    if w.shape[0] != d or b.shape[0] != d or out.shape[0] != n or out.shape[1] != d:
        raise ValueError(f"layer_norm: shapes x {(n, d)}, w {w.shape[0]}, b {b.shape[0]}, "
                         f"out {(out.shape[0], out.shape[1])} disagree")
    if not _rows_job(job, x, w, out, eps, n_threads):
        return 0
    job.b = &b[0]
    return 1


cdef int _ln_run(void* ctx, unsigned char* scratch) noexcept nogil:
    cdef RowsJob* job = <RowsJob*>ctx
    pool_run(job.nt, (job.n + job.chunks - 1) // job.chunks, _ln_item, job)
    return 0


def layer_norm(const float[:, ::1] x, const float[::1] w, const float[::1] b, float[:, ::1] out, float eps,
               int n_threads=1):
    """out[i] = (x[i] - mean(x[i])) / sqrt(var(x[i]) + eps) * w + b (BERT's LayerNorm)"""
    cdef RowsJob job
    if _ln_setup(&job, x, w, b, out, eps, n_threads):
        with nogil:
            _ln_run(&job, NULL)


def bind_layer_norm(checked, const float[:, ::1] x, const float[::1] w, const float[::1] b, float[:, ::1] out,
                    float eps, int n_threads=1):
    """layer_norm bound as a NativeStep, or None when there is nothing to compute."""
    cdef NativeStep s = step_for(sizeof(RowsJob), checked)
    if not _ln_setup(<RowsJob*>s.ctx, x, w, b, out, eps, n_threads):
        return None
    return bound(s, _ln_run, (x, w, b, out))


cdef void _gelu_item(void* ctx, int64_t item) noexcept nogil:
    # GLU_CHUNK elements of the flattened array per item
    cdef RowsJob* j = <RowsJob*>ctx
    cdef Py_ssize_t c0 = item * GLU_CHUNK, total = j.n * j.d
    pv_gelu_mul(j.x + c0, NULL, j.out + c0, GLU_CHUNK if c0 + GLU_CHUNK < total else total - c0)


cdef int _gelu_setup(RowsJob* job, const float[:, ::1] x, float[:, ::1] out, int n_threads) except -1:
    cdef Py_ssize_t n = x.shape[0], d = x.shape[1]
    if out.shape[0] != n or out.shape[1] != d:
        raise ValueError(f"gelu: input {(n, d)} and output {(out.shape[0], out.shape[1])} disagree")
    if n == 0 or d == 0:
        return 0
    job.x = &x[0, 0]
    job.out = &out[0, 0]
    job.n = n
    job.d = d
    job.nt = n_threads if n * d >= PARALLEL_MIN_ELEMENTS else 1
    return 1


cdef int _gelu_run(void* ctx, unsigned char* scratch) noexcept nogil:
    cdef RowsJob* job = <RowsJob*>ctx
    pool_run(job.nt, (job.n * job.d + GLU_CHUNK - 1) // GLU_CHUNK, _gelu_item, job)
    return 0


def gelu(const float[:, ::1] x, float[:, ::1] out, int n_threads=1):
    """out = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (BERT's FFN activation)"""
    cdef RowsJob job
    if _gelu_setup(&job, x, out, n_threads):
        with nogil:
            _gelu_run(&job, NULL)


def bind_gelu(checked, const float[:, ::1] x, float[:, ::1] out, int n_threads=1):
    """gelu bound as a NativeStep, or None when there is nothing to compute."""
    cdef NativeStep s = step_for(sizeof(RowsJob), checked)
    if not _gelu_setup(<RowsJob*>s.ctx, x, out, n_threads):
        return None
    return bound(s, _gelu_run, (x, out))


cdef extern from "vec_math.h" nogil:
    void pv_silu_mul(const float *g, const float *u, float *out, int64_t n)
    float pv_dot(const float *a, const float *b, int64_t n)
    float pv_softmax_unnormed(float *x, int64_t n)
    float pv_softmax_unnormed_sink(float *x, int64_t n, float sink)
    bint pv_attend_ok(int G, int hd, int kt, int vt)
    bint pv_ggml_attend_ok(int hd, int kt, int vt)
    void pv_ggml_attend(const float *q, int G, int hd, const unsigned char *kc, long long k_row, long long k_off,
                        const unsigned char *vc, long long v_row, long long v_off, const int *cells, long long n,
                        float scale, int lanes, float *scores, long long L, float *acc, float *out)
    void pv_rope_cache(float pos, int half, float theta_scale, float freq_scale, const float *factors, float mscale,
                       float *cs)
    void pv_rope_cache_yarn(float pos, int half, float theta_scale, float freq_scale, float low, float high,
                            float ext_factor, float mscale, float *cs)
    void pv_ggml_attend_kv(const float *q, int G, int hk, int hd, const unsigned char *kc, long long k_row,
                           long long k_off, const unsigned char *vc, long long v_row, long long v_off,
                           const int *cells, long long n, float scale, int lanes, float *scores, long long L,
                           float *acc, float *out)
    void pv_attend_qk(const float *q, int G, int hd, const unsigned char *kc, long long k_row, long long head_bytes,
                      int kt, const int *cells, long long n, float scale, float *scores, long long L,
                      const unsigned char *vc, long long v_row, long long v_head_bytes, int vt)
    void pv_attend_pv(const float *p, const float *totals, int G, int hd, const unsigned char *vc, long long v_row,
                      long long head_bytes, int vt, const int *cells, long long n, long long L, float *out)


cdef void _glu_item(void* ctx, int64_t item) noexcept nogil:
    # item: (row, chunk of GLU_CHUNK columns), so that one long row spreads over the threads too
    cdef RowsJob* j = <RowsJob*>ctx
    cdef Py_ssize_t r = item // j.chunks, c0 = item % j.chunks * GLU_CHUNK
    cdef Py_ssize_t c1 = c0 + GLU_CHUNK if c0 + GLU_CHUNK < j.d else j.d
    cdef const float* gu = j.x + r * 2 * j.d
    cdef float* out = j.out + r * j.d
    if j.gelu:
        pv_gelu_mul(gu + c0, gu + j.d + c0, out + c0, c1 - c0)
    else:
        pv_silu_mul(gu + c0, gu + j.d + c0, out + c0, c1 - c0)


cdef int _glu_setup(RowsJob* job, str name, const float[:, ::1] gu, float[:, ::1] out, int n_threads,
                    bint gelu) except -1:
    cdef Py_ssize_t n = gu.shape[0], f = out.shape[1]
    if gu.shape[1] != 2 * f or out.shape[0] != n:
        raise ValueError(f"{name}: input {(n, gu.shape[1])} and output {(out.shape[0], f)} disagree")
    if n == 0 or f == 0:
        return 0
    job.x = &gu[0, 0]
    job.out = &out[0, 0]
    job.n = n
    job.d = f
    job.chunks = (f + GLU_CHUNK - 1) // GLU_CHUNK
    job.gelu = gelu
    job.nt = n_threads if n * f >= PARALLEL_MIN_ELEMENTS else 1
    return 1


cdef int _glu_run(void* ctx, unsigned char* scratch) noexcept nogil:
    cdef RowsJob* job = <RowsJob*>ctx
    pool_run(job.nt, job.n * job.chunks, _glu_item, job)
    return 0


cdef _glu(str name, const float[:, ::1] gu, float[:, ::1] out, int n_threads, bint gelu):
    cdef RowsJob job
    if _glu_setup(&job, name, gu, out, n_threads, gelu):
        with nogil:
            _glu_run(&job, NULL)


def swiglu(const float[:, ::1] gu, float[:, ::1] out, int n_threads=1):
    """out = silu(gu[:, :f]) * gu[:, f:]"""
    _glu("swiglu", gu, out, n_threads, False)


def geglu(const float[:, ::1] gu, float[:, ::1] out, int n_threads=1):
    """out = gelu_tanh(gu[:, :f]) * gu[:, f:] (GeGLU, gemma's FFN)"""
    _glu("geglu", gu, out, n_threads, True)


def bind_glu(checked, const float[:, ::1] gu, float[:, ::1] out, int n_threads=1, bint gelu=False):
    """swiglu (or geglu with gelu) bound as a NativeStep, or None when there is nothing to compute."""
    cdef NativeStep s = step_for(sizeof(RowsJob), checked)
    if not _glu_setup(<RowsJob*>s.ctx, "geglu" if gelu else "swiglu", gu, out, n_threads, gelu):
        return None
    return bound(s, _glu_run, (gu, out))


cdef inline void _norm_head(float* v, const float* w, int hd, float eps) noexcept nogil:
    pv_rms_row(v, w, v, hd, eps)   # in place: each element is read before it is written


cdef inline void _rope(float* v, const float* cs, int n_rot, int mode) noexcept nogil:
    # cs holds cos, sin interleaved per rotated pair. x0 c - x1 s and x0 s + x1 c as GCC contracts
    # ggml's rotate_pairs: the first product fused, the second rounded
    cdef int i, half = n_rot // 2
    cdef float x0, x1, c, s
    for i in range(half):
        c = cs[2 * i]
        s = cs[2 * i + 1]
        if mode == 0:
            x0 = v[2 * i]
            x1 = v[2 * i + 1]
            v[2 * i] = fmaf(x0, c, -(x1 * s))
            v[2 * i + 1] = fmaf(x0, s, x1 * c)
        else:
            x0 = v[i]
            x1 = v[i + half]
            v[i] = fmaf(x0, c, -(x1 * s))
            v[i + half] = fmaf(x0, s, x1 * c)


cdef inline void _hadamard(float* x, Py_ssize_t n, int size) noexcept nogil:
    """x's n values rotated in place, each run of `size` (a power of two) by the orthonormal
    Hadamard matrix of that size: ggml's fast Walsh-Hadamard transform (its CPU product with the
    Hadamard hint), scaled first by 1 / sqrt(size), then butterflies u + v, u - v from the nearest
    pairs outwards; the float steps are the same at every vector width."""
    cdef float sc = 1.0 / sqrtf(<float>size), u, v
    cdef Py_ssize_t c = 0, i, j, ln
    while c < n:
        for j in range(size):
            x[c + j] = x[c + j] * sc
        ln = 1
        while ln < size:
            i = 0
            while i < size:
                for j in range(ln):
                    u = x[c + i + j]
                    v = x[c + i + ln + j]
                    x[c + i + j] = u + v
                    x[c + i + ln + j] = u - v
                i += 2 * ln
            ln *= 2
        c += size


def _rotation_sizes(int head_dim, int k_type, int v_type):
    """(rot_k, rot_v): llama.cpp's KV cache rotates q and k by a Hadamard matrix before a quantized
    K cache stores k (the largest power of two from 64 that divides the head), and v by one of
    size 64 before a quantized V cache stores it (the attention's output is rotated back), where
    the head is a multiple of 64; 0 where it does not rotate. Quantization error spreads evenly
    over the rotated values, which is what makes 4-bit caches usable."""
    cdef int rot_k = 0
    if k_type not in (KV_F32, KV_F16, KV_BF16) and head_dim % 64 == 0:
        rot_k = 64
        while head_dim % (rot_k * 2) == 0:
            rot_k *= 2
    return rot_k, (64 if v_type not in (KV_F32, KV_F16, KV_BF16) and head_dim % 64 == 0 else 0)


cdef extern from "kv_types.h" nogil:
    int KV_F32, KV_F16, KV_BF16, KV_Q8_0
    long long kv_row_bytes(int type, long long n)
    void kv_store_row(int type, const float* x, unsigned char* row, long long n)
    void kv_load(int type, const unsigned char* row, long long start, long long n, float* out)

# The KV cache holds k and v in their cache type (F32, F16, BF16 or a block type: Q8_0, Q4_0, Q4_1,
# Q5_0, Q5_1, IQ4_NL; ggml's type ids). A token's k (after q/k norm and RoPE, computed in f32) and
# its v are rounded into that type when written, as ggml's CPU f32 -> type copy does (Q8_0: its x86
# quantizer, id = 127 / amax and round half to even; the other block types: ggml's reference
# quantizers). Reading converts every element back to f32 (exactly, but for the block types' scale
# products, which are ggml's dequantization), and the products and the softmax run in f32 exactly
# as with an F32 cache: the semantics of llama.cpp's non-flash-attention GPU paths. ggml's CPU
# kernels would also round q to the cache's dot-product type (f16, or q8_0 / q8_1 blocks) for q.k,
# and the probabilities to f16 for p.v; pyllama does not, for every cache type alike, so the
# cache's rounding is the only difference from an F32 cache.
KV_TYPE_NAMES = {0: "F32", 1: "F16", 8: "Q8_0", 30: "BF16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 20: "IQ4_NL"}

cdef extern from "vec_math.h":
    int PV_GGML_ATTEND

# Whether this build computes attention over F32 caches in ggml's float steps (an AVX-512 build;
# other builds keep the general kernel's own summation order).
GGML_F32_ATTENTION = bool(PV_GGML_ATTEND)


cdef struct AttnArgs:
    const float* qkv
    Py_ssize_t qkv_stride
    unsigned char* k_cache
    unsigned char* v_cache
    Py_ssize_t k_row, v_row  # bytes per cache row
    int k_type, v_type
    const int* pos
    const int* kv_idx
    const int* cells
    const int* ranges
    const float* q_norm
    const float* k_norm
    const float* freq_factors  # NULL, or n_rot / 2 divisors of the rotation angles (ggml's freq factors)
    const float* sinks         # NULL, or one logit per query head joining each softmax's denominator
    const float* alibi         # NULL, or one slope per query head: each score gets slope * -|p_q - p_k|
    float* out
    int H, Hkv, hd, n_rot, rope_mode
    int rot_k, rot_v    # Hadamard rotation sizes of a quantized K / V cache (0: none; see _rotation_sizes)
    float freq_scale, mscale
    float theta_scale   # powf(freq_base, -2 / n_rot): ggml's factor from one pair's angle to the next
    float eps, scale, softcap  # softcap 0: none
    Py_ssize_t n_swa           # 0: every listed cell; else only the last n_swa
    Py_ssize_t max_len  # the longest list of cells a token attends to (scores per head: max_len + 1)
    Py_ssize_t exact_len  # max_len rounded up to 64: scores per head of the ggml steps
    int kqv_lanes         # KQV's summation lanes over the cells (see GGML_KQV_LANES_ROWS)
    Py_ssize_t store_floats, attend_floats  # scratch per item
    int failed          # an item could not allocate its scratch
    Py_ssize_t n, n_cells, n_listed  # tokens, cache rows, listed cells
    Py_ssize_t q_width
    int n_threads, nt   # threads asked for, and used for this run's amount of work


cdef void _store_token(AttnArgs* a, Py_ssize_t t, float* scratch) noexcept nogil:
    """Rotates (and normalizes) token t's q into out; its k likewise, and its v as it is, rounded
    into their cache rows; q and k, and v, Hadamard-rotated first for a quantized cache (rot_k,
    rot_v). scratch: n_rot + 2 floats of cos/sin, then Hkv * hd for k, then Hkv * hd for v."""
    cdef int h, d, hd = a.hd, H = a.H, Hkv = a.Hkv
    cdef const float* src = a.qkv + t * a.qkv_stride
    cdef float* q = a.out + t * H * hd
    cdef Py_ssize_t cell = a.kv_idx[t]
    cdef float* cs = scratch
    cdef float* k = scratch + a.n_rot + 2
    cdef float* v
    pv_rope_cache(<float>a.pos[t], a.n_rot // 2, a.theta_scale, a.freq_scale, a.freq_factors, a.mscale, cs)
    for d in range(H * hd):
        q[d] = src[d]
    for d in range(Hkv * hd):
        k[d] = src[H * hd + d]
    for h in range(H):
        if a.q_norm != NULL:
            _norm_head(q + h * hd, a.q_norm, hd, a.eps)
        _rope(q + h * hd, cs, a.n_rot, a.rope_mode)
    for h in range(Hkv):
        if a.k_norm != NULL:
            _norm_head(k + h * hd, a.k_norm, hd, a.eps)
        _rope(k + h * hd, cs, a.n_rot, a.rope_mode)
    if a.rot_k:
        _hadamard(q, H * hd, a.rot_k)
        _hadamard(k, Hkv * hd, a.rot_k)
    kv_store_row(a.k_type, k, a.k_cache + cell * a.k_row, Hkv * hd)
    if a.rot_v:
        v = k + Hkv * hd
        for d in range(Hkv * hd):
            v[d] = src[(H + Hkv) * hd + d]
        _hadamard(v, Hkv * hd, a.rot_v)
        kv_store_row(a.v_type, v, a.v_cache + cell * a.v_row, Hkv * hd)
    else:
        kv_store_row(a.v_type, src + (H + Hkv) * hd, a.v_cache + cell * a.v_row, Hkv * hd)


cdef void _attend(AttnArgs* a, Py_ssize_t i, float* scratch) noexcept nogil:
    """_attend_heads, then its output rotated back where a quantized V cache holds v rotated."""
    _attend_heads(a, i, scratch)
    cdef int G = a.H // a.Hkv
    if a.rot_v:
        _hadamard(a.out + (i // a.Hkv) * a.H * a.hd + (i % a.Hkv) * G * a.hd, G * a.hd, a.rot_v)


cdef void _attend_heads(AttnArgs* a, Py_ssize_t i, float* scratch) noexcept nogil:
    """softmax(q k^T * scale) v for the G = H / Hkv query heads of token i // Hkv that share kv
    head i % Hkv, over the token's listed cells: each cache row is read (and converted) once for
    the G heads. Per head the arithmetic is that of one head alone. scratch: q and acc (G * hd
    each), a converted k row and v row (hd each), then G * max_len scores."""
    cdef int hd = a.hd, H = a.H, G = a.H // a.Hkv, d, g
    cdef Py_ssize_t t = i // a.Hkv, j
    cdef int kvh = <int>(i % a.Hkv)
    cdef Py_ssize_t r0 = a.ranges[2 * t], r1 = a.ranges[2 * t + 1], L = a.max_len + 1  # scores per head
    cdef Py_ssize_t skipped = 0  # cells of the list before the window (ALiBi reads positions off the list)
    if a.n_swa > 0 and r1 > a.n_swa:  # a sliding window: the list's last n_swa cells
        skipped = r1 - a.n_swa
        r0 = r0 + r1 - a.n_swa
        r1 = a.n_swa
    cdef Py_ssize_t head = <Py_ssize_t>kvh * hd
    cdef float* q = scratch
    cdef float* acc = scratch + G * hd
    cdef float* kbuf = scratch + 2 * G * hd
    cdef float* vbuf = kbuf + hd
    cdef float* scores = vbuf + hd
    cdef float* o = a.out + t * H * hd + kvh * G * hd
    cdef const float* kr
    cdef const float* vr
    cdef float* ag
    cdef const unsigned char* row
    cdef bint k_f32 = a.k_type == KV_F32, v_f32 = a.v_type == KV_F32
    cdef float sc, total, p
    for d in range(G * hd):
        q[d] = o[d]
    if a.softcap <= 0 and a.sinks == NULL and a.alibi == NULL and pv_ggml_attend_ok(hd, a.k_type, a.v_type):
        # F32 caches: ggml's own float steps (see vec_math.h); scratch: q, then G * exact_len
        # scores, then kqv_lanes rows of hd sums
        pv_ggml_attend(q, G, hd, a.k_cache, a.k_row, head * 4, a.v_cache, a.v_row, head * 4, a.cells + r0, r1,
                       a.scale, a.kqv_lanes, q + G * hd, a.exact_len, q + G * hd + G * a.exact_len, o)
        return
    if a.softcap <= 0 and a.sinks == NULL and pv_attend_ok(G, hd, a.k_type, a.v_type):
        # F32 / F16 caches: every cache row read once for the G heads, straight from the cache
        pv_attend_qk(q, G, hd, a.k_cache, a.k_row, head * (4 if k_f32 else 2), a.k_type, a.cells + r0, r1,
                     a.scale, scores, L, a.v_cache, a.v_row, head * (4 if v_f32 else 2), a.v_type)
        if a.alibi != NULL:  # as below: the list holds the sequence's positions in order, from 0
            for g in range(G):
                sc = a.alibi[kvh * G + g]
                for j in range(r1):
                    scores[g * L + j] = scores[g * L + j] + sc * (-<float>fabs(<double>(a.pos[t] - (j + skipped))))
        for g in range(G):
            acc[g] = pv_softmax_unnormed(scores + g * L, r1)  # acc holds the G totals here
        pv_attend_pv(scores, acc, G, hd, a.v_cache, a.v_row, head * (4 if v_f32 else 2), a.v_type, a.cells + r0,
                     r1, L, o)
        return
    for d in range(G * hd):
        acc[d] = 0.0
    for j in range(r1):
        row = a.k_cache + a.cells[r0 + j] * a.k_row
        if k_f32:
            kr = <const float*>row + head
        else:
            kv_load(a.k_type, row, head, hd, kbuf)
            kr = kbuf
        for g in range(G):
            sc = pv_dot(q + g * hd, kr, hd)
            if a.softcap > 0:
                scores[g * L + j] = a.softcap * <float>tanh(sc * a.scale / a.softcap)
            else:
                scores[g * L + j] = sc * a.scale
            if a.alibi != NULL:  # the list holds the sequence's positions in order, from 0
                scores[g * L + j] = scores[g * L + j] + a.alibi[kvh * G + g] * (
                    -<float>fabs(<double>(a.pos[t] - (j + skipped))))
    for g in range(G):  # (room for the total: r1 <= max_len)
        if a.sinks != NULL:
            scores[g * L + r1] = pv_softmax_unnormed_sink(scores + g * L, r1, a.sinks[kvh * G + g])
        else:
            scores[g * L + r1] = pv_softmax_unnormed(scores + g * L, r1)
    for j in range(r1):
        row = a.v_cache + a.cells[r0 + j] * a.v_row
        if v_f32:
            vr = <const float*>row + head
        else:
            kv_load(a.v_type, row, head, hd, vbuf)
            vr = vbuf
        for g in range(G):
            p = scores[g * L + j]
            ag = acc + g * hd
            for d in range(hd):
                ag[d] = ag[d] + p * vr[d]
    for g in range(G):
        total = scores[g * L + r1]
        for d in range(hd):
            o[g * hd + d] = acc[g * hd + d] / total


ctypedef void (*attn_part_fn)(AttnArgs* a, Py_ssize_t i, float* scratch) noexcept nogil


cdef inline void _with_scratch(AttnArgs* a, Py_ssize_t floats, attn_part_fn fn, int64_t i) noexcept nogil:
    # one item's scratch (the pool's threads share no buffer)
    cdef float* scratch = <float*>malloc(sizeof(float) * floats)
    if scratch != NULL:
        fn(a, i, scratch)
        free(scratch)
    else:
        a.failed = 1


cdef void _store_item(void* ctx, int64_t t) noexcept nogil:
    _with_scratch(<AttnArgs*>ctx, (<AttnArgs*>ctx).store_floats, _store_token, t)


cdef void _attend_item(void* ctx, int64_t i) noexcept nogil:
    _with_scratch(<AttnArgs*>ctx, (<AttnArgs*>ctx).attend_floats, _attend, i)


cdef object _cache_bytes(object cache):
    """A cache as rows of bytes: the kernel takes any C-contiguous 2-D array (F32 tests pass float
    arrays; the backends pass the bytes of F16, BF16 and Q8_0 rows as uint8)."""
    if getattr(cache, "dtype", None) == np.uint8:
        return cache
    arr = np.asarray(cache)
    if arr.ndim != 2 or not arr.flags.c_contiguous:
        raise ValueError("attention: a KV cache must be a C-contiguous 2-D array")
    return arr.view(np.uint8).reshape(arr.shape[0], -1)


def kv_row_nbytes(int cache_type, Py_ssize_t n) -> int:
    """Bytes of a KV cache row of n elements of `cache_type` (a ggml type id); 0 when the type
    cannot hold such a row (not a cache type, or a block type with n not a multiple of 32)."""
    return kv_row_bytes(cache_type, n) if n >= 0 else 0


def kv_store(int cache_type, const float[:, ::1] x, unsigned char[:, ::1] rows):
    """Writes the rows of x into cache rows of `cache_type`, rounding as the attention kernel does."""
    cdef Py_ssize_t i, n = x.shape[0], w = x.shape[1]
    if rows.shape[0] != n or kv_row_bytes(cache_type, w) == 0 or rows.shape[1] != kv_row_bytes(cache_type, w):
        raise ValueError(f"kv_store: {n} rows of {w} do not fit {KV_TYPE_NAMES.get(cache_type, cache_type)} "
                         f"rows of {rows.shape[1]} bytes")
    with nogil:
        for i in range(n):
            kv_store_row(cache_type, &x[i, 0], &rows[i, 0], w)


def kv_load_rows(int cache_type, const unsigned char[:, ::1] rows, float[:, ::1] out):
    """Reads cache rows of `cache_type` back as floats, as the attention kernel does."""
    cdef Py_ssize_t i, n = rows.shape[0], w = out.shape[1]
    if out.shape[0] != n or kv_row_bytes(cache_type, w) == 0 or rows.shape[1] != kv_row_bytes(cache_type, w):
        raise ValueError(f"kv_load_rows: {n} rows of {rows.shape[1]} bytes are not "
                         f"{KV_TYPE_NAMES.get(cache_type, cache_type)} rows of {w}")
    with nogil:
        for i in range(n):
            kv_load(cache_type, &rows[i, 0], 0, w, &out[i, 0])


cdef const float *_per_head(object values, Py_ssize_t H, str what, list keep) except? NULL:
    """One float per head (attention sinks, ALiBi slopes), kept alive in `keep`; NULL when none."""
    if values is None:
        return NULL
    cdef const float[::1] v = values
    if v.shape[0] != H:
        raise ValueError(f"attention: {v.shape[0]} {what} for {H} heads")
    keep.append(v)
    return &v[0]


cdef int _attn_setup(AttnArgs* a, const float[:, ::1] qkv, unsigned char[:, ::1] kc, unsigned char[:, ::1] vc,
                     const int[::1] pos, const int[::1] kv_idx, const int[::1] cells, const int[:, ::1] ranges,
                     const float[::1] q_norm, const float[::1] k_norm, float[:, ::1] out,
                     int n_head, int n_head_kv, int head_dim, int n_rot, int rope_mode,
                     double freq_base, double freq_scale, float norm_eps, float scale, int n_threads,
                     int k_type, int v_type, float softcap, Py_ssize_t n_swa, double rope_mscale,
                     rope_freqs, list keep, sinks=None, alibi=None) except -1:
    """Checks everything but the per-step data (kv_idx, ranges and cells, rope_freqs' values: see
    _attn_scan) and fills a; the arrays a points into are appended to keep. 0: no tokens."""
    cdef Py_ssize_t n = qkv.shape[0], n_cells = kc.shape[0], n_listed = cells.shape[0]
    cdef int hd = head_dim, H = n_head, Hkv = n_head_kv
    cdef int use_norm = q_norm.shape[0] > 0
    cdef Py_ssize_t i
    # --- validation (the graph may come from the wire) ---
    if H <= 0 or Hkv <= 0 or hd <= 0 or H % Hkv or n_rot < 0 or n_rot > hd or n_rot % 2:
        raise ValueError("attention: bad head parameters")
    if rope_mode not in (0, 2):
        raise ValueError(f"attention: unknown rope mode {rope_mode}")
    # widths in 64 bits: crafted head counts must not wrap into plausible shapes
    cdef Py_ssize_t q_width = <Py_ssize_t>H * hd, kv_width = <Py_ssize_t>Hkv * hd
    if qkv.shape[1] != q_width + 2 * kv_width or out.shape[0] != n or out.shape[1] != q_width:
        raise ValueError("attention: qkv / out shapes do not match the head parameters")
    for name, typ in (("K", k_type), ("V", v_type)):
        if typ not in KV_TYPE_NAMES:
            raise ValueError(f"attention: type {typ} cannot hold a {name} cache "
                             f"({', '.join(KV_TYPE_NAMES.values())} can)")
        if kv_row_bytes(typ, kv_width) == 0:
            raise ValueError(f"attention: a {KV_TYPE_NAMES[typ]} {name} cache needs rows of a multiple of 32 "
                             f"elements, not {kv_width}")
    cdef Py_ssize_t k_row = kv_row_bytes(k_type, kv_width), v_row = kv_row_bytes(v_type, kv_width)
    if kc.shape[1] != k_row or vc.shape[0] != n_cells or vc.shape[1] != v_row:
        raise ValueError("attention: KV cache shapes do not match the head parameters and cache types")
    if pos.shape[0] != n or kv_idx.shape[0] != n or ranges.shape[0] != n or ranges.shape[1] != 2:
        raise ValueError("attention: per-token inputs must have one row per token")
    if use_norm and (q_norm.shape[0] != hd or k_norm.shape[0] != hd):
        raise ValueError("attention: q/k norm weights must have head_dim elements")
    if not (softcap >= 0 and n_swa >= 0 and rope_mscale > 0):
        raise ValueError(f"attention: softcap {softcap}, n_swa {n_swa} or rope_mscale {rope_mscale} out of range")
    cdef const float[::1] ff
    if rope_freqs is not None:
        ff = rope_freqs
        if ff.shape[0] != n_rot // 2:
            raise ValueError(f"attention: rope_freqs has {ff.shape[0]} elements, expected n_rot / 2 = {n_rot // 2}")
        keep.append(ff)
    if n == 0:
        return 0
    a.qkv = &qkv[0, 0]
    a.qkv_stride = qkv.shape[1]
    a.k_cache = &kc[0, 0] if n_cells else NULL
    a.v_cache = &vc[0, 0] if n_cells else NULL
    a.k_row = k_row
    a.v_row = v_row
    a.k_type = k_type
    a.v_type = v_type
    a.pos = &pos[0]
    a.kv_idx = &kv_idx[0]
    a.cells = &cells[0] if n_listed else NULL
    a.ranges = &ranges[0, 0]
    a.q_norm = &q_norm[0] if use_norm else NULL
    a.k_norm = &k_norm[0] if use_norm else NULL
    a.freq_factors = &ff[0] if rope_freqs is not None and n_rot > 0 else NULL
    a.sinks = _per_head(sinks, H, "sinks", keep)
    a.alibi = _per_head(alibi, H, "ALiBi slopes", keep)
    a.mscale = <float>rope_mscale
    a.softcap = softcap
    a.n_swa = n_swa
    a.out = &out[0, 0]
    a.H = H
    a.Hkv = Hkv
    a.hd = hd
    a.n_rot = n_rot
    a.rope_mode = rope_mode
    a.theta_scale = powf(<float>freq_base, (<float>-2.0) / (<float>n_rot)) if n_rot > 0 else 1.0
    a.freq_scale = <float>freq_scale
    a.eps = norm_eps
    a.scale = scale
    a.n = n
    a.n_cells = n_cells
    a.n_listed = n_listed
    a.q_width = q_width
    a.n_threads = n_threads
    # the store's cos/sin and k row
    a.rot_k, a.rot_v = _rotation_sizes(hd, k_type, v_type)
    a.store_floats = n_rot + 2 + 2 * kv_width
    keep.extend((qkv, kc, vc, pos, kv_idx, cells, ranges, q_norm, k_norm, out))
    return 1


cdef int _attn_scan(AttnArgs* a) noexcept nogil:
    """The per-step data in range (nonzero when not: attention()'s checks then say where), and
    what depends on it: the longest list, the attend's scratch, the threads for the work."""
    cdef Py_ssize_t t, i, r0, r1, max_len = 0, max_end = 0, work = 0
    if a.freq_factors != NULL:
        for i in range(a.n_rot // 2):
            if not a.freq_factors[i] > 0:
                return 1
    for t in range(a.n):
        if a.kv_idx[t] < 0 or a.kv_idx[t] >= a.n_cells:
            return 1
        r0 = a.ranges[2 * t]
        r1 = a.ranges[2 * t + 1]
        if r0 < 0 or r1 < 1 or r0 + r1 > a.n_listed:
            return 1
        if r1 > max_len:
            max_len = r1
        if r0 + r1 > max_end:
            max_end = r0 + r1
        work += r1
    for i in range(max_end):  # only the referenced prefix of the list is meaningful
        if a.cells[i] < 0 or a.cells[i] >= a.n_cells:
            return 1
    a.max_len = max_len
    a.nt = a.n_threads if work * a.H * a.hd >= PARALLEL_MIN_ATTENTION else 1
    # the attend's q and acc per head, k and v rows, scores
    a.attend_floats = 2 * a.q_width // a.Hkv + 2 * a.hd + (a.H // a.Hkv) * (max_len + 1)
    a.exact_len = (max_len + 63) // 64 * 64
    a.kqv_lanes = GGML_KQV_LANES_ONE_ROW if a.n == 1 else GGML_KQV_LANES_ROWS
    if a.attend_floats < a.q_width // a.Hkv + (a.H // a.Hkv) * a.exact_len + a.kqv_lanes * a.hd:
        a.attend_floats = a.q_width // a.Hkv + (a.H // a.Hkv) * a.exact_len + a.kqv_lanes * a.hd
    return 0


cdef int _attn_compute(AttnArgs* a) noexcept nogil:
    """Nonzero when an item could not allocate its scratch."""
    a.failed = 0
    # every token's k and v are in the cache before any token attends (a prompt's tokens attend to
    # each other)
    pool_run(a.nt, a.n, _store_item, a)
    pool_run(a.nt, a.n * a.Hkv, _attend_item, a)
    return a.failed


cdef int _attn_step(void* ctx, unsigned char* scratch) noexcept nogil:
    cdef AttnArgs* a = <AttnArgs*>ctx
    if _attn_scan(a):
        return 1
    return _attn_compute(a)


cdef _check_freqs(int n_rot, rope_freqs):
    cdef const float[::1] ff
    cdef Py_ssize_t i
    if rope_freqs is not None:
        ff = rope_freqs
        for i in range(n_rot // 2):
            if not ff[i] > 0:
                raise ValueError(f"attention: rope_freqs[{i}] is {ff[i]}, not a positive number")


cdef _attn_explain(const int[::1] kv_idx, const int[::1] cells, const int[:, ::1] ranges, Py_ssize_t n_cells,
                   int n_rot, rope_freqs):
    """Raises the reason _attn_scan refused the per-step data."""
    cdef Py_ssize_t t, i, r0, r1, max_end = 0, n_listed = cells.shape[0]
    _check_freqs(n_rot, rope_freqs)
    for t in range(kv_idx.shape[0]):
        if kv_idx[t] < 0 or kv_idx[t] >= n_cells:
            raise ValueError(f"attention: cell {kv_idx[t]} outside the cache of {n_cells}")
        r0 = ranges[t, 0]
        r1 = ranges[t, 1]
        if r0 < 0 or r1 < 1 or r0 + r1 > n_listed:
            raise ValueError(f"attention: token {t} attends to cells [{r0}, {r0 + r1}) outside the list of {n_listed}")
        if r0 + r1 > max_end:
            max_end = r0 + r1
    for i in range(max_end):
        if cells[i] < 0 or cells[i] >= n_cells:
            raise ValueError(f"attention: listed cell {cells[i]} outside the cache of {n_cells}")
    raise ValueError("attention: per-step inputs out of range")


def attention(const float[:, ::1] qkv, k_cache, v_cache,
              const int[::1] pos, const int[::1] kv_idx, const int[::1] cells, const int[:, ::1] ranges,
              const float[::1] q_norm, const float[::1] k_norm, float[:, ::1] out,
              int n_head, int n_head_kv, int head_dim, int n_rot, int rope_mode,
              double freq_base, double freq_scale, float norm_eps, float scale, int n_threads=1,
              int k_type=0, int v_type=0, float softcap=0.0, Py_ssize_t n_swa=0, double rope_mscale=1.0,
              rope_freqs=None, sinks=None, alibi=None):
    """One layer's self-attention for a micro-batch (see Op.ATTENTION). k_cache and v_cache are
    [n_cells, row] arrays holding rows of k_type and v_type (ggml type ids: F32 0, F16 1, Q8_0 8,
    BF16 30, Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, IQ4_NL 20), as uint8 bytes or, for F32, as float32. softcap, n_swa, rope_mscale and rope_freqs
    (float32 [n_rot / 2] or None), sinks and alibi (float32 [n_head] or None) are Op.ATTENTION's
    optional parameters and sources."""
    cdef unsigned char[:, ::1] kc = _cache_bytes(k_cache)
    cdef unsigned char[:, ::1] vc = _cache_bytes(v_cache)
    cdef AttnArgs a
    cdef list keep = []
    cdef int failed
    if not _attn_setup(&a, qkv, kc, vc, pos, kv_idx, cells, ranges, q_norm, k_norm, out, n_head, n_head_kv,
                       head_dim, n_rot, rope_mode, freq_base, freq_scale, norm_eps, scale, n_threads, k_type,
                       v_type, softcap, n_swa, rope_mscale, rope_freqs, keep, sinks, alibi):
        _check_freqs(n_rot, rope_freqs)  # no tokens: only the factors can be wrong
        return
    if _attn_scan(&a):
        _attn_explain(kv_idx, cells, ranges, kc.shape[0], n_rot, rope_freqs)
    with nogil:
        failed = _attn_compute(&a)
    if failed:
        raise MemoryError("attention: cannot allocate scratch")


def bind_attention(checked, const float[:, ::1] qkv, k_cache, v_cache,
                   const int[::1] pos, const int[::1] kv_idx, const int[::1] cells, const int[:, ::1] ranges,
                   const float[::1] q_norm, const float[::1] k_norm, float[:, ::1] out,
                   int n_head, int n_head_kv, int head_dim, int n_rot, int rope_mode,
                   double freq_base, double freq_scale, float norm_eps, float scale, int n_threads=1,
                   int k_type=0, int v_type=0, float softcap=0.0, Py_ssize_t n_swa=0, double rope_mscale=1.0,
                   rope_freqs=None, sinks=None, alibi=None):
    """attention (same arguments) bound as a NativeStep, or None for no tokens. The per-step data
    (cells, ranges, ids) is checked at every run."""
    cdef unsigned char[:, ::1] kc = _cache_bytes(k_cache)
    cdef unsigned char[:, ::1] vc = _cache_bytes(v_cache)
    cdef NativeStep s = step_for(sizeof(AttnArgs), checked)
    cdef list keep = []
    if not _attn_setup(<AttnArgs *>s.ctx, qkv, kc, vc, pos, kv_idx, cells, ranges, q_norm, k_norm, out, n_head,
                       n_head_kv, head_dim, n_rot, rope_mode, freq_base, freq_scale, norm_eps, scale, n_threads,
                       k_type, v_type, softcap, n_swa, rope_mscale, rope_freqs, keep, sinks, alibi):
        return None
    return bound(s, _attn_step, keep)


# --- DeepSeek's latent attention (backend/cpu/mla.py): its RoPE and its attention in ggml's steps ---

def rope_rows(float[:, :, ::1] x, const int[::1] pos, double freq_base, double freq_scale, double ext_factor,
              double attn_factor, double beta_fast, double beta_slow, int n_ctx_orig):
    """x [n, heads, n_dims] rotated in place by ggml's rope_ext in the normal mode (adjacent pairs),
    YaRN included, in its float steps: the angles of pv_rope_cache_yarn (the corrected dimensions
    floorf / ceilf of ggml's float formula) and the pairs rotated as _rope."""
    cdef Py_ssize_t n = x.shape[0], H = x.shape[1], t, h
    cdef int n_dims = <int>x.shape[2], half = n_dims // 2
    if pos.shape[0] != n or n_dims % 2 or n_dims <= 0 or not freq_base > 0 or not freq_scale > 0:
        raise ValueError(f"rope_rows: {n} rows of {H} x {n_dims} at {pos.shape[0]} positions, base {freq_base}, "
                         f"scale {freq_scale}")
    if n == 0:
        return
    cdef float low = 0, high = 0, base = <float>freq_base, pi = <float>3.14159265358979323846
    if ext_factor != 0:
        low = floorf(n_dims * logf(n_ctx_orig / (<float>beta_fast * 2 * pi)) / (2 * logf(base)))
        high = ceilf(n_dims * logf(n_ctx_orig / (<float>beta_slow * 2 * pi)) / (2 * logf(base)))
        low = low if low > 0 else 0
        high = high if high < n_dims - 1 else n_dims - 1
    cdef float theta_scale = powf(base, (<float>-2.0) / (<float>n_dims))
    cdef float* cs = <float*>malloc(sizeof(float) * (n_dims + 2))
    if cs == NULL:
        raise MemoryError()
    with nogil:
        for t in range(n):
            pv_rope_cache_yarn(<float>pos[t], half, theta_scale, <float>freq_scale, low, high, <float>ext_factor,
                               <float>attn_factor, cs)
            for h in range(H):
                _rope(&x[t, h, 0], cs, n_dims, 0)
    free(cs)


def mla_attend(const float[:, ::1] query, k_cache, const int[::1] cells, const int[:, ::1] ranges, int n_head,
               int width, int lora, float scale, float[:, ::1] latents) -> bool:
    """Latent attention's core over an F32 cache in ggml's steps (pv_ggml_attend_kv): for token t,
    query[t] (n_head rows of width: the absorbed query and its rotated part) against the cache rows
    of its listed cells (width floats each), the values the first `lora` floats of the same rows,
    into latents[t] (n_head rows of lora). False (nothing done) where this build or these widths
    have no such steps: the caller computes it otherwise."""
    if not pv_ggml_attend_ok(width, 0, 0) or lora % 16 or lora > width:
        return False
    cdef unsigned char[:, ::1] kc = _cache_bytes(k_cache)
    cdef Py_ssize_t n = query.shape[0], n_cells = kc.shape[0], n_listed = cells.shape[0], t, i, r0, r1, L, max_len = 0
    if (query.shape[1] != <Py_ssize_t>n_head * width or latents.shape[0] != n or
            latents.shape[1] != <Py_ssize_t>n_head * lora or kc.shape[1] != 4 * width or ranges.shape[0] != n):
        raise ValueError("mla_attend: shapes do not match the heads, widths and cache rows")
    for t in range(n):
        r0, r1 = ranges[t, 0], ranges[t, 1]
        if r0 < 0 or r1 < 1 or r0 + r1 > n_listed:
            raise ValueError(f"mla_attend: token {t} attends to cells [{r0}, {r0 + r1}) outside the list")
        for i in range(r0, r0 + r1):
            if cells[i] < 0 or cells[i] >= n_cells:
                raise ValueError(f"mla_attend: listed cell {cells[i]} outside the cache of {n_cells}")
        max_len = r1 if r1 > max_len else max_len
    if n == 0:
        return True
    L = (max_len + 63) // 64 * 64
    cdef int lanes = GGML_KQV_LANES_ONE_ROW if n == 1 else GGML_KQV_LANES_ROWS
    cdef float* scratch = <float*>malloc(sizeof(float) * (n_head * L + 64 * lora))
    if scratch == NULL:
        raise MemoryError()
    with nogil:
        for t in range(n):
            r0, r1 = ranges[t, 0], ranges[t, 1]
            pv_ggml_attend_kv(&query[t, 0], n_head, width, lora, &kc[0, 0], 4 * width, 0, &kc[0, 0], 4 * width, 0,
                              &cells[r0], r1, scale, lanes, scratch, L, scratch + n_head * L, &latents[t, 0])
    free(scratch)
    return True
