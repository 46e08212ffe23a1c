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

cdef NativeStep native_step(step_fn fn, void *ctx, object keep, object checked, Py_ssize_t scratch=*)
