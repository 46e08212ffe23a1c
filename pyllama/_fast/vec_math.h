/* Vectorized float math for the element-wise kernels of ops.pyx.
 *
 * pv_dot: sum of a[i] * b[i] in 16 lanes (two 8-lane FMA chains, added lane-wise, then reduced in
 * a fixed order), so the same inputs always give the same sum; the n % 8 tail is added last.
 * pv_exp_shift_sum: x[i] = exp(x[i] - m) in place, returns their sum (lane-wise, then reduced).
 *
 * pv_silu_mul: out = silu(g) * u = g / (1 + exp(-g)) * u, 8 lanes at a time with AVX2. exp is the
 * usual range reduction (x = n ln2 + r, |r| <= ln2 / 2, ln2 split in two parts so r is exact to
 * float precision) and a degree-6 polynomial for e^r, then 2^n put into the exponent bits: within
 * 2 ulp of expf over the clamped range [-87.3, 88], where the clamping only changes results
 * that round to 0 or g anyway. The tail (n % 8 elements) and builds without AVX2 use expf.
 */
#ifndef PYLLAMA_VEC_MATH_H
#define PYLLAMA_VEC_MATH_H

#include <math.h>
#include <stdint.h>

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

static inline void pv_silu_mul(const float *g, const float *u, float *out, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = pv_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

#endif /* PYLLAMA_VEC_MATH_H */
