"""ggml's RPC protocol, version 5.0.0 (llama.cpp's `rpc-server`): the client side's codec.

Byte layouts are in docs/ggml-rpc-protocol.md. The peer trusts its client and answers any request
it cannot serve by closing the connection, so nothing here is a status code: a reply is either the
exact size its command defines or the connection is over. Every reply is checked against that size
before a byte of its payload is allocated (`reply_size`), and every decoded value against what the
command can return, so a hostile or broken peer gives one clear error, never a large allocation or
a wrong pointer used later.
"""
from __future__ import annotations

import struct
from enum import IntEnum
from typing import Optional, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ...util.errors import PyllamaError

VERSION = (5, 0, 0)
CONN_CAPS_SIZE = 24          # HELLO's transport capabilities (RDMA upgrade); pyllama offers none
MAX_DIMS = 4
MAX_SRC = 10
MAX_OP_PARAMS = 64           # bytes
MAX_NAME = 64
MAX_DEVICES = 256            # a DEVICE_COUNT above this is not a real peer's


class GCmd(IntEnum):
    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16
    MEMSET_TENSOR = 17


ONE_WAY = frozenset({GCmd.SET_TENSOR, GCmd.GRAPH_COMPUTE, GCmd.GRAPH_RECOMPUTE})

# ggml's op codes in this protocol version (its patch version moves when ggml adds an op)
GGML_OPS: tuple[str, ...] = (
    "NONE", "DUP", "ADD", "ADD_ID", "ADD1", "ACC", "SUB", "MUL", "DIV", "SQR", "SQRT", "LOG", "SIN", "COS",
    "SUM", "SUM_ROWS", "CUMSUM", "MEAN", "ARGMAX", "COUNT_EQUAL", "REPEAT", "REPEAT_BACK", "CONCAT",
    "SILU_BACK", "NORM", "RMS_NORM", "RMS_NORM_BACK", "GROUP_NORM", "L2_NORM", "MUL_MAT", "MUL_MAT_ID",
    "OUT_PROD", "SCALE", "SET", "CPY", "CONT", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE", "GET_ROWS",
    "GET_ROWS_BACK", "SET_ROWS", "DIAG", "DIAG_MASK_INF", "DIAG_MASK_ZERO", "SOFT_MAX", "SOFT_MAX_BACK",
    "ROPE", "ROPE_BACK", "CLAMP", "CONV_TRANSPOSE_1D", "IM2COL", "IM2COL_BACK", "IM2COL_3D", "COL2IM_1D",
    "CONV_2D", "CONV_3D", "CONV_2D_DW", "CONV_TRANSPOSE_2D", "POOL_1D", "POOL_2D", "POOL_2D_BACK", "UPSCALE",
    "PAD", "PAD_REFLECT_1D", "ROLL", "ARANGE", "TIMESTEP_EMBEDDING", "ARGSORT", "TOP_K", "LEAKY_RELU", "TRI",
    "FILL", "FLASH_ATTN_EXT", "FLASH_ATTN_BACK", "SSM_CONV", "SSM_SCAN", "WIN_PART", "WIN_UNPART",
    "GET_REL_POS", "ADD_REL_POS", "RWKV_WKV6", "GATED_LINEAR_ATTN", "RWKV_WKV7", "SOLVE_TRI",
    "GATED_DELTA_NET", "LIGHTNING_INDEXER", "DSV4_HC_COMB", "DSV4_HC_PRE", "DSV4_HC_POST", "UNARY",
    "MAP_CUSTOM1", "MAP_CUSTOM2", "MAP_CUSTOM3", "CUSTOM", "CROSS_ENTROPY_LOSS", "CROSS_ENTROPY_LOSS_BACK",
    "OPT_STEP_ADAMW", "OPT_STEP_SGD", "GLU")
assert len(GGML_OPS) == 101
GOp = IntEnum("GOp", {name: code for code, name in enumerate(GGML_OPS)})

# a node without this flag is skipped by ggml's backends (ggml's graph builder sets it on every op)
FLAG_COMPUTE = 16

# rpc_tensor: every field packed, 296 bytes (ne and nb are 32-bit on the wire)
RPC_TENSOR = np.dtype([
    ("id", "<u8"), ("type", "<u4"), ("buffer", "<u8"), ("ne", "<u4", (MAX_DIMS,)), ("nb", "<u4", (MAX_DIMS,)),
    ("op", "<u4"), ("op_params", "<i4", (MAX_OP_PARAMS // 4,)), ("flags", "<i4"), ("src", "<u8", (MAX_SRC,)),
    ("view_src", "<u8"), ("view_offs", "<u8"), ("data", "<u8"), ("name", "S64"), ("padding", "V4")])
assert RPC_TENSOR.itemsize == 296

U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
HEADER = struct.Struct("<BQ")                  # request: command, payload size
HELLO_REP = struct.Struct(f"<BBBB{CONN_CAPS_SIZE}s")
ALLOC_REQ = struct.Struct("<IQ")               # device, size
PTR_SIZE = struct.Struct("<QQ")                # ALLOC_BUFFER: remote_ptr, remote_size; memory: free, total
CLEAR_REQ = struct.Struct("<QB")               # remote_ptr, value
REGION = struct.Struct("<QQ")                  # GET_TENSOR / SET_TENSOR_HASH: offset, size or hash
MEMSET_TAIL = struct.Struct("<QQB")            # offset, size, value


class GGMLProtocolError(PyllamaError):
    """A ggml peer's reply that the protocol does not allow (wrong size, impossible value)."""


def version_text(v: Sequence[int]) -> str:
    return ".".join(str(int(x)) for x in v)


def hello_request() -> bytes:
    return bytes(CONN_CAPS_SIZE)


def check_hello(endpoint: str, payload: bytes) -> tuple[int, int, int]:
    """The peer's version, or one error naming both versions. Only this exact version: ggml moves
    the patch when its op list changes, and ops are inserted, not only appended, so the op codes a
    graph carries are those of one patch."""
    major, minor, patch, _, _ = HELLO_REP.unpack(payload)
    if (major, minor, patch) != VERSION:
        raise GGMLProtocolError(f"the llama.cpp rpc-server at {endpoint} speaks ggml RPC protocol "
                                f"{version_text((major, minor, patch))}; pyllama speaks {version_text(VERSION)} "
                                "(its op codes differ from one version to the next)")
    return major, minor, patch


def expected_reply(cmd: GCmd, asked: int = 0) -> Optional[int]:
    """The exact payload size of `cmd`'s reply (None: one-way). GET_TENSOR's is the size asked."""
    return {GCmd.HELLO: HELLO_REP.size, GCmd.DEVICE_COUNT: 4, GCmd.ALLOC_BUFFER: PTR_SIZE.size,
            GCmd.GET_ALIGNMENT: 8, GCmd.GET_MAX_SIZE: 8, GCmd.BUFFER_GET_BASE: 8, GCmd.FREE_BUFFER: 0,
            GCmd.BUFFER_CLEAR: 0, GCmd.SET_TENSOR_HASH: 1, GCmd.GET_TENSOR: asked, GCmd.COPY_TENSOR: 1,
            GCmd.GET_DEVICE_MEMORY: PTR_SIZE.size, GCmd.INIT_TENSOR: 0, GCmd.GET_ALLOC_SIZE: 8,
            GCmd.MEMSET_TENSOR: 0}.get(cmd)


def check_reply_size(endpoint: str, cmd: GCmd, got: int, want: int) -> None:
    if got != want:
        raise GGMLProtocolError(f"the ggml peer at {endpoint} answered {cmd.name} with {got} bytes; "
                                f"the protocol's reply is {want} bytes")


def decode_bool(endpoint: str, cmd: GCmd, payload: bytes) -> bool:
    v = payload[0]
    if v > 1:
        raise GGMLProtocolError(f"the ggml peer at {endpoint} answered {cmd.name} with result {v} (0 or 1)")
    return bool(v)


def decode_device_count(endpoint: str, payload: bytes) -> int:
    n = U32.unpack(payload)[0]
    if not 0 < n <= MAX_DEVICES:
        raise GGMLProtocolError(f"the ggml peer at {endpoint} reports {n} devices (1..{MAX_DEVICES})")
    return n


def decode_alignment(endpoint: str, payload: bytes) -> int:
    a = U64.unpack(payload)[0]
    if a == 0 or a & (a - 1) or a > 1 << 30:
        raise GGMLProtocolError(f"the ggml peer at {endpoint} reports an alignment of {a} bytes "
                                "(a power of two up to 1 GiB)")
    return a


def decode_alloc(endpoint: str, payload: bytes, asked: int) -> tuple[int, int]:
    """(remote_ptr, size); remote_ptr 0 means the peer had no room (size is then 0)."""
    ptr, size = PTR_SIZE.unpack(payload)
    if ptr and size < asked:
        raise GGMLProtocolError(f"the ggml peer at {endpoint} gave a buffer of {size} bytes for {asked} asked")
    if not ptr and size:
        raise GGMLProtocolError(f"the ggml peer at {endpoint} gave no buffer but a size of {size} bytes")
    return ptr, size


def decode_base(endpoint: str, payload: bytes, remote_ptr: int) -> int:
    base = U64.unpack(payload)[0]
    if base == 0:
        raise GGMLProtocolError(f"the ggml peer at {endpoint} gave buffer {remote_ptr:#x} a null base")
    return base


def decode_memory(endpoint: str, payload: bytes) -> tuple[int, int]:
    free, total = PTR_SIZE.unpack(payload)
    if free > total:
        raise GGMLProtocolError(f"the ggml peer at {endpoint} reports {free} bytes free of {total}")
    return free, total


def graph_payload(device: int, nodes: Sequence[int], tensors: np.ndarray) -> list[bytes | memoryview]:
    """GRAPH_COMPUTE: device, the node ids in order, then every tensor they reach (each id once;
    a source before the node that reads it is not required by the peer, but ids must resolve)."""
    ids = np.asarray(nodes, dtype="<u8")
    if tensors.dtype != RPC_TENSOR:
        raise TypeError("tensors must be rpc_tensor records")
    return [struct.pack("<II", device, len(ids)), ids.tobytes(), U32.pack(len(tensors)),
            memoryview(tensors).cast("B")]


def parse_graph(payload: bytes) -> tuple[int, np.ndarray, np.ndarray]:
    """GRAPH_COMPUTE's payload back to (device, node ids, tensor records), checking every count
    against the bytes there are (for the test peer and the fuzzer)."""
    if len(payload) < 8:
        raise GGMLProtocolError("GRAPH_COMPUTE shorter than its counts")
    device, n_nodes = struct.unpack_from("<II", payload)
    end_nodes = 8 + 8 * n_nodes
    if len(payload) < end_nodes + 4:
        raise GGMLProtocolError(f"GRAPH_COMPUTE names {n_nodes} nodes in {len(payload)} bytes")
    nodes = np.frombuffer(payload, dtype="<u8", count=n_nodes, offset=8)
    (n_tensors,) = U32.unpack_from(payload, end_nodes)
    if len(payload) < end_nodes + 4 + n_tensors * RPC_TENSOR.itemsize:
        raise GGMLProtocolError(f"GRAPH_COMPUTE names {n_tensors} tensors in {len(payload)} bytes")
    tensors = np.frombuffer(payload, dtype=RPC_TENSOR, count=n_tensors, offset=end_nodes + 4)
    return device, nodes, tensors


def tensor_bytes(rec: np.void | np.ndarray) -> bytes:
    return np.asarray(rec, dtype=RPC_TENSOR).tobytes()


def contiguous_nb(ggml_type: int, ne: Sequence[int]) -> tuple[int, int, int, int]:
    """ggml's strides of a contiguous tensor: nb[0] the element (block) size, nb[1] a row's bytes."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    ne = list(ne) + [1] * (MAX_DIMS - len(ne))
    if ne[0] % block:
        raise ValueError(f"a row of {ne[0]} is not a whole number of {block}-element blocks")
    nb1 = size * (ne[0] // block)
    return size, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2]


def tensor_record(tid: int, ggml_type: int, ne: Sequence[int], *, buffer: int = 0, data: int = 0,
                  op: int = 0, op_params: bytes = b"", src: Sequence[int] = (), view_src: int = 0,
                  view_offs: int = 0, flags: int = 0, name: str = "",
                  nb: Optional[Sequence[int]] = None) -> np.void:
    """One rpc_tensor: ne in ggml's order (ne[0] the row), contiguous strides unless `nb` is given."""
    if len(ne) > MAX_DIMS or len(src) > MAX_SRC or len(op_params) > MAX_OP_PARAMS:
        raise ValueError("too many dimensions, sources or parameter bytes for an rpc_tensor")
    rec = np.zeros((), dtype=RPC_TENSOR)
    rec["id"], rec["type"], rec["buffer"], rec["data"] = tid, ggml_type, buffer, data
    rec["ne"] = list(ne) + [1] * (MAX_DIMS - len(ne))
    rec["nb"] = list(nb) if nb is not None else contiguous_nb(ggml_type, ne)
    rec["op"], rec["flags"], rec["view_src"], rec["view_offs"] = op, flags, view_src, view_offs
    rec["op_params"] = np.frombuffer(op_params.ljust(MAX_OP_PARAMS, b"\0"), dtype="<i4")
    rec["src"] = list(src) + [0] * (MAX_SRC - len(src))
    raw = name.encode()[:MAX_NAME - 1]
    rec["name"] = raw
    return rec[()]


def tensor_nbytes(rec: np.void) -> int:
    """Bytes a contiguous tensor of the record's type and shape spans."""
    _, nb1, _, _ = contiguous_nb(int(rec["type"]), [int(x) for x in rec["ne"]])
    ne = [int(x) for x in rec["ne"]]
    return nb1 * ne[1] * ne[2] * ne[3]
