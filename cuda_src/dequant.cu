// Weight conversion at load: every supported file type -> the device's half-precision weight type
// (F16 by default, BF16 on request). Each value is computed exactly as ggml's dequantize_row_*
// (and pyllama/_fast/quant.pyx) computes it in float32 -- the products are exact and only the last
// operation rounds, so FMA contraction changes nothing -- then rounded once to the target type. The
// result equals the CPU's float32 weight rounded to nearest even.
//
// dequant_<src>_<dst>(src bytes, dst, n values): n a whole number of blocks of the source type.
#include "common.cuh"

__device__ __forceinline__ float load_f16(const uint8_t* p) {
    return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

__device__ __forceinline__ float load_bf16(const uint8_t* p) {
    return __uint_as_float((unsigned int)(p[0] | (p[1] << 8)) << 16);
}

// Q8_0: d f16 | qs int8[32]
__device__ __forceinline__ float deq_q8_0(const uint8_t* src, long long i) {
    const uint8_t* b = src + (i >> 5) * 34;
    return (float)(int8_t)b[2 + (i & 31)] * load_f16(b);
}

// Q4_0: d f16 | qs[16]: low nibbles are values 0..15, high nibbles 16..31, minus 8
__device__ __forceinline__ float deq_q4_0(const uint8_t* src, long long i) {
    const uint8_t* b = src + (i >> 5) * 18;
    const int j = (int)(i & 31);
    const int q = j < 16 ? (b[2 + j] & 0x0F) : (b[2 + j - 16] >> 4);
    return (float)(q - 8) * load_f16(b);
}

// The 6-bit scale and min of group g of a Q4_K / Q5_K block (ggml's get_scale_min_k4).
__device__ __forceinline__ void k4_scale(const uint8_t* s, int g, int* sc, int* m) {
    if (g < 4) {
        *sc = s[g] & 63;
        *m = s[g + 4] & 63;
    } else {
        *sc = (s[g + 4] & 0x0F) | ((s[g - 4] >> 6) << 4);
        *m = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
    }
}

// Q4_K: d f16 | dmin f16 | scales[12] | qs[128]. Value j of the block: group g = j / 32 takes the
// low (g even) or high nibbles of qs[32 * (g / 2) + j % 32]; y = d*sc[g] * q - dmin*m[g].
__device__ __forceinline__ float deq_q4_k(const uint8_t* src, long long i) {
    const uint8_t* b = src + (i >> 8) * 144;
    const int j = (int)(i & 255), g = j >> 5, l = j & 31;
    int sc, m;
    k4_scale(b + 4, g, &sc, &m);
    const float dl = load_f16(b) * (float)sc, ml = load_f16(b + 2) * (float)m;
    const int q = (b[16 + 32 * (g >> 1) + l] >> (4 * (g & 1))) & 0x0F;
    return dl * (float)q - ml;
}

// Q5_K: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]: as Q4_K with bit g of qh[l] as bit 4.
__device__ __forceinline__ float deq_q5_k(const uint8_t* src, long long i) {
    const uint8_t* b = src + (i >> 8) * 176;
    const int j = (int)(i & 255), g = j >> 5, l = j & 31;
    int sc, m;
    k4_scale(b + 4, g, &sc, &m);
    const float dl = load_f16(b) * (float)sc, ml = load_f16(b + 2) * (float)m;
    const int q = ((b[48 + 32 * (g >> 1) + l] >> (4 * (g & 1))) & 0x0F) | (((b[16 + l] >> g) & 1) << 4);
    return dl * (float)q - ml;
}

// Q6_K: ql[128] | qh[64] | scales int8[16] | d f16. Half h (128 values) is four runs of 32: run k
// takes the low (k < 2) or high nibbles of ql[64h + 32(k & 1) + l] and bits 2k..2k+1 of
// qh[32h + l]; y = (d * scale[8h + 2k + l / 16]) * (q - 32).
__device__ __forceinline__ float deq_q6_k(const uint8_t* src, long long i) {
    const uint8_t* b = src + (i >> 8) * 210;
    const int j = (int)(i & 255), h = j >> 7, k = (j >> 5) & 3, l = j & 31;
    const int lo = (b[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 0x0F;
    const int hi = (b[128 + 32 * h + l] >> (2 * k)) & 3;
    const float s = load_f16(b + 208) * (float)(int8_t)b[192 + 8 * h + 2 * k + (l >> 4)];
    return s * (float)((lo | (hi << 4)) - 32);
}

__device__ __forceinline__ float deq_f16(const uint8_t* src, long long i) { return load_f16(src + 2 * i); }
__device__ __forceinline__ float deq_bf16(const uint8_t* src, long long i) { return load_bf16(src + 2 * i); }
__device__ __forceinline__ float deq_f32(const uint8_t* src, long long i) {
    const uint8_t* p = src + 4 * i;
    return __uint_as_float((unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) |
                           ((unsigned int)p[3] << 24));
}

#define PYL_DEQUANT(SRC, DST, DST_T)                                                                      \
    extern "C" __global__ void dequant_##SRC##_##DST(const uint8_t* src, DST_T* dst, long long n) {      \
        for (long long i = grid_index(); i < n; i += grid_stride()) pyl_store(dst + i, deq_##SRC(src, i)); \
    }

PYL_DEQUANT(q8_0, f16, __half)
PYL_DEQUANT(q4_0, f16, __half)
PYL_DEQUANT(q4_k, f16, __half)
PYL_DEQUANT(q5_k, f16, __half)
PYL_DEQUANT(q6_k, f16, __half)
PYL_DEQUANT(bf16, f16, __half)
PYL_DEQUANT(f32, f16, __half)
PYL_DEQUANT(q8_0, bf16, __nv_bfloat16)
PYL_DEQUANT(q4_0, bf16, __nv_bfloat16)
PYL_DEQUANT(q4_k, bf16, __nv_bfloat16)
PYL_DEQUANT(q5_k, bf16, __nv_bfloat16)
PYL_DEQUANT(q6_k, bf16, __nv_bfloat16)
PYL_DEQUANT(f16, bf16, __nv_bfloat16)
PYL_DEQUANT(f32, bf16, __nv_bfloat16)
