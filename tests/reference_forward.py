"""An independent float64 reference forward pass of the llama family (llama, qwen2, qwen3, and the
Mixture-of-Experts qwen2moe, qwen3moe, Mixtral-style llama, glm4moe, deepseek2 and gpt-oss).

Test helper, not a test: `reference_logits(model_path, tokens)` reads the GGUF file with
`gguf.GGUFReader` and `gguf.quants.dequantize` (not pyllama's loader) and runs one sequence at
positions 0..n-1 the way llama.cpp computes it, in float64 numpy, written for obviousness rather
than speed.

Like ggml, a matrix product against a weight of a quantized (or half-precision) type first
quantizes the activation rows to that type's dot-product type (`ACT_TYPE`: Q8_0, Q8_1, Q8_K, F16
or BF16; written from ggml's published block formats, see `quantize_activations`); the product
itself is then taken in float64 between the dequantized weight and the dequantized activations.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, quants

NEOX_ARCHS = ("qwen2", "qwen3", "qwen2moe", "qwen3moe", "glm4moe")  # rotate (x[i], x[i + n_rot/2]); llama rotates (x[2i], x[2i+1])


# the type ggml quantizes activation rows to for the dot product against each weight type
ACT_TYPE = {QT.Q4_0: "q8_0", QT.Q5_0: "q8_0", QT.Q8_0: "q8_0", QT.Q4_1: "q8_1", QT.Q5_1: "q8_1",
            QT.Q2_K: "q8_k", QT.Q3_K: "q8_k", QT.Q4_K: "q8_k", QT.Q5_K: "q8_k", QT.Q6_K: "q8_k",
            QT.IQ4_NL: "q8_0", QT.MXFP4: "q8_0", QT.IQ4_XS: "q8_k", QT.TQ1_0: "q8_k", QT.TQ2_0: "q8_k",
            QT.F16: "f16", QT.BF16: "bf16", QT.F32: "f32"}


def quantize_activations(x: np.ndarray, act: str) -> np.ndarray:
    """Rows of `x` as ggml hands them to the dot product for activation type `act`, dequantized
    back to float64. Activations are float32 in ggml; the block scales are those ggml stores.

    q8_0 / q8_1 (blocks of 32): d = max|x| / 127, q = nearest-even(x * (127 / max|x|)), d stored as F16
    (x86 ggml's quantize_row_q8_0 / q8_1).
    q8_k (blocks of 256): m = the element of largest magnitude, q = nearest-even(-127 / m * x)
    capped at 127, d = 1 / (-127 / m) kept in float32.
    f16 / bf16: the values rounded to that type (bf16: nearest even)."""
    x32 = np.asarray(x, dtype=np.float32)
    if act == "f32":
        return x32.astype(np.float64)
    if act == "f16":
        return x32.astype(np.float16).astype(np.float64)
    if act == "bf16":
        bits = x32.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    n, k = x32.shape
    if act in ("q8_0", "q8_1"):
        b = x32.reshape(n, k // 32, 32)
        amax = np.max(np.abs(b), axis=-1, keepdims=True)
        d = amax / np.float32(127)
        with np.errstate(divide="ignore"):
            inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        q = np.rint((b * inv).astype(np.float32))
        d16 = d.astype(np.float16).astype(np.float64)
        return (q.astype(np.float64) * d16).reshape(n, k)
    if act == "q8_k":
        b = x32.reshape(n, k // 256, 256)
        idx = np.argmax(np.abs(b), axis=-1)[..., None]
        m = np.take_along_axis(b, idx, axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            iscale = np.where(m != 0, np.float32(-127) / m, np.float32(0)).astype(np.float32)
            d = np.where(m != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
        q = np.minimum(np.rint(iscale * b), 127)  # rint: nearest even, as ggml's nearest_int
        return (q.astype(np.float64) * d.astype(np.float64)).reshape(n, k)
    raise ValueError(f"unknown activation type {act}")


class Weight(np.ndarray):
    """A dequantized weight (float64) that remembers its file type."""

    qtype: QT


def _weight(values: np.ndarray, qtype: QT) -> np.ndarray:
    w = np.asarray(values, dtype=np.float64).view(Weight)
    w.qtype = qtype
    return w


def matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T with x's rows quantized as ggml does for w's type."""
    act = ACT_TYPE[getattr(w, "qtype", QT.F32)]
    return quantize_activations(x, act) @ np.asarray(w).T


def load_model(path: str, lora: tuple = ()) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata as Python values, weights as float64 arrays in numpy row-major shape; 2-D ones
    carry their file type as `.qtype`). lora: (adapter file, scale) pairs merged into the weights,
    W + scale * alpha / r * lora_b @ lora_a (the product llama.cpp adds, by its definition)."""
    reader = GGUFReader(path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    weights = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # t.shape is ggml's ne order
        values = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(shape)
        weights[t.name] = _weight(values, QT(t.tensor_type)) if len(shape) >= 2 else values
    for adapter, scale in lora:
        ameta, aw = load_model(adapter)
        alpha = float(ameta.get("adapter.lora.alpha", 0.0))
        for name in [n[:-7] for n in aw if n.endswith(".lora_a")]:
            a, b = np.asarray(aw[name + ".lora_a"]), np.asarray(aw[name + ".lora_b"])
            factor = alpha / a.shape[0] if alpha else 1.0
            w = weights[name]
            weights[name] = _weight(np.asarray(w) + scale * factor * (b @ a), w.qtype)
    return meta, weights


def rmsnorm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x: np.ndarray, base: float, n_rot: int, neox: bool, inv_freq: np.ndarray | None = None,
         mscale: float = 1.0, positions: np.ndarray | None = None) -> np.ndarray:
    """x: [n_tokens, n_heads, head_dim] at `positions` (default 0..n_tokens-1); the first n_rot dims
    rotate. inv_freq: each pair's angle per position (default base^(-2i / n_rot)); mscale scales
    cos and sin (YaRN's attention factor)."""
    pos = (np.arange(x.shape[0]) if positions is None else positions).astype(np.float64)[:, None, None]
    if inv_freq is None:
        inv_freq = base ** (-2.0 * np.arange(n_rot // 2) / n_rot)
    theta = pos * inv_freq  # [n_tokens, 1, n_rot/2]
    cos, sin = np.cos(theta) * mscale, np.sin(theta) * mscale
    out = x.copy()
    if neox:
        a, b = x[..., : n_rot // 2], x[..., n_rot // 2: n_rot]
        out[..., : n_rot // 2] = a * cos - b * sin
        out[..., n_rot // 2: n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


# Whether the chosen experts' routing weights are renormalized to sum 1 when the file does not say
# (`{arch}.expert_weights_norm`): Qwen2MoE's norm_topk_prob is false by default, the Qwen3-MoE
# models set it, and Mixtral always renormalizes.
MOE_NORM_DEFAULT = {"qwen2moe": False, "qwen3moe": True, "llama": True, "glm4moe": False, "deepseek2": False}


def _expert(x: np.ndarray, w: np.ndarray, e: int) -> np.ndarray:
    """Expert e of a 3-D expert tensor [n_expert, rows, cols], as a weight of the tensor's type."""
    return _weight(np.asarray(w)[e], w.qtype)


def moe_ffn(h: np.ndarray, W: dict, p: str, meta: dict, arch: str) -> np.ndarray:
    """The sparse MoE block of the published models (transformers' Qwen2MoeSparseMoeBlock,
    Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock): router logits, softmax over all experts, the
    top-k probabilities (renormalized when the model says so), the weighted sum of those experts'
    SwiGLU FFNs, plus (Qwen2-MoE) the shared expert times sigmoid(its gate). Each token is taken on
    its own, expert by expert: nothing here groups tokens.

    GLM-4.5 (transformers' Glm4MoeMoE): sigmoid scores, the experts chosen by score + the
    correction bias (exp_probs_b) but weighted by the score alone, normalized when the model says
    so, times routed_scaling_factor (expert_weights_scale); its shared expert is not gated."""
    k = meta[f"{arch}.expert_used_count"]
    if arch in ("glm4moe", "deepseek2"):
        return _glm4moe_ffn(h, W, p, meta, k, arch)
    norm = meta.get(f"{arch}.expert_weights_norm", MOE_NORM_DEFAULT[arch])
    scale = float(meta.get(f"{arch}.expert_weights_scale", 1.0))
    probs = matmul(h, W[p + "ffn_gate_inp.weight"])
    probs = np.exp(probs - probs.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    out = _routed(h, W, p, probs, probs, k, norm, scale)
    if p + "ffn_gate_inp_shexp.weight" in W:
        shared = matmul(silu(matmul(h, W[p + "ffn_gate_shexp.weight"])) * matmul(h, W[p + "ffn_up_shexp.weight"]),
                        W[p + "ffn_down_shexp.weight"])
        gate = 1.0 / (1.0 + np.exp(-(h @ W[p + "ffn_gate_inp_shexp.weight"])))
        out += gate[:, None] * shared
    return out


def _routed(h: np.ndarray, W: dict, p: str, choice: np.ndarray, weigh: np.ndarray, k: int, norm: bool,
            scale: float) -> np.ndarray:
    """Each token's k experts by `choice` (ties: the lower id), weighted by `weigh` (divided by
    their sum when norm) times scale, their SwiGLU FFNs summed."""
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        chosen = sorted(range(choice.shape[1]), key=lambda e: (-choice[t, e], e))[:k]
        weights = weigh[t, chosen]
        if norm:
            weights = weights / weights.sum()
        for e, wt in zip(chosen, weights * scale):
            g = matmul(h[t:t + 1], _expert(h, W[p + "ffn_gate_exps.weight"], e))
            u = matmul(h[t:t + 1], _expert(h, W[p + "ffn_up_exps.weight"], e))
            out[t] += wt * matmul(silu(g) * u, _expert(h, W[p + "ffn_down_exps.weight"], e))[0]
    return out


def _glm4moe_ffn(h: np.ndarray, W: dict, p: str, meta: dict, k: int, arch: str = "glm4moe") -> np.ndarray:
    """GLM-4.5's and DeepSeek V3's MoE (transformers' Glm4MoeMoE / DeepseekV3MoE): sigmoid scores,
    the choice by score + e_score_correction_bias, DeepSeek's within the topk_group groups whose
    two best (biased) scores sum highest, weights the plain scores."""
    norm = bool(meta.get(f"{arch}.expert_weights_norm", MOE_NORM_DEFAULT[arch]))
    scale = float(meta.get(f"{arch}.expert_weights_scale", 1.0))
    logits = matmul(h, W[p + "ffn_gate_inp.weight"])
    if int(meta.get(f"{arch}.expert_gating_func", 2)) == 2:
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        scores = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores /= scores.sum(axis=1, keepdims=True)
    choice = scores + np.asarray(W.get(p + "exp_probs_b.bias", 0.0), dtype=np.float64)
    groups = int(meta.get(f"{arch}.expert_group_count", 1) or 1)
    if groups > 1:
        used = int(meta[f"{arch}.expert_group_used_count"])
        g = choice.reshape(choice.shape[0], groups, -1)
        top2 = np.sort(g, axis=2)[:, :, -2:].sum(axis=2)
        for t in range(choice.shape[0]):
            keep = sorted(range(groups), key=lambda j: (-top2[t, j], j))[:used]
            for j in range(groups):
                if j not in keep:
                    g[t, j] = -np.inf
        choice = g.reshape(choice.shape)
    out = _routed(h, W, p, choice, scores, k, norm, scale)
    if p + "ffn_gate_shexp.weight" in W:
        out += matmul(silu(matmul(h, W[p + "ffn_gate_shexp.weight"])) * matmul(h, W[p + "ffn_up_shexp.weight"]),
                      W[p + "ffn_down_shexp.weight"])
    return out


def rope_frequencies(meta: dict, W: dict, arch: str, n_rot: int, base: float,
                     n_ctx_seq: int = 0) -> tuple[np.ndarray, float]:
    """(inv_freq [n_rot / 2], cos/sin scale) of the file's RoPE scaling, after transformers'
    modeling_rope_utils as llama.cpp reads it from GGUF:

    - linear (the default type when a factor is given): positions divided by the factor;
    - llama3: the converter stores the per-pair divisors as rope_freqs.weight;
    - yarn: pairs below the low correction dimension keep their frequency (extrapolation), those
      above the high one are divided by the factor (interpolation), linearly mixed between;
      cos and sin get the attention factor 0.1 ln(factor) + 1 (times rope.scaling.attn_factor);
    - phi3's LongRoPE (transformers' _compute_longrope_parameters): the long factors where the
      context (`n_ctx_seq`) is beyond original_context_length, else the short ones, divide the
      frequencies, and cos and sin get rope.scaling.attn_factor."""
    inv_freq = 1.0 / base ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if "rope_freqs.weight" in W:
        inv_freq = inv_freq / np.asarray(W["rope_freqs.weight"], dtype=np.float64)
    elif "rope_factors_long.weight" in W:
        orig = meta.get(f"{arch}.rope.scaling.original_context_length", meta.get(f"{arch}.context_length"))
        which = "long" if n_ctx_seq > orig else "short"
        inv_freq = inv_freq / np.asarray(W[f"rope_factors_{which}.weight"], dtype=np.float64)
        return inv_freq, float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0))
    kind = meta.get(f"{arch}.rope.scaling.type", "linear")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 0.0)) or 1.0
    if kind == "none" or factor == 1.0:
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / factor, 1.0
    assert kind == "yarn", kind
    orig = meta.get(f"{arch}.rope.scaling.original_context_length", meta.get(f"{arch}.context_length"))
    beta_fast = float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0))
    beta_slow = float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0))

    def correction_dim(n_rotations: float) -> float:  # transformers' find_correction_dim
        return (n_rot * np.log(orig / (n_rotations * 2 * np.pi))) / (2 * np.log(base))

    low = max(np.floor(correction_dim(beta_fast)), 0)
    high = min(np.ceil(correction_dim(beta_slow)), n_rot - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(n_rot // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    attn = float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0))
    return inv_freq, attn * (0.1 * np.log(factor) + 1.0)


DENSE_FAMILIES = ("gemma2", "gemma3", "phi3", "glm4")


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def gemma_rmsnorm(x: np.ndarray, w_gguf: np.ndarray, eps: float) -> np.ndarray:
    """transformers' GemmaRMSNorm, x / rms(x) * (1 + w): llama.cpp's converter stores 1 + w."""
    w = np.asarray(w_gguf) - 1.0
    return rmsnorm(x, eps) * (1.0 + w)


def _shape(meta: dict) -> tuple:
    """(arch, n_layer, n_head, n_head_kv, rms eps, rope base, n_embd, head_dim, n_rot) as the GGUF
    metadata gives them, with llama.cpp's defaults."""
    arch = meta["general.architecture"]
    n_head = meta[f"{arch}.attention.head_count"]
    e = meta[f"{arch}.embedding_length"]
    hd = meta.get(f"{arch}.attention.key_length", e // n_head)
    return (arch, meta[f"{arch}.block_count"], n_head, meta[f"{arch}.attention.head_count_kv"],
            float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]), float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            e, hd, meta.get(f"{arch}.rope.dimension_count", hd))


def _dense_family_hidden(model_path: str, tokens: list[int], n_ctx_seq: int = 0,
                         lora: tuple = ()) -> tuple[np.ndarray, dict, dict]:
    """Gemma2 / Gemma3 / Phi3 / GLM-4 as transformers' modeling_gemma2, modeling_gemma3 (text
    model), modeling_phi3 and modeling_glm4 define them, with the hyper-parameters llama.cpp
    derives from GGUF metadata (GLM-4: post-norms as gemma's but plain RMS norms, interleaved
    RoPE on the first rope.dimension_count dimensions, gate|up fused as phi3's)."""
    meta, W = load_model(model_path, lora)
    arch, n_layer, n_head, n_kv, eps, base, e, hd, n_rot = _shape(meta)
    gemma = arch in ("gemma2", "gemma3")
    post_norms = gemma or arch == "glm4"
    n = len(tokens)
    n_layer -= int(meta.get(f"{arch}.nextn_predict_layers", 0))
    norm = (lambda x, w: gemma_rmsnorm(x, w, eps)) if gemma else (lambda x, w: rmsnorm(x, eps) * w)

    # query_pre_attn_scalar: n_embd / n_head for the 27B models, else head_dim (gemma_pytorch)
    big = n_layer == {"gemma2": 46, "gemma3": 62}.get(arch)
    scaling = (e // n_head if big else hd) ** -0.5
    window = meta.get(f"{arch}.attention.sliding_window", 0) if gemma else 0
    if arch == "gemma2":
        sliding = [i % 2 == 0 for i in range(n_layer)]
        attn_cap = float(meta.get("gemma2.attn_logit_softcapping", 50.0))
    elif arch == "gemma3":
        sliding = [(i + 1) % 6 != 0 and window > 0 for i in range(n_layer)]
        attn_cap = 0.0
    else:
        sliding, attn_cap = [False] * n_layer, 0.0

    x = np.asarray(W["token_embd.weight"])[np.asarray(tokens)]
    if gemma:
        x = x * np.sqrt(e)  # the embedding normalizer
    qpos, kpos = np.arange(n)[:, None], np.arange(n)[None, :]
    for i in range(n_layer):
        p = f"blk.{i}."
        masked = kpos > qpos
        if sliding[i]:
            masked = masked | (qpos - kpos >= window)
        h = norm(x, W[p + "attn_norm.weight"])
        if p + "attn_qkv.weight" in W:
            qkv = matmul(h, W[p + "attn_qkv.weight"]) + W.get(p + "attn_qkv.bias", 0.0)
            q, k, v = np.split(qkv, [n_head * hd, (n_head + n_kv) * hd], axis=1)
        else:
            q, k, v = (matmul(h, W[p + f"attn_{c}.weight"]) + W.get(p + f"attn_{c}.bias", 0.0) for c in "qkv")
        q, k, v = q.reshape(n, n_head, hd), k.reshape(n, n_kv, hd), v.reshape(n, n_kv, hd)
        if arch == "gemma3":
            q, k = norm(q, W[p + "attn_q_norm.weight"]), norm(k, W[p + "attn_k_norm.weight"])
        if arch == "gemma3" and sliding[i]:  # local layers: rope_local_base_freq, no scaling
            inv_freq, mscale = 1.0 / 10000.0 ** (np.arange(0, n_rot, 2) / n_rot), 1.0
        else:
            inv_freq, mscale = rope_frequencies(meta, W, arch, n_rot, base, n_ctx_seq)
        neox = arch != "glm4"
        q, k = rope(q, base, n_rot, neox, inv_freq, mscale), rope(k, base, n_rot, neox, inv_freq, mscale)
        att = np.empty((n, n_head, hd))
        for hq in range(n_head):
            hk = hq // (n_head // n_kv)
            scores = q[:, hq] @ k[:, hk].T * scaling
            if attn_cap:
                scores = np.tanh(scores / attn_cap) * attn_cap
            scores[masked] = -np.inf
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            att[:, hq] = probs @ v[:, hk]
        o = matmul(att.reshape(n, n_head * hd), W[p + "attn_output.weight"])
        if post_norms:
            o = norm(o, W[p + "post_attention_norm.weight"])
        x = x + o
        h = norm(x, W[p + "ffn_norm.weight"])
        if arch in ("phi3", "glm4"):
            gate, up = np.split(matmul(h, W[p + "ffn_up.weight"]), 2, axis=1)
            f = matmul(up * silu(gate), W[p + "ffn_down.weight"])
            if post_norms:
                f = norm(f, W[p + "post_ffw_norm.weight"])
        else:
            f = matmul(gelu_tanh(matmul(h, W[p + "ffn_gate.weight"])) * matmul(h, W[p + "ffn_up.weight"]),
                       W[p + "ffn_down.weight"])
            f = norm(f, W[p + "post_ffw_norm.weight"])
        x = x + f
    return norm(x, W["output_norm.weight"]), W, meta


def reference_logits(model_path: str, tokens: list[int], n_ctx_seq: int = 0, lora: tuple = ()) -> np.ndarray:
    """Logits [len(tokens), n_vocab] (float64) of one sequence at positions 0..n-1 (n_ctx_seq: the
    context's positions per sequence, which pick phi3's LongRoPE factors); output.bias added where
    the file has one. lora: (adapter file, scale) pairs merged into the weights (load_model)."""
    if GGUFReader(model_path).fields["general.architecture"].contents() in DENSE_FAMILIES:
        h, W, meta = _dense_family_hidden(model_path, tokens, n_ctx_seq, lora)
        logits = matmul(h, W.get("output.weight", W["token_embd.weight"]))
        cap = float(meta.get(f"{meta['general.architecture']}.final_logit_softcapping", 0.0))
        logits = np.tanh(logits / cap) * cap if cap else logits
    else:
        h, W = _final_hidden(model_path, tokens, lora)
        logits = matmul(h, W.get("output.weight", W["token_embd.weight"]))
    return logits + np.asarray(W["output.bias"], dtype=np.float64) if "output.bias" in W else logits


def _deepseek2_hidden(meta: dict, W: dict, tokens: list[int], n_layer: int, eps: float) -> tuple[np.ndarray, dict]:
    """DeepSeek V2/V3 as transformers' DeepseekV3Attention computes it, without absorbing anything:
    per head, keys [k_b^T c, k_pe] and values v_b c from each token's latent c (RMS-normed), the
    query [q_nope, q_pe] from the low-rank query path, RoPE on the rope parts (adjacent pairs, as
    llama.cpp's converter lays them out), scores over sqrt(nope + rope); then the MoE FFN."""
    n, H = len(tokens), meta["deepseek2.attention.head_count"]
    lora = meta["deepseek2.attention.kv_lora_rank"]
    rope_d = meta["deepseek2.rope.dimension_count"]
    nope = meta["deepseek2.attention.key_length_mla"] - rope_d
    base = float(meta.get("deepseek2.rope.freq_base", 10000.0))
    x = np.asarray(W["token_embd.weight"])[np.asarray(tokens)]
    causal = np.triu(np.ones((n, n), dtype=bool), k=1)
    for i in range(n_layer):
        p = f"blk.{i}."
        h = rmsnorm(x, eps) * W[p + "attn_norm.weight"]
        if p + "attn_q_a.weight" in W:
            q = matmul(rmsnorm(matmul(h, W[p + "attn_q_a.weight"]), eps) * W[p + "attn_q_a_norm.weight"],
                       W[p + "attn_q_b.weight"])
        else:
            q = matmul(h, W[p + "attn_q.weight"])
        q = q.reshape(n, H, nope + rope_d)
        kv = matmul(h, W[p + "attn_kv_a_mqa.weight"])
        c = rmsnorm(kv[:, :lora], eps) * W[p + "attn_kv_a_norm.weight"]          # [n, lora]
        k_pe = rope(kv[:, None, lora:], base, rope_d, False)[:, 0]                  # [n, rope]
        q_pe = rope(q[:, :, nope:], base, rope_d, False)
        k_b, v_b = np.asarray(W[p + "attn_k_b.weight"]), np.asarray(W[p + "attn_v_b.weight"])
        att = []
        for hq in range(H):
            keys = np.concatenate([c @ k_b[hq], k_pe], axis=1)                      # [n, nope + rope]
            query = np.concatenate([q[:, hq, :nope], q_pe[:, hq]], axis=1)
            scores = query @ keys.T / np.sqrt(nope + rope_d)
            scores[causal] = -np.inf
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            att.append(probs @ (c @ v_b[hq].T))                                       # [n, v]
        x = x + matmul(np.concatenate(att, axis=1), W[p + "attn_output.weight"])
        h = rmsnorm(x, eps) * W[p + "ffn_norm.weight"]
        if p + "ffn_gate_inp.weight" in W:
            x = x + moe_ffn(h, W, p, meta, "deepseek2")
        else:
            x = x + matmul(silu(matmul(h, W[p + "ffn_gate.weight"])) * matmul(h, W[p + "ffn_up.weight"]),
                           W[p + "ffn_down.weight"])
    return rmsnorm(x, eps) * W["output_norm.weight"], W


def _gpt_oss_hidden(meta: dict, W: dict, tokens: list[int], n_layer: int, eps: float) -> tuple[np.ndarray, dict]:
    """gpt-oss as transformers' modeling_gpt_oss computes it: q/k/v and output biases, NeoX RoPE,
    a learned sink logit per head in each softmax's denominator, even layers in a sliding window,
    then the MoE: router logits plus bias, the top k by logit weighted by their softmax, each
    expert's biased gate and up through the clamped SwiGLU (alpha 1.702, limit 7), its biased down."""
    n = len(tokens)
    H, Hkv = meta["gpt-oss.attention.head_count"], meta["gpt-oss.attention.head_count_kv"]
    hd = meta["gpt-oss.attention.key_length"]
    base = float(meta["gpt-oss.rope.freq_base"])
    window = meta["gpt-oss.attention.sliding_window"]
    k_used = meta["gpt-oss.expert_used_count"]
    x = np.asarray(W["token_embd.weight"])[np.asarray(tokens)]
    qpos, kpos = np.arange(n)[:, None], np.arange(n)[None, :]
    for i in range(n_layer):
        p = f"blk.{i}."
        h = rmsnorm(x, eps) * W[p + "attn_norm.weight"]
        q, k, v = (matmul(h, W[p + f"attn_{c}.weight"]) + W[p + f"attn_{c}.bias"] for c in "qkv")
        q, k, v = q.reshape(n, H, hd), k.reshape(n, Hkv, hd), v.reshape(n, Hkv, hd)
        q, k = rope(q, base, hd, True), rope(k, base, hd, True)
        masked = kpos > qpos
        if i % 2 == 0:
            masked = masked | (qpos - kpos >= window)
        sinks = np.asarray(W[p + "attn_sinks.weight"], dtype=np.float64)
        att = np.empty((n, H, hd))
        for hq in range(H):
            hk = hq // (H // Hkv)
            scores = q[:, hq] @ k[:, hk].T / np.sqrt(hd)
            scores[masked] = -np.inf
            m = np.maximum(scores.max(axis=1, keepdims=True), sinks[hq])
            e = np.exp(scores - m)
            att[:, hq] = (e / (e.sum(axis=1, keepdims=True) + np.exp(sinks[hq] - m))) @ v[:, hk]
        x = x + matmul(att.reshape(n, H * hd), W[p + "attn_output.weight"]) + W[p + "attn_output.bias"]
        h = rmsnorm(x, eps) * W[p + "post_attention_norm.weight"]
        logits = matmul(h, W[p + "ffn_gate_inp.weight"]) + W[p + "ffn_gate_inp.bias"]
        out = np.zeros_like(h)
        for t in range(n):
            chosen = sorted(range(logits.shape[1]), key=lambda e_: (-logits[t, e_], e_))[:k_used]
            wts = np.exp(logits[t, chosen] - logits[t, chosen].max())
            wts /= wts.sum()
            for ex, wt in zip(chosen, wts):
                g = matmul(h[t:t + 1], _expert(h, W[p + "ffn_gate_exps.weight"], ex)) + W[p + "ffn_gate_exps.bias"][ex]
                u = matmul(h[t:t + 1], _expert(h, W[p + "ffn_up_exps.weight"], ex)) + W[p + "ffn_up_exps.bias"][ex]
                g = np.minimum(g, 7.0)
                act = g / (1.0 + np.exp(-1.702 * g)) * (np.clip(u, -7.0, 7.0) + 1.0)
                out[t] += wt * (matmul(act, _expert(h, W[p + "ffn_down_exps.weight"], ex))[0]
                                + W[p + "ffn_down_exps.bias"][ex])
        x = x + out
    return rmsnorm(x, eps) * W["output_norm.weight"], W


def reference_hidden(model_path: str, tokens: list[int]) -> np.ndarray:
    """The final hidden states after the output norm [len(tokens), n_embd] (float64): llama.cpp's
    `result_norm`, what it returns as embeddings (an encoder's: its last layer's output)."""
    meta, _ = load_model(model_path)
    if meta["general.architecture"] in ("bert", "nomic-bert", "jina-bert-v2"):
        return bert_hidden(model_path, tokens)
    return _final_hidden(model_path, tokens)[0]


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def bert_hidden(model_path: str, tokens: list[int]) -> np.ndarray:
    """BERT as transformers' modeling_bert defines it (post-LayerNorm layers, every token of the
    sequence seen by every other, learned absolute positions, token type 0, GELU in its tanh form
    as llama.cpp computes it), one sequence: the last layer's output [len(tokens), n_embd].
    nomic-bert (nomic-embed-text's NomicBertModel): the same layer with NeoX RoPE instead of
    learned positions, q|k|v in one matrix and a SwiGLU FFN without biases. jina-bert-v2
    (JinaBertModel): ALiBi (Press et al.: head h's scores minus slope_h |i - j|, the slopes of
    max bias 8) instead of positions, and GeGLU over gate|up in ffn_up. Keys and values are
    rounded to F16 as llama.cpp's flash attention rounds them."""
    meta, W = load_model(model_path)
    arch = meta["general.architecture"]
    n_layer, n_head = meta[f"{arch}.block_count"], meta[f"{arch}.attention.head_count"]
    e = meta[f"{arch}.embedding_length"]
    hd, eps, n = e // n_head, float(meta[f"{arch}.attention.layer_norm_epsilon"]), len(tokens)
    x = np.asarray(W["token_embd.weight"])[np.asarray(tokens)]
    if arch == "bert":
        x = x + np.asarray(W["position_embd.weight"])[:n]
    if "token_types.weight" in W:
        x = x + np.asarray(W["token_types.weight"])[0]
    x = layer_norm(x, W["token_embd_norm.weight"], W["token_embd_norm.bias"], eps)
    for i in range(n_layer):
        p = f"blk.{i}."
        if p + "attn_qkv.weight" in W:
            qkv = matmul(x, W[p + "attn_qkv.weight"]) + W.get(p + "attn_qkv.bias", 0.0)
            q, k, v = qkv[:, :e], qkv[:, e:2 * e], qkv[:, 2 * e:]
        else:
            q = matmul(x, W[p + "attn_q.weight"]) + W.get(p + "attn_q.bias", 0.0)
            k = matmul(x, W[p + "attn_k.weight"]) + W.get(p + "attn_k.bias", 0.0)
            v = matmul(x, W[p + "attn_v.weight"]) + W.get(p + "attn_v.bias", 0.0)
        q, k, v = q.reshape(n, n_head, hd), k.reshape(n, n_head, hd), v.reshape(n, n_head, hd)
        if arch == "nomic-bert":
            base, n_rot = float(meta[f"{arch}.rope.freq_base"]), meta.get(f"{arch}.rope.dimension_count", hd)
            q, k = rope(q, base, n_rot, True), rope(k, base, n_rot, True)
        # K and V rounded to F16 (from float32), as llama.cpp's flash attention casts an encoder's
        k, v = (t.astype(np.float32).astype(np.float16).astype(np.float64) for t in (k, v))
        att = np.empty((n, n_head, hd))
        dist = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
        for h in range(n_head):
            scores = q[:, h] @ k[:, h].T / np.sqrt(hd)
            if arch == "jina-bert-v2":
                scores = scores - alibi_slope(h, n_head, 8.0) * dist
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            att[:, h] = (probs / probs.sum(axis=1, keepdims=True)) @ v[:, h]
        o = matmul(att.reshape(n, e), W[p + "attn_output.weight"]) + W.get(p + "attn_output.bias", 0.0)
        x = layer_norm(x + o, W[p + "attn_output_norm.weight"], W[p + "attn_output_norm.bias"], eps)
        if arch == "nomic-bert":
            u = silu(matmul(x, W[p + "ffn_gate.weight"])) * matmul(x, W[p + "ffn_up.weight"])
            d = matmul(u, W[p + "ffn_down.weight"])
        elif arch == "jina-bert-v2":
            gu = matmul(x, W[p + "ffn_up.weight"]) + W.get(p + "ffn_up.bias", 0.0)
            f = gu.shape[1] // 2
            d = matmul(gelu_tanh(gu[:, :f]) * gu[:, f:], W[p + "ffn_down.weight"]) + W[p + "ffn_down.bias"]
        else:
            u = gelu_tanh(matmul(x, W[p + "ffn_up.weight"]) + W.get(p + "ffn_up.bias", 0.0))
            d = matmul(u, W[p + "ffn_down.weight"]) + W.get(p + "ffn_down.bias", 0.0)
        x = layer_norm(x + d, W[p + "layer_output_norm.weight"], W[p + "layer_output_norm.bias"], eps)
    return x


def alibi_slope(h: int, n_head: int, max_bias: float) -> float:
    """ALiBi's slope of head h: the geometric sequence of the paper, extended past the largest
    power of two of heads by the odd powers of the half-bias ratio (as ggml computes it)."""
    n_log2 = 2 ** int(np.floor(np.log2(n_head)))
    if h < n_log2:
        return (2.0 ** (-max_bias / n_log2)) ** (h + 1)
    return (2.0 ** (-max_bias / 2.0 / n_log2)) ** (2 * (h - n_log2) + 1)


def bert_rank_score(model_path: str, tokens: list[int]) -> np.ndarray:
    """A BERT reranker's scores for one sequence: the first token's hidden state through the
    classification head (tanh(cls x + b), then cls.output)."""
    meta, W = load_model(model_path)
    h = bert_hidden(model_path, tokens)[0]
    if "cls.weight" in W:
        h = np.tanh(np.asarray(W["cls.weight"]) @ h + W["cls.bias"])
    if "cls.output.weight" in W:
        h = np.asarray(W["cls.output.weight"]) @ h + W["cls.output.bias"]
    return h


def _final_hidden(model_path: str, tokens: list[int], lora: tuple = ()) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    meta, W = load_model(model_path, lora)
    arch, n_layer, n_head, n_kv, eps, base, n_embd, hd, n_rot = _shape(meta)
    neox = arch in NEOX_ARCHS
    n = len(tokens)
    n_layer -= int(meta.get(f"{arch}.nextn_predict_layers", 0))  # GLM's multi-token prediction layers
    ffn_norm = "post_attention_norm.weight" if arch == "glm4moe" else "ffn_norm.weight"
    if arch == "deepseek2":
        return _deepseek2_hidden(meta, W, tokens, n_layer, eps)
    if arch == "gpt-oss":
        return _gpt_oss_hidden(meta, W, tokens, n_layer, eps)

    x = np.asarray(W["token_embd.weight"])[np.asarray(tokens)]  # [n, n_embd]
    causal = np.triu(np.ones((n, n), dtype=bool), k=1)  # True above the diagonal = masked
    for i in range(n_layer):
        p = f"blk.{i}."
        h = rmsnorm(x, eps) * W[p + "attn_norm.weight"]
        q = matmul(h, W[p + "attn_q.weight"])
        k = matmul(h, W[p + "attn_k.weight"])
        v = matmul(h, W[p + "attn_v.weight"])
        if p + "attn_q.bias" in W:
            q, k, v = q + W[p + "attn_q.bias"], k + W[p + "attn_k.bias"], v + W[p + "attn_v.bias"]
        q, k, v = q.reshape(n, n_head, hd), k.reshape(n, n_kv, hd), v.reshape(n, n_kv, hd)
        if p + "attn_q_norm.weight" in W:
            q = rmsnorm(q, eps) * W[p + "attn_q_norm.weight"]
            k = rmsnorm(k, eps) * W[p + "attn_k_norm.weight"]
        inv_freq, mscale = rope_frequencies(meta, W, arch, n_rot, base)
        q, k = rope(q, base, n_rot, neox, inv_freq, mscale), rope(k, base, n_rot, neox, inv_freq, mscale)
        att = np.empty((n, n_head, hd))
        for hq in range(n_head):
            hk = hq // (n_head // n_kv)
            scores = q[:, hq] @ k[:, hk].T / np.sqrt(hd)
            scores[causal] = -np.inf
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            att[:, hq] = probs @ v[:, hk]
        x = x + matmul(att.reshape(n, n_head * hd), W[p + "attn_output.weight"])
        h = rmsnorm(x, eps) * W[p + ffn_norm]
        if p + "ffn_gate_inp.weight" in W:
            x = x + moe_ffn(h, W, p, meta, arch)
        else:
            x = x + matmul(silu(matmul(h, W[p + "ffn_gate.weight"])) * matmul(h, W[p + "ffn_up.weight"]),
                       W[p + "ffn_down.weight"])
    return rmsnorm(x, eps) * W["output_norm.weight"], W
