"""Deterministic random-weight test models, written as GGUF files that llama.cpp also loads.

    python -m pyllama.models.make --preset tiny|small|medium|deep --out PATH [--vocab VOCAB.gguf]
        [--type f32|f16|bf16|q8_0|q4_0|q4_1|q5_0|q5_1|q2_k|q3_k|q4_k|q5_k|q6_k|iq4_nl|iq4_xs|mxfp4
                |tq1_0|tq2_0|q4_k_m|q5_k_m|iq4_nl_mix|iq4_xs_mix|mxfp4_moe]
        [--seed N] [--arch llama|qwen2|qwen3|qwen2moe|qwen3moe|mixtral|gemma2|gemma3|phi3|glm4|glm4moe|deepseek2|
                gpt-oss|bert|nomic-bert|jina-bert-v2]
        [--tied|--untied] [--rerank-head]
        [--rope-scaling none|linear|yarn --rope-factor F] [--rope-freqs] [--n-rot N]
        [--sliding-window N] [--attn-softcap C] [--final-softcap C] [--longrope] [--output-bias]
        (FamilyOptions)

The same arguments give a byte-identical file: weights come from numpy's default_rng(seed) in
float32, tensor by tensor in a fixed order, and the file has no timestamps. Tensor names and
metadata keys are llama.cpp's for the architecture. Weight scales keep activations and logits
realistic at every size (final logits have a standard deviation of about 2.5):
embeddings N(0,1) (N(0, 2.5/sqrt(n_embd)) when tied, as they are then also the output matrix);
q/k/v/gate/up N(0, 1/sqrt(fan_in)); attn_output/ffn_down N(0, 0.5/sqrt(fan_in));
output.weight N(0, 2.5/sqrt(n_embd)); norm weights 1 + N(0, 0.1); biases N(0, 0.1).
Mixture-of-Experts archs (MOE_PRESETS): the router ffn_gate_inp N(0, 1/sqrt(n_embd)), the 3-D
expert tensors [n_expert, rows, cols] scaled as their dense counterparts, qwen2moe's shared
expert gate ffn_gate_inp_shexp N(0, 1/sqrt(n_embd)); `mixtral` writes a `llama` file with experts.
gemma2/gemma3 are always tied and qwen2moe never (llama.cpp's loaders read them so).
1-D tensors and the router are always F32; other weights are stored in --type, as llama.cpp's quantizer
(llama-quantize, no importance matrix) would store them from the F32 model:

- f32 ... q5_1, q2_k ... q6_k, iq4_nl, iq4_xs, mxfp4, tq1_0, tq2_0: every 2-D weight in that type
  (llama-quantize --pure; the ternary types keep a weight's sign where |x| >= max / 2, its block's
  absolute maximum as the scale). general.file_type is the matching MOSTLY_* value (MOSTLY_Q3_K_S, _Q4_K_S, _Q5_K_S for the
  plain q3_k, q4_k, q5_k; MOSTLY_MXFP4_MOE for mxfp4).
- q4_k_m / q5_k_m (general.file_type MOSTLY_Q4_K_M / MOSTLY_Q5_K_M): Q4_K / Q5_K, except
  * output.weight, or token_embd.weight when there is no output.weight (tied: it is the output
    matrix): Q6_K, or Q8_0 when its rows are not a multiple of 256;
  * attn_v.weight and ffn_down.weight of the layers where use_more_bits(i, n_layer) holds, that is
    i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2 (integer division: layers 0, 3, 6, 9, 10 and 11 of
    12, layers 2 and 5 of 6), counting layers in file order as llama.cpp does: Q6_K.
- iq4_nl_mix / iq4_xs_mix (MOSTLY_IQ4_NL / MOSTLY_IQ4_XS, llama-quantize's IQ4_NL and IQ4_XS without
  --pure or an importance matrix): IQ4_NL / IQ4_XS, except the output matrix as in the _M mixes,
  attn_v.weight Q5_K where the model has 4 or more query heads per KV head, and the ffn_down
  tensors of the layers i < n_layer/8: Q5_K.
- mxfp4_moe (MOSTLY_MXFP4_MOE): the experts' 3-D tensors MXFP4, every other 2-D weight (the output
  matrix included) Q8_0.
- K-quant fallback, for plain K types and the mixes alike: a tensor whose rows are not a multiple of
  256 (the K-quants' super-block) gets Q4_0 instead of Q2_K, Q3_K, TQ1_0 or TQ2_0, Q5_0 instead of Q4_K, Q5_1
  instead of Q5_K, Q8_0 instead of Q6_K and IQ4_NL instead of IQ4_XS (F16 if its rows are not a
  multiple of 32 either). A
  K type that would then apply to no tensor at all (the tiny preset: 64-wide rows) is refused.
  Rows: medium 768 and 2048, all K-quant; small 288 (fallback) and 768 (ffn_down, K-quant).

K-quants, IQ4_NL and IQ4_XS are computed by pyllama.models.quantize (ggml's reference searches,
vectorized); the other types by the gguf package.

Without --vocab the model gets pyllama's own byte-level BPE vocabulary (default_vocab.py);
with it, every `tokenizer.*` key of that GGUF file is copied and n_vocab is its token count.

Tensors are generated and written one at a time, so memory stays at about one tensor.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFValueType, GGUFWriter, LlamaFileType
from gguf import GGMLQuantizationType as Q

from ..util.errors import ModelFileError, PyllamaError
from .default_vocab import BOS, EOS, build_default_vocab
from .gguf_file import GGUFFile
from .quantize import QK_K, quantize


@dataclass(frozen=True)
class Preset:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int  # without --vocab
    n_ctx: int
    tied: bool  # output layer reuses token_embd unless asked otherwise (keeps small ~15M, medium ~100M)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 2, 4, 2, 192, 512, 512, False),
    # rows of 256 and 512: every K-quant applies to every matrix (tests of the K-quant kernels)
    "tiny256": Preset(256, 2, 4, 2, 512, 512, 512, True),
    "small": Preset(288, 6, 6, 6, 768, 32000, 2048, True),
    "medium": Preset(768, 12, 12, 4, 2048, 32000, 4096, True),
    # tiny's widths over 24 blocks: splits of 2, 3, 4, 6, 8 or 12 equal stages (bench/pipeline_sim.py)
    "deep": Preset(64, 24, 4, 2, 192, 512, 512, False),
}
ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "mixtral", "gemma2", "gemma3", "phi3", "glm4",
         "glm4moe", "deepseek2", "gpt-oss", "bert", "nomic-bert", "jina-bert-v2")
ENCODER_ARCHS = ("bert", "nomic-bert", "jina-bert-v2")  # embedding models: no output layer, a WordPiece vocabulary by default
BERT_NORM_EPS = 1e-12
NOMIC_ROPE_BASE = 1000.0  # nomic-embed-text's rotary base
POOLING_MEAN, POOLING_RANK = 1, 4  # llama.cpp's llama_pooling_type values
PARTIAL_ROPE_ARCHS = ("glm4", "glm4moe")  # RoPE on half of each head, as GLM's files have it
# Mixture-of-Experts shapes per preset: (experts, experts used per token, expert FFN width, shared
# expert FFN width (qwen2moe only)). The small qwen3moe model's active FFN (3 x 256) is the small
# dense preset's (768), which is what bench/bench_moe.py compares. Mixtral-style models (`mixtral`:
# general.architecture `llama` with llama.expert_count) have experts as wide as the preset's n_ff.
# No preset has 8 experts: llama.cpp's quantizer gives 8-expert models extra bits in some tensors,
# which the mixes here do not reproduce.
MOE_PRESETS: dict[str, tuple[int, int, int, int]] = {
    "tiny": (6, 2, 64, 128),
    "small": (32, 3, 256, 512),
    "medium": (64, 8, 256, 1024),
}
MOE_ARCHS = ("qwen2moe", "qwen3moe", "mixtral", "glm4moe", "deepseek2", "gpt-oss")
GPT_OSS_WINDOW = 8  # gpt-oss's sliding window here (128 in the published models): the test prompts outgrow it
# deepseek2 as DeepSeek V3's converter writes it (multi-head latent attention), per preset:
# (q_lora_rank, kv_lora_rank, nope, rope, v head size, expert groups, groups used); like glm4moe
# (GLM4MOE's counts) a leading dense layer, one shared expert, sigmoid routing with the expert
# bias, normalized weights times 2.5 and one NextN layer
MLA_PRESETS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "tiny": (64, 32, 32, 32, 32, 3, 2),
    "small": (96, 64, 32, 16, 32, 4, 2),
    "medium": (384, 256, 64, 32, 64, 8, 4),
}
# glm4moe as GLM-4.5's converter writes it: a leading dense layer, one shared expert as wide as a
# routed one, sigmoid routing with the expert bias exp_probs_b, normalized weights times the
# routed scaling factor, q/k/v biases, RoPE on half of each head, and one NextN (multi-token
# prediction) layer after the others, in the file but never computed
GLM4MOE = {"leading_dense_block_count": 1, "expert_shared_count": 1, "expert_weights_scale": 2.5,
           "nextn_predict_layers": 1}
GGUF_ARCH = {"mixtral": "llama"}  # --arch -> general.architecture where they differ
# --type -> (ggml type of the 2-D weights, general.file_type)
WTYPES: dict[str, tuple[Q, LlamaFileType]] = {
    "f32": (Q.F32, LlamaFileType.ALL_F32),
    "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (Q.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q5_0": (Q.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "q5_1": (Q.Q5_1, LlamaFileType.MOSTLY_Q5_1),
    "q2_k": (Q.Q2_K, LlamaFileType.MOSTLY_Q2_K),
    "q3_k": (Q.Q3_K, LlamaFileType.MOSTLY_Q3_K_S),
    "q4_k": (Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_S),
    "q5_k": (Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_S),
    "q6_k": (Q.Q6_K, LlamaFileType.MOSTLY_Q6_K),
    "iq4_nl": (Q.IQ4_NL, LlamaFileType.MOSTLY_IQ4_NL),
    "iq4_xs": (Q.IQ4_XS, LlamaFileType.MOSTLY_IQ4_XS),
    "mxfp4": (Q.MXFP4, LlamaFileType.MOSTLY_MXFP4_MOE),
    "tq1_0": (Q.TQ1_0, LlamaFileType.MOSTLY_TQ1_0),
    "tq2_0": (Q.TQ2_0, LlamaFileType.MOSTLY_TQ2_0),
    "q4_k_m": (Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),  # base type; tensor_types() applies the mix
    "q5_k_m": (Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_M),
    "iq4_nl_mix": (Q.IQ4_NL, LlamaFileType.MOSTLY_IQ4_NL),
    "iq4_xs_mix": (Q.IQ4_XS, LlamaFileType.MOSTLY_IQ4_XS),
    "mxfp4_moe": (Q.MXFP4, LlamaFileType.MOSTLY_MXFP4_MOE),
}
MIXES = frozenset({"q4_k_m", "q5_k_m", "iq4_nl_mix", "iq4_xs_mix", "mxfp4_moe"})
K_QUANT_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0,
                    Q.IQ4_XS: Q.IQ4_NL, Q.TQ1_0: Q.Q4_0, Q.TQ2_0: Q.Q4_0}
ROPE_FREQ_BASE = {"llama": 10000.0, "qwen2": 1000000.0, "qwen3": 1000000.0, "qwen2moe": 1000000.0,
                  "qwen3moe": 1000000.0, "mixtral": 1000000.0, "gemma2": 10000.0, "gemma3": 1000000.0,
                  "phi3": 10000.0, "glm4": 10000.0, "glm4moe": 1000000.0, "deepseek2": 10000.0,
                  "gpt-oss": 150000.0}
QKV_BIAS_ARCHS = ("qwen2", "qwen2moe", "glm4", "glm4moe", "gpt-oss")
QK_NORM_ARCHS = ("qwen3", "qwen3moe", "gemma3")
GEMMA_ARCHS = ("gemma2", "gemma3")  # post-norms, always tied (llama.cpp reads no output.weight for them)
UNTIED_ARCHS = ("qwen2moe", "gpt-oss")  # llama.cpp's loader requires output.weight (no fallback to token_embd)
SWA_DEFAULT = {"gemma2": 4096, "gemma3": 1024}  # their sliding windows


@dataclass(frozen=True)
class FamilyOptions:
    """What the dense families and RoPE scaling add to a model (defaults: none of it).

    rope_scaling "linear" / "yarn" with rope_factor writes `{arch}.rope.scaling.*` (yarn with
    original_context_length = the preset's n_ctx / rope_factor); rope_freqs adds rope_freqs.weight,
    llama3-style per-pair divisors (random in [1, 8], so that they matter at a tiny model's
    positions), generated after every other tensor so that the other weights do not change.
    sliding_window: gemma's window (0: the architecture's default); attn_softcap / final_softcap:
    gemma2's caps (0: its defaults, 50 and 30); n_rot: rope.dimension_count (0: the head size).
    longrope (phi3): the LongRoPE pair rope_factors_long.weight / rope_factors_short.weight (per-pair
    divisors, random in [1, 8] and [1, 2]) with rope.scaling.original_context_length = the preset's
    n_ctx / 4 and rope.scaling.attn_factor sqrt(1 + ln 4 / ln(that)), as the phi3 converter writes
    a 128k model; output_bias (qwen2, phi3): output.bias [n_vocab]. Both come after every other
    tensor, so that the other weights do not change. rerank_head (bert): a reranker's classification
    head (cls.weight, cls.bias, cls.output.weight, cls.output.bias: one score) and pooling_type rank;
    (jina-bert-v2) a one-score cls.weight [1, n_embd] and cls.bias.
    """

    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_freqs: bool = False
    sliding_window: int = 0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    n_rot: int = 0
    longrope: bool = False
    output_bias: bool = False
    rerank_head: bool = False
RMS_EPS = 1e-5
QUANTIZATION_VERSION = 2


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy (row-major) order
    kind: str  # "normal": N(0, std); "norm": 1 + N(0, 0.1); "bias": N(0, 0.1)
    std: float = 0.0

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


def _matrix(name: str, rows: int, cols: int, gain: float = 1.0) -> TensorSpec:
    """A weight matrix [rows, cols] drawn N(0, gain / sqrt(cols)) (see the module docstring)."""
    return TensorSpec(name, (rows, cols), "normal", gain / math.sqrt(cols))


def _encoder_embeddings(n_vocab: int, e: int, n_positions: int = 0) -> list[TensorSpec]:
    """An encoder's token and token-type embeddings, learned positions where it has them (bert), and
    the embeddings' LayerNorm, in llama.cpp's names."""
    plan = [TensorSpec("token_embd.weight", (n_vocab, e), "normal", 1.0),
            TensorSpec("token_types.weight", (2, e), "bias")]
    if n_positions:
        plan.append(TensorSpec("position_embd.weight", (n_positions, e), "bias"))
    return plan + [TensorSpec("token_embd_norm.weight", (e,), "norm"), TensorSpec("token_embd_norm.bias", (e,), "bias")]


def tensor_plan(preset: str | Preset, arch: str = "llama", tied: bool | None = None,
                n_vocab: int | None = None, opts: FamilyOptions = FamilyOptions()) -> list[TensorSpec]:
    """Every tensor of a model, in file (and random generation) order. tied=None: the preset's default."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    if arch in ENCODER_ARCHS:
        return _bert_plan(p, p.n_vocab if n_vocab is None else n_vocab, opts.rerank_head, arch)
    if arch in GEMMA_ARCHS:
        if tied is False:
            raise ValueError(f"{arch} ties its output layer to token_embd (no --untied)")
        tied = True
    if arch in UNTIED_ARCHS:
        if tied:
            raise ValueError(f"{arch} has a separate output.weight in llama.cpp (no --tied)")
        tied = False
    tied = p.tied if tied is None else tied
    n_vocab = p.n_vocab if n_vocab is None else n_vocab
    e, hd, ff = p.n_embd, p.head_dim, p.n_ff
    nq, nkv = p.n_head * hd, p.n_head_kv * hd

    w = _matrix

    def experts(name: str, n: int, rows: int, cols: int, gain: float = 1.0) -> TensorSpec:
        return TensorSpec(name, (n, rows, cols), "normal", gain / math.sqrt(cols))

    plan = [TensorSpec("token_embd.weight", (n_vocab, e), "normal", 2.5 / math.sqrt(e) if tied else 1.0)]
    n_blocks = p.n_layer + (GLM4MOE["nextn_predict_layers"] if arch in ("glm4moe", "deepseek2") else 0)
    for i in range(n_blocks):
        b = f"blk.{i}."
        if arch == "deepseek2":
            plan.extend(_deepseek2_layer(p, i, b, w, experts))
            continue
        plan.append(TensorSpec(b + "attn_norm.weight", (e,), "norm"))
        if arch == "phi3":  # q|k|v fused in the file, and gate|up in ffn_up
            plan.append(w(b + "attn_qkv.weight", nq + 2 * nkv, e))
            plan.append(w(b + "attn_output.weight", e, nq, 0.5))
            plan.append(TensorSpec(b + "ffn_norm.weight", (e,), "norm"))
            plan.append(w(b + "ffn_up.weight", 2 * ff, e))
            plan.append(w(b + "ffn_down.weight", e, ff, 0.5))
            continue
        plan.append(w(b + "attn_q.weight", nq, e))
        if arch in QKV_BIAS_ARCHS:
            plan.append(TensorSpec(b + "attn_q.bias", (nq,), "bias"))
        plan.append(w(b + "attn_k.weight", nkv, e))
        if arch in QKV_BIAS_ARCHS:
            plan.append(TensorSpec(b + "attn_k.bias", (nkv,), "bias"))
        plan.append(w(b + "attn_v.weight", nkv, e))
        if arch in QKV_BIAS_ARCHS:
            plan.append(TensorSpec(b + "attn_v.bias", (nkv,), "bias"))
        if arch in QK_NORM_ARCHS:
            plan.append(TensorSpec(b + "attn_q_norm.weight", (hd,), "norm"))
            plan.append(TensorSpec(b + "attn_k_norm.weight", (hd,), "norm"))
        if arch == "gpt-oss":
            plan.extend(_gpt_oss_layer(p, b, w, experts))
            continue
        plan.append(w(b + "attn_output.weight", e, nq, 0.5))
        if arch in GEMMA_ARCHS or arch == "glm4":
            plan.append(TensorSpec(b + "post_attention_norm.weight", (e,), "norm"))
        if arch == "glm4":  # gate|up fused in ffn_up, and a norm after the FFN
            plan += [TensorSpec(b + "ffn_norm.weight", (e,), "norm"), w(b + "ffn_up.weight", 2 * ff, e),
                     w(b + "ffn_down.weight", e, ff, 0.5), TensorSpec(b + "post_ffw_norm.weight", (e,), "norm")]
            continue
        if arch == "glm4moe":
            plan.extend(_glm4moe_layer(p, i, b, w, experts))
            continue
        plan.append(TensorSpec(b + "ffn_norm.weight", (e,), "norm"))
        if arch in MOE_ARCHS:
            n_exp, _, ff_exp, ff_sh = moe_shape(p, arch)
            plan.append(w(b + "ffn_gate_inp.weight", n_exp, e))  # the router
            plan.append(experts(b + "ffn_gate_exps.weight", n_exp, ff_exp, e))
            plan.append(experts(b + "ffn_up_exps.weight", n_exp, ff_exp, e))
            plan.append(experts(b + "ffn_down_exps.weight", n_exp, e, ff_exp, 0.5))
            if ff_sh:
                plan.append(TensorSpec(b + "ffn_gate_inp_shexp.weight", (e,), "normal", 1.0 / math.sqrt(e)))
                plan.append(w(b + "ffn_gate_shexp.weight", ff_sh, e))
                plan.append(w(b + "ffn_up_shexp.weight", ff_sh, e))
                plan.append(w(b + "ffn_down_shexp.weight", e, ff_sh, 0.5))
        else:
            plan.append(w(b + "ffn_gate.weight", ff, e))
            plan.append(w(b + "ffn_up.weight", ff, e))
            plan.append(w(b + "ffn_down.weight", e, ff, 0.5))
            if arch in GEMMA_ARCHS:
                plan.append(TensorSpec(b + "post_ffw_norm.weight", (e,), "norm"))
    plan.append(TensorSpec("output_norm.weight", (e,), "norm"))
    if not tied:
        plan.append(TensorSpec("output.weight", (n_vocab, e), "normal", 2.5 / math.sqrt(e)))
    if opts.rope_freqs:
        plan.append(TensorSpec("rope_freqs.weight", ((opts.n_rot or hd) // 2,), "rope_freqs"))
    if opts.longrope:
        plan.append(TensorSpec("rope_factors_long.weight", ((opts.n_rot or hd) // 2,), "rope_freqs"))
        plan.append(TensorSpec("rope_factors_short.weight", ((opts.n_rot or hd) // 2,), "rope_freqs", 2.0))
    if opts.output_bias:
        plan.append(TensorSpec("output.bias", (n_vocab,), "bias"))
    return plan


def _bert_plan(p: Preset, n_vocab: int, rerank_head: bool, arch: str = "bert") -> list[TensorSpec]:
    """BERT's tensors as llama.cpp's converter names them: token, type and position embeddings and
    their LayerNorm; per layer q/k/v and the output with biases, LayerNorms after attention and
    after the FFN, an ungated FFN with biases; a reranker's head last. nomic-bert's: no position
    embeddings (RoPE), q|k|v fused in attn_qkv and no biases, a gated FFN (ffn_gate)."""
    if arch == "nomic-bert":
        return _nomic_bert_plan(p, n_vocab)
    if arch == "jina-bert-v2":
        return _jina_bert_v2_plan(p, n_vocab, rerank_head)
    e, ff = p.n_embd, p.n_ff
    nq = nkv = p.n_head * p.head_dim

    w = _matrix

    plan = _encoder_embeddings(n_vocab, e, p.n_ctx)
    for i in range(p.n_layer):
        b = f"blk.{i}."
        plan += [w(b + "attn_q.weight", nq, e), TensorSpec(b + "attn_q.bias", (nq,), "bias"),
                 w(b + "attn_k.weight", nkv, e), TensorSpec(b + "attn_k.bias", (nkv,), "bias"),
                 w(b + "attn_v.weight", nkv, e), TensorSpec(b + "attn_v.bias", (nkv,), "bias"),
                 w(b + "attn_output.weight", e, nq, 0.5), TensorSpec(b + "attn_output.bias", (e,), "bias"),
                 TensorSpec(b + "attn_output_norm.weight", (e,), "norm"),
                 TensorSpec(b + "attn_output_norm.bias", (e,), "bias"),
                 w(b + "ffn_up.weight", ff, e), TensorSpec(b + "ffn_up.bias", (ff,), "bias"),
                 w(b + "ffn_down.weight", e, ff, 0.5), TensorSpec(b + "ffn_down.bias", (e,), "bias"),
                 TensorSpec(b + "layer_output_norm.weight", (e,), "norm"),
                 TensorSpec(b + "layer_output_norm.bias", (e,), "bias")]
    if rerank_head:
        plan += [w("cls.weight", e, e), TensorSpec("cls.bias", (e,), "bias"),
                 w("cls.output.weight", 1, e, 2.5), TensorSpec("cls.output.bias", (1,), "bias")]
    return plan


def _jina_bert_v2_plan(p: Preset, n_vocab: int, rerank_head: bool = False) -> list[TensorSpec]:
    """jina-bert-v2's tensors: bert's without position embeddings (ALiBi), gate|up fused in ffn_up
    (GeGLU) with its bias; a reranker's one-score head (cls [1, n_embd]) last."""
    e, ff, nq = p.n_embd, p.n_ff, p.n_head * p.head_dim

    w = _matrix

    plan = _encoder_embeddings(n_vocab, e)
    for i in range(p.n_layer):
        b = f"blk.{i}."
        plan += [w(b + "attn_q.weight", nq, e), TensorSpec(b + "attn_q.bias", (nq,), "bias"),
                 w(b + "attn_k.weight", nq, e), TensorSpec(b + "attn_k.bias", (nq,), "bias"),
                 w(b + "attn_v.weight", nq, e), TensorSpec(b + "attn_v.bias", (nq,), "bias"),
                 w(b + "attn_output.weight", e, nq, 0.5), TensorSpec(b + "attn_output.bias", (e,), "bias"),
                 TensorSpec(b + "attn_output_norm.weight", (e,), "norm"),
                 TensorSpec(b + "attn_output_norm.bias", (e,), "bias"),
                 w(b + "ffn_up.weight", 2 * ff, e), TensorSpec(b + "ffn_up.bias", (2 * ff,), "bias"),
                 w(b + "ffn_down.weight", e, ff, 0.5), TensorSpec(b + "ffn_down.bias", (e,), "bias"),
                 TensorSpec(b + "layer_output_norm.weight", (e,), "norm"),
                 TensorSpec(b + "layer_output_norm.bias", (e,), "bias")]
    if rerank_head:
        plan += [w("cls.weight", 1, e, 2.5), TensorSpec("cls.bias", (1,), "bias")]
    return plan


def _nomic_bert_plan(p: Preset, n_vocab: int) -> list[TensorSpec]:
    e, ff, nq = p.n_embd, p.n_ff, p.n_head * p.head_dim

    w = _matrix

    plan = _encoder_embeddings(n_vocab, e)
    for i in range(p.n_layer):
        b = f"blk.{i}."
        plan += [w(b + "attn_qkv.weight", 3 * nq, e), w(b + "attn_output.weight", e, nq, 0.5),
                 TensorSpec(b + "attn_output_norm.weight", (e,), "norm"),
                 TensorSpec(b + "attn_output_norm.bias", (e,), "bias"),
                 w(b + "ffn_up.weight", ff, e), w(b + "ffn_gate.weight", ff, e), w(b + "ffn_down.weight", e, ff, 0.5),
                 TensorSpec(b + "layer_output_norm.weight", (e,), "norm"),
                 TensorSpec(b + "layer_output_norm.bias", (e,), "bias")]
    return plan


def _deepseek2_layer(p: Preset, i: int, b: str, w, experts) -> list[TensorSpec]:
    """Layer i of a deepseek2 file: its latent attention (MLA_PRESETS), then the FFN as glm4moe's
    (the same leading dense layer, experts, expert bias, shared expert and NextN layer), but with
    the FFN norm under its usual name."""
    e, H = p.n_embd, p.n_head
    q_lora, lora, nope, rope, v = mla_shape(p)[:5]
    out = [TensorSpec(b + "attn_norm.weight", (e,), "norm"), w(b + "attn_q_a.weight", q_lora, e),
           TensorSpec(b + "attn_q_a_norm.weight", (q_lora,), "norm"), w(b + "attn_q_b.weight", H * (nope + rope), q_lora),
           w(b + "attn_kv_a_mqa.weight", lora + rope, e), TensorSpec(b + "attn_kv_a_norm.weight", (lora,), "norm"),
           experts(b + "attn_k_b.weight", H, lora, nope), experts(b + "attn_v_b.weight", H, v, lora),
           w(b + "attn_output.weight", e, H * v, 0.5)]
    glm = _glm4moe_layer(p, i, b, w, experts)
    return out + [TensorSpec(b + "ffn_norm.weight", (e,), "norm")] + glm[1:]


def _gpt_oss_layer(p: Preset, b: str, w, experts) -> list[TensorSpec]:
    """A gpt-oss layer after its q/k/v and their biases: the output product and its bias, the
    sink logits, the FFN norm (post_attention_norm), the router and the experts, each with a
    bias."""
    e, H = p.n_embd, p.n_head
    n_exp, _, ff_exp, _ = moe_shape(p, "gpt-oss")
    return [w(b + "attn_output.weight", e, H * p.head_dim, 0.5), TensorSpec(b + "attn_output.bias", (e,), "bias"),
            TensorSpec(b + "attn_sinks.weight", (H,), "normal", 1.0),
            TensorSpec(b + "post_attention_norm.weight", (e,), "norm"),
            w(b + "ffn_gate_inp.weight", n_exp, e), TensorSpec(b + "ffn_gate_inp.bias", (n_exp,), "bias"),
            experts(b + "ffn_gate_exps.weight", n_exp, ff_exp, e), TensorSpec(b + "ffn_gate_exps.bias", (n_exp, ff_exp), "bias"),
            experts(b + "ffn_up_exps.weight", n_exp, ff_exp, e), TensorSpec(b + "ffn_up_exps.bias", (n_exp, ff_exp), "bias"),
            experts(b + "ffn_down_exps.weight", n_exp, e, ff_exp, 0.5),
            TensorSpec(b + "ffn_down_exps.bias", (n_exp, e), "bias")]


def mla_shape(p: Preset) -> tuple[int, int, int, int, int, int, int]:
    """deepseek2's attention and routing shape at a preset (MLA_PRESETS)."""
    name = next(k for k, v in PRESETS.items() if v == p)
    if name not in MLA_PRESETS:
        raise ValueError(f"the {name} preset has no latent-attention shape (deepseek2 is made at "
                         f"{', '.join(MLA_PRESETS)})")
    return MLA_PRESETS[name]


def _glm4moe_layer(p: Preset, i: int, b: str, w, experts) -> list[TensorSpec]:
    """Layer i of a glm4moe file after its attention: the FFN norm (post_attention_norm, GLM's
    name), a dense FFN in the leading layers, else the router, the expert bias, the experts and
    the shared expert; the NextN layer's own tensors on the last block."""
    e = p.n_embd
    out = [TensorSpec(b + "post_attention_norm.weight", (e,), "norm")]
    if i < GLM4MOE["leading_dense_block_count"]:
        return out + [w(b + "ffn_gate.weight", p.n_ff, e), w(b + "ffn_up.weight", p.n_ff, e),
                      w(b + "ffn_down.weight", e, p.n_ff, 0.5)]
    n_exp, _, ff_exp, ff_sh = moe_shape(p, "glm4moe")
    out += [w(b + "ffn_gate_inp.weight", n_exp, e), TensorSpec(b + "exp_probs_b.bias", (n_exp,), "bias"),
            experts(b + "ffn_gate_exps.weight", n_exp, ff_exp, e), experts(b + "ffn_up_exps.weight", n_exp, ff_exp, e),
            experts(b + "ffn_down_exps.weight", n_exp, e, ff_exp, 0.5),
            w(b + "ffn_gate_shexp.weight", ff_sh, e), w(b + "ffn_up_shexp.weight", ff_sh, e),
            w(b + "ffn_down_shexp.weight", e, ff_sh, 0.5)]
    if i >= p.n_layer:  # the NextN layer: these, and its block above, only predict further tokens
        out += [w(b + "nextn.eh_proj.weight", e, 2 * e), TensorSpec(b + "nextn.enorm.weight", (e,), "norm"),
                TensorSpec(b + "nextn.hnorm.weight", (e,), "norm"),
                TensorSpec(b + "nextn.shared_head_norm.weight", (e,), "norm")]
    return out


def moe_shape(p: Preset, arch: str) -> tuple[int, int, int, int]:
    """(experts, used per token, expert FFN width, shared expert FFN width) of a MoE arch at a preset."""
    name = next(k for k, v in PRESETS.items() if v == p)
    if name not in MOE_PRESETS:
        raise ValueError(f"the {name} preset has no Mixture-of-Experts shape ({arch} is made at "
                         f"{', '.join(MOE_PRESETS)})")
    n_exp, n_used, ff_exp, ff_sh = MOE_PRESETS[name]
    if arch == "mixtral":
        return n_exp, n_used, p.n_ff, 0
    if arch in ("glm4moe", "deepseek2"):
        return n_exp, n_used, ff_exp, ff_exp * GLM4MOE["expert_shared_count"]
    return n_exp, n_used, ff_exp, ff_sh if arch == "qwen2moe" else 0


def count_parameters(preset: str, arch: str = "llama", tied: bool | None = None, n_vocab: int | None = None) -> int:
    """Number of weights of a model, from the preset table alone (nothing is generated)."""
    return sum(t.n_elements for t in tensor_plan(preset, arch, tied, n_vocab))


# ---- vocabulary ------------------------------------------------------------------------------

_ARRAY_TYPES = {
    "tokenizer.ggml.scores": GGUFValueType.FLOAT32,
    "tokenizer.ggml.token_type": GGUFValueType.INT32,
    "tokenizer.ggml.precompiled_charsmap": GGUFValueType.UINT8,
}


def _gguf_type(key: str, value: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    """The GGUF type to write a metadata value with (GGUFFile gives plain Python values)."""
    def scalar(v: Any) -> GGUFValueType:
        if isinstance(v, bool):
            return GGUFValueType.BOOL
        if isinstance(v, int):
            if 0 <= v < 2**32:
                return GGUFValueType.UINT32
            return GGUFValueType.INT32 if -(2**31) <= v < 0 else GGUFValueType.INT64 if v < 0 else GGUFValueType.UINT64
        if isinstance(v, float):
            return GGUFValueType.FLOAT32
        return GGUFValueType.STRING

    if isinstance(value, list):
        if key in _ARRAY_TYPES:
            return GGUFValueType.ARRAY, _ARRAY_TYPES[key]
        first = scalar(value[0])
        return GGUFValueType.ARRAY, GGUFValueType.INT32 if first == GGUFValueType.UINT32 else first
    return scalar(value), None


def _vocab_from_file(path: str) -> tuple[list[tuple[str, Any, GGUFValueType, GGUFValueType | None]], int]:
    """(typed tokenizer.* entries, token count) of a GGUF file; ModelFileError naming it."""
    gf = GGUFFile(path)
    tokens = gf.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelFileError(f"{path}: no vocabulary in this GGUF file (metadata key 'tokenizer.ggml.tokens' is missing)")
    entries = []
    for key, value in gf.metadata.items():
        if key.startswith("tokenizer.") and not (isinstance(value, list) and not value):
            vtype, sub = _gguf_type(key, value)
            entries.append((key, value, vtype, sub))
    return entries, len(tokens)


def _default_vocab_entries(n_vocab: int) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    tokens, types, merges = build_default_vocab(n_vocab)
    A, S = GGUFValueType.ARRAY, GGUFValueType.STRING
    return [
        ("tokenizer.ggml.model", "gpt2", S, None),
        ("tokenizer.ggml.pre", "default", S, None),
        ("tokenizer.ggml.tokens", tokens, A, S),
        ("tokenizer.ggml.token_type", types, A, GGUFValueType.INT32),
        ("tokenizer.ggml.merges", merges, A, S),
        ("tokenizer.ggml.bos_token_id", tokens.index(BOS), GGUFValueType.UINT32, None),
        ("tokenizer.ggml.eos_token_id", tokens.index(EOS), GGUFValueType.UINT32, None),
        ("tokenizer.ggml.add_bos_token", True, GGUFValueType.BOOL, None),
        ("tokenizer.ggml.add_eos_token", False, GGUFValueType.BOOL, None),
    ]


# ---- tensor types ----------------------------------------------------------------------------

def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in the _M mixes."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _with_fallback(qtype: Q, row: int) -> Q:
    """The type a tensor of `row`-wide rows gets when `qtype` is asked for (see the module docstring)."""
    if row % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    fallback = K_QUANT_FALLBACK.get(qtype)
    if fallback is None:
        raise ValueError(f"rows of {row} cannot be stored as {qtype.name}")
    return fallback if row % GGML_QUANT_SIZES[fallback][0] == 0 else Q.F16


def tensor_types(plan: list[TensorSpec], wtype: str) -> dict[str, Q]:
    """The ggml type of every tensor of `plan` for --type `wtype` (rules in the module docstring).

    Raises ValueError naming the tensor when a row cannot be stored in a non-K type.
    """
    base = WTYPES[wtype][0]
    tied = not any(spec.name == "output.weight" for spec in plan)
    rows = {spec.name.split(".", 2)[-1]: spec.shape[0] for spec in plan if spec.name.startswith("blk.0.")}
    n_gqa = rows.get("attn_q.weight", 1) // rows.get("attn_k.weight", 1)
    iq4_mix = wtype in ("iq4_nl_mix", "iq4_xs_mix")
    # the layers whose ffn_down gets more bits, and that type: the _M mixes' use_more_bits and Q6_K,
    # the IQ4 ftypes' first n_layer / 8 layers and Q5_K
    more = (lambda i, n: i < n // 8) if iq4_mix else use_more_bits
    more_type = Q.Q5_K if iq4_mix else Q.Q6_K
    n_attn_v = sum(1 for spec in plan if spec.name.endswith("attn_v.weight"))
    n_layer = n_attn_v  # one attn_v and one ffn_down per layer
    i_attn_v = i_ffn_down = 0
    types: dict[str, Q] = {}
    for spec in plan:
        # 1-D tensors, biases (gpt-oss's expert biases are 2-D) and the MoE router (llama.cpp's
        # quantizer quantizes only tensors named *weight, and never ffn_gate_inp) stay F32
        if len(spec.shape) == 1 or spec.name.endswith("ffn_gate_inp.weight") or not spec.name.endswith("weight"):
            types[spec.name] = Q.F32
            continue
        qtype, row = base, spec.shape[-1]
        if wtype == "mxfp4_moe":
            qtype = Q.MXFP4 if len(spec.shape) == 3 else Q.Q8_0
        elif wtype in MIXES:
            if spec.name == "output.weight" or (tied and spec.name == "token_embd.weight"):
                qtype = Q.Q8_0 if row % QK_K else Q.Q6_K
            elif spec.name.endswith("attn_v.weight"):
                if iq4_mix:
                    qtype = Q.Q5_K if n_gqa >= 4 else base
                else:
                    qtype = Q.Q6_K if use_more_bits(i_attn_v, n_attn_v) else base
                i_attn_v += 1
            elif spec.name.endswith("ffn_down.weight"):
                qtype = more_type if more(i_ffn_down, n_layer) else base
                i_ffn_down += 1
            elif spec.name.endswith(("ffn_down_exps.weight", "ffn_down_shexp.weight")):
                # a MoE model's down tensors: by their block index, as llama.cpp does with experts
                qtype = more_type if more(int(spec.name.split(".")[1]), n_layer) else base
        try:
            types[spec.name] = _with_fallback(qtype, row)
        except ValueError as exc:
            raise ValueError(f"{spec.name}: {exc} (--type {wtype})") from None
    if base in K_QUANT_FALLBACK and not any(t in K_QUANT_FALLBACK for t in types.values()):
        widest = max((s for s in plan if len(s.shape) >= 2), key=lambda s: s.shape[-1])
        raise ValueError(f"--type {wtype}: no tensor has rows that are a multiple of {QK_K} "
                         f"({widest.name} has {widest.shape[-1]}), so every tensor would fall back "
                         f"to another type; use --preset medium (all rows K-quant) or small")
    return types


# ---- weights ---------------------------------------------------------------------------------

def _generate(rng: np.random.Generator, spec: TensorSpec) -> np.ndarray:
    x = rng.standard_normal(spec.shape, dtype=np.float32)
    if spec.kind == "rope_freqs":  # per-pair divisors in [1, std or 8], log-uniform
        return np.exp(rng.uniform(0.0, math.log(spec.std or 8.0), spec.shape)).astype(np.float32)
    if spec.kind == "norm":
        x *= np.float32(0.1)
        x += np.float32(1.0)
    elif spec.kind == "bias":
        x *= np.float32(0.1)
    else:
        x *= np.float32(spec.std)
    return x


def _nbytes(spec: TensorSpec, qtype: Q) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    return spec.n_elements // block * type_size


def _check_args(preset: str, wtype: str, seed: int, arch: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    if wtype not in WTYPES:
        raise ValueError(f"unknown weight type {wtype!r} (choose from {', '.join(WTYPES)})")
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r} (choose from {', '.join(ARCHS)})")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")


@contextlib.contextmanager
def gguf_file_writer(out: str, arch: str) -> Iterator[GGUFWriter]:
    """A GGUFWriter on a temporary file beside `out` that becomes `out` when the block ends
    without an error, and is removed when it raises: the file appears complete or not at all."""
    tmp = f"{out}.{os.getpid()}.{threading.get_ident()}.tmp"
    writer = GGUFWriter(tmp, arch)
    try:
        yield writer
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def make_model(preset: str, out: str, vocab: str | None = None, wtype: str = "f32", seed: int = 0,
               arch: str = "llama", tied: bool | None = None, opts: FamilyOptions = FamilyOptions()) -> str:
    """Writes a deterministic random-weight model to `out` and returns `out`.

    Raises ValueError for bad arguments, ModelFileError for an unusable --vocab file and
    OSError when `out` cannot be written. The file appears complete or not at all.
    """
    _check_args(preset, wtype, seed, arch)
    _check_family(PRESETS[preset], arch, opts)
    out = os.fspath(out)
    p = PRESETS[preset]
    ftype = WTYPES[wtype][1]
    if vocab is not None:
        vocab_entries, n_vocab = _vocab_from_file(os.fspath(vocab))
    elif arch in ENCODER_ARCHS:
        vocab_entries = _wordpiece_vocab_entries()
        n_vocab = len(vocab_entries[1][1])
    else:
        n_vocab = p.n_vocab
        vocab_entries = _default_vocab_entries(n_vocab)
    plan = tensor_plan(p, arch, tied, n_vocab, opts)
    types = tensor_types(plan, wtype)

    with gguf_file_writer(out, GGUF_ARCH.get(arch, arch)) as writer:  # general.architecture
        _add_metadata(writer, preset, p, arch, ftype, n_vocab, vocab_entries)
        _add_family_metadata(writer, p, arch, opts)
        for spec in plan:
            t = types[spec.name]
            # element shape; the dtype argument is unused when raw_dtype is given
            writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), _nbytes(spec, t), raw_dtype=t)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        for spec in plan:
            x = _generate(rng, spec)
            writer.write_tensor_data(quantize(x, types[spec.name]))
            del x
    return out


def _add_metadata(w: GGUFWriter, preset: str, p: Preset, arch_name: str, ftype: LlamaFileType, n_vocab: int,
                  vocab_entries: list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]) -> None:
    arch = GGUF_ARCH.get(arch_name, arch_name)
    w.add_string("general.name", f"pyllama-{preset}")
    w.add_uint32("general.file_type", int(ftype))
    w.add_uint32("general.quantization_version", QUANTIZATION_VERSION)
    w.add_uint32(f"{arch}.context_length", p.n_ctx)
    w.add_uint32(f"{arch}.embedding_length", p.n_embd)
    w.add_uint32(f"{arch}.block_count",
                 p.n_layer + (GLM4MOE["nextn_predict_layers"] if arch in ("glm4moe", "deepseek2") else 0))
    w.add_uint32(f"{arch}.feed_forward_length", p.n_ff)
    w.add_uint32(f"{arch}.attention.head_count", p.n_head)
    w.add_uint32(f"{arch}.attention.head_count_kv",
                 1 if arch == "deepseek2" else p.n_head if arch in ENCODER_ARCHS else p.n_head_kv)
    if arch in ENCODER_ARCHS:
        _add_encoder_metadata(w, arch, n_vocab, vocab_entries)
        return
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", RMS_EPS)
    if arch in QK_NORM_ARCHS:
        w.add_uint32(f"{arch}.attention.key_length", p.head_dim)
        w.add_uint32(f"{arch}.attention.value_length", p.head_dim)
    if arch_name in MOE_ARCHS:
        n_exp, n_used, ff_exp, ff_sh = moe_shape(p, arch_name)
        w.add_uint32(f"{arch}.expert_count", n_exp)
        w.add_uint32(f"{arch}.expert_used_count", n_used)
        if arch_name != "mixtral":
            w.add_uint32(f"{arch}.expert_feed_forward_length", ff_exp)
        if ff_sh and arch_name == "qwen2moe":
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length", ff_sh)
        if arch_name in ("glm4moe", "deepseek2"):
            for key in ("leading_dense_block_count", "expert_shared_count", "nextn_predict_layers"):
                w.add_uint32(f"{arch}.{key}", GLM4MOE[key])
            w.add_float32(f"{arch}.expert_weights_scale", GLM4MOE["expert_weights_scale"])
            w.add_bool(f"{arch}.expert_weights_norm", True)
            w.add_uint32(f"{arch}.expert_gating_func", 2)  # sigmoid
        if arch_name == "gpt-oss":
            w.add_uint32(f"{arch}.attention.sliding_window", GPT_OSS_WINDOW)
            w.add_uint32(f"{arch}.attention.key_length", p.head_dim)
            w.add_uint32(f"{arch}.attention.value_length", p.head_dim)
        if arch_name == "deepseek2":
            q_lora, lora, nope, rope, v, groups, used = mla_shape(p)
            w.add_uint32(f"{arch}.expert_group_count", groups)
            w.add_uint32(f"{arch}.expert_group_used_count", used)
            w.add_uint32(f"{arch}.attention.q_lora_rank", q_lora)
            w.add_uint32(f"{arch}.attention.kv_lora_rank", lora)
            w.add_uint32(f"{arch}.attention.key_length", lora + rope)
            w.add_uint32(f"{arch}.attention.value_length", lora)
            w.add_uint32(f"{arch}.attention.key_length_mla", nope + rope)
            w.add_uint32(f"{arch}.attention.value_length_mla", v)
    w.add_float32(f"{arch}.rope.freq_base", ROPE_FREQ_BASE[arch_name])
    w.add_uint32(f"{arch}.vocab_size", n_vocab)
    for key, value, vtype, sub in vocab_entries:
        w.add_key_value(key, value, vtype, sub)


def _add_encoder_metadata(w: GGUFWriter, arch: str, n_vocab: int,
                          vocab_entries: list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]) -> None:
    """An encoder's keys as llama.cpp's BERT converter writes them (non-causal attention, the
    LayerNorm epsilon, the pooling type: mean, or rank with a classification head; the rank
    option rewrites it in _add_family_metadata) and its vocabulary with a token type count."""
    w.add_float32(f"{arch}.attention.layer_norm_epsilon", BERT_NORM_EPS)
    w.add_bool(f"{arch}.attention.causal", False)
    w.add_uint32(f"{arch}.vocab_size", n_vocab)
    for key, value, vtype, sub in vocab_entries:
        w.add_key_value(key, value, vtype, sub)
    if not any(key == "tokenizer.ggml.token_type_count" for key, *_ in vocab_entries):
        w.add_uint32("tokenizer.ggml.token_type_count", 2)


# WordPiece: the specials, every printable ASCII character as a word start and as a continuation,
# and a few whole words, so that plain English text tokenizes into more than characters
WPM_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
WPM_WORDS = ("the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as", "was", "at", "by",
             "this", "be", "are", "from", "or", "an", "which", "one", "all", "cat", "dog", "sat", "mat", "what",
             "how", "where", "paris", "france", "capital", "city", "river", "weather", "today", "hello", "world")
WPM_PIECES = ("ing", "ed", "er", "es", "ly", "tion", "th", "he", "an", "re", "on", "at", "en", "nd", "st")


def _wordpiece_vocab_entries() -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    """A small WordPiece vocabulary as llama.cpp's converter stores one (word starts with the
    U+2581 prefix, continuations bare; [CLS] / [SEP] framing each text)."""
    chars = [chr(c) for c in range(33, 127)]
    tokens = list(WPM_SPECIALS) + ["\u2581" + c for c in chars] + chars + ["\u2581" + x for x in WPM_WORDS] \
        + list(WPM_PIECES)
    types = [3] * len(WPM_SPECIALS) + [1] * (len(tokens) - len(WPM_SPECIALS))  # control, then normal
    A, S, U, B = GGUFValueType.ARRAY, GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.BOOL
    ids = {name: WPM_SPECIALS.index(tok) for name, tok in (("padding", "[PAD]"), ("unknown", "[UNK]"),
                                                             ("bos", "[CLS]"), ("seperator", "[SEP]"),
                                                             ("mask", "[MASK]"))}
    return [("tokenizer.ggml.model", "bert", S, None),
            ("tokenizer.ggml.tokens", tokens, A, S),
            ("tokenizer.ggml.token_type", types, A, GGUFValueType.INT32)] + \
        [(f"tokenizer.ggml.{name}_token_id", i, U, None) for name, i in ids.items()] + \
        [("tokenizer.ggml.add_bos_token", True, B, None), ("tokenizer.ggml.add_eos_token", False, B, None),
         ("tokenizer.ggml.token_type_count", 2, U, None)]


def _check_family(p: Preset, arch: str, opts: FamilyOptions) -> None:
    if opts.rerank_head and arch not in ("bert", "jina-bert-v2"):
        raise ValueError(f"--rerank-head is for bert and jina-bert-v2 (llama.cpp reads a classification head for "
                         f"them), not {arch}")
    if arch in ENCODER_ARCHS and (opts.rope_scaling != "none" or opts.rope_freqs or opts.n_rot or opts.longrope
                                  or opts.output_bias or opts.sliding_window or opts.attn_softcap
                                  or opts.final_softcap):
        raise ValueError(f"{arch} takes no RoPE, window, soft-cap or output options (it has learned positions "
                         "and no output layer)")
    if opts.rope_scaling not in ("none", "linear", "yarn"):
        raise ValueError(f"unknown rope scaling {opts.rope_scaling!r} (choose from none, linear, yarn)")
    if not opts.rope_factor >= 1.0:
        raise ValueError(f"rope factor must be at least 1, got {opts.rope_factor}")
    if opts.n_rot and (opts.n_rot % 2 or not 0 < opts.n_rot <= p.head_dim):
        raise ValueError(f"n_rot must be even and at most the head size {p.head_dim}, got {opts.n_rot}")
    if opts.sliding_window < 0 or opts.attn_softcap < 0 or opts.final_softcap < 0:
        raise ValueError("sliding window and soft-caps must not be negative")
    if opts.longrope and (arch != "phi3" or opts.rope_freqs or opts.rope_scaling != "none"):
        raise ValueError("--longrope is phi3's (and without --rope-freqs or --rope-scaling)")
    if opts.output_bias and arch not in ("qwen2", "phi3"):
        raise ValueError(f"{arch} reads no output.bias (qwen2, phi3 do)")
    if (opts.sliding_window and arch not in GEMMA_ARCHS) or \
            ((opts.attn_softcap or opts.final_softcap) and arch != "gemma2"):
        raise ValueError(f"{arch} takes no sliding window or soft-cap here (gemma2, gemma3 do)")


def _add_family_metadata(w: GGUFWriter, p: Preset, arch_name: str, opts: FamilyOptions) -> None:
    """RoPE dimensions and scaling, and the gemma keys, as llama.cpp's converters write them."""
    arch = GGUF_ARCH.get(arch_name, arch_name)
    if arch in ENCODER_ARCHS:
        w.add_uint32(f"{arch}.pooling_type", POOLING_RANK if opts.rerank_head else POOLING_MEAN)
        if arch == "nomic-bert":
            w.add_float32(f"{arch}.rope.freq_base", NOMIC_ROPE_BASE)
            w.add_uint32(f"{arch}.rope.dimension_count", p.head_dim)
        return
    n_rot = mla_shape(p)[3] if arch == "deepseek2" else p.head_dim // 2 if arch in PARTIAL_ROPE_ARCHS else p.head_dim
    w.add_uint32(f"{arch}.rope.dimension_count", opts.n_rot or n_rot)
    if opts.rope_scaling != "none":
        w.add_string(f"{arch}.rope.scaling.type", opts.rope_scaling)
        w.add_float32(f"{arch}.rope.scaling.factor", opts.rope_factor)
        if opts.rope_scaling == "yarn":
            w.add_uint32(f"{arch}.rope.scaling.original_context_length", max(1, int(p.n_ctx / opts.rope_factor)))
    if opts.longrope:
        orig = max(2, p.n_ctx // 4)
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", orig)
        w.add_float32(f"{arch}.rope.scaling.attn_factor", math.sqrt(1 + math.log(p.n_ctx / orig) / math.log(orig)))
    if arch in GEMMA_ARCHS:
        w.add_uint32(f"{arch}.attention.sliding_window", opts.sliding_window or SWA_DEFAULT[arch])
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", opts.attn_softcap or 50.0)
        w.add_float32("gemma2.final_logit_softcapping", opts.final_softcap or 30.0)


# ---- command line ----------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit status 1
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(1)


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seed {text!r} (expected a non-negative integer)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid seed {text!r} (expected a non-negative integer)")
    return value


def written_or_reported(prog: str, out: str, write: Callable[[], str]) -> str | None:
    """write()'s path, or None once one error line is on stderr (bad arguments, an unusable
    input file, an output that cannot be written)."""
    try:
        return write()
    except (PyllamaError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"{prog}: error: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="python -m pyllama.models.make",
                 description="Write a deterministic random-weight test model as a GGUF file.")
    ap.add_argument("--preset", required=True, choices=list(PRESETS), help="model size")
    ap.add_argument("--out", required=True, help="output GGUF path")
    ap.add_argument("--vocab", help="copy the tokenizer.* metadata (and vocabulary size) of this GGUF file")
    ap.add_argument("--type", dest="wtype", default="f32", choices=list(WTYPES),
                    help="type of the 2-D weights, or llama.cpp's q4_k_m / q5_k_m mix (default f32)")
    ap.add_argument("--seed", type=_seed, default=0, help="random seed (default 0)")
    ap.add_argument("--arch", default="llama", choices=list(ARCHS), help="architecture (default llama)")
    tie = ap.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None,
                     help="no output.weight: the output layer reuses token_embd (default for small and medium; "
                          "never qwen2moe)")
    tie.add_argument("--untied", dest="tied", action="store_false", help="a separate output.weight (default for tiny)")
    ap.add_argument("--rope-scaling", default="none", choices=["none", "linear", "yarn"],
                    help="rope.scaling.type written (default none)")
    ap.add_argument("--rope-factor", type=float, default=1.0, help="rope.scaling.factor (default 1)")
    ap.add_argument("--rope-freqs", action="store_true",
                    help="add rope_freqs.weight, llama3-style per-pair divisors (random in [1, 8])")
    ap.add_argument("--n-rot", type=int, default=0, help="rope.dimension_count (default: the head size)")
    ap.add_argument("--sliding-window", type=int, default=0,
                    help="gemma2/gemma3: attention.sliding_window (default 4096 / 1024)")
    ap.add_argument("--attn-softcap", type=float, default=0.0, help="gemma2: attn_logit_softcapping (default 50)")
    ap.add_argument("--final-softcap", type=float, default=0.0, help="gemma2: final_logit_softcapping (default 30)")
    ap.add_argument("--longrope", action="store_true",
                    help="phi3: LongRoPE factors (rope_factors_long/short.weight), original context n_ctx / 4")
    ap.add_argument("--output-bias", action="store_true", help="qwen2, phi3: add output.bias")
    ap.add_argument("--rerank-head", action="store_true",
                    help="bert, jina-bert-v2: a reranker's classification head (bert: cls and cls.output; "
                         "jina-bert-v2: a one-score cls) and pooling_type rank")
    args = ap.parse_args(argv)
    opts = FamilyOptions(args.rope_scaling, args.rope_factor, args.rope_freqs, args.sliding_window,
                         args.attn_softcap, args.final_softcap, args.n_rot, args.longrope, args.output_bias,
                         args.rerank_head)
    path = written_or_reported(ap.prog, args.out, lambda: make_model(
        args.preset, args.out, vocab=args.vocab, wtype=args.wtype, seed=args.seed, arch=args.arch, tied=args.tied,
        opts=opts))
    if path is None:
        return 1
    n_vocab = None if args.vocab is None else GGUFFile(path).get(f"{GGUF_ARCH.get(args.arch, args.arch)}.vocab_size")
    if args.arch in ENCODER_ARCHS:
        n_vocab = GGUFFile(path).get(f"{args.arch}.vocab_size")
    n_params = count_parameters(args.preset, args.arch, args.tied, n_vocab)
    print(f"wrote {path}: {args.arch} {args.preset}, {n_params / 1e6:.2f}M parameters, {args.wtype}, "
          f"{os.path.getsize(path) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
