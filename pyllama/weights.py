"""Weights on devices: which backend holds each layer, and the upload of the model's weights there."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .backend.base import Backend, Buffer, DType, Tensor, nbytes_of
from .models.model import Model
from .models.gguf_file import TensorInfo

log = logging.getLogger(__name__)


def layer_of(name: str, n_layer: int) -> int:
    """-1 for the embedding, n_layer for the output layer, else the block index."""
    if name.startswith("blk."):
        return int(name.split(".")[1])
    return -1 if name.startswith("token_embd") else n_layer


@dataclass
class Placement:
    """Which backend holds each layer. The output layer sits on the last backend."""

    backends: list[Backend]
    layer_backend: list[int]  # per block index

    @property
    def output_backend(self) -> int:
        return len(self.backends) - 1

    def describe(self) -> str:
        """e.g. 'RPC0 0-5, CPU 6-11 + output'."""
        parts = []
        for bi, b in enumerate(self.backends):
            layers = [i for i, x in enumerate(self.layer_backend) if x == bi]
            span = f"{layers[0]}-{layers[-1]}" if layers else "none"
            parts.append(f"{b.name} {span}" + (" + output" if bi == self.output_backend else ""))
        return ", ".join(parts)

    def backend_of_layer(self, layer: int) -> int:
        if layer < 0:
            return self.layer_backend[0] if self.layer_backend else self.output_backend
        if layer >= len(self.layer_backend):
            return self.output_backend
        return self.layer_backend[layer]


def split_layers(n_layer: int, proportions: Sequence[float]) -> list[int]:
    """Layer -> device index, contiguous ranges in device order, sized by `proportions`."""
    total = float(sum(proportions))
    if total <= 0 or any(p < 0 for p in proportions):
        raise ValueError("tensor split proportions must be non-negative and not all zero")
    cum, bounds = 0.0, []
    for p in proportions:
        cum += p / total
        bounds.append(round(cum * n_layer))
    out, dev = [], 0
    for i in range(n_layer):
        while i >= bounds[dev]:
            dev += 1
        out.append(dev)
    return out


@dataclass
class Weights:
    """The model's weights on their devices, by logical name (fused where fused)."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    buffers: list[Buffer] = field(default_factory=list)
    bytes_per_backend: dict[str, int] = field(default_factory=dict)
    # what was uploaded: each stored tensor with the file tensors and type it was made from
    sources: list[tuple[Tensor, list[TensorInfo], DType]] = field(default_factory=list)

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def get(self, name: str) -> Optional[Tensor]:
        return self.tensors.get(name)

    def upload(self, model: Model, backend: Backend) -> None:
        """Writes the weights that live on `backend` again (its buffers were made anew)."""
        for t, infos, dtype in self.sources:
            if t.backend is backend:
                _upload(backend, model, t, infos)

    def free(self) -> None:
        for buf in self.buffers:
            buf.backend.free_buffer(buf)
        self.buffers.clear()
        self.tensors.clear()
        self.sources.clear()


def load_weights(model: Model, placement: Placement, upload: bool = True) -> Weights:
    """Places every logical weight on the backend of its layer, one buffer per backend, and uploads it.

    With upload=False nothing is allocated on any device: the tensors sit in placeholder buffers
    of the right sizes, which is enough to plan graphs and to check memory before loading.
    """
    hp = model.hparams
    plan: list[tuple[str, list[TensorInfo], int, DType, tuple[int, ...]]] = []
    aliases: dict[str, str] = {}  # a tied output matrix on its embedding's device is stored once
    first_of: dict[tuple[tuple[str, ...], int], str] = {}
    sizes = [0] * len(placement.backends)
    for lname, (fnames, layer) in model.logical_weights().items():
        infos = [model.file.tensors[f] for f in fnames]
        bi = placement.backend_of_layer(layer)
        key = (tuple(fnames), bi)
        if key in first_of:
            aliases[lname] = first_of[key]
            continue
        first_of[key] = lname
        dtype = placement.backends[bi].weight_dtype(infos[0].qtype)
        rows = sum(i.shape[0] for i in infos)
        shape = (rows,) + infos[0].shape[1:] if len(infos[0].shape) > 1 else (sum(i.shape[0] for i in infos),)
        plan.append((lname, infos, bi, dtype, shape))
        sizes[bi] += _aligned(nbytes_of(dtype, shape))
    weights = Weights()
    buffers = []
    for bi, backend in enumerate(placement.backends):
        size = max(sizes[bi], 1)
        buf = backend.alloc_buffer(size, usage="weights") if upload else Buffer(backend, size, "weights")
        buffers.append(buf)
        if upload:
            weights.buffers.append(buf)
        weights.bytes_per_backend[backend.name] = sizes[bi]
    offsets = [0] * len(placement.backends)
    for lname, infos, bi, dtype, shape in plan:
        t = Tensor(dtype, shape, lname, buffers[bi], offsets[bi])
        offsets[bi] += _aligned(t.nbytes)
        if upload:
            _upload(placement.backends[bi], model, t, infos)
            weights.sources.append((t, infos, dtype))
        weights.tensors[lname] = t
    for lname, target in aliases.items():
        weights.tensors[lname] = weights.tensors[target]
    if upload:
        log.info("loaded %s: %s, %d layers, weights %s", model.name, hp.arch, hp.n_layer,
                 ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in weights.bytes_per_backend.items()))
    return weights


def _upload(backend: Backend, model: Model, t: Tensor, infos: list[TensorInfo]) -> None:
    """Writes one logical weight: converted to F32 on the host (CPU and RPC devices), or the file
    bytes as they are when the device stores the file's type; a device that stores another type
    (CUDA: F16) gets each file tensor to convert on arrival, into its rows of the fused tensor."""
    if t.dtype == DType.F32 or all(i.qtype == t.dtype for i in infos):
        backend.set_tensor(t, model.host_data(infos, t.dtype))
        return
    offset = 0
    for info in infos:
        backend.set_weight(t, offset, info.qtype, info.raw)
        offset += nbytes_of(t.dtype, info.shape)


def _aligned(n: int, align: int = 64) -> int:
    return -(-n // align) * align
