"""pyllama._fast.qmatmul against the independent float64 reference of tests/quant_reference.py.

For every weight type: the quantized activations equal ggml's reference quantizers byte for
byte, the portable path's integer block sums equal the reference's, one row and whole matrix
products equal ggml's formula within (k + 16) * 2^-24 * sum|terms| (ggml_quants.h), the AVX2 and
portable paths agree within twice that, get_rows_q equals gguf's dequantize bit for bit, and bad
input raises ValueError.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

import quant_reference as ref

qmatmul = pytest.importorskip("pyllama._fast.qmatmul", reason="Cython extensions not built (python setup.py build_ext --inplace)")
from pyllama._fast import ops  # noqa: E402

TYPES = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
         T.IQ4_NL, T.IQ4_XS, T.MXFP4)
INT_TYPES = TYPES[3:]
K = 768          # 24 blocks of 32, 3 super-blocks of 256
PATHS = (False, True) if qmatmul.have_avx2() else (True,)


def activations(n, k, rng):
    """Random rows with edge cases: an all-zero row, a row of one huge value, integer and
    half-integer values (exact .5 products after scaling), mixed magnitudes."""
    x = (rng.standard_normal((n, k)) * rng.choice([0.01, 1.0, 30.0], size=(n, 1))).astype(np.float32)
    if n > 1:
        x[1] = 0
    if n > 2:
        x[2] = 0
        x[2, 5] = -3e4
        x[2, 300] = 1e-3
    if n > 3:   # amax 127 -> d = 1, id = 1: products are exact halves (roundf vs round-to-even)
        x[3] = rng.integers(-100, 100, k) + 0.5
        x[3, ::32] = 127
        x[3, ::256] = -127
    return x


@pytest.mark.parametrize("act", (T.Q8_0, T.Q8_1, T.Q8_K, T.F16, T.BF16, T.F32), ids=lambda t: t.name)
def test_quantize_rows_match_ggml_reference(act):
    rng = np.random.default_rng(int(act))
    x = activations(9, K, rng)
    got = qmatmul.quantize_rows(x, int(act))
    assert got.shape == (9, qmatmul.row_bytes(int(act), K)) and got.dtype == np.uint8
    for r in range(9):
        assert np.array_equal(got[r], ref.quantize_activation(x[r], act)), f"row {r}"


def test_q8_0_and_q8_1_round_ties_to_even_as_x86_ggml():
    """x86 ggml's quantize_row_q8_0 / q8_1 (what llama.cpp's CPU backend runs) round x * (127 / amax)
    half to even; the reference C code's roundf would give 1, -3, 2 here."""
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [127, 0.5, -2.5, 1.5]
    q = qmatmul.quantize_rows(x, int(T.Q8_0))[0, 2:6].view(np.int8)
    assert q.tolist() == [127, 0, -2, 2]
    q1 = qmatmul.quantize_rows(x, int(T.Q8_1))[0, 4:8].view(np.int8)
    assert q1.tolist() == [127, 0, -2, 2]
    xk = np.zeros((1, 256), np.float32)
    xk[0, :4] = [-127, 0.5, -2.5, 1.5]       # iscale = 1; Q8_K rounds half to even
    qk = qmatmul.quantize_rows(xk, int(T.Q8_K))[0, 4:8].view(np.int8)
    assert qk.tolist() == [-127, 0, -2, 2]


def test_q8_0_scale_is_127_over_amax():
    """id = 127 / amax in float32 (x86 ggml), not the reference's 1 / (amax / 127), which differs
    from it by an ulp for some amax: values put next to a half of each row's scale."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    amax = np.abs(x).max(axis=1, keepdims=True)
    x[:, 0] = amax.ravel() * 2          # the block's largest element, so that column 7 is not
    amax = amax * 2
    x[:, 7] = (np.float32(1.5) / (np.float32(127) / amax)).astype(np.float32).ravel()
    q = qmatmul.quantize_rows(x, int(T.Q8_0))[:, 2:].view(np.int8)
    want = np.rint(x * (np.float32(127) / amax)).astype(np.int8)
    assert (q == want).all()


def test_q8_k_ties_and_non_finite_blocks():
    """The vectorized Q8_K quantizer takes the first element of the largest magnitude as the
    block's signed maximum (as ggml's loop does), and leaves a block holding a NaN or an infinity
    to the scalar loop without disturbing its neighbours."""
    rng = np.random.default_rng(17)
    x = rng.standard_normal((3, 768)).astype(np.float32)
    x[0, 40], x[0, 200] = -5.0, 5.0        # block 0: the negative comes first
    x[0, 300], x[0, 301] = 7.0, -7.0       # block 1: the positive comes first
    x[1, 256 + 9] = np.nan
    x[2, 512 + 100] = np.inf
    got = qmatmul.quantize_rows(x, int(T.Q8_K))
    want0 = ref.quantize_activation(x[0], T.Q8_K)
    assert np.array_equal(got[0], want0)
    assert np.frombuffer(got[0, :4].tobytes(), np.float32)[0] > 0      # d = -max / 127 with max = -5
    assert np.frombuffer(got[0, 292:296].tobytes(), np.float32)[0] < 0  # max = +7
    for r, bad in ((1, 1), (2, 2)):
        clean = [b for b in range(3) if b != bad]
        want = ref.quantize_activation(np.where(np.isfinite(x[r]), x[r], 0).astype(np.float32), T.Q8_K)
        for b in clean:
            assert np.array_equal(got[r, 292 * b:292 * (b + 1)], want[292 * b:292 * (b + 1)]), (r, b)


@pytest.mark.parametrize("qtype", INT_TYPES, ids=lambda t: t.name)
def test_int_block_sums_match_reference(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    w = ref.random_weights(qtype, 3, K, rng)
    x = activations(4, K, rng)
    xq = qmatmul.quantize_rows(x, qmatmul.vec_dot_type(int(qtype)))
    for r in range(4):
        for j in range(3):
            got = qmatmul.int_block_sums(xq[r], w[j], int(qtype), K)
            want = ref.block_sums(w[j], xq[r], qtype, K)
            assert got.shape == want.shape
            assert np.array_equal(got, want), f"row {r} weight {j}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_reference_agrees_with_gguf_dequantize(qtype):
    """The reference's block decoding against gguf's dequantization, so that the reference is
    tied to the published formats by two independent readings."""
    rng = np.random.default_rng(200 + int(qtype))
    w = ref.random_weights(qtype, 2, K, rng)
    xq = qmatmul.quantize_rows(activations(2, K, rng), qmatmul.vec_dot_type(int(qtype)))
    for j in range(2):
        exact, S = ref.dot(w[j], xq[0], qtype, K)
        assert abs(ref.dequantized_dot(w[j], xq[0], qtype, K) - exact) <= 1e-6 * S + 1e-30


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", (1, 3, 7, 8, 14, 33))
def test_mul_mat_q_matches_reference(qtype, n):
    rng = np.random.default_rng(1000 * int(qtype) + n)
    m = 11
    w = ref.random_weights(qtype, m, K, rng)
    x = activations(n, K, rng)
    xq = qmatmul.quantize_rows(x, qmatmul.vec_dot_type(int(qtype)))
    exact = np.empty((n, m))
    tol = np.empty((n, m))
    for r in range(n):
        for j in range(m):
            exact[r, j], S = ref.dot(w[j], xq[r], qtype, K)
            tol[r, j] = ref.tolerance(K, S)
    results = {}
    for portable in PATHS:
        out = np.full((n, m), np.nan, np.float32)
        qmatmul.mul_mat_q(x, w, int(qtype), out, portable=portable)
        err = np.abs(out.astype(np.float64) - exact)
        assert (err <= tol).all(), f"portable={portable}: worst error / bound {np.max(err / np.maximum(tol, 1e-300))}"
        results[portable] = out
    if len(results) == 2:   # the paths agree within twice the bound
        assert (np.abs(results[False].astype(np.float64) - results[True]) <= 2 * tol).all()
        if qtype == T.IQ4_XS:   # its portable path takes the float steps of ggml's x86 code too: same bits
            np.testing.assert_array_equal(results[False], results[True])
    one = np.empty((1, m), np.float32)     # one row alone gives the same as within the batch
    qmatmul.mul_mat_q(x[:1], w, int(qtype), one)
    assert np.allclose(one[0], results[PATHS[0]][0], rtol=0, atol=2 * tol[0].max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_gives_the_same_bits_whatever_rows_share_its_call(qtype):
    """A row's products do not depend on how many other rows one kernel call takes with it
    (1 .. the kernels' most), so a sequence's logits do not depend on its batch mates. F16 and
    BF16 weights on AVX-512 take llama.cpp's two forms (tests/test_float_products.py): one row
    alone its vec_dot's, two rows or more tinyBLAS's, the same for every number of rows."""
    rng = np.random.default_rng(int(qtype))
    w = ref.random_weights(qtype, 16, K, rng)
    x = activations(9, K, rng)
    for portable in PATHS:
        alone = np.empty((9, 16), np.float32)
        two_forms = qtype in (T.F16, T.BF16) and not portable and ops.GGML_F32_ATTENTION
        for r in range(9):
            if two_forms:  # each row beside another (row 8 beside row 0)
                pair = np.empty((2, 16), np.float32)
                qmatmul.mul_mat_q(np.ascontiguousarray(x[[r, (r + 1) % 9]]), w, int(qtype), pair, portable=portable)
                alone[r] = pair[0]
            else:
                qmatmul.mul_mat_q(x[r:r + 1], w, int(qtype), alone[r:r + 1], portable=portable)
        for n in range(2, 10):
            out = np.empty((n, 16), np.float32)
            qmatmul.mul_mat_q(x[:n], w, int(qtype), out, portable=portable)
            np.testing.assert_array_equal(out, alone[:n], err_msg=f"{n} rows, portable={portable}")


@pytest.mark.parametrize("qtype", (T.Q4_K, T.Q6_K, T.Q8_0, T.F16), ids=lambda t: t.name)
def test_threads_strided_out_and_bias(qtype):
    rng = np.random.default_rng(7)
    m, n = 67, 5
    w = ref.random_weights(qtype, m, K, rng)
    x = activations(n, K, rng)
    bias = rng.standard_normal(m).astype(np.float32)
    base = np.empty((n, m), np.float32)
    qmatmul.mul_mat_q(x, w, int(qtype), base, n_threads=1)
    wide = np.full((n, m + 9), -7.0, np.float32)
    qmatmul.mul_mat_q(x, w, int(qtype), wide[:, 4:4 + m], bias=bias, n_threads=2)
    # every output is computed by the same kernel on the same rows: threads change nothing
    assert np.array_equal(wide[:, 4:4 + m], base + bias)
    assert (wide[:, :4] == -7).all() and (wide[:, 4 + m:] == -7).all()


@pytest.mark.parametrize("qtype", (T.Q4_K, T.Q4_0), ids=lambda t: t.name)
def test_thread_pool_many_products_and_concurrent_callers(qtype):
    """Products large enough to be split over the thread pool (several tiles, a batch quantized
    in parallel, two chunks of activation rows), issued back to back, with more helpers than
    cores and from two Python threads at once: every result equals the one-thread result."""
    import threading
    rng = np.random.default_rng(11)
    m = 700
    w = ref.random_weights(qtype, m, K, rng)
    xs = [activations(n, K, rng) for n in (1, 9, 70)]
    base = []
    for x in xs:
        o = np.empty((x.shape[0], m), np.float32)
        qmatmul.mul_mat_q(x, w, int(qtype), o, n_threads=1)
        base.append(o)
    for nt in (2, 3, 4):
        for _ in range(20):
            for x, b in zip(xs, base):
                o = np.full_like(b, np.nan)
                qmatmul.mul_mat_q(x, w, int(qtype), o, n_threads=nt)
                assert np.array_equal(o, b)
    failures = []

    def worker(seed):
        order = np.random.default_rng(seed).permutation(len(xs) * 10) % len(xs)
        for i in order:
            o = np.full_like(base[i], np.nan)
            qmatmul.mul_mat_q(xs[i], w, int(qtype), o, n_threads=2)
            if not np.array_equal(o, base[i]):
                failures.append(i)
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_get_rows_q_bit_exact(qtype):
    rng = np.random.default_rng(300 + int(qtype))
    m = 9
    w = ref.random_weights(qtype, m, K, rng)
    ids = np.array([4, 0, 8, 4], np.int32)
    out = np.full((4, K), np.nan, np.float32)
    qmatmul.get_rows_q(w, int(qtype), ids, out, n_threads=2)
    if qtype == T.F32:
        want = w.view(np.float32)[ids]
    elif qtype == T.F16:
        want = w.view(np.float16)[ids].astype(np.float32)
    else:
        want = np.asarray(quants.dequantize(w[ids], qtype), np.float32).reshape(4, K)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", (T.Q4_K, T.Q8_0, T.Q3_K), ids=lambda t: t.name)
def test_blas_prompt_path(qtype):
    """Dequantized tiles + BLAS: the float32 product with the exactly dequantized weights."""
    rng = np.random.default_rng(11)
    m, n = 40, 70
    w = ref.random_weights(qtype, m, K, rng)
    x = activations(n, K, rng)
    bias = rng.standard_normal(m).astype(np.float32)
    out = np.empty((n, m), np.float32)
    qmatmul.mul_mat_q_blas(x, w, int(qtype), out, bias=bias)
    wf = np.asarray(quants.dequantize(w, qtype), np.float64).reshape(m, K)
    exact = x.astype(np.float64) @ wf.T + bias
    bound = (K + 16) * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ np.abs(wf).T + np.abs(bias))
    assert (np.abs(out - exact) <= bound).all()


# ---- bad input ---------------------------------------------------------------------------

def _raises(match, fn, *args, **kw):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kw)


def test_bad_input_raises_value_error():
    rng = np.random.default_rng(3)
    w = ref.random_weights(T.Q4_K, 4, 512, rng)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    out = np.empty((2, 4), np.float32)
    _raises("Q1_0", qmatmul.mul_mat_q, x, w, int(T.Q1_0), out)                        # unsupported, named
    _raises("needs 288", qmatmul.mul_mat_q, x, np.ascontiguousarray(w[:, :-1]), int(T.Q4_K), out)  # truncated
    _raises("not a whole number", qmatmul.mul_mat_q, x[:, :500].copy(), w, int(T.Q4_K), out)
    _raises("out is", qmatmul.mul_mat_q, x, w, int(T.Q4_K), np.empty((2, 5), np.float32))
    _raises("contiguous", qmatmul.mul_mat_q, x, w, int(T.Q4_K), np.empty((2, 8), np.float32)[:, ::2])
    _raises("bias", qmatmul.mul_mat_q, x, w, int(T.Q4_K), out, bias=np.zeros(3, np.float32))
    _raises("n_threads", qmatmul.mul_mat_q, x, w, int(T.Q4_K), out, n_threads=0)
    _raises("not a whole number", qmatmul.row_bytes, int(T.Q8_0), 33)
    _raises("unsupported", qmatmul.vec_dot_type, int(T.NVFP4))
    _raises("outside", qmatmul.get_rows_q, w, int(T.Q4_K), np.array([0, 4], np.int32), np.empty((2, 512), np.float32))
    _raises("outside", qmatmul.get_rows_q, w, int(T.Q4_K), np.array([-1], np.int32), np.empty((1, 512), np.float32))
    _raises("needs 288", qmatmul.get_rows_q, np.ascontiguousarray(w[:, 1:]), int(T.Q4_K), np.array([0], np.int32),
            np.empty((1, 512), np.float32))
    _raises("no integer block sums", qmatmul.int_block_sums, np.zeros(1024, np.uint8), np.zeros(1024, np.uint8), int(T.F16), 512)
    _raises("bytes", qmatmul.int_block_sums, np.zeros(10, np.uint8), w[0], int(T.Q4_K), 512)


def test_api_tables():
    grid_iq = (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M)   # tests/test_iq_grid.py
    ternary = (T.TQ1_0, T.TQ2_0)                                                     # tests/test_ternary.py
    assert set(qmatmul.supported_types()) == {int(t) for t in TYPES + grid_iq + ternary}
    assert qmatmul.vec_dot_type(int(T.Q4_1)) == int(T.Q8_1)
    assert qmatmul.vec_dot_type(int(T.Q5_0)) == int(T.Q8_0)
    assert qmatmul.vec_dot_type(int(T.Q6_K)) == int(T.Q8_K)
    assert qmatmul.vec_dot_type(int(T.BF16)) == int(T.BF16)
    assert qmatmul.row_bytes(int(T.Q6_K), 512) == 420
    assert qmatmul.row_bytes(int(T.Q8_K), 256) == 292
