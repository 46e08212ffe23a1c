/* Vectorized float math for the element-wise kernels of ops.pyx.
 *
 * pv_dot: sum of a[i] * b[i] in 16 lanes (two 8-lane FMA chains, added lane-wise, then reduced in
 * a fixed order), so the same inputs always give the same sum; the n % 8 tail is added last.
 * pv_exp_shift_sum: x[i] = exp(x[i] - m) in place, returns their sum (lane-wise, then reduced);
 * pv_softmax_unnormed: the same with m the row's maximum (a softmax but for the division).
 *
 * pv_exp8 (the softmax's exp) is the usual range reduction (x = n ln2 + r, |r| <= ln2 / 2, ln2 split
 * in two parts so r is exact to float precision) and a degree-6 polynomial for e^r, then 2^n put
 * into the exponent bits: within 2 ulp of expf over the clamped range [-87.3, 88].
 * pv_silu_mul: out = silu(g) * u = g / (1 + exp(-g)) * u with ggml's own vector exp (pv_ggml_exp*),
 * so that the FFN's activations are ggml's bit for bit.
 * pv_rms_row: a row of RMS norm in ggml's float steps.
 */
#ifndef PYLLAMA_VEC_MATH_H
#define PYLLAMA_VEC_MATH_H

#include <math.h>
#include <stdint.h>

#include "pinned_sum.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 pv_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float pv_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static inline float pv_dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s = pv_hsum8(_mm256_add_ps(s0, s1));
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float pv_exp_shift_sum(float *x, int64_t n, float m) {
    int64_t i = 0;
    float total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 t = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        const __m256 e = pv_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
        _mm256_storeu_ps(x + i, e);
        t = _mm256_add_ps(t, e);
    }
    total = pv_hsum8(t);
#endif
    for (; i < n; i++) { x[i] = expf(x[i] - m); total += x[i]; }
    return total;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PV_ATTEND_MAX_G 8
/* 8 elements of a cache row of type kt (0: F32, 1: F16) as floats */
static inline __m256 pv_row8(int kt, const unsigned char *p) {
    return kt ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)) : _mm256_loadu_ps((const float *)p);
}
/* The cache lines of one head's slice of a cache row (bytes long), requested ahead of use: a
 * token's cells are rows apart in the cache, too short a run for the hardware prefetcher. */
static inline void pv_prefetch_slice(const unsigned char *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
}
#define PV_PREFETCH_CELLS 8

/* [sum(a0), sum(a1), sum(a2), sum(a3)]: each vector's 8 lanes added pairwise, then the halves */
static inline __m128 pv_hsum8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* scores[g * L + c] = scale * q_g . k_c for GN query heads and 4 cells, of which the first nc
 * are stored (the others repeat a real row and are dropped). Every cell's sum runs the same
 * way whatever its place in the block, so a score does not depend on how many cells follow. */
static inline __attribute__((always_inline)) void pv_qk_block(const float *q, const int GN, int hd,
        const unsigned char *const *k, int kt, float scale, float *scores, long long L, int nc) {
    const int es = kt ? 2 : 4;
    __m256 acc[4][4];
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < 4; c++) acc[c][g] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 8) {
        const __m256 x0 = pv_row8(kt, k[0] + es * d), x1 = pv_row8(kt, k[1] + es * d);
        const __m256 x2 = pv_row8(kt, k[2] + es * d), x3 = pv_row8(kt, k[3] + es * d);
        for (int g = 0; g < GN; g++) {
            const __m256 qg = _mm256_loadu_ps(q + g * hd + d);
            acc[0][g] = _mm256_fmadd_ps(qg, x0, acc[0][g]);
            acc[1][g] = _mm256_fmadd_ps(qg, x1, acc[1][g]);
            acc[2][g] = _mm256_fmadd_ps(qg, x2, acc[2][g]);
            acc[3][g] = _mm256_fmadd_ps(qg, x3, acc[3][g]);
        }
    }
    for (int g = 0; g < GN; g++) {
        const __m128 r = _mm_mul_ps(pv_hsum8x4(acc[0][g], acc[1][g], acc[2][g], acc[3][g]), _mm_set1_ps(scale));
        if (nc == 4) {
            _mm_storeu_ps(scores + g * L, r);
        } else {
            float t[4];
            _mm_storeu_ps(t, r);
            for (int c = 0; c < nc; c++) scores[g * L + c] = t[c];
        }
    }
}

/* One kv head's attention for G <= PV_ATTEND_MAX_G query heads over n cells, straight from F32
 * or F16 cache rows (no converted copy): scores[g * L + j] = scale * q_g . k_j, the caller's
 * softmax in between (attend_pv), then out_g = sum_j p[g * L + j] * v_j / total_g. Cells go 4 at
 * a time for up to 4 heads (the 16 sums reduced together, pv_hsum8x4); per head and cell the
 * sums run in 8 lanes, reduced in a fixed order. hd a multiple of 8. */
static inline void pv_attend_qk(const float *q, int G, int hd, const unsigned char *kc, long long k_row,
                                long long head_bytes, int kt, const int *cells, long long n, float scale,
                                float *scores, long long L, const unsigned char *vc, long long v_row,
                                long long v_head_bytes, int vt) {
    const int k_bytes = hd * (kt ? 2 : 4), v_bytes = hd * (vt ? 2 : 4);
    /* K rows a few cells ahead; each V row as its K row is read, for attend_pv right after */
    for (long long i = 0; i < n && i < PV_PREFETCH_CELLS; i++)
        pv_prefetch_slice(kc + (long long)cells[i] * k_row + head_bytes, k_bytes);
    for (long long j = 0; j < n; j += 4) {
        const int nc = n - j < 4 ? (int)(n - j) : 4;
        const unsigned char *k[4];
        for (int c = 0; c < 4; c++) {
            k[c] = kc + (long long)cells[j + (c < nc ? c : 0)] * k_row + head_bytes;
            if (j + PV_PREFETCH_CELLS + c < n)
                pv_prefetch_slice(kc + (long long)cells[j + PV_PREFETCH_CELLS + c] * k_row + head_bytes, k_bytes);
            if (c < nc) pv_prefetch_slice(vc + (long long)cells[j + c] * v_row + v_head_bytes, v_bytes);
        }
        for (int g0 = 0; g0 < G; g0 += 4) {
            float *sc = scores + g0 * L + j;
            const float *qg = q + g0 * hd;
            switch (G - g0 < 4 ? G - g0 : 4) {
                case 1: pv_qk_block(qg, 1, hd, k, kt, scale, sc, L, nc); break;
                case 2: pv_qk_block(qg, 2, hd, k, kt, scale, sc, L, nc); break;
                case 3: pv_qk_block(qg, 3, hd, k, kt, scale, sc, L, nc); break;
                default: pv_qk_block(qg, 4, hd, k, kt, scale, sc, L, nc); break;
            }
        }
    }
}
/* out_g[d, d + 8 NV) = sum_j p[g * L + j] v_j[d, d + 8 NV) / totals[g] for GN heads: each cell's
 * row read once for them all, one chain per (head, 8 lanes) over the cells in list order. */
static inline __attribute__((always_inline)) void pv_pv_block(const float *p, const float *totals, const int GN,
        const int NV, int hd, int d, const unsigned char *vc, long long v_row, long long head_bytes, int vt,
        const int *cells, long long n, long long L, float *out) {
    const int es = vt ? 2 : 4;
    __m256 acc[4][4];
    for (int g = 0; g < GN; g++)
        for (int v = 0; v < NV; v++) acc[g][v] = _mm256_setzero_ps();
    for (long long j = 0; j < n; j++) {
        const unsigned char *row = vc + (long long)cells[j] * v_row + head_bytes + es * d;
        __m256 x[4];
        for (int v = 0; v < NV; v++) x[v] = pv_row8(vt, row + es * 8 * v);
        for (int g = 0; g < GN; g++) {
            const __m256 pg = _mm256_set1_ps(p[g * L + j]);
            for (int v = 0; v < NV; v++) acc[g][v] = _mm256_fmadd_ps(pg, x[v], acc[g][v]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int v = 0; v < NV; v++)
            _mm256_storeu_ps(out + g * hd + d + 8 * v, _mm256_div_ps(acc[g][v], _mm256_set1_ps(totals[g])));
}
#define PV_PV_CASE(GN, NV) pv_pv_block(p + g0 * L, totals + g0, GN, NV, hd, d, vc, v_row, head_bytes, vt, cells, n, L, \
                                       out + g0 * hd)
/* softmax(...) v for G heads: 32 lanes of the head for up to 4 heads at a time (the tail of a head
 * size not a multiple of 32 by 8 lanes), so a row's conversion and a weight's broadcast serve
 * four vectors of sums. */
static inline void pv_attend_pv(const float *p, const float *totals, int G, int hd, const unsigned char *vc,
                                long long v_row, long long head_bytes, int vt, const int *cells, long long n,
                                long long L, float *out) {
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int gn = G - g0 < 4 ? G - g0 : 4;
        int d = 0;
        for (; d + 32 <= hd; d += 32)
            switch (gn) {
                case 1: PV_PV_CASE(1, 4); break;
                case 2: PV_PV_CASE(2, 4); break;
                case 3: PV_PV_CASE(3, 4); break;
                default: PV_PV_CASE(4, 4); break;
            }
        for (; d < hd; d += 8)
            switch (gn) {
                case 1: PV_PV_CASE(1, 1); break;
                case 2: PV_PV_CASE(2, 1); break;
                case 3: PV_PV_CASE(3, 1); break;
                default: PV_PV_CASE(4, 1); break;
            }
    }
}
#undef PV_PV_CASE
static inline int pv_attend_ok(int G, int hd, int kt, int vt) {
    return G <= PV_ATTEND_MAX_G && hd % 8 == 0 && (kt == 0 || kt == 1) && (vt == 0 || vt == 1);
}
#else
static inline int pv_attend_ok(int G, int hd, int kt, int vt) { (void)G; (void)hd; (void)kt; (void)vt; return 0; }
static inline void pv_attend_qk(const float *q, int G, int hd, const unsigned char *kc, long long k_row,
                                long long head_bytes, int kt, const int *cells, long long n, float scale,
                                float *scores, long long L, const unsigned char *vc, long long v_row,
                                long long v_head_bytes, int vt) {
    (void)q; (void)G; (void)hd; (void)kc; (void)k_row; (void)head_bytes; (void)kt; (void)cells; (void)n;
    (void)scale; (void)scores; (void)L; (void)vc; (void)v_row; (void)v_head_bytes; (void)vt;
}
static inline void pv_attend_pv(const float *p, const float *totals, int G, int hd, const unsigned char *vc,
                                long long v_row, long long head_bytes, int vt, const int *cells, long long n,
                                long long L, float *out) {
    (void)p; (void)totals; (void)G; (void)hd; (void)vc; (void)v_row; (void)head_bytes; (void)vt; (void)cells;
    (void)n; (void)L; (void)out;
}
#endif

static inline float pv_softmax_unnormed(float *x, int64_t n) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    return pv_exp_shift_sum(x, n, m);
}

/* The same with an attention sink: one more logit that joins the maximum and the denominator but
 * has no value (ggml's soft_max with sinks: max over the row and the sink, then exp(sink - max)
 * added to the sum). */
static inline float pv_softmax_unnormed_sink(float *x, int64_t n, float sink) {
    float m = sink;
    for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    return pv_exp_shift_sum(x, n, m) + expf(sink - m);
}

/* exp(x) as ggml's vectorized ggml_v_expf computes it (a range reduction x = n ln2 + b with
 * n = round(x / ln2) by the 1.5 * 2^23 trick, ln2 in two parts, and a degree-5 polynomial in b
 * evaluated as c1 b + u (c2 + c3 b + u (c4 + c5 b)), u = b^2), in its AVX-512 form (16 lanes,
 * scalef) or its AVX2 form (8 lanes, 2^n put in the exponent bits: k + k j): silu and the softmax
 * give ggml's bits only with ggml's exp. */
#if defined(__AVX512F__) && defined(__AVX512DQ__)
static inline __m512 pv_ggml_exp16(__m512 x) {
    const __m512 shift = _mm512_set1_ps(0x1.8p23f);
    const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), shift);
    const __m512 n = _mm512_sub_ps(z, shift);
    const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
    const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
    const __m512 u = _mm512_mul_ps(b, b);
    const __m512 j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)), u,
                        _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
        u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
    const __m512 res = _mm512_scalef_ps(j, n);
    if (!big) return res;
    const __m512 alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ),
                                            _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
    return _mm512_mask_blend_ps(big, res, alt);
}
#define PV_GGML_EXP_LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 pv_ggml_exp8(__m256 x) {
    const __m256 shift = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), shift);
    const __m256 n = _mm256_sub_ps(z, shift);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1))));
    const __m256 an = _mm256_andnot_ps(_mm256_set1_ps(-0.f), n);
    const __m256i c = _mm256_castps_si256(_mm256_cmp_ps(an, _mm256_set1_ps(126), _CMP_GT_OQ));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                        _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
    if (!_mm256_movemask_ps(_mm256_castsi256_ps(c))) return _mm256_fmadd_ps(j, k, k);
    /* |n| > 126: 2^n in two factors (and beyond 192 an overflow or underflow), as ggml */
    const __m256i g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                       _mm256_set1_epi32((int)0x82000000u));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    const __m256 d = _mm256_cmp_ps(an, _mm256_set1_ps(192), _CMP_GT_OQ);
    const __m256 cf = _mm256_castsi256_ps(c);
    return _mm256_or_ps(_mm256_and_ps(d, _mm256_mul_ps(s1, s1)),
                        _mm256_andnot_ps(d, _mm256_or_ps(_mm256_and_ps(cf, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                                                         _mm256_andnot_ps(cf, _mm256_fmadd_ps(k, j, k)))));
}
#define PV_GGML_EXP_LANES 8
#else
#define PV_GGML_EXP_LANES 0
#endif

/* out = silu(g) * u as ggml_vec_swiglu_f32: g / (1 + exp(-g)) with ggml's vector exp, times u; the
 * tail (n % lanes) with expf, as ggml's scalar ggml_silu_f32. */
static inline void pv_silu_mul(const float *g, const float *u, float *out, int64_t n) {
    int64_t i = 0;
#if PV_GGML_EXP_LANES == 16
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 e = pv_ggml_exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
#elif PV_GGML_EXP_LANES == 8
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = pv_ggml_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* Element j of pv_silu_mul's result over a row of n: ggml's vector exp where j lies in a whole
 * vector of the row (the lanes do not mix), expf in the row's tail; for kernels that produce a
 * row's values one at a time (the MoE FFN's experts). */
__attribute__((noinline, optimize("no-associative-math", "fp-contract=off")))
static float pv_silu_mul_at(float g, float u, int64_t j, int64_t n) {
#if PV_GGML_EXP_LANES == 16
    if (j < n - n % 16) {
        const float e = _mm_cvtss_f32(_mm512_castps512_ps128(pv_ggml_exp16(_mm512_set1_ps(0.0f - g))));
        return g / (1.0f + e) * u;
    }
#elif PV_GGML_EXP_LANES == 8
    if (j < n - n % 8) {
        const float e = _mm_cvtss_f32(_mm256_castps256_ps128(pv_ggml_exp8(_mm256_set1_ps(0.0f - g))));
        return g / (1.0f + e) * u;
    }
#endif
    (void)j; (void)n;
    return g / (1.0f + expf(-g)) * u;
}

/* out = gelu(g) * u, or gelu(g) where u is NULL, gelu in its tanh form written as a logistic:
 * 0.5 (1 + tanh(z)) = 1 / (1 + exp(-2 z)), z = sqrt(2 / pi) (g + 0.044715 g^3), so that it takes
 * ggml's vector exp (a libm tanh per element was a third of a GeGLU encoder's step) and 1 + tanh(z)
 * never cancels where z is very negative. Within a few float ulp of the tanh form. */
static inline void pv_gelu_mul(const float *g, const float *u, float *out, int64_t n) {
    const float k1 = -1.5957691216057308f, k3 = -1.5957691216057308f * 0.044715f;  /* -2 sqrt(2 / pi) (1, 0.044715) */
    int64_t i = 0;
#if PV_GGML_EXP_LANES == 16
    const __m512 one = _mm512_set1_ps(1.0f), v1 = _mm512_set1_ps(k1), v3 = _mm512_set1_ps(k3);
    for (; i + 16 <= n; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 e = pv_ggml_exp16(_mm512_mul_ps(gv, _mm512_fmadd_ps(_mm512_mul_ps(gv, gv), v3, v1)));
        __m512 r = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        if (u) r = _mm512_mul_ps(r, _mm512_loadu_ps(u + i));
        _mm512_storeu_ps(out + i, r);
    }
#elif PV_GGML_EXP_LANES == 8
    const __m256 one = _mm256_set1_ps(1.0f), v1 = _mm256_set1_ps(k1), v3 = _mm256_set1_ps(k3);
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = pv_ggml_exp8(_mm256_mul_ps(gv, _mm256_fmadd_ps(_mm256_mul_ps(gv, gv), v3, v1)));
        __m256 r = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        if (u) r = _mm256_mul_ps(r, _mm256_loadu_ps(u + i));
        _mm256_storeu_ps(out + i, r);
    }
#endif
    for (; i < n; i++) {
        const float r = g[i] / (1.0f + expf(g[i] * (k1 + k3 * g[i] * g[i])));
        out[i] = u ? r * u[i] : r;
    }
}

/* One row of LayerNorm as ggml's norm, then its mul by w and add of b: the mean of a double sum,
 * x - mean in float, the variance from the squares summed in double, scale = 1 / sqrtf(variance
 * + eps) in float. */
static void pv_layer_norm_row(const float *x, const float *w, const float *b, float *out, int64_t d, float eps) {
    double sum = 0.0;
    for (int64_t j = 0; j < d; j++) sum += (double)x[j];
    const float mean = (float)(sum / (double)d);
    double sq = 0.0;
    for (int64_t j = 0; j < d; j++) {
        const float y = x[j] - mean;
        out[j] = y;
        sq += (double)(y * y);
    }
    const float scale = 1.0f / sqrtf((float)(sq / (double)d) + eps);
    for (int64_t j = 0; j < d; j++) out[j] = out[j] * scale * w[j] + b[j];
}

/* One row of RMS norm times w as ggml's rms_norm (+ mul): the squares rounded to float and added
 * in double one by one, the mean rounded to float, scale = 1 / sqrtf(mean + eps) in float, then
 * x * scale * w. No reassociation (the module is built with -fassociative-math), so the double
 * sum is ggml's sequential one. */
__attribute__((noinline, optimize("no-associative-math", "fp-contract=off")))
static void pv_rms_row(const float *x, const float *w, float *out, int64_t d, float eps) {
    double sum = 0.0;
    for (int64_t j = 0; j < d; j++) sum += (double)(x[j] * x[j]);
    const float mean = (float)(sum / (double)d);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int64_t j = 0; j < d; j++) out[j] = x[j] * scale * w[j];
}

/* RoPE's cos and sin as ggml's rope cache (ggml_rope_cache_init, rope_yarn without extrapolation
 * mixing): theta starts at the position as a float and is multiplied by theta_scale (powf(base,
 * -2 / n_rot), a float) pair after pair, each pair's angle is freq_scale * (theta / factor) and
 * cos, sin come from sincosf, times mscale; all in float, so the angles are ggml's bit for bit
 * (a double chain differs by some ulp at positions above 0). cs: cos, sin interleaved. */
__attribute__((noinline, optimize("no-associative-math", "fp-contract=off")))
static void pv_rope_cache(float pos, int half, float theta_scale, float freq_scale, const float *factors,
                          float mscale, float *cs) {
    float theta = pos;
    for (int i = 0; i < half; i++) {
        const float th = freq_scale * (factors ? theta / factors[i] : theta);
        float s, c;
        sincosf(th, &s, &c);
        cs[2 * i] = c * mscale;
        cs[2 * i + 1] = s * mscale;
        theta *= theta_scale;
    }
}

/* pv_rope_cache with YaRN as ggml's rope_yarn: pair i's angle mixes the interpolated freq_scale *
 * theta and the extrapolated theta by ramp(i) * ext_factor, ramp(i) = 1 - clamp((i - low) / max(0.001,
 * high - low), 0, 1) over ggml's corrected dimensions low, high; with ext_factor != 0 mscale is
 * multiplied by 1 + 0.1 * logf(1 / freq_scale). All in float, as ggml. */
__attribute__((noinline, optimize("no-associative-math", "fp-contract=off")))
static void pv_rope_cache_yarn(float pos, int half, float theta_scale, float freq_scale, float low, float high,
                               float ext_factor, float mscale, float *cs) {
    float theta = pos;
    /* ggml's float steps as GCC contracts them: a * b + c and a * b + c * d with the first product fused */
    if (ext_factor != 0.0f) mscale *= fmaf(0.1f, logf(1.0f / freq_scale), 1.0f);
    for (int i = 0; i < half; i++) {
        const float interp = freq_scale * theta;
        float th = interp;
        if (ext_factor != 0.0f) {
            const float y = ((float)(2 * i) / 2 - low) / fmaxf(0.001f, high - low);
            const float ramp = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * ext_factor;
            th = fmaf(interp, 1 - ramp, theta * ramp);
        }
        float s, c;
        sincosf(th, &s, &c);
        cs[2 * i] = c * mscale;
        cs[2 * i + 1] = s * mscale;
        theta *= theta_scale;
    }
}

/* ggml's F32 attention steps without flash attention (KQ = mul_mat(K, Q), soft_max_ext with the
 * scale and the mask, KQV = mul_mat(V^T, KQ)) on an AVX-512 machine, for one kv head's G query
 * heads over n cells, cell j of the list at the place j of ggml's KV view:
 * - each score is ggml_vec_dot_f32(hd, k_j, q) (4 accumulators of 16 lanes over steps of 64,
 *   added 0+2, 1+3, together, reduced as _mm512_reduce_add_ps; the hd % 64 tail fused in order),
 *   times the scale in float;
 * - the softmax: the row's maximum, ggml's vector exp of (s - max) 16 cells at a time, each block's
 *   reduced sum added in double in order (the view's masked cells are exp 0), then every exp times
 *   (float)(1 / sum);
 * - out[d] = sum_j p_j v_j[d] as ggml_vec_dot_f32 over the cells (lanes = 64: 4 accumulators of 16
 *   cells, the one-row step's kernel) or as llamafile's tinyBLAS (lanes = 16: one accumulator of 16
 *   cells, the kernel of a step of several rows), each lane a chain of fused multiply-adds in cell
 *   order, reduced as above. Cells past n (the view's padding) add nothing.
 * q: G rows of hk (the K rows' width, the dot's length); out: G rows of hd (the V rows' width: V
 * may be the first hd values of each K row, as latent attention reads it). scores: G * L floats (L >=
 * n rounded up to 64); acc: 64 * hd floats. hk and hd multiples of 16. */
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define PV_GGML_ATTEND 1
/* the same tree over 16 vectors (vector l = lane l), 16 results at once */
static inline __attribute__((always_inline)) __m512 pv_reduce16_vecs(const __m512 *a) {
    __m512 h[8], q[4], r0, r1;
    for (int i = 0; i < 8; i++) { h[i] = _mm512_add_ps(a[i], a[i + 8]); PIN_VEC(h[i]); }
    for (int i = 0; i < 4; i++) { q[i] = _mm512_add_ps(h[i], h[i + 4]); PIN_VEC(q[i]); }
    r0 = _mm512_add_ps(q[0], q[2]); PIN_VEC(r0);
    r1 = _mm512_add_ps(q[1], q[3]); PIN_VEC(r1);
    return _mm512_add_ps(r0, r1);
}
/* the same tree over 16 rows of 16 lanes each (row l = lane l), 16 results at once */
static inline __attribute__((always_inline)) __m512 pv_reduce16_rows(const float *a, long long stride) {
    __m512 h[8], q[4], r0, r1;
    for (int i = 0; i < 8; i++) { h[i] = _mm512_add_ps(_mm512_loadu_ps(a + i * stride), _mm512_loadu_ps(a + (i + 8) * stride)); PIN_VEC(h[i]); }
    for (int i = 0; i < 4; i++) { q[i] = _mm512_add_ps(h[i], h[i + 4]); PIN_VEC(q[i]); }
    r0 = _mm512_add_ps(q[0], q[2]); PIN_VEC(r0);
    r1 = _mm512_add_ps(q[1], q[3]); PIN_VEC(r1);
    return _mm512_add_ps(r0, r1);
}
static inline __attribute__((always_inline)) float pv_ggml_dot_f32(const float *x, const float *y, int n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    const int np = n & ~63;
    for (int i = 0; i < np; i += 64) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(y + i + 16), s1);
        s2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 32), _mm512_loadu_ps(y + i + 32), s2);
        s3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 48), _mm512_loadu_ps(y + i + 48), s3);
    }
    s0 = _mm512_add_ps(s0, s2);
    s1 = _mm512_add_ps(s1, s3);
    PIN_VEC(s0);
    PIN_VEC(s1);
    float sum = pinned_reduce16(_mm512_add_ps(s0, s1));
    for (int i = np; i < n; i++) {  /* ggml's `sumf += x[i]*y[i]`: the product rounded, then added */
        float prod = x[i] * y[i];
        PIN_SCALAR(prod);
        sum += prod;
    }
    return sum;
}
/* p[j] = exp(s[j] - max) / sum as ggml_vec_soft_max_f32 and the scaling after it, in place over
 * n <= L cells; p[n, round_up(n, 16)) become 0. */
__attribute__((noinline, optimize("no-associative-math", "fp-contract=off")))
static void pv_ggml_softmax(float *s, long long n) {
    float m = -INFINITY;
    for (long long j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
    const __m512 mv = _mm512_set1_ps(m);
    double sum = 0.0;
    for (long long j = 0; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, s + j);
        const __m512 e = _mm512_maskz_mov_ps(live, pv_ggml_exp16(_mm512_sub_ps(x, mv)));
        _mm512_storeu_ps(s + j, e);
        sum += (double)pinned_reduce16(e);
    }
    const __m512 inv = _mm512_set1_ps((float)(1.0 / sum));
    for (long long j = 0; j < n; j += 16) _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
}
__attribute__((noinline, optimize("no-associative-math", "fp-contract=off")))
static void pv_ggml_attend_kv(const float *q, int G, int hk, int hd, const unsigned char *kc, long long k_row,
                              long long k_off, const unsigned char *vc, long long v_row, long long v_off,
                              const int *cells, long long n, float scale, int lanes, float *scores, long long L,
                              float *acc, float *out) {
    /* K rows a few cells ahead, each V row as its K row is read (a token's cells are rows apart
     * in the cache, too short a run for the hardware prefetcher) */
    for (long long j = 0; j < n && j < PV_PREFETCH_CELLS; j++)
        pv_prefetch_slice(kc + (long long)cells[j] * k_row + k_off, 4 * hk);
    for (long long j = 0; j < n; j++) {
        const float *k = (const float *)(kc + (long long)cells[j] * k_row + k_off);
        if (j + PV_PREFETCH_CELLS < n)
            pv_prefetch_slice(kc + (long long)cells[j + PV_PREFETCH_CELLS] * k_row + k_off, 4 * hk);
        pv_prefetch_slice(vc + (long long)cells[j] * v_row + v_off, 4 * hd);
        for (int g = 0; g < G; g++) scores[g * L + j] = pv_ggml_dot_f32(k, q + (long long)g * hk, hk) * scale;
    }
    for (int g = 0; g < G; g++) {
        float *p = scores + g * L;
        pv_ggml_softmax(p, n);
        if (lanes == 16) {
            /* 16 columns at a time, the 16 lanes' chains in registers; p is 0 past n up to a
             * multiple of 16, and those cells' rows are not read */
            for (int d = 0; d < hd; d += 16) {
                __m512 acc16[16];
                for (int l = 0; l < 16; l++) acc16[l] = _mm512_setzero_ps();
                long long j = 0;
                for (; j + 16 <= n; j += 16)
                    for (int l = 0; l < 16; l++)
                        acc16[l] = _mm512_fmadd_ps(
                            _mm512_loadu_ps((const float *)(vc + (long long)cells[j + l] * v_row + v_off) + d),
                            _mm512_set1_ps(p[j + l]), acc16[l]);
                for (int l = 0; j + l < n; l++)
                    acc16[l] = _mm512_fmadd_ps(
                        _mm512_loadu_ps((const float *)(vc + (long long)cells[j + l] * v_row + v_off) + d),
                        _mm512_set1_ps(p[j + l]), acc16[l]);
                _mm512_storeu_ps(out + (long long)g * hd + d, pv_reduce16_vecs(acc16));
            }
            continue;
        }
        for (long long i = 0; i < (long long)lanes * hd; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
        for (long long j = 0; j < n; j++) {
            const float *v = (const float *)(vc + (long long)cells[j] * v_row + v_off);
            float *a = acc + (j % lanes) * hd;
            const __m512 pj = _mm512_set1_ps(p[j]);
            for (int d = 0; d < hd; d += 16)
                _mm512_storeu_ps(a + d, _mm512_fmadd_ps(_mm512_loadu_ps(v + d), pj, _mm512_loadu_ps(a + d)));
        }
        if (lanes == 64)  /* ggml_vec_dot_f32's accumulators: (0 + 2) + (1 + 3), lane by lane */
            for (int l = 0; l < 16; l++)
                for (int d = 0; d < hd; d += 16) {
                    __m512 x0 = _mm512_add_ps(_mm512_loadu_ps(acc + l * hd + d), _mm512_loadu_ps(acc + (l + 32) * hd + d));
                    __m512 x1 = _mm512_add_ps(_mm512_loadu_ps(acc + (l + 16) * hd + d),
                                              _mm512_loadu_ps(acc + (l + 48) * hd + d));
                    PIN_VEC(x0);
                    PIN_VEC(x1);
                    _mm512_storeu_ps(acc + l * hd + d, _mm512_add_ps(x0, x1));
                }
        for (int d = 0; d < hd; d += 16) _mm512_storeu_ps(out + (long long)g * hd + d, pv_reduce16_rows(acc + d, hd));
    }
}
/* ggml's steps for the common case: K and V rows of one width */
static inline void pv_ggml_attend(const float *q, int G, int hd, const unsigned char *kc, long long k_row,
                                  long long k_off, const unsigned char *vc, long long v_row, long long v_off,
                                  const int *cells, long long n, float scale, int lanes, float *scores, long long L,
                                  float *acc, float *out) {
    pv_ggml_attend_kv(q, G, hd, hd, kc, k_row, k_off, vc, v_row, v_off, cells, n, scale, lanes, scores, L, acc, out);
}
static inline int pv_ggml_attend_ok(int hd, int kt, int vt) { return hd % 16 == 0 && kt == 0 && vt == 0; }
#else
#define PV_GGML_ATTEND 0
static inline int pv_ggml_attend_ok(int hd, int kt, int vt) { (void)hd; (void)kt; (void)vt; return 0; }
static inline void pv_ggml_attend(const float *q, int G, int hd, const unsigned char *kc, long long k_row,
                                  long long k_off, const unsigned char *vc, long long v_row, long long v_off,
                                  const int *cells, long long n, float scale, int lanes, float *scores, long long L,
                                  float *acc, float *out) {
    (void)q; (void)G; (void)hd; (void)kc; (void)k_row; (void)k_off; (void)vc; (void)v_row; (void)v_off;
    (void)cells; (void)n; (void)scale; (void)lanes; (void)scores; (void)L; (void)acc; (void)out;
}
static inline void pv_ggml_attend_kv(const float *q, int G, int hk, int hd, const unsigned char *kc, long long k_row,
                                     long long k_off, const unsigned char *vc, long long v_row, long long v_off,
                                     const int *cells, long long n, float scale, int lanes, float *scores, long long L,
                                     float *acc, float *out) {
    (void)hk;
    pv_ggml_attend(q, G, hd, kc, k_row, k_off, vc, v_row, v_off, cells, n, scale, lanes, scores, L, acc, out);
}
#endif

#endif /* PYLLAMA_VEC_MATH_H */
