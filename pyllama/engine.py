"""Engine: a model loaded on its devices with its tokenizer. Contexts (one per pipeline group) are
made from it and share its weights."""
from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

from .backend.base import Backend
from .backend.cpu import CPUBackend
from .context import Context
from .devices import default_split
from .errors import ModelFileError
from .models.model import Model
from .tokenizer import Tokenizer, load_tokenizer
from .weights import Placement, Weights, load_weights, split_layers

log = logging.getLogger(__name__)


def set_compute_threads(n_threads: int) -> int:
    """Caps BLAS threads for the whole process (the Cython kernels take the count per call)."""
    n = n_threads if n_threads > 0 else (os.cpu_count() or 1)
    try:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415
        threadpool_limits(limits=n, user_api="blas")
    except Exception as exc:  # pragma: no cover - only where threadpoolctl cannot see the BLAS
        log.warning("could not limit BLAS threads to %d: %s", n, exc)
    return n


class Engine:
    def __init__(self, model_path: str, n_threads: int = 0, backends: Optional[Sequence[Backend]] = None,
                 tensor_split: Optional[Sequence[float]] = None):
        self.n_threads = set_compute_threads(n_threads)
        self.model = Model(model_path)
        self.tokenizer: Tokenizer = load_tokenizer(self.model.file.metadata, source=model_path)
        hp = self.model.hparams
        if self.tokenizer.n_vocab != hp.n_vocab:
            raise ModelFileError(f"{model_path}: the vocabulary has {self.tokenizer.n_vocab} tokens "
                                 f"but the model has {hp.n_vocab} embedding rows")
        self.backends = list(backends) if backends else [CPUBackend(self.n_threads)]
        proportions = tensor_split or (default_split(self.backends) if len(self.backends) > 1 else [1.0])
        if len(proportions) != len(self.backends):
            raise ValueError(f"--tensor-split has {len(proportions)} values for {len(self.backends)} devices")
        self.placement = Placement(self.backends, split_layers(hp.n_layer, proportions))
        self.weights: Weights = load_weights(self.model, self.placement)

    def new_context(self, n_ctx: int, n_seq_max: int = 1, n_batch: int = 2048, n_ubatch: int = 512,
                    kv_unified: bool = False) -> Context:
        return Context(self.model, self.weights, self.placement, n_ctx, n_seq_max, n_batch, n_ubatch, kv_unified)

    def close(self) -> None:
        self.weights.free()
        for b in self.backends:
            b.close()
