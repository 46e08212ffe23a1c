"""Hyper-parameters of the llama-family architectures, read from GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ModelFileError
from .gguf_file import GGUFFile

ROPE_NORMAL = 0  # rotates adjacent pairs (x[2i], x[2i+1]) - llama
ROPE_NEOX = 2    # rotates (x[i], x[i + n_rot/2]) - qwen2, qwen3

# architecture -> (rope mode, has q/k/v bias, has per-head q/k norm)
ARCHITECTURES = {
    "llama": (ROPE_NORMAL, False, False),
    "qwen2": (ROPE_NEOX, True, False),
    "qwen3": (ROPE_NEOX, False, True),
}


@dataclass(frozen=True)
class HParams:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_scale: float
    n_rot: int
    rope_mode: int
    qkv_bias: bool
    qk_norm: bool

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim


def _int(gf: GGUFFile, key: str, default: int | None = None) -> int:
    value = gf.get(key, default)
    if value is None:
        raise ModelFileError(f"{gf.path}: missing metadata key '{key}'")
    if isinstance(value, list):  # per-layer arrays (some models): all layers must agree here
        if not value or any(v != value[0] for v in value):
            raise ModelFileError(f"{gf.path}: metadata key '{key}' varies per layer, which is not supported")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelFileError(f"{gf.path}: metadata key '{key}' must be a positive integer, got {value!r}")
    return value


def _float(gf: GGUFFile, key: str, default: float) -> float:
    value = gf.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ModelFileError(f"{gf.path}: metadata key '{key}' must be a positive number, got {value!r}")
    return float(value)


def read_hparams(gf: GGUFFile) -> HParams:
    arch = gf.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFileError(
            f"{gf.path}: unsupported architecture '{arch}' (supported: {', '.join(ARCHITECTURES)})")
    rope_mode, qkv_bias, qk_norm = ARCHITECTURES[arch]
    n_embd = _int(gf, f"{arch}.embedding_length")
    n_head = _int(gf, f"{arch}.attention.head_count")
    n_head_kv = _int(gf, f"{arch}.attention.head_count_kv", n_head)
    if n_head % n_head_kv:
        raise ModelFileError(f"{gf.path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    head_dim = _int(gf, f"{arch}.attention.key_length", n_embd // n_head if n_embd % n_head == 0 else None)
    value_dim = _int(gf, f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ModelFileError(f"{gf.path}: key_length {head_dim} != value_length {value_dim} is not supported")
    n_rot = _int(gf, f"{arch}.rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot % 2:
        raise ModelFileError(f"{gf.path}: rope.dimension_count {n_rot} must be even and at most the head size {head_dim}")
    tokens = gf.get("tokenizer.ggml.tokens")
    n_vocab = gf.get(f"{arch}.vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
    if not n_vocab:
        raise ModelFileError(f"{gf.path}: no vocabulary size ('{arch}.vocab_size' or 'tokenizer.ggml.tokens')")
    scale_type = gf.get(f"{arch}.rope.scaling.type", "none")
    rope_scale = 1.0
    if scale_type == "linear":
        rope_scale = 1.0 / _float(gf, f"{arch}.rope.scaling.factor", 1.0)
    elif scale_type not in ("none", None):
        raise ModelFileError(f"{gf.path}: rope scaling type '{scale_type}' is not supported")
    return HParams(
        arch=arch,
        n_vocab=int(n_vocab),
        n_embd=n_embd,
        n_layer=_int(gf, f"{arch}.block_count"),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=_int(gf, f"{arch}.feed_forward_length"),
        n_ctx_train=_int(gf, f"{arch}.context_length", 2048),
        rms_eps=_float(gf, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_base=_float(gf, f"{arch}.rope.freq_base", 10000.0),
        rope_scale=rope_scale,
        n_rot=n_rot,
        rope_mode=rope_mode,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
    )
