"""pyllama's coarse ops lowered to ggml's, as llama.cpp's model builders write them.

One pyllama graph (the nodes a split put on one device of a ggml peer) becomes one ggml graph
(graph.GraphBuilder). Every pyllama tensor keeps its bytes where pyllama's allocator put them: a
node's final ggml result is computed at its output tensor's address (`GraphBuilder.place`), so
later nodes, later graphs, split copies and reads find it there; what a node needs in between
(a norm before its weight, q and k after RoPE, the products of a MUL_MAT_CAT) lives in the graph's
scratch buffer.

ATTENTION is llama.cpp's attention block: q, k, v are views of the fused qkv rows; q and k get
their RMS norm (qwen3) and RoPE with the model's parameters; k and v rows are written into the
caches with SET_ROWS at kv_idx; the token attends over cells [0, n_kv) of the caches with a mask
built on the host from attn_cells and attn_ranges (0 where the token may look, -inf elsewhere):
FLASH_ATTN_EXT at F32 precision on an F16 cache (what llama-server runs on a CPU by default), else
MUL_MAT, SOFT_MAX and MUL_MAT as llama.cpp's builder without flash attention.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from ...ir.tensor import AttentionParams, DType, Graph, Op, Tensor, nbytes_of
from . import graph as G

# ops a ggml device runs (MOE_FFN and SAMPLE are not lowered)
LOWERED_OPS = frozenset({Op.GET_ROWS, Op.RMS_NORM, Op.MUL_MAT, Op.MUL_MAT_CAT, Op.ADD, Op.SWIGLU, Op.ATTENTION,
                         Op.GEGLU, Op.SCALE, Op.SOFTCAP})
MASK_PAD = 64          # mask rows padded as llama.cpp pads them (GGML_KQ_MASK_PAD), for every peer's kernels
KV_STEP = 256          # attended cells rounded up to this, so a decode's graph repeats as the cache grows


def attention_mask(cells: np.ndarray, ranges: np.ndarray, n_swa: int, n_kv: int, n_tokens: int,
                   dtype=np.float16) -> np.ndarray:
    """[pad(n_tokens), n_kv]: row t is 0 at the cells attn_cells[r0 : r0 + r1] of (r0, r1) =
    ranges[t] (their last n_swa with a sliding window) and -inf elsewhere; padding rows all -inf."""
    rows = -(-max(n_tokens, 1) // MASK_PAD) * MASK_PAD
    mask = np.full((rows, n_kv), -np.inf, dtype=dtype)
    r0, r1 = ranges[:n_tokens, 0].astype(np.int64), ranges[:n_tokens, 1].astype(np.int64)
    if n_swa > 0:
        r0, r1 = r0 + np.maximum(r1 - n_swa, 0), np.minimum(r1, n_swa)
    if r1.size and (r0.min() < 0 or (r0 + r1).max() > cells.size):
        raise ValueError("ATTENTION: attn_ranges name cells beyond attn_cells")
    token = np.repeat(np.arange(n_tokens), r1)
    idx = np.repeat(r0 - np.cumsum(r1) + r1, r1) + np.arange(int(r1.sum()))
    mask[token, cells[idx]] = 0
    return mask


def attended_cells(cells: np.ndarray, n_cells: int) -> int:
    """n_kv: the cells [0, n_kv) a graph attends over, every listed cell in them, rounded up."""
    used = int(cells.max()) + 1 if cells.size else 1
    return min(n_cells, -(-used // KV_STEP) * KV_STEP)


class MaskSpec(NamedTuple):
    """What one attention mask of a graph is made of (a graph's layers share it)."""
    cells: Tensor
    ranges: Tensor
    n_swa: int
    n_kv: int
    n_tokens: int
    flash: bool
    n_cells: int


class Lowering:
    """Builds the ggml graph of one pyllama graph.

    `address(t)`: (remote buffer, address) of a pyllama tensor on the peer; `host_i32(t)`: the
    host's copy of an I32 input it wrote this step (attn_cells, attn_ranges); `mask_leaf(g, spec)`:
    the mask of `spec` uploaded to the peer as a leaf of `g` (one per distinct spec)."""

    def __init__(self, address: Callable[[Tensor], tuple[int, int]], host_i32: Callable[[Tensor], np.ndarray],
                 mask_leaf: Callable[[G.GraphBuilder, MaskSpec], G.GT]):
        self.address = address
        self.host_i32 = host_i32
        self.mask_leaf = mask_leaf

    def mask(self, spec: MaskSpec) -> np.ndarray:
        """The mask array of `spec` from this step's cell lists."""
        return attention_mask(self.host_i32(spec.cells), self.host_i32(spec.ranges).reshape(-1, 2), spec.n_swa,
                              spec.n_kv, spec.n_tokens, np.float16 if spec.flash else np.float32)

    def still_fits(self, spec: MaskSpec) -> bool:
        """Whether this step's cell lists attend over the same cells as when `spec` was made."""
        return attended_cells(self.host_i32(spec.cells), spec.n_cells) == spec.n_kv

    def lower(self, graph: Graph) -> G.GraphBuilder:
        g = G.GraphBuilder()
        self.g = g
        self.of: dict[int, G.GT] = {}      # id(pyllama tensor) -> its ggml tensor in this graph
        self.masks: dict[MaskSpec, G.GT] = {}
        for nd in graph.nodes:
            result = self._node(nd)
            buf, addr = self.address(nd.out)
            g.place(result, buf, addr)     # (a view cannot be: every node ends in a result of its own)
            want = tuple(reversed(nd.out.shape))
            if result.ne[:len(want)] != want or any(x != 1 for x in result.ne[len(want):]):
                result = g.reshape(result, want)
            self.of[id(nd.out)] = result
            g.output(result)
        return g

    # --- tensors ---------------------------------------------------------------------------------
    def t(self, x: Tensor) -> G.GT:
        """The ggml tensor of a pyllama tensor: a node's result made earlier in this graph, else a
        leaf at its address (weights, caches, inputs, results of earlier graphs)."""
        got = self.of.get(id(x))
        if got is None:
            buf, addr = self.address(x)
            got = self.g.leaf(int(x.dtype), tuple(reversed(x.shape)), buf, addr, x.name)
            self.of[id(x)] = got
        return got

    # --- ops -------------------------------------------------------------------------------------
    def _node(self, nd) -> G.GT:
        g, s, op = self.g, nd.srcs, nd.op
        if op == Op.GET_ROWS:
            return g.get_rows(self.t(s[0]), self.t(s[1]), nd.out.name)
        if op == Op.RMS_NORM:
            return g.mul(g.rms_norm(self.t(s[0]), float(nd.params[0])), self.t(s[1]), nd.out.name)
        if op == Op.MUL_MAT:
            y = g.mul_mat(self.t(s[1]), self.t(s[0]), nd.out.name)
            return g.add(y, self.t(s[2]), nd.out.name) if len(s) > 2 else y
        if op == Op.MUL_MAT_CAT:
            n_parts = int(nd.params[0])
            x = self.t(s[0])
            y = g.mul_mat(self.t(s[1]), x)
            for w in s[2:1 + n_parts]:
                y = g.concat(y, g.mul_mat(self.t(w), x), 0, nd.out.name)
            return g.add(y, self.t(s[1 + n_parts]), nd.out.name) if len(s) > 1 + n_parts else y
        if op == Op.ADD:
            return g.add(self.t(s[0]), self.t(s[1]), nd.out.name)
        if op == Op.SWIGLU:
            return g.glu_split(self.t(s[0]), G.GLU_SWIGLU, False, nd.out.name)
        if op == Op.GEGLU:
            return g.glu_split(self.t(s[0]), G.GLU_GEGLU, False, nd.out.name)
        if op == Op.SCALE:
            return g.scale(self.t(s[0]), float(nd.params[0]), 0.0, nd.out.name)
        if op == Op.SOFTCAP:   # as llama.cpp caps gemma2's logits: scale, tanh, scale
            c = float(nd.params[0])
            return g.scale(g.unary(g.scale(self.t(s[0]), 1.0 / c), G.UNARY_TANH), c, 0.0, nd.out.name)
        if op == Op.ATTENTION:
            return self._attention(nd)
        raise ValueError(f"{nd.out.name}: {Op(op).name} is not lowered to ggml ops")

    def _attention(self, nd) -> G.GT:
        g, s = self.g, nd.srcs
        a = AttentionParams.of(nd.params, len(s))
        if a.n_swa != int(a.n_swa):
            raise ValueError(f"ATTENTION {nd.out.name}: n_swa {a.n_swa} is not an integer")
        H, Hkv, hd, n = int(a.n_head), int(a.n_head_kv), int(a.head_dim), s[0].shape[0]
        qkv = self.t(s[0])
        row = qkv.nb[1]
        q = g.view(qkv, [hd, H, n], [4 * hd, row], 0)
        k = g.view(qkv, [hd, Hkv, n], [4 * hd, row], 4 * H * hd)
        v = g.view(qkv, [Hkv * hd, n], [row], 4 * (H + Hkv) * hd)
        if len(s) >= 9:   # q and k norms (qwen3): per head, before RoPE
            q = g.mul(g.rms_norm(q, float(a.norm_eps)), self.t(s[7]))
            k = g.mul(g.rms_norm(k, float(a.norm_eps)), self.t(s[8]))
        freqs = self.t(s[-1]) if a.rope_freqs else None
        pos = self.t(s[3])

        def rope(x: G.GT) -> G.GT:
            return g.rope_ext(x, pos, freqs, int(a.n_rot), int(a.rope_mode), 0, float(a.freq_base),
                              float(a.freq_scale), 0.0, float(a.rope_mscale), 32.0, 1.0)

        q, k = rope(q), rope(k)
        kc_t, vc_t = s[1], s[2]
        kc, vc, idx = self.t(kc_t), self.t(vc_t), self.t(s[4])
        k_set = g.set_rows(kc, g.reshape(k, [Hkv * hd, n]), idx)
        v_set = g.set_rows(vc, v, idx)
        n_cells = kc_t.shape[0]
        n_kv = attended_cells(self.host_i32(s[5]), n_cells)
        flash = kc_t.dtype == DType.F16 and vc_t.dtype == DType.F16
        spec = MaskSpec(s[5], s[6], int(a.n_swa), n_kv, n, flash, n_cells)
        mask = self.masks.get(spec)
        if mask is None:
            mask = self.masks[spec] = self.mask_leaf(g, spec)
        K = g.view(k_set, [hd, Hkv, n_kv], [nbytes_of(kc_t.dtype, (hd,)), nbytes_of(kc_t.dtype, (Hkv * hd,))], 0)
        V = g.view(v_set, [hd, Hkv, n_kv], [nbytes_of(vc_t.dtype, (hd,)), nbytes_of(vc_t.dtype, (Hkv * hd,))], 0)
        qp = g.permute(q, 0, 2, 1, 3)
        kp = g.permute(K, 0, 2, 1, 3)
        mrows = g.view(mask, [n_kv, mask.ne[1]], [mask.nb[1]], 0) if flash else \
            g.view(mask, [n_kv, n], [mask.nb[1]], 0)
        if flash:
            return g.flash_attn_ext(qp, kp, g.permute(V, 0, 2, 1, 3), mrows, float(a.scale), 0.0,
                                    float(a.softcap), True, nd.out.name)
        kq = g.mul_mat(kp, qp)
        scale = float(a.scale)
        if a.softcap:   # llama.cpp's order: the scores scaled, capped, then the softmax unscaled
            kq = g.scale(g.unary(g.scale(kq, scale / float(a.softcap)), G.UNARY_TANH), float(a.softcap))
            scale = 1.0
        kq = g.soft_max_ext(kq, mrows, scale, 0.0)
        vt = g.cont(g.permute(V, 1, 2, 0, 3))
        return g.cont(g.permute(g.mul_mat(vt, kq), 0, 2, 1, 3), nd.out.name)


__all__ = ["Lowering", "LOWERED_OPS", "MaskSpec", "attention_mask", "attended_cells"]
