"""Products against F16 and BF16 weights in llama.cpp's two forms on an AVX-512 machine, reproduced
in float32 numpy: one activation row goes through ggml's vec_dot, two or more through llamafile's
tinyBLAS (when k is a multiple of its step and the weight's rows a multiple of 4), whose one
accumulator of 16 lanes sums in another order. The activations are rounded to the weight's type
first, as ggml converts them to its vec_dot type."""
from __future__ import annotations

import numpy as np
import pytest

from pyllama._fast import ops, qmatmul
from test_attention_ggml import fma, reduce16

f32 = np.float32
F16, BF16 = 1, 30
AVX512 = ops.GGML_F32_ATTENTION  # built for AVX-512 (F and DQ)


def vec_dot_f16(w: np.ndarray, x: np.ndarray) -> np.float32:
    """ggml_vec_dot_f16: 4 accumulators of 16 lanes over steps of 64, (0 + 2) + (1 + 3), reduced,
    then the tail's float products added in double."""
    n = len(w)
    np_ = n & ~63
    s = np.zeros((4, 16), f32)
    for i in range(0, np_, 64):
        s = fma(w[i:i + 64].reshape(4, 16), x[i:i + 64].reshape(4, 16), s)
    total = np.float64(reduce16((s[0] + s[2]) + (s[1] + s[3])))
    for i in range(np_, n):
        total += np.float64(f32(w[i] * x[i]))
    return f32(total)


def tinyblas_fma(w: np.ndarray, x: np.ndarray) -> np.float32:
    """llamafile's tinyBLAS<16>: one accumulator of 16 lanes over steps of 16, reduced."""
    acc = np.zeros(16, f32)
    for i in range(0, len(w), 16):
        acc = fma(w[i:i + 16], x[i:i + 16], acc)
    return f32(reduce16(acc))


def _weights(rng, m: int, k: int, typ: int) -> tuple[np.ndarray, np.ndarray]:
    """(the weights as file bytes, the same values as floats)"""
    v = rng.standard_normal((m, k)).astype(f32)
    if typ == F16:
        h = v.astype(np.float16)
        return h.view(np.uint8).reshape(m, 2 * k).copy(), h.astype(f32)
    b = (v.view(np.uint32) >> 16).astype(np.uint16)  # truncated to BF16: exact values of the type
    return b.view(np.uint8).reshape(m, 2 * k).copy(), (b.astype(np.uint32) << 16).view(f32)


@pytest.mark.skipif(not AVX512, reason="the AVX-512 kernels follow ggml's float steps; others do not claim to")
@pytest.mark.parametrize("k", [768, 800])
@pytest.mark.parametrize("m", [16, 18])
@pytest.mark.parametrize("n", [1, 2, 9])
def test_f16_takes_vec_dot_for_one_row_and_tinyblas_for_several(n, m, k):
    rng = np.random.default_rng(n * 100 + m + k)
    w, wf = _weights(rng, m, k, F16)
    x = (rng.standard_normal((n, k)) * 3).astype(f32)
    xr = x.astype(np.float16).astype(f32)
    tiny = n >= 2 and k % 16 == 0 and m % 4 == 0
    want = np.array([[(tinyblas_fma if tiny else vec_dot_f16)(wf[j], xr[i]) for j in range(m)] for i in range(n)])
    for nt in (1, 2):
        out = np.zeros((n, m), f32)
        qmatmul.mul_mat_q(x, w, F16, out, n_threads=nt)
        np.testing.assert_array_equal(out, want, err_msg=f"{n} rows, {m} x {k}, {nt} threads")


@pytest.mark.skipif(not AVX512, reason="the AVX-512 kernels follow ggml's float steps; others do not claim to")
@pytest.mark.parametrize("typ", [F16, BF16])
def test_a_row_does_not_depend_on_the_other_rows_of_a_product_of_several(typ):
    """Within one form, rows are independent: 9 rows at once equal each row with one neighbour."""
    rng = np.random.default_rng(typ)
    m, k = 20, 1024
    w, _ = _weights(rng, m, k, typ)
    x = rng.standard_normal((9, k)).astype(f32)
    full = np.zeros((9, m), f32)
    qmatmul.mul_mat_q(x, w, typ, full, n_threads=2)
    for i in range(8):
        pair = np.zeros((2, m), f32)
        qmatmul.mul_mat_q(np.ascontiguousarray(x[i:i + 2]), w, typ, pair)
        np.testing.assert_array_equal(pair, full[i:i + 2])
