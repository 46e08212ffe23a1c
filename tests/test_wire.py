"""The graph codec of the RPC wire (pyllama._fast.wire): round trip of a real graph, every structural
refusal of decode_graph, and tensor sizes with overflow checks."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES

from pyllama._fast import wire
from pyllama.backend.base import DType, nbytes_of
from pyllama.backend.cpu import CPUBackend
from pyllama.runtime.context import Batch, Context
from pyllama.models.build.ops import Graph, Op
from pyllama.ir.tensor import WEIGHT_TYPES
from pyllama.models.model import Model
from pyllama.rpc.protocol import GRAPH_HEAD, NO_SRC, NODE, TENSOR
from pyllama.models.weights import Placement, load_weights, split_layers
from pyllama.rpc.protocol import graph_tables

U64_MAX = 2**64 - 1
HEAD = GRAPH_HEAD.size
TS, NS = TENSOR.itemsize, NODE.itemsize


def graph_to_wire(graph: Graph, buffer_id=lambda buf: buf.id):
    return graph_tables(graph, buffer_id)


@pytest.fixture(scope="module")
def llama_graph(model_factory) -> Graph:
    """The graph of a real forward pass of the tiny model (qwen3: q/k norm, 9-source attention)."""
    model = Model(model_factory("tiny", arch="qwen3"))
    backend = CPUBackend(1)
    placement = Placement([backend], split_layers(model.hparams.n_layer, [1]))
    ctx = Context(model, load_weights(model, placement), placement, 64, 1, 16, 16)
    graphs = []
    run = backend.graph_compute
    backend.graph_compute = lambda g, reads=(): (graphs.append(g), run(g, reads))  # type: ignore[method-assign]
    ctx.decode(Batch.for_sequence([256, 3, 4, 5, 6], 0))
    assert len(graphs) == 1
    return graphs[0]


def small_graph() -> tuple[list, list]:
    tensors = [(7, 0, int(DType.F32), (4, 8), "x"), (7, 128, int(DType.F32), (8,), "w"),
               (9, 0, int(DType.F32), (4, 8), "out")]
    nodes = [(int(Op.RMS_NORM), 2, (0, 1), (1e-5,))]
    return tensors, nodes


def patched(payload: bytes, offset: int, dtype: str, value) -> bytes:
    b = bytearray(payload)
    np.frombuffer(b, dtype, 1, offset)[0] = value
    return bytes(b)


# --- round trip ----------------------------------------------------------------------------------

def test_round_trip_of_a_llama_graph(llama_graph):
    tensors, nodes = graph_to_wire(llama_graph)
    assert any(nd[0] == Op.ATTENTION and len(nd[2]) == 9 for nd in nodes)
    payload = wire.encode_graph(3, 0xDEADBEEF12345678, tensors, nodes)
    assert len(payload) == HEAD + len(tensors) * TS + len(nodes) * NS
    device, uid, t, n = wire.decode_graph(payload)
    assert (device, uid) == (3, 0xDEADBEEF12345678)
    assert t.dtype == TENSOR and n.dtype == NODE and len(t) == len(tensors) and len(n) == len(nodes)
    for rec, (buf, off, dt, shape, name) in zip(t, tensors):
        nd = len(shape)
        assert (int(rec["buffer"]), int(rec["offset"]), int(rec["dtype"]), int(rec["n_dims"])) == (buf, off, dt, nd)
        assert tuple(rec["shape"][:nd]) == shape and not rec["shape"][nd:].any()
        assert rec["name"].decode() == name
    for rec, (op, out, srcs, params) in zip(n, nodes):
        assert (int(rec["op"]), int(rec["out"]), int(rec["n_src"])) == (op, out, len(srcs))
        assert tuple(rec["src"][:len(srcs)]) == srcs and (rec["src"][len(srcs):] == NO_SRC).all()
        assert tuple(rec["params"][:len(params)]) == params and not rec["params"][len(params):].any()
    # every buffer-protocol form decodes the same, and the arrays are copies
    buf = bytearray(payload)
    for form in (memoryview(payload), buf, np.frombuffer(payload, np.uint8)):
        _, _, t2, n2 = wire.decode_graph(form)
        assert t2.tobytes() == t.tobytes() and n2.tobytes() == n.tobytes()
    _, _, t3, _ = wire.decode_graph(buf)
    buf[HEAD] ^= 0xFF
    assert t3.tobytes() == t.tobytes()


def test_empty_graph_and_names():
    _, _, t, n = wire.decode_graph(wire.encode_graph(0, 0, [], []))
    assert len(t) == 0 and len(n) == 0
    long = "é" * 30  # 60 bytes of UTF-8: cut at a character boundary
    payload = wire.encode_graph(0, 1, [(1, 0, 0, (1,), long)], [])
    _, _, t, _ = wire.decode_graph(payload)
    assert t[0]["name"].decode() == "é" * 24


def test_encode_refuses_what_cannot_travel():
    tensors, nodes = small_graph()
    bad_tensors = [
        [(1, 0, 0, (), "no dims")], [(1, 0, 0, (1, 1, 1, 1, 1), "five dims")], [(-1, 0, 0, (1,), "neg id")],
        [(1, 2**64, 0, (1,), "big offset")], [(1, 0, 99, (1,), "dtype")], [(1, 0, int(DType.Q8_0), (33,), "rows")],
        [(1, 0, 0, (-4,), "neg dim")], [(1, U64_MAX - 3, 0, (2,), "end overflow")],
    ]
    for ts in bad_tensors:
        with pytest.raises(ValueError):
            wire.encode_graph(0, 0, ts, [])
    for nd in [(4, 3, (0, 1), ()), (4, 0, (0, 5), ()), (4, 0, tuple([0] * 11), ()), (4, 0, (0,), (0.0,) * 13),
               (-1, 0, (0,), ())]:
        with pytest.raises(ValueError):
            wire.encode_graph(0, 0, tensors, [nd])
    with pytest.raises(ValueError):
        wire.encode_graph(-1, 0, tensors, nodes)


# --- decode refusals ---------------------------------------------------------------------------------

def test_decode_refuses_sizes_that_do_not_match_the_counts():
    tensors, nodes = small_graph()
    payload = wire.encode_graph(0, 5, tensors, nodes)
    for bad in (b"", payload[:HEAD - 1], payload[:-1], payload + b"\0", payload[:HEAD + TS]):
        with pytest.raises(ValueError, match="bytes"):
            wire.decode_graph(bad)
    # counts whose byte size would overflow 32 or 64 bits in naive arithmetic
    for n_t, n_n in ((0xFFFFFFFF, 0), (0, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (wire.MAX_GRAPH_TENSORS + 1, 0),
                     (0, wire.MAX_GRAPH_NODES + 1)):
        with pytest.raises(ValueError, match="at most"):
            wire.decode_graph(GRAPH_HEAD.pack(0, 0, 1, n_t, n_n) + payload[HEAD:])


@pytest.mark.parametrize("field,value,match", [
    ("n_dims", 0, "n_dims 0"),
    ("n_dims", 5, "n_dims 5"),
    ("shape3", 7, "unused shape entry"),
    ("dtype", 99, "unsupported dtype"),
    ("dtype", int(DType.Q4_K), "whole number"),
    ("shape0_huge", U64_MAX, "overflows"),
    ("offset", U64_MAX - 16, "overflows"),
])
def test_decode_refuses_bad_tensors(field, value, match):
    tensors, nodes = small_graph()
    payload = wire.encode_graph(0, 5, tensors, nodes)
    t0 = HEAD + TS  # tensor 1 ("w", one dim)
    where = {"n_dims": (t0 + 20, "<u4"), "shape3": (t0 + 24 + 24, "<u8"), "dtype": (t0 + 16, "<u4"),
             "shape0_huge": (t0 + 24, "<u8"), "offset": (t0 + 8, "<u8")}[field]
    with pytest.raises(ValueError, match=match):
        wire.decode_graph(patched(payload, where[0], where[1], value))


@pytest.mark.parametrize("field,value,match", [
    ("out", 3, "output index 3"),
    ("out", 0xFFFFFFFF, "output index"),
    ("src1", 3, "source 1 index 3"),
    ("n_src", 11, "n_src 11"),
    ("n_src", 0xFFFFFFFF, "n_src"),
    ("n_src", 1, "unused source entry 1"),
    ("src5", 0, "unused source entry 5"),
])
def test_decode_refuses_bad_nodes(field, value, match):
    tensors, nodes = small_graph()
    payload = wire.encode_graph(0, 5, tensors, nodes)
    n0 = HEAD + 3 * TS
    where = {"out": n0 + 4, "n_src": n0 + 8, "src1": n0 + 12 + 4, "src5": n0 + 12 + 20}[field]
    with pytest.raises(ValueError, match=match):
        wire.decode_graph(patched(payload, where, "<u4", value))


def test_decode_leaves_op_semantics_to_the_server():
    tensors, nodes = small_graph()
    payload = wire.encode_graph(0, 5, tensors, [(999, 2, (0,), (float("nan"),) * 12)])
    _, _, _, n = wire.decode_graph(payload)
    assert int(n[0]["op"]) == 999


# --- sizes -----------------------------------------------------------------------------------------------

def test_tensor_nbytes_matches_gguf_for_supported_types():
    for dt in wire.SUPPORTED_DTYPES:
        block, size = GGML_QUANT_SIZES[DType(dt)]
        shape = (3, 2, 2 * block)
        assert wire.tensor_nbytes(dt, shape) == nbytes_of(DType(dt), shape) == 12 * size
    assert set(wire.SUPPORTED_DTYPES) == {int(t) for t in (DType.F32, DType.F16, DType.BF16, DType.I32)} | {
        int(t) for t in WEIGHT_TYPES}
    assert wire.tensor_nbytes(DType.F32, (0, 5)) == 0


def test_tensor_nbytes_refusals_and_overflow():
    with pytest.raises(ValueError, match="unsupported"):
        wire.tensor_nbytes(DType.Q1_0, (256,))
    with pytest.raises(ValueError, match="unsupported"):
        wire.tensor_nbytes(2**40, (1,))
    with pytest.raises(ValueError, match="whole number"):
        wire.tensor_nbytes(DType.Q6_K, (255,))
    with pytest.raises(ValueError, match="overflows"):
        wire.tensor_nbytes(DType.F32, (2**62,))           # 2^64 bytes
    with pytest.raises(ValueError, match="overflows"):
        wire.tensor_nbytes(DType.F32, (2**32, 2**32))     # 2^64 elements
    with pytest.raises(ValueError, match="overflows"):
        wire.tensor_nbytes(DType.F16, (2**21, 2**21, 2**21, 2))
    with pytest.raises(ValueError):
        wire.tensor_nbytes(DType.F32, (2**64,))
    with pytest.raises(ValueError):
        wire.tensor_nbytes(DType.F32, ())
    assert wire.tensor_nbytes(DType.F32, (2**61 - 1,)) == 2**63 - 4
    # a quantized size that fits although its element count (2^64) would not
    assert wire.tensor_nbytes(DType.Q4_0, (2**29, 2**35)) == 2**59 * 18
