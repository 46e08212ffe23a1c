"""Q4_0, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K weights repacked in groups of 8 rows (ggml_x8.h) against the float64
reference.

The repacked kernels must give ggml's products within the same bound as the file-layout kernels
((k + 16) * 2^-24 * sum|terms|, ggml_quants.h), whatever the number of activation rows, the
thread count, a bias or a strided output; and the CPU backend must use them on a model's weights
and drop a repacked copy when its weight's bytes change.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import quant_reference as ref
from test_qmatmul import activations

qmatmul = pytest.importorskip("pyllama._fast.qmatmul", reason="Cython extensions not built (python setup.py build_ext --inplace)")
pytestmark = pytest.mark.skipif(not qmatmul.x8_types(), reason="this build has no AVX2 kernels (repacking needs them)")

# Q2_K and Q3_K have no oct kernel: builds for AVX-512 VNNI keep them in the file's layout
X8 = tuple(t for t in (T.Q4_0, T.Q8_0, T.IQ4_NL, T.MXFP4, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
           if int(t) in qmatmul.x8_types())


@pytest.mark.parametrize("qtype", X8, ids=lambda t: t.name)
@pytest.mark.parametrize("n,m,k", [(1, 8, 256), (3, 16, 768), (8, 24, 512), (9, 8, 768), (17, 16, 512),
                                   (33, 8, 512)])
def test_matches_reference(qtype, n, m, k):
    rng = np.random.default_rng(31 * n + m + k + int(qtype))
    w = ref.random_weights(qtype, m, k, rng)
    x = activations(n, k, rng)
    xq = qmatmul.quantize_rows(x, qmatmul.vec_dot_type(int(qtype)))
    exact, tol = np.empty((n, m)), np.empty((n, m))
    for r in range(n):
        for j in range(m):
            exact[r, j], S = ref.dot(w[j], xq[r], qtype, k)
            tol[r, j] = ref.tolerance(k, S)
    wp = qmatmul.repack_x8(w, int(qtype), k)
    assert wp.shape[0] == m // 8 and wp.ctypes.data % 64 == 0
    out = np.full((n, m), np.nan, np.float32)
    qmatmul.mul_mat_q_x8(x, wp, int(qtype), out)
    err = np.abs(out.astype(np.float64) - exact)
    assert (err <= tol).all(), f"worst error / bound {np.max(err / np.maximum(tol, 1e-300))}"
    rows = np.empty((n, m), np.float32)     # the file layout's kernels agree within twice the bound
    qmatmul.mul_mat_q(x, w, int(qtype), rows)
    assert (np.abs(rows.astype(np.float64) - out) <= 2 * tol).all()


@pytest.mark.parametrize("qtype", X8, ids=lambda t: t.name)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_largest_quants_against_full_scale_activations(qtype, sign):
    """Every quant byte 0xFF (each weight at the top of its type's range: Q6_K's q + 32 = 63, Q3_K's
    q + 4 = 7, Q2_K's 3) against activations that quantize to +-127 everywhere: where the kernels'
    int16 partial sums (maddubs pairs, added over a group's quads before they widen) are largest.
    Exact integer sums keep the reference's bound; a saturated one would not."""
    n, m, k = 4, 16, 512
    w = np.full((m, k // ref.BLOCK_ELEMS[qtype], ref.BLOCK_BYTES[qtype]), 0xFF, np.uint8)
    for off in ref.F16_FIELDS[qtype]:
        w[:, :, off:off + 2] = np.array([0.01], np.float16).view(np.uint8)
    if qtype == T.MXFP4:
        w[:, :, 0] = 121                        # E8M0: a scale of 2^-7
    w = w.reshape(m, -1)
    x = np.full((n, k), sign, np.float32)
    xq = qmatmul.quantize_rows(x, qmatmul.vec_dot_type(int(qtype)))
    wp = qmatmul.repack_x8(w, int(qtype), k)
    exact, tol = np.empty(m), np.empty(m)   # every activation row is the same
    for j in range(m):
        exact[j], S = ref.dot(w[j], xq[0], qtype, k)
        tol[j] = ref.tolerance(k, S)
    for nr in range(1, n + 1):   # each kernel row count
        out = np.full((nr, m), np.nan, np.float32)
        qmatmul.mul_mat_q_x8(x[:nr], wp, int(qtype), out)
        err = np.abs(out.astype(np.float64) - exact)
        assert (err <= tol).all(), (nr, out, exact)


@pytest.mark.parametrize("qtype", X8, ids=lambda t: t.name)
def test_packed_bytes_are_a_permutation_but_q4_k_holds_every_scale(qtype):
    """Q4_0, Q8_0, Q2_K and Q6_K keep the file's size (its bytes rearranged); Q4_K and Q5_K store their
    6-bit scales and mins unpacked (160 bytes of header instead of 8 x 16), Q3_K its 6-bit scales
    (16 bytes per row instead of 12)."""
    rng = np.random.default_rng(5)
    w = ref.random_weights(qtype, 16, 512, rng)
    wp = qmatmul.repack_x8(w, int(qtype), 512)
    if qtype not in (T.Q3_K, T.Q4_K, T.Q5_K):
        assert wp.size == w.size
        assert np.array_equal(np.sort(wp.reshape(-1)), np.sort(w.reshape(-1)))
    else:
        assert wp.size == 2 * 2 * {T.Q3_K: 912, T.Q4_K: 1184, T.Q5_K: 1440}[qtype]


@pytest.mark.parametrize("qtype", X8, ids=lambda t: t.name)
def test_threads_strided_out_bias_and_batch_independence(qtype):
    rng = np.random.default_rng(11)
    n, m, k = 21, 136, 768            # 17 groups: several tiles per thread, three row chunks of PQ_X8_NR
    w = ref.random_weights(qtype, m, k, rng)
    wp = qmatmul.repack_x8(w, int(qtype), k)
    x = activations(n, k, rng)
    bias = rng.standard_normal(m).astype(np.float32)
    base = np.empty((n, m), np.float32)
    qmatmul.mul_mat_q_x8(x, wp, int(qtype), base, n_threads=1)
    for nt in (2, 3):
        wide = np.full((n, m + 9), -7.0, np.float32)
        qmatmul.mul_mat_q_x8(x, wp, int(qtype), wide[:, 4:4 + m], bias=bias, n_threads=nt)
        assert np.array_equal(wide[:, 4:4 + m], base + bias)
        assert (wide[:, :4] == -7).all() and (wide[:, 4 + m:] == -7).all()
    one = np.empty((1, m), np.float32)   # a row alone gives what it gives within a batch
    qmatmul.mul_mat_q_x8(x[5:6], wp, int(qtype), one)
    assert np.array_equal(one[0], base[5])


# Types whose repacked kernels follow ggml's float steps as the file-layout kernels do: Q4_0 and
# Q8_0 everywhere, the K-quants in builds for AVX-512 VNNI (the oct kernels; those builds repack no
# Q2_K), whose 256-bit kernels still add each row's lanes per block
OCT_BUILD = T.Q2_K not in X8
SAME_BITS = tuple(t for t in X8 if t in (T.Q4_0, T.Q8_0, T.IQ4_NL, T.MXFP4)
                  or (OCT_BUILD and t in (T.Q4_K, T.Q5_K, T.Q6_K)))


@pytest.mark.parametrize("qtype", SAME_BITS, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 2, 5, 32])
@pytest.mark.parametrize("nt", [1, 2])
@pytest.mark.parametrize("blocks", [32, 25])
def test_repacked_and_file_layout_give_the_same_bits(qtype, n, nt, blocks):
    """One arithmetic per weight type: the repacked product equals the file layout's bit for bit
    (ggml's float steps in both) at any row count and thread count; for the 32-element types also
    with an odd number of blocks (IQ4_NL / MXFP4 add the last one apart, as ggml does)."""
    if blocks % 8 and ref.BLOCK_ELEMS[qtype] != 32:
        pytest.skip("rows of whole super-blocks")
    rng = np.random.default_rng(7 * n + nt + int(qtype))
    m, k = 40, 32 * blocks
    w = ref.random_weights(qtype, m, k, rng)
    x = activations(n, k, rng)
    rows = np.empty((n, m), np.float32)
    qmatmul.mul_mat_q(x, w, int(qtype), rows, n_threads=nt)
    packed = np.empty((n, m), np.float32)
    qmatmul.mul_mat_q_x8(x, qmatmul.repack_x8(w, int(qtype), k), int(qtype), packed, n_threads=nt)
    assert np.array_equal(rows.view(np.uint32), packed.view(np.uint32)), \
        f"{int((rows != packed).sum())} of {rows.size} outputs differ"


def test_parts_are_one_product_of_the_weights_side_by_side():
    """A MUL_MAT_CAT's parts (q|k|v of Q4_K and Q6_K) in one call: each part's columns equal its
    own product, bias included, on any thread count; bad part lists are refused."""
    rng = np.random.default_rng(21)
    n, k = 11, 512
    specs = [(T.Q4_K, 32), (T.Q4_K, 16), (T.Q6_K, 16)]
    ws = [ref.random_weights(t, m, k, rng) for t, m in specs]
    wps = [qmatmul.repack_x8(w, int(t), k) for w, (t, _) in zip(ws, specs)]
    x = activations(n, k, rng)
    m = sum(mm for _, mm in specs)
    bias = rng.standard_normal(m).astype(np.float32)
    want = np.concatenate([np.empty((n, mm), np.float32) for _, mm in specs], axis=1)
    col = 0
    for wp, (t, mm) in zip(wps, specs):
        qmatmul.mul_mat_q_x8(x, wp, int(t), want[:, col:col + mm], bias[col:col + mm])
        col += mm
    for nt in (1, 2, 3):
        got = np.full((n, m), np.nan, np.float32)
        qmatmul.mul_mat_q_x8_parts(x, wps, [int(t) for t, _ in specs], got, bias, nt)
        assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="parts"):
        qmatmul.mul_mat_q_x8_parts(x, wps, [int(T.Q4_K)], np.zeros((n, m), np.float32))
    with pytest.raises(ValueError, match="not hold"):
        qmatmul.mul_mat_q_x8_parts(x, wps, [int(T.Q6_K), int(T.Q4_K), int(T.Q6_K)], np.zeros((n, m), np.float32))
    with pytest.raises(ValueError, match="parts"):
        qmatmul.mul_mat_q_x8_parts(x, [], [], np.zeros((n, 0), np.float32))
    q40 = qmatmul.repack_x8(ref.random_weights(T.Q4_0, 8, k, rng), int(T.Q4_0), k)
    with pytest.raises(ValueError, match="quantize x differently"):
        qmatmul.mul_mat_q_x8_parts(x, [wps[0], q40], [int(T.Q4_K), int(T.Q4_0)], np.zeros((n, 40), np.float32))


def test_bad_input_raises_value_error():
    rng = np.random.default_rng(3)
    w = ref.random_weights(T.Q4_K, 16, 256, rng)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        qmatmul.repack_x8(w[:12], int(T.Q4_K), 256)
    with pytest.raises(ValueError, match="not repacked"):
        qmatmul.repack_x8(ref.random_weights(T.Q5_0, 8, 256, rng), int(T.Q5_0), 256)
    with pytest.raises(ValueError, match="bytes"):
        qmatmul.repack_x8(w, int(T.Q4_K), 512)
    wp = qmatmul.repack_x8(w, int(T.Q4_K), 256)
    x = np.zeros((2, 256), np.float32)
    with pytest.raises(ValueError, match="not hold"):
        qmatmul.mul_mat_q_x8(x, wp, int(T.Q4_K), np.zeros((2, 24), np.float32))
    with pytest.raises(ValueError, match="not hold"):
        qmatmul.mul_mat_q_x8(x, wp, int(T.Q6_K), np.zeros((2, 16), np.float32))
    with pytest.raises(ValueError, match="bias"):
        qmatmul.mul_mat_q_x8(x, wp, int(T.Q4_K), np.zeros((2, 16), np.float32), bias=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="blocks of 256"):
        qmatmul.mul_mat_q_x8(np.zeros((2, 100), np.float32), wp, int(T.Q4_K), np.zeros((2, 16), np.float32))


def test_cpu_backend_repacks_and_forgets_on_write():
    """A MUL_MAT against a Q4_K weight runs on the repacked copy; writing the weight's bytes drops
    the copy and the next compute uses the new weights."""
    from pyllama.backend.cpu import CPUBackend
    from pyllama.ir.tensor import DType, Graph, Op, Tensor, node

    rng = np.random.default_rng(8)
    be = CPUBackend(n_threads=2)
    m, k, n = 32, 512, 3
    w1, w2 = (ref.random_weights(T.Q4_K, m, k, rng) for _ in range(2))
    buf = be.alloc_buffer(w1.nbytes + 4 * (n * k + n * m))
    wt = Tensor(DType.Q4_K, (m, k), "w", buf, 0)
    xt = Tensor(DType.F32, (n, k), "x", buf, w1.nbytes)
    ot = Tensor(DType.F32, (n, m), "out", buf, w1.nbytes + 4 * n * k)
    x = activations(n, k, rng)
    be.set_tensor(wt, w1)
    be.set_tensor(xt, x)
    g = Graph([node(Op.MUL_MAT, ot, xt, wt)])
    results = []
    for w in (w1, w2):
        be.set_tensor(wt, w)
        be.graph_compute(g)
        assert be.layout.packed_weights(buf) == 1, "the weight was not repacked"
        want = np.empty((n, m), np.float32)
        qmatmul.mul_mat_q_x8(x, qmatmul.repack_x8(w, int(T.Q4_K), k), int(T.Q4_K), want)
        got = be.get_tensor(ot)
        assert np.array_equal(got, want)
        results.append(got)
    assert not np.array_equal(results[0], results[1])
    be.set_tensor(xt, x)              # writing another tensor of the buffer keeps the copy
    assert be.layout.packed_weights(buf) == 1
    be.free_buffer(buf)
    assert be.layout.packed_weights(buf) == 0 and be.layout.packed_weights() == 0


def test_an_allocated_weight_is_not_repacked_when_memory_is_short(monkeypatch, caplog):
    """An uploaded (allocated) weight's copy is extra memory: with too little free the backend
    keeps the file layout, logs it once, and computes the same product."""
    from pyllama.backend.cpu import CPUBackend, memory
    from pyllama.ir.tensor import DType, Graph, Op, Tensor, node

    rng = np.random.default_rng(9)
    m, k, n = 16, 256, 2
    w = ref.random_weights(T.Q6_K, m, k, rng)
    x = activations(n, k, rng)
    outs = []
    for free in (1 << 40, 1 << 20):
        monkeypatch.setattr(memory, "available_memory", lambda free=free: free)
        be = CPUBackend(n_threads=1)
        buf = be.alloc_buffer(w.nbytes + 4 * (n * k + n * m))
        wt = Tensor(DType.Q6_K, (m, k), "w", buf, 0)
        xt = Tensor(DType.F32, (n, k), "x", buf, w.nbytes)
        ot = Tensor(DType.F32, (n, m), "out", buf, w.nbytes + 4 * n * k)
        be.set_tensor(wt, w)
        be.set_tensor(xt, x)
        with caplog.at_level("WARNING"):
            be.graph_compute(Graph([node(Op.MUL_MAT, ot, xt, wt)]))
            be.graph_compute(Graph([node(Op.MUL_MAT, ot, xt, wt)]))
        assert be.layout.packed_weights(buf) == (1 if free > 1 << 30 else 0)
        outs.append(be.get_tensor(ot))
    assert sum("not enough free memory to repack" in r.getMessage() for r in caplog.records) == 1
    bound = np.abs(outs[0]).max() * 1e-5
    assert np.allclose(outs[0], outs[1], rtol=0, atol=bound)
