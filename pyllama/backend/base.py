"""The Backend: one device as the engine holds it, put together as ggml-backend splits a backend.

- Device (device.py): what it is and what it runs, asked before anything is placed there;
- Buffers (buffer.py): its memory, and blocking reads and writes of tensors;
- Stream (stream.py): a queue of work on it (async I/O, graph compute, events); a Backend is its
  own default stream, and `new_stream()` gives each pipeline group one of its own where the
  device has queues of its own (a GPU); elsewhere the default stream serves every group;
- `layout`, a WeightLayout (layout.py): how a model's weights are stored on it;
- RemoteDevice (remote.py), mixed in by a device of another machine: losing its peer, reconnecting.

The scheduler and the engine never ask what kind of device they hold: a CPU, a CUDA device and a
remote device behind RPC all answer the same calls.
"""
from __future__ import annotations

# the shared vocabulary lives in the bottom module; re-exported for the backends' callers
from ..ir.tensor import NP_DTYPES, Buffer, DType, Tensor, nbytes_of
from .buffer import Buffers
from .device import Device, DeviceInfo
from .layout import WeightLayout
from .stream import Event, Stream

__all__ = ["DType", "Buffer", "Tensor", "DeviceInfo", "Backend", "Event", "nbytes_of", "NP_DTYPES"]


class Backend(Device, Buffers, Stream):
    """One device: its capabilities, its buffers, its weight layout and its default stream."""

    layout: WeightLayout  # each backend sets its own in __init__

    @property
    def backend(self) -> "Backend":
        return self  # as a stream, the backend is its device's default one

    def new_stream(self) -> Stream:
        """A stream for one pipeline group's work on this device. Here the default stream itself,
        which already serves each caller in order (a CPU computes on the calling thread; an RPC
        client keeps each thread's reads apart, and the peer runs a device's commands in arrival
        order); a device with queues of its own (a GPU) gives a new one."""
        return self
