"""Hyper-parameters of the llama-family architectures, read from GGUF metadata."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from ..util.errors import ModelFileError
from .gguf_file import GGUFFile

ROPE_NORMAL = 0  # rotates adjacent pairs (x[2i], x[2i+1]) - llama
ROPE_NEOX = 2    # rotates (x[i], x[i + n_rot/2]) - qwen2, qwen3

# architecture -> (rope mode, has q/k/v bias, has per-head q/k norm)
ARCHITECTURES = {
    "llama": (ROPE_NORMAL, False, False),
    "qwen2": (ROPE_NEOX, True, False),
    "qwen3": (ROPE_NEOX, False, True),
    "qwen2moe": (ROPE_NEOX, True, False),
    "qwen3moe": (ROPE_NEOX, False, True),
    "gemma2": (ROPE_NEOX, False, False),
    "gemma3": (ROPE_NEOX, False, True),
    "phi3": (ROPE_NEOX, False, False),
    # q/k/v biases and per-head q/k norms where its file has them (GLM-4.5 has the biases, the
    # 355B model the norms too)
    "glm4moe": (ROPE_NEOX, False, False),
    # GLM-4-0414 (dense): normal-mode RoPE on part of the head, post-norms, gate|up fused in ffn_up
    "glm4": (ROPE_NORMAL, False, False),
    # DeepSeek V2/V3/R1, Kimi K2: multi-head latent attention (MLA files only), normal-mode RoPE on
    # the rope part of each head, leading dense layers, then routed and shared experts
    "deepseek2": (ROPE_NORMAL, False, False),
    # gpt-oss: NeoX RoPE (YaRN in the published files), q/k/v and output biases, attention sinks,
    # every other layer in a sliding window, and Mixture-of-Experts layers with biased experts
    "gpt-oss": (ROPE_NEOX, True, False),
    # BERT: an encoder (every token sees its whole sequence), learned positions instead of RoPE,
    # LayerNorm with biases after attention and after the FFN, an ungated GELU FFN with biases
    "bert": (ROPE_NORMAL, True, False),
    # nomic-bert: BERT's layer with NeoX RoPE instead of learned positions and a SwiGLU FFN; q|k|v
    # fused in the file, biases where it has them
    "nomic-bert": (ROPE_NEOX, False, False),
    # jina-bert-v2: BERT's layer with ALiBi instead of positions (no RoPE) and a GeGLU FFN over
    # gate|up fused in the file's ffn_up (or an ungated GELU where ffn_up is n_ff wide)
    "jina-bert-v2": (ROPE_NORMAL, True, False),
}
# encoders: no output layer, embeddings (and a classification head's scores) only
ENCODER_ARCHS = ("bert", "nomic-bert", "jina-bert-v2")
JINA_ALIBI_MAX_BIAS = 8.0  # llama.cpp's fixed ALiBi bias for jina-bert-v2
# architectures whose q/k/v biases and q/k norms are optional: present where the file has them
OPTIONAL_ATTN_TENSORS = ("glm4moe", "glm4")
# architectures whose last `nextn_predict_layers` blocks only predict further tokens (multi-token
# prediction): in the file, never computed, as llama.cpp skips them
NEXTN_ARCHS = ("glm4moe", "glm4", "deepseek2")
GEMMA_ARCHS = ("gemma2", "gemma3")
# the RoPE scaling types of `{arch}.rope.scaling.type` (llama.cpp's names); llama3's per-dimension
# factors come as the tensor rope_freqs.weight instead, with any of them
ROPE_SCALING_TYPES = ("none", "linear", "yarn")
# Mixture-of-Experts architectures (every layer's FFN is routed) -> whether the chosen experts'
# weights are divided by their sum when the file has no `{arch}.expert_weights_norm` key (what
# llama.cpp builds for each: Qwen2MoE's norm_topk_prob defaults to false, Qwen3MoE's models and
# Mixtral normalize). `llama` is MoE (Mixtral-style) when its file has `llama.expert_count`.
MOE_NORM_DEFAULT = {"qwen2moe": False, "qwen3moe": True, "llama": True, "glm4moe": False, "deepseek2": False,
                    "gpt-oss": False}
EXPERT_GATING_SOFTMAX = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
EXPERT_GATING_SIGMOID = 2
EXPERT_GATING_SOFTMAX_WEIGHT = 3  # choose by the router logits, weigh by the chosen ones' softmax (gpt-oss)
# the gating an architecture's MoE layers use when the file names none (llama.cpp's loaders)
GATING_DEFAULT = {"glm4moe": EXPERT_GATING_SIGMOID}


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
    # Mixture of Experts (n_expert 0: a dense FFN)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0            # rows of each expert's gate and up matrices
    n_ff_shexp: int = 0          # the shared expert's (0: none)
    expert_weights_norm: bool = False
    expert_weights_scale: float = 1.0
    expert_gating: int = EXPERT_GATING_SOFTMAX  # 2: sigmoid (glm4moe), with the expert bias exp_probs_b;
                                                # 3: the chosen logits' softmax (gpt-oss)
    moe_biases: bool = False     # the router and every expert have biases, and SwiGLU is clamped (gpt-oss)
    attn_sinks: bool = False     # a learned sink logit per head joins each softmax (gpt-oss)
    n_layer_dense_lead: int = 0  # the first layers of a MoE model with a dense FFN instead (glm4moe)
    n_layer_nextn: int = 0       # blocks after n_layer that only predict further tokens (glm4moe's
                                 # NextN/MTP layers): in the file, never computed
    n_expert_groups: int = 1     # DeepSeek V3's group-limited routing: experts in this many groups,
    n_group_used: int = 1        # of which each token's experts come from this many
    # multi-head latent attention (deepseek2; mla_lora_kv 0: none). head_dim is then the cache
    # row (latent + rope), n_head_kv 1; each head's query has mla_nope + n_rot values, its output mla_v
    mla_lora_q: int = 0          # the query's low-rank width (0: a plain attn_q)
    mla_lora_kv: int = 0         # the latent's width (kv_lora_rank)
    mla_nope: int = 0
    mla_v: int = 0
    yarn_log_mul: float = 0.0    # DeepSeek's mscale_all_dim (rope.scaling.yarn_log_multiplier / 0.1)
    # RoPE scaling (llama.cpp's semantics): rope_scale above is its freq_scale (1 / factor, also
    # for yarn); yarn mixes interpolated and extrapolated frequencies over the pairs between its
    # correction dimensions and scales cos/sin by rope_mscale
    rope_scaling: str = "none"
    n_ctx_orig: int = 0           # the original context length: yarn's, and the context beyond which
                                  # phi3 takes its long LongRoPE factors (0: n_ctx_train)
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_ext_factor: float = 1.0  # how much of the ramp extrapolates (0: yarn interpolates alone)
    rope_attn_factor: float = 1.0  # cos/sin's factor (phi3's LongRoPE magnitude; yarn's times its own)
    # the gemma and phi3 families
    swa_layers: tuple = ()        # per layer: True where it attends through the sliding window
    n_swa: int = 0                # the window (positions p - n_swa < q <= p), 0: none
    rope_base_swa: float = 0.0    # sliding-window layers' RoPE base (0: rope_base); they never scale
    attn_scale: float = 0.0       # the query scale (0: 1 / sqrt(head_dim))
    attn_softcap: float = 0.0     # gemma2's attention logit soft-cap (0: none)
    final_softcap: float = 0.0    # gemma2's final logit soft-cap (0: none)
    embd_scale: float = 0.0       # the input embeddings' factor (gemma: sqrt(n_embd); 0: none)
    post_norms: bool = False      # gemma2/3, glm4: RMS norms after attention and after the FFN
    qkv_fused: bool = False       # q|k|v in the file as one attn_qkv tensor (phi3; glm4 where so written)
    ffn_gelu: bool = False        # gemma: GeGLU (gelu tanh) instead of SwiGLU
    # encoders (ENCODER_ARCHS): rms_eps above is their LayerNorm's epsilon
    encoder: bool = False         # no output layer: the last layer's output is the embedding
    causal: bool = True           # False: every token attends to every token of its sequence
    alibi_max_bias: float = 0.0   # ALiBi's max bias (jina-bert-v2: 8), 0: none

    @property
    def is_swa(self) -> tuple:
        return self.swa_layers or (False,) * self.n_layer

    @property
    def rope_mscale(self) -> float:
        """cos/sin scale: YaRN's 1 + 0.1 ln(factor) (when it extrapolates) times its attn_factor,
        as llama.cpp; without YaRN the attn_factor alone (phi3's LongRoPE files set one)."""
        if self.rope_scaling != "yarn":
            return self.rope_attn_factor
        if self.yarn_ext_factor == 0:
            return self.rope_attn_factor
        return self.rope_attn_factor * (1.0 + 0.1 * math.log(1.0 / self.rope_scale))

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def moe_layer(self, il: int) -> bool:
        """Whether layer il's FFN is routed (a MoE model's leading dense layers are not)."""
        return self.n_expert > 0 and il >= self.n_layer_dense_lead

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


def _mla_hparams(gf: GGUFFile, head_dim: int, value_dim: int, n_head_kv: int, n_rot: int) -> dict:
    """deepseek2's multi-head latent attention as llama.cpp reads an MLA file: the cache row
    (key_length) is the latent (value_length = kv_lora_rank) and the rope part, one KV head."""
    if gf.get("deepseek2.attention.key_length_mla") is None:
        raise ModelFileError(f"{gf.path}: a deepseek2 file without 'deepseek2.attention.key_length_mla' (from a "
                             "converter before multi-head latent attention) is not supported; convert it again")
    lora = _int(gf, "deepseek2.attention.kv_lora_rank")
    k_mla, v_mla = _int(gf, "deepseek2.attention.key_length_mla"), _int(gf, "deepseek2.attention.value_length_mla")
    if n_head_kv != 1 or value_dim != lora or head_dim != lora + n_rot or k_mla <= n_rot:
        raise ModelFileError(f"{gf.path}: MLA needs head_count_kv 1, value_length = kv_lora_rank ({lora}), key_length "
                             f"= kv_lora_rank + rope.dimension_count and key_length_mla above it; got {n_head_kv}, "
                             f"{value_dim}, {head_dim}, {k_mla} (rope {n_rot})")
    log_mul = gf.get("deepseek2.rope.scaling.yarn_log_multiplier", 0.0)
    if not isinstance(log_mul, (int, float)) or isinstance(log_mul, bool) or log_mul < 0:
        raise ModelFileError(f"{gf.path}: 'deepseek2.rope.scaling.yarn_log_multiplier' must be a non-negative number")
    q_lora = gf.get("deepseek2.attention.q_lora_rank", 0)
    return dict(mla_lora_q=_int(gf, "deepseek2.attention.q_lora_rank") if q_lora else 0, mla_lora_kv=lora,
                mla_nope=k_mla - n_rot, mla_v=v_mla, yarn_log_mul=float(log_mul) / 0.1)


def _layer_count(gf: GGUFFile, key: str, n_layer: int) -> int:
    """A count of layers (0 when the key is absent) below the block count."""
    value = gf.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_layer:
        raise ModelFileError(f"{gf.path}: metadata key '{key}' must be an integer in 0..{n_layer - 1}, got {value!r}")
    return value


def _float(gf: GGUFFile, key: str, default: float, zero: bool = False) -> float:
    value = gf.get(key, default)
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0
            or value == float("inf") or (value == 0 and not zero)):
        raise ModelFileError(f"{gf.path}: metadata key '{key}' must be a {'non-negative' if zero else 'positive'} "
                             f"number, got {value!r}")
    return float(value)


# llama.cpp's RoPE options -> the metadata keys they stand in for ({arch}: the model's architecture)
ROPE_KEYS = {"rope_scaling": "{arch}.rope.scaling.type", "rope_freq_base": "{arch}.rope.freq_base",
             "rope_freq_scale": "{arch}.rope.scaling.factor",
             "yarn_orig_ctx": "{arch}.rope.scaling.original_context_length",
             "yarn_ext_factor": "{arch}.rope.scaling.yarn_ext_factor",
             "yarn_attn_factor": "{arch}.rope.scaling.attn_factor",
             "yarn_beta_fast": "{arch}.rope.scaling.yarn_beta_fast",
             "yarn_beta_slow": "{arch}.rope.scaling.yarn_beta_slow"}


def model_overrides(args: Any) -> dict[str, Any]:
    """The metadata overrides of a command line: --override-kv's, and the RoPE options' over them."""
    return {**dict(getattr(args, "override_kv", None) or []), **rope_overrides(args)}


def add_rope_args(p: Any) -> None:
    """llama.cpp's RoPE options on an argument parser (the server's and generate's)."""
    p.add_argument("--rope-scaling", choices=list(ROPE_SCALING_TYPES), default=None,
                   llama_env="LLAMA_ARG_ROPE_SCALING_TYPE",
                   help="RoPE frequency scaling: none, linear or yarn (default: the model's)")
    p.add_argument("--rope-scale", dest="rope_freq_scale", type=_inverse_factor, default=None,
                   metavar="N", llama_env="LLAMA_ARG_ROPE_SCALE",
                   help="RoPE context scaling factor: the context grows by N (default: the model's)")
    p.add_argument("--rope-freq-base", type=float, default=None, metavar="N", llama_env="LLAMA_ARG_ROPE_FREQ_BASE",
                   help="RoPE base frequency (default, or 0: the model's)")
    p.add_argument("--rope-freq-scale", type=float, default=None, metavar="N", llama_env="LLAMA_ARG_ROPE_FREQ_SCALE",
                   help="RoPE frequency scale: the context grows by 1/N (default, or 0: the model's)")
    p.add_argument("--yarn-orig-ctx", type=int, default=None, metavar="N", llama_env="LLAMA_ARG_YARN_ORIG_CTX",
                   help="YaRN: the model's original context (default, or 0: the model's, else its training context)")
    p.add_argument("--yarn-ext-factor", type=float, default=None, metavar="N", llama_env="LLAMA_ARG_YARN_EXT_FACTOR",
                   help="YaRN: extrapolation mix, 0 = interpolation alone (default, or -1: 1.0)")
    p.add_argument("--yarn-attn-factor", type=float, default=None, metavar="N",
                   llama_env="LLAMA_ARG_YARN_ATTN_FACTOR", help="YaRN: magnitude factor (default, or -1: the model's)")
    p.add_argument("--yarn-beta-slow", type=float, default=None, metavar="N", llama_env="LLAMA_ARG_YARN_BETA_SLOW",
                   help="YaRN: high correction dimension (default, or -1: the model's, else 1)")
    p.add_argument("--yarn-beta-fast", type=float, default=None, metavar="N", llama_env="LLAMA_ARG_YARN_BETA_FAST",
                   help="YaRN: low correction dimension (default, or -1: the model's, else 32)")


def _inverse_factor(text: str) -> float:
    """--rope-scale N as the frequency scale 1 / N (llama.cpp's reading)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got '{text}'")
    return 1.0 / value


def rope_overrides(args: Any) -> dict[str, Any]:
    """Metadata overrides for llama.cpp's RoPE options (--rope-scaling, --rope-scale,
    --rope-freq-base, --rope-freq-scale, --yarn-*) in `args`, with llama.cpp's "the model's own"
    values (unset, 0 or a negative number) left out. --rope-freq-scale N is a factor of 1 / N."""
    out: dict[str, Any] = {}
    for field, key in ROPE_KEYS.items():
        value = getattr(args, field, None)
        if value is None or (not isinstance(value, str) and (value < 0 if field == "yarn_ext_factor" else value <= 0)):
            continue  # llama.cpp's "the model's own" (only the extrapolation factor may be 0)
        if field == "rope_freq_scale":
            value = 1.0 / value
        out[key] = value if isinstance(value, str) else (int(value) if field == "yarn_orig_ctx" else float(value))
    return out


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
    if value_dim != head_dim and arch != "deepseek2":
        raise ModelFileError(f"{gf.path}: key_length {head_dim} != value_length {value_dim} is not supported")
    n_rot = 0 if arch in ("bert", "jina-bert-v2") else _int(gf, f"{arch}.rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot % 2:  # (an encoder's 0: no RoPE)
        raise ModelFileError(f"{gf.path}: rope.dimension_count {n_rot} must be even and at most the head size {head_dim}")
    tokens = gf.get("tokenizer.ggml.tokens")
    n_vocab = gf.get(f"{arch}.vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
    if not n_vocab:
        raise ModelFileError(f"{gf.path}: no vocabulary size ('{arch}.vocab_size' or 'tokenizer.ggml.tokens')")
    n_ff_default = gf.get(f"{arch}.expert_feed_forward_length") if arch in ("qwen2moe", "qwen3moe", "gpt-oss") else None
    n_ff = _int(gf, f"{arch}.feed_forward_length", n_ff_default)
    rope = _rope_scaling(gf, arch)
    rope_scale = rope.pop("rope_scale")
    n_layer = _int(gf, f"{arch}.block_count")
    moe = _moe_hparams(gf, arch, n_ff)
    n_layer_nextn = _layer_count(gf, f"{arch}.nextn_predict_layers", n_layer) if arch in NEXTN_ARCHS else 0
    n_layer -= n_layer_nextn
    dense = _dense_family_hparams(gf, arch, n_layer, n_embd, n_head, head_dim)
    mla = _mla_hparams(gf, head_dim, value_dim, n_head_kv, n_rot) if arch == "deepseek2" else {}
    if arch in ENCODER_ARCHS:  # llama.cpp's default is causal; BERT's converter writes false
        causal = gf.get(f"{arch}.attention.causal", True)
        if not isinstance(causal, bool):
            raise ModelFileError(f"{gf.path}: metadata key '{arch}.attention.causal' must be a bool, got {causal!r}")
        dense = dict(encoder=True, causal=causal)
        if arch == "jina-bert-v2":
            dense.update(_jina_hparams(gf))
    qkv_fused = arch == "phi3" or (arch in ("glm4", "nomic-bert", "jina-bert-v2")
                                   and "blk.0.attn_qkv.weight" in gf.tensors)
    if arch in OPTIONAL_ATTN_TENSORS or arch in ("nomic-bert", "jina-bert-v2"):
        qkv_bias = f"blk.0.attn_{'qkv' if qkv_fused else 'q'}.bias" in gf.tensors
        qk_norm = "blk.0.attn_q_norm.weight" in gf.tensors
    return HParams(
        arch=arch,
        n_vocab=int(n_vocab),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        n_ctx_train=_int(gf, f"{arch}.context_length", 2048),
        rms_eps=_float(gf, f"{arch}.attention.layer_norm_{'' if arch in ENCODER_ARCHS else 'rms_'}epsilon", 1e-5 if arch not in ENCODER_ARCHS else 1e-12),
        rope_base=_float(gf, f"{arch}.rope.freq_base", 10000.0),
        rope_scale=rope_scale,
        n_rot=n_rot,
        rope_mode=rope_mode,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        qkv_fused=qkv_fused,
        n_layer_nextn=n_layer_nextn,
        **mla,
        **moe,
        **rope,
        **dense,
    )


def _jina_hparams(gf: GGUFFile) -> dict:
    """jina-bert-v2's fields: ALiBi, and GeGLU where ffn_up holds gate|up (2 n_ff rows). The
    optional parts of llama.cpp's graph that pyllama lacks are refused by name."""
    for name in ("attn_q_norm.weight", "attn_norm_2.weight", "ffn_gate.weight"):
        if f"blk.0.{name}" in gf.tensors:
            raise ModelFileError(f"{gf.path}: jina-bert-v2 files with '{name.split('.')[0]}' tensors are not supported")
    n_ff = _int(gf, "jina-bert-v2.feed_forward_length")
    up = gf.tensors.get("blk.0.ffn_up.weight")
    return dict(alibi_max_bias=JINA_ALIBI_MAX_BIAS, ffn_gelu=up is not None and up.shape[0] == 2 * n_ff)


def _rope_scaling(gf: GGUFFile, arch: str) -> dict:
    """rope_scale and the scaling fields of HParams, read as llama.cpp reads them: the type
    defaults to linear, the factor to 1 (no scaling); type none never scales."""
    kind = gf.get(f"{arch}.rope.scaling.type", "linear")
    if kind not in ROPE_SCALING_TYPES:
        raise ModelFileError(f"{gf.path}: rope scaling type '{kind}' is not supported "
                             f"(supported: {', '.join(ROPE_SCALING_TYPES)})")
    factor = gf.get(f"{arch}.rope.scaling.factor", gf.get(f"{arch}.rope.scale_linear", 0.0))
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 0 or factor != factor:
        raise ModelFileError(f"{gf.path}: metadata key '{arch}.rope.scaling.factor' must be a non-negative number, "
                             f"got {factor!r}")
    out: dict = {"rope_scale": 1.0 if kind == "none" or factor == 0 else 1.0 / float(factor),
                 # also what phi3's LongRoPE factors are chosen by, and its magnitude
                 "n_ctx_orig": _int(gf, f"{arch}.rope.scaling.original_context_length",
                                    _int(gf, f"{arch}.context_length", 2048)),
                 "rope_attn_factor": _float(gf, f"{arch}.rope.scaling.attn_factor", 1.0)}
    if kind == "yarn":
        out.update(rope_scaling="yarn",
                   yarn_beta_fast=_float(gf, f"{arch}.rope.scaling.yarn_beta_fast", 32.0),
                   yarn_beta_slow=_float(gf, f"{arch}.rope.scaling.yarn_beta_slow", 1.0),
                   yarn_ext_factor=_float(gf, f"{arch}.rope.scaling.yarn_ext_factor", 1.0, zero=True))
    elif out["rope_scale"] != 1.0:
        out["rope_scaling"] = "linear"
    return out


def _dense_family_hparams(gf: GGUFFile, arch: str, n_layer: int, n_embd: int, n_head: int, head_dim: int) -> dict:
    """The gemma2 / gemma3 / glm4 fields of HParams, as llama.cpp sets them (phi3: none, as
    llama.cpp, which ignores phi3's sliding_window key); empty for the other architectures."""
    if arch == "glm4":
        return dict(post_norms=True)
    if arch == "gpt-oss":  # every `sliding_window_pattern`-th layer attends to all, the others slide
        period = gf.get("gpt-oss.attention.sliding_window_pattern", 2)
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise ModelFileError(f"{gf.path}: 'gpt-oss.attention.sliding_window_pattern' must be a positive integer")
        return dict(n_swa=_int(gf, "gpt-oss.attention.sliding_window"), attn_sinks=True,
                    swa_layers=tuple(il % period < period - 1 for il in range(n_layer)))
    if arch not in GEMMA_ARCHS:
        return {}
    # the query scale of gemma_pytorch's config: 1 / sqrt(n_embd / n_head) for the 27B models
    # (llama.cpp recognises them by their layer count), else 1 / sqrt(head_dim)
    big = n_layer == (46 if arch == "gemma2" else 62)
    out: dict = dict(embd_scale=math.sqrt(n_embd), post_norms=True, ffn_gelu=True,
                     attn_scale=1.0 / math.sqrt(n_embd // n_head if big else head_dim))
    if arch == "gemma2":
        # every other layer slides, the first among them; window and caps default to gemma2's
        out.update(n_swa=_int(gf, "gemma2.attention.sliding_window", 4096),
                   swa_layers=tuple(il % 2 == 0 for il in range(n_layer)),
                   attn_softcap=_float(gf, "gemma2.attn_logit_softcapping", 50.0),
                   final_softcap=_float(gf, "gemma2.final_logit_softcapping", 30.0))
    else:
        n_swa = gf.get("gemma3.attention.sliding_window", 0)
        if n_swa:  # five sliding layers, then a global one; local layers on base 10000, unscaled
            out.update(n_swa=_int(gf, "gemma3.attention.sliding_window"),
                       swa_layers=tuple(il % 6 < 5 for il in range(n_layer)),
                       rope_base_swa=_float(gf, "gemma3.rope.freq_base_swa", 10000.0))
        if gf.get("gemma3.final_logit_softcapping") is not None:
            out["final_softcap"] = _float(gf, "gemma3.final_logit_softcapping", 0.0)
    return out


def _moe_hparams(gf: GGUFFile, arch: str, n_ff: int) -> dict:
    """The MoE fields of HParams (llama.cpp's keys), empty for a dense model."""
    if arch not in MOE_NORM_DEFAULT or (arch == "llama" and gf.get("llama.expert_count") in (None, 0)):
        return {}
    n_expert = _int(gf, f"{arch}.expert_count")
    n_used = _int(gf, f"{arch}.expert_used_count")
    if n_used > n_expert:
        raise ModelFileError(f"{gf.path}: expert_used_count {n_used} is above expert_count {n_expert}")
    if n_used > 64:
        raise ModelFileError(f"{gf.path}: expert_used_count {n_used} above 64 is not supported")
    default_gating = GATING_DEFAULT.get(arch, EXPERT_GATING_SOFTMAX)
    gating = gf.get(f"{arch}.expert_gating_func", default_gating)
    if gating == 0:  # llama.cpp's NONE: the architecture's own
        gating = default_gating
    if arch == "gpt-oss":  # llama.cpp's graph routes gpt-oss so whatever the file says
        return dict(n_expert=n_expert, n_expert_used=n_used, n_ff_exp=_int(gf, "gpt-oss.expert_feed_forward_length"),
                    expert_gating=EXPERT_GATING_SOFTMAX_WEIGHT, moe_biases=True,
                    expert_weights_scale=_float(gf, "gpt-oss.expert_weights_scale", 1.0))
    if gating not in (EXPERT_GATING_SOFTMAX, EXPERT_GATING_SIGMOID) or isinstance(gating, bool):
        raise ModelFileError(f"{gf.path}: expert_gating_func {gating!r} is not supported (1 softmax, 2 sigmoid)")
    norm = gf.get(f"{arch}.expert_weights_norm", MOE_NORM_DEFAULT[arch])
    if not isinstance(norm, bool):
        raise ModelFileError(f"{gf.path}: metadata key '{arch}.expert_weights_norm' must be a bool, got {norm!r}")
    # Mixtral's experts are feed_forward_length wide; the Qwen and GLM MoE files give their own width
    n_ff_exp = n_ff if arch == "llama" else _int(gf, f"{arch}.expert_feed_forward_length")
    n_ff_shexp = _int(gf, f"{arch}.expert_shared_feed_forward_length", n_ff) if arch == "qwen2moe" else 0
    extra: dict = {}
    if arch in ("glm4moe", "deepseek2"):
        n_shared = gf.get(f"{arch}.expert_shared_count", 0)
        n_ff_shexp = n_ff_exp * _int(gf, f"{arch}.expert_shared_count") if n_shared else 0
        extra = dict(n_layer_dense_lead=_layer_count(gf, f"{arch}.leading_dense_block_count",
                                                     _int(gf, f"{arch}.block_count")))
        groups = gf.get(f"{arch}.expert_group_count", 0) or 1
        used = gf.get(f"{arch}.expert_group_used_count", 0) or 1
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (groups, used)) or groups > 64 \
                or n_expert % groups or not 1 <= used <= groups or (groups > 1 and n_expert // groups < 2):
            raise ModelFileError(f"{gf.path}: expert_group_count {groups!r} / expert_group_used_count {used!r} do not "
                                 f"divide {n_expert} experts (at most 64 groups of two or more)")
        extra.update(n_expert_groups=groups, n_group_used=used)
    return dict(n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp,
                expert_weights_norm=norm, expert_gating=gating,
                expert_weights_scale=_float(gf, f"{arch}.expert_weights_scale", 1.0), **extra)
