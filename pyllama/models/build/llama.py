"""The llama-family forward graph (llama, qwen2, qwen3, and their MoE forms: models/build/moe.py; glm4moe;
deepseek2's latent attention: models/build/mla.py; the dense gemma2, gemma3, phi3 and glm4, and RoPE
scaling: docs/engine.md) for one micro-batch.

The graph is built device-agnostic: nodes carry their layer, and the scheduler decides which
backend runs them and where the hidden state crosses devices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ...ir.tensor import AttentionParams, DType, Tensor
from ..hparams import HParams
from .ops import Graph, Node, NodeList, Op, input_tensor, node, sample_in_cols, sample_out_cols, step_inputs
from .bert import build_encoder
from .mla import build_mla_attention
from .moe import build_moe_ffn

if TYPE_CHECKING:  # the loader builds a graph to check a placement, so it imports this module
    from ..weights import Weights

F32, I32 = DType.F32, DType.I32

INPUT_NAMES = ("inp_tokens", "inp_pos", "inp_kv_idx", "inp_attn_cells", "inp_attn_ranges", "inp_out_ids", "inp_lora")
OUTPUT_NAME = "result_output"
SAMPLED_NAME = "result_sampled"
SAMPLING_INPUT = "inp_sampling"
LORA_INPUT = "inp_lora"


@dataclass
class ForwardGraph:
    nodes: list[Node]
    inputs: dict[str, Tensor]   # name -> unallocated input tensor (the scheduler places copies)
    output: Tensor | None       # logits [n_outputs, n_vocab] (or, sampling on the device, the packed
                                # sampled ids [n_outputs, 2 + 2N]; with embd, the normed hidden state
                                # [n_outputs, n_embd]); None when no row wants an output
    n_tokens: int
    n_outputs: int


def build_forward(hp: HParams, w: Weights, kv: list[tuple[Tensor, Tensor]], n_tokens: int, n_outputs: int,
                  n_cells_listed: int, sample: Optional[tuple[int, int]] = None, embd: bool = False,
                  n_ctx_seq: int = 0) -> ForwardGraph:
    """Nodes for `n_tokens` tokens of which `n_outputs` rows produce logits.

    kv[il] = (k_cache, v_cache) of layer il; `n_cells_listed` bounds the attention cell list.
    sample = (n_probs, window): the output rows are sampled by a SAMPLE node on the output
    layer's device, and the graph's output is its packed result instead of the logits.
    embd: the graph ends at `result_norm`, the final hidden state after the output norm (what
    llama.cpp returns as embeddings): no output matrix product.
    n_ctx_seq: the context's positions per sequence, which pick phi3's LongRoPE factors (the long
    ones beyond the original context length, as llama.cpp).
    """
    if hp.encoder:
        return build_encoder(hp, w, kv, n_tokens, n_outputs, n_cells_listed)
    n, e = n_tokens, hp.n_embd
    inputs, select_rows = step_inputs(n, n_outputs, n_cells_listed)
    nodes = NodeList()
    add, mul_mat = nodes.add, nodes.mul_mat

    def adapted_mul_mat(shape: tuple[int, ...], name: str, x: Tensor, wname: str, bias: Optional[Tensor] = None, *,
                        layer: int) -> Tensor:
        """mul_mat by the logical weight `wname`, plus its LoRA adapters' product where it has any
        (models/lora.py): a LORA node taking each token's adapter scales."""
        widths = w.lora.get(wname)
        if not widths:
            return mul_mat(shape, name, x, w[wname], bias, layer=layer)
        y = mul_mat(shape, name + "_base", x, w[wname], bias, layer=layer)
        return add(Op.LORA, shape, name, y, x, w[wname + ".lora_a"], w[wname + ".lora_b"], lora_rows,
                   params=widths, layer=layer)

    lora_rows = None  # each token's scale of each LoRA adapter, its request's
    if w.lora:
        lora_rows = inputs[LORA_INPUT] = input_tensor(LORA_INPUT, F32, (n, w.n_lora))
    x = add(Op.GET_ROWS, (n, e), "inp_embd", w["token_embd"], inputs["inp_tokens"], layer=-1)
    if hp.embd_scale:  # gemma scales its input embeddings by sqrt(n_embd)
        x = add(Op.SCALE, (n, e), "inp_scaled", x, params=(hp.embd_scale,), layer=-1)
    long_rope = n_ctx_seq > (hp.n_ctx_orig or hp.n_ctx_train)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        freqs = w.get(b + "rope_freqs")
        if freqs is None:
            freqs = w.get(b + ("rope_freqs_long" if long_rope else "rope_freqs_short"))
        attn_params = _attention_params(hp, il, freqs is not None, w.get(b + "attn_sinks") is not None)
        h = add(Op.RMS_NORM, (n, e), f"attn_norm-{il}", x, w[b + "attn_norm"], params=(hp.rms_eps,), layer=il)
        k_cache, v_cache = kv[il]
        if hp.mla_lora_kv:
            a = build_mla_attention(add, mul_mat, hp, w, il, h, k_cache, inputs)
        else:
            qkv = adapted_mul_mat((n, hp.n_embd_q + 2 * hp.n_embd_kv), f"qkv-{il}", h, b + "attn_qkv",
                                  w.get(b + "attn_qkv_bias"), layer=il)
            a = add(Op.ATTENTION, (n, hp.n_embd_q), f"kqv_out-{il}", qkv, k_cache, v_cache, inputs["inp_pos"],
                    inputs["inp_kv_idx"], inputs["inp_attn_cells"], inputs["inp_attn_ranges"],
                    w.get(b + "attn_q_norm"), w.get(b + "attn_k_norm"), freqs, w.get(b + "attn_sinks"),
                    params=attn_params, layer=il)
        if il == hp.n_layer - 1:
            if n_outputs == 0:
                break  # the KV cache is written; nothing downstream is read
            if select_rows:  # only rows that want logits go through the last FFN and the output layer
                a = add(Op.GET_ROWS, (n_outputs, a.shape[1]), f"kqv_out_sel-{il}", a, inputs["inp_out_ids"], layer=il)
                x = add(Op.GET_ROWS, (n_outputs, e), f"inp_sel-{il}", x, inputs["inp_out_ids"], layer=il)
                if lora_rows is not None:
                    lora_rows = add(Op.GET_ROWS, (n_outputs, w.n_lora), f"lora_sel-{il}", lora_rows,
                                    inputs["inp_out_ids"], layer=il)
        rows = a.shape[0]
        o = adapted_mul_mat((rows, e), f"attn_out-{il}", a, b + "attn_output", w.get(b + "attn_output_bias"),
                            layer=il)
        if hp.post_norms:
            o = add(Op.RMS_NORM, (rows, e), f"attn_post_norm-{il}", o, w[b + "attn_post_norm"],
                    params=(hp.rms_eps,), layer=il)
        x1 = add(Op.ADD, (rows, e), f"ffn_inp-{il}", o, x, layer=il)
        h2 = add(Op.RMS_NORM, (rows, e), f"ffn_norm-{il}", x1, w[b + "ffn_norm"], params=(hp.rms_eps,), layer=il)
        if hp.moe_layer(il):
            d = build_moe_ffn(add, mul_mat, hp, w, il, h2)
        else:
            gu = adapted_mul_mat((rows, 2 * hp.n_ff), f"ffn_gate_up-{il}", h2, b + "ffn_gate_up", layer=il)
            s = add(Op.GEGLU if hp.ffn_gelu else Op.SWIGLU, (rows, hp.n_ff), f"ffn_act-{il}", gu, layer=il)
            d = adapted_mul_mat((rows, e), f"ffn_out-{il}", s, b + "ffn_down", layer=il)
        if hp.post_norms:
            d = add(Op.RMS_NORM, (rows, e), f"ffn_post_norm-{il}", d, w[b + "ffn_post_norm"],
                    params=(hp.rms_eps,), layer=il)
        x = add(Op.ADD, (rows, e), f"l_out-{il}", d, x1, layer=il)
    output = None
    if n_outputs > 0:
        hn = add(Op.RMS_NORM, (n_outputs, e), "result_norm", x, w["output_norm"], params=(hp.rms_eps,),
                 layer=hp.n_layer)
        if embd:
            return ForwardGraph(nodes, inputs, hn, n_tokens, n_outputs)
        if hp.final_softcap:  # gemma2: logits = c * tanh(logits / c)
            raw = adapted_mul_mat((n_outputs, hp.n_vocab), "result_output_raw", hn, "output", layer=hp.n_layer)
            output = add(Op.SOFTCAP, (n_outputs, hp.n_vocab), OUTPUT_NAME, raw, params=(hp.final_softcap,),
                         layer=hp.n_layer)
        else:
            output = adapted_mul_mat((n_outputs, hp.n_vocab), OUTPUT_NAME, hn, "output", w.get("output_bias"),
                                     layer=hp.n_layer)
        if sample is not None:
            n_probs, window = sample
            inputs[SAMPLING_INPUT] = input_tensor(SAMPLING_INPUT, I32, (n_outputs, sample_in_cols(window)))
            output = Tensor(I32, (n_outputs, sample_out_cols(n_probs)), SAMPLED_NAME)
            nodes.append(node(Op.SAMPLE, output, nodes[-1].out, inputs[SAMPLING_INPUT],
                              params=(n_probs, window), layer=hp.n_layer))
    return ForwardGraph(nodes, inputs, output, n_tokens, n_outputs)


def _attention_params(hp: HParams, il: int, scaled_freqs: bool, sinks: bool = False) -> tuple:
    """Layer il's ATTENTION parameters: the 9 base ones, and the 3 extensions only where used
    (so that plain models build the 9-parameter graphs every device runs).

    A sliding-window layer of gemma3 rotates with its own base, unscaled; with rope_freqs (the
    file's factors, or YaRN's folded in) freq_scale is part of them and passes as 1."""
    swa = hp.is_swa[il]
    base, freq_scale, mscale = hp.rope_base, hp.rope_scale, hp.rope_mscale
    if swa and hp.rope_base_swa > 0:
        base, freq_scale, mscale = hp.rope_base_swa, 1.0, 1.0
    elif scaled_freqs and hp.rope_scaling == "yarn":
        freq_scale = 1.0
    scale = hp.attn_scale or 1.0 / math.sqrt(hp.head_dim)
    return AttentionParams(hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_rot, hp.rope_mode, base, freq_scale, hp.rms_eps,
                           scale, hp.attn_softcap, hp.n_swa if swa else 0, mscale, scaled_freqs, sinks).params()


__all__ = ["ForwardGraph", "build_forward", "INPUT_NAMES", "OUTPUT_NAME", "SAMPLED_NAME", "SAMPLING_INPUT", "Graph"]
