# The products' worker pool (ggml_quants.h), shared with the other kernels of a step so that one
# set of helper threads serves them all: two pools would each keep a helper spinning per core.
from libc.stdint cimport int64_t

ctypedef void (*pool_item_fn)(void *ctx, int64_t item) noexcept nogil

cdef void pool_run(int n_threads, int64_t n_items, pool_item_fn fn, void *ctx) noexcept nogil
