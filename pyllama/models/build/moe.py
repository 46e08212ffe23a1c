"""The Mixture-of-Experts FFN of a layer (qwen2moe, qwen3moe, Mixtral-style llama).

One MOE_FFN node does the routed part: the router product, softmax, each token's top-k experts
with the model's normalisation, and the chosen experts' gate/up/down products summed with their
weights (ir/tensor.py documents the op). It is one fused node rather than a router op plus
gathered products because the grouping of tokens by expert, which is what lets the kernel read
each chosen expert's rows once per step and never an unchosen one, would otherwise travel
between nodes as index tensors of data-dependent size; the graph (and the rpc wire) keeps fixed
shapes. A shared expert (qwen2moe) is an ordinary dense FFN built from the existing nodes, and
its output is handed to MOE_FFN, which adds it, gated by sigmoid(x . ffn_gate_inp_shexp).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..hparams import HParams
from ...ir.tensor import MoeParams, Op, Tensor

if TYPE_CHECKING:  # the loader builds a graph to check a placement, so it imports this module
    from ..weights import Weights


def build_moe_ffn(add: Callable[..., Tensor], mul_mat: Callable[..., Tensor], hp: HParams, w: "Weights",
                  il: int, h: Tensor) -> Tensor:
    """The FFN output [rows, n_embd] of layer `il` for its normed input `h` [rows, n_embd].

    add(op, shape, name, *srcs, params=, layer=) and mul_mat(shape, name, x, weight, layer=) are
    the graph builder's node constructors."""
    b = f"blk.{il}."
    rows, e = h.shape
    shexp = shexp_gate = None
    if hp.n_ff_shexp:
        gu = mul_mat((rows, 2 * hp.n_ff_shexp), f"ffn_gate_up_shexp-{il}", h, w[b + "ffn_gate_up_shexp"], layer=il)
        s = add(Op.SWIGLU, (rows, hp.n_ff_shexp), f"ffn_swiglu_shexp-{il}", gu, layer=il)
        shexp = mul_mat((rows, e), f"ffn_shexp-{il}", s, w[b + "ffn_down_shexp"], layer=il)
        shexp_gate = w.get(b + "ffn_gate_inp_shexp")
    probs_b = w.get(b + "exp_probs_b")
    biases = [w[b + n + "_bias"] for n in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")] \
        if hp.moe_biases else []
    params = MoeParams(hp.n_expert_used, 1 if hp.expert_weights_norm else 0, hp.expert_weights_scale,
                       hp.expert_gating, 1 if probs_b is not None else 0, hp.n_expert_groups, hp.n_group_used,
                       1 if biases else 0, 1 if hp.moe_biases else 0).params()
    return add(Op.MOE_FFN, (rows, e), f"ffn_moe_out-{il}", h, w[b + "ffn_gate_inp"], w[b + "ffn_gate_exps"],
               w[b + "ffn_up_exps"], w[b + "ffn_down_exps"], *biases, shexp, shexp_gate, probs_b, params=params,
               layer=il)


__all__ = ["build_moe_ffn"]
