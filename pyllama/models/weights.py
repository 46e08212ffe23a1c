"""Weights on devices: which backend holds each layer, and the upload of the model's weights there."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from ..backend.base import Backend, Buffer, DType, Tensor, nbytes_of
from ..backend.layout import dequantize_f32
from ..util.errors import ModelFileError, UnsupportedOpError
from ..ir.tensor import FAMILY_OPS, AttentionParams, Node, Op, family_node
from .build.llama import build_forward
from .lora import lora_weights
from .model import Model
from .gguf_file import TensorInfo

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

    @property
    def n_stages(self) -> int:
        """Devices a step goes through: those holding blocks, and the output layer's."""
        return len(set(self.layer_backend) | {self.output_backend})

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


# A logical weight on its device: one tensor, or (a fused q|k|v or gate|up whose file tensors the
# device stores in different types) its parts in row order, each part one type.
WeightRef = Union[Tensor, tuple[Tensor, ...]]


@dataclass
class Weights:
    """The model's weights on their devices, by logical name (fused where fused)."""

    tensors: dict[str, WeightRef] = field(default_factory=dict)
    buffers: list[Buffer] = field(default_factory=list)
    bytes_per_backend: dict[str, int] = field(default_factory=dict)
    # what was written: each stored tensor with the file tensors and type it was made from
    # (weights used in place in a memory-mapped file are not here: nothing was written)
    sources: list[tuple[Tensor, list[TensorInfo], DType]] = field(default_factory=list)
    # by layer (-1 the embedding, n_layer the output layer): its logical names and own buffers
    layer_names: dict[int, list[str]] = field(default_factory=dict)
    layer_buffers: dict[int, list[Buffer]] = field(default_factory=dict)
    # LoRA adapters (models/lora.py): adapted logical weight -> each adapter's rank block width;
    # its matrices are the weights `<name>.lora_a` and `<name>.lora_b`
    lora: dict[str, tuple[int, ...]] = field(default_factory=dict)
    n_lora: int = 0
    lora_factors: Optional[np.ndarray] = None  # each adapter's alpha / r, which its tokens' scales carry

    def __getitem__(self, name: str) -> WeightRef:
        return self.tensors[name]

    def get(self, name: str) -> Optional[WeightRef]:
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
        self.layer_names.clear()
        self.layer_buffers.clear()

    def replace_layers(self, moved: "Weights") -> list[Tensor]:
        """Takes the weights of `moved`'s layers (loaded on their new devices) in place of this
        one's: frees the buffers those layers had, and returns the tensors they had (for the
        devices to drop what they keep for them, e.g. the CPU's repacked copies)."""
        old: list[Tensor] = []
        for layer, names in moved.layer_names.items():
            gone = self.layer_buffers.pop(layer, [])
            gone_ids = {id(b) for b in gone}
            for lname in self.layer_names.get(layer, []):
                for t in _as_tuple(self.tensors[lname]):
                    old.append(t)
                    if t.buffer is not None and id(t.buffer) not in gone_ids:  # read in place from the file
                        self.bytes_per_backend[t.buffer.backend.name] -= t.nbytes
            self.buffers = [b for b in self.buffers if id(b) not in gone_ids]
            self.sources = [s for s in self.sources if id(s[0].buffer) not in gone_ids]
            for buf in gone:
                self.bytes_per_backend[buf.backend.name] -= buf.size
                buf.backend.free_buffer(buf)
            self.layer_names[layer] = list(names)
            self.layer_buffers[layer] = list(moved.layer_buffers.get(layer, []))
            for lname in names:
                self.tensors[lname] = moved.tensors[lname]
        known = {id(b) for b in self.buffers}
        self.buffers.extend(b for b in moved.buffers if id(b) not in known)
        self.sources.extend(moved.sources)
        for name, n in moved.bytes_per_backend.items():
            self.bytes_per_backend[name] = self.bytes_per_backend.get(name, 0) + n
        return old


@dataclass
class _Part:
    """One stored tensor of a logical weight: consecutive file tensors of one stored type."""

    infos: list[TensorInfo]
    dtype: DType
    shape: tuple[int, ...]
    mapped: bool  # used in place in the file's memory map (one file tensor, stored as the file has it)


def _parts(infos: list[TensorInfo], backend: Backend, can_map: bool, stack: bool = False) -> list[_Part]:
    """Groups a logical weight's file tensors (concatenated by rows) into runs the device stores
    in one type: one part when the types agree (the fusion stays whole), else one per run; one
    part per file tensor for types the device does not fuse (WeightLayout.fuses). stack: the file
    tensors are the experts of one 3-D tensor (old Mixtral files), one part [n, rows, cols]."""
    if stack:
        if len({(i.qtype, i.shape) for i in infos}) != 1:
            raise ModelFileError(f"{infos[0].name}: the experts of one tensor differ in type or shape")
        dtype = backend.layout.weight_dtype(infos[0].qtype)
        return [_Part(list(infos), dtype, (len(infos),) + infos[0].shape, False)]
    dtypes = [backend.layout.weight_dtype(i.qtype) for i in infos]
    if len(set(dtypes)) > 1 and not backend.supports(Op.MUL_MAT_CAT):
        dtypes = [DType.F32] * len(infos)  # a device without MUL_MAT_CAT gets the fusion whole, in F32
    parts: list[_Part] = []
    for info, dtype in zip(infos, dtypes):
        if parts and parts[-1].dtype == dtype and backend.layout.fuses(dtype):
            parts[-1].infos.append(info)
        else:
            parts.append(_Part([info], dtype, (), False))
    for p in parts:
        first = p.infos[0]
        rows = sum(i.shape[0] for i in p.infos)
        p.shape = (rows,) + first.shape[1:]
        # in place when the file's bytes serve as they are (GGUF aligns tensor data to 32 bytes by
        # default; a file with a smaller alignment gets its tensors copied, to aligned rows)
        p.mapped = (can_map and len(p.infos) == 1 and p.dtype == first.qtype and first.offset >= 0
                    and first.offset % _MAP_ALIGN == 0)
    return parts


def load_weights(model: Model, placement: Placement, upload: bool = True, map_weights: bool = True,
                 layers: Optional[set[int]] = None) -> Weights:
    """Places every logical weight on the backend of its layer, and uploads it.

    A device that can use host memory in place (the CPU) reads every weight that is one file
    tensor of a type it computes on straight from the file's memory map; the others (fused
    tensors, converted types, every weight of a device elsewhere) get one buffer per layer and
    device, so that a layer's weights can later move to another device and free their room here
    (`Engine.move_layers`). With upload=False nothing is allocated on any device: the tensors sit
    in placeholder buffers of the right sizes, which is enough to plan graphs and to check memory
    before loading. map_weights=False (--no-mmap) uses nothing in place: every weight is copied.
    layers: only the weights of these layers (-1 the embedding, n_layer the output layer).
    """
    hp = model.hparams
    check_placement(model, placement)
    n_backends = len(placement.backends)
    plan: list[tuple[str, int, int, list[_Part]]] = []
    aliases: dict[str, str] = {}  # a tied output matrix on its embedding's device is stored once
    first_of: dict[tuple[tuple[str, ...], int], str] = {}
    mapped_bufs: list[Optional[Buffer]] = [b.layout.map_host(model.file.data) if map_weights else None
                                           for b in placement.backends]
    sizes: dict[tuple[int, int], int] = {}  # (backend, layer) -> bytes of its buffer
    mapped_sizes = [0] * n_backends
    logical = _logical_weights(model)
    for lname, (infos, layer) in logical.items():
        if layers is not None and layer not in layers:
            continue
        bi = placement.backend_of_layer(layer)
        key = (tuple(i.name for i in infos), bi)
        if key in first_of:
            aliases[lname] = first_of[key]
            continue
        first_of[key] = lname
        parts = _parts(infos, placement.backends[bi], mapped_bufs[bi] is not None, lname in model.expert_stacks)
        for p in parts:
            if p.mapped:
                mapped_sizes[bi] += nbytes_of(p.dtype, p.shape)
            else:
                sizes[(bi, layer)] = sizes.get((bi, layer), 0) + _aligned(nbytes_of(p.dtype, p.shape))
        plan.append((lname, bi, layer, parts))
    weights = Weights()
    _set_lora(weights, model)
    buffers: dict[tuple[int, int], Buffer] = {}
    offsets: dict[tuple[int, int], int] = {}
    copied: list[TensorInfo] = []
    in_file: dict[int, TensorInfo] = {}  # id of a tensor read in place -> its file tensor
    try:
        for (bi, layer), size in sizes.items():
            backend = placement.backends[bi]
            buf = backend.alloc_buffer(size, usage="weights") if upload else Buffer(backend, size, "weights")
            buffers[(bi, layer)] = buf
            if upload:
                weights.buffers.append(buf)
                weights.layer_buffers.setdefault(layer, []).append(buf)
        for bi, backend in enumerate(placement.backends):
            if upload and mapped_sizes[bi]:
                weights.buffers.append(mapped_bufs[bi])  # type: ignore[arg-type]
            own = sum(size for (b, _), size in sizes.items() if b == bi)
            weights.bytes_per_backend[backend.name] = own + mapped_sizes[bi]
        for lname, bi, layer, parts in plan:
            stored = []
            weights.layer_names.setdefault(layer, []).append(lname)
            for k, p in enumerate(parts):
                name = lname if len(parts) == 1 else f"{lname}.{k}"
                if p.mapped:
                    stored.append(Tensor(p.dtype, p.shape, name, mapped_bufs[bi], p.infos[0].offset))
                    in_file[id(stored[-1])] = p.infos[0]
                    continue
                off = offsets.get((bi, layer), 0)
                t = Tensor(p.dtype, p.shape, name, buffers[(bi, layer)], off)
                offsets[(bi, layer)] = off + _aligned(t.nbytes)
                if upload:
                    _upload(placement.backends[bi], model, t, p.infos)
                    weights.sources.append((t, p.infos, p.dtype))
                    copied.extend(p.infos)
                stored.append(t)
            weights.tensors[lname] = stored[0] if len(stored) == 1 else tuple(stored)
    except BaseException:
        weights.free()  # what was allocated before the failure (a peer out of memory or lost)
        raise
    for lname, target in aliases.items():
        weights.tensors[lname] = weights.tensors[target]
        weights.layer_names.setdefault(logical[lname][1], []).append(lname)
    if upload:
        # the token embedding is only looked up, by rows in the file's layout, unless the output
        # layer multiplies by it too (tied): a copy for products would go unused
        lookup_only = {"token_embd"} - set(aliases.values())
        lookup_only |= {n + suffix for n in weights.lora for suffix in (".lora_a", ".lora_b")}  # (read as they are)
        for bi, backend in enumerate(placement.backends):
            own = backend.layout.prepare_weights([t for lname, tb, _, _ in plan
                                                  if tb == bi and lname not in lookup_only
                                                  for t in _as_tuple(weights.tensors[lname])])
            for t in own:  # the device computes on its own copy: the file's pages can go
                if id(t) in in_file:
                    model.file.release_pages(in_file[id(t)])
        in_place = {id(p.infos[0]) for _, bi, _, parts in plan for p in parts if p.mapped}
        for info in copied:  # their bytes now live in a device buffer: the file's pages can go
            if id(info) not in in_place and info.offset >= 0:  # (computed tensors have no file bytes)
                model.file.release_pages(info)
        if layers is None:
            log.info("loaded %s: %s, %d layers, weights %s%s", model.name, hp.arch, hp.n_layer,
                     ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in weights.bytes_per_backend.items()),
                     "".join(f" ({placement.backends[bi].name}: {m / 2**20:.1f} MiB read in place from the file)"
                             for bi, m in enumerate(mapped_sizes) if m and upload))
    return weights


def _set_lora(weights: Weights, model: Model) -> None:
    lora = model.lora
    if lora is not None:
        weights.lora, weights.n_lora, weights.lora_factors = lora.widths(), lora.n, lora.factors()


def _logical_weights(model: Model) -> dict[str, tuple[list[TensorInfo], int]]:
    """Every logical weight: its file tensors (or the ones computed at load) in row order, and
    its layer."""
    computed = computed_weights(model)
    out = {lname: ([model.file.tensors[f] for f in fnames], layer)
           for lname, (fnames, layer) in model.logical_weights().items()}
    out.update({lname: ([info], layer) for lname, (info, layer) in computed.items()})
    return out


def _as_tuple(t: "Tensor | tuple[Tensor, ...]") -> tuple[Tensor, ...]:
    return t if isinstance(t, tuple) else (t,)


# What a refused node does, for the one line that names it
_NODE_WHAT = {Op.GET_ROWS: "row lookup", Op.RMS_NORM: "RMS norm", Op.MUL_MAT: "matrix product", Op.ADD: "addition",
              Op.SWIGLU: "SwiGLU FFN", Op.ATTENTION: "attention", Op.SAMPLE: "sampling",
              Op.MUL_MAT_CAT: "product over weight parts of mixed types", Op.MOE_FFN: "Mixture-of-Experts FFN",
              Op.GEGLU: "GeGLU FFN", Op.SCALE: "embedding scale", Op.SOFTCAP: "logit soft-capping",
              Op.MLA_ATTENTION: "multi-head latent attention", Op.LAYER_NORM: "layer norm", Op.GELU: "GELU FFN",
              Op.LORA: "LoRA adapters' product"}


def check_placement(model: Model, placement: Placement) -> None:
    """Refuses a placement that gives a device a node it cannot run, before anything is allocated:
    the model's graph is built for a small batch over placeholder tensors (each weight in the
    type and parts its device would store it in; the KV cache in F32, which every device holds),
    and each node's device is asked about it (Device.supports_node, which reads the node's op and
    typed parameters). UnsupportedOpError names the device (and the rpc server's address), what
    the refused nodes do, the ops the device lacks for them, and their layers."""
    hp = model.hparams
    paper = Weights()
    _set_lora(paper, model)
    for lname, (infos, layer) in _logical_weights(model).items():
        parts = _parts(infos, placement.backends[placement.backend_of_layer(layer)], can_map=False,
                       stack=lname in model.expert_stacks)
        stored = tuple(Tensor(p.dtype, p.shape, lname if len(parts) == 1 else f"{lname}.{k}")
                       for k, p in enumerate(parts))
        paper.tensors[lname] = stored[0] if len(stored) == 1 else stored
    kv = [(Tensor(DType.F32, (1, hp.n_embd_kv), f"cache_k_l{il}"), Tensor(DType.F32, (1, hp.n_embd_kv), f"cache_v_l{il}"))
          for il in range(hp.n_layer)]
    # two tokens of which one wants logits: the output rows are selected, as in any prompt
    graph = build_forward(hp, paper, kv, n_tokens=2, n_outputs=1, n_cells_listed=2)
    refused: dict[int, list[Node]] = {}
    for nd in graph.nodes:
        bi = placement.backend_of_layer(nd.layer)
        if not placement.backends[bi].supports_node(nd):
            refused.setdefault(bi, []).append(nd)
    for bi, nodes in refused.items():
        backend = placement.backends[bi]
        what, lacks = {}, {}
        for nd in nodes:
            what.setdefault(_what(nd), None)
            for op in _lacking(backend, nd):
                lacks.setdefault(op.name, None)
        hint = backend.refusal_hint()
        layers = _layers_text(sorted({nd.layer for nd in nodes}), hp.n_layer)
        raise UnsupportedOpError(
            f"{model.name}: the {', '.join(what)} of {layers} cannot run on {backend.name}"
            f"{f' ({hint})' if hint else ''}, which lacks "
            f"{', '.join(lacks)}; keep {layers} on a device that has them (the CPU)")


def _what(nd: Node) -> str:
    """e.g. 'GeGLU FFN (GEGLU)', 'attention with soft-capping, a sliding window or scaled RoPE (ATTENTION)'."""
    what = _NODE_WHAT.get(nd.op, "node")
    if nd.op == Op.ATTENTION and AttentionParams.of(nd.params, len(nd.srcs)).sinks:
        what += " with sinks"
    elif nd.op == Op.ATTENTION and family_node(nd.op, nd.params, len(nd.srcs)):
        what += " with soft-capping, a sliding window or scaled RoPE"
    elif nd.op == Op.MOE_FFN and family_node(nd.op, nd.params, len(nd.srcs)):
        what += " with sigmoid, grouped or biased routing"
    return f"{what} ({nd.op.name})"


def _lacking(backend: Backend, nd: Node) -> list[Op]:
    """The ops `backend` lacks for node `nd`: its own, and for a node of the dense families'
    extensions those ops (FAMILY_OPS); the node's op when the device refuses it otherwise."""
    wanted = [nd.op] + (list(FAMILY_OPS) if family_node(nd.op, nd.params, len(nd.srcs)) else [])
    return [op for op in dict.fromkeys(wanted) if not backend.supports(op)] or [nd.op]


def _layers_text(layers: Sequence[int], n_layer: int) -> str:
    """e.g. 'the embedding, layers 0-5 and the output layer' (-1 the embedding, n_layer the output)."""
    blocks = [il for il in layers if 0 <= il < n_layer]
    parts = ["the embedding"] if -1 in layers else []
    if blocks:
        parts.append(f"layers {blocks[0]}-{blocks[-1]}" if len(blocks) > 1 else f"layer {blocks[0]}")
    if n_layer in layers:
        parts.append("the output layer")
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


LONGROPE_TENSORS = {"rope_freqs_long": "rope_factors_long.weight", "rope_freqs_short": "rope_factors_short.weight"}


def _factor_tensor(model: Model, name: str, half: int) -> Optional[np.ndarray]:
    """A file tensor of per-pair RoPE divisors (F32 [n_rot / 2], all positive) as float64, or None."""
    info = model.file.tensors.get(name)
    if info is None:
        return None
    if info.qtype != DType.F32 or info.shape != (half,):
        raise ModelFileError(f"{model.path}: tensor '{name}' must be F32 of shape [{half}], is "
                             f"{info.qtype.name} {list(info.shape)}")
    factors = info.raw.view(np.float32).astype(np.float64)
    if not np.all(factors > 0):
        raise ModelFileError(f"{model.path}: tensor '{name}' holds a value that is not positive")
    return factors


def rope_factors(model: Model, base: float, name: str = "rope_freqs.weight") -> Optional[np.ndarray]:
    """ATTENTION's rope_freqs for the layers that scale RoPE (float32 [n_rot / 2]), or None where
    plain (freq_base, freq_scale) say it all. As llama.cpp: the file's per-pair divisors (`name`:
    llama3's rope_freqs.weight, or one of phi3's LongRoPE pair), and for YaRN each pair's angle made
    a mix of the interpolated (times freq_scale) and the extrapolated one, ramping between yarn's
    correction dimensions; the graph then passes freq_scale 1 (it is folded in here)."""
    hp = model.hparams
    half = hp.n_rot // 2
    factors = _factor_tensor(model, name, half)
    if factors is None:
        if hp.rope_scaling != "yarn":
            return None
        factors = np.ones(half, dtype=np.float64)
    if hp.rope_scaling == "yarn":
        def corr_dim(n_rotations: float) -> float:  # the pair whose wavelength fits n_rotations times
            return hp.n_rot * math.log(hp.n_ctx_orig / (n_rotations * 2 * math.pi)) / (2 * math.log(base))
        low = max(0.0, math.floor(corr_dim(hp.yarn_beta_fast)))
        high = min(hp.n_rot - 1.0, math.ceil(corr_dim(hp.yarn_beta_slow)))
        i = np.arange(half, dtype=np.float64)
        ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)  # 1: extrapolate, 0: interpolate
        ramp *= hp.yarn_ext_factor
        factors = factors / (hp.rope_scale * (1.0 - ramp) + ramp)
    return factors.astype(np.float32)


def computed_weights(model: Model) -> dict[str, tuple[TensorInfo, int]]:
    """Weights computed at load rather than read from the file: each scaling layer's rope_freqs
    (one tensor, stored once per device), by logical name -> (its TensorInfo, its layer). A phi3
    LongRoPE file gives two, rope_freqs_long and rope_freqs_short, and each context takes the one
    its sequences' length calls for (models/build/llama.py), as llama.cpp; rope_freqs.weight, where
    a file has it, wins over them; and the LoRA adapters' matrices (models/lora.py)."""
    out = _rope_and_encoder_weights(model)
    out.update(lora_weights(model))
    return out


def _rope_and_encoder_weights(model: Model) -> dict[str, tuple[TensorInfo, int]]:
    hp = model.hparams
    if hp.encoder:
        table = _position_table(model)
        out = {"position_embd": (table, -1)} if table is not None else {}
        if hp.alibi_max_bias > 0:
            slopes = alibi_slopes(hp.n_head, hp.alibi_max_bias)
            info = TensorInfo("attn_alibi (computed)", DType.F32, slopes.shape, slopes.size, slopes.view(np.uint8), -1)
            out.update({f"blk.{il}.attn_alibi": (info, il) for il in range(hp.n_layer)})
        return out
    if hp.mla_lora_kv:  # MLA_ATTENTION computes its YaRN angles itself, as ggml's rope_ext does
        return {}
    names = {"rope_freqs": "rope_freqs.weight"}
    if "rope_freqs.weight" not in model.file.tensors and any(t in model.file.tensors for t in LONGROPE_TENSORS.values()):
        names = dict(LONGROPE_TENSORS)
    out: dict[str, tuple[TensorInfo, int]] = {}
    for logical, tensor in names.items():
        factors = rope_factors(model, hp.rope_base, tensor)
        if factors is None:
            continue
        info = TensorInfo(f"{logical} (computed)", DType.F32, factors.shape, factors.size, factors.view(np.uint8), -1)
        out.update({f"blk.{il}.{logical}": (info, il) for il in range(hp.n_layer)
                    if not (hp.is_swa[il] and hp.rope_base_swa > 0)})  # gemma3's local layers never scale
    return out


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ALiBi's slope per head (float32 [n_head]) as ggml's soft_max computes them from max_bias:
    the first 2^floor(log2(n_head)) heads powers of m0, the rest odd powers of m1."""
    n_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = np.float32(2.0) ** np.float32(-max_bias / n_log2)
    m1 = np.float32(2.0) ** np.float32(-(max_bias / 2.0) / n_log2)
    h = np.arange(n_head)
    return np.where(h < n_log2, m0 ** (h + 1.0), m1 ** (2.0 * (h - n_log2) + 1.0)).astype(np.float32)


def _position_table(model: Model) -> Optional[TensorInfo]:
    """What an encoder adds to each token's embedding by its position (F32 [n_ctx_train, n_embd]):
    the learned position embeddings (bert) plus the first token type's row (every token is of
    type 0, as llama.cpp's graph has it), so that one lookup and one addition serve both; for a
    RoPE encoder the type row alone on every row, or None without one."""
    hp = model.hparams
    types = model.file.tensors.get("token_types.weight")
    if "position_embd.weight" in model.file.tensors and hp.arch == "bert":
        table = _f32(model, [model.file.tensors["position_embd.weight"]]).astype(np.float32, copy=True)
    elif types is not None:
        table = np.zeros((hp.n_ctx_train, hp.n_embd), dtype=np.float32)
    else:
        return None
    if types is not None:
        table += _f32(model, [types])[0]
    return TensorInfo("position_embd (computed)", DType.F32, table.shape, table.size, table.view(np.uint8).reshape(-1), -1)


def _upload(backend: Backend, model: Model, t: Tensor, infos: list[TensorInfo]) -> None:
    """Writes one stored tensor: the file bytes as they are when the device stores the file's type
    (concatenated once when fused), F32 converted on the host (a peer that computes in F32), or
    each file tensor converted into its rows of the tensor by the device's layout (set_weight)."""
    if all(i.qtype == t.dtype for i in infos):
        backend.set_tensor(t, infos[0].raw if len(infos) == 1 else np.concatenate([i.raw for i in infos]))
        return
    if t.dtype == DType.F32:
        backend.set_tensor(t, _f32(model, infos))
        return
    offset = 0
    for info in infos:
        backend.layout.set_weight(t, offset, info.qtype, info.raw)
        offset += nbytes_of(t.dtype, info.shape)


def _f32(model: Model, infos: list[TensorInfo]) -> np.ndarray:
    arrays = []
    for info in infos:
        try:
            arrays.append(dequantize_f32(info.raw, info.qtype, info.shape))
        except ValueError as exc:
            raise ModelFileError(f"{model.path}: tensor '{info.name}': {exc}") from None
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)


_MAP_ALIGN = 32


def _aligned(n: int, align: int = 64) -> int:
    return -(-n // align) * align
