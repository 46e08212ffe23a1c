"""DeepSeek's multi-head latent attention (deepseek2) as graph nodes, after llama.cpp's MLA path.

The query comes from one product (or, with q_lora_rank, a low-rank product, its RMS norm and a
second product), the latent and the rope part of the key from attn_kv_a_mqa, and one
MLA_ATTENTION node does the rest (ir/tensor.py): the latent's norm, RoPE, the cache write of
latent + rope values per token, the absorbed query through k_b, attention with one KV head, and
v_b back to each head's values. attn_output follows in the layer as for every architecture.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from ...ir.tensor import MlaParams, Op, Tensor
from ..hparams import HParams

if TYPE_CHECKING:
    from ..weights import Weights


def mla_scales(hp: HParams) -> tuple[float, float]:
    """(RoPE's attn_factor, the attention's score scale) as llama.cpp sets them for deepseek2:
    with YaRN, llama.cpp's context makes attn_factor mscale(factor, m) / mscale(factor, m_all)
    over ggml's own 1 + 0.1 ln(factor) (m_all = yarn_log_multiplier / 0.1, m = m_all, or 1 where
    m_all is 1), and the score scale carries (1 + 0.1 m_all ln(factor))^2 / sqrt(nope + rope)."""
    head_k = hp.mla_nope + hp.n_rot
    attn_factor = hp.rope_attn_factor
    mscale = 1.0
    if hp.rope_scaling == "yarn" and hp.rope_scale < 1.0:
        factor = 1.0 / hp.rope_scale

        def get_mscale(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
        if hp.yarn_log_mul:
            m = hp.yarn_log_mul if hp.yarn_log_mul != 1.0 else 1.0
            yarn = get_mscale(m) / get_mscale(hp.yarn_log_mul)
        else:
            yarn = get_mscale(1.0)
        yarn /= 1.0 + 0.1 * math.log(factor)
        attn_factor = yarn * hp.rope_attn_factor
        org = attn_factor * (1.0 + 0.1 * math.log(factor))
        mscale = org * (1.0 + 0.1 * hp.yarn_log_mul * math.log(factor))
    return attn_factor, mscale * mscale / math.sqrt(head_k)


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
