"""RoPE in ggml's float steps: the angle chain theta *= theta_scale in float from the position, each
pair's angle freq_scale * theta / factor in float, cos and sin from the C library's float functions
(ggml_rope_cache_init), and the rotation with ggml's contraction."""
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


def _run(qkv, kc, vc, pos, kv_idx, cells, ranges, H, Hkv, hd, n_rot, mode=0, base=10000.0, freq_scale=1.0,
         scale=0.125, n_threads=1, rope_freqs=None):
    out = np.zeros((qkv.shape[0], H * hd), f32)
    empty = np.zeros(0, f32)
    ops.attention(qkv, kc, vc, pos, kv_idx, cells, ranges, empty, empty, out, H, Hkv, hd, n_rot, mode, base,
                  freq_scale, 1e-6, scale, n_threads, rope_freqs=rope_freqs)
    return out


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
