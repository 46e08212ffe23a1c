// Host emulation of the CUDA features the kernels of cuda_src/ use, to run their very source on a
// CPU (tests/test_cuda.py): one std::thread per CUDA thread, the blocks of a grid one after
// another (so `__shared__` can be a function-local static), __syncthreads as a std::barrier, warp
// shuffles through a per-warp exchange buffer, atomics under a mutex. It checks the kernels'
// logic (indexing, barriers, warp reductions, the sampler's selection); not timing, not the GPU's
// memory model beyond those barriers, not its floating-point library.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#include <memory>
#include <cfloat>
#include <climits>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

struct dim3e { unsigned x, y, z; };
extern thread_local dim3e threadIdx, blockIdx;
extern dim3e blockDim, gridDim;

struct BlockSync {
    std::barrier<> bar;
    std::vector<std::unique_ptr<std::barrier<>>> warp;
    std::vector<unsigned long long> slot;
    explicit BlockSync(int n) : bar(n), slot(n) {
        for (int w = 0; w < (n + 31) / 32; w++) warp.emplace_back(new std::barrier<>(32));
    }
};
extern BlockSync* g_sync;
extern std::mutex g_atomic;

inline void __syncthreads() { g_sync->bar.arrive_and_wait(); }

template <typename T> inline unsigned long long to_bits(T v) { unsigned long long b = 0; std::memcpy(&b, &v, sizeof(T)); return b; }
template <typename T> inline T from_bits(unsigned long long b) { T v; std::memcpy(&v, &b, sizeof(T)); return v; }

template <typename T> inline T __shfl_xor_sync(unsigned, T v, int o) {
    int t = threadIdx.x, lane = t & 31, w = t >> 5;
    g_sync->slot[t] = to_bits(v);
    g_sync->warp[w]->arrive_and_wait();
    T r = from_bits<T>(g_sync->slot[(w << 5) | (lane ^ o)]);
    g_sync->warp[w]->arrive_and_wait();
    return r;
}
template <typename T> inline T __shfl_up_sync(unsigned, T v, int o) {
    int t = threadIdx.x, lane = t & 31, w = t >> 5;
    g_sync->slot[t] = to_bits(v);
    g_sync->warp[w]->arrive_and_wait();
    T r = lane >= o ? from_bits<T>(g_sync->slot[(w << 5) | (lane - o)]) : v;
    g_sync->warp[w]->arrive_and_wait();
    return r;
}
template <typename T> inline T atomicAdd(T* p, T v) { std::lock_guard<std::mutex> g(g_atomic); T o = *p; *p = o + v; return o; }
inline unsigned atomicOr(unsigned* p, unsigned v) { std::lock_guard<std::mutex> g(g_atomic); unsigned o = *p; *p = o | v; return o; }
inline int atomicExch(int* p, int v) { std::lock_guard<std::mutex> g(g_atomic); int o = *p; *p = v; return o; }

inline float __int_as_float(int i) { return from_bits<float>((unsigned)i); }
inline int __float_as_int(float f) { return (int)(unsigned)to_bits(f); }
inline float __uint_as_float(unsigned i) { return from_bits<float>(i); }
inline unsigned __float_as_uint(float f) { return (unsigned)to_bits(f); }
using std::isnan;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
