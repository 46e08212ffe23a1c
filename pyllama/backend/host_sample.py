"""The SAMPLE op computed on this host's CPU: the CPU device runs it as a step of its graphs, and
a device without a sampler of its own (a llama.cpp rpc-server) runs it on the logits it read back."""
from __future__ import annotations

from typing import Callable

import numpy as np

from .._fast import sampling as k_sampling
from ..ir.tensor import sample_in_cols, sample_out_cols


def bind_sample(logits: np.ndarray, inp: np.ndarray, out: np.ndarray, n_probs: int, window: int,
                 nt: int) -> Callable[[], None]:
    """The SAMPLE op: unpacks the rows' sampler inputs, runs the sampling kernel, packs the ids,
    probabilities and candidates (layout in models/build/ops.py)."""
    rows = logits.shape[0]
    if not 0 <= n_probs <= 4096 or not 0 <= window <= 1 << 20:
        raise ValueError(f"SAMPLE: n_probs {n_probs} or window {window} out of range")
    if inp.shape != (rows, sample_in_cols(window)) or inp.dtype != np.int32:
        raise ValueError(f"SAMPLE: sampling input {inp.shape} {inp.dtype}, expected int32 ({rows}, {sample_in_cols(window)})")
    if out.shape != (rows, sample_out_cols(n_probs)) or out.dtype != np.int32:
        raise ValueError(f"SAMPLE: output {out.shape} {out.dtype}, expected int32 ({rows}, {sample_out_cols(n_probs)})")
    fparams = np.zeros((rows, 8), np.float32)
    iparams = np.zeros((rows, 4), np.int32)
    pen = np.zeros((rows, window), np.int32)
    ids = np.zeros(rows, np.int32)
    prob = np.zeros(rows, np.float32)
    top_ids = np.zeros((rows, n_probs), np.int32)
    top_probs = np.zeros((rows, n_probs), np.float32)

    def run() -> None:
        fparams.view(np.int32)[:] = inp[:, :8]
        iparams[:] = inp[:, 8:12]
        pen[:] = inp[:, 12:]
        k_sampling.sample_rows(logits, fparams, iparams, pen, ids, prob, top_ids, top_probs, nt)
        out[:, 0] = ids
        out[:, 1] = prob.view(np.int32)
        out[:, 2:2 + n_probs] = top_ids
        out[:, 2 + n_probs:] = top_probs.view(np.int32)
    return run


__all__ = ["bind_sample"]
