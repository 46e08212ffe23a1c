"""The Backend interface: one device, its buffers, tensors as views into them, and graph compute.

It mirrors ggml-backend so that the scheduler and the engine never ask what kind of device they
hold: a CPU, a CUDA device and a remote device behind RPC all answer the same calls.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

# the shared vocabulary lives in the bottom module; re-exported for the backends' callers
from ..ir.tensor import FAMILY_OPS, NP_DTYPES, Buffer, DType, Graph, Node, Tensor, family_node, nbytes_of

__all__ = ["DType", "Buffer", "Tensor", "DeviceInfo", "Backend", "Event", "nbytes_of", "NP_DTYPES"]


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    kind: str  # "cpu", "cuda", "rpc"
    description: str
    free: int
    total: int


class Event:
    """A point in a backend's stream of work. CPU backends complete work at submission."""

    def __init__(self, backend: "Backend"):
        self.backend = backend
        self.handle: Any = None


class Backend(ABC):
    """One device. Blocking calls complete before returning; *_async calls complete by synchronize()."""

    name: str

    # --- buffers -----------------------------------------------------------------------------
    @abstractmethod
    def alloc_buffer(self, size: int, usage: str = "compute") -> Buffer: ...

    @abstractmethod
    def free_buffer(self, buffer: Buffer) -> None: ...

    @abstractmethod
    def clear_buffer(self, buffer: Buffer, value: int = 0) -> None: ...

    # --- data --------------------------------------------------------------------------------
    @abstractmethod
    def set_tensor(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        """Writes the bytes of `data` into the tensor starting `offset` bytes in."""

    @abstractmethod
    def get_tensor(self, tensor: Tensor, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Reads the tensor; into `out` (a C-contiguous array of the same byte size) when given."""

    def set_tensor_async(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        self.set_tensor(tensor, data, offset)

    def get_tensor_async(self, tensor: Tensor, out: np.ndarray) -> None:
        self.get_tensor(tensor, out)

    def stage_read(self, tensor: Tensor) -> Any:
        """A staging region (with `.view`, a uint8 array, and `.release()`) for reading `tensor`
        out of this device on its way to another, or None: the caller then uses the host bytes
        its plan set aside. Devices with a staging arena of their own (RPC) override this."""
        return None

    host_memory = False  # whether tensors live in this host's memory (host_array gives views)
    # Whether every command reaches the device in the order it is issued and runs after the ones
    # before it (a write after the graphs issued earlier, whatever reads them): then a step's next
    # micro-batch may be issued to this device while its previous one runs on the later stages
    # of a split (Scheduler.compute_ubatches).
    in_order = False
    # whether graph_compute returns before the graph has run (its work queued on the device or a
    # peer); False: it returns when the graph is done, as on a host device
    compute_async = False
    # whether quantized products cost about as much per token in batches of 16-64 rows as in 512
    # (a CPU's kernels; a GPU's need large batches to fill the device)
    small_batches_cheap = False

    def host_array(self, tensor: Tensor) -> Optional[np.ndarray]:
        """A numpy view of the tensor when its bytes live in this host's memory (a CPU device),
        so a copy to another device can read them in place; None otherwise."""
        return None

    def can_copy_from(self, src: "Backend") -> bool:
        """Whether cpy_tensor_async can take a tensor of `src` without passing through the host."""
        return False

    def cpy_tensor_async(self, src: Tensor, dst: Tensor) -> bool:
        """Copies src (on any backend) into dst (on this one) if this backend knows how; else False."""
        return False

    def cpy_tensor_from_async(self, src: Tensor, dst: Tensor) -> bool:
        """Source-side copy, for backends built for that role; others decline."""
        return False

    def can_copy_to(self, dst: "Backend") -> bool:
        """Whether cpy_tensor_from_async takes this device's tensors to `dst` (planned ahead, so
        the scheduler does not stage those copies through the host)."""
        return False

    # --- compute -----------------------------------------------------------------------------
    @abstractmethod
    def graph_compute(self, graph: "Graph", reads: Sequence[tuple[Tensor, np.ndarray]] = ()) -> None:
        """Runs a graph whose tensors all live on this backend. May return before completion.
        `reads`: tensors to read back into host arrays right after the graph, as part of it;
        they are complete after synchronize()."""

    def synchronize(self) -> None:
        """Waits for every queued operation."""

    def forget_graph(self, uid: int) -> None:
        """Drops whatever the backend keeps for a graph it will not see again."""

    # --- events ------------------------------------------------------------------------------
    def event_new(self) -> Event:
        return Event(self)

    def event_record(self, event: Event) -> None:
        """Marks the current end of this backend's queued work."""

    def event_wait(self, event: Event) -> None:
        """Makes later work on this backend wait for `event` (recorded on any backend)."""
        event.backend.event_synchronize(event)

    def event_synchronize(self, event: Event) -> None:
        """Blocks the host until `event` completed."""

    # --- information -------------------------------------------------------------------------
    @abstractmethod
    def device_info(self) -> DeviceInfo: ...

    def supports(self, op: int) -> bool:
        """Whether graphs on this device may hold `op` (an Op code); every device runs the core
        ops, optional ones (SAMPLE) depend on the device or, for a peer, its capabilities."""
        return True

    def supports_node(self, node: "Node") -> bool:
        """Whether this device runs `node`: its op, and what its parameters ask of it (ATTENTION's
        extensions need the dense families' ops, FAMILY_OPS)."""
        if not self.supports(node.op):
            return False
        return not family_node(node.op, node.params, len(node.srcs)) or all(self.supports(op) for op in FAMILY_OPS)

    # the types a graph may give as a weight (MUL_MAT's matrix, GET_ROWS's table): the rpc server
    # accepts exactly these from a client
    weight_types: frozenset = frozenset({DType.F32})

    # the types this device holds a KV cache in (ATTENTION's k_cache, v_cache); a context that asks
    # for another keeps that cache in F32 on this device, and logs it
    kv_types: frozenset = frozenset({DType.F32})

    def weight_dtype(self, file_dtype: DType) -> DType:
        """The type this backend stores a weight of `file_dtype` in (it may convert at load)."""
        return file_dtype

    def prepare_weights(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Called once the model's weights on this device are written: a device that keeps its own
        layout of some weights (the CPU's repacked quantized weights) makes it now rather than on
        the first graph. Returns the weights whose stored bytes its products no longer read (the
        caller may let their file pages go)."""
        return []

    def drop_weights(self, tensors: Sequence[Tensor]) -> None:
        """These weights are no longer used here (their layer moved to another device): a device
        that keeps its own copies of them (the CPU's repacked weights) lets those go."""

    def fuses(self, dtype: DType) -> bool:
        """Whether weights of `dtype` that one product uses (q|k|v, gate|up) are worth storing as one
        fused copy; when not, each file tensor stays a part of its own (read in place where it can
        be) and MUL_MAT_CAT multiplies by the parts."""
        return True

    def map_host(self, data: np.ndarray, usage: str = "weights") -> Optional[Buffer]:
        """A buffer over host bytes the caller keeps alive (a model file's memory map), so weights
        stored as the file stores them are used in place; None for devices that cannot (every
        device whose memory is not this host's)."""
        return None

    def set_weight(self, tensor: Tensor, offset: int, file_dtype: DType, raw: np.ndarray) -> None:
        """Writes one file tensor (`raw`: its bytes, of type `file_dtype`) into `tensor` (of this
        backend's weight_dtype) starting `offset` bytes in, converting on the way. Called when the
        two types differ and are not F32; a device that converts on arrival (CUDA) overrides this,
        the default converts on the host (to F16 or BF16)."""
        if tensor.dtype not in (DType.F16, DType.BF16):
            raise ValueError(f"{self.name}: cannot convert {file_dtype.name} weights to {tensor.dtype.name} on the host")
        row = tensor.shape[-1]
        values = dequantize_f32(raw, file_dtype, (raw.size // nbytes_of(file_dtype, (row,)), row))
        self.set_tensor(tensor, values.astype(np.float16) if tensor.dtype == DType.F16 else f32_to_bf16(values), offset)

    # --- tracing (GPU backends only) -----------------------------------------------------------
    def trace_mark(self) -> None:
        return None

    def trace_poll(self) -> list[dict[str, Any]]:
        return []

    # --- a device of another machine ------------------------------------------------------------
    remote = False  # reached over the network: it can be lost, and reconnected

    def lost(self) -> Optional[str]:
        """Why this device cannot be used any more (its peer went away or stopped answering), or
        None. Local devices are never lost."""
        return None

    def reach(self) -> None:
        """Opens a new connection to a lost device's peer without touching anything in use (raises
        while the peer cannot be reached); `reconnect` then continues on it."""

    def reconnect(self) -> list[Buffer]:
        """Makes a lost device usable again: every live buffer exists there again (under the same
        Buffer objects), contents lost; returns them. Only devices that can be lost implement it."""
        raise NotImplementedError(f"{self.name} cannot reconnect")

    def disconnect(self) -> None:
        """Stops waiting on the device's peer, if it has one: pending and later calls fail at once."""

    def close(self) -> None:
        """Releases every resource of the backend."""


def dequantize_f32(raw: np.ndarray, qtype: DType, shape: tuple[int, ...]) -> np.ndarray:
    """A float32 copy of a tensor's values from its bytes of `qtype` (any type of
    tensor.WEIGHT_TYPES), for devices that store weights in another type than the file's."""
    rows, k = (int(shape[0]), int(shape[1])) if len(shape) == 2 else (1, int(shape[0]))
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if nbytes_of(qtype, (rows, k)) != data.size:
        raise ValueError(f"{data.size} B are not a {qtype.name} tensor of shape {list(shape)}")
    if qtype == DType.F32:
        return data.view(np.float32).reshape(shape).copy()
    if qtype == DType.F16:
        return data.view(np.float16).astype(np.float32).reshape(shape)
    from .._fast import qmatmul  # noqa: PLC0415 - the kernels' row lookup dequantizes every type
    out = np.empty((rows, k), np.float32)
    qmatmul.get_rows_q(data.reshape(rows, -1), int(qtype), np.arange(rows, dtype=np.int32), out)
    return out.reshape(shape)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bit patterns (uint16), rounded to nearest even (NaN kept NaN)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def lost_devices(backends: Sequence["Backend"]) -> dict[str, str]:
    """Of `backends`, those that cannot be used any more, by name, with why (naming the peer)."""
    lost = {}
    for b in backends:
        why = b.lost()
        if why:
            lost[b.name] = why
    return lost
