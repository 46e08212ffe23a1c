# cython: language_level=3
"""Graph encoding and structural validation for the RPC wire (docs/rpc-protocol.md).

A GRAPH_COMPUTE payload is `GRAPH_HEAD | n_tensors x tensor | n_nodes x node`, the fixed layouts
of `pyllama.rpc.protocol` (TENSOR, NODE). Nothing here builds Python objects from wire bytes
other than numpy structured arrays of those dtypes and integers.

The codec checks structure: sizes against counts, n_dims, unused shape and source entries,
tensor indices, dtypes it knows, byte sizes and `offset + size` without overflow. What the ops
mean (source counts, parameters, dtypes per op) is checked by whoever runs the graph.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

import sys

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as _QT

from pyllama.rpc.protocol import (GRAPH_HEAD, MAX_DIMS, MAX_SRC, N_PARAMS, NAME_LEN, NO_SRC, NODE,
                                  TENSOR)

__all__ = ["encode_graph", "decode_graph", "tensor_nbytes", "SUPPORTED_DTYPES",
           "MAX_GRAPH_TENSORS", "MAX_GRAPH_NODES"]

# A graph of the coarse ops is ~10 nodes per layer; these bounds are far above any real model and
# keep a hostile count from costing more than one small refusal.
MAX_GRAPH_TENSORS = 1 << 16
MAX_GRAPH_NODES = 1 << 16

cdef uint64_t U64_MAX = 0xFFFFFFFFFFFFFFFF


cdef packed struct head_t:
    uint32_t device
    uint32_t reserved
    uint64_t uid
    uint32_t n_tensors
    uint32_t n_nodes


cdef packed struct tensor_t:
    uint64_t buffer
    uint64_t offset
    uint32_t dtype
    uint32_t n_dims
    uint64_t shape[4]
    char name[48]


cdef packed struct node_t:
    uint32_t op
    uint32_t out
    uint32_t n_src
    uint32_t src[10]
    double params[12]


if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("pyllama._fast.wire assumes a little-endian host")
if (sizeof(tensor_t), sizeof(node_t), sizeof(head_t)) != (TENSOR.itemsize, NODE.itemsize, GRAPH_HEAD.size):
    raise ImportError("pyllama._fast.wire: structure sizes disagree with pyllama.rpc.protocol")
if (MAX_DIMS, NAME_LEN, MAX_SRC, N_PARAMS, TENSOR.fields["shape"][1]) != (4, 48, 10, 12, 24):
    raise ImportError("pyllama._fast.wire: structure constants disagree with pyllama.rpc.protocol")

DEF N_TYPE_IDS = 64
cdef uint64_t _block[N_TYPE_IDS]
cdef uint64_t _type_size[N_TYPE_IDS]
memset(_block, 0, sizeof(_block))
memset(_type_size, 0, sizeof(_type_size))

# the element types (F32, F16, BF16, I32) and every weight type of pyllama.ir.tensor.WEIGHT_TYPES
SUPPORTED_DTYPES = tuple(int(t) for t in (_QT.F32, _QT.F16, _QT.BF16, _QT.I32, _QT.Q4_0, _QT.Q4_1, _QT.Q5_0,
                                          _QT.Q5_1, _QT.Q8_0, _QT.Q2_K, _QT.Q3_K, _QT.Q4_K, _QT.Q5_K, _QT.Q6_K,
                                          _QT.IQ4_NL, _QT.IQ4_XS, _QT.MXFP4, _QT.IQ2_XXS, _QT.IQ2_XS, _QT.IQ2_S,
                                          _QT.IQ3_XXS, _QT.IQ3_S, _QT.IQ1_S, _QT.IQ1_M, _QT.TQ1_0, _QT.TQ2_0))
for _t in SUPPORTED_DTYPES:
    _block[_t] = GGML_QUANT_SIZES[_QT(_t)][0]
    _type_size[_t] = GGML_QUANT_SIZES[_QT(_t)][1]


cdef inline bint _mul(uint64_t a, uint64_t b, uint64_t* r) noexcept nogil:
    """r = a * b; False on overflow."""
    if a != 0 and b > U64_MAX // a:
        return False
    r[0] = a * b
    return True


cdef int _nbytes(uint32_t dtype, uint32_t n_dims, const uint64_t* shape, uint64_t* out) noexcept nogil:
    """Byte size of a row-major tensor: 0 ok, 1 unknown dtype, 2 partial block row, 3 overflow."""
    if dtype >= N_TYPE_IDS or _block[dtype] == 0:
        return 1
    cdef uint64_t block = _block[dtype], n = 1
    cdef uint32_t i
    if shape[n_dims - 1] % block:
        return 2
    for i in range(n_dims - 1):
        if not _mul(n, shape[i], &n):
            return 3
    if not _mul(n, shape[n_dims - 1] // block, &n):
        return 3
    if not _mul(n, _type_size[dtype], &n):
        return 3
    out[0] = n
    return 0


cdef inline int _tensor_nbytes(const tensor_t* t, uint64_t* dims, uint64_t* out) noexcept nogil:
    """_nbytes of a (possibly unaligned, packed) wire tensor; copies its shape into `dims`."""
    memcpy(dims, <const char*>t + 24, 4 * sizeof(uint64_t))  # shape sits at byte 24 (checked at import)
    return _nbytes(t.dtype, t.n_dims, dims, out)


cdef str _type_name(uint32_t dtype):
    try:
        return _QT(dtype).name
    except ValueError:
        return f"type {dtype}"


cdef str _size_error(int code, uint32_t dtype, uint32_t n_dims, const uint64_t* shape):
    shp = [shape[i] for i in range(n_dims)]
    if code == 1:
        return f"unsupported dtype {dtype}"
    if code == 2:
        return f"a row of {shape[n_dims - 1]} is not a whole number of {_type_name(dtype)} blocks"
    return f"the byte size of {_type_name(dtype)}{shp} overflows 64 bits"


def fnv1a64(data) -> int:
    """The 64-bit FNV-1a hash of a bytes-like object, as ggml's RPC hashes a tensor write for a
    llama.cpp rpc-server's cache (SET_TENSOR_HASH). The GIL is released over the bytes."""
    cdef const uint8_t[::1] view = memoryview(data).cast("B")
    cdef uint64_t h = 0xcbf29ce484222325ULL
    cdef Py_ssize_t i, n = view.shape[0]
    with nogil:
        for i in range(n):
            h = (h ^ view[i]) * 0x100000001b3ULL
    return h


def tensor_nbytes(dtype, shape) -> int:
    """Bytes of a row-major `dtype` tensor of `shape` (1 to 4 dims); ValueError when it has none."""
    cdef uint64_t dims[4]
    cdef uint64_t n = 0
    cdef uint32_t nd
    cdef int code
    dt = int(dtype)
    if not 0 <= dt < N_TYPE_IDS or _block[dt] == 0:
        raise ValueError(f"unsupported dtype {dt}")
    shp = [int(d) for d in shape]
    if not 1 <= len(shp) <= 4:
        raise ValueError(f"a tensor has 1 to 4 dimensions, not {len(shp)}")
    for i, d in enumerate(shp):
        if not 0 <= d <= U64_MAX:
            raise ValueError(f"dimension {i} of {shp} is not a u64")
        dims[i] = d
    nd = len(shp)
    code = _nbytes(dt, nd, dims, &n)
    if code:
        raise ValueError(_size_error(code, dt, nd, dims))
    return n


cdef str _name_of(const tensor_t* t):
    cdef bytes raw = t.name[:48]
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


cdef bytes _name_bytes(name):
    if isinstance(name, (bytes, bytearray)):
        raw = bytes(name)
    else:
        raw = str(name).encode("utf-8")
    if len(raw) > NAME_LEN:  # cut at a character boundary
        raw = raw[:NAME_LEN].decode("utf-8", "ignore").encode("utf-8")
    return raw


def encode_graph(device, unsigned long long uid, list tensors, list nodes) -> bytes:
    """The whole GRAPH_COMPUTE payload.

    tensors: (buffer_id, offset, dtype, shape (1..4 dims), name) per tensor;
    nodes: (op, out_index, src_indices (<= 10), params (<= 12 floats)) per node.
    """
    cdef Py_ssize_t n_t = len(tensors), n_n = len(nodes), i, j, k
    cdef uint64_t nb = 0
    cdef uint64_t dims[4]
    cdef int code
    cdef head_t* head
    cdef tensor_t* t
    cdef node_t* nd
    if not 0 <= device <= 0xFFFFFFFF:
        raise ValueError(f"device {device} is not a u32")
    if n_t > MAX_GRAPH_TENSORS or n_n > MAX_GRAPH_NODES:
        raise ValueError(f"a graph holds at most {MAX_GRAPH_TENSORS} tensors and {MAX_GRAPH_NODES} nodes, "
                         f"not {n_t} and {n_n}")
    cdef Py_ssize_t size = sizeof(head_t) + n_t * sizeof(tensor_t) + n_n * sizeof(node_t)
    out = PyBytes_FromStringAndSize(NULL, size)
    cdef char* base = PyBytes_AS_STRING(out)
    memset(base, 0, size)
    head = <head_t*>base
    head.device = device
    head.uid = uid
    head.n_tensors = <uint32_t>n_t
    head.n_nodes = <uint32_t>n_n
    t = <tensor_t*>(base + sizeof(head_t))
    for i in range(n_t):
        try:
            buffer_id, offset, dtype, shape, name = tensors[i]
            t[i].buffer = buffer_id
            t[i].offset = offset
            t[i].dtype = dtype
            shape = tuple(shape)
            if not 1 <= len(shape) <= 4:
                raise ValueError(f"{len(shape)} dimensions (1 to 4 travel)")
            t[i].n_dims = <uint32_t>len(shape)
            for k in range(len(shape)):
                t[i].shape[k] = shape[k]
        except (OverflowError, TypeError, ValueError) as exc:
            raise ValueError(f"tensor {i}: {exc}") from None
        code = _tensor_nbytes(&t[i], dims, &nb)
        if code:
            raise ValueError(f"tensor {i} ({name}): {_size_error(code, t[i].dtype, t[i].n_dims, dims)}")
        if nb > U64_MAX - t[i].offset:
            raise ValueError(f"tensor {i} ({name}): offset {t[i].offset} + {nb} bytes overflows 64 bits")
        raw = _name_bytes(name)
        memcpy(t[i].name, <const char*>raw, len(raw))
    nd = <node_t*>(base + sizeof(head_t) + n_t * sizeof(tensor_t))
    for j in range(n_n):
        try:
            op, out_index, srcs, params = nodes[j]
            srcs = tuple(srcs)
            params = tuple(params)
            if len(srcs) > MAX_SRC:
                raise ValueError(f"{len(srcs)} sources (at most {MAX_SRC})")
            if len(params) > N_PARAMS:
                raise ValueError(f"{len(params)} parameters (at most {N_PARAMS})")
            nd[j].op = op
            if not 0 <= out_index < n_t:
                raise ValueError(f"output index {out_index} outside the {n_t} tensors")
            nd[j].out = out_index
            nd[j].n_src = <uint32_t>len(srcs)
            for k in range(MAX_SRC):
                nd[j].src[k] = NO_SRC
            for k in range(len(srcs)):
                if not 0 <= srcs[k] < n_t:
                    raise ValueError(f"source {k} index {srcs[k]} outside the {n_t} tensors")
                nd[j].src[k] = srcs[k]
            for k in range(len(params)):
                nd[j].params[k] = params[k]
        except (OverflowError, TypeError, ValueError) as exc:
            raise ValueError(f"node {j}: {exc}") from None
    return out


def decode_graph(payload):
    """(device, uid, tensors, nodes) of a GRAPH_COMPUTE payload; ValueError when it is malformed.

    `tensors` and `nodes` are copies, structured arrays of protocol.TENSOR and protocol.NODE.
    """
    mv = memoryview(payload)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    cdef const uint8_t[::1] buf = mv
    cdef uint64_t n = buf.shape[0]
    cdef head_t head
    if n < sizeof(head_t):
        raise ValueError(f"graph payload of {n} bytes is shorter than its {sizeof(head_t)}-byte head")
    memcpy(&head, &buf[0], sizeof(head_t))
    if head.n_tensors > MAX_GRAPH_TENSORS:
        raise ValueError(f"graph of {head.n_tensors} tensors (at most {MAX_GRAPH_TENSORS})")
    if head.n_nodes > MAX_GRAPH_NODES:
        raise ValueError(f"graph of {head.n_nodes} nodes (at most {MAX_GRAPH_NODES})")
    # both counts are below 2^17: no overflow in 64 bits
    cdef uint64_t need = sizeof(head_t) + <uint64_t>head.n_tensors * sizeof(tensor_t) \
        + <uint64_t>head.n_nodes * sizeof(node_t)
    if n != need:
        raise ValueError(f"graph payload is {n} bytes but {head.n_tensors} tensors and {head.n_nodes} nodes "
                         f"need {need}")
    cdef uint32_t n_t = head.n_tensors, n_n = head.n_nodes, i, j, k
    tensors = np.frombuffer(mv, TENSOR, n_t, sizeof(head_t)).copy()
    nodes = np.frombuffer(mv, NODE, n_n, sizeof(head_t) + n_t * sizeof(tensor_t)).copy()
    cdef const tensor_t* t = <const tensor_t*>&buf[sizeof(head_t)] if n_t else NULL
    cdef const node_t* nd = <const node_t*>&buf[sizeof(head_t) + n_t * sizeof(tensor_t)] if n_n else NULL
    cdef uint64_t nb = 0
    cdef uint64_t dims[4]
    cdef int code
    for i in range(n_t):
        if t[i].n_dims < 1 or t[i].n_dims > 4:
            raise ValueError(f"tensor {i} ({_name_of(&t[i])}): n_dims {t[i].n_dims} is not in 1..4")
        for k in range(t[i].n_dims, 4):
            if t[i].shape[k] != 0:
                raise ValueError(f"tensor {i} ({_name_of(&t[i])}): unused shape entry {k} is "
                                 f"{t[i].shape[k]}, not 0")
        code = _tensor_nbytes(&t[i], dims, &nb)
        if code:
            raise ValueError(f"tensor {i} ({_name_of(&t[i])}): "
                             f"{_size_error(code, t[i].dtype, t[i].n_dims, dims)}")
        if nb > U64_MAX - t[i].offset:
            raise ValueError(f"tensor {i} ({_name_of(&t[i])}): offset {t[i].offset} + {nb} bytes "
                             f"overflows 64 bits")
    for j in range(n_n):
        if nd[j].n_src > MAX_SRC:
            raise ValueError(f"node {j}: n_src {nd[j].n_src} exceeds {MAX_SRC}")
        if nd[j].out >= n_t:
            raise ValueError(f"node {j}: output index {nd[j].out} outside the {n_t} tensors")
        for k in range(nd[j].n_src):
            if nd[j].src[k] >= n_t:
                raise ValueError(f"node {j}: source {k} index {nd[j].src[k]} outside the {n_t} tensors")
        for k in range(nd[j].n_src, MAX_SRC):
            if nd[j].src[k] != NO_SRC:
                raise ValueError(f"node {j}: unused source entry {k} is {nd[j].src[k]}, not 0xFFFFFFFF")
    return head.device, head.uid, tensors, nodes
