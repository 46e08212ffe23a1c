"""pyllama's coarse ops lowered to ggml's, as llama.cpp's model builders write them.

One pyllama graph (the nodes a split put on one device of a ggml peer) becomes one ggml graph
(graph.GraphBuilder). Every pyllama tensor keeps its bytes where pyllama's allocator put them: a
node's final ggml result is computed at its output tensor's address (`GraphBuilder.place`), so
later nodes, later graphs, split copies and reads find it there; what a node needs in between
(a norm before its weight, q and k after RoPE, the products of a MUL_MAT_CAT) lives in the graph's
scratch buffer.

ATTENTION is llama.cpp's attention block: q, k, v are views of the fused qkv rows; q and k get
their RMS norm (qwen3) and RoPE with the model's parameters; k and v rows are written into the
caches with SET_ROWS at kv_idx. Then each sequence attends over its own cells, as llama.cpp does
with a KV stream per sequence: GET_ROWS gathers every sequence's cells (rounded up to 256, cast
back to the cache's type), and one attention per group of sequences with the same number of
tokens in the step runs over [cells, tokens, heads, sequences] with a mask built on the host from
attn_cells and attn_ranges (0 where the token may look, -inf elsewhere): FLASH_ATTN_EXT at F32
precision on an F16 cache (what llama-server runs on a CPU by default), else MUL_MAT, SOFT_MAX and
MUL_MAT as llama.cpp's builder without flash attention. A decode step is one group in the batch's
order; a step that mixes a prompt with decodes has several, their rows gathered into groups and
the results back into the batch's order.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np

from ...ir.tensor import AttentionParams, DType, Graph, MlaParams, MoeParams, Op, Tensor
from . import graph as G
from . import protocol as P

# ops a ggml device runs (SAMPLE ends at ARGMAX or on the host)
LOWERED_OPS = frozenset({Op.GET_ROWS, Op.RMS_NORM, Op.MUL_MAT, Op.MUL_MAT_CAT, Op.ADD, Op.SWIGLU, Op.ATTENTION,
                         Op.GEGLU, Op.SCALE, Op.SOFTCAP, Op.SAMPLE, Op.MOE_FFN, Op.MLA_ATTENTION})
FLASH_KV = frozenset({DType.F16, DType.BF16, DType.Q8_0, DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1,
                      DType.IQ4_NL})   # caches flash attention reads
KV_STEP = 256          # a sequence's attended cells rounded up to this, as llama.cpp pads a stream's


class AttnLayout(NamedTuple):
    """How a step's tokens attend, sequence by sequence (llama.cpp's KV streams): the sequences
    with the same number of tokens in the step form a group, one attention over [C cells, T
    tokens, heads, m sequences]; a graph lowered for one layout serves every step with it."""
    groups: tuple[tuple[int, int, int], ...]   # (T tokens per sequence, m sequences, C cells) each
    in_order: bool                             # groups' tokens, sequence by sequence, are the batch's order


class AttnGroup(NamedTuple):
    tokens: np.ndarray     # [m * T] the batch rows, sequence by sequence
    gather: np.ndarray     # [m * C] i32: each sequence's cells in position order, then cell 0
    lengths: np.ndarray    # [m, T]: how many of its sequence's cells each token attends


def attention_plan(cells: np.ndarray, ranges: np.ndarray, n_tokens: int) -> tuple[AttnLayout, list[AttnGroup]]:
    """The step's layout and each group's rows from the host's cell lists: token t attends
    cells[r0 : r0 + r1] for (r0, r1) = ranges[t], a sequence's tokens sharing r0 (kv_cache
    lists each sequence's cells once, in position order)."""
    r0, r1 = ranges[:n_tokens, 0].astype(np.int64), ranges[:n_tokens, 1].astype(np.int64)
    if n_tokens and (r0.min() < 0 or r1.min() < 1 or (r0 + r1).max() > cells.size):
        raise ValueError("ATTENTION: attn_ranges name cells beyond attn_cells")
    starts, first, inverse = np.unique(r0, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")          # sequences in the order they first appear
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    seq = rank[inverse.reshape(-1)]                   # token -> its sequence, by appearance
    starts = starts[order]
    n_seq_tokens = np.bincount(seq, minlength=starts.size)
    length = np.zeros(starts.size, np.int64)
    np.maximum.at(length, seq, r1)
    t_values, t_first, t_of = np.unique(n_seq_tokens, return_index=True, return_inverse=True)
    by_first = np.argsort(t_first, kind="stable")     # groups in the order their first sequence appears
    t_order = t_values[by_first]
    group_rank = np.empty_like(by_first)
    group_rank[by_first] = np.arange(by_first.size)
    group_of = group_rank[t_of.reshape(-1)]
    slots = np.lexsort((np.arange(n_tokens), seq, group_of[seq]))   # batch rows in group, sequence order
    groups, layout = [], []
    at = 0
    for gi, T in enumerate(t_order.tolist()):
        members = np.flatnonzero(group_of == gi)
        m = members.size
        C = -(-int(length[members].max()) // KV_STEP) * KV_STEP
        tokens = slots[at:at + m * T]
        at += m * T
        col = np.arange(C)
        valid = col[None, :] < length[members, None]
        gather = np.where(valid, cells[np.minimum(starts[members, None] + col[None, :], max(cells.size - 1, 0))], 0)
        groups.append(AttnGroup(tokens, gather.astype(np.int32).reshape(-1), r1[tokens].reshape(m, T)))
        layout.append((int(T), int(m), C))
    in_order = bool((slots == np.arange(n_tokens)).all())
    return AttnLayout(tuple(layout), in_order), groups


def group_mask(group: AttnGroup, C: int, n_swa: int, dtype=np.float16) -> np.ndarray:
    """[m, 1, T, C]: 0 where token j of sequence i may look (its first lengths[i, j] cells, their
    last n_swa with a sliding window), -inf elsewhere."""
    hi = group.lengths[:, :, None]
    lo = np.maximum(hi - n_swa, 0) if n_swa > 0 else 0
    col = np.arange(C)[None, None, :]
    mask = np.where((col >= lo) & (col < hi), 0.0, -np.inf).astype(dtype)
    return mask[:, None]


class AttnSpec(NamedTuple):
    """One attention's inputs of a graph (its layers share them): the cell lists they come from,
    the sliding window, the mask's type, the layout they were laid out for, and the sizes of the
    Hadamard rotations of a quantized K or V cache (0: none)."""
    cells: Tensor
    ranges: Tensor
    n_swa: int
    n_tokens: int
    flash: bool
    layout: AttnLayout
    rot_k: int = 0
    rot_v: int = 0


def hadamard(n: int) -> np.ndarray:
    """The n x n Hadamard matrix over sqrt(n) (Sylvester's, as llama.cpp's KV cache makes it)."""
    h = np.full((1, 1), np.float32(1.0) / np.sqrt(np.float32(n)), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def rotation_sizes(head_dim: int, k_type: DType, v_type: DType) -> tuple[int, int]:
    """llama.cpp rotates q, k (and v, its output back) by a Hadamard matrix before a quantized
    cache stores them, where heads are a multiple of 64: K by the largest power of two dividing
    the head, V by 64."""
    def quantized(t: DType) -> bool:
        return t not in (DType.F32, DType.F16, DType.BF16)
    rot_k = 0
    if quantized(k_type) and head_dim % 64 == 0:
        rot_k = 64
        while head_dim % (rot_k * 2) == 0:
            rot_k *= 2
    return rot_k, (64 if quantized(v_type) and head_dim % 64 == 0 else 0)


class GraphSources(NamedTuple):
    """The host inputs a graph's lowering reads: its attentions' (attn_cells, attn_ranges,
    n_tokens) and its SAMPLE's sampler rows."""
    attention: list
    sampling: Optional[Tensor]


class SampleTail(NamedTuple):
    """A graph's SAMPLE node, made on the host from what the peer computed: the ids of its ARGMAX
    (every row greedy) or, when `ids` is None, the sampler chain run on the logits read back."""
    node: object
    ids: Optional[G.GT]


class Lowering:
    """Builds the ggml graph of one pyllama graph.

    `address(t)`: (remote buffer, address) of a pyllama tensor on the peer; `host_i32(t)`: the
    host's copy of an I32 input it wrote this step (attn_cells, attn_ranges, sampler rows);
    `input_leaves(g, spec)`: the arrays `inputs(spec)` uploaded to the peer as leaves of `g`
    (once per spec). A step's plans of the cell lists are kept in a `memo` dict the caller
    passes, so a step works each out once (and two groups' threads never share one)."""

    def __init__(self, address: Callable[[Tensor], tuple[int, int]], host_i32: Callable[[Tensor], np.ndarray],
                 input_leaves: Callable[[G.GraphBuilder, AttnSpec], list[G.GT]]):
        self.address = address
        self.host_i32 = host_i32
        self.input_leaves = input_leaves

    def plan(self, cells: Tensor, ranges: Tensor, n_tokens: int, memo: dict) -> tuple[AttnLayout, list[AttnGroup]]:
        """This step's attention plan of a graph's cell lists (`memo`: the plans this step made)."""
        key = (id(cells), id(ranges), n_tokens)
        got = memo.get(key)
        if got is None:
            got = memo[key] = attention_plan(self.host_i32(cells), self.host_i32(ranges).reshape(-1, 2), n_tokens)
        return got

    def inputs(self, spec: AttnSpec, memo: dict) -> list[tuple[str, np.ndarray]]:
        """This step's (name, array) inputs of `spec`, in the order `_attention` reads them: the
        Hadamard matrices of its rotations, then per group its cell gather and mask (and its batch
        rows when the groups reorder the batch), then the batch order of the result rows when they do."""
        layout, groups = self.plan(spec.cells, spec.ranges, spec.n_tokens, memo)
        if layout != spec.layout:
            raise ValueError("ATTENTION: the step's cell lists have another layout than its lowered graph")
        out = [(name, hadamard(n)) for name, n in (("attn_rot_k", spec.rot_k), ("attn_rot_v", spec.rot_v)) if n]
        for (T, m, C), grp in zip(layout.groups, groups):
            out += [("kv_gather", grp.gather),
                    ("kq_mask", group_mask(grp, C, spec.n_swa, np.float16 if spec.flash else np.float32))]
            if not layout.in_order:
                out.append(("attn_rows", grp.tokens.astype(np.int32)))
        if not layout.in_order:
            slots = np.concatenate([grp.tokens for grp in groups])
            back = np.empty(slots.size, np.int32)
            back[slots] = np.arange(slots.size, dtype=np.int32)
            out.append(("attn_order", back))
        return out

    def shape_of(self, sources: "GraphSources", memo: dict) -> tuple:
        """What a lowering of the graph depends on besides its nodes, this step: each attention's
        layout and whether every sampled row is greedy."""
        layouts = tuple(self.plan(c, r, n, memo)[0] for c, r, n in sources.attention)
        return layouts, (self.all_greedy(sources.sampling) if sources.sampling is not None else None)

    def lower(self, graph: Graph, memo: dict) -> G.GraphBuilder:
        """The ggml graph of `graph` for this step's cell lists (`memo`: this step's plans); then
        `sources` says what its shape depends on (shape_of) and `sample` how its SAMPLE is made."""
        g = G.GraphBuilder()
        self.g = g
        self.memo = memo
        self.sources = GraphSources([], None)
        self.of: dict[int, G.GT] = {}      # id(pyllama tensor) -> its ggml tensor in this graph
        self.attn_inputs: dict[AttnSpec, list[G.GT]] = {}
        self.sample: Optional[SampleTail] = None
        for nd in graph.nodes:
            if nd.op == Op.SAMPLE:
                self.sample = self._sample(nd)
                continue
            result = self._node(nd)
            buf, addr = self.address(nd.out)
            g.place(result, buf, addr)     # (a view cannot be: every node ends in a result of its own)
            want = tuple(reversed(nd.out.shape))
            if result.ne[:len(want)] != want or any(x != 1 for x in result.ne[len(want):]):
                result = g.reshape(result, want)
            self.of[id(nd.out)] = result
            g.output(result)
        return g

    def all_greedy(self, sampling: Tensor) -> bool:
        """Whether every row of this step's packed sampler inputs takes the most likely token
        (temperature <= 0, no penalty tokens, no candidate probabilities asked)."""
        rows = self.host_i32(sampling).reshape(sampling.shape)
        return bool((rows[:, 0].view(np.float32) <= 0).all() and not rows[:, 9:11].any())

    def _sample(self, nd) -> "SampleTail":
        """SAMPLE ends the graph at ARGMAX when every row is greedy (the step reads back ids),
        else at the logits, which the host samples."""
        greedy = self.all_greedy(nd.srcs[1])
        self.sources = self.sources._replace(sampling=nd.srcs[1])
        ids = self.g.output(self.g.argmax(self.t(nd.srcs[0]), "sampled_ids")) if greedy else None
        return SampleTail(nd, ids)

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
        if op == Op.MLA_ATTENTION:
            return self._mla(nd)
        if op == Op.MOE_FFN:
            return self._moe_ffn(nd)
        raise ValueError(f"{nd.out.name}: {Op(op).name} is not lowered to ggml ops")

    def _moe_ffn(self, nd) -> G.GT:
        """llama.cpp's build_moe_ffn: router product, SOFT_MAX (or SIGMOID), the expert bias
        added for the choice only, the top K by a descending ARGSORT, their probabilities by
        GET_ROWS (normalised by their clamped sum, scaled), MUL_MAT_ID for the chosen experts'
        gate, up and down, SWIGLU, the weights, and the K results added in order; then the shared
        expert, gated by a sigmoid when it has one."""
        g, s = self.g, nd.srcs
        mp = MoeParams.of(nd.params)
        K, norm, w_scale = int(mp.n_used), int(mp.norm), float(mp.scale)
        four, rest, probs_b = mp.sources(s)   # gpt-oss's biases; the shared expert and its gate; the expert bias
        biases = [self.t(t) for t in four]
        bias = self.t(probs_b) if probs_b is not None else None
        x = self.t(s[0])
        e, n = x.ne[0], x.ne[1]
        n_expert = s[1].shape[0]
        logits = g.mul_mat(self.t(s[1]), x)                                     # [E, n]
        if biases:
            logits = g.add(logits, biases[0])
        if mp.gating == 2:
            probs = g.unary(logits, G.UNARY_SIGMOID)
        elif mp.gating == 3:   # choose by the logits, weigh by the chosen ones' softmax
            probs = logits
        else:
            probs = g.soft_max_ext(logits, None, 1.0, 0.0)
        selection = probs if bias is None else g.add(probs, bias)
        if mp.n_group > 1:   # DeepSeek V3's group-limited choice, as llama.cpp's build_moe_ffn builds it
            groups, used = int(mp.n_group), int(mp.n_group_used)
            per = n_expert // groups
            by_group = g.reshape(selection, [per, groups, n])
            best2 = g.argsort_top_k(by_group, 2)                                                 # [2, groups, n]
            scores = g.get_rows(g.reshape(by_group, [1, per, groups, n]), best2)                 # [1, 2, groups, n]
            scores = g.reshape(g.sum_rows(g.reshape(scores, [2, groups, n])), [groups, n])
            kept = g.argsort_top_k(scores, used)                                                 # [used, n]
            masked = g.set_rows(g.fill(by_group, float("-inf")), g.get_rows(by_group, kept), kept)
            selection = g.reshape(masked, [n_expert, n])
        chosen = g.argsort_top_k(selection, K)                                  # [K, n]
        weights = g.get_rows(g.reshape(probs, [1, n_expert, n]), chosen)        # [1, K, n]
        if mp.gating == 3:
            weights = g.reshape(g.soft_max_ext(g.reshape(weights, [K, n]), None, 1.0, 0.0), [1, K, n])
        if norm:
            weights = g.reshape(weights, [K, n])
            total = g.clamp(g.sum_rows(weights), 6.103515625e-5, float("inf"))
            weights = g.reshape(g.div(weights, total), [1, K, n])
        if w_scale not in (0.0, 1.0):
            weights = g.scale(weights, w_scale)
        x3 = g.reshape(x, [e, 1, n])
        up = g.mul_mat_id(self.t(s[3]), x3, chosen)                             # [f, K, n]
        if biases:
            up = g.add_id(up, biases[2], chosen)
        gate = g.mul_mat_id(self.t(s[2]), x3, chosen)
        if biases:
            gate = g.add_id(gate, biases[1], chosen)
        if mp.act == 1:        # gpt-oss's clamped SwiGLU, llama.cpp's constants
            hidden = g.glu_pair(gate, up, G.GLU_SWIGLU_OAI, alpha=1.702, limit=7.0)
        else:
            hidden = g.glu_pair(gate, up, G.GLU_SWIGLU)
        experts = g.mul_mat_id(self.t(s[4]), hidden, chosen)
        if biases:
            experts = g.add_id(experts, biases[3], chosen)
        experts = g.mul(experts, weights)
        out = g.view(experts, [e, n], [experts.nb[2]], 0)
        for k in range(1, K):
            out = g.add(out, g.view(experts, [e, n], [experts.nb[2]], k * experts.nb[1]))
        if K == 1:
            out = g.cont(out)
        if rest:
            shexp = self.t(rest[0])
            if len(rest) > 1:   # the gate's sigmoid as llama.cpp's qwen2moe builds it: silu(z) / z
                z = g.mul_mat(self.t(rest[1]), x)
                shexp = g.mul(shexp, g.div(g.unary(z, G.UNARY_SILU), z))
            out = g.add(out, shexp)
        return out

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
        if len(s) - a.sinks >= 9:   # q and k norms (qwen3): per head, before RoPE
            q = g.mul(g.rms_norm(q, float(a.norm_eps)), self.t(s[7]))
            k = g.mul(g.rms_norm(k, float(a.norm_eps)), self.t(s[8]))
        freqs = self.t(s[-2 if a.sinks else -1]) if a.rope_freqs else None
        sinks = self.t(s[-1]) if a.sinks else None
        pos = self.t(s[3])

        def rope(x: G.GT) -> G.GT:
            return g.rope_ext(x, pos, freqs, int(a.n_rot), int(a.rope_mode), 0, float(a.freq_base),
                              float(a.freq_scale), 0.0, float(a.rope_mscale), 32.0, 1.0)

        q, k = rope(q), rope(k)
        kc_t, vc_t = s[1], s[2]
        # flash attention on F16, BF16 and quantized caches (llama-server's default on a CPU, and what
        # it needs for a quantized V cache); MUL_MAT + SOFT_MAX when a cache is F32
        flash = kc_t.dtype in FLASH_KV and vc_t.dtype in FLASH_KV
        rot_k, rot_v = rotation_sizes(hd, kc_t.dtype, vc_t.dtype)
        spec = AttnSpec(s[5], s[6], int(a.n_swa), n, flash, self.plan(s[5], s[6], n, self.memo)[0], rot_k, rot_v)
        if not any(c is s[5] and r is s[6] and t == n for c, r, t in self.sources.attention):
            self.sources.attention.append((s[5], s[6], n))
        leaves = self.attn_inputs.get(spec)
        if leaves is None:
            leaves = self.attn_inputs[spec] = self.input_leaves(g, spec)
        leaves = list(leaves)

        def rotate(x: G.GT, rot: G.GT) -> G.GT:
            """llama_mul_mat_hadamard: x's values in rows of rot's size, times rot."""
            n_rot = rot.ne[0]
            rows = g.reshape(x if x.is_contiguous() else g.cont(x), [n_rot, int(np.prod(x.ne)) // n_rot])
            return g.mul_mat(rot, rows, hint=G.HINT_HADAMARD)

        rot_k_leaf = leaves.pop(0) if rot_k else None
        rot_v_leaf = leaves.pop(0) if rot_v else None
        if rot_k_leaf is not None:
            q = g.reshape(rotate(q, rot_k_leaf), list(q.ne))
            k = g.reshape(rotate(k, rot_k_leaf), list(k.ne))
        if rot_v_leaf is not None:
            v = g.reshape(rotate(v, rot_v_leaf), list(v.ne))
        kc, vc, idx = self.t(kc_t), self.t(vc_t), self.t(s[4])
        k_set = g.set_rows(kc, g.reshape(k, [Hkv * hd, n]), idx)
        v_set = g.set_rows(vc, v, idx)
        y = self._attend(nd, spec, leaves, q, k_set, v_set, hd, hd, Hkv, float(a.scale), float(a.softcap), sinks)
        return y if rot_v_leaf is None else rotate(y, rot_v_leaf)   # the output rotated back

    def _attend(self, nd, spec: AttnSpec, leaves: list, q: G.GT, k_set: G.GT, v_set: Optional[G.GT], hd: int,
                dv: int, Hkv: int, scale: float, softcap: float, sinks: Optional[G.GT],
                v_mla: Optional[G.GT] = None) -> G.GT:
        """Each group of the batch attends over its sequences' cells (spec.layout), as llama.cpp's
        build_attn_mha: q [hd, H, n] against the caches written (k_set; v_set, or with MLA the
        first dv values of k_set's rows), flash attention or MUL_MAT + SOFT_MAX; with v_mla each
        head's weighted latent goes through it. The result [H dv (or H v), n] in the batch's order."""
        g = self.g
        H, n = q.ne[1], q.ne[2]
        flash = spec.flash

        def per_sequence(cache: G.GT, gather: G.GT, C: int, m: int) -> G.GT:
            """[hd, Hkv, C, m]: each sequence's cells of a cache, gathered in the cache's type (as
            4-byte words, copied bit for bit, where a row is whole words; else through F32), so the
            peer's kernels read what they read from llama.cpp's per-sequence streams. Under
            MUL_MAT + SOFT_MAX every cache is read as F32."""
            kind = cache.type if flash else G.F32
            row = Hkv * hd
            row_bytes = P.contiguous_nb(cache.type, (row,))[1]
            if kind == cache.type and kind != G.F32 and row_bytes % 4 == 0:
                words = g.reinterpret(cache, G.I32, [row_bytes // 4, cache.ne[1]])
                rows = g.reinterpret(g.get_rows(words, gather), kind, [row, C * m])
            else:
                rows = g.get_rows(cache, gather)
                if kind != G.F32:
                    rows = g.cast(rows, kind)
            nb = P.contiguous_nb(kind, (hd, Hkv, C, m))
            return g.view(rows, [hd, Hkv, C, m], nb[1:], 0)

        q_rows = g.reshape(q if q.is_contiguous() else g.cont(q), [hd * H, n]) if not spec.layout.in_order else None
        width = H * (v_mla.ne[1] if v_mla is not None else dv)
        parts = []
        first = 0
        for T, m, C in spec.layout.groups:
            gather, mask = leaves.pop(0), leaves.pop(0)
            if spec.layout.in_order and q.is_contiguous():   # this group's rows are the batch's [first, first + m T)
                qg = g.view(q, [hd, H, T, m], [4 * hd, 4 * hd * H, 4 * hd * H * T], 4 * hd * H * first)
            elif spec.layout.in_order:
                qg = g.reshape(g.cont(g.view(q, [hd, H, T * m], q.nb[1:], first * q.nb[2])), [hd, H, T, m])
            else:
                qg = g.reshape(g.get_rows(q_rows, leaves.pop(0)), [hd, H, T, m])
            first += T * m
            K = per_sequence(k_set, gather, C, m)
            V = per_sequence(v_set, gather, C, m) if v_set is not None else g.view(K, [dv, Hkv, C, m], K.nb[1:], 0)
            qp, kp = g.permute(qg, 0, 2, 1, 3), g.permute(K, 0, 2, 1, 3)
            name = nd.out.name if v_mla is None else ""
            if flash:
                out = g.flash_attn_ext(qp, kp, g.permute(V, 0, 2, 1, 3), mask, scale, 0.0, softcap, True, name,
                                       sinks=sinks)                               # [dv, H, T, m]
                if v_mla is not None:   # as llama.cpp: to [dv, T, H], through v_mla, back
                    out = g.cont(g.permute(g.mul_mat(v_mla, g.permute(out, 0, 2, 1, 3)), 0, 2, 1, 3), nd.out.name)
            else:
                kq = g.mul_mat(kp, qp)
                s = scale
                if softcap:   # llama.cpp's order: the scores scaled, capped, then the softmax unscaled
                    kq = g.scale(g.unary(g.scale(kq, s / softcap), G.UNARY_TANH), softcap)
                    s = 1.0
                kq = g.soft_max_ext(kq, mask, s, 0.0, sinks=sinks)
                vt = g.cont(g.permute(V, 1, 2, 0, 3))
                kqv = g.mul_mat(vt, kq)                                                # [dv, T, H, m]
                if v_mla is not None:
                    kqv = g.mul_mat(v_mla, kqv)
                out = g.cont(g.permute(kqv, 0, 2, 1, 3), nd.out.name)
            parts.append(out)
        if len(parts) == 1 and spec.layout.in_order:
            return parts[0]   # its bytes are the [width, n] result (a reshape would be a view)
        y = g.reshape(parts[0], [width, parts[0].ne[2] * parts[0].ne[3]])
        for p in parts[1:]:
            y = g.concat(y, g.reshape(p, [width, p.ne[2] * p.ne[3]]), 1, nd.out.name)
        if not spec.layout.in_order:
            y = g.get_rows(y, leaves.pop(0), nd.out.name)
        return y

    def _mla(self, nd) -> G.GT:
        """deepseek2's latent attention as llama.cpp's MLA path builds it: the query's rope part
        and the key's turned by ROPE, the latent RMS-normed, the query's no-rope part absorbed by
        MUL_MAT with k_b per head, [latent, k_pe] written as the cache row (one KV head), the
        attention over those rows (the values: their first lora values), then v_b per head."""
        g, s = self.g, nd.srcs
        p = MlaParams(*nd.params[:11])
        H, lora, n = int(p.n_head), int(p.lora), s[0].shape[0]
        width = s[1].shape[1]
        rope_d, nope = width - lora, s[8].shape[2]
        q_t, kv_t, pos = self.t(s[0]), self.t(s[1]), self.t(s[3])
        qh = 4 * (nope + rope_d)
        q_nope = g.view(q_t, [nope, H, n], [qh, q_t.nb[1]], 0)
        q_pe = g.view(q_t, [rope_d, H, n], [qh, q_t.nb[1]], 4 * nope)
        kv_cmpr = g.view(kv_t, [lora, n], [kv_t.nb[1]], 0)
        k_pe = g.view(kv_t, [rope_d, 1, n], [kv_t.nb[1], kv_t.nb[1]], 4 * lora)

        def rope(x: G.GT) -> G.GT:
            return g.rope_ext(x, pos, None, rope_d, 0, int(p.n_ctx_orig), float(p.freq_base), float(p.freq_scale),
                              float(p.ext_factor), float(p.attn_factor), float(p.beta_fast), float(p.beta_slow))

        q_pe, k_pe = rope(q_pe), rope(k_pe)
        kv_cmpr = g.mul(g.rms_norm(kv_cmpr, float(p.norm_eps)), self.t(s[7]))
        q_abs = g.permute(g.mul_mat(self.t(s[8]), g.permute(q_nope, 0, 2, 1, 3)), 0, 2, 1, 3)   # [lora, H, n]
        q = g.concat(q_abs, q_pe, 0)                                                           # [lora + rope, H, n]
        k = g.concat(g.reshape(kv_cmpr, [lora, 1, n]), k_pe, 0)                                # [lora + rope, 1, n]
        kc_t = s[2]
        flash = kc_t.dtype in FLASH_KV
        spec = AttnSpec(s[5], s[6], 0, n, flash, self.plan(s[5], s[6], n, self.memo)[0])
        if not any(c is s[5] and r is s[6] and t == n for c, r, t in self.sources.attention):
            self.sources.attention.append((s[5], s[6], n))
        leaves = self.attn_inputs.get(spec)
        if leaves is None:
            leaves = self.attn_inputs[spec] = self.input_leaves(g, spec)
        k_set = g.set_rows(self.t(kc_t), g.reshape(k, [width, n]), self.t(s[4]))
        return self._attend(nd, spec, list(leaves), q, k_set, None, width, lora, 1, float(p.scale), 0.0, None,
                            v_mla=self.t(s[9]))


__all__ = ["AttnLayout", "AttnSpec", "GraphSources", "Lowering", "SampleTail", "hadamard", "rotation_sizes", "LOWERED_OPS", "attention_plan", "group_mask"]
