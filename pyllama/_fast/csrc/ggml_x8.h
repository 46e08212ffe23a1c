/* Q4_0, Q8_0, IQ4_NL, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K weights repacked in groups of 8 rows, for the AVX2
 * / AVX-512 products.
 *
 * In the file's layout each weight row is dotted with an activation row on its own: the kernel
 * unpacks a block, multiplies 32 bytes at a time and reduces the 8 int32 lanes to one sum at the
 * end, and the block scales cost as much again as the products (ggml_quants.h). Here the 8 rows
 * of a group sit side by side: lane l of a 32-byte vector holds 4 consecutive weights of row l,
 * the 4 matching activation bytes are broadcast to every lane, and one byte dot product (VNNI's
 * dpbusd, or maddubs + madd) adds 4 products to each of the 8 rows' sums. The per-row scales are
 * a lane-wise multiply, the minimum / offset correction a lane-wise madd, and the 8 lanes are the
 * 8 outputs: no horizontal sums, and a block's unpacking is shared by up to PQ_X8_NR activation
 * rows. (llama.cpp repacks Q4_K into 8-row groups for the same reason.)
 *
 * The integer sums are ggml's, exactly: per 32-element (Q4_K) or 16-element (Q2_K, Q3_K, Q6_K)
 * group the lane holds sum(q * q8) in int32, multiplied by the group's 4-, 6- or 8-bit scale and
 * summed over the super-block in int32, as ggml's vec_dot_q2_K / q3_K / q4_K / q6_K do (Q3_K's
 * and Q6_K's signed weights as unsigned q + 4 / q + 32, the offset taken back with the
 * activation's group sums); the float steps per super-block are the same as the row kernels'
 * (one multiply by d * d8 per block), so the error bound of ggml_quants.h holds unchanged.
 *
 * Q4_0 and Q8_0 (signed weights, one f16 scale per 32 elements, Q8_0 activations) take the
 * product as |w| . (y with w's sign), exact in the byte dot product, per 32-element block (the
 * 512-bit kernel offsets y instead, see pq_x8_kernel_0_oct). IQ4_NL and MXFP4 are Q4_0 with the
 * nibbles looked up in their 16 values instead of less 8, and MXFP4's scale an E8M0 exponent.
 *
 * Packed layouts, per group of 8 rows and per block (32 elements for Q4_0 / Q8_0, a super-block
 * of 256 for the K-quants), each the file's 8 blocks' size but Q4_K's:
 *   Q4_0 (144 bytes): d f16[8] | qs[4 quads][8 rows][4 bytes] (low nibbles elements 4q.., high 16 + 4q..)
 *   Q8_0 (272 bytes): d f16[8] | qs[8 quads][8 rows][4 bytes]
 *   IQ4_NL (144 bytes): as Q4_0;  MXFP4 (136 bytes): e u8[8] | qs as Q4_0's
 *   Q4_K (1184 bytes): d f16[8] | dmin f16[8] | scale u8[8 sub-blocks][8 rows]
 *                      | min u8[8][8] | qs[4 runs of 64][8 quads][8 rows][4 bytes]
 *   Q5_K (1440 bytes): Q4_K's layout | qh[8 quads][8 rows][4 bytes] (bit j: sub-block j's 5th bit)
 *   Q6_K (1680 bytes, the file's size): d f16[8] | scale i8[16][8]
 *                      | 2 halves x (ql[0..31] [8 quads][8 rows][4] | ql[32..63] likewise | qh likewise)
 *   Q3_K (912 bytes): d f16[8] | scale - 32 i8[16][8] | qs[0..31] [8 quads][8 rows][4]
 *                      | qs[32..63] likewise | hmask likewise (quads only: no oct kernel, see PQ_X8_OCT)
 *   Q2_K (672 bytes, the file's size): d f16[8] | dmin f16[8] | scale | min << 4 u8[16][8]
 *                      | qs[0..31] [8 quads][8 rows][4] | qs[32..63] likewise (quads only, as Q3_K)
 * where a quad is 4 consecutive bytes of the row's block at the same offset. With AVX-512 VNNI the
 * qs / ql / qh runs hold octs instead, [units][8 rows][8 bytes], the same runs at the same offsets
 * (see PQ_X8_OCT): Q4_0 / Q8_0 8 consecutive bytes of each row, the K-quants a 32-byte run's
 * quads o and o + 4.
 */
#ifndef PYLLAMA_GGML_X8_H
#define PYLLAMA_GGML_X8_H

#include "ggml_quants.h"

#define PQ_X8_Q4_K_BYTES 1184
#define PQ_X8_Q6_K_BYTES 1680
#define PQ_X8_Q3_K_BYTES 912
#define PQ_X8_Q2_K_BYTES 672

/* With AVX-512 VNNI every repacked type's runs are laid out in units of 8 bytes instead of 4
 * ("octs": a 64-byte vector holds two quads of each of the 8 rows), so that one 512-bit byte dot
 * product covers two quads of every row and the activation's matching 8 bytes are broadcast as one
 * 64-bit value. Q4_0 / Q8_0 octs are 8 consecutive bytes. A K-quant's oct o of a 32-byte run holds
 * its quads o and o + 4, and the Q8_K activation rows get the same order within each 32 values
 * (pq_x8_arrange_x): Q6_K's 16-element groups 2p and 2p + 1 then share every oct of their run (row
 * l's lanes 2l and 2l + 1) and one multiply applies both groups' scales. Each row's two int32 lanes
 * are added once per block (K-quants) or at the end (Q4_0 / Q8_0). Without AVX-512 VNNI the 256-bit
 * kernels read quads. The bytes and the block sizes are the same either way. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define PQ_X8_OCT 1
#define PQ_X8_UNIT 8
#else
#define PQ_X8_OCT 0
#define PQ_X8_UNIT 4
#endif

/* Packed bytes per group of 8 rows and block; 0 for types that are not repacked. */
static inline int pq_x8_block_bytes(int t) {
    switch (t) {
    case PQ_Q4_0: return 144;
    case PQ_Q8_0: return 272;
    case PQ_IQ4_NL: return 144;
    case PQ_MXFP4: return 136;
    case PQ_Q4_K: return PQ_X8_Q4_K_BYTES;
    case PQ_Q5_K: return PQ_X8_Q4_K_BYTES + 256;
    case PQ_Q6_K: return PQ_X8_Q6_K_BYTES;
    case PQ_Q3_K: return PQ_X8_OCT ? 0 : PQ_X8_Q3_K_BYTES;   /* no oct kernel: the file layout's */
    case PQ_Q2_K: return PQ_X8_OCT ? 0 : PQ_X8_Q2_K_BYTES;
    default: return 0;
    }
}
/* Elements per block of a repacked type */
/* the types of the 32-element kernels (pq_x8_kernel_0), and those of them with 4-bit weights */
static inline int pq_x8_is_0(int t) { return t == PQ_Q4_0 || t == PQ_Q8_0 || t == PQ_IQ4_NL || t == PQ_MXFP4; }
static inline int pq_x8_is_nib(int t) { return t == PQ_Q4_0 || t == PQ_IQ4_NL || t == PQ_MXFP4; }
static inline int pq_x8_block_elems(int t) { return pq_x8_is_0(t) ? 32 : PQ_QK_K; }

/* Copies bytes [off, off + 4 * nq) of each of the 8 rows' blocks (src[l]) to dst in units of
 * `unit` (4 or 8) bytes, unit-major: unit u of row l at dst + 8 * unit * u + unit * l. */
static inline void pq_x8_units(uint8_t *dst, const uint8_t *const src[8], int off, int nq, int unit) {
    for (int u = 0; u < 4 * nq / unit; u++)
        for (int l = 0; l < 8; l++) memcpy(dst + 8 * unit * u + unit * l, src[l] + off + unit * u, unit);
}
/* a K-quant's runs of 32 bytes per row: in quads, or (PQ_X8_OCT) in octs that pair quads o, o + 4 */
static inline void pq_x8_kruns(uint8_t *dst, const uint8_t *const src[8], int off, int nq) {
    if (!PQ_X8_OCT) {
        pq_x8_units(dst, src, off, nq, 4);
        return;
    }
    for (int r = 0; r < nq / 8; r++)
        for (int o = 0; o < 4; o++)
            for (int l = 0; l < 8; l++) {
                uint8_t *d = dst + 256 * r + 64 * o + 8 * l;
                memcpy(d, src[l] + off + 32 * r + 4 * o, 4);
                memcpy(d + 4, src[l] + off + 32 * r + 16 + 4 * o, 4);
            }
}

/* w: m rows (m % 8 == 0) of k elements of type t at byte stride wstride -> out, laid out as above
 * (row group g at out + g * (k / block elements) * pq_x8_block_bytes(t)). Returns 0, or -1 for
 * another type. */
PQ_API int pq_repack_x8(int t, const uint8_t *w, int64_t m, int64_t wstride, int64_t k, uint8_t *out) {
    const int pb = pq_x8_block_bytes(t);
    if (!pb || m % 8 || k % pq_x8_block_elems(t)) return -1;
    const int64_t nb = k / pq_x8_block_elems(t);
    pq_traits tr;
    pq_get_traits(t, &tr);
    const int fb = tr.bytes;
    for (int64_t g = 0; g < m / 8; g++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *src[8];
            for (int l = 0; l < 8; l++) src[l] = w + (8 * g + l) * wstride + b * fb;
            uint8_t *o = out + (g * nb + b) * pb;
            if (t == PQ_MXFP4) {
                for (int l = 0; l < 8; l++) o[l] = src[l][0];
                pq_x8_units(o + 8, src, 1, 4, PQ_X8_UNIT);
            } else if (pq_x8_is_0(t)) {
                for (int l = 0; l < 8; l++) memcpy(o + 2 * l, src[l], 2);
                pq_x8_units(o + 16, src, 2, t == PQ_Q8_0 ? 8 : 4, PQ_X8_UNIT);
            } else if (t == PQ_Q4_K || t == PQ_Q5_K) {
                for (int l = 0; l < 8; l++) {
                    memcpy(o + 2 * l, src[l], 2);
                    memcpy(o + 16 + 2 * l, src[l] + 2, 2);
                    for (int j = 0; j < 8; j++) pq_k4_scale_min(j, src[l] + 4, o + 32 + 8 * j + l, o + 96 + 8 * j + l);
                }
                pq_x8_kruns(o + 160, src, t == PQ_Q5_K ? 48 : 16, 32);
                if (t == PQ_Q5_K) pq_x8_kruns(o + PQ_X8_Q4_K_BYTES, src, 16, 8);   /* qh */
            } else if (t == PQ_Q2_K) {
                for (int l = 0; l < 8; l++) {
                    memcpy(o + 2 * l, src[l] + 80, 2);
                    memcpy(o + 16 + 2 * l, src[l] + 82, 2);
                    for (int s = 0; s < 16; s++) o[32 + 8 * s + l] = src[l][s];
                }
                pq_x8_kruns(o + 160, src, 16, 8);         /* qs, first half's 32 bytes */
                pq_x8_kruns(o + 160 + 256, src, 48, 8);   /* second half's */
            } else if (t == PQ_Q3_K) {
                for (int l = 0; l < 8; l++) {
                    memcpy(o + 2 * l, src[l] + 108, 2);
                    for (int s = 0; s < 16; s++) o[16 + 8 * s + l] = (uint8_t)(int8_t)pq_q3_scale(src[l] + 96, s);
                }
                pq_x8_kruns(o + 144, src, 32, 8);         /* qs, first half's 32 bytes */
                pq_x8_kruns(o + 144 + 256, src, 64, 8);   /* second half's */
                pq_x8_kruns(o + 144 + 512, src, 0, 8);    /* hmask */
            } else {
                for (int l = 0; l < 8; l++) {
                    memcpy(o + 2 * l, src[l] + 208, 2);
                    for (int s = 0; s < 16; s++) o[16 + 8 * s + l] = src[l][192 + s];
                }
                for (int h = 0; h < 2; h++) {
                    uint8_t *oh = o + 144 + 768 * h;
                    pq_x8_kruns(oh, src, 64 * h, 8);
                    pq_x8_kruns(oh + 256, src, 64 * h + 32, 8);
                    pq_x8_kruns(oh + 512, src, 128 + 32 * h, 8);
                }
            }
        }
    }
    return 0;
}

/* a 256-bit byte dot product (pq_dpbusd_acc is one instruction) */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define PQ_X8_VNNI256 1
#else
#define PQ_X8_VNNI256 0
#endif

/* One product may cover up to PQ_X8_MAX_PARTS weights (a MUL_MAT_CAT's q|k|v or gate|up): they
 * share x, quantized once, and one pool run whose items are the parts' tiles. */
#define PQ_X8_MAX_PARTS 8

#if PQ_HAVE_AVX2

#if defined(__AVX512VL__)
#define PQ_X8_NR 8
#else
#define PQ_X8_NR 4
#endif

/* a + b, kept apart from the sums around it (PIN_VEC) */
PQ_INLINE __m256 pq_x8_add(__m256 a, __m256 b) { __m256 s = _mm256_add_ps(a, b); PIN_VEC(s); return s; }
PQ_INLINE __m256i pq_x8_bcast(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }

/* The 8 unsigned weights' quad i of group s of a Q4_K (sub-block s, 32 elements) or Q2_K / Q3_K /
 * Q6_K (16 elements) packed block, one row per lane. */
PQ_INLINE __m256i pq_x8_quad(int t, const uint8_t *blk, int s, int i) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (t == PQ_Q4_K || t == PQ_Q5_K) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 160 + 256 * (s / 2) + 32 * i));
        const __m256i lo = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(v, 4) : v, m4);
        if (t == PQ_Q4_K) return lo;
        /* Q5_K: bit s of the quad's qh bytes (the same 4 bytes for every sub-block) is bit 4 */
        const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + PQ_X8_Q4_K_BYTES + 32 * i));
        const __m256i hs = s < 4 ? _mm256_slli_epi16(h, 4 - s) : s > 4 ? _mm256_srli_epi16(h, s - 4) : h;
        return _mm256_or_si256(lo, _mm256_and_si256(hs, _mm256_set1_epi8(0x10)));
    }
    if (t == PQ_Q2_K) {   /* as Q3_K's two low bits */
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 160 + 256 * (s / 8) + 32 * (4 * (s % 2) + i)));
        return _mm256_and_si256(_mm256_srli_epi16(lo, 2 * ((s % 8) / 2)), _mm256_set1_epi8(3));
    }
    if (t == PQ_Q3_K) {
        /* element 16 s + 4 i' is quad q = (s % 2) * 4 + i' of half s / 8's qs run, its 2 bits
         * (s % 8) / 2 (ggml's shift), and of the hmask run, its bit `hbit` (set: q + 4 >= 4) */
        const int j = (s % 8) / 2, hbit = 4 * (s / 8) + j, q = 4 * (s % 2) + i;
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 144 + 256 * (s / 8) + 32 * q));
        const __m256i hm = _mm256_loadu_si256((const __m256i *)(blk + 144 + 512 + 32 * q));
        const __m256i l2 = _mm256_and_si256(_mm256_srli_epi16(lo, 2 * j), _mm256_set1_epi8(3));
        const __m256i h4 = hbit >= 2 ? _mm256_srli_epi16(hm, hbit - 2) : _mm256_slli_epi16(hm, 2 - hbit);
        return _mm256_or_si256(l2, _mm256_and_si256(h4, _mm256_set1_epi8(4)));
    }
    /* Q6_K: element 16 s + 4 i' is quad (s % 2) * 4 + i' of value qi = (s % 8) / 2 of half s / 8 */
    const uint8_t *hb = blk + 144 + 768 * (s / 8);
    const int qi = (s % 8) / 2, q = 4 * (s % 2) + i;
    const __m256i lo = _mm256_loadu_si256((const __m256i *)(hb + 256 * (qi % 2) + 32 * q));
    const __m256i hi = _mm256_loadu_si256((const __m256i *)(hb + 512 + 32 * q));
    const __m256i m30 = _mm256_set1_epi8(0x30);
    const __m256i l4 = _mm256_and_si256(qi < 2 ? lo : _mm256_srli_epi16(lo, 4), m4);
    const __m256i h2 = qi == 0 ? _mm256_slli_epi16(hi, 4) : qi == 1 ? _mm256_slli_epi16(hi, 2)
                     : qi == 2 ? hi : _mm256_srli_epi16(hi, 2);
    return _mm256_or_si256(l4, _mm256_and_si256(h2, m30));
}

#if PQ_X8_OCT
/* Oct j (0..3) of the 32 elements s of a K-quant packed block (Q4_K / Q5_K: sub-block s; Q6_K:
 * groups 2s and 2s + 1): 8 unsigned weights of each row, row l in 64-bit lane l. The same
 * unpacking as pq_x8_quad, on twice the bytes. */
PQ_INLINE __m512i pq_x8_oct(int t, const uint8_t *blk, int s, int j) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (t == PQ_Q4_K || t == PQ_Q5_K) {
        const __m512i v = _mm512_loadu_si512((const void *)(blk + 160 + 256 * (s / 2) + 64 * j));
        const __m512i lo = _mm512_and_si512(s % 2 ? _mm512_srli_epi16(v, 4) : v, m4);
        if (t == PQ_Q4_K) return lo;
        const __m512i h = _mm512_loadu_si512((const void *)(blk + PQ_X8_Q4_K_BYTES + 64 * j));
        const __m512i hs = s < 4 ? _mm512_slli_epi16(h, 4 - s) : s > 4 ? _mm512_srli_epi16(h, s - 4) : h;
        return _mm512_or_si512(lo, _mm512_and_si512(hs, _mm512_set1_epi8(0x10)));
    }
    /* Q6_K: s is the pair of groups 2s, 2s + 1 (one 32-byte run of the half s / 4, value s % 4) */
    const uint8_t *hb = blk + 144 + 768 * (s / 4);
    const int qi = s % 4;
    const __m512i lo = _mm512_loadu_si512((const void *)(hb + 256 * (qi % 2) + 64 * j));
    const __m512i hi = _mm512_loadu_si512((const void *)(hb + 512 + 64 * j));
    const __m512i l4 = _mm512_and_si512(qi < 2 ? lo : _mm512_srli_epi16(lo, 4), m4);
    const __m512i h2 = qi == 0 ? _mm512_slli_epi16(hi, 4) : qi == 1 ? _mm512_slli_epi16(hi, 2)
                     : qi == 2 ? hi : _mm512_srli_epi16(hi, 2);
    return _mm512_or_si512(l4, _mm512_and_si512(h2, _mm512_set1_epi8(0x30)));
}

/* The sums of each row's two lanes (2l, 2l + 1) as 8 lanes in row order, int32 and float */
PQ_INLINE __m256i pq_x8_pair_sums(__m512i v) {
    const __m256i h = _mm256_hadd_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    return _mm256_permute4x64_epi64(h, _MM_SHUFFLE(3, 1, 2, 0));   /* [r0 r1 r4 r5 | r2 r3 r6 r7] -> rows */
}
PQ_INLINE __m256 pq_x8_pair_sums_ps(__m512 v) {
    const __m256 h = _mm256_hadd_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), _MM_SHUFFLE(3, 1, 2, 0)));
}
#endif

/* A group's 8 scales (one per row) as int32 lanes: Q4_K / Q5_K 6-bit unsigned, Q2_K the low nibble,
 * Q3_K / Q6_K signed bytes */
PQ_INLINE __m256i pq_x8_scales32(int t, __m128i s8) {
    if (t == PQ_Q4_K || t == PQ_Q5_K) return _mm256_cvtepu8_epi32(s8);
    if (t == PQ_Q2_K) return _mm256_cvtepu8_epi32(_mm_and_si128(s8, _mm_set1_epi8(0x0F)));
    return _mm256_cvtepi8_epi32(s8);
}

#if PQ_X8_OCT
/* Oct s's scales of the 8 rows as 16 bytes, row l's in bytes 2l and 2l + 1: its sub-block's scale
 * twice (Q4_K / Q5_K), or its groups 2s and 2s + 1's (Q6_K) */
PQ_INLINE __m128i pq_x8_oct_scales(const uint8_t *sc, int s, int k4) {
    if (k4) {
        const __m128i s8 = _mm_loadl_epi64((const __m128i *)(sc + 8 * s));
        return _mm_unpacklo_epi8(s8, s8);
    }
    const __m128i s16 = _mm_loadu_si128((const __m128i *)(sc + 16 * s));
    return _mm_unpacklo_epi8(s16, _mm_srli_si128(s16, 8));
}
#endif

/* The integer part of a K-quant block against NR activation rows: per row, the 8 rows' sum over
 * groups of scale * sum(q * q8) (isum) */
PQ_INLINE void pq_x8_kblock(int t, int NR, const uint8_t *blk, const uint8_t *x, size_t xs, __m256i *isum) {
    const int k4 = t == PQ_Q4_K || t == PQ_Q5_K;   /* 6-bit scales and mins per 32 elements */
    const uint8_t *sc = blk + (k4 || t == PQ_Q2_K ? 32 : 16);
#if PQ_X8_OCT
    __m512i zsum[PQ_X8_NR];
    for (int r = 0; r < NR; r++) zsum[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {   /* 32 elements: a Q4_K / Q5_K sub-block, two Q6_K groups */
        __m512i acc[PQ_X8_NR];
        for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m512i q = pq_x8_oct(t, blk, s, j);
            for (int r = 0; r < NR; r++) {
                int64_t y8;
                memcpy(&y8, x + r * xs + 4 + 32 * s + 8 * j, 8);
                acc[r] = _mm512_dpbusd_epi32(acc[r], q, _mm512_set1_epi64(y8));
            }
        }
        const __m128i s88 = pq_x8_oct_scales(sc, s, k4);
        const __m512i s32 = k4 ? _mm512_cvtepu8_epi32(s88) : _mm512_cvtepi8_epi32(s88);
        for (int r = 0; r < NR; r++) {
            zsum[r] = _mm512_add_epi32(zsum[r], _mm512_mullo_epi32(acc[r], s32));
            /* one group at a time: otherwise the compiler starts the next groups' sums early and
             * spills the accumulators */
            __asm__("" : "+v"(zsum[r]));
        }
    }
    for (int r = 0; r < NR; r++) isum[r] = pq_x8_pair_sums(zsum[r]);
#else
    const int ngroups = k4 ? 8 : 16, nquads = k4 ? 8 : 4, gsize = 4 * nquads;
    for (int r = 0; r < NR; r++) isum[r] = _mm256_setzero_si256();
    /* unrolled: each group's unpacking is then straight-line code (its shifts are constants) */
#pragma GCC unroll 16
    for (int s = 0; s < ngroups; s++) {
        const __m128i s8 = _mm_loadl_epi64((const __m128i *)(sc + 8 * s));
        if (PQ_X8_VNNI256 || ((t == PQ_Q2_K || t == PQ_Q5_K) && NR < 3)) {
            __m256i acc[PQ_X8_NR];
            for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int i = 0; i < nquads; i++) {
                const __m256i q = pq_x8_quad(t, blk, s, i);
                for (int r = 0; r < NR; r++)
                    acc[r] = pq_dpbusd_acc(acc[r], q, pq_x8_bcast(x + r * xs + 4 + gsize * s + 4 * i));
            }
            /* (the scales converted after the products: converted before them, the compiler
             * scheduled Q4_K's kernel 20% slower on an AVX2 core) */
            const __m256i s32 = pq_x8_scales32(t, s8);
            for (int r = 0; r < NR; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(acc[r], s32));
        } else {
            /* Without a byte dot product: the int16 pairs of maddubs (each at most 2 * 127 * the
             * type's largest q) of a group's quads are added as int16 as far as the sum cannot
             * overflow (Q4_K's q <= 15: all 8 quads; Q5_K's q <= 31: 4; Q6_K's q + 32 <= 63: 2;
             * Q3_K's q + 4 <= 7 and Q2_K's q <= 3: all 4), and the madd that widens them multiplies
             * by the group's scale (in both halves of each row's lane): per quad a maddubs and an
             * add instead of a maddubs, a madd and an add, and per group no multiply and no
             * accumulators (4 of them besides the sums spilled at 4 rows). The same integers.
             * Q4_K at 4 / 16 rows a call 1.7x as fast, Q6_K 1.2x / 1.5x, Q2_K, Q3_K and Q5_K
             * 1.1-1.3x (figures in engine.md); Q5_K and Q2_K at 1-2 rows were as fast or faster
             * with the multiply (Q5_K at 1 row 8.8 -> 7.6 GMAC/s on an AMD Zen 2 core): they keep
             * it. */
            const __m256i s32 = pq_x8_scales32(t, s8);
            const __m256i s16 = _mm256_or_si256(_mm256_and_si256(s32, _mm256_set1_epi32(0xFFFF)),
                                                _mm256_slli_epi32(s32, 16));
            const int per = t == PQ_Q4_K ? 8 : t == PQ_Q6_K ? 2 : 4;
#pragma GCC unroll 4
            for (int i = 0; i < nquads; i += per) {
                __m256i p[PQ_X8_NR];
#pragma GCC unroll 8
                for (int j = 0; j < per; j++) {
                    const __m256i q = pq_x8_quad(t, blk, s, i + j);
                    for (int r = 0; r < NR; r++) {
                        const __m256i m = _mm256_maddubs_epi16(q, pq_x8_bcast(x + r * xs + 4 + gsize * s + 4 * (i + j)));
                        p[r] = j ? _mm256_add_epi16(p[r], m) : m;
                    }
                }
                for (int r = 0; r < NR; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p[r], s16));
            }
        }
    }
#endif
}

/* The 8 outputs of each of NR activation rows (+ bias) */
PQ_INLINE void pq_x8_store(int NR, const __m256 *facc, float *out, int64_t ldo, const float *bias) {
    for (int r = 0; r < NR; r++)
        _mm256_storeu_ps(out + r * ldo, bias ? _mm256_add_ps(facc[r], _mm256_loadu_ps(bias)) : facc[r]);
}

/* NR activation rows (Q8_K, byte stride xs) against one group of 8 rows (nb packed blocks at wg):
 * out[r * ldo + l] = row l's product with activation row r (+ bias[l]). */
PQ_INLINE void pq_x8_kernel(int t, int NR, int64_t nb, const uint8_t *wg, const uint8_t *x, size_t xs,
                            float *out, int64_t ldo, const float *bias) {
    const int pb = pq_x8_block_bytes(t);
    const int k4 = t == PQ_Q4_K || t == PQ_Q5_K, mins = k4 || t == PQ_Q2_K;
    __m256 facc[PQ_X8_NR];
    for (int r = 0; r < NR; r++) facc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * pb;
        __m256i isum[PQ_X8_NR];
        pq_x8_kblock(t, NR, blk, x + 292 * b, xs, isum);
        /* Q4_K: sum over sub-blocks j of min_j * (bsum[2j] + bsum[2j+1]); Q2_K: over the 16 groups
         * of min * bsum; Q3_K / Q6_K: of scale * bsum (the -4 / -32 offset's weight). Pairs of
         * int16 per lane, one madd. */
        __m256i pairs[8];
        for (int p = 0; p < 8; p++) {
            if (t == PQ_Q2_K) {   /* the high nibbles of groups 2p and 2p + 1 */
                const __m128i m4 = _mm_set1_epi8(0x0F);
                const __m128i a = _mm_loadl_epi64((const __m128i *)(blk + 32 + 16 * p));
                const __m128i c = _mm_loadl_epi64((const __m128i *)(blk + 40 + 16 * p));
                pairs[p] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(a, 4), m4),
                                                                  _mm_and_si128(_mm_srli_epi16(c, 4), m4)));
                continue;
            }
            const __m128i a = _mm_loadl_epi64((const __m128i *)(blk + (k4 ? 96 + 8 * p : 16 + 16 * p)));
            const __m128i c = k4 ? a : _mm_loadl_epi64((const __m128i *)(blk + 24 + 16 * p));
            pairs[p] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, c));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 dmin = mins ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : d;
        for (int r = 0; r < NR; r++) {
            const uint8_t *y = x + r * xs + 292 * b;
            __m256i corr = _mm256_setzero_si256();
            for (int p = 0; p < 8; p++) corr = _mm256_add_epi32(corr, _mm256_madd_epi16(pairs[p], pq_x8_bcast(y + 260 + 4 * p)));
            const __m256 yd = _mm256_set1_ps(pq_ld_f32(y));
            if (mins) {
                facc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, yd), _mm256_cvtepi32_ps(isum[r]), facc[r]);
                facc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, yd), _mm256_cvtepi32_ps(corr), facc[r]);
            } else {
                const __m256i tot = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(corr, t == PQ_Q3_K ? 2 : 5));
                facc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, yd), _mm256_cvtepi32_ps(tot), facc[r]);
            }
        }
    }
    pq_x8_store(NR, facc, out, ldo, bias);
}

/* Q4_0 / Q8_0: NR activation rows (Q8_0 blocks, byte stride xs) against one group of 8 rows, in
 * ggml's float steps: its vec_dot (and llamafile's tinyBLAS_Q0_AVX) keeps 8 float lanes per output,
 * lane q the products of the block's elements 4q..4q+3, each block's exact int32 lane sum times
 * d_w * d_x added into its lane, the 8 lanes added at the end as hsum_float_8 does:
 * ((L0 + L4) + (L2 + L6)) + ((L1 + L5) + (L3 + L7)). Here quad q of the 8 rows is one vector, so
 * each row's lane q is lane `row` of accumulator q. */
PQ_INLINE __m256 pq_x8_hsum8_lanes(const __m256 *f) {
    return pq_x8_add(pq_x8_add(pq_x8_add(f[0], f[4]), pq_x8_add(f[2], f[6])),
                     pq_x8_add(pq_x8_add(f[1], f[5]), pq_x8_add(f[3], f[7])));
}
/* The 8 rows' block scales: f16, or MXFP4's E8M0 bytes as pq_e8m0_half reads them */
PQ_INLINE __m256 pq_x8_scales_0(int t, const uint8_t *blk) {
    if (t != PQ_MXFP4) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)blk));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(tiny, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1))));
}
static inline int pq_x8_qs_0(int t) { return t == PQ_MXFP4 ? 8 : 16; }
static inline int pq_x8_is_lut(int t) { return t == PQ_IQ4_NL || t == PQ_MXFP4; }
static inline const int8_t *pq_x8_lut_0(int t) { return t == PQ_IQ4_NL ? pq_kvalues_iq4nl : pq_kvalues_mxfp4; }
PQ_INLINE void pq_x8_kernel_0(int t, int NR, int64_t nb, const uint8_t *wg, const uint8_t *x, size_t xs,
                              float *out, int64_t ldo, const float *bias) {
    const int pb = pq_x8_block_bytes(t), nq = 8;
    const __m256i m4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
    const int qo = pq_x8_qs_0(t);
    __m128i kv128 = _mm_setzero_si128();
    if (t == PQ_IQ4_NL || t == PQ_MXFP4) kv128 = _mm_loadu_si128((const __m128i *)pq_x8_lut_0(t));
    const __m256i lut = _mm256_set_m128i(kv128, kv128);
    /* IQ4_NL / MXFP4: ggml's even and odd blocks in two accumulator sets, an odd last block apart
     * (pq_avx2_lut_0) */
    const int two = pq_x8_is_lut(t);
    const int64_t tail = two && (nb & 1) ? nb - 1 : -1;
    __m256 facc[PQ_X8_NR][2][8], dtail[PQ_X8_NR];
    __m256i itail[PQ_X8_NR];
    for (int r = 0; r < NR; r++) {
        itail[r] = _mm256_setzero_si256();
        dtail[r] = _mm256_setzero_ps();
        for (int q = 0; q < nq; q++) facc[r][0][q] = facc[r][1][q] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * pb;
        const __m256 d = pq_x8_scales_0(t, blk);
        const int par = two ? (int)(b & 1) : 0;
        __m256 dd[PQ_X8_NR];
        for (int r = 0; r < NR; r++) dd[r] = _mm256_mul_ps(d, _mm256_set1_ps(pq_h2f(x + r * xs + 34 * b)));
        if (b == tail)
            for (int r = 0; r < NR; r++) dtail[r] = dd[r];
#pragma GCC unroll 8
        for (int q = 0; q < nq; q++) {
            __m256i w;
            if (pq_x8_is_nib(t)) {   /* quads 0..3: low nibbles (elements 4q..), 4..7: high (16 + 4(q - 4)..) */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + qo + 32 * (q % 4)));
                const __m256i nib = _mm256_and_si256(q < 4 ? v : _mm256_srli_epi16(v, 4), m4);
                w = t == PQ_Q4_0 ? _mm256_sub_epi8(nib, eight) : _mm256_shuffle_epi8(lut, nib);
            } else {
                w = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * q));
            }
            const __m256i wa = _mm256_sign_epi8(w, w);
            for (int r = 0; r < NR; r++) {
                const __m256i p = pq_dpbusd(wa, _mm256_sign_epi8(pq_x8_bcast(x + r * xs + 34 * b + 2 + 4 * q), w));
                if (b == tail) itail[r] = _mm256_add_epi32(itail[r], p);
                else facc[r][par][q] = _mm256_fmadd_ps(dd[r], _mm256_cvtepi32_ps(p), facc[r][par][q]);
            }
        }
    }
    __m256 fsum[PQ_X8_NR];
    for (int r = 0; r < NR; r++) {
        __m256 lanes[8];
        for (int q = 0; q < nq; q++) lanes[q] = two ? pq_x8_add(facc[r][0][q], facc[r][1][q]) : facc[r][0][q];
        fsum[r] = pq_x8_hsum8_lanes(lanes);
        if (tail >= 0) fsum[r] = _mm256_fmadd_ps(dtail[r], _mm256_cvtepi32_ps(itail[r]), fsum[r]);
    }
    pq_x8_store(NR, fsum, out, ldo, bias);
}

#if PQ_X8_OCT
/* Q4_0 / Q8_0 in octs, with the activations' bytes offset by 128 (pq_x8_arrange_x: unsigned, as
 * dpbusd's first operand wants) and the weights signed: sum((y + 128) w) - 128 sum(w) = sum(y w),
 * exactly, per 32-bit lane. Oct u holds quads 2u and 2u + 1 of each row (row l's lanes 2l, 2l + 1),
 * so accumulator u holds ggml's lanes 2u and 2u + 1 (see pq_x8_kernel_0): the sums of
 * accumulators 0 + 2 and 1 + 3 give each row's (L0 + L4, L1 + L5) and (L2 + L6, L3 + L7), their
 * sum its two halves and the pair sum its result. */
PQ_INLINE void pq_x8_kernel_0_oct(int t, int NR, int64_t nb, const uint8_t *wg, const uint8_t *x, size_t xs,
                                  float *out, int64_t ldo, const float *bias) {
    const int pb = pq_x8_block_bytes(t);
    const __m512i m4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8), ones = _mm512_set1_epi8(1);
    const int qo = pq_x8_qs_0(t);
    __m128i kv128 = _mm_setzero_si128();
    if (t == PQ_IQ4_NL || t == PQ_MXFP4) kv128 = _mm_loadu_si128((const __m128i *)pq_x8_lut_0(t));
    const __m512i lut = _mm512_broadcast_i32x4(kv128);
    const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    /* IQ4_NL / MXFP4: ggml's even and odd blocks in two accumulator sets, an odd last block apart
     * (see pq_x8_kernel_0) */
    const int two = pq_x8_is_lut(t);
    const int64_t tail = two && (nb & 1) ? nb - 1 : -1;
    __m512 facc[PQ_X8_NR][2][4];
    __m512i itail[PQ_X8_NR];
    __m256 dtail[PQ_X8_NR];
    for (int r = 0; r < NR; r++) {
        itail[r] = _mm512_setzero_si512();
        dtail[r] = _mm256_setzero_ps();
        for (int u = 0; u < 4; u++) facc[r][0][u] = facc[r][1][u] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * pb;
        const int par = two ? (int)(b & 1) : 0;
        __m512i w[4], start[4];
        for (int u = 0; u < 4; u++) {
            if (pq_x8_is_nib(t)) {   /* octs 0, 1: low nibbles (elements 8u..), 2, 3: high (16 + 8(u - 2)..) */
                const __m512i v = _mm512_loadu_si512((const void *)(blk + qo + 64 * (u % 2)));
                const __m512i nib = _mm512_and_si512(u < 2 ? v : _mm512_srli_epi16(v, 4), m4);
                w[u] = t == PQ_Q4_0 ? _mm512_sub_epi8(nib, eight) : _mm512_shuffle_epi8(lut, nib);
            } else {
                w[u] = _mm512_loadu_si512((const void *)(blk + 16 + 64 * u));
            }
            start[u] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                        _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w[u]), 7));
        }
        const __m512 d = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(pq_x8_scales_0(t, blk)));
        for (int r = 0; r < NR; r++) {
            const uint8_t *y = x + r * xs + 34 * b;
            const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(pq_h2f(y)));
            if (b == tail) dtail[r] = _mm256_mul_ps(pq_x8_scales_0(t, blk), _mm256_set1_ps(pq_h2f(y)));
            for (int u = 0; u < 4; u++) {
                int64_t y8;
                memcpy(&y8, y + 2 + 8 * u, 8);
                const __m512i acc = _mm512_dpbusd_epi32(start[u], _mm512_set1_epi64(y8), w[u]);
                if (b == tail) itail[r] = _mm512_add_epi32(itail[r], acc);
                else facc[r][par][u] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(acc), facc[r][par][u]);
            }
        }
    }
    __m256 fsum[PQ_X8_NR];
    for (int r = 0; r < NR; r++)
    {
        __m512 f[4];
        for (int u = 0; u < 4; u++) {
            f[u] = two ? _mm512_add_ps(facc[r][0][u], facc[r][1][u]) : facc[r][0][u];
            PIN_VEC(f[u]);
        }
        __m512 a = _mm512_add_ps(f[0], f[2]), c = _mm512_add_ps(f[1], f[3]);
        PIN_VEC(a);
        PIN_VEC(c);
        __m512 t = _mm512_add_ps(a, c);
        PIN_VEC(t);
        fsum[r] = pq_x8_pair_sums_ps(t);
        /* the last block's integer sums: each row's two lanes, exact in float (|sum| < 2^24) */
        if (tail >= 0)
            fsum[r] = _mm256_fmadd_ps(dtail[r], pq_x8_pair_sums_ps(_mm512_cvtepi32_ps(itail[r])), fsum[r]);
    }
    pq_x8_store(NR, fsum, out, ldo, bias);
}
#endif

#if PQ_X8_OCT
/* Q4_K, Q5_K and Q6_K in octs, in ggml's float steps (its AVX2 vec_dot_q4_K / q5_K / q6_K): each
 * output keeps 8 int32 lanes per super-block, lane i the products of quad i (elements 4i..4i+3)
 * of every 32 elements times their group's scale (Q6_K less its lane of the -32 offset's
 * correction, 32 * (scale * bsum) of groups 2i and 2i + 1), converted and multiplied by d_w * d_x
 * into 8 float lanes added at the end as hsum_float_8 does; Q4_K's minimums go into 4 float lanes
 * (lane i: sub-blocks 2i and 2i + 1) added as ggml does, Q5_K's into one float per block. Oct j
 * of a run holds quads j and j + 4 (row l's lanes 2l, 2l + 1), so accumulator j holds each row's
 * lanes j and j + 4, and its pair sums give L_j + L_{j+4}. The same integers as pq_x8_kernel. */
PQ_INLINE void pq_x8_kernel_k_oct(int t, int NR, int64_t nb, const uint8_t *wg, const uint8_t *x, size_t xs,
                                  float *out, int64_t ldo, const float *bias) {
    const int pb = pq_x8_block_bytes(t);
    const int k4 = t == PQ_Q4_K || t == PQ_Q5_K;
    const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i ilv = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    __m512 facc[PQ_X8_NR][4];
    __m256 macc[PQ_X8_NR][4];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < 4; j++) { facc[r][j] = _mm512_setzero_ps(); macc[r][j] = _mm256_setzero_ps(); }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * pb;
        const uint8_t *sc = blk + (k4 ? 32 : 16);
        __m512i s32[8];
        for (int s = 0; s < 8; s++) {
            const __m128i s88 = pq_x8_oct_scales(sc, s, k4);
            /* the scale in each lane's low int16, 0 above: dpwssd then adds oct sum * scale (the oct
             * sums fit int16: at most 4 * 63 * 127 in magnitude) in one instruction */
            s32[s] = _mm512_and_si512(k4 ? _mm512_cvtepu8_epi32(s88) : _mm512_cvtepi8_epi32(s88),
                                      _mm512_set1_epi32(0xFFFF));
        }
        /* per row lane: Q4_K / Q5_K min_p * (bsum[2p] + bsum[2p + 1]), Q6_K scale * bsum of groups
         * 2p and 2p + 1 (as pq_x8_kernel) */
        __m256i pairs[8];
        for (int p = 0; p < 8; p++) {
            const __m128i a = _mm_loadl_epi64((const __m128i *)(blk + (k4 ? 96 + 8 * p : 16 + 16 * p)));
            const __m128i c = k4 ? a : _mm_loadl_epi64((const __m128i *)(blk + 24 + 16 * p));
            pairs[p] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, c));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 dmin = k4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : d;
        __m512 dd[PQ_X8_NR];
        __m512i corr[PQ_X8_NR][4];
        for (int r = 0; r < NR; r++) {
            const uint8_t *y = x + r * xs + 292 * b;
            const float yd = pq_ld_f32(y);
            dd[r] = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(yd), d)));
            __m256i cv[8];
            for (int p = 0; p < 8; p++) cv[p] = _mm256_madd_epi16(pairs[p], pq_x8_bcast(y + 260 + 4 * p));
            if (t == PQ_Q6_K) {
                for (int j = 0; j < 4; j++)
                    corr[r][j] = _mm512_slli_epi32(_mm512_permutex2var_epi32(_mm512_castsi256_si512(cv[j]), ilv,
                                                                             _mm512_castsi256_si512(cv[j + 4])), 5);
            } else {
                const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(-yd), dmin);
                if (t == PQ_Q4_K) {
                    for (int i = 0; i < 4; i++)
                        macc[r][i] = _mm256_fmadd_ps(dm, _mm256_cvtepi32_ps(_mm256_add_epi32(cv[2 * i], cv[2 * i + 1])),
                                                     macc[r][i]);
                } else {
                    __m256i tot = cv[0];
                    for (int p = 1; p < 8; p++) tot = _mm256_add_epi32(tot, cv[p]);
                    macc[r][0] = _mm256_fmadd_ps(dm, _mm256_cvtepi32_ps(tot), macc[r][0]);
                }
            }
        }
        for (int j = 0; j < 4; j++) {
            __m512i zs[PQ_X8_NR];
            for (int r = 0; r < NR; r++) zs[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int s = 0; s < 8; s++) {
                const __m512i q = pq_x8_oct(t, blk, s, j);
                for (int r = 0; r < NR; r++) {
                    int64_t y8;
                    memcpy(&y8, x + r * xs + 292 * b + 4 + 32 * s + 8 * j, 8);
                    zs[r] = _mm512_dpwssd_epi32(zs[r], _mm512_dpbusd_epi32(_mm512_setzero_si512(), q,
                                                                           _mm512_set1_epi64(y8)), s32[s]);
                }
            }
            for (int r = 0; r < NR; r++) {
                const __m512i v = t == PQ_Q6_K ? _mm512_sub_epi32(zs[r], corr[r][j]) : zs[r];
                facc[r][j] = _mm512_fmadd_ps(dd[r], _mm512_cvtepi32_ps(v), facc[r][j]);
            }
        }
    }
    __m256 fsum[PQ_X8_NR];
    for (int r = 0; r < NR; r++) {
        const __m256 s0 = pq_x8_add(pq_x8_pair_sums_ps(facc[r][0]), pq_x8_pair_sums_ps(facc[r][2]));
        const __m256 s1 = pq_x8_add(pq_x8_pair_sums_ps(facc[r][1]), pq_x8_pair_sums_ps(facc[r][3]));
        fsum[r] = pq_x8_add(s0, s1);
        if (t == PQ_Q4_K)
            fsum[r] = pq_x8_add(fsum[r], pq_x8_add(pq_x8_add(macc[r][0], macc[r][2]), pq_x8_add(macc[r][1], macc[r][3])));
        else if (t == PQ_Q5_K)
            fsum[r] = pq_x8_add(fsum[r], macc[r][0]);
    }
    pq_x8_store(NR, fsum, out, ldo, bias);
}
#define PQ_X8_KERNEL_K pq_x8_kernel_k_oct
#else
#define PQ_X8_KERNEL_K pq_x8_kernel
#endif

#if PQ_X8_OCT
#define PQ_X8_KERNEL_0 pq_x8_kernel_0_oct
#else
#define PQ_X8_KERNEL_0 pq_x8_kernel_0
#endif
#ifndef PQ_X8_LUT_NR
#define PQ_X8_LUT_NR 2
#endif
typedef void (*pq_x8_fn)(int64_t nb, const uint8_t *wg, const uint8_t *x, size_t xs, float *out, int64_t ldo,
                         const float *bias);
static pq_x8_fn pq_x8_kernel_for(int t, int nr);
#define PQ_X8_DEF1(name, t, nr) \
    static void name##_##nr(int64_t nb, const uint8_t *wg, const uint8_t *x, size_t xs, float *out, int64_t ldo, \
                            const float *bias) { \
        if (pq_x8_is_lut(t) && nr > PQ_X8_LUT_NR) { \
            /* two accumulator sets: a few activation rows at a time keep them in registers */ \
            int r0 = 0; \
            for (; r0 + PQ_X8_LUT_NR <= nr; r0 += PQ_X8_LUT_NR) \
                PQ_X8_KERNEL_0(t, PQ_X8_LUT_NR, nb, wg, x + r0 * xs, xs, out + r0 * ldo, ldo, bias); \
            if (r0 < nr) pq_x8_kernel_for(t, nr - r0)(nb, wg, x + r0 * xs, xs, out + r0 * ldo, ldo, bias); \
        } \
        else if (pq_x8_is_0(t)) PQ_X8_KERNEL_0(t, nr, nb, wg, x, xs, out, ldo, bias); \
        else PQ_X8_KERNEL_K(t, nr, nb, wg, x, xs, out, ldo, bias); }
#if PQ_X8_NR == 8
#define PQ_X8_DEF(name, t) PQ_X8_DEF1(name, t, 1) PQ_X8_DEF1(name, t, 2) PQ_X8_DEF1(name, t, 3) PQ_X8_DEF1(name, t, 4) \
    PQ_X8_DEF1(name, t, 5) PQ_X8_DEF1(name, t, 6) PQ_X8_DEF1(name, t, 7) PQ_X8_DEF1(name, t, 8)
#define PQ_X8_TAB(name) { name##_1, name##_2, name##_3, name##_4, name##_5, name##_6, name##_7, name##_8 }
#else
#define PQ_X8_DEF(name, t) PQ_X8_DEF1(name, t, 1) PQ_X8_DEF1(name, t, 2) PQ_X8_DEF1(name, t, 3) PQ_X8_DEF1(name, t, 4)
#define PQ_X8_TAB(name) { name##_1, name##_2, name##_3, name##_4 }
#endif
PQ_X8_DEF(pq_x8_q4_K, PQ_Q4_K)
PQ_X8_DEF(pq_x8_q5_K, PQ_Q5_K)
PQ_X8_DEF(pq_x8_q6_K, PQ_Q6_K)
#if !PQ_X8_OCT
PQ_X8_DEF(pq_x8_q3_K, PQ_Q3_K)
PQ_X8_DEF(pq_x8_q2_K, PQ_Q2_K)
#endif
PQ_X8_DEF(pq_x8_q4_0, PQ_Q4_0)
PQ_X8_DEF(pq_x8_q8_0, PQ_Q8_0)
PQ_X8_DEF(pq_x8_iq4_nl, PQ_IQ4_NL)
PQ_X8_DEF(pq_x8_mxfp4, PQ_MXFP4)

static pq_x8_fn pq_x8_kernel_for(int t, int nr) {
    static const pq_x8_fn q4[PQ_X8_NR] = PQ_X8_TAB(pq_x8_q4_K), q6[PQ_X8_NR] = PQ_X8_TAB(pq_x8_q6_K);
    static const pq_x8_fn q40[PQ_X8_NR] = PQ_X8_TAB(pq_x8_q4_0), q80[PQ_X8_NR] = PQ_X8_TAB(pq_x8_q8_0);
    static const pq_x8_fn q5[PQ_X8_NR] = PQ_X8_TAB(pq_x8_q5_K);
    static const pq_x8_fn nl[PQ_X8_NR] = PQ_X8_TAB(pq_x8_iq4_nl), mx[PQ_X8_NR] = PQ_X8_TAB(pq_x8_mxfp4);
#if !PQ_X8_OCT
    static const pq_x8_fn q3[PQ_X8_NR] = PQ_X8_TAB(pq_x8_q3_K), q2[PQ_X8_NR] = PQ_X8_TAB(pq_x8_q2_K);
    if (t == PQ_Q3_K) return q3[nr - 1];
    if (t == PQ_Q2_K) return q2[nr - 1];
#endif
    switch (t) {
    case PQ_Q4_K: return q4[nr - 1];
    case PQ_Q5_K: return q5[nr - 1];
    case PQ_Q6_K: return q6[nr - 1];
    case PQ_Q4_0: return q40[nr - 1];
    case PQ_IQ4_NL: return nl[nr - 1];
    case PQ_MXFP4: return mx[nr - 1];
    default: return q80[nr - 1];
    }
}

typedef struct {
    int t;
    const uint8_t *wp; int64_t ngroups, gstride, tile, first_item, col;
    const float *bias;
} pq_x8_part;

typedef struct {
    int64_t n, k;
    float *out; int64_t ldo;
    uint8_t *xq; int64_t xq_stride;
    int nparts; int64_t items_per_chunk;
    int nt;   /* threads of the pool run (pq_prefetch_next_tile) */
    pq_x8_part part[PQ_X8_MAX_PARTS];
} pq_x8_job;

/* The next tile's prefetch. With more activation rows than one kernel call takes, an item goes
 * over its tile in several passes: the first reads it from memory, the others from L2, so memory
 * idled after the first pass while the first pass alone waited for it. Every kernel call of the
 * item prefetches an equal slice of the tile this thread most likely claims next (items are
 * claimed in order: nt items on), which spreads the reads over all the passes and lets that
 * tile's first pass read from cache. With one pass the hardware's prefetcher keeps up and this
 * only cost (Q4_K at 1-8 rows), so nothing is fetched then. (The file-layout kernels, at a third
 * of this speed, do not wait on memory: prefetching there changed nothing.) Row groups u0..u1 of
 * `units` at `stride` bytes from w (u1 > u0), gone over in `passes` passes by nt >= 1 threads. */
typedef struct { const uint8_t *next, *end; int64_t slice; } pq_prefetch;
static inline pq_prefetch pq_prefetch_next_tile(const uint8_t *w, int64_t stride, int64_t u0, int64_t u1,
                                                int64_t units, int nt, int64_t passes) {
    const int64_t ahead = (int64_t)nt * (u1 - u0);
    const int64_t n0 = u0 + ahead < units ? u0 + ahead : units, n1 = u1 + ahead < units ? u1 + ahead : units;
    pq_prefetch p = {w + n0 * stride, w + n1 * stride, 0};
    if (passes > 1) p.slice = ((n1 - n0) * stride / (passes * (u1 - u0)) + 127) & ~(int64_t)63;
    return p;
}
static inline void pq_prefetch_slice(pq_prefetch *p) {
    const uint8_t *b = p->next + p->slice < p->end ? p->next + p->slice : p->end;
    for (; p->next < b; p->next += 64) __builtin_prefetch(p->next, 0, 3);
}

static void pq_x8_tile_item(void *ctx, int64_t item) {
    const pq_x8_job *jb = (const pq_x8_job *)ctx;
    const int64_t c0 = item / jb->items_per_chunk * PQ_ROW_CHUNK;
    const int64_t c1 = c0 + PQ_ROW_CHUNK < jb->n ? c0 + PQ_ROW_CHUNK : jb->n;
    const int64_t it = item % jb->items_per_chunk;
    int p = 0;
    while (p + 1 < jb->nparts && jb->part[p + 1].first_item <= it) p++;
    const pq_x8_part *pt = &jb->part[p];
    const int64_t g0 = (it - pt->first_item) * pt->tile;
    const int64_t g1 = g0 + pt->tile < pt->ngroups ? g0 + pt->tile : pt->ngroups;
    const int64_t nb = jb->k / pq_x8_block_elems(pt->t);
    pq_prefetch pf = pq_prefetch_next_tile(pt->wp, pt->gstride, g0, g1, pt->ngroups, jb->nt,
                                           (c1 - c0 + PQ_X8_NR - 1) / PQ_X8_NR);
    for (int64_t r0 = c0; r0 < c1; r0 += PQ_X8_NR) {
        const int nr = (int)(c1 - r0 < PQ_X8_NR ? c1 - r0 : PQ_X8_NR);
        const pq_x8_fn fn = pq_x8_kernel_for(pt->t, nr);
        for (int64_t g = g0; g < g1; g++) {
            pq_prefetch_slice(&pf);
            fn(nb, pt->wp + g * pt->gstride, jb->xq + r0 * jb->xq_stride, (size_t)jb->xq_stride,
               jb->out + r0 * jb->ldo + pt->col + 8 * g, jb->ldo, pt->bias ? pt->bias + 8 * g : NULL);
        }
    }
}

#if PQ_X8_OCT
/* The quantized activation rows as the oct kernels read them, each run of 32 values in place:
 * Q8_0 (pq_x8_kernel_0_oct) each value + 128 as an unsigned byte; Q8_K (the K-quants) its quads in
 * the octs' order [0 4 1 5 2 6 3 7]. */
static void pq_x8_arrange_x(int vt, uint8_t *xq, int64_t n, int64_t k, int64_t xq_stride) {
    if (vt != PQ_Q8_0 && vt != PQ_Q8_K) return;
    const int q8k = vt == PQ_Q8_K;
    const int64_t nb = q8k ? k / PQ_QK_K : k / 32, bbytes = q8k ? 292 : 34, qoff = q8k ? 4 : 2;
    const int runs = q8k ? 8 : 1;
    const __m256i idx = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), offset = _mm256_set1_epi8((char)0x80);
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < nb; b++)
            for (int c = 0; c < runs; c++) {
                __m256i *p = (__m256i *)(xq + r * xq_stride + bbytes * b + qoff + 32 * c);
                const __m256i v = _mm256_loadu_si256(p);
                _mm256_storeu_si256(p, q8k ? _mm256_permutevar8x32_epi32(v, idx) : _mm256_xor_si256(v, offset));
            }
}
#endif

/* out[:, the parts' columns side by side] = x . (each part's weights, repacked by pq_repack_x8:
 * ms[p] rows, a multiple of 8)^T (+ biases[p]), as pq_mul_mat does for one weight: the activation
 * rows quantized once into xq, then (chunk of activation rows) x (tile of row groups of a part)
 * items on the pool. Returns -1 (nothing done) for more than PQ_X8_MAX_PARTS parts or parts of
 * different activation types. */
PQ_API int pq_mul_mat_x8_parts(int nparts, const int *types, const uint8_t *const *wps, const int64_t *ms,
                               const float *const *biases, const float *x, int64_t n, int64_t k, int64_t ldx,
                               float *out, int64_t ldo, uint8_t *xq, int64_t xq_stride, int n_threads) {
    if (nparts < 1 || nparts > PQ_X8_MAX_PARTS) return -1;
    pq_traits tr;
    pq_get_traits(types[0], &tr);
    const int vt = tr.vec_type;
    pq_x8_job job = {n, k, out, ldo, xq, xq_stride, nparts, 0, 1, {{0}}};
    int64_t col = 0, work = 0, ngroups_all = 0;
    for (int p = 0; p < nparts; p++) {
        pq_get_traits(types[p], &tr);
        if (tr.vec_type != vt) return -1;
        pq_x8_part *pt = &job.part[p];
        pt->t = types[p]; pt->wp = wps[p]; pt->ngroups = ms[p] / 8; pt->col = col; pt->bias = biases ? biases[p] : NULL;
        pt->gstride = k / pq_x8_block_elems(types[p]) * pq_x8_block_bytes(types[p]);
        col += ms[p];
        work += pt->ngroups * pt->gstride;
        ngroups_all += pt->ngroups;
    }
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > ngroups_all) nt = (int)(ngroups_all > 0 ? ngroups_all : 1);
    /* below ~10 us of single-thread work one thread does it all (handing out items costs ~1 us) */
    if (work * ((n + PQ_X8_NR - 1) / PQ_X8_NR) < 65536) nt = 1;
    job.nt = nt;
    const int64_t tile_bytes = pq_tile_bytes(work, nt, n <= PQ_X8_NR);
    for (int p = 0; p < nparts; p++) {
        pq_x8_part *pt = &job.part[p];
        pt->tile = tile_bytes / (pt->gstride > 0 ? pt->gstride : 1);
        if (pt->tile < 1) pt->tile = 1;
        pt->first_item = job.items_per_chunk;
        job.items_per_chunk += (pt->ngroups + pt->tile - 1) / pt->tile;
    }
    pq_rows_job rows = {types[0], vt, 0, x, k, ldx, xq, xq_stride};
    pq_quantize_rows_pool(&rows, n, nt, n <= 2 * PQ_X8_NR);
#if PQ_X8_OCT
    pq_x8_arrange_x(vt, xq, n, k, xq_stride);
#endif
    const int64_t nchunks = (n + PQ_ROW_CHUNK - 1) / PQ_ROW_CHUNK;
    pq_pool_run(nt, nchunks * job.items_per_chunk, pq_x8_tile_item, &job);
    return 0;
}

/* For kernels that call the repacked products themselves (the MoE FFN's experts): activation rows
 * quantized to vt put in the order the kernels read (nothing to do without the oct kernels), and
 * one kernel call of nr <= PQ_X8_NR activation rows (stride xs) against one group of 8 weight rows
 * of k elements: out[r * ldo + l] = row l's product with activation row r. */
PQ_API void pq_x8_prepare_x(int vt, uint8_t *xq, int64_t n, int64_t k, int64_t stride) {
#if PQ_X8_OCT
    pq_x8_arrange_x(vt, xq, n, k, stride);
#else
    (void)vt; (void)xq; (void)n; (void)k; (void)stride;
#endif
}
PQ_API void pq_x8_dot8(int t, int nr, int64_t k, const uint8_t *wg, const uint8_t *x, size_t xs, float *out,
                       int64_t ldo) {
    pq_x8_kernel_for(t, nr)(k / pq_x8_block_elems(t), wg, x, xs, out, ldo, NULL);
}
PQ_API int pq_x8_max_rows(void) { return PQ_X8_NR; }
PQ_API int pq_have_x8(void) { return 1; }
#else
PQ_API void pq_x8_prepare_x(int vt, uint8_t *xq, int64_t n, int64_t k, int64_t stride) {
    (void)vt; (void)xq; (void)n; (void)k; (void)stride;
}
PQ_API void pq_x8_dot8(int t, int nr, int64_t k, const uint8_t *wg, const uint8_t *x, size_t xs, float *out,
                       int64_t ldo) {
    (void)t; (void)nr; (void)k; (void)wg; (void)x; (void)xs; (void)out; (void)ldo;
    abort();   /* callers check pq_have_x8() */
}
PQ_API int pq_x8_max_rows(void) { return 1; }
PQ_API int pq_have_x8(void) { return 0; }
PQ_API int pq_mul_mat_x8_parts(int nparts, const int *types, const uint8_t *const *wps, const int64_t *ms,
                               const float *const *biases, const float *x, int64_t n, int64_t k, int64_t ldx,
                               float *out, int64_t ldo, uint8_t *xq, int64_t xq_stride, int n_threads) {
    (void)nparts; (void)types; (void)wps; (void)ms; (void)biases; (void)x; (void)n; (void)k; (void)ldx;
    (void)out; (void)ldo; (void)xq; (void)xq_stride; (void)n_threads;
    abort();   /* callers check pq_have_x8() */
}
#endif /* PQ_HAVE_AVX2 */

#endif /* PYLLAMA_GGML_X8_H */
