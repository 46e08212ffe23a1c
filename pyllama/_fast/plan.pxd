# A graph's kernels bound once to their buffers, then run in order in one call without the GIL
# (plan.pyx). Each kernel module makes NativeSteps of its own kernels (bind_* functions).

# scratch: 64-byte aligned, at least the step's `scratch` bytes, shared by the steps of a run
ctypedef int (*step_fn)(void *ctx, unsigned char *scratch) noexcept nogil

cdef class NativeStep:
    cdef step_fn fn
    cdef void *ctx          # the kernel's arguments (malloc'd, freed with the step)
    cdef readonly object keep     # the arrays the arguments point into
    cdef readonly object checked  # the same op through its Python function (it validates as it runs)
    cdef readonly Py_ssize_t scratch  # bytes of scratch it needs while it runs

# A kernel's bind_* function: s = step_for(sizeof(its args), checked); fills s.ctx (checking the
# arguments: an exception or returning None drops s and its ctx); return bound(s, fn, keep, scratch)
cdef NativeStep step_for(size_t ctx_size, object checked)
cdef NativeStep bound(NativeStep s, step_fn fn, object keep, Py_ssize_t scratch=*)
