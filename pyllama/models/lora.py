"""LoRA adapters: llama.cpp's adapter GGUF files, checked against their base model and laid out for
the LORA op (pyllama.ir.tensor).

An adapter file (what llama.cpp's converter writes) holds, for each adapted matrix W [m, k] of the
base model, `<W's name>.lora_a` [r, k] and `<W's name>.lora_b` [m, r]; `adapter.lora.alpha` sets
the product's scale, alpha / r times the user's scale (the user's scale alone when alpha is 0).

Adapters are never merged into the weights (a quantized weight would lose them to rounding, and
each request may ask for other adapters and scales). Every adapted logical weight gets one pair of
F32 matrices holding all loaded adapters: A [R, k] their `lora_a` rows stacked, B [m, R] their
`lora_b` columns side by side, each times alpha / r. A fused weight (q|k|v, gate|up) takes each
part's adapter into its own rows of B, so one adapter's block of A and B is block-diagonal. The
LORA node then adds ((x @ A.T) * scale) @ B.T, where scale holds each token's scale of each adapter
(its request's), so that requests with other adapters share a batch.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from ..backend.layout import dequantize_f32
from ..ir.tensor import DType
from ..util.errors import ModelFileError, PyllamaError
from .gguf_file import GGUFFile, TensorInfo

if TYPE_CHECKING:
    from .model import Model

log = logging.getLogger(__name__)

# At most this many adapters: a LORA node names each adapter's rank block in its parameters,
# and a node carries N_PARAMS of them on the wire (pyllama.rpc.protocol).
MAX_ADAPTERS = 12

# The logical weights whose products the graph adapts (models/build/llama.py): the dense layers'
# attention and FFN matrices and the output layer. Others (experts, latent attention, encoders)
# are refused at load rather than ignored.
ADAPTED = ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down")
ADAPTED_GLOBAL = ("output",)


class LoraError(PyllamaError):
    """An adapter file that cannot serve its base model."""


@dataclass
class LoraAdapter:
    """One adapter file: its pairs by base tensor name, a [r, k] and b [m, r] as float32."""

    path: str
    alpha: float
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]
    task_name: str = ""
    prompt_prefix: str = ""
    half: bool = False  # every matrix is F16 in the file (llama.cpp's converter's default): products round to F16

    def factor(self, rank: int) -> float:
        """The scale of a pair of rank `rank` at adapter scale 1 (as llama.cpp's get_scale)."""
        return self.alpha / rank if self.alpha else 1.0

    @property
    def uniform_factor(self) -> Optional[float]:
        """factor() of every pair when all have one rank (the usual adapter), else None."""
        ranks = {a.shape[0] for a, _ in self.pairs.values()}
        return self.factor(ranks.pop()) if len(ranks) == 1 else None


@dataclass
class LoraSet:
    """The adapters loaded with a model, and per adapted logical weight its A, B and rank blocks."""

    adapters: list[LoraAdapter]
    fused: dict[str, tuple[np.ndarray, np.ndarray, tuple[int, ...]]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.adapters)

    def factors(self) -> np.ndarray:
        """Each adapter's alpha / r where it is the same for all its pairs (its tokens' scales are
        multiplied by it: the matrices stay as the file has them), else 1 (folded into B)."""
        return np.asarray([ad.uniform_factor or 1.0 for ad in self.adapters], dtype=np.float32)

    def widths(self) -> dict[str, tuple[int, ...]]:
        """Adapted logical weight -> each adapter's rank block width (0 where it leaves it alone)."""
        return {name: widths for name, (_, _, widths) in self.fused.items()}


def load_adapter(path: str, model: "Model") -> LoraAdapter:
    """Reads and checks one adapter file against `model`; LoraError or ModelFileError says why not."""
    path = os.fspath(path)
    f = GGUFFile(path)
    where = f"LoRA adapter {path}"
    if f.get("general.type") != "adapter":
        raise LoraError(f"{where}: general.type is {f.get('general.type')!r}, not 'adapter'")
    if f.get("adapter.type") != "lora":
        raise LoraError(f"{where}: adapter.type is {f.get('adapter.type')!r}, not 'lora'")
    if f.get("general.architecture") != model.file.get("general.architecture"):
        raise LoraError(f"{where}: made for {f.get('general.architecture')!r}, the model is "
                        f"{model.file.get('general.architecture')!r}")
    if f.get("adapter.alora.invocation_tokens") is not None:
        raise LoraError(f"{where}: activated LoRA (adapter.alora.invocation_tokens) is not supported")
    alpha = f.get("adapter.lora.alpha", 0.0)
    if not isinstance(alpha, (int, float)) or not np.isfinite(alpha):
        raise LoraError(f"{where}: adapter.lora.alpha is {alpha!r}, not a number")
    halves: dict[str, dict[str, TensorInfo]] = {}
    for name, info in f.tensors.items():
        if name.endswith((".lora_a", ".lora_b")):
            halves.setdefault(name[:-7], {})[name[-1]] = info
        elif name.endswith("_norm.weight"):
            continue  # norm vectors in adapters are skipped, as llama.cpp skips them
        else:
            raise LoraError(f"{where}: tensor '{name}' is neither a .lora_a nor a .lora_b")
    if not halves:
        raise LoraError(f"{where}: no .lora_a / .lora_b tensor pairs")
    pairs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for base, ab in sorted(halves.items()):
        if set(ab) != {"a", "b"}:
            raise LoraError(f"{where}: '{base}' has only its lora_{next(iter(ab))}")
        target = model.file.tensors.get(base)
        if target is None:
            raise LoraError(f"{where}: '{base}' is not a tensor of {model.name} (made for another model?)")
        a, b = ab["a"], ab["b"]
        if len(a.shape) != 2 or len(b.shape) != 2 or len(target.shape) != 2:
            raise LoraError(f"{where}: '{base}' and its pair must be matrices")
        m, k = target.shape
        if a.shape[1] != k or b.shape[0] != m or a.shape[0] != b.shape[1]:
            raise LoraError(f"{where}: '{base}' is [{m}, {k}] (rows, columns) but its lora_a is {list(a.shape)} "
                            f"and lora_b {list(b.shape)}; expected [r, {k}] and [{m}, r] (made for another model?)")
        pairs[base] = (_f32(a, where), _f32(b, where))
    half = all(ab[x].qtype == DType.F16 for ab in halves.values() for x in "ab")
    return LoraAdapter(path, float(alpha), pairs, str(f.get("adapter.lora.task_name", "") or ""),
                       str(f.get("adapter.lora.prompt_prefix", "") or ""), half)


def _f32(info: TensorInfo, where: str) -> np.ndarray:
    try:
        x = dequantize_f32(info.raw, info.qtype, info.shape)
    except ValueError as exc:
        raise ModelFileError(f"{where}: tensor '{info.name}': {exc}") from None
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.all(np.isfinite(x)):
        raise ModelFileError(f"{where}: tensor '{info.name}' holds a value that is not finite")
    return x


def load_lora_set(paths: Sequence[str], model: "Model") -> Optional[LoraSet]:
    """The adapters of `paths` laid out for `model`'s logical weights, or None without any."""
    if not paths:
        return None
    if len(paths) > MAX_ADAPTERS:
        raise LoraError(f"{len(paths)} LoRA adapters given; at most {MAX_ADAPTERS} can be loaded at once")
    hp = model.hparams
    if hp.encoder:
        raise LoraError(f"{model.name}: LoRA adapters on an encoder ({hp.arch}) are not supported")
    adapters = [load_adapter(p, model) for p in paths]
    return LoraSet(adapters, _fuse(model, adapters))


def _fuse(model: "Model", adapters: list[LoraAdapter]) -> dict[str, tuple[np.ndarray, np.ndarray, tuple[int, ...]]]:
    """Per adapted logical weight: A [R, k], B [m, R] (float32) and the block widths. alpha / r is
    folded into B only for an adapter whose pairs differ in rank (else its tokens' scales carry it,
    LoraSet.factors). The width of an adapter stored as F16 in its file is negative: the LORA node
    rounds that block's activations to F16 before each product, as ggml's products against F16
    matrices do (its values are F16 values, exact in float32)."""
    hp = model.hparams
    adaptable = {f"blk.{il}.{n}" for il in range(hp.n_layer) if not hp.moe_layer(il) for n in ADAPTED}
    adaptable.update(ADAPTED_GLOBAL)
    # file tensor -> (logical weight, its first row there)
    rows_of: dict[str, tuple[str, int]] = {}
    logical = model.logical_weights()
    for lname, (fnames, _) in logical.items():
        if model.tied_output and lname == "output":
            continue  # the embedding's table, not a matrix of its own
        row = 0
        for fname in fnames:
            rows_of.setdefault(fname, (lname, row))
            row += model.file.tensors[fname].shape[0]
    wanted: set[str] = set()
    for ad in adapters:
        for base in ad.pairs:
            lname = rows_of.get(base, (None, 0))[0]
            if lname not in adaptable:
                raise LoraError(f"LoRA adapter {ad.path}: adapting '{base}' is not supported (only the dense "
                                f"layers' attention and FFN matrices and the output matrix are)")
            wanted.add(lname)
    out = {}
    for lname in sorted(wanted):
        fnames = logical[lname][0]
        m = sum(model.file.tensors[f].shape[0] for f in fnames)
        k = model.file.tensors[fnames[0]].shape[1]
        a_blocks, b_blocks, widths = [], [], []
        for ad in adapters:
            parts = [(f, ad.pairs[f]) for f in fnames if f in ad.pairs]
            width = sum(a.shape[0] for _, (a, _) in parts)
            widths.append(-width if ad.half else width)
            if not width:
                continue
            uniform = ad.uniform_factor
            bb = np.zeros((m, width), dtype=np.float32)
            col = 0
            for fname, (a, b) in parts:
                row = rows_of[fname][1]
                r = a.shape[0]
                bb[row:row + b.shape[0], col:col + r] = b if uniform is not None else b * np.float32(ad.factor(r))
                col += r
            a_blocks.append(np.concatenate([a for _, (a, _) in parts], axis=0))
            b_blocks.append(bb)
        out[lname] = (np.ascontiguousarray(np.concatenate(a_blocks, axis=0)),
                      np.ascontiguousarray(np.concatenate(b_blocks, axis=1)), tuple(widths))
        assert out[lname][0].shape[1] == k
    return out


def lora_weights(model: "Model") -> dict[str, tuple[TensorInfo, int]]:
    """The adapters' matrices as weights computed at load (models/weights.py): `<name>.lora_a`
    and `<name>.lora_b` of each adapted logical weight, on its layer's device."""
    lora = model.lora
    if lora is None:
        return {}
    layers = {lname: layer for lname, (_, layer) in model.logical_weights().items()}
    out = {}
    for lname, (a, b, _) in lora.fused.items():
        for suffix, x in ((".lora_a", a), (".lora_b", b)):
            info = TensorInfo(f"{lname}{suffix} (adapters)", DType.F32, x.shape, x.size, x.view(np.uint8).reshape(-1), -1)
            out[lname + suffix] = (info, layers[lname])
    return out


# --- the programs' flags (llama.cpp's names) -----------------------------------------------------
def _files_arg(text: str) -> list[tuple[str, float]]:
    return [(path.strip(), 1.0) for path in text.split(",") if path.strip()]


def _scaled_arg(text: str) -> list[tuple[str, float]]:
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        path, sep, scale = item.rpartition(":")
        try:
            value = float(scale)
        except ValueError:
            value = math.nan
        if not sep or not path or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{item!r} is not FNAME:SCALE (a file and a finite number)")
        out.append((path, value))
    return out


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """--lora, --lora-scaled and --lora-init-without-apply, as llama.cpp's programs take them."""
    p.add_argument("--lora", dest="lora", type=_files_arg, action="append", default=[], metavar="FNAME",
                   llama_env=None,
                   help="LoRA adapter file(s), comma-separated (the flag may repeat), at scale 1 (the server: for every "
                        "request that does not ask otherwise with its 'lora' field or POST /lora-adapters)")
    p.add_argument("--lora-scaled", dest="lora", type=_scaled_arg, action="append", metavar="FNAME:SCALE,...",
                   llama_env=None, help="LoRA adapter file(s) with their scale, FNAME:SCALE comma-separated")
    p.add_argument("--lora-init-without-apply", dest="lora_init_without_apply", action="store_true", llama_env=None,
                   help="load the LoRA adapters at scale 0 (the server: applied later by POST /lora-adapters or a "
                        "request's 'lora')")


def lora_adapters(args: argparse.Namespace) -> list[tuple[str, float]]:
    """--lora and --lora-scaled as (file, scale) in the order given (the adapters' ids); scale 0
    for each with --lora-init-without-apply."""
    adapters = [pair for group in getattr(args, "lora", None) or [] for pair in group]
    if getattr(args, "lora_init_without_apply", False):
        adapters = [(path, 0.0) for path, _ in adapters]
    return adapters
