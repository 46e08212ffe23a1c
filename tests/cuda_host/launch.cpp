// The runtime of shim.h and one C entry point per kernel: launch_<kernel>(grid, block, args...).
// Compiled once per cuda_src file with -DKERNELS=<file> (tests/test_cuda.py builds them).
#include "shim.h"

#if defined(RUNTIME)
thread_local dim3e threadIdx, blockIdx;
dim3e blockDim, gridDim;
BlockSync* g_sync;
std::mutex g_atomic;

void emu_launch(int grid, int block, const std::function<void()>& body) {
    gridDim = {(unsigned)grid, 1, 1};
    blockDim = {(unsigned)block, 1, 1};
    for (int b = 0; b < grid; b++) {
        BlockSync sync(block);
        g_sync = &sync;
        std::vector<std::thread> ts;
        for (int t = 0; t < block; t++)
            ts.emplace_back([&, t, b] {
                threadIdx = {(unsigned)t, 0, 0};
                blockIdx = {(unsigned)b, 0, 0};
                body();
                // a thread that returns leaves the barriers (the kernels return block-uniformly)
                sync.bar.arrive_and_drop();
                sync.warp[t >> 5]->arrive_and_drop();
            });
        for (auto& th : ts) th.join();
    }
}
#else
void emu_launch(int, int, const std::function<void()>&);
#define L(name, params, args) \
    extern "C" void launch_##name(int g, int b, params) { emu_launch(g, b, [=] { name args; }); }
#define COMMA ,
#endif

#if defined(ELEMENTWISE)
#include "elementwise.cu"
L(get_rows_f32, const float* t COMMA const int* i COMMA float* o COMMA long long n COMMA long long d COMMA unsigned* e, (t, i, o, n, d, e))
L(get_rows_f16, const __half* t COMMA const int* i COMMA float* o COMMA long long n COMMA long long d COMMA unsigned* e, (t, i, o, n, d, e))
L(get_rows_bf16, const __nv_bfloat16* t COMMA const int* i COMMA float* o COMMA long long n COMMA long long d COMMA unsigned* e, (t, i, o, n, d, e))
L(rms_norm_f32, const float* x COMMA const float* w COMMA float* o COMMA long long d COMMA float eps, (x, w, o, d, eps))
L(swiglu_f32, const float* gu COMMA float* o COMMA long long n COMMA long long f, (gu, o, n, f))
L(add_f32, const float* x COMMA const float* y COMMA float* o COMMA long long n, (x, y, o, n))
L(add_bias_f32, float* o COMMA const float* bias COMMA long long n COMMA long long m, (o, bias, n, m))
L(convert_f32_f16, const float* x COMMA __half* y COMMA long long n, (x, y, n))
L(convert_f32_bf16, const float* x COMMA __nv_bfloat16* y COMMA long long n, (x, y, n))
#elif defined(ATTENTION)
#include "attention.cu"
L(attn_store, const float* qkv COMMA float* k COMMA float* v COMMA const int* pos COMMA const int* kvi COMMA const float* qn COMMA
  const float* kn COMMA float* out COMMA int H COMMA int Hkv COMMA int hd COMMA int n_rot COMMA int mode COMMA double fb COMMA
  double fs COMMA float eps COMMA long long nc COMMA unsigned* e, (qkv, k, v, pos, kvi, qn, kn, out, H, Hkv, hd, n_rot, mode, fb, fs, eps, nc, e))
L(attn_attend, const float* k COMMA const float* v COMMA const int* cells COMMA const int* ranges COMMA float* out COMMA int H COMMA
  int Hkv COMMA int hd COMMA float scale COMMA long long nc COMMA long long nl COMMA unsigned* e, (k, v, cells, ranges, out, H, Hkv, hd, scale, nc, nl, e))
#elif defined(DEQUANT)
#include "dequant.cu"
#define LQ(S, D, T) L(dequant_##S##_##D, const uint8_t* s COMMA T* d COMMA long long n, (s, d, n))
LQ(q8_0, f16, __half) LQ(q4_0, f16, __half) LQ(q4_k, f16, __half) LQ(q5_k, f16, __half) LQ(q6_k, f16, __half)
LQ(bf16, f16, __half) LQ(f32, f16, __half) LQ(q8_0, bf16, __nv_bfloat16) LQ(q4_0, bf16, __nv_bfloat16)
LQ(q4_k, bf16, __nv_bfloat16) LQ(q5_k, bf16, __nv_bfloat16) LQ(q6_k, bf16, __nv_bfloat16) LQ(f16, bf16, __nv_bfloat16)
LQ(f32, bf16, __nv_bfloat16)
#elif defined(SAMPLING)
#include "sampling.cu"
L(sample_rows, const float* lg COMMA const int* inp COMMA int* out COMMA float* sb COMMA int* sc COMMA unsigned long long* sg COMMA
  int V COMMA int L COMMA int N COMMA unsigned* e, (lg, inp, out, sb, sc, sg, V, L, N, e))
#endif
