"""Greedy decoding of one sequence straight on a Context, for tests that compare a context's
tokens before and after something happened to its devices."""
from __future__ import annotations

import numpy as np

from pyllama.runtime.context import Batch


def greedy_decode(ctx, tokens: list[int], n: int) -> list[int]:
    """The prompt `tokens` decoded as sequence 0 from position 0, then n greedy tokens."""
    out = []
    logits = ctx.decode(Batch.for_sequence(tokens, 0, 0)).logits
    pos = len(tokens)
    for _ in range(n):
        tok = int(np.argmax(logits[0]))
        out.append(tok)
        logits = ctx.decode(Batch.for_sequence([tok], pos, 0)).logits
        pos += 1
    return out
