"""Helpers for tests that drive the engine directly."""
from __future__ import annotations

from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.ir.tensor import DType, Tensor


def greedy(engine: Engine, prompt: list[int], n: int, kv: DType = DType.F32) -> list[int]:
    """n greedy tokens after `prompt`, one sequence, a KV cache of type kv (F32: no cache rounding,
    as the float64 references)."""
    ctx = engine.new_context(256, 1, type_k=kv, type_v=kv)
    out = ctx.decode(Batch.for_sequence(prompt, 0, 0))
    tokens = []
    for i in range(n):
        tokens.append(int(out.logits[0].argmax()))
        out = ctx.decode(Batch.for_sequence([tokens[-1]], len(prompt) + i, 0))
    return tokens


def placed(backend, dtype: DType, shape: tuple, data=None, name: str = "t"):
    """A tensor in a buffer of its own on `backend`, holding `data` when given."""
    t = Tensor(dtype, shape, name)
    t.buffer = backend.alloc_buffer(max(t.nbytes, 1))
    if data is not None:
        backend.set_tensor(t, data)
    return t
