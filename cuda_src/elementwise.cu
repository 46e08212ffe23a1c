// Row and element kernels of the graph: GET_ROWS, RMS_NORM, SWIGLU, ADD, the bias of MUL_MAT and
// the activation conversion in front of a half-precision cuBLAS GEMM. Semantics follow the CPU
// backend (pyllama/backend/cpu.py, pyllama/_fast/ops.pyx); all activations are float32.
#include "common.cuh"

// GET_ROWS: out[i, :] = table[ids[i], :] as float32. One block per output row. An id outside the
// table writes a row of zeros and sets PYL_ERR_ROW_INDEX (the CPU raises).
template <typename T>
__device__ __forceinline__ void get_rows_impl(const T* table, const int* ids, float* out, long long n_rows,
                                              long long d, unsigned int* err) {
    const long long i = blockIdx.x;
    const long long r = ids[i];
    float* o = out + i * d;
    if (r < 0 || r >= n_rows) {
        if (threadIdx.x == 0) pyl_flag(err, PYL_ERR_ROW_INDEX);
        for (long long j = threadIdx.x; j < d; j += blockDim.x) o[j] = 0.0f;
        return;
    }
    const T* src = table + r * d;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) o[j] = pyl_load(src + j);
}

extern "C" __global__ void get_rows_f32(const float* table, const int* ids, float* out, long long n_rows,
                                        long long d, unsigned int* err) {
    get_rows_impl(table, ids, out, n_rows, d, err);
}

extern "C" __global__ void get_rows_f16(const __half* table, const int* ids, float* out, long long n_rows,
                                        long long d, unsigned int* err) {
    get_rows_impl(table, ids, out, n_rows, d, err);
}

extern "C" __global__ void get_rows_bf16(const __nv_bfloat16* table, const int* ids, float* out,
                                         long long n_rows, long long d, unsigned int* err) {
    get_rows_impl(table, ids, out, n_rows, d, err);
}

// RMS_NORM: out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w. One block per row.
extern "C" __global__ void rms_norm_f32(const float* x, const float* w, float* out, long long d, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (long long)blockIdx.x * d;
    float* o = out + (long long)blockIdx.x * d;
    float ss = 0.0f;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) ss += xr[j] * xr[j];
    ss = block_sum(ss, scratch);
    // as the CPU: the scale in double, rounded once to float
    const float scale = (float)(1.0 / sqrt((double)ss / (double)d + (double)eps));
    for (long long j = threadIdx.x; j < d; j += blockDim.x) o[j] = xr[j] * scale * w[j];
}

// SWIGLU: out[i, j] = silu(gu[i, j]) * gu[i, f + j] for gu [n, 2f].
extern "C" __global__ void swiglu_f32(const float* gu, float* out, long long n, long long f) {
    const long long total = n * f;
    for (long long idx = grid_index(); idx < total; idx += grid_stride()) {
        const long long i = idx / f, j = idx - i * f;
        const float g = gu[i * 2 * f + j];
        out[idx] = g / (1.0f + expf(-g)) * gu[i * 2 * f + f + j];
    }
}

// ADD: out = a + b, element-wise over n floats.
extern "C" __global__ void add_f32(const float* a, const float* b, float* out, long long n) {
    for (long long i = grid_index(); i < n; i += grid_stride()) out[i] = a[i] + b[i];
}

// The bias of MUL_MAT, after the GEMM: out[i, j] += bias[j] for out [n, m].
extern "C" __global__ void add_bias_f32(float* out, const float* bias, long long n, long long m) {
    const long long total = n * m;
    for (long long idx = grid_index(); idx < total; idx += grid_stride()) out[idx] += bias[idx % m];
}

// The activation of a half-precision GEMM: cuBLAS multiplies two matrices of one type, so x
// (float32) is rounded to the weight's type first (round to nearest even).
extern "C" __global__ void convert_f32_f16(const float* x, __half* y, long long n) {
    for (long long i = grid_index(); i < n; i += grid_stride()) y[i] = __float2half_rn(x[i]);
}

extern "C" __global__ void convert_f32_bf16(const float* x, __nv_bfloat16* y, long long n) {
    for (long long i = grid_index(); i < n; i += grid_stride()) y[i] = __float2bfloat16_rn(x[i]);
}
