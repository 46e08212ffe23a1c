/* A float reduction in a fixed order. The kernels are built with -fassociative-math, which lets the
 * compiler regroup vector additions differently in each inlined copy; the results that must equal
 * ggml's bits (products, attention) pin each step with an empty asm so the order stays as written. */
#ifndef PYLLAMA_PINNED_SUM_H
#define PYLLAMA_PINNED_SUM_H

#define PIN_VEC(v) __asm__("" : "+v"(v))
/* a scalar float pinned likewise: a product so pinned is rounded before it is added (no FMA) */
#define PIN_SCALAR(f) __asm__("" : "+x"(f))

#if defined(__AVX512F__)
#include <immintrin.h>

/* _mm512_reduce_add_ps's tree, pinned: (256-bit halves) -> (128-bit halves) -> (0+2, 1+3) -> sum */
static inline __attribute__((always_inline)) float pinned_reduce16(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    PIN_VEC(h);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    PIN_VEC(q);
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    PIN_VEC(q);
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#endif

#endif /* PYLLAMA_PINNED_SUM_H */
