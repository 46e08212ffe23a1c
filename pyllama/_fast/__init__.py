"""Cython kernels: sampling, quantization, the CPU ops. Each releases the GIL while it computes."""
import os

# OpenMP threads that spin after a parallel region steal the cores BLAS's own threads need next
# (on a 2-core machine a decode step slowed 10x). Sleeping is the right default for us; a user
# who sets the variable keeps their choice. Must be set before libgomp loads with the first kernel.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
