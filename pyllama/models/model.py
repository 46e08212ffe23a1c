"""A llama-family model file, checked against its architecture, and its weights as the graph wants them.

Weights are fused at load where that saves ops per layer (q|k|v into one matrix, gate|up into
one), so every backend sees the same coarse graph.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional

from gguf import GGMLQuantizationType as QT

from ..util.errors import ModelFileError
from ..ir.tensor import WEIGHT_TYPES
from .gguf_file import GGUFFile
from .hparams import HParams, read_hparams

if TYPE_CHECKING:
    from .lora import LoraSet

log = logging.getLogger(__name__)

SUPPORTED_TYPES = WEIGHT_TYPES  # the types a model's tensors may have (not NVFP4, not Q1_0)
# architectures whose llama.cpp graph adds an output.bias [n_vocab] to the logits where the file has one
OUTPUT_BIAS_ARCHS = ("qwen2", "phi3")
# architectures whose gate|up come fused in the file's ffn_up [2 n_ff, n_embd], gate first
FUSED_FFN_ARCHS = ("phi3", "glm4")


def expected_tensors(hp: HParams) -> dict[str, tuple[int, ...]]:
    """File tensor name -> numpy shape, for every tensor the graph needs (output.weight optional)."""
    if hp.encoder:
        return _encoder_tensors(hp)
    e, q, kv = hp.n_embd, hp.n_embd_q, hp.n_embd_kv
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (hp.n_vocab, e),
        "output_norm.weight": (e,),
    }
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        shapes.update({
            b + "attn_norm.weight": (e,),
            b + "attn_q.weight": (q, e),
            b + "attn_k.weight": (kv, e),
            b + "attn_v.weight": (kv, e),
            b + "attn_output.weight": (e, q),
            b + ffn_norm_tensor(hp): (e,),
        })
        if hp.mla_lora_kv:
            _mla_tensors(hp, b, shapes)
        if hp.attn_sinks:  # gpt-oss: a sink logit per head, and the output product's bias
            shapes.update({b + "attn_sinks.weight": (hp.n_head,), b + "attn_output.bias": (e,)})
        shapes.update(_ffn_tensors(hp, i))
        if hp.qkv_bias:
            shapes.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
        if hp.qk_norm:
            shapes.update({b + "attn_q_norm.weight": (hp.head_dim,), b + "attn_k_norm.weight": (hp.head_dim,)})
    return _dense_family_tensors(hp, shapes)


# the encoders whose classification head llama.cpp reads (rank pooling)
RANK_HEAD_ARCHS = ("bert", "jina-bert-v2")
# an encoder's biases that llama.cpp reads where the file has them
ENCODER_OPTIONAL_BIASES = ("attn_output.bias", "ffn_up.bias", "ffn_down.bias")


def encoder_optional_biases(hp: HParams) -> tuple[str, ...]:
    """An encoder's biases that llama.cpp's graph adds where the file has them (nomic-bert's FFN
    has none: its SwiGLU ignores any; jina-bert-v2 requires the others)."""
    if hp.arch == "jina-bert-v2":
        return ("ffn_up.bias",)
    return ENCODER_OPTIONAL_BIASES if hp.arch == "bert" else ("attn_output.bias",)


def _encoder_tensors(hp: HParams) -> dict[str, tuple[int, ...]]:
    """The BERT family's required tensors as llama.cpp names them (bert: learned positions, q/k/v
    with biases, an ungated FFN; nomic-bert: RoPE, q|k|v fused, a gated FFN); LayerNorms with
    biases. The optional ones are added by Model where the file has them."""
    e, q, kv, ff = hp.n_embd, hp.n_embd_q, hp.n_embd_kv, hp.n_ff
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (hp.n_vocab, e), "token_embd_norm.weight": (e,),
                                          "token_embd_norm.bias": (e,)}
    if hp.arch == "bert":
        shapes["position_embd.weight"] = (hp.n_ctx_train, e)
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        if hp.qkv_fused:
            shapes[b + "attn_qkv.weight"] = (q + 2 * kv, e)
            if hp.qkv_bias:
                shapes[b + "attn_qkv.bias"] = (q + 2 * kv,)
        else:
            shapes.update({b + "attn_q.weight": (q, e), b + "attn_k.weight": (kv, e), b + "attn_v.weight": (kv, e)})
            if hp.qkv_bias:
                shapes.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
        shapes.update({
            b + "attn_output.weight": (e, q),
            b + "attn_output_norm.weight": (e,), b + "attn_output_norm.bias": (e,),
            b + "ffn_up.weight": (ff, e), b + "ffn_down.weight": (e, ff),
            b + "layer_output_norm.weight": (e,), b + "layer_output_norm.bias": (e,),
        })
        if hp.arch == "nomic-bert":
            shapes[b + "ffn_gate.weight"] = (ff, e)
        if hp.arch == "jina-bert-v2":  # gate|up in ffn_up where GeGLU; output and down biases required
            shapes.update({b + "ffn_up.weight": ((2 if hp.ffn_gelu else 1) * ff, e), b + "attn_output.bias": (e,),
                           b + "ffn_down.bias": (e,)})
    return shapes


def _encoder_weights(hp: HParams, present: set) -> dict[str, tuple[list[str], int]]:
    """An encoder's logical weights: q|k|v fused (with their biases), gate|up fused where gated,
    the rest one file tensor each (the additive position table is computed at load:
    weights.computed_weights)."""
    out: dict[str, tuple[list[str], int]] = {
        "token_embd": (["token_embd.weight"], -1),
        "token_embd_norm": (["token_embd_norm.weight"], -1),
        "token_embd_norm_bias": (["token_embd_norm.bias"], -1),
    }
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        if hp.qkv_fused:
            out[b + "attn_qkv"] = ([b + "attn_qkv.weight"], i)
            if hp.qkv_bias:
                out[b + "attn_qkv_bias"] = ([b + "attn_qkv.bias"], i)
        else:
            out[b + "attn_qkv"] = ([b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"], i)
            if hp.qkv_bias:
                out[b + "attn_qkv_bias"] = ([b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias"], i)
        for name in ("attn_output", "ffn_down"):
            out[b + name] = ([b + name + ".weight"], i)
        if hp.arch == "jina-bert-v2":
            out[b + "attn_output_bias"] = ([b + "attn_output.bias"], i)
            out[b + "ffn_down_bias"] = ([b + "ffn_down.bias"], i)
        if hp.arch != "nomic-bert":  # (jina-bert-v2's GeGLU: gate|up as GEGLU reads them)
            out[b + "ffn_up"] = ([b + "ffn_up.weight"], i)
        else:  # SwiGLU: gate|up as SWIGLU reads them
            out[b + "ffn_gate_up"] = ([b + "ffn_gate.weight", b + "ffn_up.weight"], i)
        for name in ("attn_output_norm", "layer_output_norm"):
            out[b + name] = ([b + name + ".weight"], i)
            out[b + name + "_bias"] = ([b + name + ".bias"], i)
        for name in encoder_optional_biases(hp):
            if b + name in present:
                out[b + name.replace(".", "_")] = ([b + name], i)
    return out


def _dense_family_tensors(hp: HParams, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The fused file tensors (q|k|v in attn_qkv: phi3, some glm4 files; gate|up in ffn_up: phi3,
    glm4) and the post-norms (gemma, glm4)."""
    e, ff = hp.n_embd, hp.n_ff
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        if hp.qkv_fused:
            for name in ("attn_q", "attn_k", "attn_v"):
                shapes.pop(b + name + ".weight")
                if hp.qkv_bias:
                    shapes.pop(b + name + ".bias")
            shapes[b + "attn_qkv.weight"] = (hp.n_embd_q + 2 * hp.n_embd_kv, e)
            if hp.qkv_bias:
                shapes[b + "attn_qkv.bias"] = (hp.n_embd_q + 2 * hp.n_embd_kv,)
        if hp.arch in FUSED_FFN_ARCHS:
            for name in ("ffn_gate", "ffn_up"):
                shapes.pop(b + name + ".weight")
            shapes[b + "ffn_up.weight"] = (2 * ff, e)
        if hp.post_norms:
            shapes[b + "post_attention_norm.weight"] = (e,)
            shapes[b + "post_ffw_norm.weight"] = (e,)
    return shapes


def _dense_family_weights(hp: HParams, out: dict[str, tuple[list[str], int]]) -> dict[str, tuple[list[str], int]]:
    """logical_weights' entries for the fused file tensors and the post-norms."""
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        if hp.qkv_fused:  # already fused in the file, in the graph's row order
            out[b + "attn_qkv"] = ([b + "attn_qkv.weight"], i)
            if hp.qkv_bias:
                out[b + "attn_qkv_bias"] = ([b + "attn_qkv.bias"], i)
        if hp.arch in FUSED_FFN_ARCHS:
            out[b + "ffn_gate_up"] = ([b + "ffn_up.weight"], i)
        if hp.post_norms:
            out[b + "attn_post_norm"] = ([b + "post_attention_norm.weight"], i)
            out[b + "ffn_post_norm"] = ([b + "post_ffw_norm.weight"], i)
    return out


def _mla_tensors(hp: HParams, b: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """deepseek2's attention tensors in place of q/k/v: the query (low-rank with its norm where
    q_lora_rank is set), the latent and rope part (attn_kv_a_mqa), the latent's norm, k_b and v_b
    per head [n_head, rows, cols], and the output."""
    e, H, lora, rope = hp.n_embd, hp.n_head, hp.mla_lora_kv, hp.n_rot
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        shapes.pop(b + name + ".weight")
    qw = H * (hp.mla_nope + rope)
    if hp.mla_lora_q:
        shapes.update({b + "attn_q_a.weight": (hp.mla_lora_q, e), b + "attn_q_a_norm.weight": (hp.mla_lora_q,),
                       b + "attn_q_b.weight": (qw, hp.mla_lora_q)})
    else:
        shapes[b + "attn_q.weight"] = (qw, e)
    shapes.update({b + "attn_kv_a_mqa.weight": (lora + rope, e), b + "attn_kv_a_norm.weight": (lora,),
                   b + "attn_k_b.weight": (H, lora, hp.mla_nope), b + "attn_v_b.weight": (H, hp.mla_v, lora),
                   b + "attn_output.weight": (e, H * hp.mla_v)})


def ffn_norm_tensor(hp: HParams) -> str:
    """The file name of a layer's norm before the FFN (GLM's converter names it for the HF model's
    post_attention_layernorm)."""
    return "post_attention_norm.weight" if hp.arch in ("glm4moe", "gpt-oss") else "ffn_norm.weight"


def _ffn_tensors(hp: HParams, il: int) -> dict[str, tuple[int, ...]]:
    """Layer il's FFN tensors: dense, or (MoE) the router, the 3-D expert tensors [n_expert, rows,
    cols], the expert bias (glm4moe) and the shared expert with its gate where the architecture
    has one."""
    e, b = hp.n_embd, f"blk.{il}."
    if not hp.moe_layer(il):
        return {b + "ffn_gate.weight": (hp.n_ff, e), b + "ffn_up.weight": (hp.n_ff, e),
                b + "ffn_down.weight": (e, hp.n_ff)}
    x, f = hp.n_expert, hp.n_ff_exp
    out = {b + "ffn_gate_inp.weight": (x, e), b + "ffn_gate_exps.weight": (x, f, e),
           b + "ffn_up_exps.weight": (x, f, e), b + "ffn_down_exps.weight": (x, e, f)}
    if hp.arch == "glm4moe":
        out[b + "exp_probs_b.bias"] = (x,)
    if hp.moe_biases:
        out.update({b + "ffn_gate_inp.bias": (x,), b + "ffn_gate_exps.bias": (x, f), b + "ffn_up_exps.bias": (x, f),
                    b + "ffn_down_exps.bias": (x, e)})
    if hp.n_ff_shexp:
        fs = hp.n_ff_shexp
        out.update({b + "ffn_gate_shexp.weight": (fs, e), b + "ffn_up_shexp.weight": (fs, e),
                    b + "ffn_down_shexp.weight": (e, fs)})
        if hp.arch == "qwen2moe":
            out[b + "ffn_gate_inp_shexp.weight"] = (e,)
    return out


class Model:
    """A GGUF model file, validated: hyper-parameters, tokenizer and the tensors the graph needs."""

    def __init__(self, path: str | os.PathLike[str], kv_overrides: Mapping[str, Any] | None = None):
        self.path = os.fspath(path)
        self.file = GGUFFile(self.path, kv_overrides)
        self.hparams = read_hparams(self.file)
        # Mixtral files from converters before 3-D expert tensors hold each expert's matrix alone
        # (blk.N.ffn_gate.E.weight ...): their logical weights stack them into one 3-D tensor
        self.split_experts = self.hparams.is_moe and "blk.0.ffn_gate.0.weight" in self.file.tensors
        self.expert_stacks: frozenset[str] = frozenset(
            f"blk.{i}.{name}" for i in range(self.hparams.n_layer) if self.split_experts
            for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
        self._check_tensors()
        self.lora: "Optional[LoraSet]" = None  # the LoRA adapters loaded with it (Engine; models/lora.py)

    @property
    def tied_output(self) -> bool:
        return "output.weight" not in self.file.tensors

    @property
    def output_bias(self) -> bool:
        return self.hparams.arch in OUTPUT_BIAS_ARCHS and "output.bias" in self.file.tensors

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def _check_tensors(self) -> None:
        hp = self.hparams
        want = expected_tensors(hp)
        if self.split_experts:  # each expert's matrix alone, as older Mixtral files have them
            for i in range(hp.n_layer):
                for name in ("ffn_gate", "ffn_up", "ffn_down"):
                    shape = want.pop(f"blk.{i}.{name}_exps.weight")[1:]
                    want.update({f"blk.{i}.{name}.{x}.weight": shape for x in range(hp.n_expert)})
        if "output.weight" in self.file.tensors:
            want["output.weight"] = (hp.n_vocab, hp.n_embd)
        if self.output_bias:
            want["output.bias"] = (hp.n_vocab,)
        if hp.encoder:
            want.update(self._encoder_optional())
        for name, shape in want.items():
            info = self.file.tensors.get(name)
            if info is None:
                raise ModelFileError(f"{self.path}: missing tensor '{name}'")
            if info.shape != shape:
                raise ModelFileError(f"{self.path}: tensor '{name}' has shape {list(info.shape)}, expected {list(shape)}")
            if info.qtype not in SUPPORTED_TYPES:
                raise ModelFileError(f"{self.path}: tensor '{name}' has unsupported type {info.qtype.name} "
                                     f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")
            if len(shape) == 1 and info.qtype != QT.F32:
                raise ModelFileError(f"{self.path}: tensor '{name}' must be F32, is {info.qtype.name}")

    def _encoder_optional(self) -> dict[str, tuple[int, ...]]:
        """The shapes of an encoder's optional tensors that the file has (the type embedding, the
        classification head of a reranker, the output and FFN biases)."""
        hp, e = self.hparams, self.hparams.n_embd
        have = self.file.tensors
        out: dict[str, tuple[int, ...]] = {}
        if hp.arch == "jina-bert-v2" and "token_types.weight" not in have:  # required by llama.cpp's loader
            raise ModelFileError(f"{self.path}: missing tensor 'token_types.weight'")
        if "token_types.weight" in have:
            out["token_types.weight"] = (have["token_types.weight"].shape[0], e)
        if hp.arch not in RANK_HEAD_ARCHS:
            have = {k: v for k, v in have.items() if not k.startswith("cls.")}
        if "cls.weight" in have and hp.arch == "jina-bert-v2":  # a one-score head (jina's rerankers)
            out.update({"cls.weight": (1, e), "cls.bias": (1,)})
            have = {k: v for k, v in have.items() if not k.startswith("cls.output")}
        elif "cls.weight" in have:
            out.update({"cls.weight": (e, e), "cls.bias": (e,)})
        if "cls.output.weight" in have:
            n_cls = have["cls.output.weight"].shape[0]
            out.update({"cls.output.weight": (n_cls, e), "cls.output.bias": (n_cls,)})
        for i in range(hp.n_layer):
            for name in encoder_optional_biases(hp):
                if f"blk.{i}.{name}" in have:
                    out[f"blk.{i}.{name}"] = (self._ffn_up_rows() if name == "ffn_up.bias" else e,)
        return out

    def _ffn_up_rows(self) -> int:
        """Rows of an encoder's ffn_up: n_ff, or gate|up (2 n_ff) for jina-bert-v2's GeGLU."""
        return (2 if self.hparams.arch == "jina-bert-v2" and self.hparams.ffn_gelu else 1) * self.hparams.n_ff

    @property
    def has_rank_head(self) -> bool:
        """Whether the file has a classification head for rank pooling (bert: cls and or
        cls.output; jina-bert-v2: a one-score cls), the encoders llama.cpp reads one for."""
        return self.hparams.arch in RANK_HEAD_ARCHS and ("cls.output.weight" in self.file.tensors
                                                         or "cls.weight" in self.file.tensors)

    def n_params(self) -> int:
        return sum(t.n_elements for t in self.file.tensors.values())

    def weight_types(self) -> dict[str, int]:
        """Count of tensors per file type (for the load log and the benchmark report)."""
        out: dict[str, int] = {}
        for t in self.file.tensors.values():
            out[t.qtype.name] = out.get(t.qtype.name, 0) + 1
        return out

    def blocks_quantized(self) -> bool:
        """Whether most of the blocks' weights (by elements) are of a block-quantized type."""
        quant = total = 0
        for name, t in self.file.tensors.items():
            if name.startswith("blk.") and len(t.shape) >= 2:
                total += t.n_elements
                if t.qtype not in (QT.F32, QT.F16, QT.BF16):
                    quant += t.n_elements
        return 2 * quant > total

    # ------------------------------------------------------------------------------------------
    def logical_weights(self) -> dict[str, tuple[list[str], int]]:
        """Logical weight name -> (file tensors concatenated by rows, layer)."""
        hp = self.hparams
        if hp.encoder:
            return _encoder_weights(hp, set(self.file.tensors))
        out: dict[str, tuple[list[str], int]] = {
            "token_embd": (["token_embd.weight"], -1),
            "output_norm": (["output_norm.weight"], hp.n_layer),
            "output": (["token_embd.weight" if self.tied_output else "output.weight"], hp.n_layer),
        }
        if self.output_bias:
            out["output_bias"] = (["output.bias"], hp.n_layer)
        for i in range(hp.n_layer):
            b = f"blk.{i}."
            out[b + "attn_norm"] = ([b + "attn_norm.weight"], i)
            if hp.mla_lora_kv:
                names = ["attn_kv_a_mqa", "attn_kv_a_norm", "attn_k_b", "attn_v_b", "attn_output"]
                names += ["attn_q_a", "attn_q_a_norm", "attn_q_b"] if hp.mla_lora_q else ["attn_q"]
                out.update({b + n: ([b + n + ".weight"], i) for n in names})
            else:
                out[b + "attn_qkv"] = ([b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"], i)
            if hp.qkv_bias:
                out[b + "attn_qkv_bias"] = ([b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias"], i)
            if hp.qk_norm:
                out[b + "attn_q_norm"] = ([b + "attn_q_norm.weight"], i)
                out[b + "attn_k_norm"] = ([b + "attn_k_norm.weight"], i)
            out[b + "attn_output"] = ([b + "attn_output.weight"], i)
            if hp.attn_sinks:
                out[b + "attn_sinks"] = ([b + "attn_sinks.weight"], i)
                out[b + "attn_output_bias"] = ([b + "attn_output.bias"], i)
            out[b + "ffn_norm"] = ([b + ffn_norm_tensor(hp)], i)
            if hp.moe_layer(i):  # expert tensors stay whole (3-D), each one file tensor, used in place
                for name in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                    out[b + name] = ([b + name + ".weight"], i)
                if self.split_experts:  # stacked at load (expert_stacks)
                    for name in ("ffn_gate", "ffn_up", "ffn_down"):
                        out[b + name + "_exps"] = ([f"{b}{name}.{x}.weight" for x in range(hp.n_expert)], i)
                if b + "exp_probs_b.bias" in self.file.tensors:  # glm4moe's always, DeepSeek V3's
                    out[b + "exp_probs_b"] = ([b + "exp_probs_b.bias"], i)
                if hp.moe_biases:
                    for name in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                        out[b + name + "_bias"] = ([b + name + ".bias"], i)
                if hp.n_ff_shexp:
                    if hp.arch == "qwen2moe":
                        out[b + "ffn_gate_inp_shexp"] = ([b + "ffn_gate_inp_shexp.weight"], i)
                    out[b + "ffn_gate_up_shexp"] = ([b + "ffn_gate_shexp.weight", b + "ffn_up_shexp.weight"], i)
                    out[b + "ffn_down_shexp"] = ([b + "ffn_down_shexp.weight"], i)
            else:
                out[b + "ffn_gate_up"] = ([b + "ffn_gate.weight", b + "ffn_up.weight"], i)
                out[b + "ffn_down"] = ([b + "ffn_down.weight"], i)
        return _dense_family_weights(hp, out)
