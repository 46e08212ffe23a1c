"""Which hidden rows of a prompt an embedding's pooling reads, and how it combines them (as
llama.cpp: none, mean, cls, last, rank). The batching core asks only for those rows of each step."""
from __future__ import annotations

import numpy as np


def rows_wanted(pooling: str, start: int, n: int, n_prompt: int) -> np.ndarray:
    """Which of the prompt positions start..start+n the pooling reads (bool [n])."""
    pos = np.arange(start, start + n)
    if pooling in ("cls", "rank"):  # rank: the first token's state feeds the classification head
        return pos == 0
    if pooling == "last":
        return pos == n_prompt - 1
    return np.ones(n, dtype=bool)


def pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """[n_tokens, n_embd] hidden states of one prompt (only the rows `rows_wanted` chose) ->
    [n_embd] (or [n_tokens, n_embd] for none)."""
    if pooling == "mean":
        return hidden.mean(axis=0, dtype=np.float64).astype(np.float32)
    if pooling in ("cls", "last", "rank"):
        return hidden[0]
    return hidden
