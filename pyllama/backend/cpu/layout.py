"""The CPU's weight layout: weights stay in the file's type, read in place from its memory map
where a weight is one file tensor, and quantized ones are also repacked in groups of 8 rows.

Q4_0, Q8_0, Q4_K, Q5_K and Q6_K weights with a multiple of 8 rows are repacked in groups of 8 rows
(`_fast/csrc/ggml_x8.h`) once loaded (`prepare_weights`; an rpc server's on the first graph that
multiplies by them); the products then run on that copy, and the loader lets the file's pages of
a weight read in place go (the bytes stay in the file layout for row lookups and reads, which
page them in again). A weight in an allocated buffer (an rpc server's) is then held twice.
--no-repack (`repack = False`) or PYLLAMA_CPU_REPACK=0 (the backend's settings) turn repacking off.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from ..._fast import qmatmul
from ...ir.tensor import Buffer, DType, Tensor
from ..layout import WeightLayout
from . import memory

if TYPE_CHECKING:
    from .backend import CPUBackend

__all__ = ["RepackingLayout"]

_REPACK_RESERVE = 512 << 20  # free memory an extra repacked copy must leave (or a tenth of the total)
_X8_TYPES = frozenset(DType(t) for t in qmatmul.x8_types())


class RepackingLayout(WeightLayout):
    """The CPU's layout (module docstring); the repacked copies are made, found and dropped here."""

    backend: "CPUBackend"

    def __init__(self, backend: "CPUBackend"):
        super().__init__(backend)
        self.repack = backend.settings.repack
        # weights repacked in groups of 8 rows: id(buffer) -> (the buffer, {(offset, nbytes, type,
        # shape): packed array}); the buffer is kept so that its id cannot be reused by another while
        # listed. Every view of one weight shares its copy; the same bytes as another type or shape
        # are another weight (their copy is laid out otherwise)
        self._packed: dict[int, tuple[Buffer, dict[tuple, np.ndarray]]] = {}
        self._repack_short = False  # a weight went unrepacked for want of memory (logged once)
        self._charged: dict[int, int] = {}  # id(repacked copy) -> bytes reserved for it (backend.budget)

    def weight_dtype(self, file_dtype: DType) -> DType:
        # every type the kernels take stays as the file stores it; anything else (no model file
        # gets here: Model refuses types outside tensor.WEIGHT_TYPES) would be computed in F32
        return file_dtype if file_dtype in self.backend.weight_types else DType.F32

    def map_host(self, data: np.ndarray, usage: str = "weights") -> Buffer:
        """A buffer over host bytes the caller keeps alive (a model file's memory map): weights
        placed in it are read where they lie, never copied. Read-only if `data` is."""
        from .backend import CPUBuffer  # noqa: PLC0415 - the backend module imports this one
        return CPUBuffer(self.backend, data.size, usage, data.reshape(-1).view(np.uint8))

    def prepare_weights(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        return [t for t in tensors if self.packed(t) is not None]

    def drop_weights(self, tensors: Sequence[Tensor]) -> None:
        for t in tensors:
            if t.buffer is not None:
                self.forget(t.buffer, t.offset, t.offset + t.nbytes)

    def fuses(self, dtype: DType) -> bool:
        # a repacked weight would be held twice if fused (the fused copy and its repacked copy);
        # apart, each part is read in place from the file and MUL_MAT_CAT quantizes x once
        return not (self.repack and dtype in _X8_TYPES)

    def packed(self, t: Tensor) -> Optional[np.ndarray]:
        """The repacked copy of weight `t` for the products (made on first use), or None when
        its type or row count has no repacked kernel. A Mixture-of-Experts tensor [experts, rows,
        cols] is repacked as its experts' rows one after the other ([experts, rows / 8 groups])."""
        if not self.repack or t.dtype not in _X8_TYPES or len(t.shape) not in (2, 3) or t.shape[-2] % 8:
            return None
        per_buf = self._packed.setdefault(id(t.buffer), (t.buffer, {}))[1]  # type: ignore[arg-type]
        key = (t.offset, t.nbytes, int(t.dtype), tuple(t.shape))
        packed = per_buf.get(key)
        if packed is None:
            budget = self.backend.budget
            # an rpc server's upload stays where it is; a model's experts, unlike a dense weight, are
            # not all in memory until repacked (the unchosen ones are never paged in): both need room
            if (not t.buffer.mapped or len(t.shape) == 3) and not self._room_for(t):  # type: ignore[union-attr]
                return None
            if budget is not None:
                try:
                    budget.reserve(t.nbytes, f"repacked copy of {t.name}")
                except MemoryError as exc:
                    self._short_of_memory(t, str(exc))
                    return None
            try:
                rows = int(np.prod(t.shape[:-1]))  # an expert's groups of 8 never reach into the next
                packed = qmatmul.repack_x8(self.backend.bytes_of(t).reshape(rows, -1), int(t.dtype), t.shape[-1])
            except BaseException:
                if budget is not None:
                    budget.release(t.nbytes)
                raise
            if len(t.shape) == 3:
                packed = packed.reshape(t.shape[0], -1)
            per_buf[key] = packed
            if budget is not None:
                self._charged[id(packed)] = t.nbytes
        return packed

    def _short_of_memory(self, t: Tensor, why: str) -> None:
        if not self._repack_short:
            self._repack_short = True
            logging.getLogger(__name__).warning(
                "%s: %s; %s and later weights that do not fit run on the file's layout", self.backend.name, why, t.name)

    def _room_for(self, t: Tensor) -> bool:
        """Whether a repacked copy of weight `t` fits (an rpc server's upload stays where it is, and
        a model's experts are not all in memory until repacked, so the copy is extra memory): not
        when it would leave less than a tenth of the machine's memory (at least 512 MiB) free; the
        weight then runs on the file layout, logged once. A server that holds a model too large for
        one machine stays within its memory."""
        if memory.available_memory() - t.nbytes >= max(_REPACK_RESERVE, memory.total_memory() // 10):
            return True
        if not self._repack_short:
            self._repack_short = True
            logging.getLogger(__name__).warning(
                "%s: not enough free memory to repack %s and later weights into groups of 8 rows (%.0f MiB "
                "free); they run on the file's layout", self.backend.name, t.name, memory.available_memory() / 2**20)
        return False

    def forget(self, buffer: Buffer, start: int, end: int) -> None:
        """Bytes [start, end) of `buffer` change: repacked copies of weights there are stale, and
        so are the backend's plans bound to them."""
        entry = self._packed.get(id(buffer))
        if not entry or not entry[1]:
            return
        per_buf = entry[1]
        stale = [key for key in list(per_buf) if key[0] < end and start < key[0] + key[1]]  # a snapshot: a compute may add one
        if not stale:
            return
        budget = self.backend.budget
        for key in stale:
            packed = per_buf.pop(key, None)
            charged = self._charged.pop(id(packed), 0) if packed is not None else 0
            if charged and budget is not None:
                budget.release(charged)
        self.backend.forget_plans()

    def forget_buffer(self, buffer: Buffer) -> None:
        """`buffer` is freed: its repacked copies go with it."""
        self.forget(buffer, 0, buffer.size)
        self._packed.pop(id(buffer), None)

    def holds_copies(self) -> bool:
        """Whether any weight has a repacked copy listed (a write may make one stale)."""
        return bool(self._packed)

    def packed_weights(self, buffer: Optional[Buffer] = None) -> int:
        """How many weights (of `buffer`, or of every buffer) have a repacked copy."""
        entries = [self._packed.get(id(buffer))] if buffer is not None else list(self._packed.values())
        return sum(len(e[1]) for e in entries if e)
