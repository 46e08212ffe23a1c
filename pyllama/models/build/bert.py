"""The encoder graph of the BERT family for one micro-batch: learned positions (bert), RoPE
(nomic-bert) or ALiBi (jina-bert-v2), LayerNorms with biases after attention and after the FFN,
an ungated GELU FFN (bert), SwiGLU (nomic-bert) or GeGLU (jina-bert-v2), and attention over the whole sequence (the host lists every cell of a
token's sequence, not only those before it).

The graph ends at the last layer's output, which is the embedding (llama.cpp's `result_embd`);
pooling, and a reranker's classification head, run on the host over the rows it returns.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ...ir.tensor import AttentionParams, DType, Tensor
from ..hparams import HParams
from .ops import NodeList, Op, step_inputs

if TYPE_CHECKING:
    from ..weights import Weights
    from .llama import ForwardGraph

F32 = DType.F32
EMBD_NAME = "result_embd"


def build_encoder(hp: HParams, w: "Weights", kv: list[tuple[Tensor, Tensor]], n_tokens: int, n_outputs: int,
                  n_cells_listed: int) -> "ForwardGraph":
    """Nodes for `n_tokens` tokens of which `n_outputs` rows come back (their last hidden states)."""
    from .llama import ForwardGraph  # (llama.py dispatches here)
    n, e = n_tokens, hp.n_embd
    inputs, select_rows = step_inputs(n, n_outputs, n_cells_listed)
    nodes = NodeList()
    add, mul_mat = nodes.add, nodes.mul_mat

    eps = (hp.rms_eps,)
    x = add(Op.GET_ROWS, (n, e), "inp_tok", w["token_embd"], inputs["inp_tokens"], layer=-1)
    if w.get("position_embd") is not None:
        # learned positions and the token type's row, in one table (weights.computed_weights)
        pos = add(Op.GET_ROWS, (n, e), "inp_pos_embd", w["position_embd"], inputs["inp_pos"], layer=-1)
        x = add(Op.ADD, (n, e), "inp_embd", x, pos, layer=-1)
    x = add(Op.LAYER_NORM, (n, e), "inp_norm", x, w["token_embd_norm"], w["token_embd_norm_bias"], params=eps,
            layer=-1)
    # bert: no RoPE (n_rot 0); nomic-bert rotates as the file says
    alibi = hp.alibi_max_bias > 0  # jina-bert-v2: per-head slopes (weights.computed_weights)
    attn = AttentionParams(hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_rot, hp.rope_mode, hp.rope_base, hp.rope_scale,
                           hp.rms_eps, 1.0 / math.sqrt(hp.head_dim), alibi=alibi).params()
    gated = hp.arch == "nomic-bert"
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        k_cache, v_cache = kv[il]
        qkv = mul_mat((n, hp.n_embd_q + 2 * hp.n_embd_kv), f"qkv-{il}", x, w[b + "attn_qkv"],
                      w.get(b + "attn_qkv_bias"), layer=il)
        a = add(Op.ATTENTION, (n, hp.n_embd_q), f"kqv_out-{il}", qkv, k_cache, v_cache, inputs["inp_pos"],
                inputs["inp_kv_idx"], inputs["inp_attn_cells"], inputs["inp_attn_ranges"],
                w.get(b + "attn_alibi") if alibi else None, params=attn, layer=il)
        if il == hp.n_layer - 1:
            if n_outputs == 0:
                break
            if select_rows:  # only the rows the pooling reads go on
                a = add(Op.GET_ROWS, (n_outputs, a.shape[1]), f"kqv_out_sel-{il}", a, inputs["inp_out_ids"], layer=il)
                x = add(Op.GET_ROWS, (n_outputs, e), f"inp_sel-{il}", x, inputs["inp_out_ids"], layer=il)
        rows = a.shape[0]
        o = add(Op.MUL_MAT, (rows, e), f"attn_out-{il}", a, w[b + "attn_output"], w.get(b + "attn_output_bias"),
                layer=il)
        h = add(Op.ADD, (rows, e), f"attn_res-{il}", o, x, layer=il)
        h = add(Op.LAYER_NORM, (rows, e), f"ffn_inp-{il}", h, w[b + "attn_output_norm"],
                w[b + "attn_output_norm_bias"], params=eps, layer=il)
        if gated:  # nomic-bert: silu(gate) * up
            gu = mul_mat((rows, 2 * hp.n_ff), f"ffn_gate_up-{il}", h, w[b + "ffn_gate_up"], None, layer=il)
            g = add(Op.SWIGLU, (rows, hp.n_ff), f"ffn_act-{il}", gu, layer=il)
        elif hp.ffn_gelu:  # jina-bert-v2: gelu(gate) * up, gate|up fused in the file's ffn_up
            u = add(Op.MUL_MAT, (rows, 2 * hp.n_ff), f"ffn_up-{il}", h, w[b + "ffn_up"], w.get(b + "ffn_up_bias"),
                    layer=il)
            g = add(Op.GEGLU, (rows, hp.n_ff), f"ffn_act-{il}", u, layer=il)
        else:
            u = add(Op.MUL_MAT, (rows, hp.n_ff), f"ffn_up-{il}", h, w[b + "ffn_up"], w.get(b + "ffn_up_bias"),
                    layer=il)
            g = add(Op.GELU, (rows, hp.n_ff), f"ffn_act-{il}", u, layer=il)
        d = add(Op.MUL_MAT, (rows, e), f"ffn_out-{il}", g, w[b + "ffn_down"], w.get(b + "ffn_down_bias"), layer=il)
        d = add(Op.ADD, (rows, e), f"ffn_res-{il}", d, h, layer=il)
        x = add(Op.LAYER_NORM, (rows, e), EMBD_NAME if il == hp.n_layer - 1 else f"l_out-{il}", d,
                w[b + "layer_output_norm"], w[b + "layer_output_norm_bias"], params=eps, layer=il)
    return ForwardGraph(nodes, inputs, x if n_outputs > 0 else None, n_tokens, n_outputs)


__all__ = ["build_encoder", "EMBD_NAME"]
