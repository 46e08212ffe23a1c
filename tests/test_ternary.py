"""The ternary weight types TQ1_0 and TQ2_0 against gguf.quants and the float64 product.

TQ1_0 packs five base-3 digits per byte (and four in its last 4 bytes), TQ2_0 four 2-bit fields per
byte; each digit is a weight's -1, 0 or +1 plus one, times the block's f16 scale. Random bytes are valid
blocks once the scale is finite (a TQ1_0 byte of 243 or more, which ggml's quantizer never writes, and a
TQ2_0 field of 3 decode as ggml decodes them). For each type: dequantization equals gguf's bit for bit;
the 8 integer lanes per block, scaled, give the float64 product; mul_mat_q is within the bound; the
portable path and the AVX2 kernel give the same bits (both take ggml's x86 vec_dot steps, which
bench/ggml_kernels.py checks against ggml itself), whatever rows share a kernel call.
"""
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants

import quant_reference as ref

qmatmul = pytest.importorskip("pyllama._fast.qmatmul", reason="Cython extensions not built (python setup.py build_ext --inplace)")
quant = pytest.importorskip("pyllama._fast.quant")

TYPES = (T.TQ1_0, T.TQ2_0)
K = 768
PATHS = (False, True) if qmatmul.have_avx2() else (True,)
SCALE_AT = {T.TQ1_0: 52, T.TQ2_0: 64}   # the f16 scale closes the block


def random_blocks(qtype: T, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [m, row_bytes]: random bytes (every byte value in the first block of a row), each block's
    f16 scale in +-(0.001 .. 0.1), some zero."""
    nb, size = k // 256, GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (m, nb, size), dtype=np.uint8)
    raw[:, 0, :52] = rng.permutation(256)[:52].astype(np.uint8)   # high bytes too
    d = (rng.uniform(0.001, 0.1, (m, nb)) * rng.choice([-1, 1], (m, nb))).astype(np.float16)
    d[rng.random((m, nb)) < 0.05] = 0
    at = SCALE_AT[qtype]
    raw[:, :, at:at + 2] = d.view(np.uint8).reshape(m, nb, 2)
    return raw.reshape(m, -1)


def every_byte_rows(qtype: T, k: int = K) -> np.ndarray:
    """Rows of k whose blocks' data bytes take every value 0..255 at every position (scale 1)."""
    at, nb = SCALE_AT[qtype], k // 256
    raw = np.zeros((256 + (-256) % nb, GGML_QUANT_SIZES[qtype][1]), np.uint8)
    for b in range(raw.shape[0]):
        raw[b, :at] = (np.arange(at) + b) % 256
    raw[:, at:at + 2] = np.array([1.0], np.float16).view(np.uint8)
    return raw.reshape(-1, nb * raw.shape[1])


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
    for w in (random_blocks(qtype, 3, 64 * 256, rng), every_byte_rows(qtype)):
        want = np.asarray(quants.dequantize(w, qtype), dtype=np.float32).reshape(-1)
        for n_threads in (1, 2):
            out = np.full(want.size, np.nan, np.float32)
            quant.dequantize(w.reshape(-1), int(qtype), want.size, out, n_threads)
            assert np.array_equal(out, want), f"max abs diff {np.abs(out - want).max()}"
    w = random_blocks(qtype, 3, 64 * 256, rng)
    rows = np.full((2, 64 * 256), np.nan, np.float32)
    qmatmul.get_rows_q(w, int(qtype), np.array([2, 0], np.int32), rows)
    assert np.array_equal(rows, gguf_weights(w, qtype).astype(np.float32)[[2, 0]])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantized_values_are_the_signs_of_the_large_weights(qtype):
    """gguf's (ggml's reference) quantizer: |x| >= max / 2 keeps its sign, the scale is the block's max."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    raw = quants.quantize(x, qtype)
    out = np.empty(x.size, np.float32)
    quant.dequantize(raw.reshape(-1), int(qtype), x.size, out)
    amax = np.abs(x.reshape(-1, 256)).max(axis=1, keepdims=True).astype(np.float16).astype(np.float32)
    want = np.where(np.abs(x.reshape(-1, 256)) >= amax / 2, np.sign(x.reshape(-1, 256)), 0) * amax
    np.testing.assert_array_equal(out.reshape(-1, 256), want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_integer_lanes_give_the_dequantized_product(qtype):
    """sum over blocks of d_w d_x (sum of the 8 lanes) is the dot of gguf's values with the activations'."""
    rng = np.random.default_rng(50 + int(qtype))
    w = np.concatenate([random_blocks(qtype, 3, K, rng), every_byte_rows(qtype)])
    x = activations(3, K, rng)
    xq = qmatmul.quantize_rows(x, int(T.Q8_K))
    wf = gguf_weights(w, qtype)
    for r in range(3):
        xa = ref.decode_activation(xq[r], T.Q8_K, K)
        xd = xa.q * np.repeat(xa.d, 256)
        for j in range(w.shape[0]):
            s = qmatmul.int_block_sums(xq[r], w[j], int(qtype), K).astype(np.float64)
            assert s.shape == (K // 256, 8)
            at = SCALE_AT[qtype]
            d = w[j].reshape(-1, GGML_QUANT_SIZES[qtype][1])[:, at:at + 2].copy().view(np.float16)[:, 0].astype(np.float64)
            got = (d * xa.d * s.sum(axis=1)).sum()
            want = (wf[j] * xd).sum()
            assert abs(got - want) <= 1e-12 * (np.abs(wf[j] * xd).sum() + 1e-30), (r, j)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_mul_mat_q_within_the_bound_and_paths_identical(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    m, n = 13, 9
    w = np.concatenate([random_blocks(qtype, m, K, rng), every_byte_rows(qtype)])
    m = w.shape[0]
    x = activations(n, K, rng)
    xq = qmatmul.quantize_rows(x, int(T.Q8_K))
    xd = np.stack([(lambda a: a.q * np.repeat(a.d, 256))(ref.decode_activation(xq[r], T.Q8_K, K)) for r in range(n)])
    wf = gguf_weights(w, qtype)
    exact = xd @ wf.T
    # each lane holds digits 0..2 times q_x less the q_x of 32 elements: terms of |d_x q_x| d_w at most 3
    S = np.abs(xd) @ np.abs(np.where(wf == 0, 1.0, wf)).T * 3
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
