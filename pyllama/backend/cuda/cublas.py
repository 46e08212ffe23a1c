"""cuBLAS through ctypes: the GEMM behind the CUDA backend's MUL_MAT.

Only what MUL_MAT needs: a handle per stream and cublasGemmEx with half-precision (F16 or BF16)
or float32 inputs, float32 output and float32 compute. ctypes releases the GIL around each call.
The library is found as $PYLLAMA_CUBLAS, in the pip wheel of cuBLAS (nvidia-cublas-*), by its
soname, or under $CUDA_HOME / $CUDA_PATH / /usr/local/cuda.
"""
from __future__ import annotations

import ctypes
import glob
import os
from typing import Iterator

from ...util.settings import current

CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
# cudaDataType
CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14
# cublasComputeType_t: float32 accumulation without TF32 (the default math mode)
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1


class CuBLASError(RuntimeError):
    pass


def _candidates() -> Iterator[str]:
    cuda = current().cuda
    if cuda.cublas:
        yield cuda.cublas
    try:
        import nvidia.cublas as wheel  # noqa: PLC0415 - the pip wheel, when installed
        for root in wheel.__path__:
            yield from sorted(glob.glob(os.path.join(root, "lib", "libcublas.so*")), reverse=True)
    except ImportError:
        pass
    for name in ("libcublas.so", "libcublas.so.13", "libcublas.so.12", "libcublas.so.11"):
        yield name
    for root in (*cuda.toolkit, "/usr/local/cuda"):
        if root:
            for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                        os.path.join("targets", "sbsa-linux", "lib")):
                yield from sorted(glob.glob(os.path.join(root, sub, "libcublas.so*")), reverse=True)


def load_library() -> ctypes.CDLL:
    """The cuBLAS shared library; OSError naming what was tried when none loads."""
    tried = []
    for cand in _candidates():
        try:
            return ctypes.CDLL(cand)
        except OSError as exc:
            tried.append(f"{cand} ({exc})" if os.path.sep in cand else cand)
    raise OSError("libcublas not found (tried " + ", ".join(tried[:6]) + (", ..." if len(tried) > 6 else "") +
                  "); set PYLLAMA_CUBLAS to its path")


class CuBLAS:
    """The few cuBLAS entry points the backend calls, with their ctypes signatures."""

    def __init__(self, lib: ctypes.CDLL | None = None):
        self.lib = lib or load_library()
        vp, i = ctypes.c_void_p, ctypes.c_int
        self._create = self.lib.cublasCreate_v2
        self._create.argtypes = [ctypes.POINTER(vp)]
        self._create.restype = i
        self._destroy = self.lib.cublasDestroy_v2
        self._destroy.argtypes = [vp]
        self._destroy.restype = i
        self._set_stream = self.lib.cublasSetStream_v2
        self._set_stream.argtypes = [vp, vp]
        self._set_stream.restype = i
        self.gemm_ex = self.lib.cublasGemmEx
        self.gemm_ex.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        self.gemm_ex.restype = i
        # alpha = 1, beta = 0 as float32 (the scale type of CUBLAS_COMPUTE_32F); host pointer mode
        self.one = ctypes.c_float(1.0)
        self.zero = ctypes.c_float(0.0)
        self.p_one = ctypes.cast(ctypes.pointer(self.one), vp)
        self.p_zero = ctypes.cast(ctypes.pointer(self.zero), vp)

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise CuBLASError(f"{what} failed with cuBLAS status {status}")

    def create(self, stream_handle: int) -> ctypes.c_void_p:
        """A handle whose work goes to `stream_handle` (a CUstream as an int). Call with the
        device's context current."""
        handle = ctypes.c_void_p()
        self.check(self._create(ctypes.byref(handle)), "cublasCreate")
        self.check(self._set_stream(handle, ctypes.c_void_p(stream_handle)), "cublasSetStream")
        return handle

    def destroy(self, handle: ctypes.c_void_p) -> None:
        self._destroy(handle)

    def gemm_args(self, handle: ctypes.c_void_p, n: int, m: int, k: int, w: int, w_type: int, x: int,
                  x_type: int, out: int) -> tuple:
        """Arguments of cublasGemmEx for row-major out[n, m] = x[n, k] @ w[m, k].T.

        cuBLAS is column-major. Read column-major, the row-major buffers are A = w as a k x m
        matrix (lda k), B = x as k x n (ldb k) and C = out as m x n (ldc m), and C = A^T B is
        exactly out = x @ w.T."""
        return (handle, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, self.p_one, w, w_type, k, x, x_type, k, self.p_zero,
                out, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)

    def gemm(self, args: tuple) -> None:
        self.check(self.gemm_ex(*args), "cublasGemmEx")
