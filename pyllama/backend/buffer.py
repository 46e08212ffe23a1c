"""A device's memory: buffers, and the blocking reads and writes of tensors in them.

Tensors are views (buffer, offset, dtype, shape, name) of a Buffer (ir.tensor); a device
subclasses Buffer to hold its handle. Blocking calls complete before they return.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import numpy as np

from ..ir.tensor import Buffer, Tensor

__all__ = ["Buffers"]


class Buffers(ABC):
    """Allocation of a device's buffers and blocking I/O of their tensors."""

    @abstractmethod
    def alloc_buffer(self, size: int, usage: str = "compute") -> Buffer: ...

    @abstractmethod
    def free_buffer(self, buffer: Buffer) -> None: ...

    @abstractmethod
    def clear_buffer(self, buffer: Buffer, value: int = 0) -> None: ...

    @abstractmethod
    def set_tensor(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        """Writes the bytes of `data` into the tensor starting `offset` bytes in."""

    @abstractmethod
    def get_tensor(self, tensor: Tensor, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Reads the tensor; into `out` (a C-contiguous array of the same byte size) when given."""

    def host_array(self, tensor: Tensor) -> Optional[np.ndarray]:
        """A numpy view of the tensor when its bytes live in this host's memory (a CPU device),
        so a copy to another device can read them in place; None otherwise."""
        return None
