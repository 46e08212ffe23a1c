"""The MLA_ATTENTION op on the CPU: DeepSeek's multi-head latent attention (ir/tensor.py documents it).

The step follows llama.cpp's MLA path with the "absorbed" weights: each token's latent (RMS-normed
by kv_norm) and its rotated k_pe are written as one cache row of lora + rope values, the query's
no-RoPE part goes through k_b into the latent space, every head attends over the same rows (one
KV head), and v_b maps each head's weighted latent to its output. RoPE is ggml's rope_ext in the
normal mode (adjacent pairs) with its YaRN ramp computed here from the op's parameters, in float32
and ggml's order (the angle multiplied pair after pair by base^(-2 / n_rot)).

It is numpy, vectorised over heads and cells, one token's attention at a time; the per-head
products with k_b and v_b run the quantized-product kernels (qmatmul.mul_mat_q) on the weights'
file bytes, so a quantized k_b or v_b rounds its activations as ggml's MUL_MAT does.
"""
from __future__ import annotations

import math

import numpy as np

from ..._fast import ops, qmatmul
from ...ir.tensor import MlaParams


def rope_cos_sin(pos: np.ndarray, n_dims: int, p: MlaParams) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n, n_dims / 2] (float32) of ggml's rope_ext (its YaRN included) at positions pos."""
    base, freq_scale, ext = np.float32(p.freq_base), np.float32(p.freq_scale), float(p.ext_factor)
    theta_scale = np.float32(base ** np.float32(-2.0 / n_dims))
    low = high = 0.0
    mscale = np.float32(p.attn_factor)
    if ext != 0:
        def corr_dim(n_rot: float) -> float:
            return n_dims * math.log(p.n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(p.freq_base))
        low = max(0.0, math.floor(corr_dim(p.beta_fast)))
        high = min(n_dims - 1.0, math.ceil(corr_dim(p.beta_slow)))
        mscale = np.float32(mscale * np.float32(1.0 + 0.1 * math.log(1.0 / float(freq_scale))))
    theta = pos.astype(np.float32)
    cos = np.empty((len(pos), n_dims // 2), np.float32)
    sin = np.empty_like(cos)
    for i in range(n_dims // 2):
        interp = freq_scale * theta
        if ext != 0:
            ramp = np.float32((1.0 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))) * ext)
            angle = interp * (np.float32(1) - ramp) + theta * ramp
        else:
            angle = interp
        cos[:, i] = np.cos(angle) * mscale
        sin[:, i] = np.sin(angle) * mscale
        theta = (theta * theta_scale).astype(np.float32)
    return cos, sin


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [n, heads, d] rotated in adjacent pairs (ggml's normal mode); cos, sin [n, d / 2]."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def mla_attention(q: np.ndarray, kv: np.ndarray, k_cache: np.ndarray, k_type: int, pos: np.ndarray,
                  kv_idx: np.ndarray, cells: np.ndarray, ranges: np.ndarray, kv_norm: np.ndarray,
                  k_b: np.ndarray, k_b_type: int, v_b: np.ndarray, v_b_type: int, nope: int, v_dim: int,
                  params: MlaParams, out: np.ndarray) -> None:
    """One layer's MLA for a micro-batch: writes the tokens' cache rows (k_cache: uint8 rows of
    cache type k_type), then out [n, H v]. k_b: uint8 [H, lora, bytes of a row of nope values]
    and v_b: uint8 [H, v, bytes of a row of lora values], in the weight types k_b_type, v_b_type."""
    n = q.shape[0]
    H, lora = int(params.n_head), int(params.lora)
    width = kv.shape[1]
    rope = width - lora
    if n == 0:
        return
    if H <= 0 or lora <= 0 or rope <= 0 or rope % 2 or nope <= 0 or v_dim <= 0 or k_b.shape[:2] != (H, lora) \
            or k_b.shape[2] != qmatmul.row_bytes(k_b_type, nope) or v_b.shape[:2] != (H, v_dim) \
            or v_b.shape[2] != qmatmul.row_bytes(v_b_type, lora):
        raise ValueError(f"MLA_ATTENTION: {H} heads, latent {lora} of {width}, k_b {list(k_b.shape)}, "
                         f"v_b {list(v_b.shape)} do not fit")
    if q.shape[1] != H * (nope + rope) or out.shape != (n, H * v_dim) or kv_norm.shape != (lora,):
        raise ValueError(f"MLA_ATTENTION: q {list(q.shape)}, out {list(out.shape)} or kv_norm {list(kv_norm.shape)} "
                         f"do not fit {H} heads of {nope} + {rope} and latent {lora}")
    if ops.kv_row_nbytes(k_type, width) != k_cache.shape[1]:
        raise ValueError(f"MLA_ATTENTION: cache rows of {k_cache.shape[1]} B are not rows of {width} (type {k_type})")
    if len(pos) != n or len(kv_idx) != n or ranges.shape != (n, 2):
        raise ValueError("MLA_ATTENTION: per-token inputs must have one row per token")
    n_cells = k_cache.shape[0]
    if np.any((kv_idx < 0) | (kv_idx >= n_cells)):
        raise ValueError("MLA_ATTENTION: a token's cache row outside the cache")
    if np.any(ranges[:, 0] < 0) or np.any(ranges[:, 1] < 1) or np.any(ranges.sum(1) > len(cells)):
        raise ValueError("MLA_ATTENTION: a token's cell range outside the listed cells")
    used = np.zeros(len(cells), bool)
    for r0, r1 in ranges:
        used[r0:r0 + r1] = True
    if np.any((cells[used] < 0) | (cells[used] >= n_cells)):
        raise ValueError("MLA_ATTENTION: a listed cell outside the cache")  # (before anything is written)
    cos, sin = rope_cos_sin(pos, rope, params)
    # the cache rows: the latent RMS-normed (sum of squares in double, as ggml) times kv_norm, k_pe rotated
    lat = kv[:, :lora]
    ss = np.einsum("ij,ij->i", lat.astype(np.float64), lat.astype(np.float64))
    inv = (np.float32(1) / np.sqrt((ss / lora).astype(np.float32) + np.float32(params.norm_eps))).astype(np.float32)
    rows = np.empty((n, width), np.float32)
    rows[:, :lora] = (lat * inv[:, None]) * kv_norm
    rows[:, lora:] = _rope(kv[:, None, lora:], cos, sin)[:, 0]
    stored = np.empty((n, k_cache.shape[1]), np.uint8)
    ops.kv_store(k_type, rows, stored)
    k_cache[kv_idx] = stored
    # the absorbed queries [n, H, lora + rope]
    qh = q.reshape(n, H, nope + rope)
    query = np.empty((n, H, width), np.float32)
    for h in range(H):  # each head's no-rope part through its k_b [lora, nope]
        qmatmul.mul_mat_q(np.ascontiguousarray(qh[:, h, :nope]), k_b[h], k_b_type, query[:, h, :lora])
    query[:, :, lora:] = _rope(qh[:, :, nope:], cos, sin)
    scale = np.float32(params.scale)
    latents = np.empty((n, H, lora), np.float32)
    for t in range(n):
        r0, r1 = int(ranges[t, 0]), int(ranges[t, 1])
        listed = cells[r0:r0 + r1]
        keys = np.empty((len(listed), width), np.float32)
        ops.kv_load_rows(k_type, np.ascontiguousarray(k_cache[listed]), keys)
        scores = (query[t] @ keys.T) * scale                        # [H, C]
        scores = np.exp(scores - scores.max(axis=1, keepdims=True))
        probs = scores / scores.sum(axis=1, keepdims=True)
        latents[t] = probs @ keys[:, :lora]                          # [H, lora]
    for h in range(H):  # each head's weighted latent through its v_b [v, lora]
        qmatmul.mul_mat_q(np.ascontiguousarray(latents[:, h]), v_b[h], v_b_type, out[:, h * v_dim:(h + 1) * v_dim])


__all__ = ["mla_attention", "rope_cos_sin"]
