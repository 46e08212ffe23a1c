/* ggml's quantized matrix-vector arithmetic for the CPU backend: weights stay in their GGUF block
 * layout, activation rows are quantized to the weight type's "vec_dot_type" exactly as ggml's
 * reference quantize_row_*_ref does, and each weight block is dotted with the matching activation
 * block in integers before the block scales are applied in float, as ggml's vec_dot_* do.
 *
 * Two paths compute every product:
 *   - portable: plain C, one activation row at a time, following ggml's scalar (generic) code for
 *     the integer sums and the order in which the scales are applied (pq_isums_* + pq_dot1_*);
 *   - AVX2 (+FMA, F16C; compiled when the build targets them): maddubs/madd integer dot products
 *     (VNNI's dpbusd for the byte products where the build targets AVX-VNNI or AVX-512 VNNI: the
 *     same exact integer sums in one instruction), several activation rows per weight block while the unpacked block sits in registers, float
 *     accumulation in vector lanes (as ggml's AVX2 code does).
 * Both paths compute the same integer sums per block from the same quantized activations (the
 * quantizers below are shared, so the activations agree bit for bit). The final float results
 * differ only by the order of float additions and by where the block scale is multiplied in:
 *     |result - exact| <= (k + 16) * 2^-24 * S
 * where k is the row length and S = sum over elements of |w_scale * q_w| * |x_scale * q_x| (plus
 * the same with the block minimum for the types that have one): every path adds at most k
 * rounded terms, each carrying at most 3 roundings from its scale products. Two paths therefore
 * agree within twice that bound. tests/test_qmatmul.py checks both against a float64 reference.
 * (For the bound to hold, every float term must be a sum of element-level terms of one sign
 * structure: the AVX2 Q6_K kernel therefore reduces its integer sum, whose offset correction
 * lives in other lanes, before converting it to float.)
 *
 * Byte layouts are ggml's (gguf.quants mirrors them). AVX-512VL builds take 8 activation rows per
 * weight block (32 vector registers) instead of 4; ggml_x8.h has the Q4_K / Q6_K kernels for
 * weights repacked in groups of 8 rows.
 */
#ifndef PYLLAMA_GGML_QUANTS_H
#define PYLLAMA_GGML_QUANTS_H

#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <pthread.h>
#include <time.h>
#include <unistd.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <linux/futex.h>

#include "pinned_sum.h"
#include "ggml_iq_grids.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PQ_HAVE_AVX2 1
static inline int32_t pq_hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}
#else
#define PQ_HAVE_AVX2 0
#endif

/* ggml type ids (gguf.GGMLQuantizationType values) */
enum {
    PQ_F32 = 0, PQ_F16 = 1, PQ_Q4_0 = 2, PQ_Q4_1 = 3, PQ_Q5_0 = 6, PQ_Q5_1 = 7, PQ_Q8_0 = 8,
    PQ_Q8_1 = 9, PQ_Q2_K = 10, PQ_Q3_K = 11, PQ_Q4_K = 12, PQ_Q5_K = 13, PQ_Q6_K = 14,
    PQ_Q8_K = 15, PQ_IQ2_XXS = 16, PQ_IQ2_XS = 17, PQ_IQ3_XXS = 18, PQ_IQ1_S = 19, PQ_IQ4_NL = 20,
    PQ_IQ3_S = 21, PQ_IQ2_S = 22, PQ_IQ4_XS = 23, PQ_IQ1_M = 29, PQ_BF16 = 30, PQ_TQ1_0 = 34, PQ_TQ2_0 = 35,
    PQ_MXFP4 = 39
};
/* The grid IQ types: super-blocks of 256 whose groups of 8 (or 4) elements are points of a lattice
 * grid (ggml_iq_grids.h), dotted against Q8_K activations */
static inline int pq_is_iq_grid(int t) {
    return t == PQ_IQ2_XXS || t == PQ_IQ2_XS || t == PQ_IQ2_S || t == PQ_IQ3_XXS || t == PQ_IQ3_S || t == PQ_IQ1_S ||
           t == PQ_IQ1_M;
}
/* The 4-bit lookup types' values: IQ4_NL / IQ4_XS's non-linear grid and MXFP4's E2M1 values
 * doubled (ggml's kvalues_iq4nl, kvalues_mxfp4). */
static const int8_t pq_kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t pq_kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#define PQ_QK_K 256
/* Entry points: a module that includes this header uses only some of them. */
#define PQ_API static __attribute__((unused))
/* Most activation rows one weight row is dotted with while its unpacked block is in registers:
 * with AVX-512VL's 32 vector registers the accumulators of 8 rows fit, with AVX2's 16 those of 4. */
#if defined(__AVX512VL__)
#define PQ_MAX_NR 8
#else
#define PQ_MAX_NR 4
#endif
/* Activation rows per chunk of the batch loop (see pq_mul_mat). */
#define PQ_ROW_CHUNK 64

typedef struct {
    int block;     /* elements per block */
    int bytes;     /* bytes per block */
    int vec_type;  /* the activation type of the dot product (weights only) */
    int ints;      /* integer sums per block reported by pq_isums (0: a float type) */
} pq_traits;

/* 1 and the traits of `t` when known, else 0. Q8_1/Q8_K are activation types only. */
static inline int pq_get_traits(int t, pq_traits *tr) {
    switch (t) {
    case PQ_F32:  *tr = (pq_traits){1, 4, PQ_F32, 0}; return 1;
    case PQ_F16:  *tr = (pq_traits){1, 2, PQ_F16, 0}; return 1;
    case PQ_BF16: *tr = (pq_traits){1, 2, PQ_BF16, 0}; return 1;
    case PQ_Q4_0: *tr = (pq_traits){32, 18, PQ_Q8_0, 1}; return 1;
    case PQ_Q4_1: *tr = (pq_traits){32, 20, PQ_Q8_1, 1}; return 1;
    case PQ_Q5_0: *tr = (pq_traits){32, 22, PQ_Q8_0, 1}; return 1;
    case PQ_Q5_1: *tr = (pq_traits){32, 24, PQ_Q8_1, 1}; return 1;
    case PQ_Q8_0: *tr = (pq_traits){32, 34, PQ_Q8_0, 1}; return 1;
    case PQ_Q8_1: *tr = (pq_traits){32, 36, -1, 0}; return 1;
    case PQ_Q2_K: *tr = (pq_traits){PQ_QK_K, 84, PQ_Q8_K, 18}; return 1;
    case PQ_Q3_K: *tr = (pq_traits){PQ_QK_K, 110, PQ_Q8_K, 17}; return 1;
    case PQ_Q4_K: *tr = (pq_traits){PQ_QK_K, 144, PQ_Q8_K, 10}; return 1;
    case PQ_Q5_K: *tr = (pq_traits){PQ_QK_K, 176, PQ_Q8_K, 10}; return 1;
    case PQ_Q6_K: *tr = (pq_traits){PQ_QK_K, 210, PQ_Q8_K, 17}; return 1;
    case PQ_Q8_K: *tr = (pq_traits){PQ_QK_K, 292, -1, 0}; return 1;
    case PQ_IQ4_NL: *tr = (pq_traits){32, 18, PQ_Q8_0, 1}; return 1;
    case PQ_IQ4_XS: *tr = (pq_traits){PQ_QK_K, 136, PQ_Q8_K, 9}; return 1;
    case PQ_MXFP4: *tr = (pq_traits){32, 17, PQ_Q8_0, 1}; return 1;
    case PQ_IQ2_XXS: *tr = (pq_traits){PQ_QK_K, 66, PQ_Q8_K, 17}; return 1;
    case PQ_IQ2_XS: *tr = (pq_traits){PQ_QK_K, 74, PQ_Q8_K, 17}; return 1;
    case PQ_IQ2_S: *tr = (pq_traits){PQ_QK_K, 82, PQ_Q8_K, 17}; return 1;
    case PQ_IQ3_XXS: *tr = (pq_traits){PQ_QK_K, 98, PQ_Q8_K, 17}; return 1;
    case PQ_IQ3_S: *tr = (pq_traits){PQ_QK_K, 110, PQ_Q8_K, 17}; return 1;
    case PQ_IQ1_S: *tr = (pq_traits){PQ_QK_K, 50, PQ_Q8_K, 18}; return 1;
    case PQ_IQ1_M: *tr = (pq_traits){PQ_QK_K, 56, PQ_Q8_K, 18}; return 1;
    case PQ_TQ1_0: *tr = (pq_traits){PQ_QK_K, 54, PQ_Q8_K, 8}; return 1;
    case PQ_TQ2_0: *tr = (pq_traits){PQ_QK_K, 66, PQ_Q8_K, 8}; return 1;
    default: return 0;
    }
}

static inline int pq_have_avx2(void) { return PQ_HAVE_AVX2; }

/* ---------------------------------------------------------------------------------------------
 * Scalar conversions. Integer-only, so the compiler's float reassociation cannot change them. */

static inline float pq_bits_f32(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t pq_f32_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

/* IEEE half -> float, exact for every input (branch-free). */
static inline float pq_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;
    uint32_t bits;
    if (em >= 0x7c00u) {                 /* inf / nan */
        bits = sign | 0x7f800000u | ((em & 0x3ffu) << 13);
    } else if (em >= 0x0400u) {          /* normal */
        bits = sign | ((em << 13) + 0x38000000u);
    } else {                             /* subnormal or zero: em * 2^-24, exact */
        return sign ? -((float)em * 5.9604644775390625e-8f) : (float)em * 5.9604644775390625e-8f;
    }
    return pq_bits_f32(bits);
}

/* float -> IEEE half, round to nearest even (what F16C, numpy and ggml's converters do). */
static inline uint16_t pq_f32_to_f16(float f) {
    const uint32_t x = pq_f32_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((ax >> 13) & 0x3ffu);  /* nan, quiet */
    if (ax >= 0x477ff000u) return sign | 0x7c00u;         /* >= 65520 rounds to inf */
    if (ax < 0x38800000u) {                                /* below 2^-14: subnormal half */
        if (ax < 0x33000000u) return sign;                 /* < 2^-25 rounds to 0 */
        const uint32_t e = ax >> 23;                       /* 102..112 */
        const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - e;                   /* 14..24 */
        uint32_t q = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return sign | (uint16_t)q;
    }
    const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);   /* round at bit 13, ties to even */
    return sign | (uint16_t)((r - 0x38000000u) >> 13);
}

/* float -> bfloat16 as ggml_compute_fp32_to_bf16: nan made quiet, else round to nearest even. */
static inline uint16_t pq_f32_to_bf16(float f) {
    const uint32_t u = pq_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64u);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}
static inline float pq_bf16_to_f32(uint16_t h) { return pq_bits_f32((uint32_t)h << 16); }

static inline float pq_ld_f16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return pq_f16_to_f32(h); }
static inline float pq_ld_f32(const uint8_t *p) { float f; memcpy(&f, p, 4); return f; }
static inline int16_t pq_ld_i16(const uint8_t *p) { int16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t pq_ld_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
/* MXFP4's E8M0 block exponent as 2^(e - 128), half the scale, since the values are doubled
 * (ggml_e8m0_to_fp32_half: e < 2 gives the subnormals 2^-128 and 2^-127) */
static inline float pq_e8m0_half(uint8_t e) {
    return pq_bits_f32(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}
/* IQ4_XS sub-block ib's 6-bit scale, less 32 */
static inline int pq_iq4xs_scale(const uint8_t *b, int ib) {
    const int lo = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
    const int hi = (b[2 + ib / 4] >> (2 * (ib % 4))) & 3;   /* scales_h, a little-endian uint16 */
    return (lo | (hi << 4)) - 32;
}

static inline uint16_t pq_ld_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* Grid IQ types. Sub-block ib (elements 32 ib .. 32 ib + 31) of block b, decoded as ggml's dequantizers
 * and vec_dots read it: v the signed integer values (grid point times sign: the IQ2 / IQ3 grids hold
 * magnitudes and a byte of sign bits per group of 8, the IQ1 grid signed -1 / 0 / 1), sc the odd
 * integer scales of its two halves of 16 (2 ls + 1), and for IQ1_S / IQ1_M dl the sign of each group
 * of 8's delta (+-1/8). An element's value is d * sc * v / 8 (IQ2), / 4 (IQ3_XXS), d * sc * v (IQ3_S),
 * d * sc * (v + dl / 8) (IQ1). */
static inline void pq_iq_sign8(int8_t *v, uint64_t grid, unsigned signs) {
    for (int j = 0; j < 8; j++) {
        const int m = (int)((grid >> (8 * j)) & 0xFF);
        v[j] = (int8_t)((signs >> j) & 1 ? -m : m);
    }
}
static inline void pq_iq_sub(int t, const uint8_t *b, int ib, int8_t *v, int *sc, int *dl) {
    switch (t) {
    case PQ_IQ2_XXS: {   /* d | per sub-block: 4 grid bytes, then u32 signs 4x7 | scale << 28 */
        const uint8_t *q = b + 2 + 8 * ib;
        const uint32_t a = pq_ld_u32(q + 4);
        sc[0] = sc[1] = 2 * (int)(a >> 28) + 1;
        for (int l = 0; l < 4; l++) pq_iq_sign8(v + 8 * l, pq_iq2xxs_grid[q[l]], pq_ksigns_iq2xs[(a >> (7 * l)) & 127]);
        break; }
    case PQ_IQ2_XS: {    /* d | qs u16[32]: 9-bit grid index | 7 sign bits << 9 | scales[8] of 2 nibbles */
        for (int l = 0; l < 4; l++) {
            const uint16_t q = pq_ld_u16(b + 2 + 8 * ib + 2 * l);
            pq_iq_sign8(v + 8 * l, pq_iq2xs_grid[q & 511], pq_ksigns_iq2xs[q >> 9]);
        }
        sc[0] = 2 * (b[66 + ib] & 0xF) + 1;
        sc[1] = 2 * (b[66 + ib] >> 4) + 1;
        break; }
    case PQ_IQ2_S: {     /* d | qs[32] | signs[32] | qh[8]: 2 index bits per group | scales[8] */
        for (int l = 0; l < 4; l++) {
            const int idx = b[2 + 4 * ib + l] | ((b[66 + ib] << (8 - 2 * l)) & 0x300);
            pq_iq_sign8(v + 8 * l, pq_iq2s_grid[idx], b[34 + 4 * ib + l]);
        }
        sc[0] = 2 * (b[74 + ib] & 0xF) + 1;
        sc[1] = 2 * (b[74 + ib] >> 4) + 1;
        break; }
    case PQ_IQ3_XXS: {   /* d | qs[64]: grid bytes, 8 per sub-block | u32[8] signs 4x7 | scale << 28 */
        const uint32_t a = pq_ld_u32(b + 66 + 4 * ib);
        sc[0] = sc[1] = 2 * (int)(a >> 28) + 1;
        for (int l = 0; l < 4; l++) {
            const uint64_t g = (uint64_t)pq_iq3xxs_grid[b[2 + 8 * ib + 2 * l]] |
                               (uint64_t)pq_iq3xxs_grid[b[3 + 8 * ib + 2 * l]] << 32;
            pq_iq_sign8(v + 8 * l, g, pq_ksigns_iq2xs[(a >> (7 * l)) & 127]);
        }
        break; }
    case PQ_IQ3_S: {     /* d | qs[64] | qh[8]: the 9th index bits | signs[32] | scales[4] of 2 nibbles */
        for (int l = 0; l < 4; l++) {
            const int i1 = b[2 + 8 * ib + 2 * l] | ((b[66 + ib] << (8 - 2 * l)) & 256);
            const int i2 = b[3 + 8 * ib + 2 * l] | ((b[66 + ib] << (7 - 2 * l)) & 256);
            pq_iq_sign8(v + 8 * l, (uint64_t)pq_iq3s_grid[i1] | (uint64_t)pq_iq3s_grid[i2] << 32, b[74 + 4 * ib + l]);
        }
        sc[0] = sc[1] = 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0xF) + 1;
        break; }
    case PQ_IQ1_S: {     /* d | qs[32] | qh u16[8]: 4x3 index bits | scale << 12 | delta sign << 15 */
        const uint16_t h = pq_ld_u16(b + 34 + 2 * ib);
        sc[0] = sc[1] = 2 * ((h >> 12) & 7) + 1;
        for (int l = 0; l < 4; l++) {
            const uint64_t g = pq_iq1s_grid[b[2 + 4 * ib + l] | (((h >> (3 * l)) & 7) << 8)];
            for (int j = 0; j < 8; j++) v[8 * l + j] = (int8_t)(g >> (8 * j));
            dl[l] = h & 0x8000 ? -1 : 1;
        }
        break; }
    default: {           /* IQ1_M: qs[32] | qh[16]: 3 index bits | delta sign << 3, per group | scales u16[4] */
        const uint16_t s16 = pq_ld_u16(b + 48 + 2 * (ib / 2));
        sc[0] = 2 * ((s16 >> (6 * (ib % 2))) & 7) + 1;
        sc[1] = 2 * ((s16 >> (6 * (ib % 2) + 3)) & 7) + 1;
        for (int l = 0; l < 4; l++) {
            const int h = (b[32 + 2 * ib + l / 2] >> (4 * (l % 2))) & 0xF;
            const uint64_t g = pq_iq1s_grid[b[4 * ib + l] | ((h & 7) << 8)];
            for (int j = 0; j < 8; j++) v[8 * l + j] = (int8_t)(g >> (8 * j));
            dl[l] = h & 8 ? -1 : 1;
        }
        break; }
    }
}
/* A grid IQ block's f16 scale (IQ1_M keeps its 16 bits in the top nibbles of its 4 scale words) */
static inline float pq_iq_d(int t, const uint8_t *b) {
    if (t != PQ_IQ1_M) return pq_ld_f16(b);
    const uint16_t s0 = pq_ld_u16(b + 48), s1 = pq_ld_u16(b + 50), s2 = pq_ld_u16(b + 52), s3 = pq_ld_u16(b + 54);
    return pq_f16_to_f32((uint16_t)((s0 >> 12) | ((s1 >> 8) & 0x00F0) | ((s2 >> 4) & 0x0F00) | (s3 & 0xF000)));
}

/* ---------------------------------------------------------------------------------------------
 * Activation quantizers: ggml's x86 quantize_row_q8_0 / q8_1 (what its CPU backend runs on AVX
 * machines: id = 127 / amax rather than the reference's 1 / d, and round half to even (nearbyintf
 * in the default mode, as _mm256_round_ps) rather than roundf; the two differ where a product lands on or next to a half, as activations derived from
 * quantized embeddings do), quantize_row_q8_K_ref (which x86 ggml also runs), F16 and BF16
 * conversion. Shared by both paths; reassociation and FMA contraction are off so that every
 * build computes the reference's float operations one by one. */

#define PQ_EXACT __attribute__((noinline, unused, optimize("no-associative-math", "fp-contract=off")))

PQ_EXACT static void pq_quantize_row_q8_0(const float *x, uint8_t *y, int64_t k) {
    for (int64_t b = 0; b < k / 32; b++, x += 32, y += 34) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) { const float a = fabsf(x[j]); amax = amax > a ? amax : a; }
        const float d = amax / 127.0f;
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        const uint16_t dh = pq_f32_to_f16(d);
        memcpy(y, &dh, 2);
        int8_t *qs = (int8_t *)(y + 2);
        for (int j = 0; j < 32; j++) qs[j] = (int8_t)(int)nearbyintf(x[j] * id);
    }
}

PQ_EXACT static void pq_quantize_row_q8_1(const float *x, uint8_t *y, int64_t k) {
    for (int64_t b = 0; b < k / 32; b++, x += 32, y += 36) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) { const float a = fabsf(x[j]); amax = amax > a ? amax : a; }
        const float d = amax / 127.0f;
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int8_t *qs = (int8_t *)(y + 4);
        int sum = 0;
        for (int j = 0; j < 32; j++) { qs[j] = (int8_t)(int)nearbyintf(x[j] * id); sum += qs[j]; }
        const uint16_t dh = pq_f32_to_f16(d), sh = pq_f32_to_f16((float)sum * d);
        memcpy(y, &dh, 2);
        memcpy(y + 2, &sh, 2);
    }
}

#if PQ_HAVE_AVX2
/* One Q8_K block with AVX2, bit for bit as the scalar loop below: the same float products
 * iscale * x, rounded half to even (nearbyintf in the default mode), clamped at 127; the signed
 * maximum is the first element of the largest magnitude. Returns 0 (nothing written) for a block
 * holding a NaN or an infinity, which the scalar loop handles. */
PQ_EXACT static int pq_quantize_block_q8_K_avx2(const float *x, uint8_t *y) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax8 = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int j = 0; j < PQ_QK_K; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_NEQ_UQ));
    }
    if (_mm256_movemask_ps(bad)) return 0;
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    if (amax == 0.0f) { memset(y, 0, 292); return 1; }
    float max = 0.0f;
    for (int j = 0; j < PQ_QK_K; j += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)),
                                                         _mm256_set1_ps(amax), _CMP_EQ_OQ));
        if (hit) { max = x[j + __builtin_ctz(hit)]; break; }
    }
    const float iscale = -127.0f / max;
    const __m256 is = _mm256_set1_ps(iscale);
    const __m256i cap = _mm256_set1_epi32(127), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int j = 0; j < PQ_QK_K; j += 32) {
        __m256i v[4];
        for (int u = 0; u < 4; u++)
            v[u] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(is, _mm256_loadu_ps(x + j + 8 * u)),
                                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)), cap);
        for (int g = 0; g < 2; g++) {
            const int32_t s = pq_hsum_i32(_mm256_add_epi32(v[2 * g], v[2 * g + 1]));
            const int16_t s16 = (int16_t)s;
            memcpy(y + 260 + 2 * (j / 16 + g), &s16, 2);
        }
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(y + 4 + j), _mm256_permutevar8x32_epi32(p, order));
    }
    const float d = 1.0f / iscale;
    memcpy(y, &d, 4);
    return 1;
}
#endif

/* Q8_K: float d, int8 qs[256], int16 bsums[16]; ggml's nearest_int rounds half to even. */
PQ_EXACT static void pq_quantize_row_q8_K(const float *x, uint8_t *y, int64_t k) {
    for (int64_t b = 0; b < k / PQ_QK_K; b++, x += PQ_QK_K, y += 292) {
#if PQ_HAVE_AVX2
        if (pq_quantize_block_q8_K_avx2(x, y)) continue;
#endif
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < PQ_QK_K; j++) {
            const float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        int8_t *qs = (int8_t *)(y + 4);
        if (amax == 0.0f) {
            memset(y, 0, 292);
            continue;
        }
        const float iscale = -127.0f / max;
        for (int j = 0; j < PQ_QK_K; j++) {
            const int v = (int)nearbyintf(iscale * x[j]);
            qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += qs[16 * g + l];
            const int16_t s16 = (int16_t)s;
            memcpy(y + 260 + 2 * g, &s16, 2);
        }
        const float d = 1.0f / iscale;
        memcpy(y, &d, 4);
    }
}

PQ_API void pq_quantize_row_f16(const float *x, uint8_t *y, int64_t k) {
    uint16_t *h = (uint16_t *)y;
    int64_t i = 0;
#if PQ_HAVE_AVX2
    for (; i + 8 <= k; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < k; i++) h[i] = pq_f32_to_f16(x[i]);
}

PQ_API void pq_quantize_row_bf16(const float *x, uint8_t *y, int64_t k) {
    uint16_t *h = (uint16_t *)y;
    for (int64_t i = 0; i < k; i++) h[i] = pq_f32_to_bf16(x[i]);
}

/* One row of k floats to vec type `t` (F32, F16, BF16, Q8_0, Q8_1, Q8_K). */
static inline void pq_quantize_row(int t, const float *x, uint8_t *y, int64_t k) {
    switch (t) {
    case PQ_Q8_0: pq_quantize_row_q8_0(x, y, k); break;
    case PQ_Q8_1: pq_quantize_row_q8_1(x, y, k); break;
    case PQ_Q8_K: pq_quantize_row_q8_K(x, y, k); break;
    case PQ_F16: pq_quantize_row_f16(x, y, k); break;
    case PQ_BF16: pq_quantize_row_bf16(x, y, k); break;
    default: memcpy(y, x, (size_t)k * 4); break;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Weight dequantizers, bit-exact with ggml's dequantize_row_* (every product below is exact in
 * float32, so FMA contraction cannot change a result). Used for row lookups and tile unpacking. */

static inline void pq_k4_scale_min(int j, const uint8_t *s, uint8_t *sc, uint8_t *m) {
    if (j < 4) { *sc = s[j] & 63; *m = s[j + 4] & 63; }
    else { *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4); *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

static inline int pq_q3_scale(const uint8_t *s, int i) {
    const int lo = (s[i % 8] >> (4 * (i / 8))) & 0xF;
    const int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (lo | (hi << 4)) - 32;
}

/* The ternary types' 256 stored digits, each 0, 1 or 2 for the weight's -1, 0, +1 (TQ2_0's 2-bit fields
 * may also hold 3, which ggml reads as +2), in element order:
 *   TQ1_0: qs[48] | qh[4] | d. A byte holds 5 base-3 digits as a fixed-point fraction (byte = ceil(v *
 *   256 / 243)); digit n is the top of 3 * (byte * 3^n mod 256) / 256. Element 32n + m is digit n of
 *   qs[m] (m < 32), 160 + 16n + m digit n of qs[32 + m], 240 + 4n + j digit n (< 4) of qh[j].
 *   TQ2_0: qs[64] | d. Element 128h + 32l + m is bits 2l .. 2l + 1 of qs[32h + m]. */
static inline int pq_trit(uint8_t byte, int n) {
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    return ((uint16_t)(uint8_t)(byte * pow3[n]) * 3) >> 8;
}
static inline void pq_tq_digits(int t, const uint8_t *b, uint8_t *u) {
    if (t == PQ_TQ2_0) {
        for (int e = 0; e < PQ_QK_K; e++) u[e] = (b[32 * (e / 128) + e % 32] >> (2 * ((e / 32) % 4))) & 3;
        return;
    }
    for (int n = 0; n < 5; n++)
        for (int m = 0; m < 32; m++) u[32 * n + m] = (uint8_t)pq_trit(b[m], n);
    for (int n = 0; n < 5; n++)
        for (int m = 0; m < 16; m++) u[160 + 16 * n + m] = (uint8_t)pq_trit(b[32 + m], n);
    for (int n = 0; n < 4; n++)
        for (int j = 0; j < 4; j++) u[240 + 4 * n + j] = (uint8_t)pq_trit(b[48 + j], n);
}

/* One block of type t at `b` -> its `block` floats. */
static inline void pq_dequant_block(int t, const uint8_t *b, float *y) {
    switch (t) {
    case PQ_TQ1_0: case PQ_TQ2_0: { /* (digit - 1) * d, exact */
        uint8_t u[PQ_QK_K];
        const float d = pq_ld_f16(b + (t == PQ_TQ1_0 ? 52 : 64));
        pq_tq_digits(t, b, u);
        for (int e = 0; e < PQ_QK_K; e++) y[e] = (float)(u[e] - 1) * d;
        break; }
    case PQ_Q4_0: { const float d = pq_ld_f16(b);
        for (int j = 0; j < 16; j++) { y[j] = (float)((b[2 + j] & 0xF) - 8) * d; y[j + 16] = (float)((b[2 + j] >> 4) - 8) * d; }
        break; }
    case PQ_Q4_1: { const float d = pq_ld_f16(b), m = pq_ld_f16(b + 2);
        for (int j = 0; j < 16; j++) { y[j] = (float)(b[4 + j] & 0xF) * d + m; y[j + 16] = (float)(b[4 + j] >> 4) * d + m; }
        break; }
    case PQ_Q5_0: { const float d = pq_ld_f16(b); const uint32_t qh = pq_ld_u32(b + 2);
        for (int j = 0; j < 16; j++) {
            const int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
            y[j] = (float)(((b[6 + j] & 0xF) | (h0 << 4)) - 16) * d;
            y[j + 16] = (float)(((b[6 + j] >> 4) | (h1 << 4)) - 16) * d;
        }
        break; }
    case PQ_Q5_1: { const float d = pq_ld_f16(b), m = pq_ld_f16(b + 2); const uint32_t qh = pq_ld_u32(b + 4);
        for (int j = 0; j < 16; j++) {
            const int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
            y[j] = (float)((b[8 + j] & 0xF) | (h0 << 4)) * d + m;
            y[j + 16] = (float)((b[8 + j] >> 4) | (h1 << 4)) * d + m;
        }
        break; }
    case PQ_Q8_0: { const float d = pq_ld_f16(b);
        for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
        break; }
    case PQ_Q2_K: { /* scales[16] | qs[64] | d | dmin */
        const float d = pq_ld_f16(b + 80), dmin = pq_ld_f16(b + 82);
        for (int e = 0; e < PQ_QK_K; e++) {
            const int h = e / 128, s = (e / 32) % 4, l = e % 32, g = e / 16;
            const int q = (b[16 + 32 * h + l] >> (2 * s)) & 3;
            y[e] = d * (float)(b[g] & 0xF) * (float)q - dmin * (float)(b[g] >> 4);
        }
        break; }
    case PQ_Q3_K: { /* hmask[32] | qs[64] | scales[12] | d */
        const float d = pq_ld_f16(b + 108);
        for (int e = 0; e < PQ_QK_K; e++) {
            const int h = e / 128, s = (e / 32) % 4, l = e % 32;
            const int q = ((b[32 + 32 * h + l] >> (2 * s)) & 3) - (((b[l] >> (e / 32)) & 1) ? 0 : 4);
            y[e] = d * (float)pq_q3_scale(b + 96, e / 16) * (float)q;
        }
        break; }
    case PQ_Q4_K: case PQ_Q5_K: {
        const float d = pq_ld_f16(b), dmin = pq_ld_f16(b + 2);
        const uint8_t *qh = b + 16, *qs = b + (t == PQ_Q5_K ? 48 : 16);
        for (int g = 0; g < 8; g++) {
            uint8_t sc, m; pq_k4_scale_min(g, b + 4, &sc, &m);
            const float dl = d * (float)sc, ml = dmin * (float)m;
            for (int l = 0; l < 32; l++) {
                int q = (qs[32 * (g / 2) + l] >> (4 * (g % 2))) & 0xF;
                if (t == PQ_Q5_K) q |= ((qh[l] >> g) & 1) << 4;
                y[32 * g + l] = dl * (float)q - ml;
            }
        }
        break; }
    case PQ_Q6_K: { /* ql[128] | qh[64] | scales int8[16] | d */
        const float d = pq_ld_f16(b + 208);
        for (int e = 0; e < PQ_QK_K; e++) {
            const int h = e / 128, k = (e / 32) % 4, l = e % 32;
            const int lo = (b[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 0xF;
            const int hi = (b[128 + 32 * h + l] >> (2 * k)) & 3;
            y[e] = d * (float)(int8_t)b[192 + e / 16] * (float)((lo | (hi << 4)) - 32);
        }
        break; }
    case PQ_IQ4_NL: case PQ_MXFP4: {
        const int nl = t == PQ_IQ4_NL;
        const float d = nl ? pq_ld_f16(b) : pq_e8m0_half(b[0]);
        const int8_t *kv = nl ? pq_kvalues_iq4nl : pq_kvalues_mxfp4;
        const uint8_t *qs = b + (nl ? 2 : 1);
        for (int j = 0; j < 16; j++) { y[j] = d * (float)kv[qs[j] & 0xF]; y[j + 16] = d * (float)kv[qs[j] >> 4]; }
        break; }
    case PQ_IQ4_XS: { /* d | scales_h | scales_l[4] | qs[128]; dl = d * (scale - 32), as ggml */
        const float d = pq_ld_f16(b);
        for (int ib = 0; ib < 8; ib++) {
            const float dl = d * (float)pq_iq4xs_scale(b, ib);
            const uint8_t *qs = b + 8 + 16 * ib;
            for (int j = 0; j < 16; j++) {
                y[32 * ib + j] = dl * (float)pq_kvalues_iq4nl[qs[j] & 0xF];
                y[32 * ib + j + 16] = dl * (float)pq_kvalues_iq4nl[qs[j] >> 4];
            }
        }
        break; }
    case PQ_IQ2_XXS: case PQ_IQ2_XS: case PQ_IQ2_S: case PQ_IQ3_XXS: case PQ_IQ3_S: case PQ_IQ1_S: case PQ_IQ1_M: {
        /* every product exact: d (11 bits) * sc (4) * v (6) or * (v +- 1/8) (4) */
        const float d = pq_iq_d(t, b);
        const float f = t == PQ_IQ3_S || t == PQ_IQ1_S || t == PQ_IQ1_M ? 1.0f : t == PQ_IQ3_XXS ? 0.25f : 0.125f;
        const int iq1 = t == PQ_IQ1_S || t == PQ_IQ1_M;
        int8_t v[32];
        int sc[2], dl[4];
        for (int ib = 0; ib < 8; ib++) {
            pq_iq_sub(t, b, ib, v, sc, dl);
            for (int e = 0; e < 32; e++) {
                const float db = d * (float)sc[e / 16] * f;
                y[32 * ib + e] = iq1 ? db * ((float)v[e] + (dl[e / 8] < 0 ? -0.125f : 0.125f)) : db * (float)v[e];
            }
        }
        break; }
    case PQ_F16: y[0] = pq_ld_f16(b); break;
    case PQ_BF16: { uint16_t h; memcpy(&h, b, 2); y[0] = pq_bf16_to_f32(h); break; }
    default: y[0] = pq_ld_f32(b); break;
    }
}

/* A row of k elements of type t -> floats. */
PQ_API void pq_dequant_row(int t, const uint8_t *w, float *y, int64_t k) {
    pq_traits tr;
    if (!pq_get_traits(t, &tr)) return;
    if (t == PQ_F16) {
        int64_t i = 0;
#if PQ_HAVE_AVX2
        for (; i + 8 <= k; i += 8)
            _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * i))));
#endif
        for (; i < k; i++) y[i] = pq_ld_f16(w + 2 * i);
        return;
    }
    if (t == PQ_F32) { memcpy(y, w, (size_t)k * 4); return; }
    for (int64_t b = 0; b < k / tr.block; b++) pq_dequant_block(t, w + b * tr.bytes, y + b * tr.block);
}

/* ---------------------------------------------------------------------------------------------
 * Portable path: integer sums per block as ggml's generic vec_dot_* form them, then the scales in
 * ggml's order. pq_isums_* fill `s` with pq_traits.ints values per block:
 *   Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: [sum q_w * q_x]
 *   Q2_K: 16 sub-block sums of q_w (0..3) * q_x, then isum = sum sc_lo * sub, summs = sum bsums * sc_hi
 *   Q3_K: 16 sub-block sums of q_w (-4..3) * q_x, then isum = sum (scale - 32) * sub
 *   Q4_K, Q5_K: 8 sub-block (32) sums of q_w * q_x, then isum = sum scale * sub, summs = sum bsums * min
 *   Q6_K: 16 sub-block sums of (q_w - 32) * q_x, then isum = sum scale * sub
 *   IQ4_NL, MXFP4: [sum value(q_w) * q_x]
 *   IQ4_XS: 8 sub-block (32) sums of value(q_w) * q_x, then isum = sum (scale - 32) * sub
 *   grid IQ types: 16 half sub-block (16) sums of v * q_x, then isum = sum sc * sub; IQ1_S, IQ1_M
 *   then the deltas' sum dsum = sum sc * (sum dl * q_x) (pq_iq_sub's v, sc, dl)
 *   TQ1_0, TQ2_0: 8 lanes as ggml's AVX2 vec_dot forms them (pq_isums_tq) */

static inline void pq_isums_q4_0(const uint8_t *w, const uint8_t *x, int32_t *s) {
    const int8_t *q8 = (const int8_t *)(x + 2);
    int s0 = 0, s1 = 0;
    for (int j = 0; j < 16; j++) {
        s0 += ((w[2 + j] & 0xF) - 8) * q8[j];
        s1 += ((w[2 + j] >> 4) - 8) * q8[j + 16];
    }
    s[0] = s0 + s1;
}

static inline void pq_isums_q4_1(const uint8_t *w, const uint8_t *x, int32_t *s) {
    const int8_t *q8 = (const int8_t *)(x + 4);
    int s0 = 0, s1 = 0;
    for (int j = 0; j < 16; j++) { s0 += (w[4 + j] & 0xF) * q8[j]; s1 += (w[4 + j] >> 4) * q8[j + 16]; }
    s[0] = s0 + s1;
}

static inline void pq_isums_q5_0(const uint8_t *w, const uint8_t *x, int32_t *s) {
    const int8_t *q8 = (const int8_t *)(x + 2);
    const uint32_t qh = pq_ld_u32(w + 2);
    int s0 = 0, s1 = 0;
    for (int j = 0; j < 16; j++) {
        const int h0 = ((qh >> j) & 1) << 4, h1 = ((qh >> (j + 16)) & 1) << 4;
        s0 += (((w[6 + j] & 0xF) | h0) - 16) * q8[j];
        s1 += (((w[6 + j] >> 4) | h1) - 16) * q8[j + 16];
    }
    s[0] = s0 + s1;
}

static inline void pq_isums_q5_1(const uint8_t *w, const uint8_t *x, int32_t *s) {
    const int8_t *q8 = (const int8_t *)(x + 4);
    const uint32_t qh = pq_ld_u32(w + 4);
    int s0 = 0, s1 = 0;
    for (int j = 0; j < 16; j++) {
        const int h0 = ((qh >> j) & 1) << 4, h1 = ((qh >> (j + 16)) & 1) << 4;
        s0 += ((w[8 + j] & 0xF) | h0) * q8[j];
        s1 += ((w[8 + j] >> 4) | h1) * q8[j + 16];
    }
    s[0] = s0 + s1;
}

static inline void pq_isums_q8_0(const uint8_t *w, const uint8_t *x, int32_t *s) {
    const int8_t *qw = (const int8_t *)(w + 2), *q8 = (const int8_t *)(x + 2);
    int sum = 0;
    for (int j = 0; j < 32; j++) sum += qw[j] * q8[j];
    s[0] = sum;
}

static inline void pq_isums_q2_K(const uint8_t *w, const uint8_t *x, int32_t *s) {
    const uint8_t *sc = w, *q2 = w + 16;
    const int8_t *q8 = (const int8_t *)(x + 4);
    int isum = 0, summs = 0;
    for (int g = 0; g < 16; g++) summs += pq_ld_i16(x + 260 + 2 * g) * (sc[g] >> 4);
    for (int g = 0; g < 16; g++) {   /* element e = 16g + l: qs byte 32*(e/128) + e%32, shift 2*((e/32)%4) */
        const int h = g / 8, sh = 2 * ((g / 2) % 4), off = 16 * (g % 2);
        int sub = 0;
        for (int l = 0; l < 16; l++) sub += q8[16 * g + l] * ((q2[32 * h + off + l] >> sh) & 3);
        s[g] = sub;
        isum += (sc[g] & 0xF) * sub;
    }
    s[16] = isum;
    s[17] = summs;
}

static inline void pq_isums_q3_K(const uint8_t *w, const uint8_t *x, int32_t *s) {
    const uint8_t *hm = w, *q3 = w + 32;
    const int8_t *q8 = (const int8_t *)(x + 4);
    int isum = 0;
    for (int g = 0; g < 16; g++) {
        const int h = g / 8, sh = 2 * ((g / 2) % 4), off = 16 * (g % 2), bit = g / 2;
        int sub = 0;
        for (int l = 0; l < 16; l++) {
            const int q = ((q3[32 * h + off + l] >> sh) & 3) - (((hm[off + l] >> bit) & 1) ? 0 : 4);
            sub += q8[16 * g + l] * q;
        }
        s[g] = sub;
        isum += pq_q3_scale(w + 96, g) * sub;
    }
    s[16] = isum;
}

static inline void pq_isums_q45_K(const uint8_t *w, const uint8_t *x, int32_t *s, int five) {
    const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
    const int8_t *q8 = (const int8_t *)(x + 4);
    int isum = 0, summs = 0;
    for (int g = 0; g < 8; g++) {
        uint8_t sc, m; pq_k4_scale_min(g, w + 4, &sc, &m);
        int sub = 0;
        for (int l = 0; l < 32; l++) {
            int q = (qs[32 * (g / 2) + l] >> (4 * (g % 2))) & 0xF;
            if (five) q += ((qh[l] >> g) & 1) ? 16 : 0;
            sub += q8[32 * g + l] * q;
        }
        s[g] = sub;
        isum += sc * sub;
        summs += (pq_ld_i16(x + 260 + 4 * g) + pq_ld_i16(x + 262 + 4 * g)) * m;
    }
    s[8] = isum;
    s[9] = summs;
}

static inline void pq_isums_q6_K(const uint8_t *w, const uint8_t *x, int32_t *s) {
    const int8_t *q8 = (const int8_t *)(x + 4);
    const int8_t *sc = (const int8_t *)(w + 192);
    int isum = 0;
    for (int g = 0; g < 16; g++) {
        const int h = g / 8, k = (g / 2) % 4, off = 16 * (g % 2);
        int sub = 0;
        for (int l = off; l < off + 16; l++) {
            const int lo = (w[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 0xF;
            const int hi = (w[128 + 32 * h + l] >> (2 * k)) & 3;
            sub += q8[128 * h + 32 * k + l] * ((lo | (hi << 4)) - 32);
        }
        s[g] = sub;
        isum += sc[g] * sub;
    }
    s[16] = isum;
}

/* IQ4_NL, MXFP4: one block of 32 looked up in kv; qs its 16 bytes of nibbles */
static inline void pq_isums_lut(const int8_t *kv, const uint8_t *qs, const uint8_t *x, int32_t *s) {
    const int8_t *q8 = (const int8_t *)(x + 2);
    int s0 = 0, s1 = 0;
    for (int j = 0; j < 16; j++) { s0 += q8[j] * kv[qs[j] & 0xF]; s1 += q8[j + 16] * kv[qs[j] >> 4]; }
    s[0] = s0 + s1;
}

static inline void pq_isums_iq4_xs(const uint8_t *w, const uint8_t *x, int32_t *s) {
    const int8_t *q8 = (const int8_t *)(x + 4);
    int isum = 0;
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *qs = w + 8 + 16 * ib;
        int sub = 0;
        for (int j = 0; j < 16; j++)
            sub += q8[32 * ib + j] * pq_kvalues_iq4nl[qs[j] & 0xF] + q8[32 * ib + j + 16] * pq_kvalues_iq4nl[qs[j] >> 4];
        s[ib] = sub;
        isum += pq_iq4xs_scale(w, ib) * sub;
    }
    s[8] = isum;
}

static inline void pq_isums_iq(int t, const uint8_t *w, const uint8_t *x, int32_t *s) {
    const int8_t *q8 = (const int8_t *)(x + 4);
    int8_t v[32];
    int sc[2], dl[4] = {0, 0, 0, 0};
    int isum = 0, dsum = 0;
    for (int ib = 0; ib < 8; ib++) {
        pq_iq_sub(t, w, ib, v, sc, dl);
        for (int h = 0; h < 2; h++) {
            int sub = 0, ds = 0;
            for (int e = 16 * h; e < 16 * h + 16; e++) { sub += v[e] * q8[32 * ib + e]; ds += dl[e / 8] * q8[32 * ib + e]; }
            s[2 * ib + h] = sub;
            isum += sc[h] * sub;
            dsum += sc[h] * ds;
        }
    }
    s[16] = isum;
    if (t == PQ_IQ1_S || t == PQ_IQ1_M) s[17] = dsum;
}

/* A grid IQ row . a Q8_K row in the float steps of ggml's x86 (AVX2) vec_dot, which llama.cpp runs
 * on x86 (its generic C code orders them otherwise). Per super-block the integer sums go to 8 int32
 * lanes, lane l taking elements 4l .. 4l + 3 of every sub-block times their half's scale; each lane
 * is converted and fused into its float accumulator with d = d_w * d_x, and the 8 accumulators are
 * reduced at the end as hsum_float_8, then times 1/8 (IQ2) or 1/4 (IQ3_XXS). IQ1_M keeps its deltas'
 * lanes in a second set of accumulators, reduced and added times 1/8; IQ1_S its deltas' whole sum
 * per super-block (from the activation's bsums) in one float, fused with d, added times 1/8. The
 * AVX2 kernel (pq_avx2_iq) takes the same steps, so the two paths agree bit for bit. No
 * reassociation: each float operation is ggml's, one by one. */
PQ_EXACT static float pq_dot1_iq(int t, int64_t n, const uint8_t *w, const uint8_t *x) {
    pq_traits tr;
    pq_get_traits(t, &tr);
    float acc[8] = {0}, accd[8] = {0}, acc1 = 0.0f;
    int8_t v[32];
    int sc[2], dl[4] = {0, 0, 0, 0};
    for (int64_t i = 0; i < n / PQ_QK_K; i++) {
        const uint8_t *wb = w + (int64_t)tr.bytes * i, *xb = x + 292 * i;
        const int8_t *q8 = (const int8_t *)(xb + 4);
        int32_t lane[8] = {0}, laned[8] = {0}, sumd = 0;
        for (int ib = 0; ib < 8; ib++) {
            pq_iq_sub(t, wb, ib, v, sc, dl);
            for (int l = 0; l < 8; l++) {
                int p = 0, pd = 0;
                for (int e = 4 * l; e < 4 * l + 4; e++) { p += v[e] * q8[32 * ib + e]; pd += dl[e / 8] * q8[32 * ib + e]; }
                lane[l] += sc[l / 4] * p;
                laned[l] += sc[l / 4] * pd;
            }
            if (t == PQ_IQ1_S) sumd += (pq_ld_i16(xb + 260 + 4 * ib) + pq_ld_i16(xb + 262 + 4 * ib)) * dl[0] * sc[0];
        }
        const float d = pq_iq_d(t, wb) * pq_ld_f32(xb);
        for (int l = 0; l < 8; l++) acc[l] = fmaf(d, (float)lane[l], acc[l]);
        if (t == PQ_IQ1_M)
            for (int l = 0; l < 8; l++) accd[l] = fmaf(d, (float)laned[l], accd[l]);
        if (t == PQ_IQ1_S) acc1 = fmaf(d, (float)sumd, acc1);
    }
    const float sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    switch (t) {
    case PQ_IQ3_S: return sum;
    case PQ_IQ3_XXS: return 0.25f * sum;
    case PQ_IQ1_S: return sum + 0.125f * acc1;
    case PQ_IQ1_M: return sum + 0.125f * (((accd[0] + accd[4]) + (accd[2] + accd[6])) + ((accd[1] + accd[5]) + (accd[3] + accd[7])));
    default: return 0.125f * sum;
    }
}

/* TQ1_0 / TQ2_0 . Q8_K, the integer lanes of ggml's x86 (AVX2) vec_dot: lane l holds the stored digits
 * (0..2) times q_x of elements 4l .. 4l + 3 of every 32, less the sum of q_x over elements 32l .. 32l + 31
 * (bsums 2l and 2l + 1), so that the 8 lanes add up to sum (digit - 1) * q_x. */
static inline void pq_isums_tq(int t, const uint8_t *w, const uint8_t *x, int32_t *lane) {
    const int8_t *q8 = (const int8_t *)(x + 4);
    uint8_t u[PQ_QK_K];
    pq_tq_digits(t, w, u);
    for (int l = 0; l < 8; l++) {
        int p = 0;
        for (int c = 0; c < 8; c++)
            for (int e = 32 * c + 4 * l; e < 32 * c + 4 * l + 4; e++) p += u[e] * q8[e];
        lane[l] = p - (pq_ld_i16(x + 260 + 4 * l) + pq_ld_i16(x + 262 + 4 * l));
    }
}

/* A ternary row . a Q8_K row in the float steps of ggml's x86 vec_dot: each super-block's 8 lanes
 * converted and fused into 8 float accumulators with d = d_x * d_w, reduced at the end as
 * hsum_float_8. The AVX2 kernel (pq_avx2_tq) takes the same steps. */
PQ_EXACT static float pq_dot1_tq(int t, int64_t n, const uint8_t *w, const uint8_t *x) {
    const int bytes = t == PQ_TQ1_0 ? 54 : 66;
    float acc[8] = {0};
    int32_t lane[8];
    for (int64_t i = 0; i < n / PQ_QK_K; i++) {
        const uint8_t *wb = w + (int64_t)bytes * i, *xb = x + 292 * i;
        pq_isums_tq(t, wb, xb, lane);
        const float d = pq_ld_f32(xb) * pq_ld_f16(wb + bytes - 2);
        for (int l = 0; l < 8; l++) acc[l] = fmaf((float)lane[l], d, acc[l]);
    }
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* An IQ4_XS row . a Q8_K row in the float steps of ggml's x86 vec_dot (and of pq_avx2_iq4_xs): per
 * super-block 8 int32 lanes, lane l the scaled sums of elements 4l .. 4l + 3 of every sub-block, each
 * fused into its float accumulator with d_w * d_x, reduced as hsum_float_8. */
PQ_EXACT static float pq_dot1_iq4_xs(int64_t n, const uint8_t *w, const uint8_t *x) {
    float acc[8] = {0};
    for (int64_t i = 0; i < n / PQ_QK_K; i++) {
        const uint8_t *wb = w + 136 * i, *xb = x + 292 * i;
        const int8_t *q8 = (const int8_t *)(xb + 4);
        int32_t lane[8] = {0};
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *qs = wb + 8 + 16 * ib;
            const int ls = pq_iq4xs_scale(wb, ib);
            for (int l = 0; l < 8; l++) {
                int p = 0;
                for (int e = 4 * l; e < 4 * l + 4; e++)   /* elements 0..15 low nibbles, 16..31 high */
                    p += q8[32 * ib + e] * pq_kvalues_iq4nl[e < 16 ? qs[e] & 0xF : qs[e - 16] >> 4];
                lane[l] += ls * p;
            }
        }
        const float d = pq_ld_f16(wb) * pq_ld_f32(xb);
        for (int l = 0; l < 8; l++) acc[l] = fmaf(d, (float)lane[l], acc[l]);
    }
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* The per-block integer sums of a whole row (nb blocks); 0 if t has none. */
PQ_API int pq_isums_row(int t, int64_t nb, const uint8_t *w, const uint8_t *x, int32_t *out) {
    pq_traits tw, tx;
    if (!pq_get_traits(t, &tw) || tw.ints == 0) return 0;
    pq_get_traits(tw.vec_type, &tx);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * tw.bytes, *xb = x + b * tx.bytes;
        int32_t *s = out + b * tw.ints;
        switch (t) {
        case PQ_Q4_0: pq_isums_q4_0(wb, xb, s); break;
        case PQ_Q4_1: pq_isums_q4_1(wb, xb, s); break;
        case PQ_Q5_0: pq_isums_q5_0(wb, xb, s); break;
        case PQ_Q5_1: pq_isums_q5_1(wb, xb, s); break;
        case PQ_Q8_0: pq_isums_q8_0(wb, xb, s); break;
        case PQ_Q2_K: pq_isums_q2_K(wb, xb, s); break;
        case PQ_Q3_K: pq_isums_q3_K(wb, xb, s); break;
        case PQ_Q4_K: pq_isums_q45_K(wb, xb, s, 0); break;
        case PQ_Q5_K: pq_isums_q45_K(wb, xb, s, 1); break;
        case PQ_Q6_K: pq_isums_q6_K(wb, xb, s); break;
        case PQ_IQ4_NL: pq_isums_lut(pq_kvalues_iq4nl, wb + 2, xb, s); break;
        case PQ_MXFP4: pq_isums_lut(pq_kvalues_mxfp4, wb + 1, xb, s); break;
        case PQ_IQ4_XS: pq_isums_iq4_xs(wb, xb, s); break;
        case PQ_TQ1_0: case PQ_TQ2_0: pq_isums_tq(t, wb, xb, s); break;
        default: if (pq_is_iq_grid(t)) pq_isums_iq(t, wb, xb, s); break;
        }
    }
    return 1;
}

/* One weight row . one quantized activation row, portable. n = row length in elements. */
PQ_API float pq_dot1_portable(int t, int64_t n, const uint8_t *w, const uint8_t *x) {
    int32_t s[18];
    float sumf = 0.0f;
    int64_t i;
    if (pq_is_iq_grid(t)) return pq_dot1_iq(t, n, w, x);
    if (t == PQ_TQ1_0 || t == PQ_TQ2_0) return pq_dot1_tq(t, n, w, x);
    switch (t) {
    case PQ_Q4_0:
        for (i = 0; i < n / 32; i++) {
            pq_isums_q4_0(w + 18 * i, x + 34 * i, s);
            sumf += (float)s[0] * pq_ld_f16(w + 18 * i) * pq_ld_f16(x + 34 * i);
        }
        return sumf;
    case PQ_Q4_1:
        for (i = 0; i < n / 32; i++) {
            const uint8_t *wb = w + 20 * i, *xb = x + 36 * i;
            pq_isums_q4_1(wb, xb, s);
            sumf += (pq_ld_f16(wb) * pq_ld_f16(xb)) * (float)s[0] + pq_ld_f16(wb + 2) * pq_ld_f16(xb + 2);
        }
        return sumf;
    case PQ_Q5_0:
        for (i = 0; i < n / 32; i++) {
            pq_isums_q5_0(w + 22 * i, x + 34 * i, s);
            sumf += (pq_ld_f16(w + 22 * i) * pq_ld_f16(x + 34 * i)) * (float)s[0];
        }
        return sumf;
    case PQ_Q5_1:
        for (i = 0; i < n / 32; i++) {
            const uint8_t *wb = w + 24 * i, *xb = x + 36 * i;
            pq_isums_q5_1(wb, xb, s);
            sumf += (pq_ld_f16(wb) * pq_ld_f16(xb)) * (float)s[0] + pq_ld_f16(wb + 2) * pq_ld_f16(xb + 2);
        }
        return sumf;
    case PQ_Q8_0:
        for (i = 0; i < n / 32; i++) {
            pq_isums_q8_0(w + 34 * i, x + 34 * i, s);
            sumf += (float)s[0] * (pq_ld_f16(w + 34 * i) * pq_ld_f16(x + 34 * i));
        }
        return sumf;
    case PQ_Q2_K:
        for (i = 0; i < n / PQ_QK_K; i++) {
            const uint8_t *wb = w + 84 * i, *xb = x + 292 * i;
            pq_isums_q2_K(wb, xb, s);
            const float yd = pq_ld_f32(xb);
            const float dall = yd * pq_ld_f16(wb + 80), dmin = yd * pq_ld_f16(wb + 82);
            sumf += dall * (float)s[16] - dmin * (float)s[17];
        }
        return sumf;
    case PQ_Q3_K:
        for (i = 0; i < n / PQ_QK_K; i++) {
            const uint8_t *wb = w + 110 * i, *xb = x + 292 * i;
            pq_isums_q3_K(wb, xb, s);
            sumf += (pq_ld_f16(wb + 108) * pq_ld_f32(xb)) * (float)s[16];
        }
        return sumf;
    case PQ_Q4_K: case PQ_Q5_K: {
        const int bytes = t == PQ_Q4_K ? 144 : 176;
        for (i = 0; i < n / PQ_QK_K; i++) {
            const uint8_t *wb = w + bytes * i, *xb = x + 292 * i;
            pq_isums_q45_K(wb, xb, s, t == PQ_Q5_K);
            const float yd = pq_ld_f32(xb);
            sumf += (pq_ld_f16(wb) * yd) * (float)s[8];
            sumf -= (pq_ld_f16(wb + 2) * yd) * (float)s[9];
        }
        return sumf; }
    case PQ_Q6_K:
        for (i = 0; i < n / PQ_QK_K; i++) {
            const uint8_t *wb = w + 210 * i, *xb = x + 292 * i;
            pq_isums_q6_K(wb, xb, s);
            sumf += (pq_ld_f16(wb + 208) * pq_ld_f32(xb)) * (float)s[16];
        }
        return sumf;
    case PQ_IQ4_NL:
        for (i = 0; i < n / 32; i++) {
            pq_isums_lut(pq_kvalues_iq4nl, w + 18 * i + 2, x + 34 * i, s);
            sumf += (pq_ld_f16(x + 34 * i) * pq_ld_f16(w + 18 * i)) * (float)s[0];
        }
        return sumf;
    case PQ_MXFP4:
        for (i = 0; i < n / 32; i++) {
            pq_isums_lut(pq_kvalues_mxfp4, w + 17 * i + 1, x + 34 * i, s);
            sumf += (pq_ld_f16(x + 34 * i) * pq_e8m0_half(w[17 * i])) * (float)s[0];
        }
        return sumf;
    case PQ_IQ4_XS: return pq_dot1_iq4_xs(n, w, x);
    case PQ_F16: {
        const uint16_t *a = (const uint16_t *)w, *b = (const uint16_t *)x;
        for (i = 0; i < n; i++) sumf += pq_f16_to_f32(a[i]) * pq_f16_to_f32(b[i]);
        return sumf; }
    case PQ_BF16: {
        const uint16_t *a = (const uint16_t *)w, *b = (const uint16_t *)x;
        for (i = 0; i < n; i++) sumf += pq_bf16_to_f32(a[i]) * pq_bf16_to_f32(b[i]);
        return sumf; }
    default: {
        const float *a = (const float *)w, *b = (const float *)x;
        for (i = 0; i < n; i++) sumf += a[i] * b[i];
        return sumf; }
    }
}

/* ---------------------------------------------------------------------------------------------
 * AVX2 path. Each kernel dots one weight row with NR (1..4) activation rows at byte stride xs,
 * unpacking each weight block once for all NR rows. The always_inline bodies take NR as a
 * constant from thin wrappers, so the per-row loops unroll and the accumulators stay in
 * registers. */
#if PQ_HAVE_AVX2

#define PQ_INLINE static inline __attribute__((always_inline))

PQ_INLINE float pq_hsum256(__m256 v) {   /* ggml's hsum_float_8: ((0+4) + (2+6)) + ((1+5) + (3+7)) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    PIN_VEC(s);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    PIN_VEC(s);
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
PQ_INLINE float pq_hsum128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    PIN_VEC(s);
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
PQ_INLINE int32_t pq_hsum_i32x4(__m128i s) {
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}
PQ_INLINE float pq_h2f(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }
/* 16 bytes of nibbles -> 32 bytes: low nibbles (elements 0..15), then high nibbles (16..31) */
PQ_INLINE __m256i pq_nibbles32(const uint8_t *p) {
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}
/* 16 bytes of nibbles -> 32 bytes, each looked up in a 16-value table (both lanes of lut) */
PQ_INLINE __m256i pq_unpack_lut(__m256i lut, const uint8_t *qs) { return _mm256_shuffle_epi8(lut, pq_nibbles32(qs)); }
/* 32 bits -> 32 bytes, byte j = 0xFF where bit j is set */
PQ_INLINE __m256i pq_bits_to_bytes(uint32_t bits) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                           0x0101010101010101LL, 0x0000000000000000LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    const __m256i bit = _mm256_set1_epi64x((long long)0x7fbfdfeff7fbfdfeULL);
    v = _mm256_or_si256(v, bit);
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}
/* unsigned bytes u . signed bytes b, 4 products per int32 lane. With VNNI one instruction; without,
 * maddubs + madd, whose int16 pair sums cannot saturate for the callers' ranges (|u| <= 128,
 * |b| <= 127), so both give the exact sums. */
PQ_INLINE __m256i pq_dpbusd_acc(__m256i acc, __m256i u, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, b), _mm256_set1_epi16(1)));
#endif
}
PQ_INLINE __m256i pq_dpbusd(__m256i u, __m256i b) { return pq_dpbusd_acc(_mm256_setzero_si256(), u, b); }
/* signed bytes a . signed bytes b, in 8 int32 lanes (|a|, |b| <= 128, never both -128) */
PQ_INLINE __m256i pq_dot_i8(__m256i a_abs, __m256i a, __m256i b) {
    return pq_dpbusd(a_abs, _mm256_sign_epi8(b, a));
}
/* unsigned bytes u (<= 63) . signed bytes b, in 8 int32 lanes */
PQ_INLINE __m256i pq_dot_u8(__m256i u, __m256i b) {
    return pq_dpbusd(u, b);
}

/* Q4_0, Q5_0, Q8_0 x Q8_0: signed weights, per-block scale dx*dy, one accumulator of 8 lanes
 * (lane l: elements 4l..4l+3 of every block) in block order, as ggml's AVX2 vec_dot and llamafile's
 * tinyBLAS_Q0_AVX add them, so that every row count gives ggml's float result bit for bit. */
PQ_INLINE __m256i pq_unpack_q_0(int t, const uint8_t *w) {
    if (t == PQ_Q4_0) return _mm256_sub_epi8(pq_nibbles32(w + 2), _mm256_set1_epi8(8));
    if (t == PQ_Q5_0) {
        /* (nibble | hbit << 4) - 16 == nibble - (hbit ? 0 : 16) */
        const __m256i hb = pq_bits_to_bytes(pq_ld_u32(w + 2));
        return _mm256_sub_epi8(pq_nibbles32(w + 6), _mm256_andnot_si256(hb, _mm256_set1_epi8(16)));
    }
    return _mm256_loadu_si256((const __m256i *)(w + 2));
}
PQ_INLINE void pq_avx2_q_0(int t, int NR, int64_t nb, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    __m256 acc[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    const int wb = t == PQ_Q4_0 ? 18 : t == PQ_Q5_0 ? 22 : 34;
    int64_t i = 0;
    for (; i < nb; i++, w += wb) {
        const __m256i q = pq_unpack_q_0(t, w);
        const __m256i qa = _mm256_sign_epi8(q, q);
        const float dx = pq_h2f(w);
        for (int r = 0; r < NR; r++) {
            const uint8_t *y = x + r * xs + 34 * i;
            const __m256i p = pq_dot_i8(qa, q, _mm256_loadu_si256((const __m256i *)(y + 2)));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * pq_h2f(y)), _mm256_cvtepi32_ps(p), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) out[r] = pq_hsum256(acc[r]);
}

/* Q4_1, Q5_1 x Q8_1: unsigned weights, plus the block minimum times the activation's s */
PQ_INLINE void pq_avx2_q_1(int t, int NR, int64_t nb, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    __m256 acc[PQ_MAX_NR];
    float accm[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) { acc[r] = _mm256_setzero_ps(); accm[r] = 0.0f; }
    const int wb = t == PQ_Q4_1 ? 20 : 24;
    for (int64_t i = 0; i < nb; i++, w += wb) {
        __m256i q;
        if (t == PQ_Q4_1) {
            q = pq_nibbles32(w + 4);
        } else {
            const __m256i hb = pq_bits_to_bytes(pq_ld_u32(w + 4));
            q = _mm256_or_si256(pq_nibbles32(w + 8), _mm256_and_si256(hb, _mm256_set1_epi8(16)));
        }
        const float dx = pq_h2f(w), mx = pq_h2f(w + 2);
        for (int r = 0; r < NR; r++) {
            const uint8_t *y = x + r * xs + 36 * i;
            const __m256i p = pq_dot_u8(q, _mm256_loadu_si256((const __m256i *)(y + 4)));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * pq_h2f(y)), _mm256_cvtepi32_ps(p), acc[r]);
            accm[r] += mx * pq_h2f(y + 2);
        }
    }
    for (int r = 0; r < NR; r++) out[r] = pq_hsum256(acc[r]) + accm[r];
}

/* Q4_K, Q5_K x Q8_K */
PQ_INLINE void pq_avx2_q45_K(int five, int NR, int64_t nb, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    __m256 acc[PQ_MAX_NR];
    __m128 accm[PQ_MAX_NR];
    float summs[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) { acc[r] = _mm256_setzero_ps(); accm[r] = _mm_setzero_ps(); summs[r] = 0.0f; }
    const int wb = five ? 176 : 144;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < nb; i++, w += wb) {
        uint32_t u[4];
        memcpy(u, w + 4, 12);
        /* unpack eight 6-bit scales (u[0..1]) and mins (u[2..3]) as ggml's get_scale_min_k4 */
        u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
        const uint32_t mins_lo = u[1] & 0x3f3f3f3fu;
        u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
        u[2] = mins_lo;
        u[0] &= 0x3f3f3f3fu;
        const __m256i sm = _mm256_cvtepu8_epi16(_mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]));
        const __m128i mins = _mm256_extracti128_si256(sm, 1);
        const __m128i sc128 = _mm256_castsi256_si128(sm);
        const __m256i scales = _mm256_set_m128i(sc128, sc128);
        const float dx = pq_h2f(w), dminx = pq_h2f(w + 2);
        const uint8_t *qs = w + (five ? 48 : 16);
        const __m256i hbits = five ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
        __m256i sumi[PQ_MAX_NR];
        for (int r = 0; r < NR; r++) sumi[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(bits, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            if (five) {
                const __m256i one = _mm256_set1_epi8(1);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1), one), 4));
            }
            /* int16 broadcast of scale 2j and 2j+1 */
            const __m256i sl = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(((4 * j + 1) << 8) | (4 * j))));
            const __m256i sh = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(((4 * j + 3) << 8) | (4 * j + 2))));
            for (int r = 0; r < NR; r++) {
                const uint8_t *y = x + r * xs + 292 * i + 4 + 64 * j;
                const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)y)), sl);
                const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(y + 32))), sh);
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
            }
        }
        for (int r = 0; r < NR; r++) {
            const uint8_t *y = x + r * xs + 292 * i;
            const float yd = pq_ld_f32(y);
            const __m128i b0 = _mm_loadu_si128((const __m128i *)(y + 260));
            const __m128i b1 = _mm_loadu_si128((const __m128i *)(y + 276));
            const __m128i pm = _mm_madd_epi16(mins, _mm_hadd_epi16(b0, b1));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * yd), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            if (five)   /* ggml's Q5_K: one float term per block, the minimums' whole integer sum */
                summs[r] = fmaf(-yd * dminx, (float)pq_hsum_i32x4(pm), summs[r]);
            else        /* ggml's Q4_K: 4 float lanes */
                accm[r] = _mm_fmadd_ps(_mm_set1_ps(dminx * yd), _mm_cvtepi32_ps(pm), accm[r]);
        }
    }
    for (int r = 0; r < NR; r++) out[r] = five ? pq_hsum256(acc[r]) + summs[r] : pq_hsum256(acc[r]) - pq_hsum128(accm[r]);
}

/* Q6_K x Q8_K: q6 stored unsigned (0..63); the -32 offset is taken out once per super-block as
 * 32 * sum(scale * bsum). */
PQ_INLINE void pq_avx2_q6_K(int NR, int64_t nb, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    __m256 acc[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    for (int64_t i = 0; i < nb; i++, w += 210) {
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(w + 192));
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        const float dx = pq_h2f(w + 208);
        __m256i sumi[PQ_MAX_NR];
        for (int r = 0; r < NR; r++) sumi[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
            const __m128i s8 = _mm_cvtepi8_epi16(h ? _mm_unpackhi_epi64(sc8, sc8) : sc8);   /* 8 int16 scales of this half */
            const __m256i s16 = _mm256_set_m128i(s8, s8);
            for (int k = 0; k < 4; k++) {
                /* lanes 0..7: scale 2k of the half, lanes 8..15: scale 2k+1 */
                const __m256i sk = _mm256_shuffle_epi8(s16, _mm256_set_epi16(
                    (short)(((4 * k + 3) << 8) | (4 * k + 2)), (short)(((4 * k + 3) << 8) | (4 * k + 2)),
                    (short)(((4 * k + 3) << 8) | (4 * k + 2)), (short)(((4 * k + 3) << 8) | (4 * k + 2)),
                    (short)(((4 * k + 3) << 8) | (4 * k + 2)), (short)(((4 * k + 3) << 8) | (4 * k + 2)),
                    (short)(((4 * k + 3) << 8) | (4 * k + 2)), (short)(((4 * k + 3) << 8) | (4 * k + 2)),
                    (short)(((4 * k + 1) << 8) | (4 * k)), (short)(((4 * k + 1) << 8) | (4 * k)),
                    (short)(((4 * k + 1) << 8) | (4 * k)), (short)(((4 * k + 1) << 8) | (4 * k)),
                    (short)(((4 * k + 1) << 8) | (4 * k)), (short)(((4 * k + 1) << 8) | (4 * k)),
                    (short)(((4 * k + 1) << 8) | (4 * k)), (short)(((4 * k + 1) << 8) | (4 * k))));
                for (int r = 0; r < NR; r++) {
                    const uint8_t *y = x + r * xs + 292 * i + 4 + 128 * h + 32 * k;
                    const __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i *)y));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, sk));
                }
            }
        }
        for (int r = 0; r < NR; r++) {
            /* ggml's order: the lanes' integer sums less their lanes' offset correction, to float,
             * times d into 8 float lanes (added up once at the end) */
            const uint8_t *y = x + r * xs + 292 * i;
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(y + 260));
            const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(pq_ld_f32(y) * dx), _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi[r], corr)),
                                     acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) out[r] = pq_hsum256(acc[r]);
}

/* Q2_K x Q8_K */
PQ_INLINE void pq_avx2_q2_K(int NR, int64_t nb, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    __m256 acc[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < nb; i++, w += 84) {
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)w);
        const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc8, 4), _mm_set1_epi8(0x0F)));
        const __m128i scl = _mm_and_si128(sc8, _mm_set1_epi8(0x0F));
        const float dx = pq_h2f(w + 80), dminx = pq_h2f(w + 82);
        __m256i sumi[PQ_MAX_NR];
        for (int r = 0; r < NR; r++) sumi[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * h));
            const __m128i s8 = _mm_cvtepu8_epi16(h ? _mm_unpackhi_epi64(scl, scl) : scl);
            const __m256i s16 = _mm256_set_m128i(s8, s8);
            for (int s = 0; s < 4; s++) {
                const __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * s), m3);
                const __m256i sk = _mm256_shuffle_epi8(s16, _mm256_set_m128i(
                    _mm_set1_epi16((short)(((4 * s + 3) << 8) | (4 * s + 2))),
                    _mm_set1_epi16((short)(((4 * s + 1) << 8) | (4 * s)))));
                for (int r = 0; r < NR; r++) {
                    const uint8_t *y = x + r * xs + 292 * i + 4 + 128 * h + 32 * s;
                    const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)y));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, sk));
                }
            }
        }
        (void)m4;
        for (int r = 0; r < NR; r++) {
            const uint8_t *y = x + r * xs + 292 * i;
            const float yd = pq_ld_f32(y);
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(y + 260));
            const __m256i pm = _mm256_madd_epi16(bs, mins16);
            /* ggml's order: the minimums' lanes, then the scaled sums', into one accumulator */
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(-yd * dminx), _mm256_cvtepi32_ps(pm), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(yd * dx), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) out[r] = pq_hsum256(acc[r]);
}

/* Q3_K x Q8_K: q3 = low2 - (hbit ? 0 : 4), via maddubs(low2, q8) - maddubs(4*!hbit, q8) */
PQ_INLINE void pq_avx2_q3_K(int NR, int64_t nb, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    __m256 acc[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int64_t i = 0; i < nb; i++, w += 110) {
        int16_t scs[16];
        for (int g = 0; g < 16; g++) scs[g] = (int16_t)pq_q3_scale(w + 96, g);
        const float dx = pq_h2f(w + 108);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)w);
        __m256i sumi[PQ_MAX_NR];
        for (int r = 0; r < NR; r++) sumi[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(w + 32 + 32 * h));
            for (int s = 0; s < 4; s++) {
                const int run = 4 * h + s;   /* elements 32*run .. +31, hmask bit `run` */
                const __m256i ql = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * s), m3);
                const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, run), _mm256_set1_epi8(1));
                const __m256i qn = _mm256_slli_epi16(_mm256_xor_si256(hb, _mm256_set1_epi8(1)), 2);  /* 4 where bit clear */
                const __m256i sk = _mm256_set_m128i(_mm_set1_epi16(scs[2 * run + 1]), _mm_set1_epi16(scs[2 * run]));
                for (int r = 0; r < NR; r++) {
                    const __m256i q8 = _mm256_loadu_si256((const __m256i *)(x + r * xs + 292 * i + 4 + 32 * run));
                    const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(ql, q8), _mm256_maddubs_epi16(qn, q8));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, sk));
                }
            }
        }
        for (int r = 0; r < NR; r++) {
            const uint8_t *y = x + r * xs + 292 * i;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * pq_ld_f32(y)), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) out[r] = pq_hsum256(acc[r]);
}

/* IQ4_NL, MXFP4 x Q8_0 in ggml's AVX2 vec_dot order: each block's 16 bytes of nibbles looked up in
 * the type's 16 values (a byte shuffle) and dotted as signed bytes; even blocks go to one 8-lane
 * accumulator and odd ones to another, added lane-wise at the end and reduced, and an odd last block
 * is added after, one float term (pq_lut_tail). The repacked kernels (ggml_x8.h) keep the same steps. */
static inline float pq_lut_scale(int t, const uint8_t *w) { return t == PQ_IQ4_NL ? pq_ld_f16(w) : pq_e8m0_half(w[0]); }
static inline float pq_lut_tail(float sum, float dxy, int32_t isum) { return fmaf(dxy, (float)isum, sum); }
PQ_INLINE void pq_avx2_lut_0(int t, int NR, int64_t nb, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    const int nl = t == PQ_IQ4_NL, wb = nl ? 18 : 17, qo = nl ? 2 : 1;
    const int8_t *kv = nl ? pq_kvalues_iq4nl : pq_kvalues_mxfp4;
    const __m128i kv128 = _mm_loadu_si128((const __m128i *)kv);
    const __m256i lut = _mm256_set_m128i(kv128, kv128);
    __m256 acc1[PQ_MAX_NR], acc2[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) { acc1[r] = _mm256_setzero_ps(); acc2[r] = _mm256_setzero_ps(); }
    int64_t i = 0;
    for (; i + 1 < nb; i += 2) {
        const uint8_t *w1 = w + wb * i, *w2 = w1 + wb;
        const __m256i q1 = pq_unpack_lut(lut, w1 + qo), q2 = pq_unpack_lut(lut, w2 + qo);
        const __m256i a1 = _mm256_sign_epi8(q1, q1), a2 = _mm256_sign_epi8(q2, q2);
        const float d1 = pq_lut_scale(t, w1), d2 = pq_lut_scale(t, w2);
        for (int r = 0; r < NR; r++) {
            const uint8_t *y = x + r * xs + 34 * i;
            const __m256i p1 = pq_dot_i8(a1, q1, _mm256_loadu_si256((const __m256i *)(y + 2)));
            const __m256i p2 = pq_dot_i8(a2, q2, _mm256_loadu_si256((const __m256i *)(y + 36)));
            acc1[r] = _mm256_fmadd_ps(_mm256_set1_ps(pq_h2f(y) * d1), _mm256_cvtepi32_ps(p1), acc1[r]);
            acc2[r] = _mm256_fmadd_ps(_mm256_set1_ps(pq_h2f(y + 34) * d2), _mm256_cvtepi32_ps(p2), acc2[r]);
        }
    }
    for (int r = 0; r < NR; r++) {
        __m256 both = _mm256_add_ps(acc1[r], acc2[r]);
        PIN_VEC(both);
        out[r] = pq_hsum256(both);
        if (i < nb) {
            const uint8_t *wl = w + wb * i, *y = x + r * xs + 34 * i;
            int32_t s;
            pq_isums_lut(kv, wl + qo, y, &s);
            out[r] = pq_lut_tail(out[r], pq_h2f(y) * pq_lut_scale(t, wl), s);
        }
    }
}

/* IQ4_XS x Q8_K: per super-block, the sub-blocks' byte products (int16 pairs) times their scales
 * summed in 8 int32 lanes, then one float term per super-block, as ggml's AVX2 vec_dot. */
PQ_INLINE void pq_avx2_iq4_xs(int NR, int64_t nb, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    const __m128i kv128 = _mm_loadu_si128((const __m128i *)pq_kvalues_iq4nl);
    const __m256i lut = _mm256_set_m128i(kv128, kv128);
    __m256 acc[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++, w += 136) {
        __m256i sumi[PQ_MAX_NR];
        for (int r = 0; r < NR; r++) sumi[r] = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib++) {
            const __m256i q = pq_unpack_lut(lut, w + 8 + 16 * ib);
            const __m256i qa = _mm256_sign_epi8(q, q);
            const __m256i ls = _mm256_set1_epi16((short)pq_iq4xs_scale(w, ib));
            for (int r = 0; r < NR; r++) {
                const __m256i y = _mm256_loadu_si256((const __m256i *)(x + r * xs + 292 * i + 4 + 32 * ib));
                const __m256i p16 = _mm256_maddubs_epi16(qa, _mm256_sign_epi8(y, q));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p16, ls));
            }
        }
        const float dx = pq_h2f(w);
        for (int r = 0; r < NR; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * pq_ld_f32(x + r * xs + 292 * i)), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
    for (int r = 0; r < NR; r++) out[r] = pq_hsum256(acc[r]);
}

/* Sub-block ib of a grid IQ block as pq_iq_sub reads it, in registers: the values' magnitudes and a
 * vector whose byte signs are theirs (+-1, or the IQ1 values themselves), the halves' scales and the
 * IQ1 shifts' signs. The grid points are gathered as ggml's AVX2 code does (one 64- or 32-bit load
 * each); the sign bytes come from their bits. */
PQ_INLINE void pq_iq_sub_avx2(int t, const uint8_t *b, int ib, __m256i *mag, __m256i *sgn, int *sc, int *dl) {
    uint32_t bits = 0;
    switch (t) {
    case PQ_IQ2_XXS: {
        const uint8_t *q = b + 2 + 8 * ib;
        const uint32_t a = pq_ld_u32(q + 4);
        sc[0] = sc[1] = 2 * (int)(a >> 28) + 1;
        *mag = _mm256_set_epi64x((long long)pq_iq2xxs_grid[q[3]], (long long)pq_iq2xxs_grid[q[2]],
                                 (long long)pq_iq2xxs_grid[q[1]], (long long)pq_iq2xxs_grid[q[0]]);
        for (int l = 0; l < 4; l++) bits |= (uint32_t)pq_ksigns_iq2xs[(a >> (7 * l)) & 127] << (8 * l);
        break; }
    case PQ_IQ2_XS: {
        uint16_t q[4];
        memcpy(q, b + 2 + 8 * ib, 8);
        *mag = _mm256_set_epi64x((long long)pq_iq2xs_grid[q[3] & 511], (long long)pq_iq2xs_grid[q[2] & 511],
                                 (long long)pq_iq2xs_grid[q[1] & 511], (long long)pq_iq2xs_grid[q[0] & 511]);
        for (int l = 0; l < 4; l++) bits |= (uint32_t)pq_ksigns_iq2xs[q[l] >> 9] << (8 * l);
        sc[0] = 2 * (b[66 + ib] & 0xF) + 1;
        sc[1] = 2 * (b[66 + ib] >> 4) + 1;
        break; }
    case PQ_IQ2_S: {
        const uint8_t *q = b + 2 + 4 * ib;
        const int h = b[66 + ib];
        *mag = _mm256_set_epi64x((long long)pq_iq2s_grid[q[3] | ((h << 2) & 0x300)], (long long)pq_iq2s_grid[q[2] | ((h << 4) & 0x300)],
                                 (long long)pq_iq2s_grid[q[1] | ((h << 6) & 0x300)], (long long)pq_iq2s_grid[q[0] | ((h << 8) & 0x300)]);
        bits = pq_ld_u32(b + 34 + 4 * ib);
        sc[0] = 2 * (b[74 + ib] & 0xF) + 1;
        sc[1] = 2 * (b[74 + ib] >> 4) + 1;
        break; }
    case PQ_IQ3_XXS: {
        const uint8_t *q = b + 2 + 8 * ib;
        const uint32_t a = pq_ld_u32(b + 66 + 4 * ib);
        sc[0] = sc[1] = 2 * (int)(a >> 28) + 1;
        *mag = _mm256_set_epi32((int)pq_iq3xxs_grid[q[7]], (int)pq_iq3xxs_grid[q[6]], (int)pq_iq3xxs_grid[q[5]], (int)pq_iq3xxs_grid[q[4]],
                                (int)pq_iq3xxs_grid[q[3]], (int)pq_iq3xxs_grid[q[2]], (int)pq_iq3xxs_grid[q[1]], (int)pq_iq3xxs_grid[q[0]]);
        for (int l = 0; l < 4; l++) bits |= (uint32_t)pq_ksigns_iq2xs[(a >> (7 * l)) & 127] << (8 * l);
        break; }
    case PQ_IQ3_S: {
        const uint8_t *q = b + 2 + 8 * ib;
        const int h = b[66 + ib];
        int idx[8];
        for (int k = 0; k < 8; k++) idx[k] = q[k] | ((h << (8 - k)) & 256);
        *mag = _mm256_set_epi32((int)pq_iq3s_grid[idx[7]], (int)pq_iq3s_grid[idx[6]], (int)pq_iq3s_grid[idx[5]], (int)pq_iq3s_grid[idx[4]],
                                (int)pq_iq3s_grid[idx[3]], (int)pq_iq3s_grid[idx[2]], (int)pq_iq3s_grid[idx[1]], (int)pq_iq3s_grid[idx[0]]);
        bits = pq_ld_u32(b + 74 + 4 * ib);
        sc[0] = sc[1] = 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0xF) + 1;
        break; }
    case PQ_IQ1_S: {
        const uint16_t h = pq_ld_u16(b + 34 + 2 * ib);
        const uint8_t *q = b + 2 + 4 * ib;
        sc[0] = sc[1] = 2 * ((h >> 12) & 7) + 1;
        dl[0] = dl[1] = dl[2] = dl[3] = h & 0x8000 ? -1 : 1;
        *sgn = _mm256_set_epi64x((long long)pq_iq1s_grid[q[3] | ((h >> 1) & 0x700)], (long long)pq_iq1s_grid[q[2] | ((h << 2) & 0x700)],
                                 (long long)pq_iq1s_grid[q[1] | ((h << 5) & 0x700)], (long long)pq_iq1s_grid[q[0] | ((h << 8) & 0x700)]);
        *mag = _mm256_sign_epi8(*sgn, *sgn);
        return; }
    default: {           /* IQ1_M */
        const uint16_t s16 = pq_ld_u16(b + 48 + 2 * (ib / 2));
        const uint8_t *q = b + 4 * ib;
        const int h0 = b[32 + 2 * ib], h1 = b[33 + 2 * ib];
        sc[0] = 2 * ((s16 >> (6 * (ib % 2))) & 7) + 1;
        sc[1] = 2 * ((s16 >> (6 * (ib % 2) + 3)) & 7) + 1;
        dl[0] = h0 & 0x08 ? -1 : 1; dl[1] = h0 & 0x80 ? -1 : 1; dl[2] = h1 & 0x08 ? -1 : 1; dl[3] = h1 & 0x80 ? -1 : 1;
        *sgn = _mm256_set_epi64x((long long)pq_iq1s_grid[q[3] | ((h1 << 4) & 0x700)], (long long)pq_iq1s_grid[q[2] | ((h1 << 8) & 0x700)],
                                 (long long)pq_iq1s_grid[q[1] | ((h0 << 4) & 0x700)], (long long)pq_iq1s_grid[q[0] | ((h0 << 8) & 0x700)]);
        *mag = _mm256_sign_epi8(*sgn, *sgn);
        return; }
    }
    *sgn = _mm256_or_si256(pq_bits_to_bytes(bits), _mm256_set1_epi8(1));   /* -1 where the bit is set, else 1 */
}

/* One activation row (batch-1 decode): the per-sub-block decode that pq_avx2_iq shares between rows
 * costs more than the product itself here, so these kernels build the weights in registers two
 * sub-blocks at a time, as ggml's AVX2 vec_dot does, without branches on the sign bits (random,
 * hence mispredicted). The int32 lanes hold the same exact sums as pq_avx2_iq's and the float steps
 * are its own, so every result is bit-identical to the shared kernel's. */
#if defined(__BMI2__)
/* Four 11-bit IQ1 grid indices: 4 low bytes and their high bits, 3 per index (IQ1_S packs them
 * contiguously, IQ1_M keeps a 4-bit nibble per index whose top bit is the delta sign) */
#define PQ_IQ1_IDX(lo, hi, hmask, hdep) (_pdep_u64((lo), 0x00FF00FF00FF00FFULL) | _pdep_u64((hi) & (hmask), (hdep)))
#else
static inline uint64_t pq_iq1_idx_sw(uint32_t lo, uint32_t hi, int nib) {
    uint64_t r = 0;
    for (int k = 0; k < 4; k++) r |= (uint64_t)(((lo >> (8 * k)) & 0xFF) | (((hi >> ((nib ? 4 : 3) * k)) & 7) << 8)) << (16 * k);
    return r;
}
#define PQ_IQ1_IDX(lo, hi, hmask, hdep) pq_iq1_idx_sw((lo), (hi), (hmask) == 0x7777)
#endif
PQ_INLINE __m256i pq_iq1_grid4(uint64_t idx) {
    return _mm256_set_epi64x((long long)pq_iq1s_grid[idx >> 48], (long long)pq_iq1s_grid[(idx >> 32) & 0xFFFF],
                             (long long)pq_iq1s_grid[(idx >> 16) & 0xFFFF], (long long)pq_iq1s_grid[idx & 0xFFFF]);
}
/* grid values (-1 / 0 / 1) . activations, int16 pairs */
PQ_INLINE __m256i pq_iq1_mul16(__m256i g, __m256i y) { return _mm256_maddubs_epi16(_mm256_sign_epi8(g, g), _mm256_sign_epi8(y, g)); }

PQ_INLINE void pq_avx2_iq1_m_1(int64_t nb, const uint8_t *w, const uint8_t *x, float *out) {
    const __m256i mask7 = _mm256_set1_epi16(7), one16 = _mm256_set1_epi16(1), ones = _mm256_set1_epi8(1);
    /* the 16 3-bit scales as int16 words: lane half 0 (low 128 bits) the first halves' scales, lane
     * half 1 the second halves', even sub-blocks in words 0..3, odd in 4..7 (pshufb stays in a lane) */
    const __m256i shift = _mm256_set_epi64x(9, 3, 6, 0);
    __m256 acc = _mm256_setzero_ps(), accd = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++, w += 56, x += 292) {
        uint64_t s64;
        memcpy(&s64, w + 48, 8);
        __m256i scales = _mm256_srlv_epi64(_mm256_set1_epi64x((long long)s64), shift);
        scales = _mm256_add_epi16(_mm256_slli_epi16(_mm256_and_si256(scales, mask7), 1), one16);
        __m256i sidx1 = _mm256_set1_epi16(0x0100), sidx2 = _mm256_set1_epi16(0x0908);
        __m256i sumi = _mm256_setzero_si256(), sumd = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib += 2) {
            uint32_t q0, q1, h;
            memcpy(&q0, w + 4 * ib, 4);
            memcpy(&q1, w + 4 * ib + 4, 4);
            memcpy(&h, w + 32 + 2 * ib, 4);
            const __m256i g1 = pq_iq1_grid4(PQ_IQ1_IDX(q0, h & 0xFFFF, 0x7777, 0x0F000F000F000F00ULL));
            const __m256i g2 = pq_iq1_grid4(PQ_IQ1_IDX(q1, h >> 16, 0x7777, 0x0F000F000F000F00ULL));
            /* byte k of ds: 0x80 where group k's delta is negative; spread to its 8 bytes' signs */
#if defined(__BMI2__)
            const uint64_t ds = _pdep_u64(h & 0x88888888u, 0xF0F0F0F0F0F0F0F0ULL);
#else
            uint64_t ds = 0;
            for (int k = 0; k < 8; k++) ds |= (uint64_t)((h >> (4 * k + 3)) & 1) << (8 * k + 7);
#endif
            const __m256i dv1 = _mm256_or_si256(ones, _mm256_cvtepi8_epi64(_mm_cvtsi32_si128((int)(uint32_t)ds)));
            const __m256i dv2 = _mm256_or_si256(ones, _mm256_cvtepi8_epi64(_mm_cvtsi32_si128((int)(uint32_t)(ds >> 32))));
            const __m256i y1 = _mm256_loadu_si256((const __m256i *)(x + 4 + 32 * ib));
            const __m256i y2 = _mm256_loadu_si256((const __m256i *)(x + 36 + 32 * ib));
            const __m256i sc1 = _mm256_shuffle_epi8(scales, sidx1), sc2 = _mm256_shuffle_epi8(scales, sidx2);
            sidx1 = _mm256_add_epi8(sidx1, _mm256_set1_epi8(2));
            sidx2 = _mm256_add_epi8(sidx2, _mm256_set1_epi8(2));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_madd_epi16(pq_iq1_mul16(g1, y1), sc1),
                                                           _mm256_madd_epi16(pq_iq1_mul16(g2, y2), sc2)));
            sumd = _mm256_add_epi32(sumd, _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(ones, _mm256_sign_epi8(y1, dv1)), sc1),
                                                           _mm256_madd_epi16(_mm256_maddubs_epi16(ones, _mm256_sign_epi8(y2, dv2)), sc2)));
        }
        const float d = pq_iq_d(PQ_IQ1_M, w) * pq_ld_f32(x);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
        accd = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumd), accd);
    }
    out[0] = pq_hsum256(acc) + 0.125f * pq_hsum256(accd);
}

PQ_INLINE void pq_avx2_iq1_s_1(int64_t nb, const uint8_t *w, const uint8_t *x, float *out) {
    const __m128i mask7 = _mm_set1_epi16(7), one16 = _mm_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    float acc1 = 0.0f;
    for (int64_t i = 0; i < nb; i++, w += 50, x += 292) {
        /* the 8 scales as int16 words, and signed by their deltas, each twice to meet the activations'
         * 16-element sums: the deltas' whole sum is one madd and a horizontal add */
        const __m128i h128 = _mm_loadu_si128((const __m128i *)(w + 34));
        const __m128i sc = _mm_add_epi16(_mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h128, 12), mask7), 1), one16);
        const __m128i neg = _mm_srai_epi16(h128, 15);
        const __m128i ss = _mm_sub_epi16(_mm_xor_si128(sc, neg), neg);
        const __m256i dsum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(x + 260)),
                                               _mm256_set_m128i(_mm_unpackhi_epi16(ss, ss), _mm_unpacklo_epi16(ss, ss)));
        __m128i d4 = _mm_add_epi32(_mm256_castsi256_si128(dsum), _mm256_extracti128_si256(dsum, 1));
        d4 = _mm_add_epi32(d4, _mm_shuffle_epi32(d4, 0x4E));
        d4 = _mm_add_epi32(d4, _mm_shuffle_epi32(d4, 0xB1));
        const int32_t sd = _mm_cvtsi128_si32(d4);
        const __m256i scales = _mm256_set_m128i(sc, sc);
        __m256i sidx1 = _mm256_set1_epi16(0x0100), sidx2 = _mm256_set1_epi16(0x0302);
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib += 2) {
            uint32_t q0, q1, h;
            memcpy(&q0, w + 2 + 4 * ib, 4);
            memcpy(&q1, w + 6 + 4 * ib, 4);
            memcpy(&h, w + 34 + 2 * ib, 4);
            const __m256i g1 = pq_iq1_grid4(PQ_IQ1_IDX(q0, h & 0xFFFF, 0xFFF, 0x0700070007000700ULL));
            const __m256i g2 = pq_iq1_grid4(PQ_IQ1_IDX(q1, h >> 16, 0xFFF, 0x0700070007000700ULL));
            const __m256i y1 = _mm256_loadu_si256((const __m256i *)(x + 4 + 32 * ib));
            const __m256i y2 = _mm256_loadu_si256((const __m256i *)(x + 36 + 32 * ib));
            const __m256i sc1 = _mm256_shuffle_epi8(scales, sidx1), sc2 = _mm256_shuffle_epi8(scales, sidx2);
            sidx1 = _mm256_add_epi8(sidx1, _mm256_set1_epi8(4));
            sidx2 = _mm256_add_epi8(sidx2, _mm256_set1_epi8(4));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_madd_epi16(pq_iq1_mul16(g1, y1), sc1),
                                                           _mm256_madd_epi16(pq_iq1_mul16(g2, y2), sc2)));
        }
        const float d = pq_iq_d(PQ_IQ1_S, w) * pq_ld_f32(x);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
        acc1 = fmaf(d, (float)sd, acc1);
    }
    out[0] = pq_hsum256(acc) + 0.125f * acc1;
}

/* The sign bytes of 4 groups of 8 (one byte each, in bytes 0, 2, 4, 6 of the 128-bit half s2) spread
 * to the groups' 32 bytes as +-1 */
PQ_INLINE __m256i pq_iq_signs4(__m128i s2, __m256i shuf) {
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set_m128i(s2, s2), shuf), bit);
    return _mm256_or_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(1));
}
PQ_INLINE void pq_avx2_iq2_xs_1(int64_t nb, const uint8_t *w, const uint8_t *x, float *out) {
    /* 0x80 where a nibble's parity is odd: the 8th sign bit of a group (ksigns_iq2xs) is the parity of
     * its 7 stored bits, and b0..b3 ^ b4..b6 has that parity */
    const __m256i parity = _mm256_set_epi64x(0x0080800080000080LL, (long long)0x8000008000808000ULL,
                                             0x0080800080000080LL, (long long)0x8000008000808000ULL);
    const __m256i m511 = _mm256_set1_epi16(511);
    const __m256i shuf1 = _mm256_set_epi64x(0x0606060606060606LL, 0x0404040404040404LL, 0x0202020202020202LL, 0);
    const __m256i shuf2 = _mm256_set_epi64x(0x0E0E0E0E0E0E0E0ELL, 0x0C0C0C0C0C0C0C0CLL, 0x0A0A0A0A0A0A0A0ALL, 0x0808080808080808LL);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++, w += 74, x += 292) {
        /* int16 words: lane half 0 sub-block ib's first half's scale in word ib, half 1 its second's */
        uint64_t a64;
        memcpy(&a64, w + 66, 8);
        const __m128i s8 = _mm_and_si128(_mm_set_epi64x((long long)(a64 >> 4), (long long)a64), _mm_set1_epi8(0xF));
        const __m256i scales = _mm256_cvtepi8_epi16(_mm_add_epi8(_mm_add_epi8(s8, s8), _mm_set1_epi8(1)));
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib += 4) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2 + 8 * ib));
            uint16_t gi[16];
            _mm256_storeu_si256((__m256i *)gi, _mm256_and_si256(q, m511));
            const __m256i s7 = _mm256_srli_epi16(q, 9);
            const __m256i sg = _mm256_or_si256(s7, _mm256_shuffle_epi8(parity, _mm256_xor_si256(s7, _mm256_srli_epi16(q, 13))));
            const __m128i sgl = _mm256_castsi256_si128(sg), sgh = _mm256_extracti128_si256(sg, 1);
            const __m256i sn[4] = {pq_iq_signs4(sgl, shuf1), pq_iq_signs4(sgl, shuf2), pq_iq_signs4(sgh, shuf1), pq_iq_signs4(sgh, shuf2)};
            for (int k = 0; k < 4; k++) {
                const __m256i g = _mm256_set_epi64x((long long)pq_iq2xs_grid[gi[4 * k + 3]], (long long)pq_iq2xs_grid[gi[4 * k + 2]],
                                                    (long long)pq_iq2xs_grid[gi[4 * k + 1]], (long long)pq_iq2xs_grid[gi[4 * k]]);
                const __m256i y = _mm256_loadu_si256((const __m256i *)(x + 4 + 32 * (ib + k)));
                const __m256i sc = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (ib + k))));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(g, _mm256_sign_epi8(y, sn[k])), sc));
            }
        }
        const float d = pq_iq_d(PQ_IQ2_XS, w) * pq_ld_f32(x);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    out[0] = 0.125f * pq_hsum256(acc);
}

/* IQ2_S and IQ3_S: a byte of sign bits per group of 8 stored as is, grid indices with high bits
 * in qh. Per sub-block one pshufb picks its halves' scales from a vector of all 16. */
PQ_INLINE void pq_avx2_iq23_s_1(int t, int64_t nb, const uint8_t *w, const uint8_t *x, float *out) {
    const int iq3 = t == PQ_IQ3_S;
    const __m128i m4 = _mm_set1_epi8(0xF), m1 = _mm_set1_epi8(1);
    const __m256i ones = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++, w += iq3 ? 110 : 82, x += 292) {
        __m256i scales;   /* int16 words: lane half 0 sub-block ib's first half's scale in word ib, half 1 its second's */
        if (iq3) {
            uint32_t s32;
            memcpy(&s32, w + 106, 4);
            const __m128i s = _mm_cvtsi32_si128((int)s32);
            const __m128i s8 = _mm_unpacklo_epi8(_mm_and_si128(s, m4), _mm_and_si128(_mm_srli_epi16(s, 4), m4));
            scales = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_add_epi8(_mm_add_epi8(s8, s8), m1)));
        } else {
            uint64_t a64;
            memcpy(&a64, w + 74, 8);
            const __m128i s8 = _mm_and_si128(_mm_set_epi64x((long long)(a64 >> 4), (long long)a64), m4);
            scales = _mm256_cvtepi8_epi16(_mm_add_epi8(_mm_add_epi8(s8, s8), m1));
        }
        __m256i sidx = _mm256_set1_epi16(0x0100);
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib++) {
            const int h = w[66 + ib];
            __m256i g;
            uint32_t bits;
            if (iq3) {
                uint64_t q8b;
                memcpy(&q8b, w + 2 + 8 * ib, 8);
#if defined(__BMI2__)
                const uint64_t i0 = _pdep_u64(q8b, 0x00FF00FF00FF00FFULL) | _pdep_u64((uint64_t)h, 0x0100010001000100ULL);
                const uint64_t i1 = _pdep_u64(q8b >> 32, 0x00FF00FF00FF00FFULL) | _pdep_u64((uint64_t)h >> 4, 0x0100010001000100ULL);
#else
                uint64_t i0 = 0, i1 = 0;
                for (int k = 0; k < 4; k++) {
                    i0 |= (uint64_t)(((q8b >> (8 * k)) & 0xFF) | (((h >> k) & 1) << 8)) << (16 * k);
                    i1 |= (uint64_t)(((q8b >> (8 * k + 32)) & 0xFF) | (((h >> (k + 4)) & 1) << 8)) << (16 * k);
                }
#endif
                g = _mm256_set_epi32((int)pq_iq3s_grid[i1 >> 48], (int)pq_iq3s_grid[(i1 >> 32) & 0xFFFF], (int)pq_iq3s_grid[(i1 >> 16) & 0xFFFF],
                                     (int)pq_iq3s_grid[i1 & 0xFFFF], (int)pq_iq3s_grid[i0 >> 48], (int)pq_iq3s_grid[(i0 >> 32) & 0xFFFF],
                                     (int)pq_iq3s_grid[(i0 >> 16) & 0xFFFF], (int)pq_iq3s_grid[i0 & 0xFFFF]);
                memcpy(&bits, w + 74 + 4 * ib, 4);
            } else {
                uint32_t q4;
                memcpy(&q4, w + 2 + 4 * ib, 4);
#if defined(__BMI2__)
                const uint64_t i0 = _pdep_u64(q4, 0x00FF00FF00FF00FFULL) | _pdep_u64((uint64_t)h, 0x0300030003000300ULL);
#else
                uint64_t i0 = 0;
                for (int k = 0; k < 4; k++) i0 |= (uint64_t)(((q4 >> (8 * k)) & 0xFF) | (((h >> (2 * k)) & 3) << 8)) << (16 * k);
#endif
                g = _mm256_set_epi64x((long long)pq_iq2s_grid[i0 >> 48], (long long)pq_iq2s_grid[(i0 >> 32) & 0xFFFF],
                                      (long long)pq_iq2s_grid[(i0 >> 16) & 0xFFFF], (long long)pq_iq2s_grid[i0 & 0xFFFF]);
                memcpy(&bits, w + 34 + 4 * ib, 4);
            }
            const __m256i sg = _mm256_or_si256(pq_bits_to_bytes(bits), ones);
            const __m256i y = _mm256_loadu_si256((const __m256i *)(x + 4 + 32 * ib));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(g, _mm256_sign_epi8(y, sg)), _mm256_shuffle_epi8(scales, sidx)));
            sidx = _mm256_add_epi8(sidx, _mm256_set1_epi8(2));
        }
        const float d = pq_iq_d(t, w) * pq_ld_f32(x);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    out[0] = iq3 ? pq_hsum256(acc) : 0.125f * pq_hsum256(acc);
}

/* IQ2_XXS and IQ3_XXS: a u32 per sub-block of 4 7-bit sign fields and the scale. The fields go to
 * 4 bytes by one pdep and get their 8th (parity) bit from a nibble-parity pshufb, in place of 4
 * ksigns lookups assembled by shifts. */
PQ_INLINE void pq_avx2_iq_xxs_1(int t, int64_t nb, const uint8_t *w, const uint8_t *x, float *out) {
    const int iq3 = t == PQ_IQ3_XXS;
    const __m128i parity = _mm_set_epi64x(0x0080800080000080LL, (long long)0x8000008000808000ULL);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL), ones = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++, w += iq3 ? 98 : 66, x += 292) {
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q = w + 2 + 8 * ib;
            const uint32_t a = pq_ld_u32(iq3 ? w + 66 + 4 * ib : q + 4);
            __m256i g;
            if (iq3)
                g = _mm256_set_epi32((int)pq_iq3xxs_grid[q[7]], (int)pq_iq3xxs_grid[q[6]], (int)pq_iq3xxs_grid[q[5]], (int)pq_iq3xxs_grid[q[4]],
                                     (int)pq_iq3xxs_grid[q[3]], (int)pq_iq3xxs_grid[q[2]], (int)pq_iq3xxs_grid[q[1]], (int)pq_iq3xxs_grid[q[0]]);
            else
                g = _mm256_set_epi64x((long long)pq_iq2xxs_grid[q[3]], (long long)pq_iq2xxs_grid[q[2]],
                                      (long long)pq_iq2xxs_grid[q[1]], (long long)pq_iq2xxs_grid[q[0]]);
#if defined(__BMI2__)
            const uint32_t s7 = _pdep_u32(a, 0x7F7F7F7Fu);
#else
            const uint32_t s7 = (a & 0x7F) | ((a << 1) & 0x7F00) | ((a << 2) & 0x7F0000) | ((a << 3) & 0x7F000000);
#endif
            __m128i v = _mm_cvtsi32_si128((int)s7);
            v = _mm_or_si128(v, _mm_shuffle_epi8(parity, _mm_xor_si128(v, _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0xF)))));
            const __m256i sb = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(v), shuf), bit);
            const __m256i sg = _mm256_or_si256(_mm256_cmpeq_epi8(sb, bit), ones);
            const __m256i y = _mm256_loadu_si256((const __m256i *)(x + 4 + 32 * ib));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(g, _mm256_sign_epi8(y, sg)),
                                                            _mm256_set1_epi16((short)(2 * (int)(a >> 28) + 1))));
        }
        const float d = pq_iq_d(t, w) * pq_ld_f32(x);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    out[0] = iq3 ? 0.25f * pq_hsum256(acc) : 0.125f * pq_hsum256(acc);
}

/* Grid IQ types x Q8_K in the steps of pq_dot1_iq (ggml's AVX2 vec_dot): each sub-block decoded once
 * (pq_iq_sub_avx2) for the NR rows; its values' magnitudes times the activations signed by them (int16
 * pairs, at most 2 * 62 * 127), times the halves' scales, summed in 8 int32 lanes. */
PQ_INLINE void pq_avx2_iq(int t, int NR, int64_t nb, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    if (NR == 1 && t == PQ_IQ1_M) { pq_avx2_iq1_m_1(nb, w, x, out); return; }
    if (NR == 1 && t == PQ_IQ1_S) { pq_avx2_iq1_s_1(nb, w, x, out); return; }
    if (NR == 1 && t == PQ_IQ2_XS) { pq_avx2_iq2_xs_1(nb, w, x, out); return; }
    if (NR == 1 && (t == PQ_IQ2_S || t == PQ_IQ3_S)) { pq_avx2_iq23_s_1(t, nb, w, x, out); return; }
    if (NR == 1 && (t == PQ_IQ2_XXS || t == PQ_IQ3_XXS)) { pq_avx2_iq_xxs_1(t, nb, w, x, out); return; }
    pq_traits tr;
    pq_get_traits(t, &tr);
    const __m256i ones = _mm256_set1_epi8(1);
    __m256 acc[PQ_MAX_NR], accd[PQ_MAX_NR];
    float acc1[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) { acc[r] = _mm256_setzero_ps(); accd[r] = _mm256_setzero_ps(); acc1[r] = 0.0f; }
    for (int64_t i = 0; i < nb; i++, w += tr.bytes) {
        __m256i sumi[PQ_MAX_NR], sumd[PQ_MAX_NR];
        int32_t sd[PQ_MAX_NR];
        for (int r = 0; r < NR; r++) { sumi[r] = _mm256_setzero_si256(); sumd[r] = _mm256_setzero_si256(); sd[r] = 0; }
        for (int ib = 0; ib < 8; ib++) {
            __m256i qa, q;
            int sc[2], dl[4] = {0, 0, 0, 0};
            pq_iq_sub_avx2(t, w, ib, &qa, &q, sc, dl);
            const __m256i scv = _mm256_set_m128i(_mm_set1_epi16((short)sc[1]), _mm_set1_epi16((short)sc[0]));
            const __m256i dv = _mm256_set_epi64x(dl[3] < 0 ? -1LL : 0x0101010101010101LL, dl[2] < 0 ? -1LL : 0x0101010101010101LL,
                                                 dl[1] < 0 ? -1LL : 0x0101010101010101LL, dl[0] < 0 ? -1LL : 0x0101010101010101LL);
            for (int r = 0; r < NR; r++) {
                const uint8_t *y = x + r * xs + 292 * i;
                const __m256i y8 = _mm256_loadu_si256((const __m256i *)(y + 4 + 32 * ib));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(qa, _mm256_sign_epi8(y8, q)), scv));
                if (t == PQ_IQ1_M)
                    sumd[r] = _mm256_add_epi32(sumd[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ones, _mm256_sign_epi8(y8, dv)), scv));
                if (t == PQ_IQ1_S)
                    sd[r] += (pq_ld_i16(y + 260 + 4 * ib) + pq_ld_i16(y + 262 + 4 * ib)) * dl[0] * sc[0];
            }
        }
        const float dw = pq_iq_d(t, w);
        for (int r = 0; r < NR; r++) {
            const float d = dw * pq_ld_f32(x + r * xs + 292 * i);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            if (t == PQ_IQ1_M) accd[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumd[r]), accd[r]);
            if (t == PQ_IQ1_S) acc1[r] = fmaf(d, (float)sd[r], acc1[r]);
        }
    }
    for (int r = 0; r < NR; r++) {
        const float sum = pq_hsum256(acc[r]);
        switch (t) {
        case PQ_IQ3_S: out[r] = sum; break;
        case PQ_IQ3_XXS: out[r] = 0.25f * sum; break;
        case PQ_IQ1_S: out[r] = sum + 0.125f * acc1[r]; break;
        case PQ_IQ1_M: out[r] = sum + 0.125f * pq_hsum256(accd[r]); break;
        default: out[r] = 0.125f * sum; break;
        }
    }
}

/* TQ1_0 / TQ2_0 x Q8_K in the steps of pq_dot1_tq: a block's 256 digits unpacked once into 8 vectors of
 * 32 (pq_tq_digits' order) for the NR rows, each left in place in its byte: TQ1_0's digit as the top
 * two bits (digit * 64), TQ2_0's as the field it has (digit * 4^l for chunk 4h + l), which spares a
 * shift per vector; the exact sums are divided back once per row. That needs VNNI's dpbusd (products
 * up to 192 * 128 would saturate maddubs' int16 pairs): without it the digits are shifted down.
 * digits . q_x by dpbusd (lane l: elements 4l .. 4l + 3 of each 32), less the bsums pairs, fused into 8
 * float lanes per row. */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define PQ_TQ_SCALED 1
#else
#define PQ_TQ_SCALED 0
#endif
PQ_INLINE __m256i pq_trit64_avx2(__m256i q) {   /* per byte: 64 * ((3 q) >> 8) (>> 6 without PQ_TQ_SCALED) */
    q = _mm256_subs_epu8(q, _mm256_set1_epi8(1));
    q = _mm256_avg_epu8(q, _mm256_avg_epu8(q, _mm256_setzero_si256()));
    if (!PQ_TQ_SCALED) return _mm256_and_si256(_mm256_srli_epi16(q, 6), _mm256_set1_epi8(3));
    return _mm256_and_si256(q, _mm256_set1_epi8((char)0xC0));
}
PQ_INLINE __m256i pq_mul9_u8(__m256i q) {     /* per byte: 9 q mod 256 */
    return _mm256_add_epi8(_mm256_and_si256(_mm256_slli_epi16(q, 3), _mm256_set1_epi8((char)0xF8)), q);
}
PQ_INLINE void pq_tq_digits_avx2(int t, const uint8_t *b, __m256i *u) {
    if (t == PQ_TQ2_0) {
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 * h));
            for (int l = 0; l < 4; l++)
                u[4 * h + l] = PQ_TQ_SCALED ? _mm256_and_si256(q, _mm256_set1_epi8((char)(3 << (2 * l))))
                                            : _mm256_and_si256(_mm256_srli_epi16(q, 2 * l), _mm256_set1_epi8(3));
        }
        return;
    }
    const __m256i q1 = _mm256_loadu_si256((const __m256i *)b);
    const __m256i q3 = _mm256_add_epi8(q1, _mm256_add_epi8(q1, q1)), q9 = pq_mul9_u8(q1);
    u[0] = pq_trit64_avx2(q1);
    u[1] = pq_trit64_avx2(q3);
    u[2] = pq_trit64_avx2(q9);
    u[3] = pq_trit64_avx2(pq_mul9_u8(q3));
    u[4] = pq_trit64_avx2(pq_mul9_u8(q9));
    /* qs[32..47] times 1, 3 | 9, 27 | 81, then qh's 4 bytes times 1, 3, 9, 27 */
    const __m256i r1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + 32)));
    const __m256i r3 = _mm256_add_epi8(r1, _mm256_add_epi8(r1, r1)), r9 = pq_mul9_u8(r1), r27 = pq_mul9_u8(r3);
    const __m256i h = _mm256_and_si256(_mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm_set1_epi32((int)pq_ld_u32(b + 48))),
                                                          _mm256_set_epi16(27, 27, 27, 27, 9, 9, 9, 9, 3, 3, 3, 3, 1, 1, 1, 1)),
                                       _mm256_set1_epi16(0xFF));
    const __m128i hb = _mm_packus_epi16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    u[5] = pq_trit64_avx2(_mm256_blend_epi32(r1, r3, 0xF0));
    u[6] = pq_trit64_avx2(_mm256_blend_epi32(r9, r27, 0xF0));
    u[7] = pq_trit64_avx2(_mm256_set_m128i(hb, _mm256_castsi256_si128(pq_mul9_u8(r9))));
}
PQ_INLINE void pq_avx2_tq(int t, int NR, int64_t nb, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    const int bytes = t == PQ_TQ1_0 ? 54 : 66;
    const __m256i ones16 = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
    __m256 acc[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++, w += bytes) {
        __m256i u[8];
        pq_tq_digits_avx2(t, w, u);
        const float dw = pq_h2f(w + bytes - 2);
        for (int r = 0; r < NR; r++) {
            const uint8_t *y = x + r * xs + 292 * i;
            __m256i yc[8];
            for (int c = 0; c < 8; c++) yc[c] = _mm256_loadu_si256((const __m256i *)(y + 4 + 32 * c));
            __m256i sumi = _mm256_sub_epi32(zero, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(y + 260)), ones16));
            if (t == PQ_TQ1_0) {   /* two chains, so that one row does not wait on each dpbusd's latency */
                __m256i s0 = zero, s1 = zero;
                for (int c = 0; c < 8; c += 2) { s0 = pq_dpbusd_acc(s0, u[c], yc[c]); s1 = pq_dpbusd_acc(s1, u[c + 1], yc[c + 1]); }
                sumi = _mm256_add_epi32(sumi, _mm256_srai_epi32(_mm256_add_epi32(s0, s1), PQ_TQ_SCALED ? 6 : 0));
            } else {               /* a chain per field position l, divided by its 4^l */
                for (int l = 0; l < 4; l++)
                    sumi = _mm256_add_epi32(sumi, _mm256_srai_epi32(pq_dpbusd_acc(pq_dpbusd(u[l], yc[l]), u[4 + l], yc[4 + l]),
                                                                    PQ_TQ_SCALED ? 2 * l : 0));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(pq_ld_f32(y) * dw), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) out[r] = pq_hsum256(acc[r]);
}

/* F16 / BF16 / F32 weights with activations of the same type: products exact in float32 for
 * the 16-bit types, FMA accumulation in 8 lanes. The activations may also come widened to F32
 * (xt = PQ_F32: the same values, rounded to the weight's type once and stored as floats), which
 * spares converting each activation row again for every weight row; the sums are identical. */
PQ_INLINE __m256 pq_ld8(int t, const uint8_t *p) {
    if (t == PQ_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (t == PQ_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}
PQ_INLINE void pq_avx2_float(int t, int xt, int NR, int64_t n, const uint8_t *w, const uint8_t *x, size_t xs,
                             float *out) {
    const int es = t == PQ_F32 ? 4 : 2, xes = xt == PQ_F32 ? 4 : 2;
    __m256 acc[PQ_MAX_NR][2];
    for (int r = 0; r < NR; r++) { acc[r][0] = _mm256_setzero_ps(); acc[r][1] = _mm256_setzero_ps(); }
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 w0 = pq_ld8(t, w + es * i), w1 = pq_ld8(t, w + es * (i + 8));
        for (int r = 0; r < NR; r++) {
            acc[r][0] = _mm256_fmadd_ps(w0, pq_ld8(xt, x + r * xs + xes * i), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, pq_ld8(xt, x + r * xs + xes * (i + 8)), acc[r][1]);
        }
    }
    for (int r = 0; r < NR; r++) {
        float s = pq_hsum256(_mm256_add_ps(acc[r][0], acc[r][1]));
        const uint8_t *y = x + r * xs;
        for (int64_t j = i; j < n; j++) {
            float a, b;
            if (t == PQ_F16) { a = pq_ld_f16(w + 2 * j); b = xt == PQ_F32 ? pq_ld_f32(y + 4 * j) : pq_ld_f16(y + 2 * j); }
            else if (t == PQ_BF16) {
                uint16_t u, v; memcpy(&u, w + 2 * j, 2); a = pq_bf16_to_f32(u);
                if (xt == PQ_F32) b = pq_ld_f32(y + 4 * j); else { memcpy(&v, y + 2 * j, 2); b = pq_bf16_to_f32(v); }
            }
            else { a = pq_ld_f32(w + 4 * j); b = pq_ld_f32(y + 4 * j); }
            s += a * b;
        }
        out[r] = s;
    }
}

#if defined(__AVX512F__)
/* F16 weights against activations rounded to F16 (widened to floats), in ggml's float steps on an
 * AVX-512 machine: ggml_vec_dot_f16 (4 accumulators of 16 lanes over steps of 64 elements, added
 * 0+2, 1+3, then together, reduced, then the n % 64 tail's products added in double), llama.cpp's
 * form for a product of one activation row (pq_avx512_f16_tiny below is its form for several). */
PQ_INLINE void pq_avx512_f16(int NR, int64_t n, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    __m512 acc[PQ_MAX_NR][4];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    const int64_t np = n & ~(int64_t)63;
    for (int64_t i = 0; i < np; i += 64)
        for (int j = 0; j < 4; j++) {   /* each weight vector once for the NR rows */
            const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 2 * (i + 16 * j))));
            for (int r = 0; r < NR; r++)
                acc[r][j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps((const float *)(x + r * xs) + i + 16 * j), acc[r][j]);
        }
    for (int r = 0; r < NR; r++) {
        const float *y = (const float *)(x + r * xs);
        __m512 a02 = _mm512_add_ps(acc[r][0], acc[r][2]), a13 = _mm512_add_ps(acc[r][1], acc[r][3]);
        PIN_VEC(a02);
        PIN_VEC(a13);
        __m512 t = _mm512_add_ps(a02, a13);
        PIN_VEC(t);
        double sum = (double)pinned_reduce16(t);
        for (int64_t j = np; j < n; j++) sum += (double)(pq_ld_f16(w + 2 * j) * y[j]);
        out[r] = (float)sum;
    }
}

/* llamafile's tinyBLAS on AVX-512, llama.cpp's form for products of two activation rows or more
 * (pq_tiny_form says when it applies): per output one accumulator of PQ_TINY_KN lanes' fused steps in
 * order, then reduced as _mm512_reduce_add_ps. F16 steps 16 elements; BF16 steps 32 elements as
 * dot-product pairs (vdpbf16ps) where the machine has them, else 16 widened elements. The activation
 * rows come rounded to the weight's type and widened to floats. */
PQ_INLINE void pq_avx512_f16_tiny(int NR, int64_t n, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    __m512 acc[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 2 * i)));
        for (int r = 0; r < NR; r++) acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps((const float *)(x + r * xs) + i), acc[r]);
    }
    for (int r = 0; r < NR; r++) out[r] = pinned_reduce16(acc[r]);
}

/* ggml_vec_dot_bf16's end: its two accumulators reduced and added in double, then the tail's
 * float products from element np on, in double */
PQ_INLINE void pq_bf16_finish(int NR, const __m512 *c1, const __m512 *c2, int64_t np, int64_t n, const uint8_t *w,
                              const uint8_t *x, size_t xs, float *out) {
    for (int r = 0; r < NR; r++) {
        const float *y = (const float *)(x + r * xs);
        double sum = 0;
        sum += (double)pinned_reduce16(c1[r]);
        sum += (double)pinned_reduce16(c2[r]);
        for (int64_t j = np; j < n; j++) { uint16_t u; memcpy(&u, w + 2 * j, 2); sum += (double)(pq_bf16_to_f32(u) * y[j]); }
        out[r] = (float)sum;
    }
}

#if defined(__AVX512BF16__)
#define PQ_BF16_TINY_KN 32
/* 32 widened BF16 activations back to BF16 pairs (exact: they are BF16 values) */
PQ_INLINE __m512bh pq_bh32(const float *y) { return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(y + 16), _mm512_loadu_ps(y)); }
/* ggml_vec_dot_bf16 with vdpbf16ps: two accumulators over steps of 64 (elements 0-31 and 32-63 of
 * each step), each reduced and added in double, then the n % 64 tail's float products in double */
PQ_INLINE void pq_avx512_bf16(int NR, int64_t n, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    __m512 c1[PQ_MAX_NR], c2[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) { c1[r] = _mm512_setzero_ps(); c2[r] = _mm512_setzero_ps(); }
    const int64_t np = n & ~(int64_t)63;
    for (int64_t i = 0; i < np; i += 64) {
        const __m512bh w1 = (__m512bh)_mm512_loadu_ps((const float *)(w + 2 * i));
        const __m512bh w2 = (__m512bh)_mm512_loadu_ps((const float *)(w + 2 * (i + 32)));
        for (int r = 0; r < NR; r++) {
            const float *y = (const float *)(x + r * xs) + i;
            c1[r] = _mm512_dpbf16_ps(c1[r], w1, pq_bh32(y));
            c2[r] = _mm512_dpbf16_ps(c2[r], w2, pq_bh32(y + 32));
        }
    }
    pq_bf16_finish(NR, c1, c2, np, n, w, x, xs, out);
}
PQ_INLINE void pq_avx512_bf16_tiny(int NR, int64_t n, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    __m512 acc[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32) {
        const __m512bh wv = (__m512bh)_mm512_loadu_ps((const float *)(w + 2 * i));
        for (int r = 0; r < NR; r++) acc[r] = _mm512_dpbf16_ps(acc[r], wv, pq_bh32((const float *)(x + r * xs) + i));
    }
    for (int r = 0; r < NR; r++) out[r] = pinned_reduce16(acc[r]);
}
#else
#define PQ_BF16_TINY_KN 16
PQ_INLINE __m512 pq_bf16x16(const uint8_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* ggml_vec_dot_bf16 on AVX-512F: two accumulators over steps of 32, a product then an addition (not
 * fused), each reduced and added in double, then the n % 32 tail in double */
PQ_INLINE void pq_avx512_bf16(int NR, int64_t n, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    __m512 c1[PQ_MAX_NR], c2[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) { c1[r] = _mm512_setzero_ps(); c2[r] = _mm512_setzero_ps(); }
    const int64_t np = n & ~(int64_t)31;
    for (int64_t i = 0; i < np; i += 32) {
        const __m512 w1 = pq_bf16x16(w + 2 * i), w2 = pq_bf16x16(w + 2 * (i + 16));
        for (int r = 0; r < NR; r++) {
            const float *y = (const float *)(x + r * xs) + i;
            __m512 p1 = _mm512_mul_ps(w1, _mm512_loadu_ps(y)), p2 = _mm512_mul_ps(w2, _mm512_loadu_ps(y + 16));
            PIN_VEC(p1);
            PIN_VEC(p2);
            c1[r] = _mm512_add_ps(p1, c1[r]);
            c2[r] = _mm512_add_ps(p2, c2[r]);
        }
    }
    pq_bf16_finish(NR, c1, c2, np, n, w, x, xs, out);
}
PQ_INLINE void pq_avx512_bf16_tiny(int NR, int64_t n, const uint8_t *w, const uint8_t *x, size_t xs, float *out) {
    __m512 acc[PQ_MAX_NR];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 wv = pq_bf16x16(w + 2 * i);
        for (int r = 0; r < NR; r++) acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps((const float *)(x + r * xs) + i), acc[r]);
    }
    for (int r = 0; r < NR; r++) out[r] = pinned_reduce16(acc[r]);
}
#endif
#endif

/* `n` is the row length in elements; nb the number of blocks. */
typedef void (*pq_dot_fn)(int64_t n, const uint8_t *w, const uint8_t *x, size_t xs, float *out);

#define PQ_DEF1(name, nr, body) \
    static void name##_##nr(int64_t n, const uint8_t *w, const uint8_t *x, size_t xs, float *out) { const int NR = nr; body; }
#if PQ_MAX_NR == 8
#define PQ_DEF4(name, body) \
    PQ_DEF1(name, 1, body) PQ_DEF1(name, 2, body) PQ_DEF1(name, 3, body) PQ_DEF1(name, 4, body) \
    PQ_DEF1(name, 5, body) PQ_DEF1(name, 6, body) PQ_DEF1(name, 7, body) PQ_DEF1(name, 8, body)
#define PQ_TAB(name) { name##_1, name##_2, name##_3, name##_4, name##_5, name##_6, name##_7, name##_8 }
#else
#define PQ_DEF4(name, body) \
    PQ_DEF1(name, 1, body) PQ_DEF1(name, 2, body) PQ_DEF1(name, 3, body) PQ_DEF1(name, 4, body)
#define PQ_TAB(name) { name##_1, name##_2, name##_3, name##_4 }
#endif

PQ_DEF4(pq_k_q4_0, pq_avx2_q_0(PQ_Q4_0, NR, n / 32, w, x, xs, out))
PQ_DEF4(pq_k_q5_0, pq_avx2_q_0(PQ_Q5_0, NR, n / 32, w, x, xs, out))
PQ_DEF4(pq_k_q8_0, pq_avx2_q_0(PQ_Q8_0, NR, n / 32, w, x, xs, out))
PQ_DEF4(pq_k_q4_1, pq_avx2_q_1(PQ_Q4_1, NR, n / 32, w, x, xs, out))
PQ_DEF4(pq_k_q5_1, pq_avx2_q_1(PQ_Q5_1, NR, n / 32, w, x, xs, out))
PQ_DEF4(pq_k_q2_K, pq_avx2_q2_K(NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_q3_K, pq_avx2_q3_K(NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_q4_K, pq_avx2_q45_K(0, NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_q5_K, pq_avx2_q45_K(1, NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_q6_K, pq_avx2_q6_K(NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_iq4_nl, pq_avx2_lut_0(PQ_IQ4_NL, NR, n / 32, w, x, xs, out))
PQ_DEF4(pq_k_mxfp4, pq_avx2_lut_0(PQ_MXFP4, NR, n / 32, w, x, xs, out))
PQ_DEF4(pq_k_iq4_xs, pq_avx2_iq4_xs(NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_iq2_xxs, pq_avx2_iq(PQ_IQ2_XXS, NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_iq2_xs, pq_avx2_iq(PQ_IQ2_XS, NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_iq2_s, pq_avx2_iq(PQ_IQ2_S, NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_iq3_xxs, pq_avx2_iq(PQ_IQ3_XXS, NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_iq3_s, pq_avx2_iq(PQ_IQ3_S, NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_iq1_s, pq_avx2_iq(PQ_IQ1_S, NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_iq1_m, pq_avx2_iq(PQ_IQ1_M, NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_tq1_0, pq_avx2_tq(PQ_TQ1_0, NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_tq2_0, pq_avx2_tq(PQ_TQ2_0, NR, n / PQ_QK_K, w, x, xs, out))
PQ_DEF4(pq_k_f16, pq_avx2_float(PQ_F16, PQ_F16, NR, n, w, x, xs, out))
PQ_DEF4(pq_k_bf16, pq_avx2_float(PQ_BF16, PQ_BF16, NR, n, w, x, xs, out))
PQ_DEF4(pq_k_f32, pq_avx2_float(PQ_F32, PQ_F32, NR, n, w, x, xs, out))
#if defined(__AVX512F__)
PQ_DEF4(pq_k_f16w, pq_avx512_f16(NR, n, w, x, xs, out))
PQ_DEF4(pq_k_bf16w, pq_avx512_bf16(NR, n, w, x, xs, out))
PQ_DEF4(pq_k_f16t, pq_avx512_f16_tiny(NR, n, w, x, xs, out))
PQ_DEF4(pq_k_bf16t, pq_avx512_bf16_tiny(NR, n, w, x, xs, out))
/* Whether llama.cpp computes a product of these sizes with llamafile's tinyBLAS (two activation rows
 * or more, k a multiple of its step, the weight's rows a multiple of 4) rather than ggml's vec_dot */
PQ_INLINE int pq_tiny_form(int t, int64_t n, int64_t k, int64_t m) {
    const int64_t kn = t == PQ_F16 ? 16 : PQ_BF16_TINY_KN;
    return n >= 2 && k % kn == 0 && m % 4 == 0;
}
#else
PQ_DEF4(pq_k_f16w, pq_avx2_float(PQ_F16, PQ_F32, NR, n, w, x, xs, out))
PQ_DEF4(pq_k_bf16w, pq_avx2_float(PQ_BF16, PQ_F32, NR, n, w, x, xs, out))
PQ_INLINE int pq_tiny_form(int t, int64_t n, int64_t k, int64_t m) { (void)t; (void)n; (void)k; (void)m; return 0; }
#endif

/* The kernel for F16 / BF16 weights against activations widened to F32 (pq_widen_row); tiny: the
 * form of a product of several rows (pq_tiny_form). */
PQ_API pq_dot_fn pq_avx2_kernel_wide(int t, int nr, int tiny) {
    static const pq_dot_fn f16[PQ_MAX_NR] = PQ_TAB(pq_k_f16w), bf16[PQ_MAX_NR] = PQ_TAB(pq_k_bf16w);
#if defined(__AVX512F__)
    static const pq_dot_fn f16t[PQ_MAX_NR] = PQ_TAB(pq_k_f16t), bf16t[PQ_MAX_NR] = PQ_TAB(pq_k_bf16t);
    if (tiny) return t == PQ_F16 ? f16t[nr - 1] : bf16t[nr - 1];
#endif
    (void)tiny;
    return t == PQ_F16 ? f16[nr - 1] : bf16[nr - 1];
}

/* The AVX2 kernel for type t and nr rows, NULL when none. */
PQ_API pq_dot_fn pq_avx2_kernel(int t, int nr) {
    static const pq_dot_fn q4_0[PQ_MAX_NR] = PQ_TAB(pq_k_q4_0), q5_0[PQ_MAX_NR] = PQ_TAB(pq_k_q5_0), q8_0[PQ_MAX_NR] = PQ_TAB(pq_k_q8_0);
    static const pq_dot_fn q4_1[PQ_MAX_NR] = PQ_TAB(pq_k_q4_1), q5_1[PQ_MAX_NR] = PQ_TAB(pq_k_q5_1);
    static const pq_dot_fn q2_K[PQ_MAX_NR] = PQ_TAB(pq_k_q2_K), q3_K[PQ_MAX_NR] = PQ_TAB(pq_k_q3_K), q4_K[PQ_MAX_NR] = PQ_TAB(pq_k_q4_K);
    static const pq_dot_fn q5_K[PQ_MAX_NR] = PQ_TAB(pq_k_q5_K), q6_K[PQ_MAX_NR] = PQ_TAB(pq_k_q6_K);
    static const pq_dot_fn f16[PQ_MAX_NR] = PQ_TAB(pq_k_f16), bf16[PQ_MAX_NR] = PQ_TAB(pq_k_bf16), f32[PQ_MAX_NR] = PQ_TAB(pq_k_f32);
    static const pq_dot_fn iq4_nl[PQ_MAX_NR] = PQ_TAB(pq_k_iq4_nl), mxfp4[PQ_MAX_NR] = PQ_TAB(pq_k_mxfp4);
    static const pq_dot_fn iq4_xs[PQ_MAX_NR] = PQ_TAB(pq_k_iq4_xs);
    static const pq_dot_fn iq2_xxs[PQ_MAX_NR] = PQ_TAB(pq_k_iq2_xxs), iq2_xs[PQ_MAX_NR] = PQ_TAB(pq_k_iq2_xs);
    static const pq_dot_fn iq2_s[PQ_MAX_NR] = PQ_TAB(pq_k_iq2_s), iq3_xxs[PQ_MAX_NR] = PQ_TAB(pq_k_iq3_xxs);
    static const pq_dot_fn iq3_s[PQ_MAX_NR] = PQ_TAB(pq_k_iq3_s), iq1_s[PQ_MAX_NR] = PQ_TAB(pq_k_iq1_s);
    static const pq_dot_fn iq1_m[PQ_MAX_NR] = PQ_TAB(pq_k_iq1_m);
    static const pq_dot_fn tq1_0[PQ_MAX_NR] = PQ_TAB(pq_k_tq1_0), tq2_0[PQ_MAX_NR] = PQ_TAB(pq_k_tq2_0);
    const pq_dot_fn *tab;
    switch (t) {
    case PQ_Q4_0: tab = q4_0; break;
    case PQ_Q5_0: tab = q5_0; break;
    case PQ_Q8_0: tab = q8_0; break;
    case PQ_Q4_1: tab = q4_1; break;
    case PQ_Q5_1: tab = q5_1; break;
    case PQ_Q2_K: tab = q2_K; break;
    case PQ_Q3_K: tab = q3_K; break;
    case PQ_Q4_K: tab = q4_K; break;
    case PQ_Q5_K: tab = q5_K; break;
    case PQ_Q6_K: tab = q6_K; break;
    case PQ_F16: tab = f16; break;
    case PQ_BF16: tab = bf16; break;
    case PQ_F32: tab = f32; break;
    case PQ_IQ4_NL: tab = iq4_nl; break;
    case PQ_MXFP4: tab = mxfp4; break;
    case PQ_IQ4_XS: tab = iq4_xs; break;
    case PQ_IQ2_XXS: tab = iq2_xxs; break;
    case PQ_IQ2_XS: tab = iq2_xs; break;
    case PQ_IQ2_S: tab = iq2_s; break;
    case PQ_IQ3_XXS: tab = iq3_xxs; break;
    case PQ_IQ3_S: tab = iq3_s; break;
    case PQ_IQ1_S: tab = iq1_s; break;
    case PQ_IQ1_M: tab = iq1_m; break;
    case PQ_TQ1_0: tab = tq1_0; break;
    case PQ_TQ2_0: tab = tq2_0; break;
    default: return NULL;
    }
    return tab[nr - 1];
}
#endif /* PQ_HAVE_AVX2 */

/* nr activation rows (1..PQ_MAX_NR) at byte stride xs against one weight row. */
static inline void pq_dot_rows(int t, int nr, int64_t k, const uint8_t *w, const uint8_t *x, size_t xs,
                               float *out, int portable) {
#if PQ_HAVE_AVX2
    const pq_dot_fn fn = portable ? NULL : pq_avx2_kernel(t, nr);
    if (fn) {   /* a type without an AVX2 kernel takes the portable one */
        fn(k, w, x, xs, out);
        return;
    }
#endif
    (void)portable;
    for (int r = 0; r < nr; r++) out[r] = pq_dot1_portable(t, k, w, x + r * xs);
}


/* ---------------------------------------------------------------------------------------------
 * The products' thread pool. A decode step runs ~100 products of tens of microseconds each; an
 * OpenMP region per product costs a wake-up per region when its threads sleep and, worse, ends
 * in a barrier that waits for every thread to arrive: on a shared machine a helper that the OS
 * has not scheduled holds the caller up for a time slice. Here the caller publishes a job of
 * numbered items, works through them itself, and waits only for items a helper has claimed;
 * a helper that wakes late finds nothing left and goes back to spinning or sleeping. Helpers spin
 * PQ_POOL_SPIN_NS after their last item (the next product usually arrives within it), then
 * sleep on a futex. Which thread computes an item never changes its result.
 *
 * Several threads may run kernels at once (pipeline groups sharing a process, an rpc server's
 * lanes): the pool holds up to PQ_POOL_SLOTS jobs, one per slot, and its helpers, as many as the
 * largest n_threads asked for less one, serve every job; a caller works only on its own job and
 * waits only for its own items. A caller takes the first free slot (one atomic exchange: a lone
 * caller always gets slot 0) and, when all are taken, runs its items alone. A helper scans the
 * slots from the one after the slot of its last item, so that the jobs of concurrent callers
 * share the helpers item by item.
 *
 * A slot's state is one atomic word: generation (16 bits) | item count (24) | next item (24), so
 * that a claim (a CAS on it) names its job exactly, and a helper that read the state of a job that
 * has since ended and been replaced in the same slot fails its CAS (the generation moved on); the
 * job's function and context are written before the state (release) and read after a successful
 * claim (acquire), when the job cannot end before the claimed item is done. A forked child
 * inherits no helpers: the pool forgets them and every slot (pthread_atfork) and starts its own. */
#define PQ_POOL_MAX 64
#define PQ_POOL_SLOTS 8         /* a power of two: helpers step through the slots by masking */
#define PQ_POOL_SPIN_NS 200000
#define PQ_POOL_WAIT_SPIN_NS 20000
#define PQ_POOL_ITEMS_MAX ((1 << 24) - 1)

typedef void (*pq_item_fn)(void *ctx, int64_t item);

typedef struct {
    uint64_t state;         /* atomic: gen << 48 | n << 24 | next */
    int done;               /* atomic futex word: items finished in the slot's current job */
    int waiting;            /* atomic: the caller sleeps on `done` */
    pq_item_fn fn;
    void *ctx;
} __attribute__((aligned(64))) pq_pool_slot;  /* a line each: one job's claims leave the others' alone */

static struct {
    pq_pool_slot slot[PQ_POOL_SLOTS];
    int busy[PQ_POOL_SLOTS] __attribute__((aligned(64)));  /* atomic: a caller owns the slot */
    int wake;               /* atomic futex word, bumped to wake sleepers */
    int sleepers;           /* atomic */
    int nhelpers;           /* helpers started (guarded by lock) */
    pthread_mutex_t lock;
} pq_pool = {{{0}}, {0}, 0, 0, 0, PTHREAD_MUTEX_INITIALIZER};

static inline int64_t pq_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
static inline void pq_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}
static inline int pq_pool_has_items(uint64_t s) { return (s & 0xFFFFFFu) < ((s >> 24) & 0xFFFFFFu); }

/* Claims one item of the slot's current job: 1 and the item (fn and ctx of its job) or 0. */
static inline int pq_pool_claim(pq_pool_slot *sl, int64_t *item) {
    uint64_t s = __atomic_load_n(&sl->state, __ATOMIC_ACQUIRE);
    for (;;) {
        if (!pq_pool_has_items(s)) return 0;
        if (__atomic_compare_exchange_n(&sl->state, &s, s + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *item = (int64_t)(s & 0xFFFFFFu);
            return 1;
        }
    }
}

static inline void pq_pool_run_claimed(pq_pool_slot *sl, int64_t item) {
    sl->fn(sl->ctx, item);
    __atomic_fetch_add(&sl->done, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&sl->waiting, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &sl->done, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static void *pq_pool_helper(void *arg) {
    (void)arg;
    prctl(PR_SET_NAME, "kernel-pool", 0, 0, 0);  /* what top -H, ps -L and /proc show for it */
    int from = 0;  /* the slot after the one of this helper's last item: where its next scan starts */
    for (;;) {
        int64_t item;
        int64_t idle_since = pq_now_ns();
        for (;;) {
            int got = -1;
            for (int j = 0; j < PQ_POOL_SLOTS; j++) {
                const int i = (from + j) & (PQ_POOL_SLOTS - 1);
                if (pq_pool_claim(&pq_pool.slot[i], &item)) { got = i; break; }
            }
            if (got >= 0) {
                pq_pool_run_claimed(&pq_pool.slot[got], item);
                from = (got + 1) & (PQ_POOL_SLOTS - 1);
                idle_since = pq_now_ns();
                continue;
            }
            for (int i = 0; i < 64; i++) pq_cpu_relax();
            if (pq_now_ns() - idle_since > PQ_POOL_SPIN_NS) break;
        }
        /* sleep until a caller bumps `wake`; re-check for work after announcing ourselves */
        __atomic_fetch_add(&pq_pool.sleepers, 1, __ATOMIC_SEQ_CST);
        const int seq = __atomic_load_n(&pq_pool.wake, __ATOMIC_SEQ_CST);
        int work = 0;
        for (int i = 0; i < PQ_POOL_SLOTS && !work; i++)
            work = pq_pool_has_items(__atomic_load_n(&pq_pool.slot[i].state, __ATOMIC_SEQ_CST));
        if (!work)
            syscall(SYS_futex, &pq_pool.wake, FUTEX_WAIT_PRIVATE, seq, NULL, NULL, 0);
        __atomic_fetch_sub(&pq_pool.sleepers, 1, __ATOMIC_SEQ_CST);
    }
    return NULL;
}

static void pq_pool_after_fork_child(void) {
    for (int i = 0; i < PQ_POOL_SLOTS; i++) {
        pq_pool_slot *sl = &pq_pool.slot[i];
        sl->state = 0; sl->done = 0; sl->waiting = 0; sl->fn = NULL; sl->ctx = NULL;
        pq_pool.busy[i] = 0;
    }
    pq_pool.wake = 0; pq_pool.sleepers = 0; pq_pool.nhelpers = 0;
    pthread_mutex_init(&pq_pool.lock, NULL);
}
static pthread_once_t pq_pool_once = PTHREAD_ONCE_INIT;
static void pq_pool_register_fork(void) { pthread_atfork(NULL, NULL, pq_pool_after_fork_child); }

/* A free slot, now owned by the caller, or NULL when every slot holds a job. */
static inline pq_pool_slot *pq_pool_take_slot(void) {
    for (int i = 0; i < PQ_POOL_SLOTS; i++)
        if (!__atomic_exchange_n(&pq_pool.busy[i], 1, __ATOMIC_ACQUIRE)) return &pq_pool.slot[i];
    return NULL;
}

/* Runs fn(ctx, i) for i < n_items on the caller and the pool's helpers (up to n_threads - 1 of
 * them are started); returns when all are done. Callers may overlap: each publishes its job in a
 * slot of its own, claims items of that job only, and waits only for the items of that job that
 * helpers claimed; the helpers serve every published job. With every slot taken a caller runs its
 * items alone. */
PQ_API void pq_pool_run(int n_threads, int64_t n_items, pq_item_fn fn, void *ctx) {
    int64_t item;
    pq_pool_slot *sl;
    if (n_items <= 0) return;
    if (n_threads > PQ_POOL_MAX) n_threads = PQ_POOL_MAX;
    if (n_threads <= 1 || n_items == 1 || n_items > PQ_POOL_ITEMS_MAX || !(sl = pq_pool_take_slot())) {
        for (int64_t i = 0; i < n_items; i++) fn(ctx, i);
        return;
    }
    if (__atomic_load_n(&pq_pool.nhelpers, __ATOMIC_RELAXED) < n_threads - 1) {
        pthread_once(&pq_pool_once, pq_pool_register_fork);
        pthread_mutex_lock(&pq_pool.lock);
        while (pq_pool.nhelpers < n_threads - 1) {
            pthread_t th;
            pthread_attr_t at;
            pthread_attr_init(&at);
            pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
            pthread_attr_setstacksize(&at, 256 * 1024);
            const int rc = pthread_create(&th, &at, pq_pool_helper, NULL);
            pthread_attr_destroy(&at);
            if (rc != 0) break;
            __atomic_store_n(&pq_pool.nhelpers, pq_pool.nhelpers + 1, __ATOMIC_RELAXED);
        }
        pthread_mutex_unlock(&pq_pool.lock);
    }
    /* publish: the slot's previous job is finished (done == n), so no helper holds one of its items */
    sl->fn = fn;
    sl->ctx = ctx;
    __atomic_store_n(&sl->done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&sl->waiting, 0, __ATOMIC_RELAXED);
    const uint64_t gen = ((__atomic_load_n(&sl->state, __ATOMIC_RELAXED) >> 48) + 1) & 0xFFFFu;
    __atomic_store_n(&sl->state, gen << 48 | (uint64_t)n_items << 24, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pq_pool.sleepers, __ATOMIC_SEQ_CST) > 0) {
        __atomic_fetch_add(&pq_pool.wake, 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, &pq_pool.wake, FUTEX_WAKE_PRIVATE, n_threads - 1, NULL, NULL, 0);
    }
    while (pq_pool_claim(sl, &item)) pq_pool_run_claimed(sl, item);
    /* Only items that a helper claimed can be outstanding. Spin briefly, then sleep until the
     * helper finishes them: a helper the OS preempted in the middle of an item can then run on
     * this core (an idle core pulls waiting threads) instead of waiting for its own. */
    const int64_t wait_from = pq_now_ns();
    for (;;) {
        const int d = __atomic_load_n(&sl->done, __ATOMIC_ACQUIRE);
        if (d >= n_items) break;
        if (pq_now_ns() - wait_from < PQ_POOL_WAIT_SPIN_NS) {
            for (int i = 0; i < 16; i++) pq_cpu_relax();
            continue;
        }
        __atomic_store_n(&sl->waiting, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&sl->done, __ATOMIC_SEQ_CST) == d)
            syscall(SYS_futex, &sl->done, FUTEX_WAIT_PRIVATE, d, NULL, NULL, 0);
    }
    __atomic_store_n(&pq_pool.busy[sl - pq_pool.slot], 0, __ATOMIC_RELEASE);
}

/* Weight bytes per work item: the longer a thread streams one run of weights, the better the
 * prefetchers keep up (16 KiB items measured 25% slower than 128 KiB at 1 activation row, 14% at
 * 32), but every thread should get several items of a product so that one the OS delays holds
 * nobody up. With more activation rows than one kernel call takes (one_call = 0) a tile is reread
 * per group of rows, from L2. */
static inline int64_t pq_tile_bytes(int64_t weight_bytes, int n_threads, int one_call) {
    int64_t b = weight_bytes / ((int64_t)(n_threads < 1 ? 1 : n_threads) * 4);
    const int64_t hi = one_call ? 262144 : 131072;
    return b > hi ? hi : b < 16384 ? 16384 : b;
}

/* Activation rows quantized to vt (or, wide, rounded to the F16 / BF16 weight type t and kept as
 * floats), each by whoever claims it. */
typedef struct {
    int t, vt, wide;
    const float *x; int64_t k, ldx;
    uint8_t *xq; int64_t xq_stride;
} pq_rows_job;

static inline void pq_widen_row(int t, const float *x, float *y, int64_t k);
static void pq_rows_item(void *ctx, int64_t r) {
    const pq_rows_job *j = (const pq_rows_job *)ctx;
    if (j->wide) pq_widen_row(j->t, j->x + r * j->ldx, (float *)(j->xq + r * j->xq_stride), j->k);
    else pq_quantize_row(j->vt, j->x + r * j->ldx, j->xq + r * j->xq_stride, j->k);
}
/* Small batches are quantized by the calling thread (handing out a few rows costs more than it
 * saves); larger ones are items of a first pool run. */
static void pq_quantize_rows_pool(pq_rows_job *job, int64_t n, int n_threads, int small) {
    if (n_threads <= 1 || small)
        for (int64_t r = 0; r < n; r++) pq_rows_item(job, r);
    else
        pq_pool_run(n_threads, n, pq_rows_item, job);
}

typedef struct {
    int t;
    int64_t n, k;
    const uint8_t *w; int64_t m, wstride;
    float *out; int64_t ldo; const float *bias;
    uint8_t *xq; int64_t xq_stride, tile, ntiles;
    int portable, wide, tiny;
} pq_mm_job;

/* An activation row rounded to F16 / BF16 (as pq_quantize_row does) and stored back as floats. */
static inline void pq_widen_row(int t, const float *x, float *y, int64_t k) {
    int64_t i = 0;
#if PQ_HAVE_AVX2
    if (t == PQ_F16)
        for (; i + 8 <= k; i += 8)
            _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT)));
#endif
    for (; i < k; i++) y[i] = t == PQ_F16 ? pq_f16_to_f32(pq_f32_to_f16(x[i])) : pq_bf16_to_f32(pq_f32_to_bf16(x[i]));
}


static void pq_mm_tile_item(void *ctx, int64_t item) {
    const pq_mm_job *jb = (const pq_mm_job *)ctx;
    const int64_t n = jb->n, m = jb->m;
    const int64_t c0 = item / jb->ntiles * PQ_ROW_CHUNK;
    const int64_t c1 = c0 + PQ_ROW_CHUNK < n ? c0 + PQ_ROW_CHUNK : n;
    const int64_t jt = item % jb->ntiles * jb->tile;
    const int64_t je = jt + jb->tile < m ? jt + jb->tile : m;
    for (int64_t r0 = c0; r0 < c1; r0 += PQ_MAX_NR) {
        const int nr = (int)(c1 - r0 < PQ_MAX_NR ? c1 - r0 : PQ_MAX_NR);
#if PQ_HAVE_AVX2
        /* looked up once per group of rows: a short row (k = 768) is only a few blocks */
        const pq_dot_fn fn = jb->portable ? NULL : jb->wide ? pq_avx2_kernel_wide(jb->t, nr, jb->tiny) : pq_avx2_kernel(jb->t, nr);
#endif
        for (int64_t j = jt; j < je; j++) {
            float s[PQ_MAX_NR];
#if PQ_HAVE_AVX2
            if (fn) fn(jb->k, jb->w + j * jb->wstride, jb->xq + r0 * jb->xq_stride, (size_t)jb->xq_stride, s);
            else
#endif
            pq_dot_rows(jb->t, nr, jb->k, jb->w + j * jb->wstride, jb->xq + r0 * jb->xq_stride,
                        (size_t)jb->xq_stride, s, jb->portable);
            const float b = jb->bias ? jb->bias[j] : 0.0f;
            for (int r = 0; r < nr; r++) jb->out[(r0 + r) * jb->ldo + j] = jb->bias ? s[r] + b : s[r];
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * out[r, j] = x[r, :] . dequant(w[j, :]) (+ bias[j]) for r < n, j < m, with ggml's arithmetic.
 * x: n rows of k floats at stride ldx; w: m rows of wstride bytes; out rows at stride ldo.
 * xq: scratch of n * xq_stride bytes for the quantized activations (xq_stride = the vec type's
 * row bytes; for F16 / BF16 weights 4 * k, as the AVX2 path keeps their activations widened to
 * floats). The activation rows are quantized once; then tiles of weight rows (about 16 KiB,
 * kept in L1/L2) go to the threads, and each weight row of a tile is dotted with groups of up
 * to PQ_MAX_NR activation rows while its unpacked blocks are in registers. */
PQ_API void pq_mul_mat(int t, const float *x, int64_t n, int64_t k, int64_t ldx,
                       const uint8_t *w, int64_t m, int64_t wstride,
                       float *out, int64_t ldo, const float *bias,
                       uint8_t *xq, int64_t xq_stride, int n_threads, int portable) {
    pq_traits tr = {1, 4, PQ_F32, 0};
    pq_get_traits(t, &tr);
    const int vt = tr.vec_type;
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > m) nt = (int)(m > 0 ? m : 1);
    /* Handing items to a helper costs about a microsecond (a futex wake when it sleeps): below
     * ~10 us of single-thread work one thread does it all. */
    if (m * wstride * ((n + PQ_MAX_NR - 1) / PQ_MAX_NR) < 65536) nt = 1;
    int64_t tile = pq_tile_bytes(m * wstride, nt, n <= PQ_MAX_NR) / (wstride > 0 ? wstride : 1);
    if (tile < 1) tile = 1;
    const int wide = PQ_HAVE_AVX2 && !portable && (t == PQ_F16 || t == PQ_BF16) && xq_stride >= 4 * k;
    pq_mm_job job = {t, n, k, w, m, wstride, out, ldo, bias, xq, xq_stride, tile, (m + tile - 1) / tile,
                     portable, wide, wide && pq_tiny_form(t, n, k, m)};
    pq_rows_job rows = {t, vt, wide, x, k, ldx, xq, xq_stride};
    pq_quantize_rows_pool(&rows, n, nt, n <= 2 * PQ_MAX_NR);
    /* Work items: (chunk of activation rows) x (tile of weight rows), claimed one at a time so
     * that a thread delayed by the OS does not hold the others up. Chunks of activation rows are
     * outermost: with all rows at once, a large batch's output and quantized rows outgrow L2 and
     * the kernel slows down (measured at n >= 128, m = 2048); the weights re-read per chunk come
     * from L3. Each output is computed by the same kernel whatever the thread, so results do not
     * depend on the thread count. */
    const int64_t nchunks = (n + PQ_ROW_CHUNK - 1) / PQ_ROW_CHUNK;
    pq_pool_run(nt, nchunks * job.ntiles, pq_mm_tile_item, &job);
}

/* Rows ids[i] of w (m rows of k elements of type t) dequantized into out rows (stride ldo). */
PQ_API void pq_get_rows(int t, const uint8_t *w, int64_t wstride, int64_t k, const int32_t *ids, int64_t n,
                        float *out, int64_t ldo, int n_threads) {
    const int nt = n_threads < 1 ? 1 : n_threads;
    #pragma omp parallel for schedule(static) num_threads(nt) if(nt > 1 && n > 1)
    for (int64_t i = 0; i < n; i++) pq_dequant_row(t, w + (int64_t)ids[i] * wstride, out + i * ldo, k);
}

/* Dequantize weight rows [j0, j1) into a row-major float tile (for the BLAS prompt path). */
PQ_API void pq_dequant_rows(int t, const uint8_t *w, int64_t wstride, int64_t k, int64_t j0, int64_t j1,
                            float *out, int n_threads) {
    const int nt = n_threads < 1 ? 1 : n_threads;
    #pragma omp parallel for schedule(static) num_threads(nt) if(nt > 1 && j1 - j0 > 1)
    for (int64_t j = j0; j < j1; j++) pq_dequant_row(t, w + j * wstride, out + (j - j0) * k, k);
}

#endif /* PYLLAMA_GGML_QUANTS_H */
