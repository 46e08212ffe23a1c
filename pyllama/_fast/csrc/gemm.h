/* The C/C++ half of _fast/gemm.pyx. */
#ifndef PYLLAMA_GEMM_H
#define PYLLAMA_GEMM_H

#include <string.h>
/* Every output element is summed exactly as written, whatever the block shape: with the
   project's -fassociative-math GCC splits or reorders the reduction chains differently in
   each template instantiation (fewer chains get more partial sums), so a row's result would
   depend on how many rows share its block. */
#pragma GCC push_options
#pragma GCC optimize("no-associative-math", "fp-contract=off")
/* One accumulator per (x row, weight row) pair must stay in registers: 16-lane vectors with
   4x4 blocks fill AVX-512's 32 registers; AVX2 has 16 registers of 8 lanes, so there the
   vectors are 8 lanes and x rows go 2 at a time (8 accumulators + 4 weight vectors + 1). */
#if defined(__AVX512F__)
#define PL_LANES 16
#define PL_MB 4
#else
#define PL_LANES 8
#define PL_MB 2
#endif
typedef float pl_v16 __attribute__((vector_size(PL_LANES * 4)));

static inline pl_v16 pl_load(const float* p) { pl_v16 v; memcpy(&v, p, sizeof v); return v; }

/* a fused multiply-add asked for explicitly: contraction is off in this block, so whether a
   product is fused never depends on how the compiler scheduled an instantiation */
#include <immintrin.h>
static inline pl_v16 pl_fma(pl_v16 a, pl_v16 b, pl_v16 c) {
#if defined(__AVX512F__)
    return (pl_v16) _mm512_fmadd_ps((__m512) a, (__m512) b, (__m512) c);
#elif defined(__FMA__)
    return (pl_v16) _mm256_fmadd_ps((__m256) a, (__m256) b, (__m256) c);
#else
    return a * b + c;
#endif
}

/* The lane sum and the K tail, out of line so every block shape shares one code path. The
   lanes are added as a tree of halves (16 -> 8 -> 4 -> 2 -> 1), a fixed order like any other
   but four dependent vector adds instead of fifteen dependent scalar ones: one such sum per
   output element was a tenth of a 16-row product (K = 768). */
__attribute__((noinline))
static float pl_finish(const pl_v16* v, const float* x, const float* w, long k, long K) {
    typedef float pl_f8 __attribute__((vector_size(32)));
    typedef float pl_f4 __attribute__((vector_size(16)));
#if PL_LANES == 16
    const pl_f8 h = __builtin_shufflevector(*v, *v, 0, 1, 2, 3, 4, 5, 6, 7)
                  + __builtin_shufflevector(*v, *v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const pl_f8 h = *v;
#endif
    const pl_f4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    float s = (q[0] + q[2]) + (q[1] + q[3]);
    for (; k < K; ++k) s += x[k] * w[k];
    return s;
}

/* MB rows of x against NB rows of w; every element sums its lane partials in a fixed order. */
template <int MB, int NB>
static inline void pl_block(const float* x, long ldx, const float* w, long ldw, float* out,
                            long ldo, const float* bias, long K, const float* pf, int npf) {
    pl_v16 acc[MB][NB];
    for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NB; ++j) acc[i][j] = (pl_v16){0};
    long k = 0;
    for (; k + PL_LANES <= K; k += PL_LANES) {
        pl_v16 wv[NB];
        for (int j = 0; j < NB; ++j) wv[j] = pl_load(w + j * ldw + k);
        for (int j = 0; j < npf; ++j) __builtin_prefetch(pf + j * ldw + k, 0, 1);
        for (int i = 0; i < MB; ++i) {
            pl_v16 xv = pl_load(x + i * ldx + k);
            for (int j = 0; j < NB; ++j) acc[i][j] = pl_fma(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MB; ++i) {
        for (int j = 0; j < NB; ++j) {
            float s = pl_finish(&acc[i][j], x + i * ldx, w + j * ldw, k, K);
            out[i * ldo + j] = bias ? s + bias[j] : s;
        }
    }
}

template <int NB>
static inline void pl_rows(const float* x, long M, long ldx, const float* w, long ldw,
                           float* out, long ldo, const float* bias, long K, const float* pf) {
    /* The passes over x share out pulling a later block's 4 weight rows into L2, a row or
       more each, so one core's memory stream runs evenly beside the arithmetic: all four in
       the first pass (into L1) left 16-row products waiting on memory a fifth longer. */
    const long passes = (M + PL_MB - 1) / PL_MB;
    const int per = (int)((4 + passes - 1) / passes);
    int left = pf ? 4 : 0;
    long m = 0;
    for (; m + PL_MB <= M; m += PL_MB) {
        const int n = left < per ? left : per;
        pl_block<PL_MB, NB>(x + m * ldx, ldx, w, ldw, out + m * ldo, ldo, bias, K, pf, n);
        pf += n * ldw;
        left -= n;
    }
    switch (M - m) {
        case 3: pl_block<3, NB>(x + m * ldx, ldx, w, ldw, out + m * ldo, ldo, bias, K, pf, left); break;
        case 2: pl_block<2, NB>(x + m * ldx, ldx, w, ldw, out + m * ldo, ldo, bias, K, pf, left); break;
        case 1: pl_block<1, NB>(x + m * ldx, ldx, w, ldw, out + m * ldo, ldo, bias, K, pf, left); break;
        default: break;
    }
}

/* Weight rows [4*b0, 4*b1) of the product (one thread's share). */
static void pl_mm_t_range(const float* x, long M, long K, long ldx, const float* w, long N,
                          float* out, long ldo, const float* bias, long b0, long b1) {
    for (long b = b0; b < b1; ++b) {
        long n = 4 * b;
        const float* bb = bias ? bias + n : 0;
        const float* pf = n + 12 <= N ? w + (n + 8) * K : 0;
        switch (N - n < 4 ? N - n : 4) {
            case 4: pl_rows<4>(x, M, ldx, w + n * K, K, out + n, ldo, bb, K, pf); break;
            case 3: pl_rows<3>(x, M, ldx, w + n * K, K, out + n, ldo, bb, K, pf); break;
            case 2: pl_rows<2>(x, M, ldx, w + n * K, K, out + n, ldo, bb, K, pf); break;
            default: pl_rows<1>(x, M, ldx, w + n * K, K, out + n, ldo, bb, K, pf); break;
        }
    }
}
/* Products of many rows (prompts, an encoder's micro-batch): out = x @ w.T (+ bias) with the
   weight rows taken PL_NR at a time into a panel stored k-major (pack[k * PL_NR + j] = w[n + j][k]),
   which every PL_PMR rows of x then multiply as broadcasts of x[i][k] against two vectors of the
   panel: PL_PMR x PL_NR sums in registers and no lane sums at the end (BLAS's packed form, on the
   products' pool: OpenBLAS's own threads spin beside the pool's after every call, each set
   taking a core the other wanted). Each output sums its products in k order, one fused
   multiply-add chain, whatever the block: a row's result never depends on the rows beside it. */
#define PL_NR (2 * PL_LANES)
#if PL_LANES == 16
#define PL_PMR 8
#else
#define PL_PMR 4
#endif

static inline pl_v16 pl_splat(float v) {
#if defined(__AVX512F__)
    return (pl_v16) _mm512_set1_ps(v);
#elif defined(__AVX__)
    return (pl_v16) _mm256_set1_ps(v);
#else
    pl_v16 r;
    for (int i = 0; i < PL_LANES; ++i) r[i] = v;
    return r;
#endif
}

/* Weight rows [n, n + PL_NR) into pack (rows past N as zeros), 16 columns of k at a time so that
   the block being written (16 x PL_NR floats) stays in L1: written row by row down the whole
   panel, a panel wider than L1 went to L2 and back for every one of its PL_NR rows (the packing
   then took a third of the product). */
static void pl_pack_panel(const float* w, long K, long N, long n, float* pack) {
    const long nr = N - n < PL_NR ? N - n : PL_NR;
    for (long k0 = 0; k0 < K; k0 += 16) {
        const long k1 = k0 + 16 < K ? k0 + 16 : K;
        for (long j = 0; j < nr; ++j) {
            const float* wr = w + (n + j) * K;
            /* the row's line 4 blocks on: 32 rows read a line at a time are more streams than the
               hardware prefetcher follows, and the weights come from memory at every step */
            if (k0 + 64 < K) __builtin_prefetch(wr + k0 + 64, 0, 0);
            for (long k = k0; k < k1; ++k) pack[k * PL_NR + j] = wr[k];
        }
        for (long j = nr; j < PL_NR; ++j)
            for (long k = k0; k < k1; ++k) pack[k * PL_NR + j] = 0.0f;
    }
}

/* MB rows of x times one packed panel: out[i][0, nr) (+ bias). */
template <int MB>
static inline void pl_panel_rows(const float* x, long ldx, const float* pack, long K, float* out, long ldo,
                                 const float* bias, long nr) {
    pl_v16 acc[MB][2];
    for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = (pl_v16){0};
    for (long k = 0; k < K; ++k) {
        const pl_v16 w0 = pl_load(pack + k * PL_NR), w1 = pl_load(pack + k * PL_NR + PL_LANES);
        for (int i = 0; i < MB; ++i) {
            const pl_v16 xb = pl_splat(x[i * ldx + k]);
            acc[i][0] = pl_fma(xb, w0, acc[i][0]);
            acc[i][1] = pl_fma(xb, w1, acc[i][1]);
        }
    }
    for (int i = 0; i < MB; ++i) {
        float t[PL_NR];
        memcpy(t, acc[i], sizeof t);
        float* o = out + i * ldo;
        if (bias)
            for (long j = 0; j < nr; ++j) o[j] = t[j] + bias[j];
        else
            memcpy(o, t, sizeof(float) * nr);
    }
}

/* Rows [m0, m1) of x against weight rows [n, n + PL_NR) (one panel, packed into `pack`, K * PL_NR
   floats). */
static void pl_mm_panel(const float* x, long K, long ldx, const float* w, long N, float* out, long ldo,
                        const float* bias, long n, long m0, long m1, float* pack) {
    const long nr = N - n < PL_NR ? N - n : PL_NR;
    const float* bb = bias ? bias + n : 0;
    pl_pack_panel(w, K, N, n, pack);
    long m = m0;
    for (; m + PL_PMR <= m1; m += PL_PMR)
        pl_panel_rows<PL_PMR>(x + m * ldx, ldx, pack, K, out + m * ldo + n, ldo, bb, nr);
    switch (m1 - m) {
#if PL_PMR == 8
        case 7: pl_panel_rows<7>(x + m * ldx, ldx, pack, K, out + m * ldo + n, ldo, bb, nr); break;
        case 6: pl_panel_rows<6>(x + m * ldx, ldx, pack, K, out + m * ldo + n, ldo, bb, nr); break;
        case 5: pl_panel_rows<5>(x + m * ldx, ldx, pack, K, out + m * ldo + n, ldo, bb, nr); break;
        case 4: pl_panel_rows<4>(x + m * ldx, ldx, pack, K, out + m * ldo + n, ldo, bb, nr); break;
#endif
        case 3: pl_panel_rows<3>(x + m * ldx, ldx, pack, K, out + m * ldo + n, ldo, bb, nr); break;
        case 2: pl_panel_rows<2>(x + m * ldx, ldx, pack, K, out + m * ldo + n, ldo, bb, nr); break;
        case 1: pl_panel_rows<1>(x + m * ldx, ldx, pack, K, out + m * ldo + n, ldo, bb, nr); break;
        default: break;
    }
}
static inline long pl_panel_width(void) { return PL_NR; }

#pragma GCC pop_options

#endif /* PYLLAMA_GEMM_H */
