/* Element conversions of the KV cache types (F32, F16, BF16, and the 32-element blocks Q8_0,
 * Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL), as ggml defines them.
 *
 * Writes round from float exactly as ggml's CPU backend does when it copies f32 rows into a cache
 * of the type (its from_float: on x86 its own quantize_row_q8_0, and the reference quantizers
 * quantize_row_*_ref for the other block types); reads are exact for
 * the float types and Q8_0, and are ggml's dequantization for the others. The float types round on
 * integer bit patterns and the block quantizers are compiled without reassociation or contraction
 * (PQ_EXACT), so the results do not depend on the compiler's float flags (the extensions build
 * with -fassociative-math) or on the instruction set: a portable build stores the same bytes as a
 * -march=native one.
 */
#ifndef PYLLAMA_KV_TYPES_H
#define PYLLAMA_KV_TYPES_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <float.h>

#include "ggml_quants.h"  /* pq_dequant_block: the block types' values */

/* ggml's type ids (gguf GGMLQuantizationType) */
#define KV_F32 0
#define KV_F16 1
#define KV_Q4_0 2
#define KV_Q4_1 3
#define KV_Q5_0 6
#define KV_Q5_1 7
#define KV_Q8_0 8
#define KV_IQ4_NL 20
#define KV_BF16 30
#define KV_QK8_0 32  /* every block type here holds 32 values */
#define KV_Q8_0_BYTES 34 /* f16 scale + 32 int8 */

static inline uint32_t kv_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float kv_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float -> IEEE half, round to nearest even; overflow gives inf, NaN the quiet NaN 0x7E00 with
 * the sign kept (what ggml's portable conversion gives). */
static inline uint16_t kv_f32_to_f16(float f) {
    const uint32_t x = kv_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520: rounds to inf */
    if (ax < 0x38800000u) {                                    /* below 2^-14: a subnormal half or 0 */
        const uint32_t e = ax >> 23;
        if (e < 102) return (uint16_t)sign;                    /* below 2^-25: rounds to 0 */
        const uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;       /* value = m * 2^(e-150) */
        const uint32_t shift = 126 - e;                        /* to units of 2^-24: 14..24 */
        const uint32_t r = (m + ((1u << (shift - 1)) - 1u) + ((m >> shift) & 1u)) >> shift;
        return (uint16_t)(sign | r);
    }
    const uint32_t r = ax - 0x38000000u; /* exponent rebiased from 127 to 15 */
    return (uint16_t)(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
}

/* IEEE half -> float, exact (the F16C instruction is exact too) */
static inline float kv_f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return kv_float(sign | 0x7F800000u | (m << 13));
    if (e != 0) return kv_float(sign | ((e + 112u) << 23) | (m << 13));
    if (m == 0) return kv_float(sign);
    /* subnormal: m * 2^-24, exact in float */
    uint32_t k = 0, mm = m;
    while (!(mm & 0x400u)) { mm <<= 1; k++; }
    return kv_float(sign | ((113u - k) << 23) | ((mm & 0x3FFu) << 13));
#endif
}

/* float -> bfloat16 as ggml: round to nearest even, NaN forced quiet, subnormals kept */
static inline uint16_t kv_f32_to_bf16(float f) {
    const uint32_t u = kv_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 64u);
    return (uint16_t)((u + (0x7FFFu + ((u >> 16) & 1u))) >> 16);
}

static inline float kv_bf16_to_f32(uint16_t h) { return kv_float((uint32_t)h << 16); }

/* Bytes of one 32-value block of a block type; 0 for another type. */
static inline int64_t kv_block_bytes(int type) {
    switch (type) {
        case KV_Q4_0: case KV_IQ4_NL: return 18;  /* f16 d + 16 bytes of nibbles */
        case KV_Q4_1: return 20;                  /* + f16 m */
        case KV_Q5_0: return 22;                  /* + 32 high bits */
        case KV_Q5_1: return 24;                  /* + f16 m + 32 high bits */
        case KV_Q8_0: return KV_Q8_0_BYTES;
        default: return 0;
    }
}

/* Bytes of a cache row of n elements (n a whole number of blocks for the block types); 0 for
 * another type. */
static inline int64_t kv_row_bytes(int type, int64_t n) {
    switch (type) {
        case KV_F32: return 4 * n;
        case KV_F16: case KV_BF16: return 2 * n;
        default: return kv_block_bytes(type) && n % KV_QK8_0 == 0 ? n / KV_QK8_0 * kv_block_bytes(type) : 0;
    }
}

/* quantize_row_q4_0_ref / q5_0: d = the value of largest magnitude over -8 (-16), nibbles of
 * x / d + 8.5 (16.5) truncated, clamped to 15 (31); Q5_0's fifth bits in a 32-bit word. */
PQ_EXACT static void kv_quantize_q4_q5_0(int five, const float *x, unsigned char *y) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 32; j++)
        if (amax < fabsf(x[j])) { amax = fabsf(x[j]); max = x[j]; }
    const float d = max / (five ? -16.0f : -8.0f), id = d ? 1.0f / d : 0.0f;
    const uint16_t dh = kv_f32_to_f16(d);
    memcpy(y, &dh, 2);
    unsigned char *qs = y + (five ? 6 : 2);
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        const float x0 = x[j] * id, x1 = x[j + 16] * id;
        const int top = five ? 31 : 15;
        int a = (int8_t)(x0 + (five ? 16.5f : 8.5f)), b = (int8_t)(x1 + (five ? 16.5f : 8.5f));
        a = (uint8_t)(a < top ? a : top);  /* ggml's MIN(top, (int8_t)v) into a uint8_t */
        b = (uint8_t)(b < top ? b : top);
        qs[j] = (unsigned char)((a & 0xF) | ((b & 0xF) << 4));
        qh |= (uint32_t)((a & 0x10) >> 4) << j;
        qh |= (uint32_t)((b & 0x10) >> 4) << (j + 16);
    }
    if (five) memcpy(y + 2, &qh, 4);
}

/* quantize_row_q4_1_ref / q5_1: d = (max - min) / 15 (31), m = min, levels (x - min) / d + 0.5
 * truncated (Q4_1 clamped to 15). */
PQ_EXACT static void kv_quantize_q4_q5_1(int five, const float *x, unsigned char *y) {
    float min = FLT_MAX, max = -FLT_MAX;
    for (int j = 0; j < 32; j++) {
        if (x[j] < min) min = x[j];
        if (x[j] > max) max = x[j];
    }
    const float d = (max - min) / (five ? 31.0f : 15.0f), id = d ? 1.0f / d : 0.0f;
    const uint16_t dh = kv_f32_to_f16(d), mh = kv_f32_to_f16(min);
    memcpy(y, &dh, 2);
    memcpy(y + 2, &mh, 2);
    unsigned char *qs = y + (five ? 8 : 4);
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        const float x0 = (x[j] - min) * id, x1 = (x[j + 16] - min) * id;
        uint8_t a, b;
        if (five) {
            a = (uint8_t)(x0 + 0.5f);
            b = (uint8_t)(x1 + 0.5f);
        } else {
            const int ia = (int8_t)(x0 + 0.5f), ib = (int8_t)(x1 + 0.5f);
            a = (uint8_t)(ia < 15 ? ia : 15);
            b = (uint8_t)(ib < 15 ? ib : 15);
        }
        qs[j] = (unsigned char)((a & 0xF) | ((b & 0xF) << 4));
        qh |= (uint32_t)((a & 0x10u) >> 4) << j;
        qh |= (uint32_t)((b & 0x10u) >> 4) << (j + 16);
    }
    if (five) memcpy(y + 4, &qh, 4);
}

/* ggml's best_index_int8: the nearest of the 16 sorted IQ4_NL values (ties: the upper one) */
static inline int kv_iq4nl_index(float x) {
    const int8_t *val = pq_kvalues_iq4nl;
    if (x <= val[0]) return 0;
    if (x >= val[15]) return 15;
    int ml = 0, mu = 15;
    while (mu - ml > 1) {
        const int mav = (ml + mu) / 2;
        if (x < val[mav]) mu = mav; else ml = mav;
    }
    return x - val[mu - 1] < val[mu] - x ? mu - 1 : mu;
}

/* quantize_row_iq4_nl_ref (what ggml's CPU backend writes into an IQ4_NL cache): levels on the
 * scale max / -127, then the x^2-weighted least-squares scale for those levels, stored as is (no
 * search over further scales, unlike the weight quantizer). A block below 1e-15 stores scale 0. */
PQ_EXACT static void kv_quantize_iq4_nl(const float *x, unsigned char *y) {
    float amax = 0.0f, max = 0.0f, sumqx = 0.0f, sumq2 = 0.0f;
    unsigned char L[32];
    for (int j = 0; j < 32; j++)
        if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); max = x[j]; }
    memset(L, 0, sizeof L);
    float d = 0.0f;
    if (amax >= 1e-15f) {
        const float id = 1.0f / (max / (float)pq_kvalues_iq4nl[0]);
        for (int j = 0; j < 32; j++) {
            L[j] = (unsigned char)kv_iq4nl_index(id * x[j]);
            const float q = (float)pq_kvalues_iq4nl[L[j]], w = x[j] * x[j];
            sumqx += w * q * x[j];
            sumq2 += w * q * q;
        }
        d = sumq2 > 0 ? sumqx / sumq2 : 0.0f;
    }
    const uint16_t dh = kv_f32_to_f16(d);
    memcpy(y, &dh, 2);
    for (int j = 0; j < 16; j++) y[2 + j] = (unsigned char)(L[j] | (L[j + 16] << 4));
}

/* x[i0, i1) as F16 values at row + 2 * i0, one at a time */
static inline void kv_store_f16_scalar(const float* x, unsigned char* row, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
        const uint16_t h = kv_f32_to_f16(x[i]);
        memcpy(row + 2 * i, &h, 2);
    }
}

/* Stores the n floats of x as one cache row (Q8_0: ggml's x86 quantize_row_q8_0, the activation
 * quantizer of ggml_quants.h; the other block types: their kv_quantize_* above). */
static inline void kv_store_row(int type, const float* x, unsigned char* row, int64_t n) {
    int64_t i, j;
    if (type == KV_F32) {
        memcpy(row, x, 4 * n);
    } else if (type == KV_F16) {
        i = 0;
#if defined(__F16C__) && defined(__AVX2__)
        /* the instruction rounds to nearest even like kv_f32_to_f16 (round-to-nearest immediate,
         * not MXCSR); only a NaN converts differently, so 8 values holding one take the scalar path */
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)))
                kv_store_f16_scalar(x, row, i, i + 8);
            else
                _mm_storeu_si128((__m128i *)(row + 2 * i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
#endif
        kv_store_f16_scalar(x, row, i, n);
    } else if (type == KV_BF16) {
        for (i = 0; i < n; i++) {
            const uint16_t h = kv_f32_to_bf16(x[i]);
            memcpy(row + 2 * i, &h, 2);
        }
    } else if (type == KV_Q8_0) {
        pq_quantize_row_q8_0(x, row, n);
    } else if (kv_block_bytes(type)) {
        const int64_t bb = kv_block_bytes(type);
        for (i = 0; i < n / KV_QK8_0; i++) {
            const float* xb = x + i * KV_QK8_0;
            unsigned char* yb = row + i * bb;
            if (type == KV_Q4_0 || type == KV_Q5_0) kv_quantize_q4_q5_0(type == KV_Q5_0, xb, yb);
            else if (type == KV_Q4_1 || type == KV_Q5_1) kv_quantize_q4_q5_1(type == KV_Q5_1, xb, yb);
            else kv_quantize_iq4_nl(xb, yb);
        }
    }
}

/* Elements [start, start + n) of a cache row as floats. */
static inline void kv_load(int type, const unsigned char* row, int64_t start, int64_t n, float* out) {
    int64_t i = 0;
    if (type == KV_F32) {
        memcpy(out, row + 4 * start, 4 * n);
    } else if (type == KV_F16) {
        const unsigned char* src = row + 2 * start;
#if defined(__F16C__)
        for (; i + 8 <= n; i += 8)  /* the hardware conversion is exact too */
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + 2 * i))));
#endif
        for (; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            out[i] = kv_f16_to_f32(h);
        }
    } else if (type == KV_BF16) {
        const unsigned char* src = row + 2 * start;
#if defined(__AVX2__)
        for (; i + 8 <= n; i += 8) {
            const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(src + 2 * i)));
            _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
        }
#endif
        for (; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            out[i] = kv_bf16_to_f32(h);
        }
    } else if (type == KV_Q8_0) {
        while (i < n) {  /* the span may start and end inside a block (a head narrower than 32) */
            const int64_t e = start + i, j0 = e % KV_QK8_0;
            const unsigned char* blk = row + e / KV_QK8_0 * KV_Q8_0_BYTES;
            const int8_t* qs = (const int8_t*)(blk + 2);
            uint16_t dh;
            memcpy(&dh, blk, 2);
            const float d = kv_f16_to_f32(dh);
            const int64_t cnt = KV_QK8_0 - j0 < n - i ? KV_QK8_0 - j0 : n - i;
            float* o = out + i;
            for (int64_t j = 0; j < cnt; j++) o[j] = d * (float)qs[j0 + j];  /* exact: 11 x 8 bits */
            i += cnt;
        }
    } else if (kv_block_bytes(type)) {
        const int64_t bb = kv_block_bytes(type);
        float blk[KV_QK8_0];
        while (i < n) {
            const int64_t e = start + i, j0 = e % KV_QK8_0;
            pq_dequant_block(type, row + e / KV_QK8_0 * bb, blk);
            const int64_t cnt = KV_QK8_0 - j0 < n - i ? KV_QK8_0 - j0 : n - i;
            memcpy(out + i, blk + j0, (size_t)cnt * sizeof(float));
            i += cnt;
        }
    }
}

#endif
