"""A reranker's classification head, as llama.cpp's rank pooling applies it: the first token's
hidden state x, then tanh(cls x + cls_b) where the file has `cls.weight`, then cls.output x +
cls.output_b where it has `cls.output.weight` (bert); the first value is the relevance score.

It runs on the host in float32 over one pooled vector per document: a few n_embd x n_embd
products per request, nothing a device would save.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..backend.layout import dequantize_f32
from ..util.errors import ModelFileError
from .model import Model


class RankHead:
    """The head's matrices and biases (float32), read once from the model file."""

    def __init__(self, cls: Optional[tuple[np.ndarray, Optional[np.ndarray]]],
                 out: Optional[tuple[np.ndarray, Optional[np.ndarray]]]):
        self.cls = cls
        self.out = out

    @classmethod
    def of(cls, model: Model) -> Optional["RankHead"]:
        """The head of `model`, or None when it has none (not an encoder, or no cls tensors)."""
        if not model.has_rank_head:
            return None

        def pair(name: str) -> Optional[tuple[np.ndarray, Optional[np.ndarray]]]:
            info = model.file.tensors.get(name + ".weight")
            if info is None:
                return None
            try:
                w = dequantize_f32(info.raw, info.qtype, info.shape).astype(np.float32)
            except ValueError as exc:
                raise ModelFileError(f"{model.path}: tensor '{info.name}': {exc}") from None
            b = model.file.tensors.get(name + ".bias")
            return w, (b.raw.view(np.float32).copy() if b is not None else None)

        # jina-bert-v2's rerankers score with cls alone (llama.cpp reads no cls.output for them)
        return cls(pair("cls"), pair("cls.output") if model.hparams.arch == "bert" else None)

    def scores(self, x: np.ndarray) -> np.ndarray:
        """The head's output for one pooled vector [n_embd]: [n_classes] (the score is [0])."""
        h = np.asarray(x, dtype=np.float32)
        if self.cls is not None:
            w, b = self.cls
            h = w @ h + (b if b is not None else 0)
            h = np.tanh(h)
        if self.out is not None:
            w, b = self.out
            h = w @ h + (b if b is not None else 0)
        return h.astype(np.float32)


__all__ = ["RankHead"]
