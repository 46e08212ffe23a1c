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


# ---- the packed kernel for many rows (mul_mat_packed) ----------------------------------------------

@pytest.mark.parametrize("m", [1, 7, 8, 9, 129, 235])
@pytest.mark.parametrize("n,k", [(1, 1), (31, 17), (32, 288), (33, 64), (288, 288), (100, 768)])
def test_packed_matches_reference(m, n, k):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    out = np.full((m, n), np.nan, dtype=np.float32)
    gemm.mul_mat_packed(x, w, out, b, 2)
    np.testing.assert_allclose(out, _ref(x, w, b), rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_packed_threads_strides_and_row_independence():
    """Any thread count gives the same bits; a row's result does not depend on the rows beside it
    (nor on its place in a block of rows); strided rows of x and out are read and written in place."""
    rng = np.random.default_rng(5)
    big_x = rng.standard_normal((300, 200), dtype=np.float32)
    x = big_x[:, 10:106]  # strided rows
    w = rng.standard_normal((70, 96), dtype=np.float32)
    b = rng.standard_normal(70, dtype=np.float32)
    outs = []
    for nt in (1, 2, 3):
        big_out = np.full((300, 100), np.nan, dtype=np.float32)
        gemm.mul_mat_packed(x, w, big_out[:, 5:75], b, nt)
        assert np.isnan(big_out[:, :5]).all() and np.isnan(big_out[:, 75:]).all()
        outs.append(big_out[:, 5:75].copy())
    for out in outs[1:]:
        assert np.array_equal(out, outs[0])
    np.testing.assert_allclose(outs[0], _ref(x, w, b), rtol=1e-4, atol=1e-3)
    alone = np.empty((1, 70), dtype=np.float32)
    for r in (0, 7, 8, 150, 299):
        gemm.mul_mat_packed(np.ascontiguousarray(x[r:r + 1]), w, alone, b, 1)
        assert np.array_equal(alone[0], outs[0][r])
    with pytest.raises(ValueError):
        gemm.mul_mat_packed(x, w[:, :95], outs[0], b)
    assert gemm.packed_fits(235, 768) and not gemm.packed_fits(64, 768) and not gemm.packed_fits(235, 4096)
