"""The vocabulary every layer shares: element types, buffers, tensors, ops, graphs, and the op table.

This module is the bottom of the engine: the graph builders (models/build/), the backends (backend/), the
scheduler and the rpc server all import it, and it imports nothing of pyllama, so no package
depends on another one just to name a tensor or an op.

`OP_TABLE` states, once, what every op takes and gives: its sources (name, allowed types, whether
the position may hold a weight in a type the device stores), its output type and its parameter
count. The CPU and CUDA backends check each node against it before binding a kernel, and the rpc
server checks every node a client sends against it (`check_node`), so the three cannot drift.

Op codes are fixed once released (a graph travels over RPC as codes plus fixed-size parameter
blocks); new ops are appended.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Iterable, NamedTuple, Optional, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as DType

__all__ = ["ATTN_ALIBI", "AttentionParams", "MlaParams", "MoeParams", "family_node", "DType", "Buffer", "Tensor", "nbytes_of", "NP_DTYPES", "WEIGHT_TYPES", "QUANT_TYPES", "KV_CACHE_TYPES",
           "Op", "Node", "Graph", "node", "input_tensor", "Src", "OpSpec", "OP_TABLE", "src_roles", "check_node",
           "sample_in_cols", "sample_out_cols", "SAMPLE_PARAM_COLS", "MAX_SRCS"]

# numpy views exist for the element types that compute touches directly; quantized types are bytes.
NP_DTYPES: dict[DType, np.dtype] = {
    DType.F32: np.dtype(np.float32),
    DType.F16: np.dtype(np.float16),
    DType.I32: np.dtype(np.int32),
}

# ggml's block formats that the engine keeps as the file stores them (and computes on directly)
QUANT_TYPES: tuple[DType, ...] = (DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.Q8_0,
                                  DType.Q2_K, DType.Q3_K, DType.Q4_K, DType.Q5_K, DType.Q6_K,
                                  DType.IQ4_NL, DType.IQ4_XS, DType.MXFP4, DType.IQ2_XXS, DType.IQ2_XS,
                                  DType.IQ2_S, DType.IQ3_XXS, DType.IQ3_S, DType.IQ1_S, DType.IQ1_M,
                                  DType.TQ1_0, DType.TQ2_0)
# every type a model file may give a weight (NVFP4 and Q1_0 are refused at load)
WEIGHT_TYPES: tuple[DType, ...] = (DType.F32, DType.F16, DType.BF16) + QUANT_TYPES
# the types a KV cache may be stored in (ATTENTION's k_cache and v_cache)
KV_CACHE_TYPES: frozenset = frozenset({DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.Q4_0, DType.Q4_1,
                                       DType.Q5_0, DType.Q5_1, DType.IQ4_NL})


def nbytes_of(dtype: DType, shape: tuple[int, ...]) -> int:
    """Bytes of a row-major tensor of `shape`; the last dimension is the row (in blocks for quants)."""
    block, type_size = GGML_QUANT_SIZES[dtype]
    n = 1
    for d in shape:
        n *= d
    if shape and shape[-1] % block:
        raise ValueError(f"row of {shape[-1]} is not a whole number of {dtype.name} blocks")
    return n // block * type_size


_buffer_ids = itertools.count(1)


class Buffer:
    """A region of device memory. Backends subclass it to hold their handle."""

    __slots__ = ("backend", "id", "size", "usage", "__weakref__")

    def __init__(self, backend: Any, size: int, usage: str):
        self.backend = backend  # the Backend (backend/base.py) that owns it
        self.id = next(_buffer_ids)
        self.size = size
        self.usage = usage

    def __repr__(self) -> str:
        return f"<Buffer {self.id} {self.usage} {self.size} B on {self.backend.name}>"


class Tensor:
    """A typed, shaped view of a buffer region. `buffer` is None until the scheduler places it."""

    __slots__ = ("buffer", "offset", "dtype", "shape", "name", "nbytes")

    def __init__(self, dtype: DType, shape: tuple[int, ...], name: str,
                 buffer: Optional[Buffer] = None, offset: int = 0):
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)
        self.name = name
        self.buffer = buffer
        self.offset = offset
        self.nbytes = nbytes_of(dtype, self.shape)

    @property
    def backend(self) -> Any:
        assert self.buffer is not None, f"tensor {self.name} is not allocated"
        return self.buffer.backend

    def view(self, shape: tuple[int, ...], name: Optional[str] = None) -> "Tensor":
        """The same bytes under another shape (row-major reinterpretation, same element count)."""
        t = Tensor(self.dtype, shape, name or self.name, self.buffer, self.offset)
        if t.nbytes != self.nbytes:
            raise ValueError(f"view {shape} of {self.name}{self.shape} changes the size")
        return t

    def __repr__(self) -> str:
        where = f"buf{self.buffer.id}+{self.offset}" if self.buffer else "unallocated"
        return f"<Tensor {self.name} {self.dtype.name}{list(self.shape)} {where}>"


# --- ops ------------------------------------------------------------------------------------------
class Op(IntEnum):
    # srcs (table [n, d], ids i32 [m]) -> out [m, d]: embedding lookup and output-row selection
    GET_ROWS = 1
    # srcs (x [n, d], w [d]); params (eps,) -> out [n, d] = x / rms(x) * w
    RMS_NORM = 2
    # srcs (x [n, k], w [m, k] [, bias [m]]) -> out [n, m] = x @ w.T (+ bias)
    MUL_MAT = 3
    # srcs (a, b) same shape -> out = a + b
    ADD = 4
    # srcs (gu [n, 2f]) -> out [n, f] = silu(gu[:, :f]) * gu[:, f:]
    SWIGLU = 5
    # Self-attention of one layer with its KV-cache write, RoPE and optional q/k norm fused:
    # srcs (qkv [n, (H + 2 Hkv) hd], k_cache [cells, Hkv hd], v_cache [cells, Hkv hd], pos i32 [n],
    #       kv_idx i32 [n], attn_cells i32 [c], attn_ranges i32 [n, 2] [, q_norm [hd], k_norm [hd]]
    #       [, rope_freqs [n_rot / 2]] [, sinks [H]])
    # params (n_head, n_head_kv, head_dim, n_rot, rope_mode, freq_base, freq_scale, norm_eps, scale
    #         [, softcap, n_swa, rope_mscale])
    # -> out [n, H hd]. Token t writes its k, v to cell kv_idx[t], then attends to the cells
    # attn_cells[r0 : r0 + r1] where (r0, r1) = attn_ranges[t] (the host lists a sequence's cells
    # in position order, ending at the token's own). Pair i of the first n_rot dims rotates by
    # pos * freq_scale * freq_base^(-2i / n_rot) / rope_freqs[i] (ggml's freq factors), its cos and
    # sin times rope_mscale (YaRN's magnitude). softcap > 0: scores become softcap *
    # tanh(score / softcap) (gemma2). n_swa > 0: only the last n_swa cells of the token's list
    # (a sliding window: positions p - n_swa < q <= p). The three trailing parameters are 0 in
    # graphs that use none of them (9-parameter graphs stay valid); rope_mscale 0 reads as 1.
    # rope_mode + ATTN_SINKS (16): a sinks source comes last, one logit per query head that joins
    # each softmax's denominator (gpt-oss's attention sinks, ggml's soft_max with sinks).
    # rope_mode + ATTN_ALIBI (32): an alibi source comes last (after any sinks), one slope per
    # query head: each score gets slope * -|p_q - p_k| (ALiBi, ggml's soft_max with max_bias), the
    # key's position read as its place in the token's list (the cache lists positions 0.. in order).
    ATTENTION = 6
    # The sampler chain of every output row, run where the logits are (backend sampling):
    # srcs (logits [r, n_vocab], sampling i32 [r, 12 + L]); params (n_probs N, window L)
    # -> out i32 [r, 2 + 2N]. A sampling row holds the packed inputs of sampling.pack_rows: 8
    # float32 parameters (bit patterns; the 7th is the row's uniform draw), 4 ints (top_k, n_probs,
    # n_penalty_tokens, 0) and L penalty tokens. An out row holds the chosen id, its probability
    # (float32 bits), N candidate ids and their probabilities (float32 bits).
    SAMPLE = 7
    # One product against weights of different types, concatenated by rows (a fused q|k|v or
    # gate|up whose parts a quantization mix stored in different types):
    # srcs (x [n, k], w_1 [m_1, k], ..., w_p [m_p, k] [, bias [m_1 + ... + m_p]]); params (p,)
    # -> out [n, m_1 + ... + m_p], part i written into its columns. Same result as MUL_MAT
    # against the rows concatenated, in one node (Python pays per node).
    MUL_MAT_CAT = 8
    # A Mixture-of-Experts FFN, router to weighted sum (models/build/moe.py):
    # srcs (x [n, e], router [E, e], gate_exps [E, f, e], up_exps [E, f, e], down_exps [E, e, f]
    #       [, shexp [n, e] [, shexp_gate [e]]] [, probs_b [E]]); params (n_expert_used K, norm,
    #       scale [, gating, probs_b, n_group, n_group_used]) (MoeParams)
    #       [, biases, act]; with biases, router_b [E], gate_b [E, f], up_b [E, f], down_b [E, e]
    #       follow the 5 fixed sources)
    # -> out [n, e]. Per token: p = softmax(x @ router.T) (gating 2: sigmoid; 3: the logits, and
    # the chosen experts' weights the softmax of their logits, gpt-oss), selection scores
    # p + probs_b (where the params say a probs_b source comes last), with n_group > 1 only the
    # experts of the n_group_used groups whose best two scores sum highest; the K best (ties: the
    # lower expert id), their weights p_k (divided by their sum when norm is 1) times scale; out =
    # sum_k w_k * down_k(silu(gate_k x) * up_k x) (act 1: min(g, 7) sigmoid(1.702 min(g, 7)) *
    # (clamp(u, -7, 7) + 1), each product plus its bias). Only the chosen experts' rows are read. shexp, a
    # shared expert's output computed by ordinary nodes, is added, times sigmoid(x . shexp_gate)
    # if given.
    MOE_FFN = 9
    # srcs (gu [n, 2f]) -> out [n, f] = gelu(gu[:, :f]) * gu[:, f:], gelu in its tanh form (GeGLU,
    # gemma's FFN)
    GEGLU = 11
    # srcs (x); params (s,) -> out = x * s (gemma's embedding scale, sqrt(n_embd))
    SCALE = 12
    # srcs (x); params (c,) -> out = c * tanh(x / c) (gemma2's final logit soft-capping)
    SOFTCAP = 13
    # DeepSeek's multi-head latent attention with its cache write, as llama.cpp's MLA path
    # (models/build/deepseek2.py): srcs (q [n, H (nope + rope)], kv [n, lora + rope], k_cache
    # [cells, lora + rope], pos, kv_idx, attn_cells, attn_ranges (as ATTENTION's), kv_norm [lora],
    # k_b [H, lora, nope], v_b [H, v, lora]); params (n_head, lora, freq_base, freq_scale,
    # norm_eps, scale, attn_factor, ext_factor, beta_fast, beta_slow, n_ctx_orig) -> out [n, H v].
    # Per token: the latent c = rms_norm(kv[:lora]) * kv_norm and k_pe = rope(kv[lora:]) are
    # stored as its cache row [c, k_pe]; each head's query is [k_b q_nope, rope(q_pe)] (the
    # "absorbed" query) against the rows of its listed cells, one KV head for all (scores times
    # scale, softmax), the probabilities times the cells' latents, and v_b of that is the head's
    # output. RoPE is ggml's rope_ext in the normal (adjacent pairs) mode with its YaRN
    # parameters. The cache holds lora + rope values per token and layer, as llama.cpp's.
    MLA_ATTENTION = 14
    # srcs (x [n, d], w [d], b [d]); params (eps,) -> out [n, d] = (x - mean) / sqrt(var + eps) * w + b
    # (the encoders' LayerNorm: BERT and its family)
    LAYER_NORM = 15
    # srcs (x); -> out = gelu(x), in its tanh form (the encoders' ungated FFN)
    GELU = 16
    # LoRA adapters on a product (models/lora.py): srcs (y [n, m], x [n, k], a [R, k], b [m, R],
    # scale [n, A]); params (w_1, ..., w_A), the widths of the A adapters' blocks of a's rows (and
    # b's columns), |w| summing to R -> out [n, m] = y + ((x @ a.T) * s) @ b.T, where s [n, R]
    # repeats column j of scale over adapter j's block: each token gets its own adapters and scales.
    # A negative width marks an adapter stored as F16: its block takes x and x @ a.T rounded to F16
    # before the products (as ggml's products against F16 matrices round their activations).
    LORA = 17


MAX_SRCS = 10  # sources a node may have (the wire's fixed node layout)
F32, I32 = DType.F32, DType.I32


@dataclass(frozen=True)
class Src:
    """One source position of an op: what it is, which types it takes, whether it may be a weight
    (then any type the device stores for weights is accepted too)."""

    name: str
    dtypes: frozenset
    weight: bool = False


# The ops of the dense families beyond llama (gemma, phi3, scaled RoPE): a device runs all of them
# and ATTENTION's extensions (soft-cap, window, rope_freqs / rope_mscale), or none.
FAMILY_OPS = (Op.GEGLU, Op.SCALE, Op.SOFTCAP)


ATTN_SINKS = 16  # a flag on ATTENTION's rope_mode: the last source is the per-head sink logits
ATTN_ALIBI = 32  # a flag on ATTENTION's rope_mode: the last source is the per-head ALiBi slopes


class AttentionParams(NamedTuple):
    """ATTENTION's parameters by name (their order on the wire: Op.ATTENTION). The extensions
    (softcap, n_swa, rope_mscale and a rope_freqs source) are what the dense families beyond llama
    add; graphs without them carry the 9 base parameters, which every device runs."""

    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_mode: int
    freq_base: float
    freq_scale: float
    norm_eps: float
    scale: float
    softcap: float = 0.0
    n_swa: float = 0      # a float as it travels; the kernels check it is whole
    rope_mscale: float = 1.0
    rope_freqs: bool = False  # a rope_freqs source follows (it is a source, not a parameter)
    sinks: bool = False       # a sinks source comes last (ATTN_SINKS on rope_mode on the wire)
    alibi: bool = False       # an alibi source comes last (ATTN_ALIBI on rope_mode on the wire)

    @classmethod
    def of(cls, params: Sequence[float], n_srcs: int) -> "AttentionParams":
        """From a node's parameters (9 or 12) and its source count (8 or 10: rope_freqs last, then
        the sinks where rope_mode carries ATTN_SINKS, then the slopes where it carries ATTN_ALIBI)."""
        p = tuple(params) + (0.0,) * (12 - len(params))
        mode = p[4]
        whole = mode == int(mode)
        sinks = whole and int(mode) & ATTN_SINKS != 0
        alibi = whole and int(mode) & ATTN_ALIBI != 0
        if sinks or alibi:
            p = p[:4] + (int(mode) & ~(ATTN_SINKS | ATTN_ALIBI),) + p[5:]
        rest = n_srcs - (1 if sinks else 0) - (1 if alibi else 0)
        return cls(*p[:9], softcap=p[9], n_swa=p[10], rope_mscale=p[11] or 1.0, rope_freqs=rest % 2 == 0,
                   sinks=sinks, alibi=alibi)

    @property
    def extended(self) -> bool:
        """Whether it uses an extension (devices without FAMILY_OPS run none)."""
        return (self.softcap != 0 or self.n_swa != 0 or self.rope_mscale != 1.0 or self.rope_freqs or self.sinks
                or self.alibi)

    def params(self) -> tuple:
        """The node's parameters: the 9 base ones, the 3 extensions only where one is used."""
        base = tuple(self[:9])
        if self.sinks or self.alibi:
            flags = (ATTN_SINKS if self.sinks else 0) | (ATTN_ALIBI if self.alibi else 0)
            base = base[:4] + (int(self.rope_mode) | flags,) + base[5:]
        if self.softcap or self.n_swa or self.rope_mscale != 1.0:
            return base + (self.softcap, self.n_swa, self.rope_mscale)
        return base


class MoeParams(NamedTuple):
    """MOE_FFN's parameters by name (their order on the wire). The routing extensions (sigmoid
    gating, an expert bias source, expert groups) are what DeepSeek- and GLM-style MoE layers add;
    graphs without them carry the 3 base parameters, which every MoE device runs."""

    n_used: float
    norm: float
    scale: float
    gating: float = 1.0   # llama.cpp's expert gating ids: 1 softmax, 2 sigmoid
    probs_b: float = 0.0  # 1: the last source is the expert bias
    n_group: float = 1.0
    n_group_used: float = 1.0
    biases: float = 0.0   # 1: router and expert biases follow the 5 fixed sources (gpt-oss)
    act: float = 0.0      # the experts' activation: 0 SwiGLU, 1 gpt-oss's clamped SwiGLU

    @classmethod
    def of(cls, params: Sequence[float]) -> "MoeParams":
        """From a node's parameters (3, 7 or 9; the wire pads with zeros, and a 0 gating or group
        count reads as its default, 1)."""
        p = tuple(params) + (0.0,) * (9 - len(params))
        return cls(*p[:3], gating=p[3] or 1.0, probs_b=p[4], n_group=p[5] or 1.0, n_group_used=p[6] or 1.0,
                   biases=p[7], act=p[8])

    @property
    def extended(self) -> bool:
        return (self.gating != 1 or self.probs_b != 0 or self.n_group != 1 or self.n_group_used != 1
                or self.biases != 0 or self.act != 0)

    def sources(self, srcs: Sequence) -> tuple[list, list, Optional[object]]:
        """(the four biases router_b, gate_b, up_b, down_b or [], the shared expert and its gate
        (0 to 2), the expert bias or None) among a node's sources past the five fixed ones."""
        bias = srcs[-1] if self.probs_b == 1 else None
        n = 4 if self.biases == 1 else 0
        return list(srcs[5:5 + n]), list(srcs[5 + n:len(srcs) - (1 if bias is not None else 0)]), bias

    def params(self) -> tuple:
        if not self.extended:
            return tuple(self[:3])
        return tuple(self) if self.biases or self.act else tuple(self[:7])


class MlaParams(NamedTuple):
    """MLA_ATTENTION's parameters by name, in their order on the wire."""

    n_head: float
    lora: float
    freq_base: float
    freq_scale: float
    norm_eps: float
    scale: float
    attn_factor: float = 1.0
    ext_factor: float = 0.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: float = 0.0


def family_node(op: Op, params: Sequence[float], n_srcs: int) -> bool:
    """Whether a node needs a device with FAMILY_OPS: one of those ops, ATTENTION extended, MOE_FFN
    routed with its extensions, or MLA_ATTENTION (which a device runs besides)."""
    return (op in FAMILY_OPS or op == Op.MLA_ATTENTION or (op == Op.ATTENTION and AttentionParams.of(params, n_srcs).extended)
            or (op == Op.MOE_FFN and len(params) > 3 and MoeParams.of(params).extended))


@dataclass(frozen=True)
class OpSpec:
    srcs: tuple[Src, ...]    # every position, optional ones last
    counts: tuple[int, ...]  # accepted source counts
    out: DType
    n_params: int            # parameters the op reads (the rest of the wire's block must be 0)


def _s(name: str, *dtypes: DType, weight: bool = False) -> Src:
    return Src(name, frozenset(dtypes), weight)


OP_TABLE: dict[Op, OpSpec] = {
    Op.GET_ROWS: OpSpec((_s("table", F32, weight=True), _s("ids", I32)), (2,), F32, 0),
    Op.RMS_NORM: OpSpec((_s("x", F32), _s("w", F32)), (2,), F32, 1),
    Op.MUL_MAT: OpSpec((_s("x", F32), _s("w", F32, weight=True), _s("bias", F32)), (2, 3), F32, 0),
    Op.ADD: OpSpec((_s("a", F32), _s("b", F32)), (2,), F32, 0),
    Op.SWIGLU: OpSpec((_s("gu", F32),), (1,), F32, 0),
    Op.ATTENTION: OpSpec((_s("qkv", F32), Src("k_cache", KV_CACHE_TYPES), Src("v_cache", KV_CACHE_TYPES),
                          _s("pos", I32), _s("kv_idx", I32), _s("attn_cells", I32), _s("attn_ranges", I32),
                          _s("q_norm", F32), _s("k_norm", F32), _s("rope_freqs", F32), _s("sinks", F32),
                          _s("alibi", F32)),
                         (7, 8, 9, 10), F32, 12),
    Op.SAMPLE: OpSpec((_s("logits", F32), _s("sampling", I32)), (2,), I32, 2),
    # sources are laid out by src_roles (x, p weights, optional bias)
    Op.MUL_MAT_CAT: OpSpec((_s("x", F32), _s("w", F32, weight=True), _s("bias", F32)),
                           tuple(range(3, MAX_SRCS + 1)), F32, 1),
    # sources are laid out by src_roles (5 fixed, the shared expert and its gate, the expert bias)
    Op.MOE_FFN: OpSpec((_s("x", F32), _s("router", F32, weight=True), _s("gate_exps", F32, weight=True),
                        _s("up_exps", F32, weight=True), _s("down_exps", F32, weight=True), _s("shexp", F32),
                        _s("shexp_gate", F32), _s("probs_b", F32), _s("router_b", F32), _s("gate_b", F32),
                        _s("up_b", F32), _s("down_b", F32)), (5, 6, 7, 8, 9, 10), F32, 9),
    Op.GEGLU: OpSpec((_s("gu", F32),), (1,), F32, 0),
    Op.MLA_ATTENTION: OpSpec((_s("q", F32), _s("kv", F32), Src("k_cache", KV_CACHE_TYPES), _s("pos", I32),
                              _s("kv_idx", I32), _s("attn_cells", I32), _s("attn_ranges", I32),
                              _s("kv_norm", F32), _s("k_b", F32, weight=True), _s("v_b", F32, weight=True)),
                    (10,), F32, 11),
    Op.SCALE: OpSpec((_s("x", F32),), (1,), F32, 1),
    Op.SOFTCAP: OpSpec((_s("x", F32),), (1,), F32, 1),
    Op.LAYER_NORM: OpSpec((_s("x", F32), _s("w", F32), _s("b", F32)), (3,), F32, 1),
    Op.GELU: OpSpec((_s("x", F32),), (1,), F32, 0),
    Op.LORA: OpSpec((_s("y", F32), _s("x", F32), _s("a", F32, weight=True), _s("b", F32, weight=True),
                     _s("scale", F32)), (5,), F32, 12),
}
assert set(OP_TABLE) == set(Op), "every op needs its row in OP_TABLE"


def src_roles(op: Op, n_srcs: int, params: Sequence[float] = ()) -> Optional[list[Src]]:
    """What each of a node's `n_srcs` sources is, or None when the op takes no such count."""
    spec = OP_TABLE[op]
    if n_srcs not in spec.counts:
        return None
    if op == Op.MUL_MAT_CAT:
        if not params:
            return None
        p = params[0]
        if p != int(p) or not 2 <= p <= n_srcs - 1 or n_srcs - 1 - p > 1:
            return None
        x, w, bias = spec.srcs
        return [x] + [w] * int(p) + [bias] * (n_srcs - 1 - int(p))
    if op == Op.MOE_FFN:  # 5 fixed [, 4 biases], the shared expert and its gate, the expert bias
        mp = MoeParams.of(params)
        if mp.probs_b not in (0, 1) or mp.biases not in (0, 1):
            return None
        bias, biases = int(mp.probs_b), 4 * int(mp.biases)
        shared = n_srcs - 5 - bias - biases
        if not 0 <= shared <= 2:
            return None
        return (list(spec.srcs[:5]) + list(spec.srcs[8:12])[:biases] + list(spec.srcs[5:5 + shared])
                + [spec.srcs[7]] * bias)
    if op == Op.ATTENTION:  # 7 fixed, then q_norm and k_norm as a pair, then rope_freqs, sinks, alibi
        base, pair, freqs, sinks = list(spec.srcs[:7]), list(spec.srcs[7:9]), [spec.srcs[9]], [spec.srcs[10]]
        ap = AttentionParams.of(params, n_srcs) if params else None
        has_sinks, has_alibi = (ap.sinks, ap.alibi) if ap is not None else (False, False)
        rest = n_srcs - (1 if has_sinks else 0) - (1 if has_alibi else 0)
        if rest < 7:
            return None
        return (base + (pair if rest >= 9 else []) + (freqs if rest % 2 == 0 else []) + (sinks if has_sinks else [])
                + ([spec.srcs[11]] if has_alibi else []))
    return list(spec.srcs[:n_srcs])


def check_node(op: Op, out_dtype: DType, src_dtypes: Sequence[DType], params: Sequence[float],
               weight_types: Iterable[DType]) -> Optional[str]:
    """Why a node cannot run on a device storing weights in `weight_types` (the op table's types
    only; shapes and parameter values are the kernels' business), or None when it can."""
    spec = OP_TABLE[op]
    roles = src_roles(op, len(src_dtypes), params)
    if roles is None:
        if op == Op.MUL_MAT_CAT:
            return (f"{len(src_dtypes)} sources with {list(params[:1])} weight parts (expected x, 2 or more "
                    f"weights and an optional bias, at most {MAX_SRCS} sources)")
        return f"{len(src_dtypes)} sources, expected {' or '.join(map(str, spec.counts))}"
    if out_dtype != spec.out:
        return f"output is {DType(out_dtype).name}, not {spec.out.name}"
    wtypes = frozenset(weight_types)
    for k, (role, dt) in enumerate(zip(roles, src_dtypes)):
        if dt in role.dtypes or (role.weight and dt in wtypes):
            continue
        allowed = role.dtypes | (wtypes if role.weight else frozenset())
        return (f"source {k} ({role.name}) is {DType(dt).name}, not "
                f"{' or '.join(sorted(DType(t).name for t in allowed))}")
    return None


SAMPLE_PARAM_COLS = 12  # the 8 float and 4 int parameters at the start of a SAMPLE input row


def sample_in_cols(window: int) -> int:
    """Columns of SAMPLE's packed input with a penalty window of `window` tokens."""
    return SAMPLE_PARAM_COLS + window


def sample_out_cols(n_probs: int) -> int:
    """Columns of SAMPLE's packed output with room for `n_probs` candidates."""
    return 2 + 2 * n_probs


# --- graphs ---------------------------------------------------------------------------------------
_graph_uids = itertools.count(1)


@dataclass(eq=False)
class Node:
    op: Op
    out: Tensor
    srcs: tuple[Tensor, ...]
    params: tuple = ()
    layer: int = -1  # which model layer the node belongs to; decides its device


@dataclass(eq=False)
class Graph:
    """Nodes in execution order, all on one backend once the scheduler has split them."""

    nodes: list[Node]
    uid: int = field(default_factory=lambda: next(_graph_uids))

    def __len__(self) -> int:
        return len(self.nodes)


def input_tensor(name: str, dtype: DType, shape: tuple[int, ...]) -> Tensor:
    """A tensor the host fills before each compute (token ids, positions, cell lists...)."""
    return Tensor(dtype, shape, name)


def node(op: Op, out: Tensor, *srcs: Optional[Tensor], params: tuple = (), layer: int = -1) -> Node:
    return Node(op, out, tuple(s for s in srcs if s is not None), params, layer)
