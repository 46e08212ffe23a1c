"""Attention over F32 caches in ggml's own float steps (llama.cpp's CPU path without flash
attention), reproduced here in float32 numpy: RoPE's float angle chain and sincosf, the KQ dot of
ggml_vec_dot_f32, soft_max_ext's vector exp and double sums, and KQV's lanes over the cells.

A fused multiply-add is emulated as the float32 rounding of the exact float64 a * b + c (exact
product, one rounding of the sum in float64 before float32: a double rounding that can differ
only on ties of the float64 sum, which random data does not hit)."""
from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest

from pyllama._fast import ops

f32 = np.float32
_libm = ctypes.CDLL(ctypes.util.find_library("m"))
_libm.cosf.restype = _libm.sinf.restype = _libm.powf.restype = ctypes.c_float
_libm.cosf.argtypes = _libm.sinf.argtypes = [ctypes.c_float]
_libm.powf.argtypes = [ctypes.c_float, ctypes.c_float]


def fma(a, b, c):
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(f32)


def reduce16(v: np.ndarray) -> np.ndarray:
    """_mm512_reduce_add_ps over the last axis (16): halves, quarters, (0 + 2) + (1 + 3)."""
    h = v[..., :8] + v[..., 8:]
    q = h[..., :4] + h[..., 4:]
    return (q[..., 0] + q[..., 2]) + (q[..., 1] + q[..., 3])


def vec_dot_f32(x: np.ndarray, y: np.ndarray) -> np.float32:
    """ggml_vec_dot_f32 on AVX-512: 4 accumulators of 16 lanes over steps of 64, then the tail one
    element at a time, each product rounded before it is added."""
    n = len(x)
    np_ = n & ~63
    s = np.zeros((4, 16), f32)
    for i in range(0, np_, 64):
        s = fma(x[i:i + 64].reshape(4, 16), y[i:i + 64].reshape(4, 16), s)
    total = reduce16((s[0] + s[2]) + (s[1] + s[3]))
    for i in range(np_, n):  # the tail's `sumf += x[i]*y[i]`: llama.cpp's build rounds the product first
        total = f32(total + f32(x[i] * y[i]))  # (bench/ggml_attention.py --head-dim 96 against its library)
    return f32(total)


def ggml_exp(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf (AVX-512 form) for finite x whose result is a normal float."""
    shift = f32(float.fromhex("0x1.8p23"))
    z = fma(x, f32(float.fromhex("0x1.715476p+0")), shift)
    n = z - shift
    b = fma(-n, f32(float.fromhex("0x1.7f7d1cp-20")), fma(-n, f32(float.fromhex("0x1.62e4p-1")), x))
    u = b * b
    j = fma(fma(fma(f32(float.fromhex("0x1.0e4020p-7")), b, f32(float.fromhex("0x1.573e2ep-5"))), u,
                fma(f32(float.fromhex("0x1.555e66p-3")), b, f32(float.fromhex("0x1.fffdb6p-2")))),
            u, fma(f32(float.fromhex("0x1.ffffecp-1")), b, f32(1.0)))
    return np.ldexp(j, n.astype(np.int32)).astype(f32)


def ggml_head(q: np.ndarray, K: np.ndarray, V: np.ndarray, scale: float, lanes: int) -> np.ndarray:
    """One query head over the listed cells' K and V rows (float32), as llama.cpp computes it."""
    n, hd = K.shape
    s = np.array([vec_dot_f32(K[j], q) for j in range(n)], f32) * f32(scale)
    e = ggml_exp(s - s.max())
    padded = np.zeros(-(-n // 16) * 16, f32)
    padded[:n] = e
    total = 0.0
    for blk in padded.reshape(-1, 16):
        total += float(reduce16(blk))
    p = e * f32(1.0 / total)
    acc = np.zeros((lanes, V.shape[1]), f32)  # V rows may be narrower than K's (latent attention)
    for j in range(n):
        acc[j % lanes] = fma(V[j], p[j], acc[j % lanes])
    if lanes == 64:
        acc = (acc[:16] + acc[32:48]) + (acc[16:32] + acc[48:])
    return reduce16(acc.T)


def _run(qkv, kc, vc, pos, kv_idx, cells, ranges, H, Hkv, hd, n_rot, mode=0, base=10000.0, freq_scale=1.0,
         scale=0.125, n_threads=1, rope_freqs=None):
    out = np.zeros((qkv.shape[0], H * hd), f32)
    empty = np.zeros(0, f32)
    ops.attention(qkv, kc, vc, pos, kv_idx, cells, ranges, empty, empty, out, H, Hkv, hd, n_rot, mode, base,
                  freq_scale, 1e-6, scale, n_threads, rope_freqs=rope_freqs)
    return out


@pytest.mark.skipif(not ops.GGML_F32_ATTENTION, reason="this build keeps the general attention kernel")
@pytest.mark.parametrize("hd", [64, 80, 128])
@pytest.mark.parametrize("n_cells", [1, 13, 70, 200])
def test_attention_is_ggml_float_steps(hd, n_cells):
    rng = np.random.default_rng(hd * 1000 + n_cells)
    H, Hkv, n_tok = 4, 2, 3
    scale = 1.0 / np.sqrt(hd)
    kc = rng.standard_normal((n_cells + n_tok, Hkv * hd)).astype(f32)
    vc = rng.standard_normal((n_cells + n_tok, Hkv * hd)).astype(f32)
    qkv = (2 * rng.standard_normal((n_tok, (H + 2 * Hkv) * hd))).astype(f32)
    # token t writes cell n_cells - 1 + t and attends to the cells up to it
    first = n_cells - 1
    kv_idx = np.arange(first, first + n_tok, dtype=np.int32)
    cells = np.arange(first + n_tok, dtype=np.int32)
    ranges = np.array([[0, first + t + 1] for t in range(n_tok)], np.int32)
    pos = kv_idx.copy()
    got1 = _run(qkv, kc, vc, pos, kv_idx, cells, ranges, H, Hkv, hd, n_rot=0, scale=scale)
    # the kernel stored each token's k and v (no rotation) before any token attended
    kc[kv_idx] = qkv[:, H * hd:(H + Hkv) * hd]
    vc[kv_idx] = qkv[:, (H + Hkv) * hd:]
    G = H // Hkv
    for t in range(n_tok):
        listed = cells[ranges[t, 0]:ranges[t, 0] + ranges[t, 1]]
        for h in range(H):
            g = h // G
            want = ggml_head(qkv[t, h * hd:(h + 1) * hd], kc[listed, g * hd:(g + 1) * hd],
                             vc[listed, g * hd:(g + 1) * hd], scale, 16)
            np.testing.assert_array_equal(got1[t, h * hd:(h + 1) * hd], want, err_msg=f"token {t} head {h}")
    # a step of one row takes ggml_vec_dot_f32's form (tinyBLAS refuses one row), as llama.cpp's
    # does; threads change nothing
    for t in range(n_tok):
        sl = slice(t, t + 1)
        listed = cells[ranges[t, 0]:ranges[t, 0] + ranges[t, 1]]
        for n_threads in (1, 2):
            alone = _run(qkv[sl], kc, vc, pos[sl], kv_idx[sl], cells, ranges[sl], H, Hkv, hd, n_rot=0,
                         scale=scale, n_threads=n_threads)
            for h in range(H):
                g = h // G
                want = ggml_head(qkv[t, h * hd:(h + 1) * hd], kc[listed, g * hd:(g + 1) * hd],
                                 vc[listed, g * hd:(g + 1) * hd], scale, 64)
                np.testing.assert_array_equal(alone[0, h * hd:(h + 1) * hd], want,
                                              err_msg=f"one row, token {t} head {h}")
        if ranges[t, 1] <= 16:  # the two forms agree up to 16 cells
            np.testing.assert_array_equal(alone[0], got1[t])


def rope_cache(pos: int, n_rot: int, base: float, freq_scale: float, factors=None) -> np.ndarray:
    """ggml_rope_cache_init without YaRN mixing: [cos, sin] per pair, all in float."""
    theta_scale = f32(_libm.powf(f32(base), f32(-2.0) / f32(n_rot)))
    theta = f32(pos)
    out = []
    for i in range(n_rot // 2):
        th = f32(f32(freq_scale) * (theta / f32(factors[i]) if factors is not None else theta))
        out.append((_libm.cosf(th), _libm.sinf(th)))
        theta = f32(theta * theta_scale)
    return np.array(out, f32)


@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("freq_scale,factors", [(1.0, False), (0.25, False), (1.0, True)],
                         ids=["plain", "linear", "factors"])
def test_rope_angles_are_ggml_float_chain(mode, freq_scale, factors):
    """k = (1, 0) in every pair rotates to (cos, sin) exactly: the stored k row shows the angles."""
    hd = n_rot = 64
    base = 500000.0
    rng = np.random.default_rng(3)
    ff = (1 + 7 * rng.random(n_rot // 2)).astype(f32) if factors else None
    positions = np.array([0, 1, 7, 100, 4095, 70000], np.int32)
    n = len(positions)
    k = np.zeros(hd, f32)
    if mode == 0:
        k[0::2] = 1
    else:
        k[:n_rot // 2] = 1
    qkv = np.zeros((n, 3 * hd), f32)
    qkv[:, hd:2 * hd] = k
    kc = np.zeros((n, hd), f32)
    vc = np.zeros((n, hd), f32)
    idx = np.arange(n, dtype=np.int32)
    ranges = np.stack([idx, np.ones(n, np.int32)], axis=1).astype(np.int32)
    _run(qkv, kc, vc, positions, idx, idx, ranges, 1, 1, hd, n_rot, mode=mode, base=base, freq_scale=freq_scale,
         rope_freqs=ff)
    for row, p in zip(kc, positions):
        want = rope_cache(int(p), n_rot, base, freq_scale, ff)
        got = np.stack([row[0::2], row[1::2]], axis=1) if mode == 0 else \
            np.stack([row[:n_rot // 2], row[n_rot // 2:]], axis=1)
        np.testing.assert_array_equal(got, want, err_msg=f"position {p}")


@pytest.mark.skipif(not ops.GGML_F32_ATTENTION, reason="this build keeps the general attention kernel")
@pytest.mark.parametrize("n_cells", [1, 13, 70])
@pytest.mark.parametrize("rows", [1, 3])
def test_latent_attention_is_ggml_float_steps(n_cells, rows):
    """DeepSeek's latent attention over an F32 cache (ops.mla_attend): one KV head whose rows are
    latent + rope values (288 here: a tail of 32 after the steps of 64), the values each row's first
    256; every head's output is ggml's KQ, soft_max_ext and KQV steps (16 lanes in a step of several
    rows, 64 in a step of one)."""
    rng = np.random.default_rng(n_cells * 10 + rows)
    H, lora, width = 12, 256, 288
    scale = float(f32(1 / np.sqrt(192)))
    cache = rng.standard_normal((n_cells + rows, width)).astype(f32)
    query = (2 * rng.standard_normal((rows, H * width))).astype(f32)
    first = n_cells - 1
    cells = np.arange(first + rows, dtype=np.int32)
    ranges = np.array([[0, first + t + 1] for t in range(rows)], np.int32)
    out = np.zeros((rows, H * lora), f32)
    assert ops.mla_attend(query, cache, cells, ranges, H, width, lora, scale, out)
    lanes = 64 if rows == 1 else 16
    for t in range(rows):
        listed = cells[:ranges[t, 1]]
        for h in range(H):
            want = ggml_head(query[t, h * width:(h + 1) * width], cache[listed], cache[listed, :lora], scale, lanes)
            np.testing.assert_array_equal(out[t, h * lora:(h + 1) * lora], want, err_msg=f"token {t} head {h}")


def test_latent_attention_refuses_what_it_cannot_take():
    cache = np.zeros((4, 288), f32)
    out = np.zeros((1, 2 * 256), f32)
    q = np.zeros((1, 2 * 288), f32)
    cells = np.arange(4, dtype=np.int32)
    with pytest.raises(ValueError, match="outside"):
        ops.mla_attend(q, cache, cells, np.array([[0, 5]], np.int32), 2, 288, 256, 0.1, out)
    with pytest.raises(ValueError, match="outside the cache"):
        ops.mla_attend(q, cache, np.array([0, 9], np.int32), np.array([[0, 2]], np.int32), 2, 288, 256, 0.1, out)
    with pytest.raises(ValueError, match="shapes"):
        ops.mla_attend(q, cache, cells, np.array([[0, 2]], np.int32), 3, 288, 256, 0.1, out)
    # widths without ggml's vector steps: nothing done, the caller computes it otherwise
    assert not ops.mla_attend(np.zeros((1, 40), f32), np.zeros((4, 20), f32), cells, np.array([[0, 2]], np.int32),
                              2, 20, 8, 0.1, np.zeros((1, 16), f32))


_libm.logf.restype = _libm.expf.restype = ctypes.c_float
_libm.logf.argtypes = _libm.expf.argtypes = [ctypes.c_float]


def rope_yarn_cache(pos: int, n_dims: int, base: float, freq_scale: float, ext: float, attn_factor: float,
                    n_ctx_orig: int, beta_fast: float = 32.0, beta_slow: float = 1.0) -> np.ndarray:
    """ggml_rope_cache_init with rope_yarn, in float as llama.cpp's build computes it: [cos, sin] per pair."""
    pi = f32(np.pi)

    def corr(beta: float) -> np.float32:
        return f32(f32(n_dims * _libm.logf(f32(f32(n_ctx_orig) / f32(f32(beta) * f32(2) * pi))))
                   / f32(f32(2) * _libm.logf(f32(base))))
    low = max(f32(0), f32(np.floor(corr(beta_fast))))
    high = min(f32(n_dims - 1), f32(np.ceil(corr(beta_slow))))
    theta_scale = f32(_libm.powf(f32(base), f32(-2.0) / f32(n_dims)))
    mscale = f32(attn_factor)
    if ext != 0:
        mscale = f32(mscale * fma(f32(0.1), _libm.logf(f32(f32(1) / f32(freq_scale))), f32(1)))
    theta = f32(pos)
    out = []
    for i in range(n_dims // 2):
        interp = f32(f32(freq_scale) * theta)
        th = interp
        if ext != 0:
            y = f32(f32(f32(i) - low) / max(f32(0.001), f32(high - low)))
            ramp = f32(f32(1 - min(f32(1), max(f32(0), y))) * f32(ext))
            th = fma(interp, f32(1 - ramp), f32(theta * ramp))
        out.append((f32(_libm.cosf(th) * mscale), f32(_libm.sinf(th) * mscale)))
        theta = f32(theta * theta_scale)
    return np.array(out, f32)


@pytest.mark.parametrize("freq_scale,ext,attn_factor,n_orig", [(1.0, 0.0, 1.0, 0), (0.025, 1.0, 0.71, 4096),
                                                               (0.25, 1.0, 1.0, 4096)],
                         ids=["plain", "yarn-40", "yarn-4"])
def test_rope_rows_angles_are_ggml_float_chain(freq_scale, ext, attn_factor, n_orig):
    """ops.rope_rows (latent attention's RoPE) on (1, 0) pairs gives each pair's (cos, sin) times
    the magnitude scale: ggml's rope_yarn angles, YaRN's ramp and mscale included."""
    n_dims = 32
    positions = np.array([0, 1, 7, 100, 4095, 70000], np.int32)
    x = np.zeros((len(positions), 2, n_dims), f32)
    x[:, :, 0::2] = 1
    ops.rope_rows(x, positions, 10000.0, freq_scale, ext, attn_factor, 32.0, 1.0, n_orig)
    for row, p in zip(x, positions):
        want = rope_yarn_cache(int(p), n_dims, 10000.0, freq_scale, ext, attn_factor, n_orig)
        for h in range(2):
            np.testing.assert_array_equal(np.stack([row[h, 0::2], row[h, 1::2]], axis=1), want,
                                          err_msg=f"position {p}")
