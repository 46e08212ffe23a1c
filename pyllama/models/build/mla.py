"""DeepSeek's multi-head latent attention (deepseek2) as graph nodes, after llama.cpp's MLA path.

The query comes from one product (or, with q_lora_rank, a low-rank product, its RMS norm and a
second product), the latent and the rope part of the key from attn_kv_a_mqa, and one
MLA_ATTENTION node does the rest (ir/tensor.py): the latent's norm, RoPE, the cache write of
latent + rope values per token, the absorbed query through k_b, attention with one KV head, and
v_b back to each head's values. attn_output follows in the layer as for every architecture.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import TYPE_CHECKING, Callable

import numpy as np

from ...ir.tensor import MlaParams, Op, Tensor
from ..hparams import HParams

if TYPE_CHECKING:
    from ..weights import Weights


_libm = ctypes.CDLL(ctypes.util.find_library("m"))
_libm.logf.restype = ctypes.c_float
_libm.logf.argtypes = [ctypes.c_float]
f32 = np.float32


def _logf(x: float) -> np.float32:
    """C's logf: llama.cpp's scales take it, and its last bit is not always double log's rounded."""
    return f32(_libm.logf(f32(x)))


def mla_scales(hp: HParams) -> tuple[float, float]:
    """(RoPE's attn_factor, the attention's score scale) as llama.cpp sets them for deepseek2, in
    its float steps (a scale one ulp off moves every score): with YaRN, llama.cpp's context makes
    attn_factor mscale(factor, m) / mscale(factor, m_all) over ggml's own 1 + 0.1 ln(factor) (m_all
    = yarn_log_multiplier, m = m_all, or 1 where m_all is 1), and the score scale carries
    (1 + 0.1 m_all ln(factor))^2 / sqrtf(nope + rope)."""
    one, tenth = f32(1), f32(0.1)
    attn_factor = f32(hp.rope_attn_factor)
    mscale = one
    if hp.rope_scaling == "yarn" and hp.rope_scale < 1.0:
        freq_scale = f32(hp.rope_scale)
        factor = one / freq_scale

        def get_mscale(m: float) -> np.float32:
            return one if factor <= one else f32(tenth * f32(m)) * _logf(factor) + one
        log_mul = f32(hp.yarn_log_mul)
        if log_mul != 0:
            yarn = get_mscale(log_mul if log_mul != one else one) / get_mscale(log_mul)
        else:
            yarn = get_mscale(one)
        yarn = yarn * (one / (one + tenth * _logf(factor)))
        attn_factor = yarn * f32(hp.rope_attn_factor)
        org = attn_factor * (one + tenth * _logf(one / freq_scale))
        mscale = org * (one + f32(tenth * log_mul) * _logf(one / freq_scale))
    head_k = f32(hp.mla_nope + hp.n_rot)
    return float(attn_factor), float(f32(f32(one * mscale) * mscale) / np.sqrt(head_k))


def build_mla_attention(add: Callable[..., Tensor], mul_mat: Callable[..., Tensor], hp: HParams, w: "Weights",
                        il: int, h: Tensor, k_cache: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    """Layer il's attention output before attn_output [rows, n_head * v] for its normed input h."""
    b, n = f"blk.{il}.", h.shape[0]
    H, lora, rope = hp.n_head, hp.mla_lora_kv, hp.n_rot
    if hp.mla_lora_q:
        qa = mul_mat((n, hp.mla_lora_q), f"q_a-{il}", h, w[b + "attn_q_a"], layer=il)
        qa = add(Op.RMS_NORM, (n, hp.mla_lora_q), f"q_a_norm-{il}", qa, w[b + "attn_q_a_norm"],
                 params=(hp.rms_eps,), layer=il)
        q = mul_mat((n, H * (hp.mla_nope + rope)), f"q-{il}", qa, w[b + "attn_q_b"], layer=il)
    else:
        q = mul_mat((n, H * (hp.mla_nope + rope)), f"q-{il}", h, w[b + "attn_q"], layer=il)
    kv = mul_mat((n, lora + rope), f"kv_cmpr_pe-{il}", h, w[b + "attn_kv_a_mqa"], layer=il)
    attn_factor, scale = mla_scales(hp)
    yarn = hp.rope_scaling == "yarn"
    params = MlaParams(H, lora, hp.rope_base, hp.rope_scale, hp.rms_eps, scale, attn_factor,
                       hp.yarn_ext_factor if yarn else 0.0, hp.yarn_beta_fast, hp.yarn_beta_slow,
                       hp.n_ctx_orig or hp.n_ctx_train)
    return add(Op.MLA_ATTENTION, (n, H * hp.mla_v), f"kqv_out-{il}", q, kv, k_cache, inputs["inp_pos"],
               inputs["inp_kv_idx"], inputs["inp_attn_cells"], inputs["inp_attn_ranges"], w[b + "attn_kv_a_norm"],
               w[b + "attn_k_b"], w[b + "attn_v_b"], params=tuple(params), layer=il)


__all__ = ["build_mla_attention", "mla_scales"]
