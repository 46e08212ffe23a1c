"""Constants and fixed layouts of the RPC protocol; docs/rpc-protocol.md is the normative text.

The structure layouts are numpy structured dtypes so both ends read and write them without any
general-purpose deserializer; `pyllama._fast.wire` encodes and validates graphs with them.
"""
from __future__ import annotations

import enum
import struct
from typing import Any, Callable

import numpy as np

VERSION = (1, 1, 0)


class Cmd(enum.IntEnum):
    HELLO = 0
    DEVICE_COUNT = 1
    GET_DEVICE_INFO = 2
    ALLOC_BUFFER = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    GET_TENSORS = 9
    COPY_TENSOR = 10
    GRAPH_COMPUTE = 11
    GRAPH_RECOMPUTE = 12
    SYNCHRONIZE = 13
    TRACE_SYNC = 14
    AUTH = 15
    GET_DEVICE_TYPES = 16
    DEVICE_BUSY = 17
    SESSION_KEY = 18
    BIND_SESSION = 19


ONE_WAY = frozenset({Cmd.SET_TENSOR, Cmd.GRAPH_COMPUTE, Cmd.GRAPH_RECOMPUTE})


class Cap(enum.IntFlag):
    GET_TENSORS = 1 << 0
    TRACE_SYNC = 1 << 1
    SET_TENSOR_HASH = 1 << 2
    BACKEND_SAMPLING = 1 << 3  # graphs may hold the SAMPLE op
    AUTH = 1 << 4              # the server requires AUTH before any other command
    DEVICE_TYPES = 1 << 5      # GET_DEVICE_TYPES: the weight and KV cache types a device holds
    MOE_FFN = 1 << 6           # graphs may hold the MOE_FFN op (Mixture-of-Experts layers, CPU devices)
    DEVICE_BUSY = 1 << 7       # DEVICE_BUSY: when a device computed (the live pipeline view)
    FAMILY_OPS = 1 << 8        # graphs may hold GEGLU, SCALE, SOFTCAP and ATTENTION's extensions (CPU devices)
    LANES = 1 << 9             # SESSION_KEY, BIND_SESSION: further connections (lanes) share a session's buffers
    LORA = 1 << 10             # graphs may hold the LORA op (LoRA adapters' products, CPU devices)


STATUS_OK = 0
STATUS_ERROR = 1
STATUS_EARLIER_ERROR = 2

HEADER = struct.Struct("<BQ")           # request: command, payload size; reply: status, payload size
HELLO_REQ = struct.Struct("<BBBB")
HELLO_REP = struct.Struct("<BBBBIQ")
DEVICE_INFO = struct.Struct("<64sIIQQ")
ALLOC_REQ = struct.Struct("<IIQ")
ALLOC_REP = struct.Struct("<QQ")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
REGION = struct.Struct("<QQ")           # offset, size (after a tensor)
GRAPH_HEAD = struct.Struct("<IIQII")    # device, reserved, uid, n_tensors, n_nodes
RECOMPUTE = struct.Struct("<IIQ")       # device, reserved, uid
TRACE_REP = struct.Struct("<QQ")
DEVICE_TYPES_HEAD = struct.Struct("<II")  # n_weight_types, n_kv_types (then that many u32 type ids)
MAX_DEVICE_TYPES = 64                     # type ids are below 64; a reply listing more is refused
BUSY_REQ = struct.Struct("<IIQ")          # device, reserved, since_us (server clock)
BUSY_HEAD = struct.Struct("<QQQII")       # t_recv_us, t_reply_us, busy_total_us, n_spans, reserved
BUSY_SPAN = struct.Struct("<QQ")          # start_us, end_us (server clock)
SESSION_KEY_SIZE = 16                     # bytes of a session's key (SESSION_KEY's reply, BIND_SESSION's request)
MAX_BUSY_SPANS = 4096                     # spans in one DEVICE_BUSY reply at most (the newest)

MAX_DIMS = 4
NAME_LEN = 48
MAX_SRC = 10
N_PARAMS = 12
NO_SRC = 0xFFFFFFFF

TENSOR = np.dtype([("buffer", "<u8"), ("offset", "<u8"), ("dtype", "<u4"), ("n_dims", "<u4"),
                   ("shape", "<u8", (MAX_DIMS,)), ("name", f"S{NAME_LEN}")])
NODE = np.dtype([("op", "<u4"), ("out", "<u4"), ("n_src", "<u4"), ("src", "<u4", (MAX_SRC,)),
                 ("params", "<f8", (N_PARAMS,))])
assert TENSOR.itemsize == 104 and NODE.itemsize == 148

USAGE = {"compute": 0, "weights": 1, "kv": 2}
KIND = {"cpu": 0, "cuda": 1}

DEFAULT_MAX_FRAME = 4 << 30             # largest payload a server accepts
DEFAULT_MAX_READ = 4 << 30              # largest total a GET_TENSORS reply may carry


def graph_tables(graph: Any, buffer_id: Callable[[Any], int]) -> tuple[list, list]:
    """A graph's (tensors, nodes) in the form `pyllama._fast.wire.encode_graph` takes: tensors
    numbered in order of first use, `buffer_id(buffer)` naming each tensor's buffer on the wire."""
    index: dict[int, int] = {}
    tensors: list = []

    def idx(t: Any) -> int:
        i = index.get(id(t))
        if i is None:
            i = index[id(t)] = len(tensors)
            tensors.append((buffer_id(t.buffer), t.offset, int(t.dtype), t.shape, t.name))
        return i

    nodes = [(int(nd.op), idx(nd.out), tuple(idx(s) for s in nd.srcs), tuple(float(p) for p in nd.params))
             for nd in graph.nodes]
    return tensors, nodes
