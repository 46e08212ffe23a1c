"""Engine: a model loaded on its devices with its tokenizer. Contexts (one per pipeline group) are
made from it and share its weights."""
from __future__ import annotations

import logging
from typing import Optional, Sequence

from .backend.base import Backend
from .backend.cpu import CPUBackend, set_compute_threads
from .context import Context
from .devices import default_split
from .errors import ModelFileError, PyllamaError
from .models.model import Model
from .tokenizer import Tokenizer, load_tokenizer
from .weights import Placement, Weights, load_weights, split_layers

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model_path: str, n_threads: int = 0, backends: Optional[Sequence[Backend]] = None,
                 tensor_split: Optional[Sequence[float]] = None, load: bool = True):
        """Opens the model and places its layers; with load=False the weights are not uploaded yet
        (check_memory first, then load())."""
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
        self.weights: Optional[Weights] = None
        if load:
            self.load()

    def load(self) -> None:
        self.weights = load_weights(self.model, self.placement)

    def check_memory(self, n_groups: int, n_ctx: int, n_seq_max: int, n_batch: int, n_ubatch: int,
                     kv_unified: bool) -> dict[str, int]:
        """Refuses (PyllamaError naming the device and the shortfall) a configuration whose weights
        plus every group's KV cache and compute buffers do not fit each device's free memory.
        Nothing is allocated; returns the bytes needed per device."""
        paper_weights = load_weights(self.model, self.placement, upload=False)
        paper = Context(self.model, paper_weights, self.placement, n_ctx, n_seq_max, n_batch, n_ubatch, kv_unified,
                        allocate=False)
        per_group = paper.device_bytes()
        need: dict[str, int] = {}
        for backend in self.backends:
            w = paper_weights.bytes_per_backend.get(backend.name, 0)
            g = per_group.get(backend.name, 0)
            need[backend.name] = w + n_groups * g
            free = backend.device_info().free
            if need[backend.name] > free:
                mib = 2 ** 20
                raise PyllamaError(
                    f"not enough memory on {backend.name}: {need[backend.name] / mib:.0f} MiB needed (weights "
                    f"{w / mib:.0f} MiB + {n_groups} group(s) x {g / mib:.0f} MiB of KV cache and compute buffers), "
                    f"{free / mib:.0f} MiB free: short by {(need[backend.name] - free) / mib:.0f} MiB")
        return need

    def new_context(self, n_ctx: int, n_seq_max: int = 1, n_batch: int = 2048, n_ubatch: int = 512,
                    kv_unified: bool = False) -> Context:
        assert self.weights is not None, "load() the weights first"
        return Context(self.model, self.weights, self.placement, n_ctx, n_seq_max, n_batch, n_ubatch, kv_unified)

    def close(self) -> None:
        if self.weights is not None:
            self.weights.free()
        for b in self.backends:
            b.close()
