"""The op set every backend implements, and the graph that carries it.

Ops are coarse on purpose: Python (and later the wire) pays per op, so a transformer layer is about
nine of them. Op codes are fixed once released (a graph travels over RPC as codes plus fixed-size
parameter blocks); new ops are appended.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Optional

from ..backend.base import Tensor


class Op(IntEnum):
    # srcs (table [n, d], ids i32 [m]) -> out [m, d]: embedding lookup and output-row selection
    GET_ROWS = 1
    # srcs (x [n, d], w [d]); params (eps,) -> out [n, d] = x / rms(x) * w
    RMS_NORM = 2
    # srcs (x [n, k], w [m, k] [, bias [m]]) -> out [n, m] = x @ w.T (+ bias)
    MUL_MAT = 3
    # srcs (a, b) same shape -> out = a + b
    ADD = 4
    # srcs (gu [n, 2f]) -> out [n, f] = silu(gu[:, :f]) * gu[:, f:]
    SWIGLU = 5
    # Self-attention of one layer with its KV-cache write, RoPE and optional q/k norm fused:
    # srcs (qkv [n, (H + 2 Hkv) hd], k_cache [cells, Hkv hd], v_cache [cells, Hkv hd], pos i32 [n],
    #       kv_idx i32 [n], attn_cells i32 [c], attn_ranges i32 [n, 2] [, q_norm [hd], k_norm [hd]])
    # params (n_head, n_head_kv, head_dim, n_rot, rope_mode, freq_base, freq_scale, norm_eps, scale)
    # -> out [n, H hd]. Token t writes its k, v to cell kv_idx[t], then attends to the cells
    # attn_cells[r0 : r0 + r1] where (r0, r1) = attn_ranges[t].
    ATTENTION = 6
    # The sampler chain of every output row, run where the logits are (backend sampling):
    # srcs (logits [r, n_vocab], sampling i32 [r, 12 + L]); params (n_probs N, window L)
    # -> out i32 [r, 2 + 2N]. A sampling row holds the packed inputs of sampling.pack_rows: 8
    # float32 parameters (bit patterns; the 7th is the row's uniform draw), 4 ints (top_k, n_probs,
    # n_penalty_tokens, 0) and L penalty tokens. An out row holds the chosen id, its probability
    # (float32 bits), N candidate ids and their probabilities (float32 bits).
    SAMPLE = 7


from ..models.hparams import ROPE_NEOX, ROPE_NORMAL  # noqa: F401 - the ATTENTION op's rope modes

SAMPLE_PARAM_COLS = 12  # the 8 float and 4 int parameters at the start of a SAMPLE input row


def sample_in_cols(window: int) -> int:
    """Columns of SAMPLE's packed input with a penalty window of `window` tokens."""
    return SAMPLE_PARAM_COLS + window


def sample_out_cols(n_probs: int) -> int:
    """Columns of SAMPLE's packed output with room for `n_probs` candidates."""
    return 2 + 2 * n_probs

_graph_uids = itertools.count(1)


@dataclass(eq=False)
class Node:
    op: Op
    out: Tensor
    srcs: tuple[Tensor, ...]
    params: tuple = ()
    layer: int = -1  # which model layer the node belongs to; decides its device


@dataclass(eq=False)
class Graph:
    """Nodes in execution order, all on one backend once the scheduler has split them."""

    nodes: list[Node]
    uid: int = field(default_factory=lambda: next(_graph_uids))

    def __len__(self) -> int:
        return len(self.nodes)


def input_tensor(name: str, dtype, shape: tuple[int, ...]) -> Tensor:
    """A tensor the host fills before each compute (token ids, positions, cell lists...)."""
    return Tensor(dtype, shape, name)


def node(op: Op, out: Tensor, *srcs: Optional[Tensor], params: tuple = (), layer: int = -1) -> Node:
    return Node(op, out, tuple(s for s in srcs if s is not None), params, layer)
