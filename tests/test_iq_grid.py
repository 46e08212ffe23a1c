"""The grid IQ weight types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) against gguf.quants.

Random bytes are valid blocks of these types once the f16 scale is finite. For each type: the
dequantization equals gguf's bit for bit; the integer block sums, scaled, give the float64 product of
gguf's dequantized weights and the Q8_K activations; mul_mat_q is within (k + 16) * 2^-24 * S of it;
the portable path and the AVX2 kernel give the same bits (both take ggml's x86 vec_dot steps, which
bench/ggml_kernels.py checks against ggml itself), whatever rows share a kernel call.
"""
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants

import quant_reference as ref

qmatmul = pytest.importorskip("pyllama._fast.qmatmul", reason="Cython extensions not built (python setup.py build_ext --inplace)")
quant = pytest.importorskip("pyllama._fast.quant")

TYPES = (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M)
K = 768
PATHS = (False, True) if qmatmul.have_avx2() else (True,)
# the factor between the integer sums and the values: d * sc * v * FACTOR (IQ1: v + delta / 8)
FACTOR = {T.IQ2_XXS: 0.125, T.IQ2_XS: 0.125, T.IQ2_S: 0.125, T.IQ3_XXS: 0.25, T.IQ3_S: 1.0, T.IQ1_S: 1.0, T.IQ1_M: 1.0}


def _set_iq1m_scale(raw: np.ndarray, h: np.ndarray) -> None:
    """IQ1_M keeps its f16 scale in the top nibbles of its 4 little-endian scale words (bytes 48..55)."""
    for j in range(4):
        word = raw[..., 48 + 2 * j].astype(np.uint16) | (raw[..., 49 + 2 * j].astype(np.uint16) << 8)
        word = (word & 0x0FFF) | (((h >> (4 * j)) & 0xF) << 12)
        raw[..., 48 + 2 * j] = (word & 0xFF).astype(np.uint8)
        raw[..., 49 + 2 * j] = (word >> 8).astype(np.uint8)


def block_scale(raw: np.ndarray, qtype: T) -> np.ndarray:
    """float64 d of each block of raw [..., bytes]."""
    if qtype == T.IQ1_M:
        w = [raw[..., 48 + 2 * j].astype(np.uint16) | (raw[..., 49 + 2 * j].astype(np.uint16) << 8) for j in range(4)]
        h = (w[0] >> 12) | ((w[1] >> 8) & 0x00F0) | ((w[2] >> 4) & 0x0F00) | (w[3] & 0xF000)
    else:
        h = raw[..., 0].astype(np.uint16) | (raw[..., 1].astype(np.uint16) << 8)
    return h.astype(np.uint16).view(np.float16).astype(np.float64)


def random_blocks(qtype: T, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [m, row_bytes]: random bytes, each block's f16 scale in +-(0.001 .. 0.1), some zero."""
    nb, size = k // 256, GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (m, nb, size), dtype=np.uint8)
    d = (rng.uniform(0.001, 0.1, (m, nb)) * rng.choice([-1, 1], (m, nb))).astype(np.float16)
    d[rng.random((m, nb)) < 0.05] = 0
    if qtype == T.IQ1_M:
        _set_iq1m_scale(raw, d.view(np.uint16))
    else:
        raw[:, :, 0:2] = d.view(np.uint8).reshape(m, nb, 2)
    return raw.reshape(m, -1)


def activations(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    x = (rng.standard_normal((n, k)) * rng.choice([0.01, 1.0, 30.0], size=(n, 1))).astype(np.float32)
    if n > 1:
        x[1] = 0
    if n > 2:
        x[2, ::7] = np.round(x[2, ::7] * 4) / 4
    return x


def gguf_weights(w: np.ndarray, qtype: T) -> np.ndarray:
    return np.asarray(quants.dequantize(np.ascontiguousarray(w), qtype), dtype=np.float64).reshape(w.shape[0], -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_exactly(qtype):
    rng = np.random.default_rng(int(qtype))
    w = random_blocks(qtype, 3, 64 * 256, rng)
    want = np.asarray(quants.dequantize(w, qtype), dtype=np.float32).reshape(-1)
    for n_threads in (1, 2):
        out = np.full(want.size, np.nan, np.float32)
        quant.dequantize(w.reshape(-1), int(qtype), want.size, out, n_threads)
        assert np.array_equal(out, want), f"max abs diff {np.abs(out - want).max()}"
    rows = np.full((2, 64 * 256), np.nan, np.float32)
    qmatmul.get_rows_q(w, int(qtype), np.array([2, 0], np.int32), rows)
    assert np.array_equal(rows, want.reshape(3, -1)[[2, 0]])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_integer_sums_give_the_dequantized_product(qtype):
    """sum over blocks of d_w d_x f (isum + dsum / 8) is the dot of gguf's values with the activations'."""
    rng = np.random.default_rng(50 + int(qtype))
    w = random_blocks(qtype, 3, K, rng)
    x = activations(3, K, rng)
    xq = qmatmul.quantize_rows(x, int(T.Q8_K))
    wf = gguf_weights(w, qtype)
    for r in range(3):
        xa = ref.decode_activation(xq[r], T.Q8_K, K)
        xd = xa.q * np.repeat(xa.d, 256)
        for j in range(3):
            s = qmatmul.int_block_sums(xq[r], w[j], int(qtype), K).astype(np.float64)
            assert s.shape == (K // 256, 18 if qtype in (T.IQ1_S, T.IQ1_M) else 17)
            isum = s[:, 16] + (s[:, 17] / 8 if s.shape[1] == 18 else 0)
            d = block_scale(w[j].reshape(-1, GGML_QUANT_SIZES[qtype][1]), qtype)
            got = (d * xa.d * FACTOR[qtype] * isum).sum()
            want = (wf[j] * xd).sum()
            assert abs(got - want) <= 1e-12 * (np.abs(wf[j] * xd).sum() + 1e-30), (r, j)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_mul_mat_q_within_the_bound_and_paths_identical(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    m, n = 13, 9
    w = random_blocks(qtype, m, K, rng)
    x = activations(n, K, rng)
    xq = qmatmul.quantize_rows(x, int(T.Q8_K))
    xd = np.stack([(lambda a: a.q * np.repeat(a.d, 256))(ref.decode_activation(xq[r], T.Q8_K, K)) for r in range(n)])
    wf = gguf_weights(w, qtype)
    exact = xd @ wf.T
    # each element's terms: |v| and, for IQ1, the delta's |1/8| apart (|v + delta| >= 7/9 (|v| + |delta|))
    S = np.abs(xd) @ np.abs(wf).T * (9 / 7 if qtype in (T.IQ1_S, T.IQ1_M) else 1)
    tol = ref.tolerance(K, 1) * S
    results = {}
    for portable in PATHS:
        out = np.full((n, m), np.nan, np.float32)
        qmatmul.mul_mat_q(x, w, int(qtype), out, portable=portable)
        err = np.abs(out.astype(np.float64) - exact)
        assert (err <= tol).all(), f"portable={portable}: worst error / bound {np.max(err / np.maximum(tol, 1e-300))}"
        results[portable] = out
        for r in range(n):   # a row alone gives the bits it gets beside the others
            one = np.empty((1, m), np.float32)
            qmatmul.mul_mat_q(x[r:r + 1], w, int(qtype), one, portable=portable)
            np.testing.assert_array_equal(one[0], out[r], err_msg=f"row {r}, portable={portable}")
    if len(results) == 2:
        np.testing.assert_array_equal(results[False], results[True])


def test_types_are_supported_everywhere():
    from pyllama._fast import wire
    from pyllama.ir.tensor import QUANT_TYPES
    for qtype in TYPES:
        assert int(qtype) in qmatmul.supported_types()
        assert qmatmul.vec_dot_type(int(qtype)) == int(T.Q8_K)
        assert qmatmul.row_bytes(int(qtype), K) == K // 256 * GGML_QUANT_SIZES[qtype][1]
        assert qtype in QUANT_TYPES and int(qtype) in wire.SUPPORTED_DTYPES
        assert int(qtype) not in qmatmul.x8_types()
