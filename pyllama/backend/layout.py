"""How a device lays out a model's weights: a strategy object per device (`Backend.layout`).

The loader (models/weights.py) asks it which type each weight is stored in, whether the parts of a
fused weight (q|k|v, gate|up) are stored as one, whether the file's memory map can serve in place,
how a weight of another type is converted on its way in, and, once the weights are written, lets
it make its own copies (the CPU's repacked rows) or drop them when a layer moves away. This plain
layout stores the file's types as they are, fuses, maps nothing and converts on the host; the CPU's
repacking layout and the CUDA device's converting layout refine it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from ..ir.tensor import Buffer, DType, Tensor, nbytes_of

if TYPE_CHECKING:
    from .base import Backend

__all__ = ["WeightLayout", "dequantize_f32", "f32_to_bf16"]


class WeightLayout:
    """The weight layout of one device (`backend`)."""

    def __init__(self, backend: "Backend"):
        self.backend = backend

    def weight_dtype(self, file_dtype: DType) -> DType:
        """The type this device stores a weight of `file_dtype` in (it may convert at load)."""
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
        device's weight_dtype) starting `offset` bytes in, converting on the way. Called when the
        two types differ and are not F32; a device that converts on arrival (CUDA) overrides this,
        the default converts on the host (to F16 or BF16)."""
        if tensor.dtype not in (DType.F16, DType.BF16):
            raise ValueError(f"{self.backend.name}: cannot convert {file_dtype.name} weights to {tensor.dtype.name} "
                             "on the host")
        row = tensor.shape[-1]
        values = dequantize_f32(raw, file_dtype, (raw.size // nbytes_of(file_dtype, (row,)), row))
        self.backend.set_tensor(tensor, values.astype(np.float16) if tensor.dtype == DType.F16 else f32_to_bf16(values),
                                offset)


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
