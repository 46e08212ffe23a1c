// Shared helpers of the pyllama CUDA kernels (included by every .cu file of cuda_src/).
//
// Kernels are `extern "C"` with plain names so that PyCUDA's Module.get_function finds them, and
// take only pointers and scalars (packed by pyllama/backend/cuda.py in the order declared here).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Bits of the per-stream error word. A graph may come from the wire (an rpc server), and data
// such as token ids or KV cells are only known on the device: a kernel that meets an index outside
// its tensor skips the access, sets its bit here, and the backend raises at the next synchronize.
#define PYL_ERR_ROW_INDEX 1u      // GET_ROWS: an id outside the table
#define PYL_ERR_KV_CELL 2u        // ATTENTION: a write cell or a listed cell outside the cache
#define PYL_ERR_ATTN_RANGE 4u     // ATTENTION: a token's range outside the cell list
#define PYL_ERR_SAMPLE_PARAMS 8u  // SAMPLE: n_probs or n_penalty_tokens outside the packed widths

__device__ __forceinline__ void pyl_flag(unsigned int* err, unsigned int bit) {
    atomicOr(err, bit);
}

__device__ __forceinline__ float pyl_load(const float* p) { return *p; }
__device__ __forceinline__ float pyl_load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float pyl_load(const __nv_bfloat16* p) { return __bfloat162float(*p); }

__device__ __forceinline__ void pyl_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void pyl_store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void pyl_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
// `scratch` holds 32 floats of shared memory; callers may reuse it after the call returns.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // the previous use of scratch is over
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < n_warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

// Elements a grid-stride loop of this launch visits per step.
__device__ __forceinline__ long long grid_stride() { return (long long)gridDim.x * blockDim.x; }
__device__ __forceinline__ long long grid_index() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
