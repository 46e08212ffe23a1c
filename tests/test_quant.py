"""pyllama._fast.quant: dequantization kernels against gguf.quants (numpy reference of ggml).

Every comparison is bit-exact (np.array_equal on the float32 results): the block formulas need
no tolerance, see the module docstring of quant.pyx for why.
"""
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants

quant = pytest.importorskip("pyllama._fast.quant", reason="Cython extensions not built (python setup.py build_ext --inplace)")

# Where each K-quant block keeps its f16 super-block scales: (d, dmin) or d alone.
K_SCALE_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
QUANTIZABLE = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4)
# the f16 scale of the 4-bit lookup types (MXFP4's E8M0 exponent comes from its quantizer above)
K_SCALE_OFFSETS[T.IQ4_NL] = (0,)
K_SCALE_OFFSETS[T.IQ4_XS] = (0,)
ALL_TYPES = QUANTIZABLE + tuple(K_SCALE_OFFSETS)


def random_k_blocks(qtype, n_blocks, rng):
    """Random bytes with every f16 scale field set to a finite value in 0.01..0.1."""
    type_size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for off in K_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(0.01, 0.1, n_blocks).astype(np.float16)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def make_raw(qtype, n, rng):
    """(raw bytes, reference float32 values) for n elements of qtype."""
    if qtype in K_SCALE_OFFSETS:
        raw = random_k_blocks(qtype, n // GGML_QUANT_SIZES[qtype][0], rng)
    else:
        x = (rng.standard_normal(n) * 3).astype(np.float32)
        raw = np.ascontiguousarray(quants.quantize(x, qtype)).view(np.uint8).reshape(-1)
    ref = quants.dequantize(raw.reshape(1, -1), qtype) if qtype not in (T.F32, T.F16) else quants.dequantize(raw, qtype)
    return raw, np.asarray(ref, dtype=np.float32).reshape(-1)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_blocks", [1, 7, 1000])
@pytest.mark.parametrize("n_threads", [1, 0, 2])
def test_matches_gguf_exactly(qtype, n_blocks, n_threads):
    rng = np.random.default_rng(1000 * int(qtype) + n_blocks)
    n = n_blocks * max(GGML_QUANT_SIZES[qtype][0], 32)
    raw, ref = make_raw(qtype, n, rng)
    out = np.full(n, np.nan, dtype=np.float32)
    quant.dequantize(raw, qtype, n, out, n_threads)
    assert np.array_equal(out, ref), f"max abs diff {np.abs(out - ref).max()}"


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_large_parallel_matches(qtype):
    """Above the parallel threshold, with a length that is not a multiple of the work item."""
    rng = np.random.default_rng(int(qtype))
    n = 256 * 1031
    raw, ref = make_raw(qtype, n, rng)
    for n_threads in (0, 2, 3):
        out = np.empty(n, dtype=np.float32)
        quant.dequantize(raw, qtype, n, out, n_threads)
        assert np.array_equal(out, ref)


def test_f16_every_value():
    """All 65536 halves, subnormals and infinities included (NaNs stay NaN)."""
    h = np.arange(65536, dtype=np.uint16)
    out = np.empty(65536, dtype=np.float32)
    quant.dequantize(h.view(np.uint8), T.F16, 65536, out)
    ref = h.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(out[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.isnan(out[nan]).all()


def test_bf16_every_value():
    h = np.arange(65536, dtype=np.uint16)
    out = np.empty(65536, dtype=np.float32)
    quant.dequantize(h.view(np.uint8), T.BF16, 65536, out)
    assert np.array_equal(out.view(np.uint32), h.astype(np.uint32) << 16)


def test_read_only_memmap_input(tmp_path):
    rng = np.random.default_rng(5)
    raw, ref = make_raw(T.Q4_K, 256 * 4, rng)
    path = tmp_path / "raw.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    assert not mm.flags.writeable
    out = np.empty(256 * 4, dtype=np.float32)
    quant.dequantize(mm, T.Q4_K, 256 * 4, out)
    assert np.array_equal(out, ref)
    del mm


def test_dequantize_to_f32_shape():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    raw = quants.quantize(x, T.Q8_0).reshape(-1)
    got = quant.dequantize_to_f32(raw, T.Q8_0, (3, 64))
    assert got.shape == (3, 64) and got.dtype == np.float32
    assert np.array_equal(got, quants.dequantize(raw.reshape(3, -1), T.Q8_0))
    raw16 = x.astype(np.float16).view(np.uint8).reshape(-1)
    assert np.array_equal(quant.dequantize_to_f32(raw16, int(T.F16), [3, 64]), x.astype(np.float16).astype(np.float32))


def test_zero_elements():
    out = np.empty(0, dtype=np.float32)
    quant.dequantize(np.empty(0, dtype=np.uint8), T.Q4_0, 0, out)
    assert quant.dequantize_to_f32(np.empty(0, dtype=np.uint8), T.Q6_K, (0, 256)).shape == (0, 256)


# ---- errors -------------------------------------------------------------------------------

def _err(raw, qtype, n, out, n_threads=0):
    with pytest.raises(ValueError) as info:
        quant.dequantize(raw, qtype, n, out, n_threads)
    return str(info.value)


def test_unsupported_type_is_named():
    msg = _err(np.zeros(36, np.uint8), T.Q1_0, 256, np.empty(256, np.float32))
    assert "Q1_0" in msg and "unsupported" in msg
    msg = _err(np.zeros(20, np.uint8), 9999, 32, np.empty(32, np.float32))
    assert "9999" in msg


def test_raw_size_mismatch():
    msg = _err(np.zeros(33, np.uint8), T.Q8_0, 32, np.empty(32, np.float32))
    assert "33 bytes" in msg and "34" in msg
    msg = _err(np.zeros(144 * 2 - 1, np.uint8), T.Q4_K, 512, np.empty(512, np.float32))
    assert "287 bytes" in msg and "288" in msg


def test_not_whole_blocks():
    msg = _err(np.zeros(34, np.uint8), T.Q8_0, 31, np.empty(31, np.float32))
    assert "31" in msg and "Q8_0" in msg and "block" in msg
    with pytest.raises(ValueError, match="not a whole number"):
        quant.dequantize_to_f32(np.zeros(2 * 34, np.uint8), T.Q8_0, (32, 2))  # 2 blocks, rows of 2


def test_out_checks():
    raw = np.zeros(34, np.uint8)
    assert "out has 31" in _err(raw, T.Q8_0, 32, np.empty(31, np.float32))
    assert "float32" in _err(raw, T.Q8_0, 32, np.empty(32, np.float64))
    assert "float32" in _err(raw, T.Q8_0, 32, np.empty((2, 16), np.float32))
    assert "float32" in _err(raw, T.Q8_0, 32, np.empty(64, np.float32)[::2])
    assert "float32" in _err(raw, T.Q8_0, 32, [0.0] * 32)
    ro = np.empty(32, np.float32)
    ro.flags.writeable = False
    assert "read-only" in _err(raw, T.Q8_0, 32, ro)


def test_raw_checks():
    out = np.empty(32, np.float32)
    assert "uint8" in _err(np.zeros(17, np.uint16), T.Q8_0, 32, out)
    assert "uint8" in _err(np.zeros((2, 17), np.uint8), T.Q8_0, 32, out)
    assert "uint8" in _err(np.zeros(68, np.uint8)[::2], T.Q8_0, 32, out)
    quant.dequantize(bytes(34), T.Q8_0, 32, out)  # any 1-D byte buffer is fine
    assert not out.any()


def test_bad_counts():
    out = np.empty(32, np.float32)
    assert "n_elements" in _err(np.zeros(34, np.uint8), T.Q8_0, -32, out)
    assert "n_threads" in _err(np.zeros(34, np.uint8), T.Q8_0, 32, out, -1)


@pytest.mark.parametrize("qtype", (T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K), ids=lambda t: t.name)
def test_edge_blocks_match_gguf(qtype):
    """Blocks of all-zero and all-0xFF quants, negative / zero / subnormal / largest f16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    offs = {T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), **K_SCALE_OFFSETS}[qtype]
    blocks = []
    for fill in (0x00, 0xFF, 0x5A):
        for scale in (-0.0625, 0.0, 6e-8, 65504.0, -1.5):
            b = np.full(size, fill, np.uint8)
            for off in offs:
                b[off:off + 2] = np.array([scale], np.float16).view(np.uint8)
            blocks.append(b)
    raw = np.concatenate(blocks)
    n = len(blocks) * block
    ref = np.asarray(quants.dequantize(raw.reshape(len(blocks), -1), qtype), np.float32).reshape(-1)
    out = np.empty(n, np.float32)
    quant.dequantize(raw, qtype, n, out, 1)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
