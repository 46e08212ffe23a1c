"""The op set every backend implements, and the graph that carries it.

The vocabulary itself (Op, Node, Graph, the op table) lives in `pyllama.ir.tensor`, the bottom module
that the backends import too; this module re-exports it for the graph builders and adds what only
they need.
"""
from __future__ import annotations

from ..hparams import ROPE_NEOX, ROPE_NORMAL  # noqa: F401 - the ATTENTION op's rope modes
from ...ir.tensor import (OP_TABLE, SAMPLE_PARAM_COLS, Graph, Node, Op, OpSpec, check_node, input_tensor,  # noqa: F401
                      node, sample_in_cols, sample_out_cols, src_roles)

__all__ = ["Op", "Node", "Graph", "OP_TABLE", "OpSpec", "check_node", "src_roles", "input_tensor", "node",
           "sample_in_cols", "sample_out_cols", "SAMPLE_PARAM_COLS", "ROPE_NEOX", "ROPE_NORMAL"]
