"""The step kernels split their work into items on the products' worker pool: results must not
depend on the thread count, and sizes on both sides of the parallel thresholds must agree with a
plain numpy computation."""
import numpy as np
import pytest

from pyllama._fast import ops

THREADS = (1, 2, 3)


# rows are handed out several to an item (about 8192 elements): 37 x 768 ends in a partial item,
# 5 x 9000 has one row per item
@pytest.mark.parametrize("n,d", [(1, 768), (32, 768), (37, 768), (64, 4096), (5, 9000)])
def test_rms_norm_is_the_same_on_any_thread_count(n, d):
    rng = np.random.default_rng(n * d)
    x = rng.standard_normal((n, d)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    outs = []
    for nt in THREADS:
        out = np.empty_like(x)
        ops.rms_norm(x, w, out, 1e-5, nt)
        outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-6)


def _silu(g):
    return g / (1 + np.exp(-g))


def _gelu_tanh(g):
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))


@pytest.mark.parametrize("name,act", [("swiglu", _silu), ("geglu", _gelu_tanh)])
@pytest.mark.parametrize("n,f", [(1, 2048), (1, 5000), (32, 2048), (3, 4097)])
def test_glu_is_the_same_on_any_thread_count(name, act, n, f):
    rng = np.random.default_rng(n + f)
    gu = rng.standard_normal((n, 2 * f)).astype(np.float32)
    outs = []
    for nt in THREADS:
        out = np.full((n, f), np.nan, np.float32)
        getattr(ops, name)(gu, out, nt)
        outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    g, u = gu[:, :f].astype(np.float64), gu[:, f:].astype(np.float64)
    np.testing.assert_allclose(outs[0], act(g) * u, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,d", [(1, 288), (37, 288), (64, 768), (5, 9000)])
def test_layer_norm_is_the_same_on_any_thread_count(n, d):
    rng = np.random.default_rng(n + d)
    x = (rng.standard_normal((n, d)) * 3 + 1).astype(np.float32)
    w, b = rng.standard_normal(d).astype(np.float32), rng.standard_normal(d).astype(np.float32)
    outs = []
    for nt in THREADS:
        out = np.full_like(x, np.nan)
        ops.layer_norm(x, w, b, out, 1e-12, nt)
        outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-12) * w + b
    np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,d", [(1, 7), (3, 768), (37, 768), (2, 5000)])
def test_gelu_is_the_same_on_any_thread_count(n, d):
    """Also far out on both sides, where the logistic form's exp overflows or vanishes."""
    rng = np.random.default_rng(n * d)
    x = (rng.standard_normal((n, d)) * 4).astype(np.float32)
    x.reshape(-1)[:4] = [-100.0, 100.0, -12.0, 0.0][:x.size]
    outs = []
    for nt in THREADS:
        out = np.full_like(x, np.nan)
        ops.gelu(x, out, nt)
        outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    np.testing.assert_allclose(outs[0], _gelu_tanh(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,L,H,Hkv,k_type", [(1, 70, 12, 4, 1), (32, 70, 12, 4, 1), (8, 300, 8, 8, 0),
                                              (16, 40, 6, 2, 8)])
def test_attention_is_the_same_on_any_thread_count(n, L, H, Hkv, k_type):
    """Sequences of L cached cells each, one new token per sequence (the decode shape), GQA
    groups of H / Hkv heads; above and below the parallel threshold."""
    rng = np.random.default_rng(n * L + H)
    hd = 64
    kvw = Hkv * hd
    n_cells = n * (L + 1)
    old = rng.standard_normal((n_cells, kvw)).astype(np.float32)
    if k_type == 0:
        cache = old
    else:
        cache = np.zeros((n_cells, ops.kv_row_nbytes(k_type, kvw)), np.uint8)
        ops.kv_store(k_type, old, cache)
    qkv = rng.standard_normal((n, (H + 2 * Hkv) * hd)).astype(np.float32)
    pos = np.full(n, L, np.int32)
    kv_idx = (np.arange(n, dtype=np.int32) * (L + 1) + L).astype(np.int32)
    cells = np.arange(n_cells, dtype=np.int32)
    ranges = np.stack([np.arange(n) * (L + 1), np.full(n, L + 1)], 1).astype(np.int32)
    e = np.zeros(0, np.float32)
    outs = []
    for nt in THREADS:
        kc, vc = cache.copy(), cache[::-1].copy()
        out = np.full((n, H * hd), np.nan, np.float32)
        ops.attention(qkv, kc, vc, pos, kv_idx, cells, ranges, e, e, out, H, Hkv, hd, hd, 2, 10000.0, 1.0,
                      1e-5, 0.125, nt, k_type, k_type)
        outs.append((out, kc, vc))
    for out, kc, vc in outs[1:]:
        np.testing.assert_array_equal(out, outs[0][0])
        np.testing.assert_array_equal(kc, outs[0][1])
        np.testing.assert_array_equal(vc, outs[0][2])
    assert np.isfinite(outs[0][0]).all()


@pytest.mark.parametrize("k_type", [0, 1])
@pytest.mark.parametrize("alibi", [False, True])
def test_encoder_attention_with_alibi_matches_numpy(k_type, alibi):
    """Sequences whose tokens each attend to the whole sequence (an encoder's micro-batch), with
    and without ALiBi's per-head slopes, GQA groups of 2, over F32 and F16 caches."""
    rng = np.random.default_rng(k_type + 2 * alibi)
    lens, H, Hkv, hd = [7, 3, 9], 4, 2, 16
    n = sum(lens)
    slopes = np.asarray([2.0 ** (-8 * (i + 1) / H) for i in range(H)], np.float32) if alibi else None
    qkv = rng.standard_normal((n, (H + 2 * Hkv) * hd)).astype(np.float32)
    row = ops.kv_row_nbytes(k_type, Hkv * hd)
    kc, vc = np.zeros((64, row), np.uint8), np.zeros((64, row), np.uint8)
    pos, ranges = [], []
    for start, L in zip(np.cumsum([0] + lens[:-1]), lens):
        pos += range(L)
        ranges += [(start, L)] * L
    pos = np.asarray(pos, np.int32)
    cells = np.arange(n, dtype=np.int32)
    empty = np.zeros(0, np.float32)
    outs = []
    for nt in THREADS:
        out = np.full((n, H * hd), np.nan, np.float32)
        ops.attention(qkv, kc, vc, pos, cells, cells, np.asarray(ranges, np.int32), empty, empty, out, H, Hkv, hd, 0,
                      2, 10000.0, 1.0, 1e-6, 1 / np.sqrt(hd), nt, k_type, k_type, alibi=slopes)
        outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    q = qkv[:, :H * hd].astype(np.float64).reshape(n, H, hd)
    k, v = (np.repeat(qkv[:, a * hd:b * hd].reshape(n, Hkv, hd), H // Hkv, axis=1)
            for a, b in ((H, H + Hkv), (H + Hkv, H + 2 * Hkv)))
    if k_type == 1:
        k, v = k.astype(np.float16), v.astype(np.float16)
    k, v = k.astype(np.float64), v.astype(np.float64)
    want = np.zeros((n, H, hd))
    for start, L in zip(np.cumsum([0] + lens[:-1]), lens):
        s = slice(start, start + L)
        for h in range(H):
            scores = q[s, h] @ k[s, h].T / np.sqrt(hd)
            if alibi:
                scores -= slopes[h] * np.abs(np.arange(L)[:, None] - np.arange(L)[None, :])
            p = np.exp(scores - scores.max(1, keepdims=True))
            want[s, h] = p / p.sum(1, keepdims=True) @ v[s, h]
    np.testing.assert_allclose(outs[0], want.reshape(n, -1), rtol=1e-5, atol=2e-6)
