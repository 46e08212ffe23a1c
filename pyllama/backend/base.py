"""The Backend interface: one device, its buffers, tensors as views into them, and graph compute.

It mirrors ggml-backend so that the scheduler and the engine never ask what kind of device they
hold: a CPU, a CUDA device and a remote device behind RPC all answer the same calls.
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as DType

if TYPE_CHECKING:
    from ..graph.ops import Graph

__all__ = ["DType", "Buffer", "Tensor", "DeviceInfo", "Backend", "Event", "nbytes_of", "NP_DTYPES"]

# numpy views exist for the element types that compute touches directly; quantized types are bytes.
NP_DTYPES: dict[DType, np.dtype] = {
    DType.F32: np.dtype(np.float32),
    DType.F16: np.dtype(np.float16),
    DType.I32: np.dtype(np.int32),
}


def nbytes_of(dtype: DType, shape: tuple[int, ...]) -> int:
    """Bytes of a row-major tensor of `shape`; the last dimension is the row (in blocks for quants)."""
    block, type_size = GGML_QUANT_SIZES[dtype]
    n = 1
    for d in shape:
        n *= d
    if shape and shape[-1] % block:
        raise ValueError(f"row of {shape[-1]} is not a whole number of {dtype.name} blocks")
    return n // block * type_size


_buffer_ids = itertools.count(1)


class Buffer:
    """A region of device memory. Backends subclass it to hold their handle."""

    __slots__ = ("backend", "id", "size", "usage", "__weakref__")

    def __init__(self, backend: "Backend", size: int, usage: str):
        self.backend = backend
        self.id = next(_buffer_ids)
        self.size = size
        self.usage = usage

    def __repr__(self) -> str:
        return f"<Buffer {self.id} {self.usage} {self.size} B on {self.backend.name}>"


class Tensor:
    """A typed, shaped view of a buffer region. `buffer` is None until the scheduler places it."""

    __slots__ = ("buffer", "offset", "dtype", "shape", "name", "nbytes")

    def __init__(self, dtype: DType, shape: tuple[int, ...], name: str,
                 buffer: Optional[Buffer] = None, offset: int = 0):
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)
        self.name = name
        self.buffer = buffer
        self.offset = offset
        self.nbytes = nbytes_of(dtype, self.shape)

    @property
    def backend(self) -> "Backend":
        assert self.buffer is not None, f"tensor {self.name} is not allocated"
        return self.buffer.backend

    def view(self, shape: tuple[int, ...], name: Optional[str] = None) -> "Tensor":
        """The same bytes under another shape (row-major reinterpretation, same element count)."""
        t = Tensor(self.dtype, shape, name or self.name, self.buffer, self.offset)
        if t.nbytes != self.nbytes:
            raise ValueError(f"view {shape} of {self.name}{self.shape} changes the size")
        return t

    def __repr__(self) -> str:
        where = f"buf{self.buffer.id}+{self.offset}" if self.buffer else "unallocated"
        return f"<Tensor {self.name} {self.dtype.name}{list(self.shape)} {where}>"


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

    # the types a graph may give as a weight (MUL_MAT's matrix, GET_ROWS's table): the rpc server
    # accepts exactly these from a client
    weight_types: frozenset = frozenset({DType.F32})

    def weight_dtype(self, file_dtype: DType) -> DType:
        """The type this backend stores a weight of `file_dtype` in (it may convert at load)."""
        return file_dtype

    def set_weight(self, tensor: Tensor, offset: int, file_dtype: DType, raw: np.ndarray) -> None:
        """Writes one file tensor (`raw`: its bytes, of type `file_dtype`) into `tensor` (of this
        backend's weight_dtype) starting `offset` bytes in, converting on the way. Called when the
        two types differ and are not F32; a device that converts on arrival (CUDA) overrides this,
        the default converts on the host (to F16)."""
        from .._fast.quant import dequantize_to_f32  # noqa: PLC0415
        if tensor.dtype != DType.F16:
            raise ValueError(f"{self.name}: cannot convert {file_dtype.name} weights to {tensor.dtype.name} on the host")
        block, type_size = GGML_QUANT_SIZES[file_dtype]
        values = dequantize_to_f32(np.ascontiguousarray(raw).reshape(-1).view(np.uint8), int(file_dtype),
                                   (raw.size // type_size * block,))
        self.set_tensor(tensor, values.astype(np.float16), offset)

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


def lost_devices(backends: Sequence["Backend"]) -> dict[str, str]:
    """Of `backends`, those that cannot be used any more, by name, with why (naming the peer)."""
    lost = {}
    for b in backends:
        why = b.lost()
        if why:
            lost[b.name] = why
    return lost
