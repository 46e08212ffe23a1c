"""Embeddings as llama-server computes them: the final hidden state after the output norm
(`result_norm`) of a prompt's tokens, pooled per sequence and normalized, all on the host.

Pooling: none (one vector per token), mean (their average), cls (the first token's), last (the
last token's). A model's default is its GGUF key `<arch>.pooling_type`, else none, as llama.cpp.
"""
from __future__ import annotations

import base64
from typing import Any, Optional

import numpy as np

from ..batching.pooling import pool, rows_wanted  # noqa: F401 - the handlers pool through this module

POOLING_NAMES = ("none", "mean", "cls", "last")  # index = llama.cpp's llama_pooling_type value


def model_pooling(gguf: Any, option: Optional[str]) -> str:
    """The pooling a server uses: --pooling, else the model's `<arch>.pooling_type`, else none."""
    if option:
        return option
    arch = gguf.get("general.architecture", "")
    value = gguf.get(f"{arch}.pooling_type", 0)
    if isinstance(value, int) and 0 <= value < len(POOLING_NAMES):
        return POOLING_NAMES[value]
    return "none"  # rank (4) and unknown values have no meaning for a generative model


def normalize(v: np.ndarray, embd_normalize: int) -> np.ndarray:
    """llama.cpp's common_embd_normalize: -1 none, 0 max-abs scaled to the int16 range (32760),
    2 Euclidean, any other p > 0 the p-norm. A zero vector stays zero."""
    x = v.astype(np.float64)
    if embd_normalize == -1:
        total = 1.0
    elif embd_normalize == 0:
        total = float(np.abs(x).max(initial=0.0)) / 32760.0
    elif embd_normalize == 2:
        total = float(np.sqrt((x * x).sum()))
    else:
        total = float((np.abs(x) ** embd_normalize).sum() ** (1.0 / embd_normalize))
    scale = 1.0 / total if total > 0 else 0.0
    return (x * scale).astype(np.float32)


def native_item(index: int, vectors: np.ndarray) -> dict:
    """/embedding's element: `embedding` is a list of vectors (one per token for pooling none, else
    the one pooled vector)."""
    rows = vectors if vectors.ndim == 2 else vectors[None, :]
    return {"index": index, "embedding": rows.tolist()}


def oai_response(model: str, items: list[tuple[np.ndarray, int]], use_base64: bool) -> dict:
    """/v1/embeddings' body for pooled vectors [(vector, n_prompt_tokens)], in input order."""
    data = []
    for i, (vec, _) in enumerate(items):
        if use_base64:  # little-endian float32 bytes, as llama-server sends them
            data.append({"embedding": base64.b64encode(vec.astype("<f4").tobytes()).decode(), "index": i,
                         "object": "embedding", "encoding_format": "base64"})
        else:
            data.append({"embedding": vec.tolist(), "index": i, "object": "embedding"})
    n_tokens = sum(n for _, n in items)
    return {"model": model, "object": "list", "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            "data": data}
