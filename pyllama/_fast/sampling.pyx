# cython: language_level=3
"""Sampling kernel: one call samples every row of a decode step.

The per-row chain follows llama.cpp's default order: penalties -> top_k -> top_p -> min_p ->
temperature -> dist (or greedy when temperature <= 0). It runs entirely without the GIL, rows in
parallel (OpenMP, rows handed out dynamically), with one scratch block per thread and call.

The candidates must be ordered by logit (descending, ties by lower id) for the top_p prefix, the
draw walk and the top-n report, but sorting the vocabulary is never needed:

- top_k <= 512 (llama-server's default is 40): a threshold from a strided sample of the row, a
  vectorized gather of the tokens at or above it, nth_element + sort of that handful; the rest of
  the chain runs on the k sorted candidates.
- otherwise (top_k off or large): every token gets a bucket by its distance to the max logit
  (1024 buckets). The kept candidates are always "every token of buckets [0, bK) plus the first
  mK tokens of bucket bK"; top_k moves that boundary with per-bucket counts, top_p with
  per-bucket masses, min_p with a logit threshold, and the draw walks per-bucket tempered masses.
  Only the bucket a boundary or the draw falls in is sorted. Per-bucket sums are built lazily, the
  top quarter of the range first, so peaked rows rarely pay for a full scatter pass.

Greedy rows need only the argmax and the softmax normalizer (and the top-n selection when
n_probs > 0).
"""

from cython.parallel cimport prange, parallel
from libc.stdlib cimport calloc, free
cimport openmp

cdef extern from "sampling.h" nogil:
    cppclass Scratch "pyllama_sampling::Scratch":
        pass
    Scratch* new_scratch "pyllama_sampling::new_scratch"(int n_vocab, int L)
    void free_scratch "pyllama_sampling::free_scratch"(Scratch* s)
    void sample_row "pyllama_sampling::sample_row"(
        const float* logits, int n_vocab, const float* fp, const int* ip, const int* pen,
        float* xf, const int* xi, const int* hist, int n_hist, const int* brk,
        Scratch& s, int* out_id, float* out_prob, int* top_ids, float* top_probs,
        int n_top_cols)


# Dummy buffers for zero-width arrays (a 0-column memoryview has no element to take the address of).
cdef int _zero_i[1]
cdef float _zero_f[1]


def sample_rows(const float[:, ::1] logits,
                const float[:, ::1] fparams,
                const int[:, ::1] iparams,
                const int[:, ::1] penalty_tokens,
                int[::1] out_ids,
                float[::1] out_prob,
                int[:, ::1] out_top_ids,
                float[:, ::1] out_top_probs,
                int n_threads=0,
                float[:, ::1] xparams=None,
                const int[:, ::1] xiparams=None,
                list dry_tokens=None,
                list dry_breakers=None):
    """Samples every row of ``logits`` (see the module docstring for the chain).

    fparams [n_rows, 8]: temperature, top_p, min_p, repeat_penalty, frequency_penalty,
    presence_penalty, draw (uniform in [0, 1)), unused. iparams [n_rows, 4]: top_k, n_probs,
    n_penalty_tokens, unused. penalty_tokens [n_rows, L]: the row's recent tokens (the first
    n_penalty_tokens are used; ids outside [0, n_vocab) are ignored). Writes out_ids, out_prob
    (probability of the chosen token) and the rows' n_probs most probable candidates into
    out_top_ids / out_top_probs (padding -1 / 0). n_threads 0 = OpenMP default.

    The general chain (any order; typical-p, XTC, DRY, top-n-sigma, dynamic temperature,
    mirostat, min_keep) runs for the rows whose xiparams[r, 0] is non-zero:
    xparams float32 [n_rows, 16]: typical_p, top_n_sigma, xtc_probability, xtc_threshold,
    xtc draw, dry_multiplier, dry_base, mirostat_tau, mirostat_eta, mirostat mu (updated in place),
    dynatemp_range, dynatemp_exponent, unused. xiparams int32 [n_rows, 24]: general chain (0/1),
    min_keep, mirostat (0/1/2), dry_allowed_length, chain length (<= 16), chain codes (0
    penalties, 1 dry, 2 top_n_sigma, 3 top_k, 4 typical, 5 top_p, 6 min_p, 7 xtc, 8 temperature).
    dry_tokens / dry_breakers: per row, None or a C-contiguous int32 array (the DRY history,
    oldest first; the breaker table of pyllama.batching.sampling.dry_breaker_table).
    """
    cdef Py_ssize_t n_rows = logits.shape[0]
    cdef Py_ssize_t n_vocab = logits.shape[1]
    cdef Py_ssize_t L = penalty_tokens.shape[1]
    cdef Py_ssize_t N = out_top_ids.shape[1]
    cdef Py_ssize_t r
    cdef int nt, n_probs, n_pen

    if n_vocab < 1 or n_vocab > 0x7FFFFFFF:
        raise ValueError(f"logits must have between 1 and 2**31-1 columns, got {n_vocab}")
    if fparams.shape[1] != 8:
        raise ValueError(f"fparams must have 8 columns, got {fparams.shape[1]}")
    if iparams.shape[1] != 4:
        raise ValueError(f"iparams must have 4 columns, got {iparams.shape[1]}")
    for name, rows in (("fparams", fparams.shape[0]), ("iparams", iparams.shape[0]),
                       ("penalty_tokens", penalty_tokens.shape[0]),
                       ("out_ids", out_ids.shape[0]), ("out_prob", out_prob.shape[0]),
                       ("out_top_ids", out_top_ids.shape[0]),
                       ("out_top_probs", out_top_probs.shape[0])):
        if rows != n_rows:
            raise ValueError(f"{name} has {rows} rows, logits has {n_rows}")
    if out_top_probs.shape[1] != N:
        raise ValueError(f"out_top_probs has {out_top_probs.shape[1]} columns, "
                         f"out_top_ids has {N}")
    for r in range(n_rows):
        n_probs = iparams[r, 1]
        n_pen = iparams[r, 2]
        if n_probs < 0 or n_probs > N:
            raise ValueError(f"row {r}: n_probs={n_probs} must be in [0, {N}] "
                             f"(the width of out_top_ids)")
        if n_pen < 0 or n_pen > L:
            raise ValueError(f"row {r}: n_penalty_tokens={n_pen} must be in [0, {L}] "
                             f"(the width of penalty_tokens)")
    if n_rows == 0:
        return

    # The general chain's per-row inputs: pointers taken here, with the GIL, from arrays the
    # caller keeps alive for the call.
    cdef float* xf_ptr = NULL
    cdef const int* xi_ptr = NULL
    cdef const int** hist_ptrs = NULL
    cdef int* hist_lens = NULL
    cdef const int** brk_ptrs = NULL
    cdef const int[::1] arr
    cdef Py_ssize_t e, n_e, off
    if xiparams is not None:
        if xparams is None or xparams.shape[0] != n_rows or xparams.shape[1] != 16:
            raise ValueError("xparams must be float32 [n_rows, 16] with xiparams")
        if xiparams.shape[0] != n_rows or xiparams.shape[1] != 24:
            raise ValueError("xiparams must be int32 [n_rows, 24]")
        for r in range(n_rows):
            if xiparams[r, 4] < 0 or xiparams[r, 4] > 16:
                raise ValueError(f"row {r}: the chain holds {xiparams[r, 4]} samplers (at most 16)")
        for name, lst in (("dry_tokens", dry_tokens), ("dry_breakers", dry_breakers)):
            if lst is not None and len(lst) != n_rows:
                raise ValueError(f"{name} has {len(lst)} rows, logits has {n_rows}")
        xf_ptr = &xparams[0, 0]
        xi_ptr = &xiparams[0, 0]
        hist_ptrs = <const int**>calloc(n_rows, sizeof(int*))
        hist_lens = <int*>calloc(n_rows, sizeof(int))
        brk_ptrs = <const int**>calloc(n_rows, sizeof(int*))
        if hist_ptrs == NULL or hist_lens == NULL or brk_ptrs == NULL:
            free(hist_ptrs); free(hist_lens); free(brk_ptrs)
            raise MemoryError("sample_rows: could not allocate the row pointers")
        try:
            for r in range(n_rows):
                if dry_tokens is not None and dry_tokens[r] is not None:
                    arr = dry_tokens[r]
                    if arr.shape[0] > 0x7FFFFFFF:
                        raise ValueError(f"row {r}: DRY history too long")
                    hist_lens[r] = <int>arr.shape[0]
                    if arr.shape[0] > 0:
                        hist_ptrs[r] = &arr[0]
                if dry_breakers is not None and dry_breakers[r] is not None:
                    arr = dry_breakers[r]
                    # a malformed table must fail here, not read out of bounds in the kernel
                    if arr.shape[0] < 1 or arr[0] < 0 or 1 + 2 * arr[0] > arr.shape[0]:
                        raise ValueError(f"row {r}: malformed DRY breaker table")
                    n_e = arr[0]
                    for e in range(n_e):
                        off = arr[2 + 2 * e]
                        if off < 1 + 2 * n_e or off >= arr.shape[0] or arr[off] < 0 \
                                or off + 1 + arr[off] > arr.shape[0] \
                                or (e > 0 and arr[1 + 2 * e] < arr[2 * e - 1]):
                            raise ValueError(f"row {r}: malformed DRY breaker table")
                    brk_ptrs[r] = &arr[0]
        except BaseException:
            free(hist_ptrs); free(hist_lens); free(brk_ptrs)
            raise

    nt = n_threads if n_threads > 0 else openmp.omp_get_max_threads()
    if nt > n_rows:
        nt = <int>n_rows    # one scratch per thread: never start threads that get no row

    cdef const int* pen_ptr = &penalty_tokens[0, 0] if L > 0 else _zero_i
    cdef int* top_ids_ptr = &out_top_ids[0, 0] if N > 0 else _zero_i
    cdef float* top_probs_ptr = &out_top_probs[0, 0] if N > 0 else _zero_f
    cdef const float* lg = &logits[0, 0]
    cdef const float* fp = &fparams[0, 0]
    cdef const int* ip = &iparams[0, 0]
    cdef int* oid = &out_ids[0]
    cdef float* opr = &out_prob[0]
    cdef int nv = <int>n_vocab
    cdef int Li = <int>L
    cdef int Ni = <int>N
    cdef Scratch* s = NULL
    cdef int failed = 0
    with nogil, parallel(num_threads=nt):
        # Per-thread scratch, once per call; rows are handed out dynamically because greedy
        # rows cost far less than rows with a wide candidate set.
        s = new_scratch(nv, Li)
        for r in prange(n_rows, schedule="dynamic", chunksize=1):
            if s == NULL:
                failed += 1
            elif xi_ptr != NULL:
                sample_row(lg + r * nv, nv, fp + r * 8, ip + r * 4, pen_ptr + r * Li,
                           xf_ptr + r * 16, xi_ptr + r * 24, hist_ptrs[r], hist_lens[r],
                           brk_ptrs[r], s[0], oid + r, opr + r, top_ids_ptr + r * Ni,
                           top_probs_ptr + r * Ni, Ni)
                if oid[r] < 0:
                    failed += 1
            else:
                sample_row(lg + r * nv, nv, fp + r * 8, ip + r * 4, pen_ptr + r * Li,
                           NULL, NULL, NULL, 0, NULL, s[0],
                           oid + r, opr + r, top_ids_ptr + r * Ni, top_probs_ptr + r * Ni, Ni)
        free_scratch(s)
    free(hist_ptrs)
    free(hist_lens)
    free(brk_ptrs)
    if failed:
        raise MemoryError("sample_rows: could not allocate the per-thread sampling scratch")
