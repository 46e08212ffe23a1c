"""The op set every backend implements, and the graph that carries it.

The vocabulary itself (Op, Node, Graph, the op table) lives in `pyllama.ir.tensor`, the bottom module
that the backends import too; this module re-exports it for the graph builders and adds what only
they need.
"""
from __future__ import annotations

from typing import Optional

from ..hparams import ROPE_NEOX, ROPE_NORMAL  # noqa: F401 - the ATTENTION op's rope modes
from ...ir.tensor import (OP_TABLE, SAMPLE_PARAM_COLS, DType, Graph, Node, Op, OpSpec, Tensor, check_node,  # noqa: F401
                          input_tensor, node, sample_in_cols, sample_out_cols, src_roles)

__all__ = ["NodeList", "Op", "Node", "Graph", "OP_TABLE", "OpSpec", "check_node", "src_roles", "input_tensor", "node",
           "sample_in_cols", "sample_out_cols", "SAMPLE_PARAM_COLS", "ROPE_NEOX", "ROPE_NORMAL", "step_inputs"]


def step_inputs(n: int, n_outputs: int, n_cells_listed: int) -> tuple[dict[str, Tensor], bool]:
    """A forward step's host inputs for n tokens (ids, positions, cache cells, the attention's cell
    lists and ranges) and whether only n_outputs of its rows come back (then their ids, inp_out_ids)."""
    i32 = DType.I32
    inputs = {
        "inp_tokens": input_tensor("inp_tokens", i32, (n,)),
        "inp_pos": input_tensor("inp_pos", i32, (n,)),
        "inp_kv_idx": input_tensor("inp_kv_idx", i32, (n,)),
        "inp_attn_cells": input_tensor("inp_attn_cells", i32, (max(n_cells_listed, 1),)),
        "inp_attn_ranges": input_tensor("inp_attn_ranges", i32, (n, 2)),
    }
    select_rows = 0 < n_outputs < n
    if select_rows:
        inputs["inp_out_ids"] = input_tensor("inp_out_ids", i32, (n_outputs,))
    return inputs, select_rows


class NodeList(list):
    """A graph's nodes as a builder appends them, each writing a new F32 tensor."""

    def add(self, op: Op, shape: tuple[int, ...], name: str, *srcs: Optional[Tensor], params: tuple = (),
            layer: int) -> Tensor:
        out = Tensor(DType.F32, shape, name)
        self.append(node(op, out, *srcs, params=params, layer=layer))
        return out

    def mul_mat(self, shape: tuple[int, ...], name: str, x: Tensor, wt, bias: Optional[Tensor] = None, *,
                layer: int) -> Tensor:
        """x @ w.T: one MUL_MAT, or one MUL_MAT_CAT when the device stores the weight's fused
        parts in different types (a quantization mix); one node either way."""
        if isinstance(wt, tuple):
            return self.add(Op.MUL_MAT_CAT, shape, name, x, *wt, bias, params=(len(wt),), layer=layer)
        return self.add(Op.MUL_MAT, shape, name, x, wt, bias, layer=layer)
