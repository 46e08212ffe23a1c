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
#pragma GCC pop_options

#endif /* PYLLAMA_GEMM_H */
