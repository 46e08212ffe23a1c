# cython: language_level=3
"""A CPU graph's kernels run in one call without the GIL.

A graph bound by the CPU backend is a list of steps, one per node. Run as Python callables, every
step takes the GIL back when its kernel ends: about 125 times per decode step of a 12-layer model,
and each time the thread may wait for whoever holds the GIL then (the server's event loop
streaming tokens, another group's decode thread building its batch) while the kernel pool's
helpers wait for it in turn. A NativeStep is a kernel's C function with its arguments bound once
(pointers into the graph's buffers, validated when bound); NativeRun runs a stretch of them in
order with the GIL released once for all of them, and one scratch buffer for the call that all of
them share.

What depends on the data (token ids, KV cell lists) is still checked at every run, in C. A step
that finds its data out of range (or cannot allocate its scratch) returns nonzero; the run then
takes the GIL and computes that node through its Python function (`checked`), which raises the
reason the op gives everywhere else, or computes it, and goes on with the next step.
"""
from libc.stdlib cimport calloc, malloc, free


cdef class NativeStep:
    def __dealloc__(self):
        free(self.ctx)
        self.ctx = NULL


cdef NativeStep step_for(size_t ctx_size, object checked):
    """A step owning ctx_size zeroed bytes of arguments (freed with it), not yet bound to a kernel."""
    cdef NativeStep s = NativeStep.__new__(NativeStep)
    s.ctx = calloc(1, ctx_size)
    if s.ctx == NULL:
        raise MemoryError("cannot allocate a kernel's arguments")
    s.checked = checked
    return s


cdef NativeStep bound(NativeStep s, step_fn fn, object keep, Py_ssize_t scratch=0):
    """s with its kernel, the arrays its arguments point into, and the scratch it needs."""
    s.fn = fn
    s.keep = keep
    s.scratch = scratch
    return s


cdef class NativeRun:
    """Steps (NativeStep) run in order by one call, the GIL released while they compute."""
    cdef step_fn *fns
    cdef void **ctxs
    cdef Py_ssize_t n
    cdef list steps
    cdef bint running
    cdef Py_ssize_t scratch

    def __cinit__(self, steps):
        self.steps = list(steps)
        self.n = len(self.steps)
        self.fns = <step_fn *>malloc(sizeof(step_fn) * max(self.n, 1))
        self.ctxs = <void **>malloc(sizeof(void *) * max(self.n, 1))
        if self.fns == NULL or self.ctxs == NULL:
            raise MemoryError("NativeRun: cannot allocate the step table")
        cdef NativeStep s
        for i, step in enumerate(self.steps):
            s = <NativeStep?>step
            if s.fn == NULL:
                raise ValueError("NativeRun: a step that was never bound to its kernel")
            self.fns[i] = s.fn
            self.ctxs[i] = s.ctx
            self.scratch = max(self.scratch, s.scratch)

    def __dealloc__(self):
        free(self.fns)
        free(self.ctxs)

    def __len__(self):
        return self.n

    def __call__(self):
        cdef Py_ssize_t i = 0, n = self.n
        cdef step_fn *fns = self.fns
        cdef void **ctxs = self.ctxs
        if self.running:
            # the same bound graph on a second thread: the steps' scratch is theirs alone, so this
            # caller computes through the Python functions, which allocate their own
            for step in self.steps:
                (<NativeStep>step).checked()
            return
        # the scratch for this call only (the products' quantized activations): a run kept bound
        # for every graph shape seen must not hold a prompt's worth of it each
        cdef unsigned char *raw = <unsigned char *>malloc(self.scratch + 64)
        if raw == NULL:
            raise MemoryError(f"cannot allocate {self.scratch} bytes of kernel scratch")
        cdef unsigned char *scratch = raw + (-<size_t>raw) % 64
        self.running = True
        try:
            while i < n:
                with nogil:
                    while i < n and fns[i](ctxs[i], scratch) == 0:
                        i += 1
                if i < n:
                    (<NativeStep>self.steps[i]).checked()
                    i += 1
        finally:
            self.running = False
            free(raw)
