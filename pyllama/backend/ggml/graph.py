"""Building a ggml graph on the client: ggml's op constructors, as ggml.c writes them, over tensors
that live on a ggml peer.

Each constructor here gives the result the shape, strides, source order and op parameters ggml's
own function of that name gives it (views share their root's bytes at an offset; ROPE keeps its
15 parameters; SET_ROWS's sources are in ggml's order), so the peer computes what llama.cpp's
model builders compute with the same calls. `finish` then places every result that is not a view
in one scratch buffer, reusing a result's bytes once the last node that reads it has run (as
ggml-alloc does), and returns the node ids in order and the rpc_tensor records of every tensor the
graph reaches, ready for GRAPH_COMPUTE.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from . import protocol as P
from .protocol import GOp

F32, F16, I32, I64 = 0, 1, 26, 27
GLU_SWIGLU, GLU_GEGLU, GLU_SWIGLU_OAI = 2, 1, 3
UNARY_TANH, UNARY_SIGMOID, UNARY_SILU = 4, 7, 10
SORT_DESC = 1
HINT_HADAMARD = 1
ROPE_NORM, ROPE_NEOX = 0, 2


@dataclass(eq=False)
class GT:
    """A tensor of a graph being built (ggml's ne/nb order: ne[0] is the row)."""
    id: int
    type: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    op: int = 0
    params: bytes = b""
    src: tuple[Optional["GT"], ...] = ()
    view_src: Optional["GT"] = None   # the root tensor whose bytes a view shares
    view_offs: int = 0
    buffer: int = 0
    data: int = 0
    name: str = ""
    keep: bool = False                # an output: its bytes are not reused within the graph
    fixed: bool = False               # placed by the caller (`place`), not in the scratch buffer
    users: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """ggml_nbytes: the span of the tensor's bytes under its strides."""
        block = P.GGML_QUANT_SIZES[P.GGMLQuantizationType(self.type)][0]
        if block == 1:
            n = P.GGML_QUANT_SIZES[P.GGMLQuantizationType(self.type)][1]
            for i in range(4):
                n += (self.ne[i] - 1) * self.nb[i]
            return n
        n = self.ne[0] * self.nb[0] // block
        for i in range(1, 4):
            n += (self.ne[i] - 1) * self.nb[i]
        return n

    def is_contiguous(self) -> bool:
        return self.nb == P.contiguous_nb(self.type, self.ne)


def _ne4(ne: Sequence[int]) -> tuple[int, int, int, int]:
    if not 1 <= len(ne) <= 4:
        raise ValueError(f"a ggml tensor has 1 to 4 dimensions, not {len(ne)}")
    return tuple(int(x) for x in ne) + (1,) * (4 - len(ne))  # type: ignore[return-value]


class GraphBuilder:
    """One graph's tensors and nodes, in the order they are made (sources before their users)."""

    def __init__(self, first_id: int = 1):
        self.tensors: list[GT] = []
        self.nodes: list[GT] = []
        self._next_id = first_id

    # --- tensors that exist on the peer ---------------------------------------------------------
    def leaf(self, ggml_type: int, ne: Sequence[int], buffer: int, data: int, name: str = "",
             nb: Optional[Sequence[int]] = None) -> GT:
        """A tensor already in a peer buffer at address `data` (a weight, a cache, an input)."""
        ne4 = _ne4(ne)
        t = GT(self._id(), ggml_type, ne4, tuple(nb) if nb is not None else P.contiguous_nb(ggml_type, ne4),
               buffer=buffer, data=data, name=name)
        self.tensors.append(t)
        return t

    # --- ggml's constructors ---------------------------------------------------------------------
    def get_rows(self, a: GT, b: GT, name: str = "") -> GT:
        if b.type != I32 or a.ne[2] != b.ne[1] or a.ne[3] != b.ne[2]:
            raise ValueError("get_rows: b must be I32 rows of a")
        return self._new(I32 if a.type == I32 else F32, (a.ne[0], b.ne[0], b.ne[1], b.ne[2]), GOp.GET_ROWS,
                         (a, b), name=name)

    def rms_norm(self, a: GT, eps: float, name: str = "") -> GT:
        return self._new(a.type, a.ne, GOp.RMS_NORM, (a,), struct.pack("<f", eps), name)

    def add(self, a: GT, b: GT, name: str = "") -> GT:
        return self._binary(GOp.ADD, a, b, name)

    def mul(self, a: GT, b: GT, name: str = "") -> GT:
        return self._binary(GOp.MUL, a, b, name)

    def scale(self, a: GT, s: float, b: float = 0.0, name: str = "") -> GT:
        return self._new(a.type, a.ne, GOp.SCALE, (a,), struct.pack("<ff", s, b), name)

    def mul_mat(self, a: GT, b: GT, name: str = "", hint: int = 0) -> GT:
        """ggml_mul_mat(a, b): [a.ne1, b.ne1, b.ne2, b.ne3] F32, row i of b against every row of a;
        hint HINT_HADAMARD: a is a Hadamard matrix (ggml_mul_mat_set_hint; a CPU computes a fast
        Walsh-Hadamard transform instead)."""
        if a.ne[0] != b.ne[0] or b.ne[2] % a.ne[2] or b.ne[3] % a.ne[3]:
            raise ValueError(f"mul_mat: {a.ne} cannot multiply {b.ne}")
        params = struct.pack("<ii", 0, hint) if hint else b""
        return self._new(F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), GOp.MUL_MAT, (a, b), params, name)

    def mul_mat_id(self, a: GT, b: GT, ids: GT, name: str = "") -> GT:
        """ggml_mul_mat_id(as, b, ids): [as.ne1, ids.ne0, b.ne2] F32, b's row j of token t against
        the matrix ids[k, t] of as, for every k (b.ne1 rows broadcast over the k)."""
        if a.ne[3] != 1 or b.ne[3] != 1 or ids.type != I32 or ids.ne[2] != 1 or ids.ne[3] != 1 or \
                ids.ne[1] != b.ne[2] or a.ne[0] != b.ne[0] or ids.ne[0] % b.ne[1]:
            raise ValueError(f"mul_mat_id: {a.ne} x {b.ne} by {ids.ne}")
        return self._new(F32, (a.ne[1], ids.ne[0], b.ne[2], 1), GOp.MUL_MAT_ID, (a, b, ids), name=name)

    def argsort(self, a: GT, order: int, name: str = "") -> GT:
        return self._new(I32, a.ne, GOp.ARGSORT, (a,), struct.pack("<i", order), name)

    def argsort_top_k(self, a: GT, k: int, name: str = "") -> GT:
        """ggml_argsort_top_k: the first k of a descending argsort, a view."""
        s = self.argsort(a, SORT_DESC, name)
        return self.view(s, [k, s.ne[1], s.ne[2], s.ne[3]], s.nb[1:], 0)

    def sum_rows(self, a: GT, name: str = "") -> GT:
        return self._new(a.type, (1,) + a.ne[1:], GOp.SUM_ROWS, (a,), name=name)

    def div(self, a: GT, b: GT, name: str = "") -> GT:
        return self._binary(GOp.DIV, a, b, name)

    def clamp(self, a: GT, lo: float, hi: float, name: str = "") -> GT:
        """ggml_clamp: in place, a view of a (as ggml writes it)."""
        return self._view_of(a, a.ne, a.nb, 0, GOp.CLAMP, (a,), struct.pack("<ff", lo, hi), name)

    def glu_pair(self, a: GT, b: GT, op: int, name: str = "", alpha: float = 0.0, limit: float = 0.0) -> GT:
        """ggml_swiglu_split / geglu_split(a, b): act(a) * b, two tensors of one shape;
        GLU_SWIGLU_OAI takes ggml_swiglu_oai's alpha and limit."""
        if a.ne != b.ne or a.type != b.type:
            raise ValueError(f"glu: {a.ne} and {b.ne}")
        params = struct.pack("<ii", op, 0) + (struct.pack("<ff", alpha, limit) if op == GLU_SWIGLU_OAI else b"")
        return self._new(a.type, a.ne, GOp.GLU, (a, b), params, name)

    def add_id(self, a: GT, b: GT, ids: GT, name: str = "") -> GT:
        """ggml_add_id(a, b, ids): a[:, i1, i2] + b[:, ids[i1, i2]] (each chosen expert's bias)."""
        if a.ne[0] != b.ne[0] or ids.type != I32 or ids.ne[0] != a.ne[1] or ids.ne[1] != a.ne[2]:
            raise ValueError(f"add_id: {a.ne} + {b.ne} by {ids.ne}")
        return self._new(a.type, a.ne, GOp.ADD_ID, (a, b, ids), name=name)

    def glu_split(self, a: GT, op: int, swapped: bool = False, name: str = "") -> GT:
        """ggml_glu(a, op, swapped): the activated half is a's first (second when swapped)."""
        return self._new(a.type, (a.ne[0] // 2,) + a.ne[1:], GOp.GLU, (a,), struct.pack("<ii", op, int(swapped)), name)

    def soft_max_ext(self, a: GT, mask: Optional[GT], scale: float, max_bias: float = 0.0, name: str = "",
                     sinks: Optional[GT] = None) -> GT:
        """ggml_soft_max_ext (with ggml_soft_max_add_sinks' per-head sink logits as src[2])."""
        srcs = (a, mask, sinks) if sinks is not None else (a, mask)
        return self._new(a.type, a.ne, GOp.SOFT_MAX, srcs, struct.pack("<ff", scale, max_bias), name)

    def rope_ext(self, a: GT, pos: GT, freqs: Optional[GT], n_dims: int, mode: int, n_ctx_orig: int,
                 freq_base: float, freq_scale: float, ext_factor: float, attn_factor: float,
                 beta_fast: float, beta_slow: float, name: str = "") -> GT:
        if pos.type != I32 or a.ne[2] != pos.ne[0]:
            raise ValueError("rope: one I32 position per a.ne[2]")
        params = struct.pack("<5i6f4i", 0, n_dims, mode, 0, n_ctx_orig, freq_base, freq_scale, ext_factor,
                             attn_factor, beta_fast, beta_slow, 0, 0, 0, 0)
        return self._new(a.type, a.ne, GOp.ROPE, (a, pos, freqs), params, name)

    def set_rows(self, a: GT, b: GT, c: GT, name: str = "") -> GT:
        """ggml_set_rows(a, b, c): rows b written into a at the indices c; the result is a view of a."""
        if a.ne[0] != b.ne[0] or b.ne[1] != c.ne[0] or c.type not in (I32, I64):
            raise ValueError("set_rows: b's rows into a at the I32/I64 indices c")
        return self._view_of(a, a.ne, a.nb, 0, GOp.SET_ROWS, (b, c, a), b"", name)

    def fill(self, a: GT, c: float, name: str = "") -> GT:
        """ggml_fill(a, c): a new tensor of a's shape, every value c."""
        return self._new(a.type, a.ne, GOp.FILL, (a,), struct.pack("<f", c), name)

    def argmax(self, a: GT, name: str = "") -> GT:
        return self._new(I32, (a.ne[1],), GOp.ARGMAX, (a,), name=name)

    def unary(self, a: GT, op: int, name: str = "") -> GT:
        return self._new(a.type, a.ne, GOp.UNARY, (a,), struct.pack("<i", op), name)

    def concat(self, a: GT, b: GT, dim: int, name: str = "") -> GT:
        if a.type != b.type or any(a.ne[i] != b.ne[i] for i in range(4) if i != dim):
            raise ValueError(f"concat: {a.ne} and {b.ne} along {dim}")
        ne = tuple(a.ne[i] + b.ne[i] if i == dim else a.ne[i] for i in range(4))
        return self._new(a.type, ne, GOp.CONCAT, (a, b), struct.pack("<i", dim), name)

    def cont(self, a: GT, name: str = "") -> GT:
        return self._new(a.type, a.ne, GOp.CONT, (a,), name=name)

    def cpy(self, a: GT, b: GT, name: str = "") -> GT:
        """ggml_cpy(a, b): a's values written into b (converted to b's type); a view of b."""
        return self._view_of(b, b.ne, b.nb, 0, GOp.CPY, (a, b), b"", name)

    def cast(self, a: GT, ggml_type: int, name: str = "") -> GT:
        """ggml_cast(a, type): a's values converted into a new tensor (a CPY that is its own
        destination, as ggml writes it)."""
        ne = a.ne
        t = GT(self._id(), ggml_type, ne, P.contiguous_nb(ggml_type, ne), op=int(GOp.CPY), name=name)
        return self._node(t, (a, t))

    # views
    def view(self, a: GT, ne: Sequence[int], nb: Sequence[int], offset: int, name: str = "") -> GT:
        """ggml_view_Nd(a, ne..., nb1.., offset): nb[0] is the element size."""
        ne4 = _ne4(ne)
        nb4 = list(P.contiguous_nb(a.type, ne4))
        for i, stride in enumerate(nb, 1):     # ggml_view_2d/3d: the given strides, then packed above
            nb4[i] = int(stride)
        for i in range(len(nb) + 1, 4 if nb else 0):
            nb4[i] = nb4[i - 1] * ne4[i - 1]
        return self._view_of(a, ne4, tuple(nb4), offset, GOp.VIEW, (a,), struct.pack("<Q", offset), name)

    def reinterpret(self, a: GT, ggml_type: int, ne: Sequence[int], name: str = "") -> GT:
        """a's bytes read as another type (a VIEW of a contiguous tensor, of the same byte size):
        GET_ROWS of 4-byte words copies F16 rows bit for bit where ggml's F16 GET_ROWS would
        widen them to F32."""
        ne4 = _ne4(ne)
        nb4 = P.contiguous_nb(ggml_type, ne4)
        probe = GT(0, ggml_type, ne4, nb4)
        if not a.is_contiguous() or probe.nbytes != a.nbytes:
            raise ValueError(f"reinterpret: {a.ne} type {a.type} is not {ne4} type {ggml_type} byte for byte")
        root = a.view_src or a
        t = GT(self._id(), ggml_type, ne4, nb4, op=int(GOp.VIEW), params=struct.pack("<Q", 0), view_src=root,
               view_offs=a.view_offs, buffer=root.buffer, name=name)
        return self._node(t, (a,))

    def reshape(self, a: GT, ne: Sequence[int], name: str = "") -> GT:
        if not a.is_contiguous():
            raise ValueError("reshape of a tensor that is not contiguous")
        ne4 = _ne4(ne)
        if np.prod(ne4) != np.prod(a.ne):
            raise ValueError(f"reshape {a.ne} -> {ne4} changes the element count")
        return self._view_of(a, ne4, P.contiguous_nb(a.type, ne4), 0, GOp.RESHAPE, (a,), b"", name)

    def permute(self, a: GT, axis0: int, axis1: int, axis2: int, axis3: int, name: str = "") -> GT:
        axes = (axis0, axis1, axis2, axis3)
        if sorted(axes) != [0, 1, 2, 3]:
            raise ValueError(f"permute {axes}")
        ne, nb = [0] * 4, [0] * 4
        for i, ax in enumerate(axes):
            ne[ax], nb[ax] = a.ne[i], a.nb[i]
        return self._view_of(a, tuple(ne), tuple(nb), 0, GOp.PERMUTE, (a,), struct.pack("<4i", *axes), name)

    def transpose(self, a: GT, name: str = "") -> GT:
        ne = (a.ne[1], a.ne[0], a.ne[2], a.ne[3])
        nb = (a.nb[1], a.nb[0], a.nb[2], a.nb[3])
        return self._view_of(a, ne, nb, 0, GOp.TRANSPOSE, (a,), b"", name)

    def flash_attn_ext(self, q: GT, k: GT, v: GT, mask: Optional[GT], scale: float, max_bias: float = 0.0,
                       logit_softcap: float = 0.0, prec_f32: bool = False, name: str = "",
                       sinks: Optional[GT] = None) -> GT:
        """ggml_flash_attn_ext (with ggml_flash_attn_ext_add_sinks' sink logits as src[4])."""
        params = struct.pack("<fffi", scale, max_bias, logit_softcap, 10 if prec_f32 else 0)
        srcs = (q, k, v, mask, sinks) if sinks is not None else (q, k, v, mask)
        return self._new(F32, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]), GOp.FLASH_ATTN_EXT, srcs, params, name)

    # --- the finished graph -----------------------------------------------------------------------
    def output(self, t: GT) -> GT:
        """Marks a result to read after the graph: its bytes are never reused by a later node."""
        (t.view_src or t).keep = True
        return t

    def place(self, t: GT, buffer: int, data: int) -> GT:
        """Puts a result at an address of the caller's (a tensor the caller's graph names), so it
        is computed there rather than in the scratch buffer."""
        if t.view_src is not None:
            raise ValueError("a view takes its root's address")
        t.buffer, t.data, t.fixed = buffer, data, True
        return t

    def finish(self, scratch_buffer: int, scratch_base: int, scratch_size: int,
               alignment: int) -> tuple[list[int], np.ndarray, int]:
        """(node ids, rpc_tensor records, scratch bytes used): every result that is not a view gets
        its place in the scratch buffer, freed after the last node that reads it (or a view of it)."""
        used = self._place(scratch_buffer, scratch_base, scratch_size, alignment)
        ts = self.tensors
        recs = np.zeros(len(ts), dtype=P.RPC_TENSOR)
        # whole columns at once: a numpy record's fields set one by one cost a microsecond each
        recs["id"] = [t.id for t in ts]
        recs["type"] = [t.type for t in ts]
        recs["buffer"] = [t.buffer for t in ts]
        recs["data"] = [t.data for t in ts]
        recs["ne"] = [t.ne for t in ts]
        recs["nb"] = [t.nb for t in ts]
        recs["op"] = [t.op for t in ts]
        params = b"".join(t.params.ljust(P.MAX_OP_PARAMS, b"\0") for t in ts)
        recs["op_params"] = np.frombuffer(params, dtype="<i4").reshape(len(ts), P.MAX_OP_PARAMS // 4)
        recs["flags"] = [P.FLAG_COMPUTE if t.op else 0 for t in ts]
        recs["src"] = [[s.id if s is not None else 0 for s in t.src] + [0] * (P.MAX_SRC - len(t.src)) for t in ts]
        recs["view_src"] = [t.view_src.id if t.view_src is not None else 0 for t in ts]
        recs["view_offs"] = [t.view_offs for t in ts]
        recs["name"] = [t.name.encode()[:P.MAX_NAME - 1] for t in ts]
        return [t.id for t in self.nodes], recs, used

    # --- internals ---------------------------------------------------------------------------------
    def _id(self) -> int:
        i = self._next_id
        self._next_id += 1
        return i

    def _binary(self, op: GOp, a: GT, b: GT, name: str) -> GT:
        if any(a.ne[i] % b.ne[i] for i in range(4)):
            raise ValueError(f"{op.name}: {b.ne} does not repeat into {a.ne}")
        return self._new(a.type, a.ne, op, (a, b), name=name)

    def _node(self, t: GT, srcs: tuple[Optional[GT], ...]) -> GT:
        t.src = srcs
        index = len(self.nodes)
        for s in srcs:
            if s is not None:
                (s.view_src or s).users.append(index)
        self.tensors.append(t)
        self.nodes.append(t)
        return t

    def _new(self, ggml_type: int, ne: Sequence[int], op: GOp, srcs: tuple[Optional[GT], ...],
             params: bytes = b"", name: str = "") -> GT:
        ne4 = _ne4(ne)
        t = GT(self._id(), ggml_type, ne4, P.contiguous_nb(ggml_type, ne4), op=int(op), params=params, name=name)
        return self._node(t, srcs)

    def _view_of(self, a: GT, ne, nb, offset: int, op: GOp, srcs, params: bytes, name: str) -> GT:
        root = a.view_src or a
        t = GT(self._id(), a.type, tuple(ne), tuple(nb), op=int(op), params=params, view_src=root,
               view_offs=a.view_offs + offset, buffer=root.buffer, name=name)
        return self._node(t, srcs)

    def _place(self, buffer: int, base: int, size: int, alignment: int) -> int:
        """First-fit placement of every non-view result, in node order, freeing each after its
        last reader; views then take their root's address."""
        def align(n: int) -> int:
            return (n + alignment - 1) // alignment * alignment

        free: list[tuple[int, int]] = [(0, size)]       # (offset, length), sorted by offset
        ends: dict[int, list[tuple[int, int]]] = {}     # node index -> blocks to free after it
        high = 0
        for index, t in enumerate(self.nodes):
            if t.view_src is None and not t.fixed:
                need = align(t.nbytes)
                for j, (off, length) in enumerate(free):
                    if length >= need:
                        free[j] = (off + need, length - need)
                        break
                else:
                    raise MemoryError(f"the graph's results need more than its {size} scratch bytes")
                t.buffer, t.data = buffer, base + off
                high = max(high, off + need)
                last = max(t.users, default=index)
                if not t.keep:
                    ends.setdefault(last, []).append((off, need))
            for off, need in ends.pop(index, ()):
                free.append((off, need))
                free.sort()
                merged: list[tuple[int, int]] = []
                for o, n in free:
                    if merged and merged[-1][0] + merged[-1][1] == o:
                        merged[-1] = (merged[-1][0], merged[-1][1] + n)
                    elif n:
                        merged.append((o, n))
                free = merged
        for t in self.tensors:
            if t.view_src is not None:
                t.buffer, t.data = t.view_src.buffer, t.view_src.data + t.view_offs
        return high
