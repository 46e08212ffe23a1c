/* Element conversions of the KV cache types (F32, F16, BF16, Q8_0), as ggml defines them.
 *
 * Writes round from float exactly as ggml's reference conversions do; reads are exact (every
 * stored value is a float). All rounding is done on integer bit patterns, so the results do not
 * depend on the compiler's float flags (the extensions build with -fassociative-math) or on the
 * instruction set: a portable build stores the same bytes as a -march=native one.
 */
#ifndef PYLLAMA_KV_TYPES_H
#define PYLLAMA_KV_TYPES_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* ggml's type ids (gguf GGMLQuantizationType) */
#define KV_F32 0
#define KV_F16 1
#define KV_Q8_0 8
#define KV_BF16 30
#define KV_QK8_0 32
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

/* Bytes of a cache row of n elements (n a whole number of blocks for Q8_0); 0 for another type. */
static inline int64_t kv_row_bytes(int type, int64_t n) {
    switch (type) {
        case KV_F32: return 4 * n;
        case KV_F16: case KV_BF16: return 2 * n;
        case KV_Q8_0: return n % KV_QK8_0 ? 0 : n / KV_QK8_0 * KV_Q8_0_BYTES;
        default: return 0;
    }
}

/* x[i0, i1) as F16 values at row + 2 * i0, one at a time */
static inline void kv_store_f16_scalar(const float* x, unsigned char* row, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
        const uint16_t h = kv_f32_to_f16(x[i]);
        memcpy(row + 2 * i, &h, 2);
    }
}

/* Stores the n floats of x as one cache row (Q8_0: ggml's quantize_row_q8_0_ref, roundf). */
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
        for (i = 0; i < n / KV_QK8_0; i++) {
            const float* xb = x + i * KV_QK8_0;
            unsigned char* yb = row + i * KV_Q8_0_BYTES;
            float amax = 0.0f;
            for (j = 0; j < KV_QK8_0; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            const uint16_t dh = kv_f32_to_f16(d);
            memcpy(yb, &dh, 2);
            for (j = 0; j < KV_QK8_0; j++) yb[2 + j] = (unsigned char)(int8_t)roundf(xb[j] * id);
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
    }
}

#endif
