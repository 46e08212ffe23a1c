"""A stream: one queue of work on a device (ggml-backend's backend proper): asynchronous tensor
I/O, graph compute, events, and a GPU's trace marks.

Work queued on a stream completes in order; *_async calls and graph_compute may return before
their work is done, synchronize() waits for all of it. A device that completes work as it is
submitted (a CPU) keeps nothing queued, so synchronize and events are trivial there.

A Backend is its device's default stream; `Backend.new_stream()` gives a pipeline group a stream of
its own (each Context's scheduler holds one per device). A GPU makes it a queue of its own; a device
whose default stream already keeps its callers apart gives that stream.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..ir.tensor import Graph, Tensor

if TYPE_CHECKING:
    from .base import Backend

__all__ = ["Event", "Stream"]


class Event:
    """A point in a stream's work. Streams that complete work at submission keep nothing here."""

    def __init__(self, stream: "Stream"):
        self.stream = stream
        self.handle: Any = None


class Stream(ABC):
    """A queue of work on one device (`backend`)."""

    @property
    @abstractmethod
    def backend(self) -> "Backend":
        """The device this stream's work runs on."""

    # --- data --------------------------------------------------------------------------------
    def set_tensor_async(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        self.backend.set_tensor(tensor, data, offset)

    def get_tensor_async(self, tensor: Tensor, out: np.ndarray) -> None:
        self.backend.get_tensor(tensor, out)

    def stage_read(self, tensor: Tensor) -> Any:
        """A staging region (with `.view`, a uint8 array, and `.release()`) for reading `tensor`
        out of this device on its way to another, or None: the caller then uses the host bytes
        its plan set aside. Devices with a staging arena of their own (RPC) override this."""
        return None

    def cpy_tensor_async(self, src: Tensor, dst: Tensor) -> bool:
        """Copies src (on any backend) into dst (on this one) if this backend knows how; else False."""
        return False

    def cpy_tensor_from_async(self, src: Tensor, dst: Tensor) -> bool:
        """Source-side copy, for backends built for that role; others decline."""
        return False

    # --- compute -----------------------------------------------------------------------------
    @abstractmethod
    def graph_compute(self, graph: Graph, reads: Sequence[tuple[Tensor, np.ndarray]] = ()) -> None:
        """Runs a graph whose tensors all live on this stream's device. May return before
        completion. `reads`: tensors to read back into host arrays right after the graph, as part
        of it; they are complete after synchronize()."""

    def synchronize(self) -> None:
        """Waits for every queued operation."""

    def forget_graph(self, uid: int) -> None:
        """Drops whatever is kept for a graph that will not be seen again."""

    # --- events ------------------------------------------------------------------------------
    def event_new(self) -> Event:
        return Event(self)

    def event_record(self, event: Event) -> None:
        """Marks the current end of this stream's queued work."""

    def event_wait(self, event: Event) -> None:
        """Makes later work on this stream wait for `event` (recorded on any stream)."""
        event.stream.event_synchronize(event)

    def event_synchronize(self, event: Event) -> None:
        """Blocks the host until `event` completed."""

    # --- tracing (GPU streams only) ----------------------------------------------------------
    def trace_mark(self) -> None:
        return None

    def trace_poll(self) -> list[dict[str, Any]]:
        return []

    def release(self) -> None:
        """Gives back what the stream holds on its device; it is not used again."""
