"""The streaming small-batch matrix product (_fast/gemm.pyx) against float64 numpy."""
import numpy as np
import pytest

from pyllama._fast import gemm


def _ref(x, w, bias=None):
    r = x.astype(np.float64) @ w.astype(np.float64).T
    return r if bias is None else r + bias


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 13, 32])
@pytest.mark.parametrize("n,k", [(1, 1), (3, 15), (4, 16), (7, 17), (64, 64), (130, 200), (33, 768)])
def test_matches_reference(m, n, k):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    out = np.full((m, n), np.nan, dtype=np.float32)
    gemm.mul_mat_t(x, w, out)
    np.testing.assert_allclose(out, _ref(x, w), rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bias_and_threads(threads):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 96), dtype=np.float32)
    w = rng.standard_normal((1000, 96), dtype=np.float32)  # 250 blocks: several thread chunks
    b = rng.standard_normal(1000, dtype=np.float32)
    out = np.empty((6, 1000), dtype=np.float32)
    gemm.mul_mat_t(x, w, out, b, threads)
    np.testing.assert_allclose(out, _ref(x, w, b), rtol=1e-4, atol=1e-3)
    one = np.empty_like(out)
    gemm.mul_mat_t(x, w, one, b, 1)
    assert np.array_equal(out, one), "thread count changed the result"


def test_strided_rows():
    rng = np.random.default_rng(2)
    big_x = rng.standard_normal((10, 80), dtype=np.float32)
    x = big_x[::2, 8:72]                      # 5 rows of 64 with a row stride of 160 floats
    w = rng.standard_normal((9, 64), dtype=np.float32)
    big_out = np.zeros((5, 20), dtype=np.float32)
    out = big_out[:, 3:12]
    gemm.mul_mat_t(x, w, out)
    np.testing.assert_allclose(out, _ref(x, w), rtol=1e-4, atol=1e-4)
    assert not big_out[:, :3].any() and not big_out[:, 12:].any(), "wrote outside the out view"


def test_row_result_independent_of_batch():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((gemm.small_rows_max(), 200), dtype=np.float32)
    w = rng.standard_normal((77, 200), dtype=np.float32)
    full = np.empty((x.shape[0], 77), dtype=np.float32)
    gemm.mul_mat_t(x, w, full)
    for m in (1, 3, 5, 17):
        part = np.empty((m, 77), dtype=np.float32)
        gemm.mul_mat_t(x[:m], w, part)
        assert np.array_equal(part, full[:m]), f"row results changed with a batch of {m}"


def test_empty_and_bad_shapes():
    w = np.ones((4, 8), dtype=np.float32)
    gemm.mul_mat_t(np.ones((0, 8), np.float32), w, np.ones((0, 4), np.float32))
    with pytest.raises(ValueError, match="columns"):
        gemm.mul_mat_t(np.ones((2, 7), np.float32), w, np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match="out is"):
        gemm.mul_mat_t(np.ones((2, 8), np.float32), w, np.ones((2, 5), np.float32))
    with pytest.raises(ValueError, match="bias"):
        gemm.mul_mat_t(np.ones((2, 8), np.float32), w, np.ones((2, 4), np.float32), np.ones(3, np.float32))
    with pytest.raises(ValueError, match="contiguous"):
        gemm.mul_mat_t(np.ones((2, 16), np.float32)[:, ::2], w, np.ones((2, 4), np.float32))
    with pytest.raises(ValueError):
        gemm.mul_mat_t(np.ones((2, 8), np.float32), np.ones((8, 4), np.float32).T, np.ones((2, 4), np.float32))
