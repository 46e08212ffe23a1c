"""Cython kernels: sampling, quantization, the CPU ops. Each releases the GIL while it computes.

The package (`pyllama/__init__.py`) makes idle OpenMP and BLAS workers sleep before these load."""
