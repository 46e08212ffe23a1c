# The products' declarations from ggml_quants.h and their worker pool, shared with the other kernels
# of a step (ops.pyx, moe.pyx) so that one set of helper threads serves them all: two pools would
# each keep a helper spinning per core.
from libc.stdint cimport int32_t, int64_t, uint8_t

cdef extern from "ggml_quants.h" nogil:
    ctypedef struct pq_traits:
        int block
        int bytes
        int vec_type
        int ints
    int PQ_MAX_NR
    int pq_get_traits(int t, pq_traits *tr)
    int pq_have_avx2()
    void pq_quantize_row(int t, const float *x, uint8_t *y, int64_t k)
    int pq_isums_row(int t, int64_t nb, const uint8_t *w, const uint8_t *x, int32_t *out)
    void pq_dot_rows(int t, int nr, int64_t k, const uint8_t *w, const uint8_t *x, size_t xs, float *out,
                     int portable)
    void pq_mul_mat(int t, const float *x, int64_t n, int64_t k, int64_t ldx,
                    const uint8_t *w, int64_t m, int64_t wstride,
                    float *out, int64_t ldo, const float *bias,
                    uint8_t *xq, int64_t xq_stride, int n_threads, int portable)
    void pq_get_rows(int t, const uint8_t *w, int64_t wstride, int64_t k, const int32_t *ids, int64_t n,
                     float *out, int64_t ldo, int n_threads)
    void pq_dequant_rows(int t, const uint8_t *w, int64_t wstride, int64_t k, int64_t j0, int64_t j1,
                         float *out, int n_threads)
    ctypedef void (*pq_item_fn)(void *ctx, int64_t item) noexcept nogil
    void pq_pool_run(int n_threads, int64_t n_items, pq_item_fn fn, void *ctx)
    int64_t pq_tile_bytes(int64_t weight_bytes, int n_threads, int one_call)

ctypedef void (*pool_item_fn)(void *ctx, int64_t item) noexcept nogil

cdef void pool_run(int n_threads, int64_t n_items, pool_item_fn fn, void *ctx) noexcept nogil
