"""An independent float64 reference forward pass of the llama family (llama, qwen2, qwen3).

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

NEOX_ARCHS = ("qwen2", "qwen3")  # rotate (x[i], x[i + n_rot/2]); llama rotates (x[2i], x[2i+1])


# the type ggml quantizes activation rows to for the dot product against each weight type
ACT_TYPE = {QT.Q4_0: "q8_0", QT.Q5_0: "q8_0", QT.Q8_0: "q8_0", QT.Q4_1: "q8_1", QT.Q5_1: "q8_1",
            QT.Q2_K: "q8_k", QT.Q3_K: "q8_k", QT.Q4_K: "q8_k", QT.Q5_K: "q8_k", QT.Q6_K: "q8_k",
            QT.F16: "f16", QT.BF16: "bf16", QT.F32: "f32"}


def _round_away(v: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero."""
    return np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))


def quantize_activations(x: np.ndarray, act: str) -> np.ndarray:
    """Rows of `x` as ggml hands them to the dot product for activation type `act`, dequantized
    back to float64. Activations are float32 in ggml; the block scales are those ggml stores.

    q8_0 / q8_1 (blocks of 32): d = max|x| / 127, q = roundf(x / d), d stored as F16.
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
            inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        q = _round_away(b * inv)
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


def load_model(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata as Python values, weights as float64 arrays in numpy row-major shape; 2-D ones
    carry their file type as `.qtype`)."""
    reader = GGUFReader(path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    weights = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # t.shape is ggml's ne order
        values = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(shape)
        weights[t.name] = _weight(values, QT(t.tensor_type)) if len(shape) == 2 else values
    return meta, weights


def rmsnorm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x: np.ndarray, base: float, n_rot: int, neox: bool) -> np.ndarray:
    """x: [n_tokens, n_heads, head_dim] at positions 0..n_tokens-1; the first n_rot dims rotate."""
    pos = np.arange(x.shape[0], dtype=np.float64)[:, None, None]
    theta = pos * base ** (-2.0 * np.arange(n_rot // 2) / n_rot)  # [n_tokens, 1, n_rot/2]
    cos, sin = np.cos(theta), np.sin(theta)
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


def reference_logits(model_path: str, tokens: list[int]) -> np.ndarray:
    """Logits [len(tokens), n_vocab] (float64) of one sequence at positions 0..n-1."""
    h, W = _final_hidden(model_path, tokens)
    return matmul(h, W.get("output.weight", W["token_embd.weight"]))


def reference_hidden(model_path: str, tokens: list[int]) -> np.ndarray:
    """The final hidden states after the output norm [len(tokens), n_embd] (float64): llama.cpp's
    `result_norm`, what it returns as embeddings."""
    return _final_hidden(model_path, tokens)[0]


def _final_hidden(model_path: str, tokens: list[int]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    meta, W = load_model(model_path)
    arch = meta["general.architecture"]
    n_layer = meta[f"{arch}.block_count"]
    n_head = meta[f"{arch}.attention.head_count"]
    n_kv = meta[f"{arch}.attention.head_count_kv"]
    eps = float(meta[f"{arch}.attention.layer_norm_rms_epsilon"])
    base = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    n_embd = meta[f"{arch}.embedding_length"]
    hd = meta.get(f"{arch}.attention.key_length", n_embd // n_head)
    n_rot = meta.get(f"{arch}.rope.dimension_count", hd)
    neox = arch in NEOX_ARCHS
    n = len(tokens)

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
        q, k = rope(q, base, n_rot, neox), rope(k, base, n_rot, neox)
        att = np.empty((n, n_head, hd))
        for hq in range(n_head):
            hk = hq // (n_head // n_kv)
            scores = q[:, hq] @ k[:, hk].T / np.sqrt(hd)
            scores[causal] = -np.inf
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            att[:, hq] = probs @ v[:, hk]
        x = x + matmul(att.reshape(n, n_head * hd), W[p + "attn_output.weight"])
        h = rmsnorm(x, eps) * W[p + "ffn_norm.weight"]
        x = x + matmul(silu(matmul(h, W[p + "ffn_gate.weight"])) * matmul(h, W[p + "ffn_up.weight"]),
                   W[p + "ffn_down.weight"])
    return rmsnorm(x, eps) * W["output_norm.weight"], W
