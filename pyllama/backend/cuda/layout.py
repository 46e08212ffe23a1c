"""The CUDA device's weight layout: every matrix converted at load into one half-precision type
(F16, or BF16 with PYLLAMA_CUDA_WEIGHTS=bf16), so every MUL_MAT is one cuBLAS GEMM; F32 tensors
(norms, biases) stay F32. The block types cuda_src/dequant.cu converts (DEQUANT_KERNELS) go up as
the file stores them and are converted on the device; the others are converted on the host."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...ir.tensor import DType, Tensor
from ..layout import WeightLayout
from ...util.settings import current

if TYPE_CHECKING:
    from .backend import CUDABackend

__all__ = ["ConvertingLayout", "DEQUANT_KERNELS"]

_SRC_NAMES = {DType.Q8_0: "q8_0", DType.Q4_0: "q4_0", DType.Q4_K: "q4_k", DType.Q5_K: "q5_k",
              DType.Q6_K: "q6_k", DType.F16: "f16", DType.BF16: "bf16", DType.F32: "f32"}
_DST_NAMES = {DType.F16: "f16", DType.BF16: "bf16"}
# (file type, device type) -> the load-time conversion kernel
DEQUANT_KERNELS: dict[tuple[DType, DType], str] = {
    (src, dst): f"dequant_{s}_{d}" for src, s in _SRC_NAMES.items() for dst, d in _DST_NAMES.items() if src != dst
}


class ConvertingLayout(WeightLayout):
    """CUDA's layout (module docstring)."""

    backend: "CUDABackend"

    def __init__(self, backend: "CUDABackend"):
        super().__init__(backend)
        self.half = DType.BF16 if current().cuda.weights == "bf16" else DType.F16

    def weight_dtype(self, file_dtype: DType) -> DType:
        # norms and biases are F32 in every file and stay F32; every matrix type becomes the half type
        return DType.F32 if file_dtype == DType.F32 else self.half

    def set_weight(self, tensor: Tensor, offset: int, file_dtype: DType, raw: np.ndarray) -> None:
        kname = DEQUANT_KERNELS.get((file_dtype, tensor.dtype))
        if kname is None:  # a type cuda_src/dequant.cu lacks (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K): on the host
            super().set_weight(tensor, offset, file_dtype, raw)
            return
        self.backend.convert_weight(tensor, offset, file_dtype, raw, kname)
