# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Token masks of constrained decoding applied to logits: one pass over the packed bitmasks.

A mask has one bit per token (bit t % 32 of 32-bit word t // 32, set = allowed), as llguidance
writes them. Whole words are handled at once: an all-ones word (the common case inside a JSON
string, where nearly every token is allowed) costs one comparison, an all-zeros word 32 plain
stores; only mixed words look at bits. numpy needs a bool array of the whole vocabulary per row
and a masked store, several times slower on a 32,000-token vocabulary.
"""
from libc.math cimport INFINITY


def apply_bitmasks(float[:, ::1] logits, const int[::1] rows, const unsigned int[:, ::1] masks) -> None:
    """logits[rows[k], t] = -inf for every token t whose bit is clear in masks[k] (and for the
    tokens past the mask's last word, if the row is longer)."""
    cdef Py_ssize_t n_vocab = logits.shape[1], n_words = masks.shape[1], n = rows.shape[0]
    cdef Py_ssize_t k, w, b, r, base, end, t
    cdef unsigned int word
    if masks.shape[0] < n:
        raise ValueError(f"{n} rows but {masks.shape[0]} masks")
    for k in range(n):
        if not 0 <= rows[k] < logits.shape[0]:
            raise ValueError(f"row {rows[k]} outside the logits' {logits.shape[0]} rows")
    with nogil:
        for k in range(n):
            r = rows[k]
            for w in range(n_words):
                word = masks[k, w]
                if word == 0xFFFFFFFFu:
                    continue
                base = w * 32
                if base >= n_vocab:
                    break
                end = base + 32
                if end > n_vocab:
                    end = n_vocab
                if word == 0:
                    for t in range(base, end):
                        logits[r, t] = -INFINITY
                else:
                    for t in range(base, end):
                        if not (word >> (t - base)) & 1u:
                            logits[r, t] = -INFINITY
            for t in range(n_words * 32, n_vocab):
                logits[r, t] = -INFINITY
