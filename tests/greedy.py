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


def prompt_logits_f32(engine, text: str, n_ctx: int = 256):
    """(the prompt's tokens, a context over F32 KV caches, the logits of every prompt position):
    F32 caches round nothing, as the float64 reference (tests/reference_forward.py) does not."""
    from pyllama.ir.tensor import DType  # noqa: PLC0415
    prompt = engine.tokenizer.encode(text)
    ctx = engine.new_context(n_ctx, 1, type_k=DType.F32, type_v=DType.F32)
    batch = Batch.for_sequence(prompt, 0, 0)
    batch.logits[:] = True
    return prompt, ctx, ctx.decode(batch).logits[:len(prompt)].copy()


def paper_graph(path: str, n_tokens: int = 4):
    """The forward graph of a model file over placeholder weights and F16 caches on one CPU (nothing
    uploaded): what a test reads node by node."""
    from pyllama.backend.cpu import CPUBackend  # noqa: PLC0415
    from pyllama.ir.tensor import DType, Tensor  # noqa: PLC0415
    from pyllama.models.build.llama import build_forward  # noqa: PLC0415
    from pyllama.models.model import Model  # noqa: PLC0415
    from pyllama.models.weights import Placement, load_weights  # noqa: PLC0415
    model = Model(path)
    hp = model.hparams
    w = load_weights(model, Placement([CPUBackend(1)], [0] * hp.n_layer), upload=False)
    kv = [(Tensor(DType.F16, (8, hp.n_embd_kv), "k"), Tensor(DType.F16, (8, hp.n_embd_kv), "v"))] * hp.n_layer
    return build_forward(hp, w, kv, n_tokens, 1, n_tokens)
