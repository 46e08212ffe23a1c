"""The Mixture-of-Experts FFN kernel (the MOE_FFN op): routing, then only the chosen experts.

`moe_ffn` takes the router's logits (the router product is an ordinary matrix product, run by
the backend before it), picks each token's experts, and groups the (token, expert) pairs by
expert across the batch: each used expert then multiplies its gathered rows with the same dot
kernels and arithmetic as `qmatmul.mul_mat_q` (ggml_quants.h: activations quantized to the
weight type's dot-product type, integer block sums, ggml's scales), so an expert's weight rows
are read once per step however many tokens chose it, and an expert nobody chose is never read.

Experts may come repacked in groups of 8 rows (the CPU backend's layout for its products,
ggml_x8.h): their products then run the repacked kernels, 8 weight rows against up to PQ_X8_NR
gathered rows per call, as a dense product against a repacked weight does.

The work runs on the products' pool (qmatmul.pool_run): items are (expert, tile of weight rows),
so threads split the experts' rows as they split a dense product's. Each output element is
computed by one kernel call whatever the thread, and the weighted sum over a token's experts
runs in the token's top-k order, so results do not depend on the thread count. Everything is
validated (ValueError naming the argument) before the GIL is released.
"""
from libc.math cimport INFINITY, expf
from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

import numpy as np

from pyllama._fast.plan cimport NativeStep, bound, step_for
from pyllama._fast.qmatmul cimport (PQ_MAX_NR, pool_run, pq_dot_rows, pq_get_traits, pq_quantize_row,
                                     pq_tile_bytes, pq_traits)
from pyllama._fast import qmatmul

cdef extern from "moe_route.h" nogil:
    float pv_silu_mul_at(float g, float u, int64_t j, int64_t n)
    void pv_moe_probs(int gating, const float *x, float *p, int64_t n)
    void pv_moe_weights(float *w, int k, int norm, float norm_min, float scale)
    void pv_moe_mix(float *out, const float *const *rows, const float *w, int k, int64_t e)

cdef extern from "ggml_x8.h" nogil:
    int pq_have_x8()
    int pq_x8_block_bytes(int t)
    int pq_x8_block_elems(int t)
    int pq_x8_max_rows()
    void pq_x8_prepare_x(int vt, uint8_t *xq, int64_t n, int64_t k, int64_t stride)
    void pq_x8_dot8(int t, int nr, int64_t k, const uint8_t *wg, const uint8_t *x, size_t xs, float *out,
                    int64_t ldo)

# below this much single-thread work (weight bytes x row groups) one thread does it all: handing
# items to helpers costs about a microsecond each
DEF PARALLEL_MIN = 65536
DEF NORM_MIN = 6.103515625e-5  # llama.cpp clamps the sum of the chosen weights to this before dividing
DEF GATING_SOFTMAX = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_* ids
DEF GATING_SIGMOID = 2
DEF GATING_SOFTMAX_WEIGHT = 3  # gpt-oss: choose by the logits, weigh by the softmax of the chosen ones
DEF OAI_ALPHA = 1.702          # gpt-oss's clamped SwiGLU (ggml's swiglu_oai with llama.cpp's constants)
DEF OAI_LIMIT = 7.0


ctypedef struct Item:
    int32_t expert
    int32_t j0, j1


ctypedef struct MoeJob:
    int t_gate, t_up, t_down          # weight types
    int64_t e, f                      # model width, expert FFN width
    const uint8_t *gate
    const uint8_t *up
    const uint8_t *down
    int64_t gate_es, up_es, down_es   # bytes per expert
    int64_t gate_rb, up_rb, down_rb   # bytes per weight row
    const int32_t *first              # [E + 1]: grouped rows of expert x are first[x] .. first[x + 1]
    const uint8_t *xg_gate            # gathered activations quantized for gate (rows at xs_gate)
    const uint8_t *xg_up              # ... for up (may be xg_gate)
    int64_t xs_gate, xs_up
    float *hg                         # [R, f]: silu(gate x) * up x
    const uint8_t *aq                 # [R, aq_stride]: hg quantized for down
    int64_t aq_stride
    float *y                          # [R, e]: down(...)
    const Item *items
    const float *hsrc                 # rows to quantize (quantize phase)
    uint8_t *qdst
    int64_t q_k, q_stride
    int q_type
    int nr_x8                         # activation rows per repacked kernel call
    int64_t gs_gate, gs_up, gs_down   # bytes per group of 8 rows of repacked experts
    const float *gate_b               # the experts' biases ([E, f], [E, f], [E, e]) or NULL
    const float *up_b
    const float *down_b
    int act                           # 0: silu(g) u; 1: gpt-oss's clamped SwiGLU


cdef inline float _glu(const MoeJob *jb, float g, float u, int64_t x, int64_t j) noexcept nogil:
    """One hidden value of expert x's row j from its gate and up products (plus their biases)."""
    if jb.gate_b != NULL:
        g = g + jb.gate_b[x * jb.f + j]
        u = u + jb.up_b[x * jb.f + j]
    if jb.act == 1:  # min(g, limit) sigmoid(alpha min(g, limit)) (clamp(u, -limit, limit) + 1)
        if g > OAI_LIMIT:
            g = OAI_LIMIT
        if u > OAI_LIMIT:
            u = OAI_LIMIT
        elif u < -OAI_LIMIT:
            u = -OAI_LIMIT
        return g / (1.0 + expf(<float>OAI_ALPHA * (-g))) * (u + 1.0)
    return pv_silu_mul_at(g, u, j, jb.f)  # ggml's swiglu over the row, as the SWIGLU op computes it


cdef void _gate_up_item(void *ctx, int64_t it) noexcept nogil:
    cdef MoeJob *jb = <MoeJob *>ctx
    cdef Item item = jb.items[it]
    cdef int64_t r0 = jb.first[item.expert], r1 = jb.first[item.expert + 1], r, j
    cdef int nr, i
    cdef float g[8]
    cdef float u[8]
    cdef const uint8_t *wg = jb.gate + item.expert * jb.gate_es
    cdef const uint8_t *wu = jb.up + item.expert * jb.up_es
    cdef float gv
    r = r0
    while r < r1:
        nr = <int>(r1 - r if r1 - r < PQ_MAX_NR else PQ_MAX_NR)
        for j in range(item.j0, item.j1):
            pq_dot_rows(jb.t_gate, nr, jb.e, wg + j * jb.gate_rb, jb.xg_gate + r * jb.xs_gate, <size_t>jb.xs_gate,
                        g, 0)
            pq_dot_rows(jb.t_up, nr, jb.e, wu + j * jb.up_rb, jb.xg_up + r * jb.xs_up, <size_t>jb.xs_up, u, 0)
            for i in range(nr):
                jb.hg[(r + i) * jb.f + j] = _glu(jb, g[i], u[i], item.expert, j)
        r += nr


cdef void _down_item(void *ctx, int64_t it) noexcept nogil:
    cdef MoeJob *jb = <MoeJob *>ctx
    cdef Item item = jb.items[it]
    cdef int64_t r0 = jb.first[item.expert], r1 = jb.first[item.expert + 1], r, j
    cdef int nr, i
    cdef float s[8]
    cdef const uint8_t *wd = jb.down + item.expert * jb.down_es
    r = r0
    while r < r1:
        nr = <int>(r1 - r if r1 - r < PQ_MAX_NR else PQ_MAX_NR)
        for j in range(item.j0, item.j1):
            pq_dot_rows(jb.t_down, nr, jb.f, wd + j * jb.down_rb, jb.aq + r * jb.aq_stride, <size_t>jb.aq_stride,
                        s, 0)
            for i in range(nr):
                jb.y[(r + i) * jb.e + j] = s[i] + (jb.down_b[item.expert * jb.e + j] if jb.down_b != NULL else 0.0)
        r += nr


cdef void _gate_up_item_x8(void *ctx, int64_t it) noexcept nogil:
    """_gate_up_item against experts repacked in groups of 8 rows (ggml_x8.h): each group of the
    tile against up to nr_x8 gathered rows per kernel call."""
    cdef MoeJob *jb = <MoeJob *>ctx
    cdef Item item = jb.items[it]
    cdef int64_t r0 = jb.first[item.expert], r1 = jb.first[item.expert + 1], r, grp
    cdef int nr, i, l
    cdef float g[64]
    cdef float u[64]
    cdef const uint8_t *wg = jb.gate + item.expert * jb.gate_es
    cdef const uint8_t *wu = jb.up + item.expert * jb.up_es
    cdef float gv
    cdef float *h
    r = r0
    while r < r1:
        nr = <int>(r1 - r if r1 - r < jb.nr_x8 else jb.nr_x8)
        for grp in range(item.j0 // 8, item.j1 // 8):
            pq_x8_dot8(jb.t_gate, nr, jb.e, wg + grp * jb.gs_gate, jb.xg_gate + r * jb.xs_gate, <size_t>jb.xs_gate,
                       g, 8)
            pq_x8_dot8(jb.t_up, nr, jb.e, wu + grp * jb.gs_up, jb.xg_up + r * jb.xs_up, <size_t>jb.xs_up, u, 8)
            for i in range(nr):
                h = jb.hg + (r + i) * jb.f + grp * 8
                for l in range(8):
                    h[l] = _glu(jb, g[i * 8 + l], u[i * 8 + l], item.expert, grp * 8 + l)
        r += nr


cdef void _down_item_x8(void *ctx, int64_t it) noexcept nogil:
    cdef MoeJob *jb = <MoeJob *>ctx
    cdef Item item = jb.items[it]
    cdef int64_t r0 = jb.first[item.expert], r1 = jb.first[item.expert + 1], r, grp
    cdef int nr, i, l
    cdef const uint8_t *wd = jb.down + item.expert * jb.down_es
    r = r0
    while r < r1:
        nr = <int>(r1 - r if r1 - r < jb.nr_x8 else jb.nr_x8)
        for grp in range(item.j0 // 8, item.j1 // 8):
            pq_x8_dot8(jb.t_down, nr, jb.f, wd + grp * jb.gs_down, jb.aq + r * jb.aq_stride, <size_t>jb.aq_stride,
                       jb.y + r * jb.e + grp * 8, jb.e)
            if jb.down_b != NULL:
                for i in range(nr):
                    for l in range(8):
                        jb.y[(r + i) * jb.e + grp * 8 + l] += jb.down_b[item.expert * jb.e + grp * 8 + l]
        r += nr


cdef void _quantize_item(void *ctx, int64_t r) noexcept nogil:
    cdef MoeJob *jb = <MoeJob *>ctx
    pq_quantize_row(jb.q_type, jb.hsrc + r * jb.q_k, jb.qdst + r * jb.q_stride, jb.q_k)


cdef pq_traits _traits(int qtype, str what) except *:
    cdef pq_traits tr
    if qtype not in qmatmul.supported_types() or not pq_get_traits(qtype, &tr):
        raise ValueError(f"moe_ffn: {what} has an unsupported type id {qtype}")
    return tr


cdef int64_t _rb(pq_traits tr, int64_t k, str what) except -1:
    if k % tr.block:
        raise ValueError(f"moe_ffn: {what}: a row of {k} elements is not a whole number of blocks of {tr.block}")
    return k // tr.block * tr.bytes


cdef int _top(const float *v, int64_t n, const int32_t *taken, int n_taken) noexcept nogil:
    """The index of the largest of v[0, n) not in taken (ties: the lower index); when no value
    compares (NaN, or every one -inf), the lowest index not taken."""
    cdef int64_t x
    cdef int jj, bi = -1
    cdef float best = -INFINITY
    for x in range(n):
        if v[x] > best:
            jj = 0
            while jj < n_taken and taken[jj] != x:
                jj += 1
            if jj == n_taken:
                best = v[x]
                bi = <int>x
    if bi < 0:
        bi = 0
        jj = 0
        while jj < n_taken:
            if taken[jj] == bi:
                bi += 1
                jj = 0
            else:
                jj += 1
    return bi


cdef void _route(const float *logits, int64_t n, int64_t n_exp, int k, bint norm, float scale, int gating,
                 const float *bias, int n_group, int n_group_used, int32_t *ids, float *wts,
                 float *p) noexcept nogil:
    """Each token's experts as llama.cpp's build_moe_ffn picks them: probabilities p (softmax, or
    sigmoid, of the logits); selection scores p + bias (the expert bias, DeepSeek V3's and GLM's
    load balancing, picks experts but does not weigh them); with n_group > 1 only the experts of
    the n_group_used groups whose two best scores sum highest; the k best scores (ties: the lower
    id); their weights p (divided by their sum when norm) times scale. p: 3 * n_exp floats."""
    cdef int64_t t, x, per = n_exp // n_group if n_group > 0 else n_exp
    cdef int j, gi, gj
    cdef float mx
    cdef double ds
    cdef float *sel = p + n_exp
    cdef float *gs = p + 2 * n_exp
    cdef int32_t gtaken[64]
    cdef int32_t two[2]
    cdef const float *lg
    for t in range(n):
        lg = logits + t * n_exp
        if gating == GATING_SOFTMAX_WEIGHT:
            for x in range(n_exp):
                p[x] = lg[x]
        else:  # ggml's sigmoid or soft_max, in its float steps
            pv_moe_probs(gating, lg, p, n_exp)
        for x in range(n_exp):
            sel[x] = p[x] + bias[x] if bias != NULL else p[x]
        if n_group > 1:
            for gi in range(n_group):
                two[0] = _top(sel + gi * per, per, two, 0)
                two[1] = _top(sel + gi * per, per, two, 1)
                gs[gi] = sel[gi * per + two[0]] + sel[gi * per + two[1]]
            for gj in range(n_group_used):
                gtaken[gj] = _top(gs, n_group, gtaken, gj)
            for gi in range(n_group):
                gj = 0
                while gj < n_group_used and gtaken[gj] != gi:
                    gj += 1
                if gj == n_group_used:
                    for x in range(gi * per, (gi + 1) * per):
                        sel[x] = -INFINITY
        for j in range(k):
            ids[t * k + j] = _top(sel, n_exp, ids + t * k, j)
            wts[t * k + j] = p[ids[t * k + j]]
        if gating == GATING_SOFTMAX_WEIGHT:  # the chosen logits' softmax (ggml's: its sum in double)
            mx = wts[t * k]  # the first chosen is the largest
            ds = 0.0
            for j in range(k):
                wts[t * k + j] = expf(wts[t * k + j] - mx)
                ds = ds + wts[t * k + j]
            for j in range(k):
                wts[t * k + j] = wts[t * k + j] * <float>(1.0 / ds)
        pv_moe_weights(wts + t * k, k, norm and gating != GATING_SOFTMAX_WEIGHT, NORM_MIN, scale)


cdef const float *_routing_setup(int64_t n_exp, int gating, probs_b, int n_group, int n_group_used,
                                 list keep) except? NULL:
    """Checks the routing options against n_exp experts; the expert bias's data, or NULL."""
    cdef const float[::1] bv
    if gating not in (GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT):
        raise ValueError(f"moe_ffn: gating {gating} is not 1 (softmax), 2 (sigmoid) or 3 (softmax of the chosen)")
    if n_group < 1 or n_group > 64 or n_exp % n_group or not 1 <= n_group_used <= n_group:
        raise ValueError(f"moe_ffn: {n_exp} experts in {n_group} groups of which {n_group_used} are used")
    if n_group > 1 and n_exp // n_group < 2:
        raise ValueError(f"moe_ffn: expert groups of {n_exp // n_group} (groups are scored by their best two)")
    if probs_b is None:
        return NULL
    bv = probs_b
    if bv.shape[0] != n_exp:
        raise ValueError(f"moe_ffn: probs_b has {bv.shape[0]} elements, expected {n_exp}")
    keep.append(bv)
    return &bv[0]


def route(const float[:, ::1] logits, int n_used, bint norm=True, float scale=1.0, int gating=GATING_SOFTMAX,
          probs_b=None, int n_group=1, int n_group_used=1):
    """(ids int32 [n, n_used], weights float32 [n, n_used]) that moe_ffn uses for these router
    logits (_route): the n_used best in descending order, normalized and scaled as asked."""
    cdef int64_t n = logits.shape[0], n_exp = logits.shape[1]
    if not 1 <= n_used <= n_exp:
        raise ValueError(f"route: n_used {n_used} outside 1..{n_exp}")
    cdef list keep = []
    cdef const float *bias = _routing_setup(n_exp, gating, probs_b, n_group, n_group_used, keep)
    ids = np.zeros((n, n_used), dtype=np.int32)
    wts = np.zeros((n, n_used), dtype=np.float32)
    if n == 0:
        return ids, wts
    cdef int32_t[:, ::1] iv = ids
    cdef float[:, ::1] wv = wts
    cdef float *p = <float *>malloc(3 * n_exp * sizeof(float))
    if p == NULL:
        raise MemoryError("route: scratch")
    with nogil:
        _route(&logits[0, 0], n, n_exp, n_used, norm, scale, gating, bias, n_group, n_group_used, &iv[0, 0],
               &wv[0, 0], p)
    free(p)
    return ids, wts


cdef Item *_items(const int32_t *first, int64_t n_exp, int64_t rows, int64_t row_bytes, int n_threads,
                  int64_t align, int64_t *n_items) noexcept nogil:
    """Work items (expert, tile of its weight rows) for every expert with grouped rows, tiles
    sized as the dense products' (pq_tile_bytes: long runs of weights for the prefetchers, several
    items per thread; 16 KiB items made the per-item hand-off the bound of a batch-1 step), a
    multiple of `align` rows (8 for repacked experts)."""
    cdef int64_t x, j, c = 0, used = 0, most = 0
    for x in range(n_exp):
        if first[x + 1] > first[x]:
            used += 1
            if first[x + 1] - first[x] > most:
                most = first[x + 1] - first[x]
    cdef int64_t rb = row_bytes if row_bytes > 0 else 1
    cdef int64_t tile = pq_tile_bytes(used * rows * rb, n_threads, most <= PQ_MAX_NR) // rb
    tile = (tile + align - 1) // align * align
    if tile < align:
        tile = align
    cdef int64_t per = (rows + tile - 1) // tile
    cdef Item *items = <Item *>malloc((used * per + 1) * sizeof(Item))
    if items == NULL:
        n_items[0] = -1
        return NULL
    for x in range(n_exp):
        if first[x + 1] == first[x]:
            continue
        j = 0
        while j < rows:
            items[c].expert = <int32_t>x
            items[c].j0 = <int32_t>j
            items[c].j1 = <int32_t>(j + tile if j + tile < rows else rows)
            c += 1
            j += tile
    n_items[0] = c
    return items


cdef int _threads(int n_threads, int64_t work) noexcept nogil:
    return n_threads if work >= PARALLEL_MIN else 1


ctypedef struct MoeArgs:
    int64_t n, e, f, n_exp, R
    int n_used, n_threads
    bint norm, same_x
    float scale
    int gating, n_group, n_group_used, act
    const float *probs_b              # the expert bias, or NULL
    const float *gate_b               # the experts' own biases, or NULL
    const float *up_b
    const float *down_b
    int t_gate, t_up, t_down, vt_gate, vt_up, vt_down
    const uint8_t *gate
    const uint8_t *up
    const uint8_t *down
    int64_t gate_es, up_es, down_es, gate_rb, up_rb, down_rb
    int64_t xs_g, xs_u, aq_stride
    bint x8_gu, x8_down               # gate and up / down repacked in groups of 8 rows (ggml_x8.h)
    int64_t gs_gate, gs_up, gs_down   # their bytes per group of 8 rows
    const float *x
    const float *logits
    const float *sp                   # the shared expert's output, or NULL
    const float *sgp                  # its gate, or NULL
    float *out
    size_t need                       # bytes of scratch


cdef int64_t _x8_group_bytes(int qtype, int64_t k, str what) except -1:
    """Bytes per group of 8 repacked rows of k elements (ValueError when `qtype` is not repacked)."""
    if not pq_have_x8() or pq_x8_block_bytes(qtype) == 0:
        raise ValueError(f"moe_ffn: {what} cannot be repacked (type id {qtype}, or a build without the kernels)")
    if k % pq_x8_block_elems(qtype):
        raise ValueError(f"moe_ffn: {what}: a row of {k} elements is not a whole number of blocks")
    return k // pq_x8_block_elems(qtype) * pq_x8_block_bytes(qtype)


cdef int _moe_setup(MoeArgs *a, const float[:, ::1] x, const float[:, ::1] logits,
                    const uint8_t[:, ::1] gate, int t_gate, const uint8_t[:, ::1] up, int t_up,
                    const uint8_t[:, ::1] down, int t_down, float[:, ::1] out, int n_used, bint norm,
                    float scale, shexp, shexp_gate, int n_threads, list keep, bint x8_gate_up,
                    bint x8_down, int gating, probs_b, int n_group, int n_group_used, biases, int act) except -1:
    """Checks the arguments and fills a (the arrays it points into appended to keep); 0 when
    there is nothing to compute. x8_gate_up / x8_down: those experts come repacked in groups of
    8 rows (qmatmul.repack_x8 of each expert's rows, experts one after the other)."""
    cdef int64_t n = x.shape[0], e = x.shape[1], n_exp = logits.shape[1]
    cdef pq_traits tg = _traits(t_gate, "gate_exps"), tu = _traits(t_up, "up_exps"), td = _traits(t_down, "down_exps")
    cdef pq_traits tvg = tg, tvu = tu, tvd = td
    pq_get_traits(tg.vec_type, &tvg)
    pq_get_traits(tu.vec_type, &tvu)
    pq_get_traits(td.vec_type, &tvd)
    if logits.shape[0] != n:
        raise ValueError(f"moe_ffn: {logits.shape[0]} rows of router logits for {n} tokens")
    if n_exp < 1 or not 1 <= n_used <= n_exp:
        raise ValueError(f"moe_ffn: n_expert_used {n_used} outside 1..{n_exp}")
    if n_used > 64:
        raise ValueError(f"moe_ffn: n_expert_used {n_used} above 64")
    a.probs_b = _routing_setup(n_exp, gating, probs_b, n_group, n_group_used, keep)
    a.gating, a.n_group, a.n_group_used, a.act = gating, n_group, n_group_used, act
    if act not in (0, 1):
        raise ValueError(f"moe_ffn: activation {act} is not 0 (SwiGLU) or 1 (clamped SwiGLU)")
    a.gate_b = a.up_b = a.down_b = NULL
    if gate.shape[0] != n_exp or up.shape[0] != n_exp or down.shape[0] != n_exp:
        raise ValueError(f"moe_ffn: expert tensors have {gate.shape[0]}, {up.shape[0]}, {down.shape[0]} experts, "
                         f"the router {n_exp}")
    cdef int64_t gate_rb = _rb(tg, e, "gate_exps"), up_rb = _rb(tu, e, "up_exps")
    cdef int64_t gs_gate = 0, gs_up = 0, gs_down = 0
    if x8_gate_up:
        gs_gate, gs_up = _x8_group_bytes(t_gate, e, "gate_exps"), _x8_group_bytes(t_up, e, "up_exps")
        gate_rb, up_rb = gs_gate // 8, gs_up // 8  # (only the work estimates use them)
        if gs_gate == 0 or gate.shape[1] % gs_gate:
            raise ValueError(f"moe_ffn: repacked gate_exps of {gate.shape[1]} B are not whole groups of 8 rows")
    if gate_rb == 0 or gate.shape[1] % gate_rb:
        raise ValueError(f"moe_ffn: gate_exps rows of {gate.shape[1]} B are not whole rows of {e} elements")
    cdef int64_t f = gate.shape[1] // gs_gate * 8 if x8_gate_up else gate.shape[1] // gate_rb
    if up.shape[1] != (f // 8 * gs_up if x8_gate_up else f * up_rb):
        raise ValueError(f"moe_ffn: up_exps has {up.shape[1]} B per expert, expected {f} rows of {up_rb} B")
    cdef int64_t down_rb = _rb(td, f, "down_exps")
    if x8_down:
        if e % 8:
            raise ValueError(f"moe_ffn: repacked down_exps need a multiple of 8 rows, not {e}")
        gs_down = _x8_group_bytes(t_down, f, "down_exps")
        down_rb = gs_down // 8
    if down.shape[1] != e * down_rb:
        raise ValueError(f"moe_ffn: down_exps has {down.shape[1]} B per expert, expected {e} rows of {down_rb} B")
    if out.shape[0] != n or out.shape[1] != e:
        raise ValueError(f"moe_ffn: out is {out.shape[0]}x{out.shape[1]}, expected {n}x{e}")
    cdef const float[:, ::1] sv
    cdef const float[::1] sgv
    cdef const float *sp = NULL
    cdef const float *sgp = NULL
    if shexp is not None:
        sv = shexp
        if sv.shape[0] != n or sv.shape[1] != e:
            raise ValueError(f"moe_ffn: shexp is {sv.shape[0]}x{sv.shape[1]}, expected {n}x{e}")
        if n:
            sp = &sv[0, 0]
        keep.append(sv)
        if shexp_gate is not None:
            sgv = shexp_gate
            if sgv.shape[0] != e:
                raise ValueError(f"moe_ffn: shexp_gate has {sgv.shape[0]} elements, expected {e}")
            if e:
                sgp = &sgv[0]
            keep.append(sgv)
    elif shexp_gate is not None:
        raise ValueError("moe_ffn: shexp_gate without shexp")
    if n_threads < 1:
        raise ValueError(f"moe_ffn: n_threads must be >= 1, got {n_threads}")
    cdef const float[:, ::1] gbv
    cdef const float[:, ::1] ubv
    cdef const float[:, ::1] dbv
    if biases is not None:
        gbv, ubv, dbv = biases
        f_rows = gate.shape[1] // gs_gate * 8 if x8_gate_up else (gate.shape[1] // gate_rb if gate_rb else 0)
        if (gbv.shape[0] != n_exp or ubv.shape[0] != n_exp or dbv.shape[0] != n_exp or gbv.shape[1] != f_rows
                or ubv.shape[1] != f_rows or dbv.shape[1] != e):
            raise ValueError(f"moe_ffn: expert biases {gbv.shape[0]}x{gbv.shape[1]}, {ubv.shape[0]}x{ubv.shape[1]}, "
                             f"{dbv.shape[0]}x{dbv.shape[1]} do not fit {n_exp} experts of {f_rows} rows, width {e}")
        if n_exp and f_rows and e:
            a.gate_b, a.up_b, a.down_b = &gbv[0, 0], &ubv[0, 0], &dbv[0, 0]
        keep.extend((gbv, ubv, dbv))
    if n == 0 or e == 0:
        return 0
    if f == 0:
        raise ValueError("moe_ffn: experts with no rows")
    cdef int64_t R = n * n_used, xs_g = _rb(tvg, e, "x"), xs_u = _rb(tvu, e, "x"), aq_stride = _rb(tvd, f, "hidden")
    cdef bint same_x = tg.vec_type == tu.vec_type
    # scratch: routing, grouping, gathered activations, hidden rows, expert outputs
    a.need = (R * (2 * sizeof(int32_t) + sizeof(float) + (xs_g + (0 if same_x else xs_u))
                   + f * sizeof(float) + aq_stride + e * sizeof(float))
              + (2 * n_exp + 1) * sizeof(int32_t) + 3 * n_exp * sizeof(float) + n * (xs_g + xs_u) + 64 * 8)
    a.n, a.e, a.f, a.n_exp, a.R = n, e, f, n_exp, R
    a.n_used, a.n_threads, a.norm, a.same_x, a.scale = n_used, n_threads, norm, same_x, scale
    a.t_gate, a.t_up, a.t_down = t_gate, t_up, t_down
    a.vt_gate, a.vt_up, a.vt_down = tg.vec_type, tu.vec_type, td.vec_type
    a.gate, a.up, a.down = &gate[0, 0], &up[0, 0], &down[0, 0]
    a.gate_es, a.up_es, a.down_es = gate.strides[0], up.strides[0], down.strides[0]
    a.gate_rb, a.up_rb, a.down_rb = gate_rb, up_rb, down_rb
    a.xs_g, a.xs_u, a.aq_stride = xs_g, xs_u, aq_stride
    a.x8_gu, a.x8_down, a.gs_gate, a.gs_up, a.gs_down = x8_gate_up, x8_down, gs_gate, gs_up, gs_down
    a.x, a.logits, a.out = &x[0, 0], &logits[0, 0], &out[0, 0]
    a.sp, a.sgp = sp, sgp
    keep.extend((x, logits, gate, up, down, out))
    return 1


cdef int64_t _moe_compute(const MoeArgs *a, uint8_t *mem) noexcept nogil:
    """The MoE FFN with its scratch at mem (a.need bytes): the number of experts computed, or -1
    when its work items could not be allocated."""
    cdef int64_t n = a.n, e = a.e, f = a.f, n_exp = a.n_exp, R = a.R, n_used = a.n_used
    cdef int64_t xs_g = a.xs_g, xs_u = a.xs_u, aq_stride = a.aq_stride
    cdef bint same_x = a.same_x
    cdef int n_threads = a.n_threads
    cdef const float *sp = a.sp
    cdef const float *sgp = a.sgp
    cdef uint8_t *cur = mem
    cdef int32_t *ids = <int32_t *>cur
    cur += R * sizeof(int32_t)
    cdef int32_t *slot_row = <int32_t *>cur
    cur += R * sizeof(int32_t)
    cdef float *wts = <float *>cur
    cur += R * sizeof(float)
    cdef int32_t *first = <int32_t *>cur
    cur += (n_exp + 1) * sizeof(int32_t)
    cdef int32_t *fill = <int32_t *>cur
    cur += n_exp * sizeof(int32_t)
    cdef float *p = <float *>cur
    cur += 3 * n_exp * sizeof(float)
    cur += (-<size_t>cur) % 64
    cdef uint8_t *xq_g = cur
    cur += n * xs_g
    cdef uint8_t *xq_u = cur
    cur += n * xs_u
    cur += (-<size_t>cur) % 64
    cdef uint8_t *xg_g = cur
    cur += R * xs_g
    cdef uint8_t *xg_u = xg_g
    if not same_x:
        cur += (-<size_t>cur) % 64
        xg_u = cur
        cur += R * xs_u
    cur += (-<size_t>cur) % 64
    cdef float *hg = <float *>cur
    cur += R * f * sizeof(float)
    cur += (-<size_t>cur) % 64
    cdef uint8_t *aq = cur
    cur += R * aq_stride
    cur += (-<size_t>cur) % 64
    cdef float *y = <float *>cur

    cdef MoeJob jb
    cdef Item *items_a = NULL
    cdef Item *items_b = NULL
    cdef int64_t na = 0, nb = 0, t, xx, r, c, used = 0
    cdef int j
    cdef float gsum, sg
    cdef const float **mix_rows = <const float **>malloc(sizeof(float *) * n_used)
    cdef const float *xp = a.x
    cdef const float *lp = a.logits
    cdef float *op = a.out
    _route(lp, n, n_exp, <int>n_used, a.norm, a.scale, a.gating, a.probs_b, a.n_group, a.n_group_used, ids, wts, p)
    # group the (token, slot) pairs by expert, tokens in order within an expert
    for xx in range(n_exp + 1):
        first[xx] = 0
    for r in range(R):
        first[ids[r] + 1] += 1
    for xx in range(n_exp):
        if first[xx + 1]:
            used += 1
        first[xx + 1] += first[xx]
    for xx in range(n_exp):
        fill[xx] = 0
    for t in range(n):
        for j in range(n_used):
            xx = ids[t * n_used + j]
            r = first[xx] + fill[xx]
            fill[xx] += 1
            slot_row[t * n_used + j] = <int32_t>r
    # each token's activations quantized once per dot-product type, then gathered
    for t in range(n):
        pq_quantize_row(a.vt_gate, xp + t * e, xq_g + t * xs_g, e)
        if not same_x:
            pq_quantize_row(a.vt_up, xp + t * e, xq_u + t * xs_u, e)
    if a.x8_gu:  # in the order the repacked kernels read
        pq_x8_prepare_x(a.vt_gate, xq_g, n, e, xs_g)
        if not same_x:
            pq_x8_prepare_x(a.vt_up, xq_u, n, e, xs_u)
    for t in range(n):
        for j in range(n_used):
            r = slot_row[t * n_used + j]
            memcpy(xg_g + r * xs_g, xq_g + t * xs_g, xs_g)
            if not same_x:
                memcpy(xg_u + r * xs_u, xq_u + t * xs_u, xs_u)
    jb.t_gate, jb.t_up, jb.t_down = a.t_gate, a.t_up, a.t_down
    jb.e, jb.f = e, f
    jb.gate, jb.up, jb.down = a.gate, a.up, a.down
    jb.gate_es, jb.up_es, jb.down_es = a.gate_es, a.up_es, a.down_es
    jb.gate_rb, jb.up_rb, jb.down_rb = a.gate_rb, a.up_rb, a.down_rb
    jb.first = first
    jb.xg_gate, jb.xg_up, jb.xs_gate, jb.xs_up = xg_g, xg_u, xs_g, xs_u
    jb.hg, jb.aq, jb.aq_stride, jb.y = hg, aq, aq_stride, y
    jb.nr_x8, jb.gs_gate, jb.gs_up, jb.gs_down = pq_x8_max_rows(), a.gs_gate, a.gs_up, a.gs_down
    jb.gate_b, jb.up_b, jb.down_b, jb.act = a.gate_b, a.up_b, a.down_b, a.act
    items_a = _items(first, n_exp, f, a.gate_rb + a.up_rb, n_threads, 8 if a.x8_gu else 1, &na)
    items_b = _items(first, n_exp, e, a.down_rb, n_threads, 8 if a.x8_down else 1, &nb)
    if items_a != NULL and items_b != NULL and mix_rows != NULL:
        jb.items = items_a
        pool_run(_threads(n_threads, used * f * (a.gate_rb + a.up_rb) * ((R // used + 3) // 4)), na,
                 _gate_up_item_x8 if a.x8_gu else _gate_up_item, &jb)
        jb.hsrc, jb.qdst, jb.q_k, jb.q_stride, jb.q_type = hg, aq, f, aq_stride, a.vt_down
        pool_run(_threads(n_threads, R * f * 8), R, _quantize_item, &jb)
        if a.x8_down:
            pq_x8_prepare_x(a.vt_down, aq, R, f, aq_stride)
        jb.items = items_b
        pool_run(_threads(n_threads, used * e * a.down_rb * ((R // used + 3) // 4)), nb,
                 _down_item_x8 if a.x8_down else _down_item, &jb)
        # the weighted sum in each token's top-k order (ggml's mul, then its adds), then the shared expert
        for t in range(n):
            for j in range(n_used):
                mix_rows[j] = y + slot_row[t * n_used + j] * e
            pv_moe_mix(op + t * e, mix_rows, wts + t * n_used, n_used, e)
            if sp != NULL:
                sg = 1.0
                if sgp != NULL:
                    gsum = 0.0
                    for c in range(e):
                        gsum += xp[t * e + c] * sgp[c]
                    sg = 1.0 / (1.0 + expf(-gsum))
                for c in range(e):
                    op[t * e + c] += sg * sp[t * e + c]
    free(items_a)
    free(items_b)
    free(mix_rows)
    if na < 0 or nb < 0 or items_a == NULL or items_b == NULL or mix_rows == NULL:
        return -1
    return used


cdef int _moe_step(void *ctx, unsigned char *scratch) noexcept nogil:
    return 1 if _moe_compute(<MoeArgs *>ctx, scratch) < 0 else 0


def moe_ffn(const float[:, ::1] x, const float[:, ::1] logits,
            const uint8_t[:, ::1] gate, int t_gate, const uint8_t[:, ::1] up, int t_up,
            const uint8_t[:, ::1] down, int t_down, float[:, ::1] out, int n_used, bint norm=True,
            float scale=1.0, shexp=None, shexp_gate=None, int n_threads=1, bint x8_gate_up=False,
            bint x8_down=False, int gating=GATING_SOFTMAX, probs_b=None, int n_group=1, int n_group_used=1,
            biases=None, int act=0):
    """out[n, e] = the MoE FFN of x[n, e] (module docstring), given the router logits [n, E],
    routed by _route (gating 1 softmax, 2 sigmoid or 3 the chosen logits' softmax, probs_b an
    expert bias float32 [E] or None, n_group / n_group_used the expert groups). biases: None or
    the experts' (gate_b [E, f], up_b [E, f], down_b [E, e]) float32; act 1: the clamped SwiGLU.

    gate, up: uint8 [E, f * row_bytes(t_gate / t_up, e)] (each expert's f rows of e elements);
    down: uint8 [E, e * row_bytes(t_down, f)]. shexp: float32 [n, e] added to the result, times
    sigmoid(x . shexp_gate) when shexp_gate (float32 [e]) is given. x8_gate_up / x8_down: gate and
    up / down come repacked in groups of 8 rows instead (qmatmul.repack_x8 of all the experts'
    rows, [E, rows / 8 * bytes per group]). Returns the number of experts that were computed
    (chosen by at least one token)."""
    cdef MoeArgs a
    cdef list keep = []
    if not _moe_setup(&a, x, logits, gate, t_gate, up, t_up, down, t_down, out, n_used, norm, scale, shexp,
                      shexp_gate, n_threads, keep, x8_gate_up, x8_down, gating, probs_b, n_group, n_group_used,
                      biases, act):
        return 0
    cdef uint8_t *mem = <uint8_t *>malloc(a.need)
    if mem == NULL:
        raise MemoryError("moe_ffn: scratch")
    cdef int64_t used
    with nogil:
        used = _moe_compute(&a, mem)
    free(mem)
    if used < 0:
        raise MemoryError("moe_ffn: work items")
    return used


def bind_moe_ffn(checked, const float[:, ::1] x, const float[:, ::1] logits,
                 const uint8_t[:, ::1] gate, int t_gate, const uint8_t[:, ::1] up, int t_up,
                 const uint8_t[:, ::1] down, int t_down, float[:, ::1] out, int n_used, bint norm=True,
                 float scale=1.0, shexp=None, shexp_gate=None, int n_threads=1, bint x8_gate_up=False,
                 bint x8_down=False, int gating=GATING_SOFTMAX, probs_b=None, int n_group=1, int n_group_used=1,
                 biases=None, int act=0):
    """moe_ffn (same arguments) bound as a NativeStep (plan.pyx), its scratch the run's; None
    when there is nothing to compute."""
    cdef NativeStep s = step_for(sizeof(MoeArgs), checked)
    cdef list keep = []
    if not _moe_setup(<MoeArgs *>s.ctx, x, logits, gate, t_gate, up, t_up, down, t_down, out, n_used, norm,
                      scale, shexp, shexp_gate, n_threads, keep, x8_gate_up, x8_down, gating, probs_b, n_group,
                      n_group_used, biases, act):
        return None
    return bound(s, _moe_step, keep, (<MoeArgs *>s.ctx).need)
