"""One NVIDIA GPU as a device (backend.py), through PyCUDA; cuBLAS through ctypes (cublas.py); the
ahead-of-time build of cuda_src/ into kernels/ (build.py). Importing it never needs PyCUDA."""
from .backend import (DEQUANT_KERNELS, MODULES, OP_KERNELS, CUDABackend, CUDABuffer, CUDAStream, CUDAUnavailable,
                      device_count, kernel_dir, open_backend)

__all__ = ["CUDABackend", "CUDABuffer", "CUDAStream", "CUDAUnavailable", "DEQUANT_KERNELS", "MODULES", "OP_KERNELS",
           "device_count", "kernel_dir", "open_backend"]
