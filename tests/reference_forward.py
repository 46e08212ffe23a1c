"""An independent float64 reference forward pass of the llama family (llama, qwen2, qwen3).

Test helper, not a test: `reference_logits(model_path, tokens)` reads the GGUF file with
`gguf.GGUFReader` and `gguf.quants.dequantize` (not pyllama's loader) and runs one sequence at
positions 0..n-1 the way llama.cpp computes it, in float64 numpy, written for obviousness rather
than speed.
"""
from __future__ import annotations

import numpy as np
from gguf import GGUFReader, quants

NEOX_ARCHS = ("qwen2", "qwen3")  # rotate (x[i], x[i + n_rot/2]); llama rotates (x[2i], x[2i+1])


def load_model(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata as Python values, weights as float64 arrays in numpy row-major shape)."""
    reader = GGUFReader(path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    weights = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # t.shape is ggml's ne order
        weights[t.name] = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(shape)
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

    x = W["token_embd.weight"][np.asarray(tokens)]  # [n, n_embd]
    causal = np.triu(np.ones((n, n), dtype=bool), k=1)  # True above the diagonal = masked
    for i in range(n_layer):
        p = f"blk.{i}."
        h = rmsnorm(x, eps) * W[p + "attn_norm.weight"]
        q = h @ W[p + "attn_q.weight"].T
        k = h @ W[p + "attn_k.weight"].T
        v = h @ W[p + "attn_v.weight"].T
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
        x = x + att.reshape(n, n_head * hd) @ W[p + "attn_output.weight"].T
        h = rmsnorm(x, eps) * W[p + "ffn_norm.weight"]
        x = x + (silu(h @ W[p + "ffn_gate.weight"].T) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
    h = rmsnorm(x, eps) * W["output_norm.weight"]
    return h @ W.get("output.weight", W["token_embd.weight"]).T
