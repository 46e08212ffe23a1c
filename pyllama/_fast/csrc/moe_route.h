/* The float steps of llama.cpp's build_moe_ffn around the expert products, as ggml's CPU ops take
 * them, so that a token's routing weights and its mixture are ggml's bits (the module is built with
 * -fassociative-math and FMA contraction: both are off here). On a model with quantized experts a
 * last-bit difference in the mixture can change how the next layer's activations round to their
 * 8-bit blocks, and from there every later value. */
#ifndef PYLLAMA_MOE_ROUTE_H
#define PYLLAMA_MOE_ROUTE_H

#include <math.h>
#include <stdint.h>
#include "vec_math.h"

#define PV_MOE_SOFTMAX 1
#define PV_MOE_SIGMOID 2

/* The router's probabilities: ggml_sigmoid (1 / (1 + expf(-x)) in float), or ggml_soft_max with
 * scale 1 and no mask: the row's maximum, then exp(x - max) in blocks of 16 by ggml's vector exp
 * (each block's reduced sum added in double), the rest by expf one by one (added in double), and
 * every value times (float)(1 / sum). */
__attribute__((noinline, optimize("no-associative-math", "fp-contract=off")))
static void pv_moe_probs(int gating, const float *x, float *p, int64_t n) {
    if (gating == PV_MOE_SIGMOID) {
        for (int64_t i = 0; i < n; i++) p[i] = 1.f / (1.f + expf(-x[i]));
        return;
    }
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    double sum = 0.0;
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    for (; i + 15 < n; i += 16) {
        const __m512 e = pv_ggml_exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(mx)));
        _mm512_storeu_ps(p + i, e);
        sum += (double)pinned_reduce16(e);
    }
#endif
    for (; i < n; i++) {
        const float e = expf(x[i] - mx);
        sum += (double)e;
        p[i] = e;
    }
    const float inv = (float)(1.0 / sum);
    for (int64_t j = 0; j < n; j++) p[j] *= inv;
}

/* The chosen weights divided by their sum (ggml_sum_rows: added in double, rounded to float;
 * clamped below at norm_min; ggml_div), then times scale (ggml_scale) where it is not 0 or 1. */
__attribute__((noinline, optimize("no-associative-math", "fp-contract=off")))
static void pv_moe_weights(float *w, int k, int norm, float norm_min, float scale) {
    if (norm) {
        double s = 0.0;
        for (int j = 0; j < k; j++) s += (double)w[j];
        float sf = (float)s;
        if (sf < norm_min) sf = norm_min;
        for (int j = 0; j < k; j++) w[j] = w[j] / sf;
    }
    if (scale != 0.0f && scale != 1.0f)
        for (int j = 0; j < k; j++) w[j] = w[j] * scale;
}

/* out[c] = sum over j of rows[j][c] * w[j]: each product rounded (ggml_mul), then added in the
 * experts' order (one ggml_add per expert after the first). */
__attribute__((noinline, optimize("no-associative-math", "fp-contract=off")))
static void pv_moe_mix(float *out, const float *const *rows, const float *w, int k, int64_t e) {
    for (int64_t c = 0; c < e; c++) out[c] = rows[0][c] * w[0];
    for (int j = 1; j < k; j++) {
        const float *r = rows[j];
        const float wj = w[j];
        for (int64_t c = 0; c < e; c++) {
            const float prod = r[c] * wj;
            out[c] = out[c] + prod;
        }
    }
}

#endif /* PYLLAMA_MOE_ROUTE_H */
