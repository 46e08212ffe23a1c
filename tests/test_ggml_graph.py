"""The ggml graph builder's records: shapes, strides, sources and parameters as ggml's constructors
give them, and the scratch placement (bench/ggml_ops_check.py runs such graphs on llama.cpp's own
rpc-server against a numpy reference)."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from pyllama.backend.ggml import graph as G
from pyllama.backend.ggml import protocol as P
from pyllama.backend.ggml.protocol import GOp

BUF, BASE = 0x100, 0x7000_0000


def _layer():
    g = G.GraphBuilder()
    w = g.leaf(G.F32, [64, 32], BUF, BASE, "w")            # 32 rows of 64
    x = g.leaf(G.F32, [64, 3], BUF, BASE + 8192, "x")
    return g, w, x


def test_mul_mat_and_norm_records():
    g, w, x = _layer()
    n = g.rms_norm(x, 1e-5)
    y = g.mul_mat(w, n)
    assert y.ne == (32, 3, 1, 1) and y.nb == (4, 128, 384, 384) and y.type == G.F32
    assert y.src == (w, n) and y.op == GOp.MUL_MAT
    assert struct.unpack("<f", n.params)[0] == pytest.approx(1e-5)
    nodes, recs, used = g.finish(0x200, 0x9000_0000, 1 << 20, 32)
    assert nodes == [n.id, y.id]
    by_id = {int(r["id"]): r for r in recs}
    ry = by_id[y.id]
    assert list(ry["src"][:3]) == [w.id, n.id, 0] and ry["flags"] == P.FLAG_COMPUTE
    assert by_id[w.id]["flags"] == 0 and by_id[w.id]["data"] == BASE
    assert ry["buffer"] == 0x200 and ry["data"] >= 0x9000_0000


def test_views_share_their_root_and_carry_ggml_strides():
    g, w, x = _layer()
    q = g.mul_mat(w, x)                                     # [32, 3]
    r = g.reshape(q, [8, 4, 3])
    p = g.permute(r, 0, 2, 1, 3)                            # ne [8, 3, 4]
    assert p.ne == (8, 3, 4, 1) and p.nb == (4, 128, 32, 384)
    assert struct.unpack("<4i", p.params) == (0, 2, 1, 3)
    v = g.view(q, [8, 2], [128], 64)                        # 2 rows of 8 floats at byte 64
    assert v.nb == (4, 128, 256, 256) and struct.unpack("<Q", v.params)[0] == 64
    vv = g.view(v, [4], [], 16)
    assert vv.view_src is q and vv.view_offs == 80          # offsets add up to the root's
    t = g.transpose(q)
    assert t.ne == (3, 32, 1, 1) and t.nb == (128, 4, 384, 384)
    g.output(p)
    g.finish(0x200, 0x9000_0000, 1 << 20, 32)
    assert r.data == q.data and vv.data == q.data + 80 and r.buffer == q.buffer == 0x200


def test_set_rows_keeps_ggml_source_order_and_writes_into_a_view():
    g = G.GraphBuilder()
    cache = g.leaf(G.F16, [32, 8], BUF, BASE, "cache")
    rows = g.leaf(G.F32, [32, 3], BUF, BASE + 4096, "rows")
    idx = g.leaf(G.I64, [3], BUF, BASE + 8192, "idx")
    s = g.set_rows(cache, rows, idx)
    assert s.src == (rows, idx, cache) and s.view_src is cache and s.ne == cache.ne and s.nb == cache.nb
    with pytest.raises(ValueError):
        g.set_rows(cache, rows, g.leaf(G.F32, [3], BUF, BASE, "bad"))


def test_rope_parameters_are_ggml_s_fifteen():
    g = G.GraphBuilder()
    q = g.leaf(G.F32, [16, 4, 3], BUF, BASE)
    pos = g.leaf(G.I32, [3], BUF, BASE + 4096)
    r = g.rope_ext(q, pos, None, 16, G.ROPE_NEOX, 4096, 10000.0, 0.5, 1.0, 1.0, 32.0, 1.0)
    ints = struct.unpack("<5i", r.params[:20])
    floats = struct.unpack("<6f", r.params[20:44])
    assert ints == (0, 16, 2, 0, 4096) and floats == (10000.0, 0.5, 1.0, 1.0, 32.0, 1.0)
    assert r.params[44:60] == bytes(16) and r.src == (q, pos, None)
    with pytest.raises(ValueError):
        g.rope_ext(q, g.leaf(G.I32, [4], BUF, BASE), None, 16, 0, 0, 1e4, 1, 0, 1, 32, 1)


def test_scratch_is_reused_after_the_last_reader():
    g = G.GraphBuilder()
    x = g.leaf(G.F32, [256, 4], BUF, BASE)                  # 4 KiB
    a = g.scale(x, 2.0)                                    # read by b only
    b = g.scale(a, 2.0)                                    # read by c only
    c = g.scale(b, 2.0)
    d = g.scale(c, 2.0)
    g.output(d)
    _, _, used = g.finish(0x200, 0x1000, 1 << 20, 64)
    assert used == 2 * 4096                                # two blocks serve the chain
    assert a.data == c.data and b.data == d.data and a.data != b.data
    # an output is never overwritten by a later result
    g2 = G.GraphBuilder()
    x2 = g2.leaf(G.F32, [256, 4], BUF, BASE)
    o = g2.output(g2.scale(x2, 1.0))
    later = [g2.scale(x2, float(i)) for i in range(3)]
    g2.finish(0x200, 0x1000, 1 << 20, 64)
    assert all(t.data != o.data for t in later)


def test_a_view_keeps_its_root_alive():
    g = G.GraphBuilder()
    x = g.leaf(G.F32, [256, 4], BUF, BASE)
    a = g.scale(x, 1.0)
    va = g.view(a, [256], [], 0)                           # read through the view, later
    b = g.scale(x, 3.0)
    c = g.add(x, va)
    g.output(c)
    g.finish(0x200, 0x1000, 1 << 20, 64)
    assert b.data != a.data                                # a's bytes are still read by c


def test_scratch_too_small_is_an_error():
    g = G.GraphBuilder()
    x = g.leaf(G.F32, [1024], BUF, BASE)
    g.output(g.scale(x, 1.0))
    with pytest.raises(MemoryError):
        g.finish(0x200, 0x1000, 1024, 32)


def test_flash_attention_result_and_parameters():
    g = G.GraphBuilder()
    q = g.leaf(G.F32, [16, 3, 4], BUF, BASE)               # [hd, n, H] after ggml's permute
    k = g.leaf(G.F16, [16, 8, 2], BUF, BASE + 4096)
    v = g.leaf(G.F16, [16, 8, 2], BUF, BASE + 8192)
    m = g.leaf(G.F16, [8, 64], BUF, BASE + 16384)
    fa = g.flash_attn_ext(q, k, v, m, 0.25, 0.0, 0.0, True)
    assert fa.ne == (16, 4, 3, 1) and fa.src == (q, k, v, m)
    assert struct.unpack("<fffi", fa.params) == (0.25, 0.0, 0.0, 10)


def test_shape_errors():
    g, w, x = _layer()
    with pytest.raises(ValueError):
        g.mul_mat(w, g.leaf(G.F32, [32, 3], BUF, BASE))
    with pytest.raises(ValueError):
        g.add(x, w)
    with pytest.raises(ValueError):
        g.reshape(x, [7, 3])
    with pytest.raises(ValueError):
        g.reshape(g.transpose(x), [3, 64])
    with pytest.raises(ValueError):
        g.permute(x, 0, 0, 1, 2)
    assert np.prod(g.reshape(x, [8, 8, 3]).ne) == 192
