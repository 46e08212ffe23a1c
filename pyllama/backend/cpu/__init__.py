"""The host's CPU as a device (backend.py): numpy buffers, the Cython kernels of pyllama._fast."""
from .backend import CPU_WEIGHT_TYPES, CPUBackend, CPUBuffer, set_compute_threads

__all__ = ["CPU_WEIGHT_TYPES", "CPUBackend", "CPUBuffer", "set_compute_threads"]
