"""The MLA_ATTENTION op on the CPU: DeepSeek's multi-head latent attention (ir/tensor.py documents it).

The step follows llama.cpp's MLA path with the "absorbed" weights: each token's latent (RMS-normed
by kv_norm) and its rotated k_pe are written as one cache row of lora + rope values, the query's
no-RoPE part goes through k_b into the latent space, every head attends over the same rows (one
KV head), and v_b maps each head's weighted latent to its output.

Every step takes ggml's float steps, so that the values are its bits: the norm is ggml's rms_norm
and mul (ops.rms_norm), RoPE its rope_ext in the normal mode with YaRN (ops.rope_rows), the
per-head products with k_b and v_b the quantized-product kernels on the weights' file bytes (a
quantized k_b or v_b rounds its activations as ggml's MUL_MAT does), and over an F32 cache the
attention ggml's KQ, soft_max_ext and KQV steps (ops.mla_attend, as the F32 path of ATTENTION).
That matters beyond the last bits: on a model with quantized weights a last-bit difference can
change how a later activation rounds to its 8-bit blocks. Over other cache types the attention is
numpy, one token at a time.
"""
from __future__ import annotations

import numpy as np

from ..._fast import ops, qmatmul
from ...ir.tensor import MlaParams


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
    # the cache rows: the latent RMS-normed times kv_norm (ggml's rms_norm and mul), k_pe rotated
    rows = np.empty((n, width), np.float32)
    latent = np.empty((n, lora), np.float32)
    ops.rms_norm(np.ascontiguousarray(kv[:, :lora]), np.ascontiguousarray(kv_norm), latent, float(params.norm_eps))
    rows[:, :lora] = latent
    k_pe = np.ascontiguousarray(kv[:, None, lora:])
    _rope_rows(k_pe, pos, params)
    rows[:, lora:] = k_pe[:, 0]
    stored = np.empty((n, k_cache.shape[1]), np.uint8)
    ops.kv_store(k_type, rows, stored)
    k_cache[kv_idx] = stored
    # the absorbed queries [n, H, lora + rope]
    qh = q.reshape(n, H, nope + rope)
    query = np.empty((n, H, width), np.float32)
    for h in range(H):  # each head's no-rope part through its k_b [lora, nope]
        qmatmul.mul_mat_q(np.ascontiguousarray(qh[:, h, :nope]), k_b[h], k_b_type, query[:, h, :lora])
    q_pe = np.ascontiguousarray(qh[:, :, nope:])
    _rope_rows(q_pe, pos, params)
    query[:, :, lora:] = q_pe
    scale = np.float32(params.scale)
    latents = np.empty((n, H, lora), np.float32)
    if not (k_type == 0 and ops.mla_attend(query.reshape(n, H * width), k_cache, np.ascontiguousarray(cells, np.int32),
                                           np.ascontiguousarray(ranges, np.int32), H, width, lora, float(scale),
                                           latents.reshape(n, H * lora))):
        # another cache type (or a build without ggml's F32 steps): numpy, one token at a time
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


def _rope_rows(x: np.ndarray, pos: np.ndarray, p: MlaParams) -> None:
    """x [n, heads, rope] rotated in place by ggml's rope_ext (normal mode, YaRN as the parameters say)."""
    ops.rope_rows(x, np.ascontiguousarray(pos, np.int32), float(p.freq_base), float(p.freq_scale),
                  float(p.ext_factor), float(p.attn_factor), float(p.beta_fast), float(p.beta_slow),
                  int(p.n_ctx_orig))


__all__ = ["mla_attention"]
