// ATTENTION: one layer's self-attention with its paged KV-cache write, RoPE (normal or NeoX) and
// the optional per-head q/k RMS norm (graph/ops.py, Op.ATTENTION; CPU: _fast/ops.pyx attention).
//
// Two launches on one stream, as the CPU's two phases: attn_store writes every token's rotated
// q (into out) and k, v (into the cache cells kv_idx), then attn_attend lets each (token, head)
// attend to its listed cells, so tokens of one micro-batch see each other's keys.
#include "common.cuh"

#include <math.h>

#define ROPE_NORMAL 0

// One block per token, one warp per head (q heads, then k heads, then v heads).
extern "C" __global__ void __launch_bounds__(256)
attn_store(const float* qkv, float* k_cache, float* v_cache, const int* pos, const int* kv_idx,
           const float* q_norm, const float* k_norm, float* out, int H, int Hkv, int hd, int n_rot,
           int rope_mode, double freq_base, double freq_scale, float eps, long long n_cells,
           unsigned int* err) {
    const int t = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const long long qkv_stride = (long long)(H + 2 * Hkv) * hd;
    const float* src_row = qkv + (long long)t * qkv_stride;
    const long long cell = kv_idx[t];
    const bool cell_ok = cell >= 0 && cell < n_cells;
    if (!cell_ok && threadIdx.x == 0) pyl_flag(err, PYL_ERR_KV_CELL);
    const double p = (double)pos[t];
    const int half = n_rot / 2;
    const bool use_norm = q_norm != nullptr;
    for (int h = warp; h < H + 2 * Hkv; h += n_warps) {
        const float* x = src_row + (long long)h * hd;
        float* dst;
        const float* nw = nullptr;
        bool rope = true;
        if (h < H) {
            dst = out + (long long)t * H * hd + (long long)h * hd;
            nw = use_norm ? q_norm : nullptr;
        } else if (h < H + Hkv) {
            if (!cell_ok) continue;
            dst = k_cache + cell * Hkv * hd + (long long)(h - H) * hd;
            nw = use_norm ? k_norm : nullptr;
        } else {
            if (!cell_ok) continue;
            dst = v_cache + cell * Hkv * hd + (long long)(h - H - Hkv) * hd;
            rope = false;
        }
        if (!rope) {
            for (int d = lane; d < hd; d += 32) dst[d] = x[d];
            continue;
        }
        float scale = 1.0f;
        if (nw != nullptr) {
            float ss = 0.0f;
            for (int d = lane; d < hd; d += 32) ss += x[d] * x[d];
            ss = warp_sum(ss);
            scale = (float)(1.0 / sqrt((double)ss / hd + (double)eps));
        }
        // rotated pairs: (2i, 2i+1) in normal mode, (i, i + n_rot/2) in NeoX mode
        for (int i = lane; i < half; i += 32) {
            const double theta = p * freq_scale * pow(freq_base, -2.0 * i / n_rot);
            const float c = (float)cos(theta), s = (float)sin(theta);
            const int i0 = rope_mode == ROPE_NORMAL ? 2 * i : i;
            const int i1 = rope_mode == ROPE_NORMAL ? 2 * i + 1 : i + half;
            const float x0 = nw != nullptr ? x[i0] * scale * nw[i0] : x[i0];
            const float x1 = nw != nullptr ? x[i1] * scale * nw[i1] : x[i1];
            dst[i0] = x0 * c - x1 * s;
            dst[i1] = x0 * s + x1 * c;
        }
        for (int d = n_rot + lane; d < hd; d += 32) dst[d] = nw != nullptr ? x[d] * scale * nw[d] : x[d];
    }
}

// Values of a head each lane holds: head_dim up to 32 * ATT_MAXD (the backend checks).
#define ATT_MAXD 8
#define ATT_WARPS 4

// One block per (token, head): its warps take the listed cells in turn, each with an online
// softmax of its own, and combine at the end. q is read from out (written by attn_store) and the
// result replaces it.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attn_attend(const float* k_cache, const float* v_cache, const int* cells, const int* ranges, float* out,
            int H, int Hkv, int hd, float scale, long long n_cells, long long n_listed, unsigned int* err) {
    __shared__ float s_m[ATT_WARPS], s_l[ATT_WARPS];
    __shared__ float s_acc[ATT_WARPS][ATT_MAXD * 32];
    const long long t = blockIdx.x / H;
    const int h = (int)(blockIdx.x % H);
    const int kvh = h / (H / Hkv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* o = out + t * H * hd + (long long)h * hd;
    const long long r0 = ranges[2 * t], r1 = ranges[2 * t + 1];
    if (r0 < 0 || r1 < 1 || r0 + r1 > n_listed) {
        if (threadIdx.x == 0) pyl_flag(err, PYL_ERR_ATTN_RANGE);
        __syncthreads();  // nobody may still read q when it is overwritten
        for (int d = threadIdx.x; d < hd; d += blockDim.x) o[d] = 0.0f;
        return;
    }
    float q[ATT_MAXD], acc[ATT_MAXD];
#pragma unroll
    for (int k = 0; k < ATT_MAXD; k++) {
        const int d = lane + 32 * k;
        q[k] = d < hd ? o[d] : 0.0f;
        acc[k] = 0.0f;
    }
    const long long stride = (long long)Hkv * hd;
    float m = -INFINITY, l = 0.0f;
    for (long long j = warp; j < r1; j += ATT_WARPS) {
        const long long c = cells[r0 + j];
        if (c < 0 || c >= n_cells) {
            if (lane == 0) pyl_flag(err, PYL_ERR_KV_CELL);
            continue;
        }
        const float* kr = k_cache + c * stride + (long long)kvh * hd;
        const float* vr = v_cache + c * stride + (long long)kvh * hd;
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < ATT_MAXD; k++) {
            const int d = lane + 32 * k;
            if (d < hd) s += q[k] * kr[d];
        }
        s = warp_sum(s) * scale;
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new);  // 0 for the first cell (m = -inf)
        const float pj = expf(s - m_new);
        l = l * corr + pj;
#pragma unroll
        for (int k = 0; k < ATT_MAXD; k++) {
            const int d = lane + 32 * k;
            if (d < hd) acc[k] = acc[k] * corr + pj * vr[d];
        }
        m = m_new;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int k = 0; k < ATT_MAXD; k++) s_acc[warp][lane + 32 * k] = acc[k];
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, s_m[w]);
    float den = 0.0f;
    float wt[ATT_WARPS];
    for (int w = 0; w < ATT_WARPS; w++) {
        wt[w] = s_m[w] == -INFINITY ? 0.0f : expf(s_m[w] - M);
        den += s_l[w] * wt[w];
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float num = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) num += s_acc[w][d] * wt[w];
        o[d] = den > 0.0f ? num / den : 0.0f;
    }
}
