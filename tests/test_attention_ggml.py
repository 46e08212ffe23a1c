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
    """ggml_vec_dot_f32 on AVX-512: 4 accumulators of 16 lanes over steps of 64, then the tail."""
    n = len(x)
    np_ = n & ~63
    s = np.zeros((4, 16), f32)
    for i in range(0, np_, 64):
        s = fma(x[i:i + 64].reshape(4, 16), y[i:i + 64].reshape(4, 16), s)
    total = reduce16((s[0] + s[2]) + (s[1] + s[3]))
    for i in range(np_, n):
        total = fma(x[i], y[i], total)
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
    acc = np.zeros((lanes, hd), f32)
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
